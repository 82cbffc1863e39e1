"""From a spec file to a checked YAML node tree, and typed scalars read off its nodes.

No schema knowledge lives here: this module knows files, YAML and scalar types (integers,
booleans, durations, names), never which keys a spec has. Problems are raised as `BadValue`
(a line, a field path, a problem and maybe a hint); load_spec adds the file name.
"""
from __future__ import annotations

import difflib
import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence

import yaml

from tfcluster.errors import SpecError
from tfcluster.safetext import escape

MAX_SPEC_BYTES = 1 << 20          # a spec is a page of YAML; anything bigger is a mistake or an attack
MAX_DEPTH = 32                    # the schema nests 5 deep; deeper is junk (and costs stack)

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_INT_RE = re.compile(r"-?[0-9]+")
_DURATION_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smh]?)")
_NULLS = ("", "~", "null", "Null", "NULL")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}

try:  # libyaml is ~10x faster; the pure-Python loader gives the same nodes
    _Loader: type = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    _Loader = yaml.SafeLoader


# --------------------------------------------------------------------------- errors

class BadValue(Exception):
    """Raised deep in the walk without the file name; load_spec adds it."""

    def __init__(self, line: int, field: str, problem: str, hint: str | None = None) -> None:
        super().__init__(problem)
        self.line, self.field, self.problem, self.hint = line, field, problem, hint


def one_line(text: str) -> str:
    # user text (keys, values, paths) lands in the message; it must stay one line
    return escape(text)


def spec_error(path: str, line: int | None, field: str, problem: str,
                hint: str | None = None) -> SpecError:
    where = f"{path}:{line}" if line else path
    head = f"{where}: {field}: " if field else f"{where}: "
    return SpecError(one_line(head + problem), hint=hint)


