"""The spec's entry points: load a file, check the files it ships, apply command-line overrides."""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import replace

from tfcluster.errors import SpecError, UsageError
from tfcluster.spec.layout import check_conflicts, check_loopback_mix, check_mode, layout_tasks
from tfcluster.spec.limits import check_args, check_plan_size, check_tensorboard
from tfcluster.spec.model import Spec
from tfcluster.spec.schema import build, check_placeholders
from tfcluster.spec.shipped import Shipped, ship_list
from tfcluster.spec.yamltree import BadValue, compose, decode, one_line, read_text, spec_error


def load_spec(path: str) -> Spec:
    """Read, parse and validate the spec at `path`; SpecError (one line) for any problem.

    Whether train.script and train.files exist is not checked here (see check_train_files):
    commands that never ship them must work after a script moved.
    """
    try:
        data = read_text(path)
        spec, lines = build(path, compose(decode(data)))
        check_args(spec)
        check_tensorboard(spec)
    except BadValue as bad:
        raise spec_error(path, bad.line, bad.field, bad.problem, bad.hint) from None
    spec = replace(spec, digest=hashlib.sha256(data).hexdigest())
    slots = layout_tasks(spec)
    check_conflicts(spec, slots)
    check_loopback_mix(spec, slots)
    check_mode(spec, slots, lines["jobs"])
    try:
        check_plan_size(spec, slots, lines["jobs"], lines["env"])
    except BadValue as bad:
        raise spec_error(path, bad.line, bad.field, bad.problem, bad.hint) from None
    return spec


def check_train_files(spec: Spec) -> Shipped:
    """Every file a run of `spec` ships, script first, as (local path, path in the run
    directory, bytes); SpecError (one line) for a file that is missing, outside the spec's
    directory and train.allow_outside, not a regular file or directory, or over a limit.

    For commands that ship them (train), before anything connects: load_spec does not look
    at files, so commands that never ship them work after a script moved.
    """
    try:
        return ship_list(spec)
    except BadValue as bad:
        raise spec_error(spec.path, bad.line, bad.field, bad.problem, bad.hint) from None


def preview_train_files(spec: Spec) -> tuple[Shipped, str | None]:
    """check_train_files for `plan`, which shows what would ship and never fails on it:
    (the files, None), or ((), why train would refuse them)."""
    if not spec.train.script:
        return (), f"{spec.path}: train.script is not set: there is no script to run (or pass `train --script`)"
    try:
        return check_train_files(spec), None
    except SpecError as exc:
        return (), exc.message


def with_train_overrides(spec: Spec, *, script: str | None = None, args: list[str] | None = None,
                         timeout: float | None = None, tensorboard: str | None = None) -> Spec:
    """The spec with the command line's train.script / train.args / train.timeout /
    train.tensorboard.

    Checked by the loader's rules; UsageError (one line) for a bad value. An empty `args`
    overrides nothing, as the command line gives one when no `-- ARGS` were passed.
    """
    changes: dict = {}
    if script is not None:
        if not os.path.isfile(script):
            raise UsageError(one_line(f"--script: no such file: {script}"))
        # no longer the spec's script: check_train_files must not look for that one
        changes.update(script=os.path.abspath(script), script_source=None, script_line=0)
    if args:
        for i, arg in enumerate(args):
            try:
                check_placeholders(arg, 0, "")
            except BadValue as bad:
                raise UsageError(one_line(f"script argument {i + 1} ({arg!r}): {bad.problem}"),
                                 hint=bad.hint) from None
        changes.update(args=tuple(args), args_line=0, args_lines=())
    if timeout is not None:
        if not 0 < timeout < math.inf:   # also refuses NaN, which compares false to everything
            raise UsageError("--timeout must be a positive number of seconds")
        changes["timeout"] = float(timeout)
    if tensorboard is not None:
        if not tensorboard:
            raise UsageError("--tensorboard needs a log directory, got an empty string")
        if "\0" in tensorboard or "\n" in tensorboard:
            raise UsageError(one_line(f"--tensorboard {tensorboard!r}: must not contain NUL or newline"))
        try:
            check_placeholders(tensorboard, 0, "")
        except BadValue as bad:
            raise UsageError(one_line(f"--tensorboard {tensorboard!r}: {bad.problem}"),
                             hint=bad.hint) from None
        changes["tensorboard"] = tensorboard
        changes["tensorboard_line"] = 0
    if not changes:
        return spec
    spec = replace(spec, train=replace(spec.train, **changes))
    if tensorboard is not None:
        try:
            check_tensorboard(spec)
        except BadValue as bad:
            raise UsageError(one_line(f"{bad.field}: {bad.problem}"), hint=bad.hint) from None
    if args:
        try:
            check_args(spec)
            check_plan_size(spec, layout_tasks(spec), 0, 0)
        except BadValue as bad:
            raise UsageError(one_line(f"{bad.field}: {bad.problem}"), hint=bad.hint) from None
    return spec
