"""train.progress: the patterns metrics.py reads a script's step and loss with."""
from __future__ import annotations

import re

import yaml

from tfcluster.spec.model import Progress
from tfcluster.spec.yamltree import BadValue, as_int, as_str, fields_of, line_of

MAX_PATTERN = 500       # characters: a pattern runs on every line of every task


def parse_progress(node: yaml.Node) -> Progress:
    f = fields_of(node, "train.progress", ("step", "loss", "target"))
    found = {k: _pattern(f[k][1], f"train.progress.{k}") for k in ("step", "loss") if k in f}
    if "target" in f:
        found["target"] = as_int(f["target"][1], "train.progress.target", 1, 10**12)
    return Progress(**found)


def _pattern(node: yaml.Node, field: str) -> str:
    value = as_str(node, field)
    if not value or len(value) > MAX_PATTERN:
        raise BadValue(line_of(node), field, f"must be a regular expression of 1 to {MAX_PATTERN} characters")
    try:
        regex = re.compile(value.encode("utf-8"))   # lines are matched as bytes
    except re.error as exc:
        raise BadValue(line_of(node), field, f"invalid regular expression '{value}': {exc}",
                   hint="e.g. 'iter (\\d+)': Python's re syntax, one capturing group") from None
    if regex.groups != 1:
        raise BadValue(line_of(node), field, f"'{value}' has {regex.groups} capturing groups; it needs "
                                       f"exactly one, around the number",
                   hint="write (?:...) for a group that is not the number")
    return value