def line_of(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def sub_field(field: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{field}[{key}]"
    return f"{field}.{key}" if field else key


def _closest(word: str, choices: Sequence[str]) -> str | None:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return close[0] if close else None


def suggest(word: str, choices: Iterable[str], what: str) -> str:
    return unknown(0, "", word, list(choices), what, "").problem


def unknown(line: int, field: str, word: str, choices: Sequence[str], what: str, listed: str) -> BadValue:
    """`word` is none of `choices`: the closest one suggested, with the whole list as the hint
    (`listed` names it); with none close, the list in the error itself, said once."""
    close = _closest(word, choices)
    if close is None:
        return BadValue(line, field, f"unknown {what} {word!r}; expected one of: {', '.join(choices)}")
    return BadValue(line, field, f"unknown {what} {word!r}; did you mean {close!r}?",
                    hint=f"{listed}{', '.join(choices)}")


# --------------------------------------------------------------------------- reading

def read_text(path: str) -> bytes:
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):   # a FIFO or device would block or never end
            raise BadValue(0, "", "not a regular file")
        if st.st_size > MAX_SPEC_BYTES:
            raise BadValue(0, "", f"file is {st.st_size} bytes; a spec may be at most 1 MiB")
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except (OSError, ValueError) as exc:
        raise BadValue(0, "", f"cannot read spec: {getattr(exc, 'strerror', None) or exc}") from None
    if len(data) > MAX_SPEC_BYTES:         # it grew between stat and read
        raise BadValue(0, "", "file is larger than 1 MiB; a spec may be at most 1 MiB")
    return data


def decode(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise BadValue(line, "spec", f"not UTF-8 text (byte 0x{data[exc.start]:02x})") from None


def _yaml_problem(exc: yaml.YAMLError, text: str) -> BadValue:
    if isinstance(exc, yaml.reader.ReaderError):
        # libyaml reports a byte offset, pure PyYAML a character offset; both are near enough
        line = text.encode("utf-8", "replace").count(b"\n", 0, max(exc.position, 0)) + 1
        return BadValue(line, "yaml", exc.reason)
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    problem = f"{problem} ({context})" if context else problem
    lines = text.splitlines()
    if mark and mark.line < len(lines) and "\t" in lines[mark.line][:mark.column + 1]:
        return BadValue(mark.line + 1, "yaml", f"a tab character; YAML indents with spaces only ({problem})",
                    hint="replace the tabs on that line with spaces")
    if mark and mark.line < len(lines) and _BARE_IPV6.search(lines[mark.line]):
        # inside `{...}` a colon ends a key: `address: ::1` there is no value YAML can read
        return BadValue(mark.line + 1, "yaml", problem, hint="quote an IPv6 address: address: '::1'")
    if mark and mark.line < len(lines) and _BARE_PLACEHOLDER.search(lines[mark.line]):
        return BadValue(mark.line + 1, "yaml", problem, hint=PLACEHOLDER_HINT)
    return BadValue(mark.line + 1 if mark else 1, "yaml", problem)


_BARE_IPV6 = re.compile(r"""(?<!['"\w])[0-9A-Fa-f]*::[0-9A-Fa-f:.]*(?!['"])""")
# `{workdir}/tb` unquoted: YAML reads a `{` that starts a value as a mapping
_BARE_PLACEHOLDER = re.compile(r"""(?:^|[\s,\[:])\{\w+\}""")
PLACEHOLDER_HINT = "quote a value with a placeholder: YAML reads a bare {...} as a mapping: '{workdir}/tb'"


def compose(text: str) -> yaml.Node:
    try:
        root = _tree(yaml.parse(text, Loader=_Loader))
    except yaml.YAMLError as exc:
        raise _yaml_problem(exc, text) from None
    if root is None:
        raise BadValue(1, "spec", "file is empty; expected a mapping with name, hosts and jobs")
    return root


def _tree(events: Iterable[yaml.Event]) -> yaml.Node | None:
    """yaml.compose's node tree, built in one streaming pass over the parser's events.

    Not yaml.compose itself: libyaml's composer recurses in C (a deep `[[[[` kills the
    interpreter), the pure-Python one takes seconds on a 1 MiB file, and both expand
    aliases. Here aliases, anchors and tags are refused as they stream by (a billion-laughs
    file stops at its first anchor) and nesting is capped. No implicit typing is done:
    nodes keep the text as written and its style.
    """
    root: yaml.Node | None = None
    stack: list[yaml.Node] = []            # open collections, innermost last
    keys: list[yaml.Node | None] = []      # per open collection: a mapping key awaiting its value
    for event in events:
        _refuse(event, len(stack), root)
        if isinstance(event, yaml.CollectionEndEvent):
            stack.pop()
            keys.pop()
            continue
        node = _node(event)
        if node is None:
            continue
        if stack:
            _attach(stack[-1], keys, node)
        else:
            root = node
        if not isinstance(node, yaml.ScalarNode):
            stack.append(node)
            keys.append(None)
    return root


def _refuse(event: yaml.Event, depth: int, root: yaml.Node | None) -> None:
    if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
        raise BadValue(line_of(event), "yaml", "YAML anchors/aliases are not supported")
    if getattr(event, "tag", None) not in (None, "!"):
        raise BadValue(line_of(event), "yaml", f"YAML tags are not supported ({event.tag})")
    if isinstance(event, yaml.CollectionStartEvent) and depth >= MAX_DEPTH:
        raise BadValue(line_of(event), "yaml", f"nested more than {MAX_DEPTH} levels deep")
    if isinstance(event, yaml.DocumentStartEvent) and root is not None:
        raise BadValue(line_of(event), "yaml", "a second YAML document; a spec is a single document")


def _node(event: yaml.Event) -> yaml.Node | None:
    marks = (event.start_mark, event.end_mark)
    if isinstance(event, yaml.ScalarEvent):
        return yaml.ScalarNode("", event.value, *marks, style=event.style)
    if isinstance(event, yaml.SequenceStartEvent):
        return yaml.SequenceNode("", [], *marks, flow_style=event.flow_style)
    if isinstance(event, yaml.MappingStartEvent):
        return yaml.MappingNode("", [], *marks, flow_style=event.flow_style)
    return None


def _attach(parent: yaml.Node, keys: list[yaml.Node | None], node: yaml.Node) -> None:
    if isinstance(parent, yaml.SequenceNode):
        parent.value.append(node)
    elif keys[-1] is None:
        keys[-1] = node
    else:
        parent.value.append((keys[-1], node))
        keys[-1] = None


# --------------------------------------------------------------------------- typed scalars

def kind_of(node: yaml.Node, typed: bool = False) -> str:
    """What a node is, for an error. `typed`: the field wants a number or true/false, so a
    quoted scalar is named as one (`port: "22"`)."""
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if typed and isinstance(node, yaml.ScalarNode) and node.style in ("'", '"'):
        # the quotes are the mistake only where the words would do without them
        bare = _DURATION_RE.fullmatch(node.value) or node.value.lower() in ("true", "false", "off")
        return f"the quoted string {node.value!r}" + (" (write it without quotes)" if bare else "")
    return "null" if is_null(node) else f"{node.value!r}"


def is_plain(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and not node.style


def is_null(node: yaml.Node) -> bool:
    return is_plain(node) and node.value in _NULLS


class AnyKey:
    """`allowed` for mappings whose keys are data (env names, job names), not schema."""

    def __contains__(self, key: object) -> bool:
        return True


def fields_of(node: yaml.Node, field: str, allowed: Sequence[str] | AnyKey,
            required: Sequence[str] = (), homes: Mapping[str, str] | None = None
            ) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    """key -> (key node, value node), refusing duplicates, unknown and missing keys. `homes`:
    keys of another level, by where they belong (`env` -> "at the spec's top level"), said
    for one written at this level instead of the closest name."""
    if not isinstance(node, yaml.MappingNode):
        raise BadValue(line_of(node), field or "spec", f"must be a mapping, got {kind_of(node)}")
    found: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    for key_node, value in node.value:
        key = _key(key_node, field)
        if key in found:  # YAML itself would silently keep the last one
            first = line_of(found[key][0])
            raise BadValue(line_of(key_node), sub_field(field, key), f"duplicate key (first on line {first})")
        if key not in allowed and homes and key in homes:
            raise BadValue(line_of(key_node), sub_field(field, key), f"{key} belongs {homes[key]}, not "
                           + (f"under {field}" if field else "at the spec's top level"),
                           hint=f"allowed keys here: {', '.join(allowed)}")
        if key not in allowed:
            raise unknown(line_of(key_node), sub_field(field, key), key, allowed, "key", "allowed keys here: ")
        found[key] = (key_node, value)
    for key in required:
        if key not in found:
            raise BadValue(line_of(node), sub_field(field, key), "missing required key")
    return found


def _key(node: yaml.Node, field: str) -> str:
    if not isinstance(node, yaml.ScalarNode):
        raise BadValue(line_of(node), field or "spec", f"keys must be strings, got {kind_of(node)}")
    return node.value


def as_str(node: yaml.Node, field: str) -> str:
    """The scalar's text as written: `no` stays "no" and `2` stays "2" (no YAML typing)."""
    if not isinstance(node, yaml.ScalarNode) or is_null(node):
        placeholder = (isinstance(node, yaml.MappingNode) and len(node.value) == 1 and is_null(node.value[0][1])
                       and isinstance(node.value[0][0], yaml.ScalarNode) and node.value[0][0].value.isidentifier())
        raise BadValue(line_of(node), field, f"must be a string, got {kind_of(node)}",
                       hint=PLACEHOLDER_HINT if placeholder else None)
    return node.value


def as_word(node: yaml.Node, field: str) -> str:
    """A string that ends up in a command line: no whitespace or control characters."""
    value = as_str(node, field)
    if not value:
        raise BadValue(line_of(node), field, "must not be empty")
    if any(c.isspace() or not c.isprintable() for c in value):
        raise BadValue(line_of(node), field, f"must not contain whitespace or control characters: {value!r}")
    return value


def as_path(node: yaml.Node, field: str) -> str:
    value = as_str(node, field)
    if "\0" in value or "\n" in value:
        raise BadValue(line_of(node), field, "must not contain NUL or newline")
    return value


def as_name(node: yaml.Node, field: str) -> str:
    value = as_str(node, field)
    if not _NAME_RE.fullmatch(value) or ".." in value:
        raise BadValue(line_of(node), field, f"invalid name {value!r}",
                   hint="1-63 characters: letters, digits, '_', '.', '-'; starts with a letter "
                        "or digit; no '..'")
    return value


def as_int(node: yaml.Node, field: str, lo: int, hi: int) -> int:
    """Plain decimal digits only: `22:22` (sexagesimal), `0x10`, `1_000`, `true` are refused."""
    if not is_plain(node) or not _INT_RE.fullmatch(node.value):
        raise BadValue(line_of(node), field, f"must be a decimal integer, got {kind_of(node, typed=True)}")
    # Python refuses to parse huge digit strings; anything this long is out of range anyway
    value = int(node.value) if len(node.value) <= 12 else hi + 1
    if not lo <= value <= hi:
        raise BadValue(line_of(node), field, f"must be an integer from {lo} to {hi}, got {node.value[:20]}")
    return value


# A year: longer than any run or wait anyone means, and far inside what the timers take
# (a sleep or socket timeout past about 292 years, threading's wait past 9.2e9 s, overflow).
MAX_DURATION = 8784 * 3600.0
DURATION_WORDS = "a positive number of seconds or a duration like 90s, 30m, 2h (at most 8784h, a year)"


def parse_duration(text: str) -> float | None:
    """Seconds from `90`, `90s`, `1.5m`, `2h`; None for anything else, not positive or over
    MAX_DURATION."""
    match = _DURATION_RE.fullmatch(text) if len(text) <= 15 else None
    if not match or float(match.group(1)) <= 0:
        return None
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    return seconds if seconds <= MAX_DURATION else None


def as_duration(node: yaml.Node, field: str) -> float:
    seconds = parse_duration(node.value if isinstance(node, yaml.ScalarNode) else "")
    if seconds is None:
        raise BadValue(line_of(node), field, f"must be {DURATION_WORDS}; got {kind_of(node, typed=True)}")
    return seconds


def as_bool(node: yaml.Node, field: str) -> bool:
    if not is_plain(node) or node.value.lower() not in ("true", "false"):
        raise BadValue(line_of(node), field, f"must be true or false, got {kind_of(node, typed=True)}")
    return node.value.lower() == "true"


def as_choice(node: yaml.Node, field: str, choices: Sequence[str], what: str) -> str:
    value = as_str(node, field)
    if value not in choices:
        raise unknown(line_of(node), field, value, choices, what, "one of: ")
    return value


def as_list(node: yaml.Node, field: str) -> list[yaml.Node]:
    if not isinstance(node, yaml.SequenceNode):
        raise BadValue(line_of(node), field, f"must be a list, got {kind_of(node)}")
    return node.value
