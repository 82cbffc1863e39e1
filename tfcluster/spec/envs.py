"""The spec's environment: `env`, `secret_env` and `public_env`, and the rule that no
script argument carries a secret env value (arguments are visible in `ps` on every host).

Which names are secret is model.is_secret (docs/design/spec-safety.md, "Spec safety").
"""
from __future__ import annotations

import math
import re

import yaml

from tfcluster.errors import did_you_mean
from tfcluster.spec.model import MAX_ARG_BYTES, MAX_ENV_BYTES, MAX_ENV_ENTRIES, MIN_SECRET_CHARS, SECRET_MARKERS
from tfcluster.spec.yamltree import (
    AnyKey,
    BadValue,
    as_list,
    as_str,
    fields_of,
    is_null,
    kind_of,
    line_of,
    sub_field,
)

_ENV_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# What tfcluster sets in each task's environment (plan.py, session.py, the shim): a value in
# `env:` would be overridden without a word. TFCLUSTER_STDOUT_FLUSH and TFCLUSTER_SERVER_IMPORT
# are knobs `env:` may set.
_PER_TASK = {"CLUSTER", "JOB", "TASK_INDEX", "IS_CHIEF", "NUM_WORKERS", "MASTER", "RUN_ID", "JOB_ID",
             "RESTART", "HOLD", "PROBE"}


def _reserved(name: str) -> str | None:
    """Why tfcluster cannot take `name` from env: (it sets it per task), or None."""
    if name == "TF_CONFIG":
        return "tfcluster writes each task's TF_CONFIG from jobs:"
    if name == "CUDA_VISIBLE_DEVICES":
        return "tfcluster gives each task its GPUs (hosts[].gpus, jobs.<job>.per_gpu); a ps gets none"
    if name.startswith("TFCLUSTER_") and name[len("TFCLUSTER_"):] in _PER_TASK:
        return f"tfcluster sets {name} for each task"
    return None


def _knob_problem(name: str, value: str) -> tuple[str, str] | None:
    """(problem, hint) where `value` is no value the knob `name` reads, else None: the host
    would fall back in silence (a flush of 0, the lean import) or fail at the move (a standby's
    import of a module name that cannot be one)."""
    if name == "TFCLUSTER_STDOUT_FLUSH":
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not 0 <= seconds < math.inf:      # NaN too
            return (f"must be seconds (a number, 0 or more), got {value!r}",
                    "e.g. 0.01 (the default); 0 turns the timed flush off")
    if name == "TFCLUSTER_SERVER_IMPORT" and value not in ("lean", "full"):
        return f"must be lean or full, got {value!r}", "lean (the default) imports only TensorFlow's runtime"
    if name == "TFCLUSTER_STANDBY_IMPORT" and not all(
            part and all(w.isidentifier() for w in part.split(".")) for part in value.split(",")):
        return (f"must be module names, comma-separated, got {value!r}",
                "e.g. tensorflow,keras (what a warm spare's standby imports before its task comes)")
    return None


def _size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def parse_env(node: yaml.Node, line: int) -> tuple[tuple[str, str], ...]:
    """env: (name, value) pairs in file order; `line`: the line of the `env:` key."""
    found = fields_of(node, "env", AnyKey())
    if len(found) > MAX_ENV_ENTRIES:
        raise BadValue(line, "env", f"{len(found)} entries; at most {MAX_ENV_ENTRIES}")
    pairs, total = [], 0
    for key, (key_node, value) in found.items():
        if not _ENV_RE.fullmatch(key):
            raise BadValue(line_of(key_node), sub_field("env", key), "invalid variable name",
                       hint="letters, digits and '_', not starting with a digit")
        why = _reserved(key)
        if why:
            raise BadValue(line_of(key_node), sub_field("env", key), f"{key} is set by tfcluster for each task", hint=why)
        if not isinstance(value, yaml.ScalarNode) or is_null(value):
            raise BadValue(line_of(value), sub_field("env", key), f"value must be a string, got {kind_of(value)}",
                       hint=f'quote it: {key}: "..."')
        knob = _knob_problem(key, value.value)
        if knob:
            raise BadValue(line_of(value), sub_field("env", key), knob[0], hint=knob[1])
        if "\0" in value.value:
            raise BadValue(line_of(value), sub_field("env", key), "value must not contain NUL")
        size = _size(key) + 1 + _size(value.value)
        if size > MAX_ARG_BYTES:
            raise BadValue(line_of(value), sub_field("env", key),
                       f"{key}=VALUE is {size} bytes; one environment string may be at most "
                       f"{MAX_ARG_BYTES} (execve's MAX_ARG_STRLEN)")
        total += size
        pairs.append((key, value.value))
    if total > MAX_ENV_BYTES:
        raise BadValue(line, "env", f"{total} bytes in all; at most {MAX_ENV_BYTES}",
                   hint="put large values in a file shipped with train.files")
    return tuple(pairs)


def parse_names(node: yaml.Node, field: str, env: tuple[tuple[str, str], ...],
                other: tuple[str, ...] = ()) -> tuple[str, ...]:
    """secret_env / public_env: names set in env:. `other`: secret_env, when reading public_env."""
    names = [k for k, _ in env]
    out: list[str] = []
    for i, item in enumerate(as_list(node, field)):
        name = as_str(item, sub_field(field, i))
        if name not in names:
            raise BadValue(line_of(item), sub_field(field, i), f"{name!r} is not set in env" + did_you_mean(name, names))
        if name in other:
            raise BadValue(line_of(item), sub_field(field, i), f"{name} is also listed in secret_env")
        if field == "public_env" and not any(m in name.upper() for m in SECRET_MARKERS):
            raise BadValue(line_of(item), sub_field(field, i),
                       f"{name} is shown anyway: public_env only un-marks names containing "
                       f"{', '.join(SECRET_MARKERS)}")
        if name not in out:
            out.append(name)
    return tuple(out)


def secret_in(arg: str, secrets: tuple[tuple[str, str], ...]) -> str | None:
    """The name of the first secret env entry whose value (MIN_SECRET_CHARS or longer) `arg`
    contains, or None."""
    return next((name for name, value in secrets
                 if len(value) >= MIN_SECRET_CHARS and value in arg), None)


def secret_problem(name: str) -> tuple[str, str]:
    """(problem, hint) for an argument that carries the value of secret env `name`."""
    return (f"contains the value of secret env {name}; script arguments are visible in `ps` "
            "on every host",
            f"read it in the script from the environment (os.environ[{name!r}]); if {name} is "
            "not secret, list it in public_env")
