"""The spec's entry points: load a file, check the files it ships, apply command-line overrides."""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import replace

from tfcluster.errors import UsageError
from tfcluster.spec.layout import _check_conflicts, _check_loopback_mix, _check_mode, layout_tasks
from tfcluster.spec.model import Spec
from tfcluster.spec.schema import _build, _check_placeholders
from tfcluster.spec.yamltree import _Bad, _compose, _decode, _one_line, _read, _spec_error, _sub


def load_spec(path: str) -> Spec:
    """Read, parse and validate the spec at `path`; SpecError (one line) for any problem.

    Whether train.script and train.files exist is not checked here (see check_train_files):
    commands that never ship them must work after a script moved.
    """
    try:
        data = _read(path)
        spec, jobs_line = _build(path, _compose(_decode(data)))
    except _Bad as bad:
        raise _spec_error(path, bad.line, bad.field, bad.problem, bad.hint) from None
    spec = replace(spec, digest=hashlib.sha256(data).hexdigest())
    slots = layout_tasks(spec)
    _check_conflicts(spec, slots)
    _check_loopback_mix(spec, slots)
    _check_mode(spec, slots, jobs_line)
    return spec


def check_train_files(spec: Spec) -> None:
    """SpecError unless the spec's train.script and every train.files entry exist.

    For commands that ship them (train). A script given on the command line instead
    (with_train_overrides) was checked there and is not checked again; a template
    script ships inside the package and is not checked either.
    """
    train, base_dir = spec.train, spec.base_dir
    source = train.script_source
    if source is not None and not source.startswith("template:"):
        full = os.path.join(base_dir, source)
        if not os.path.isfile(full):
            what = "is a directory, not a file" if os.path.isdir(full) else "file not found"
            raise _spec_error(spec.path, train.script_line, "train.script", f"{what}: {full}",
                              hint="script paths are relative to the spec's directory")
    for i, (value, line) in enumerate(zip(train.files, train.files_lines)):
        if not os.path.exists(os.path.join(base_dir, value)):
            raise _spec_error(spec.path, line, _sub("train.files", i),
                              f"not found: {os.path.join(base_dir, value)}",
                              hint="file paths are relative to the spec's directory")


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
            raise UsageError(_one_line(f"--script: no such file: {script}"))
        # no longer the spec's script: check_train_files must not look for that one
        changes.update(script=os.path.abspath(script), script_source=None, script_line=0)
    if args:
        for i, arg in enumerate(args):
            try:
                _check_placeholders(arg, 0, "")
            except _Bad as bad:
                raise UsageError(_one_line(f"script argument {i + 1} ({arg!r}): {bad.problem}"),
                                 hint=bad.hint) from None
        changes.update(args=tuple(args), args_line=0)
    if timeout is not None:
        if not 0 < timeout < math.inf:   # also refuses NaN, which compares false to everything
            raise UsageError("--timeout must be a positive number of seconds")
        changes["timeout"] = float(timeout)
    if tensorboard is not None:
        if not tensorboard:
            raise UsageError("--tensorboard needs a log directory, got an empty string")
        if "\0" in tensorboard or "\n" in tensorboard:
            raise UsageError(_one_line(f"--tensorboard {tensorboard!r}: must not contain NUL or newline"))
        try:
            _check_placeholders(tensorboard, 0, "")
        except _Bad as bad:
            raise UsageError(_one_line(f"--tensorboard {tensorboard!r}: {bad.problem}"),
                             hint=bad.hint) from None
        changes["tensorboard"] = tensorboard
    if not changes:
        return spec
    return replace(spec, train=replace(spec.train, **changes))
