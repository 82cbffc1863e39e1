"""The cluster spec: frozen dataclasses plus a strict YAML loader.

`load_spec(path)` returns a fully validated `Spec` or raises
`SpecError("FILE:LINE: field.path: problem")`; `layout_tasks(spec)` places every
task on a host, port and GPUs (the planner's input). Nothing here touches the
network or imports TensorFlow.
"""
from __future__ import annotations

import difflib
import hashlib
import importlib.resources
import ipaddress
import os
import re
import stat
import string
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from tfcluster.errors import SpecError

MODES = ("between-graph", "classic", "coordinator", "mirrored")
JOB_NAMES = ("chief", "ps", "worker", "evaluator")   # canonical order everywhere
RESTART_POLICIES = ("never", "on-failure", "exit-code")
HOST_KEY_POLICIES = ("reject", "accept-new")
LOCAL_ADDRESSES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class SshSettings:
    """Connection settings after merging spec-level defaults with the host's own."""

    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    host_key_policy: str = "reject"
    jump_host: str | None = None
    connect_timeout: float = 10.0


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    gpus: int = 0
    local: bool = False              # run tasks as local processes (no SSH)
    ssh: SshSettings = field(default_factory=SshSettings)
    line: int = 0                    # line of this host's entry in the spec


@dataclass(frozen=True)
class Job:
    """One job as written. Exactly one of (`count`/`per_gpu` + `hosts` + `port`) or `tasks`."""

    name: str
    count: int | None = None
    per_gpu: bool = False
    gpus: int = 0                     # GPUs per task (per_gpu implies 1)
    hosts: tuple[str, ...] = ()
    port: int | None = None
    tasks: tuple[tuple[str, int], ...] | None = None   # explicit (host name, port)
    line: int = 0


@dataclass(frozen=True)
class Restart:
    policy: str = "never"
    max_restarts: int = 3


@dataclass(frozen=True)
class Train:
    mode: str = "between-graph"
    script: str | None = None         # absolute local path (resolved against the spec's dir)
    files: tuple[str, ...] = ()       # as written, relative to the spec's dir
    args: tuple[str, ...] = ()        # unexpanded; placeholders checked by the loader
    restart: Restart = field(default_factory=Restart)
    timeout: float | None = None      # seconds
    args_line: int = 0


@dataclass(frozen=True)
class Spec:
    path: str                         # the file as given
    name: str
    python: str = "python3"
    workdir: str = "~/.tfcluster"
    env: tuple[tuple[str, str], ...] = ()   # in file order; the planner sorts
    hosts: tuple[Host, ...] = ()
    jobs: tuple[Job, ...] = ()              # canonical JOB_NAMES order
    train: Train = field(default_factory=Train)
    digest: str = ""                  # sha256 of the file's bytes

    @property
    def base_dir(self) -> str:
        import os
        return os.path.dirname(os.path.abspath(self.path))

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def job(self, name: str) -> Job | None:
        for j in self.jobs:
            if j.name == name:
                return j
        return None


@dataclass(frozen=True)
class Slot:
    """One task placed on a host: the contract between the loader and the planner."""

    job: str
    index: int
    host: str
    port: int
    gpus: tuple[int, ...] = ()


MAX_SPEC_BYTES = 1 << 20          # a spec is a page of YAML; anything bigger is a mistake or an attack
MAX_DEPTH = 32                    # the schema nests 5 deep; deeper is junk (and costs stack)
MAX_TASKS = 10_000                # bounds the layout work whatever counts the file asks for
PLACEHOLDERS = ("job", "index", "ps_hosts", "worker_hosts", "chief_hosts", "workdir",
                "num_workers")

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_ENV_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_USER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_LABEL_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_INT_RE = re.compile(r"-?[0-9]+")
_NUM_RE = re.compile(r"[0-9]+(\.[0-9]+)?")
_DURATION_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smh]?)")
_SHELL_CHARS = set(";|&$`'\"<>(){}[]*?!\\#~^%,=")
_NULLS = ("", "~", "null", "Null", "NULL")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
_TOP_KEYS = ("name", "python", "workdir", "env", "ssh", "hosts", "jobs", "train")
_SSH_KEYS = ("user", "port", "identity_file", "known_hosts", "host_key_policy", "jump_host",
             "connect_timeout")
_HOST_KEYS = ("name", "address", "gpus", "ssh")
_JOB_KEYS = ("count", "per_gpu", "hosts", "port", "gpus", "tasks")
_TRAIN_KEYS = ("mode", "script", "files", "args", "restart", "timeout")
_LOOPBACK_NOTE = "127.0.0.x addresses are one machine and a TF server binds every interface"

try:  # libyaml is ~10x faster; the pure-Python loader gives the same nodes
    _Loader: type = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    _Loader = yaml.SafeLoader


# --------------------------------------------------------------------------- errors

class _Bad(Exception):
    """Raised deep in the walk without the file name; load_spec adds it."""

    def __init__(self, line: int, field: str, problem: str, hint: str | None = None) -> None:
        super().__init__(problem)
        self.line, self.field, self.problem, self.hint = line, field, problem, hint


def _one_line(text: str) -> str:
    # user text (keys, values, paths) lands in the message; it must stay one line
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _spec_error(path: str, line: int | None, field: str, problem: str,
                hint: str | None = None) -> SpecError:
    where = f"{path}:{line}" if line else path
    head = f"{where}: {field}: " if field else f"{where}: "
    return SpecError(_one_line(head + problem), hint=hint)


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _sub(field: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{field}[{key}]"
    return f"{field}.{key}" if field else key


def _suggest(word: str, choices: Iterable[str], what: str) -> str:
    choices = list(choices)
    close = difflib.get_close_matches(word, choices, n=1)
    if close:
        return f"unknown {what} {word!r}; did you mean {close[0]!r}?"
    return f"unknown {what} {word!r}; expected one of: {', '.join(choices)}"


# --------------------------------------------------------------------------- reading

def _read(path: str) -> bytes:
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):   # a FIFO or device would block or never end
            raise _Bad(0, "", "not a regular file")
        if st.st_size > MAX_SPEC_BYTES:
            raise _Bad(0, "", f"file is {st.st_size} bytes; a spec may be at most 1 MiB")
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except (OSError, ValueError) as exc:
        raise _Bad(0, "", f"cannot read spec: {getattr(exc, 'strerror', None) or exc}") from None
    if len(data) > MAX_SPEC_BYTES:         # it grew between stat and read
        raise _Bad(0, "", "file is larger than 1 MiB; a spec may be at most 1 MiB")
    return data


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise _Bad(line, "spec", f"not UTF-8 text (byte 0x{data[exc.start]:02x})") from None


def _yaml_problem(exc: yaml.YAMLError, text: str) -> _Bad:
    if isinstance(exc, yaml.reader.ReaderError):
        # libyaml reports a byte offset, pure PyYAML a character offset; both are near enough
        line = text.encode("utf-8", "replace").count(b"\n", 0, max(exc.position, 0)) + 1
        return _Bad(line, "yaml", exc.reason)
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    problem = f"{problem} ({context})" if context else problem
    return _Bad(mark.line + 1 if mark else 1, "yaml", problem)


def _compose(text: str) -> yaml.Node:
    try:
        root = _tree(yaml.parse(text, Loader=_Loader))
    except yaml.YAMLError as exc:
        raise _yaml_problem(exc, text) from None
    if root is None:
        raise _Bad(1, "spec", "file is empty; expected a mapping with name, hosts and jobs")
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
        raise _Bad(_line(event), "yaml", "YAML anchors/aliases are not supported")
    if getattr(event, "tag", None) not in (None, "!"):
        raise _Bad(_line(event), "yaml", f"YAML tags are not supported ({event.tag})")
    if isinstance(event, yaml.CollectionStartEvent) and depth >= MAX_DEPTH:
        raise _Bad(_line(event), "yaml", f"nested more than {MAX_DEPTH} levels deep")
    if isinstance(event, yaml.DocumentStartEvent) and root is not None:
        raise _Bad(_line(event), "yaml", "a second YAML document; a spec is a single document")


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

def _kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return "null" if _is_null(node) else f"{node.value!r}"


def _is_plain(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and not node.style


def _is_null(node: yaml.Node) -> bool:
    return _is_plain(node) and node.value in _NULLS


def _fields(node: yaml.Node, field: str, allowed: Sequence[str],
            required: Sequence[str] = ()) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    """key -> (key node, value node), refusing duplicates, unknown and missing keys."""
    if not isinstance(node, yaml.MappingNode):
        raise _Bad(_line(node), field or "spec", f"must be a mapping, got {_kind(node)}")
    found: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    for key_node, value in node.value:
        key = _key(key_node, field)
        if key in found:  # YAML itself would silently keep the last one
            first = _line(found[key][0])
            raise _Bad(_line(key_node), _sub(field, key), f"duplicate key (first on line {first})")
        if key not in allowed:
            raise _Bad(_line(key_node), _sub(field, key), _suggest(key, allowed, "key"),
                       hint=f"allowed keys here: {', '.join(allowed)}")
        found[key] = (key_node, value)
    for key in required:
        if key not in found:
            raise _Bad(_line(node), _sub(field, key), "missing required key")
    return found


def _key(node: yaml.Node, field: str) -> str:
    if not isinstance(node, yaml.ScalarNode):
        raise _Bad(_line(node), field or "spec", f"keys must be strings, got {_kind(node)}")
    return node.value


def _str(node: yaml.Node, field: str) -> str:
    """The scalar's text as written: `no` stays "no" and `2` stays "2" (no YAML typing)."""
    if not isinstance(node, yaml.ScalarNode) or _is_null(node):
        raise _Bad(_line(node), field, f"must be a string, got {_kind(node)}")
    return node.value


def _word(node: yaml.Node, field: str) -> str:
    """A string that ends up in a command line: no whitespace or control characters."""
    value = _str(node, field)
    if not value:
        raise _Bad(_line(node), field, "must not be empty")
    if any(c.isspace() or not c.isprintable() for c in value):
        raise _Bad(_line(node), field, f"must not contain whitespace or control characters: {value!r}")
    return value


def _int(node: yaml.Node, field: str, lo: int, hi: int) -> int:
    """Plain decimal digits only: `22:22` (sexagesimal), `0x10`, `1_000`, `true` are refused."""
    if not _is_plain(node) or not _INT_RE.fullmatch(node.value):
        raise _Bad(_line(node), field, f"must be a decimal integer, got {_kind(node)}")
    # Python refuses to parse huge digit strings; anything this long is out of range anyway
    value = int(node.value) if len(node.value) <= 12 else hi + 1
    if not lo <= value <= hi:
        raise _Bad(_line(node), field, f"must be an integer from {lo} to {hi}, got {node.value[:20]}")
    return value


def _positive(node: yaml.Node, field: str) -> float:
    if not _is_plain(node) or not _NUM_RE.fullmatch(node.value) or len(node.value) > 15:
        raise _Bad(_line(node), field, f"must be a positive number, got {_kind(node)}")
    value = float(node.value)
    if value <= 0:
        raise _Bad(_line(node), field, f"must be a positive number, got {node.value}")
    return value


def _bool(node: yaml.Node, field: str) -> bool:
    if not _is_plain(node) or node.value.lower() not in ("true", "false"):
        raise _Bad(_line(node), field, f"must be true or false, got {_kind(node)}")
    return node.value.lower() == "true"


def _choice(node: yaml.Node, field: str, choices: Sequence[str], what: str) -> str:
    value = _str(node, field)
    if value not in choices:
        raise _Bad(_line(node), field, _suggest(value, choices, what),
                   hint=f"one of: {', '.join(choices)}")
    return value


def _list(node: yaml.Node, field: str) -> list[yaml.Node]:
    if not isinstance(node, yaml.SequenceNode):
        raise _Bad(_line(node), field, f"must be a list, got {_kind(node)}")
    return node.value


def _name(node: yaml.Node, field: str) -> str:
    value = _str(node, field)
    if not _NAME_RE.fullmatch(value) or ".." in value:
        raise _Bad(_line(node), field, f"invalid name {value!r}",
                   hint="1-63 characters: letters, digits, '_', '.', '-'; starts with a letter "
                        "or digit; no '..'")
    return value


# --------------------------------------------------------------------------- addresses

def _address(node: yaml.Node, field: str) -> str:
    value = _str(node, field)
    problem = _address_problem(value)
    if problem:
        raise _Bad(_line(node), field, f"{problem}: {value!r}")
    return value


def _address_problem(value: str) -> str | None:
    """Why `value` is not a hostname, IPv4 or IPv6 address (it reaches ssh and shells)."""
    if not value:
        return "must not be empty"
    if any(c.isspace() or not c.isprintable() for c in value):
        return "must not contain whitespace or control characters"
    if value.startswith("-"):
        return "must not start with '-' (ssh would take it for an option)"
    bad = sorted(set(value) & _SHELL_CHARS)
    if bad:
        return f"must not contain shell metacharacter {bad[0]!r}"
    if _is_ip(value) or _is_hostname(value):
        return None
    return "not a valid hostname, IPv4 or IPv6 address"


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def _is_hostname(value: str) -> bool:
    labels = value.split(".")
    if len(value) > 253 or not all(_LABEL_RE.fullmatch(label) for label in labels):
        return False
    return not all(label.isdigit() for label in labels)   # 10.1.0.300 is a broken IPv4


def _machine(address: str) -> str:
    """One key per machine: every loopback address is this machine (§6b)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return "loopback" if address.lower() == "localhost" else address.lower()
    return "loopback" if ip.is_loopback else ip.compressed


def _jump_host(node: yaml.Node, field: str) -> str:
    value = _str(node, field)
    user, _, rest = value.rpartition("@")
    host, port = rest, ""
    if rest.count(":") == 1:       # host:port; a bare IPv6 address has several colons
        host, _, port = rest.partition(":")
    ok = (not user or _USER_RE.fullmatch(user)) and re.fullmatch(r"[0-9]{0,5}", port)
    problem = _address_problem(host) if ok else "must be [user@]host[:port]"
    if problem:
        raise _Bad(_line(node), field, f"{problem}: {value!r}")
    return value


# --------------------------------------------------------------------------- sections

def _parse_env(node: yaml.Node) -> tuple[tuple[str, str], ...]:
    pairs = []
    for key, (key_node, value) in _fields(node, "env", _AnyKey()).items():
        if not _ENV_RE.fullmatch(key):
            raise _Bad(_line(key_node), _sub("env", key), "invalid variable name",
                       hint="letters, digits and '_', not starting with a digit")
        if not isinstance(value, yaml.ScalarNode) or _is_null(value):
            raise _Bad(_line(value), _sub("env", key), f"value must be a string, got {_kind(value)}",
                       hint=f'quote it: {key}: "..."')
        if "\0" in value.value:
            raise _Bad(_line(value), _sub("env", key), "value must not contain NUL")
        pairs.append((key, value.value))
    return tuple(pairs)


class _AnyKey:
    """`allowed` for mappings whose keys are data (env names), not schema."""

    def __contains__(self, key: object) -> bool:
        return True


def _parse_ssh(node: yaml.Node, field: str) -> dict[str, Any]:
    """Only the fields this mapping sets, so a host's ssh overrides the spec's field by field."""
    out: dict[str, Any] = {}
    for key, (_, value) in _fields(node, field, _SSH_KEYS).items():
        out[key] = _SSH_PARSERS[key](value, _sub(field, key))
    return out


def _ssh_user(node: yaml.Node, field: str) -> str:
    value = _str(node, field)
    if not _USER_RE.fullmatch(value):
        raise _Bad(_line(node), field, f"invalid user name {value!r}")
    return value


def _path(node: yaml.Node, field: str) -> str:
    value = _str(node, field)
    if "\0" in value or "\n" in value:
        raise _Bad(_line(node), field, "must not contain NUL or newline")
    return value


_SSH_PARSERS: dict[str, Callable[[yaml.Node, str], Any]] = {
    "user": _ssh_user,
    "port": lambda n, f: _int(n, f, 1, 65535),
    "identity_file": _path,
    "known_hosts": _path,
    "host_key_policy": lambda n, f: _choice(n, f, HOST_KEY_POLICIES, "host key policy"),
    "jump_host": _jump_host,
    "connect_timeout": _positive,
}


def _parse_hosts(node: yaml.Node, ssh: dict[str, Any]) -> tuple[Host, ...]:
    items = _list(node, "hosts")
    if not items:
        raise _Bad(_line(node), "hosts", "must list at least one host")
    hosts: dict[str, Host] = {}
    for i, item in enumerate(items):
        host = _parse_host(item, _sub("hosts", i), ssh)
        if host.name in hosts:
            raise _Bad(host.line, _sub(_sub("hosts", i), "name"),
                       f"duplicate host name {host.name!r} (first on line {hosts[host.name].line})")
        hosts[host.name] = host
    return tuple(hosts.values())


def _parse_host(node: yaml.Node, field: str, ssh: dict[str, Any]) -> Host:
    f = _fields(node, field, _HOST_KEYS, required=("name", "address"))
    own = _parse_ssh(f["ssh"][1], _sub(field, "ssh")) if "ssh" in f else {}
    address = _address(f["address"][1], _sub(field, "address"))
    return Host(
        name=_name(f["name"][1], _sub(field, "name")),
        address=address,
        gpus=_int(f["gpus"][1], _sub(field, "gpus"), 0, 4096) if "gpus" in f else 0,
        local=address in LOCAL_ADDRESSES and "ssh" not in f,
        ssh=SshSettings(**{**ssh, **own}),
        line=_line(node),
    )


# --------------------------------------------------------------------------- jobs

def _parse_jobs(node: yaml.Node, hosts: dict[str, Host]) -> tuple[Job, ...]:
    found = _fields(node, "jobs", _AnyKey())
    for key, (key_node, _) in found.items():
        if key not in JOB_NAMES:
            raise _Bad(_line(key_node), _sub("jobs", key), _suggest(key, JOB_NAMES, "job"),
                       hint=f"jobs are {', '.join(JOB_NAMES)}")
    jobs = [_parse_job(name, *found[name], hosts) for name in JOB_NAMES if name in found]
    total = sum(_task_count(job, hosts) for job in jobs)
    if total > MAX_TASKS:
        raise _Bad(_line(node), "jobs", f"{total} tasks in all; at most {MAX_TASKS} are supported")
    return tuple(jobs)


def _parse_job(name: str, key_node: yaml.Node, node: yaml.Node, hosts: dict[str, Host]) -> Job:
    field = _sub("jobs", name)
    f = _fields(node, field, _JOB_KEYS)
    if "tasks" in f:
        job = _parse_task_job(name, field, f, hosts)
    else:
        job = _parse_counted_job(name, field, node, f, hosts)
    job = replace(job, line=_line(key_node))
    _check_job_gpus(job, field, f, hosts)
    return job


def _parse_task_job(name: str, field: str, f: dict, hosts: dict[str, Host]) -> Job:
    mixed = [k for k in ("count", "per_gpu", "hosts", "port") if k in f]
    if mixed:
        raise _Bad(_line(f[mixed[0]][0]), _sub(field, mixed[0]),
                   "cannot be combined with 'tasks' (list every task, or use count/per_gpu, "
                   "hosts and port)")
    items = _list(f["tasks"][1], _sub(field, "tasks"))
    tasks = tuple(_parse_task(item, _sub(_sub(field, "tasks"), i), hosts)
                  for i, item in enumerate(items))
    return Job(name=name, tasks=tasks, gpus=_job_gpus(field, f))


def _parse_task(node: yaml.Node, field: str, hosts: dict[str, Host]) -> tuple[str, int]:
    value = _str(node, field)
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise _Bad(_line(node), field, f"must be 'host:port', got {value!r}")
    if host not in hosts:
        raise _Bad(_line(node), field, _suggest(host, hosts, "host"))
    if not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        raise _Bad(_line(node), field, f"port must be an integer from 1 to 65535, got {port!r}")
    return host, int(port)


def _parse_counted_job(name: str, field: str, node: yaml.Node, f: dict,
                       hosts: dict[str, Host]) -> Job:
    if "count" in f and "per_gpu" in f:
        raise _Bad(_line(f["per_gpu"][0]), _sub(field, "per_gpu"),
                   "cannot be combined with 'count' (per_gpu starts one task per GPU)")
    per_gpu = "per_gpu" in f and _bool(f["per_gpu"][1], _sub(field, "per_gpu"))
    for key in ("hosts", "port") if per_gpu else ("count", "hosts", "port"):
        if key not in f:
            raise _Bad(_line(node), _sub(field, key), "missing required key",
                       hint="a job is {count: N, hosts: [...], port: P}, {per_gpu: true, "
                            "hosts: [...], port: P} or {tasks: ['host:port', ...]}")
    count = None if per_gpu else _int(f["count"][1], _sub(field, "count"), 0, MAX_TASKS)
    gpus = _job_gpus(field, f)     # checked even with per_gpu, which refuses the key
    job = Job(name=name, count=count, per_gpu=per_gpu,
              hosts=_job_hosts(f["hosts"][1], _sub(field, "hosts"), hosts, per_gpu),
              port=_int(f["port"][1], _sub(field, "port"), 1, 65535),
              gpus=1 if per_gpu else gpus)
    _check_port_room(job, f["port"][1], _sub(field, "port"), hosts)
    return job


def _job_gpus(field: str, f: dict) -> int:
    if "gpus" not in f:
        return 0
    if "per_gpu" in f and _bool(f["per_gpu"][1], _sub(field, "per_gpu")):
        raise _Bad(_line(f["gpus"][0]), _sub(field, "gpus"),
                   "cannot be combined with per_gpu (per_gpu gives each task one GPU)")
    return _int(f["gpus"][1], _sub(field, "gpus"), 0, 4096)


def _job_hosts(node: yaml.Node, field: str, hosts: dict[str, Host], per_gpu: bool) -> tuple[str, ...]:
    names: list[str] = []
    items = _list(node, field)
    if not items:
        raise _Bad(_line(node), field, "must name at least one host")
    for i, item in enumerate(items):
        name = _str(item, _sub(field, i))
        if name not in hosts:
            raise _Bad(_line(item), _sub(field, i), _suggest(name, hosts, "host"))
        if name in names:
            raise _Bad(_line(item), _sub(field, i), f"host {name!r} is listed twice")
        if per_gpu and not hosts[name].gpus:
            raise _Bad(_line(item), _sub(field, i),
                       f"per_gpu needs GPUs but host {name} has none (set gpus: on the host)")
        names.append(name)
    return tuple(names)


def _check_job_gpus(job: Job, field: str, f: dict, hosts: dict[str, Host]) -> None:
    if job.name == "ps" and (job.per_gpu or job.gpus):
        key = "per_gpu" if job.per_gpu else "gpus"
        raise _Bad(_line(f[key][0]), _sub(field, key), "ps tasks never get GPUs",
                   hint="ps tasks run with CUDA_VISIBLE_DEVICES=\"\"; remove this key")


def _per_host(job: Job, hosts: dict[str, Host]) -> dict[str, int]:
    """How many tasks of a count/per_gpu job land on each of its hosts."""
    if job.per_gpu:
        return {name: hosts[name].gpus for name in job.hosts}
    n = len(job.hosts)
    return {name: (job.count or 0) // n + (i < (job.count or 0) % n)
            for i, name in enumerate(job.hosts)}


def _check_port_room(job: Job, node: yaml.Node, field: str, hosts: dict[str, Host]) -> None:
    # ports count up per host, so the last one must still be a port
    for name, n in _per_host(job, hosts).items():
        if job.port is not None and job.port + n - 1 > 65535:
            raise _Bad(_line(node), field,
                       f"{n} tasks on host {name} need ports {job.port}-{job.port + n - 1}, "
                       "past 65535")


def _task_count(job: Job, hosts: dict[str, Host]) -> int:
    if job.tasks is not None:
        return len(job.tasks)
    return sum(_per_host(job, hosts).values())


# --------------------------------------------------------------------------- train

def _parse_train(node: yaml.Node, base_dir: str) -> Train:
    f = _fields(node, "train", _TRAIN_KEYS)
    value = {k: v for k, (_, v) in f.items()}
    return Train(
        mode=_choice(value["mode"], "train.mode", MODES, "mode") if "mode" in f else MODES[0],
        script=_script(value["script"], base_dir) if "script" in f else None,
        files=_files(value["files"], base_dir) if "files" in f else (),
        args=_args(value["args"]) if "args" in f else (),
        restart=_restart(value["restart"]) if "restart" in f else Restart(),
        timeout=_duration(value["timeout"], "train.timeout") if "timeout" in f else None,
        args_line=_line(value["args"]) if "args" in f else 0,
    )


def _templates_root() -> Any:
    """The package's shipped training scripts (a Traversable); tests swap it out."""
    return importlib.resources.files("tfcluster.templates")


def _template_names() -> list[str]:
    try:
        return sorted(p.name[:-3] for p in _templates_root().iterdir()
                      if p.name.endswith(".py") and not p.name.startswith("_"))
    except (ModuleNotFoundError, OSError):
        return []


def _script(node: yaml.Node, base_dir: str) -> str:
    value = _path(node, "train.script")
    if value.startswith("template:"):
        return _template(node, value[len("template:"):])
    full = os.path.join(base_dir, value)
    if not os.path.isfile(full):
        what = "is a directory, not a file" if os.path.isdir(full) else "file not found"
        raise _Bad(_line(node), "train.script", f"{what}: {full}",
                   hint="script paths are relative to the spec's directory")
    return os.path.abspath(full)


def _template(node: yaml.Node, name: str) -> str:
    names = _template_names()
    if name not in names:
        problem = _suggest(name, names, "template") if names else f"unknown template {name!r}; none are installed"
        raise _Bad(_line(node), "train.script", problem)
    return str(_templates_root() / f"{name}.py")


def _files(node: yaml.Node, base_dir: str) -> tuple[str, ...]:
    out = []
    for i, item in enumerate(_list(node, "train.files")):
        value = _path(item, _sub("train.files", i))
        if not value or not os.path.exists(os.path.join(base_dir, value)):
            raise _Bad(_line(item), _sub("train.files", i),
                       f"not found: {os.path.join(base_dir, value)}",
                       hint="file paths are relative to the spec's directory")
        out.append(value)
    return tuple(out)


def _args(node: yaml.Node) -> tuple[str, ...]:
    out = []
    for i, item in enumerate(_list(node, "train.args")):
        value = _str(item, _sub("train.args", i))
        _check_placeholders(value, _line(item), _sub("train.args", i))
        out.append(value)
    return tuple(out)


def _check_placeholders(value: str, line: int, field: str) -> None:
    """Exactly `{name}` with a known name: the planner fills them with str.format."""
    try:
        parts = list(string.Formatter().parse(value))
    except ValueError as exc:
        raise _Bad(line, field, f"malformed placeholder in {value!r} ({exc}); "
                                "write {{ and }} for literal braces") from None
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if name not in PLACEHOLDERS or spec or conversion:
            raise _Bad(line, field, f"unknown placeholder {shown}; known: {', '.join(PLACEHOLDERS)}",
                       hint="write {{ and }} for literal braces")


def _restart(node: yaml.Node) -> Restart:
    f = _fields(node, "train.restart", ("policy", "max_restarts"))
    policy = (_choice(f["policy"][1], "train.restart.policy", RESTART_POLICIES, "restart policy")
              if "policy" in f else Restart.policy)
    most = (_int(f["max_restarts"][1], "train.restart.max_restarts", 0, 1_000_000)
            if "max_restarts" in f else Restart.max_restarts)
    return Restart(policy=policy, max_restarts=most)


def _duration(node: yaml.Node, field: str) -> float:
    text = node.value if isinstance(node, yaml.ScalarNode) else ""
    match = _DURATION_RE.fullmatch(text) if len(text) <= 15 else None
    if not match or float(match.group(1)) <= 0:
        raise _Bad(_line(node), field,
                   f"must be a positive number of seconds or a duration like 90s, 30m, 2h; "
                   f"got {_kind(node)}")
    return float(match.group(1)) * _UNITS[match.group(2)]


# --------------------------------------------------------------------------- layout

def layout_tasks(spec: Spec) -> tuple[Slot, ...]:
    """Every task of the spec on its host, port and GPUs, in JOB_NAMES then index order.

    Pure and deterministic. Count jobs go round-robin over their hosts (ports count up per
    host), per_gpu jobs give each GPU of each host one task, explicit tasks keep list order.
    GPU ids come from one counter per host, consumed in that same order. Raises SpecError
    when a host is asked for more GPUs than it has.
    """
    hosts = {h.name: h for h in spec.hosts}
    order = {name: i for i, name in enumerate(JOB_NAMES)}
    placed = [p for job in sorted(spec.jobs, key=lambda j: order[j.name])
              for p in _place(job, hosts)]
    return tuple(_assign_gpus(spec.path, placed, hosts))


def _assign_gpus(path: str, placed: list[tuple[Job, int, str, int, int]],
                 hosts: dict[str, Host]) -> Iterator[Slot]:
    need: dict[str, int] = {}          # totals, so the error says what the host would need
    for _, _, host, _, k in placed:
        need[host] = need.get(host, 0) + k
    used: dict[str, int] = {}
    for job, index, host, port, k in placed:
        start = used.get(host, 0)
        if start + k > hosts[host].gpus:
            raise _spec_error(path, job.line, _sub("jobs", job.name),
                              f"host {host} has {hosts[host].gpus} GPUs but its tasks need {need[host]}")
        used[host] = start + k
        yield Slot(job.name, index, host, port, tuple(range(start, start + k)))


def _place(job: Job, hosts: dict[str, Host]) -> list[tuple[Job, int, str, int, int]]:
    """(job, index, host, port, gpus per task) for each task of one job."""
    if job.tasks is not None:
        return [(job, i, h, p, job.gpus) for i, (h, p) in enumerate(job.tasks)]
    port = job.port or 0
    if job.per_gpu:
        pairs = [(h, port + g) for h in job.hosts for g in range(hosts[h].gpus)]
        return [(job, i, h, p, 1) for i, (h, p) in enumerate(pairs)]
    n = len(job.hosts)
    return [(job, i, job.hosts[i % n], port + i // n, job.gpus) for i in range(job.count or 0)]


# --------------------------------------------------------------------------- cross checks

def _check_conflicts(spec: Spec, slots: tuple[Slot, ...]) -> None:
    hosts = {h.name: h for h in spec.hosts}
    seen: dict[tuple[str, int], Slot] = {}
    for slot in slots:
        key = (_machine(hosts[slot.host].address), slot.port)
        first = seen.setdefault(key, slot)
        if first is not slot:
            job = spec.job(slot.job)
            raise _spec_error(spec.path, job.line if job else None, _sub("jobs", slot.job),
                              _conflict(slot, first, hosts))


def _conflict(slot: Slot, first: Slot, hosts: dict[str, Host]) -> str:
    both = f"{slot.job}:{slot.index} and {first.job}:{first.index} both use"
    a, b = hosts[slot.host], hosts[first.host]
    if a.name == b.name:
        return f"{both} {a.name}:{slot.port}"
    if a.address == b.address:
        return f"{both} port {slot.port} of {a.address} (hosts {a.name} and {b.name})"
    return (f"{both} port {slot.port} of this machine (hosts {a.name} at {a.address} and "
            f"{b.name} at {b.address}): {_LOOPBACK_NOTE}")


def _check_mode(spec: Spec, slots: tuple[Slot, ...], jobs_line: int) -> None:
    mode = spec.train.mode
    have = {name: sum(1 for s in slots if s.job == name) for name in JOB_NAMES}

    def bad(name: str, problem: str, hint: str | None = None) -> SpecError:
        job = spec.job(name)
        field = _sub("jobs", name) if job else "jobs"
        return _spec_error(spec.path, job.line if job else jobs_line, field, problem, hint)

    if have["chief"] > 1:
        raise bad("chief", f"at most 1 chief task, got {have['chief']}")
    if not have["worker"]:
        raise bad("worker", f"mode {mode} needs at least one worker task")
    if mode != "mirrored" and not have["ps"]:
        raise bad("ps", f"mode {mode} needs at least one ps task",
                  hint="add ps: {count: 1, hosts: [...], port: 2222}")
    if mode == "coordinator" and not have["chief"]:
        raise bad("chief", "mode coordinator needs a chief job (it runs the coordinator)",
                  hint="add chief: {count: 1, hosts: [...], port: ...}")
    if mode == "mirrored" and have["ps"]:
        raise bad("ps", "mode mirrored takes no ps tasks: MultiWorkerMirroredStrategy uses no "
                        "parameter servers", hint="remove the ps job or pick another train.mode")


# --------------------------------------------------------------------------- entry

def load_spec(path: str) -> Spec:
    """Read, parse and validate the spec at `path`; SpecError (one line) for any problem."""
    try:
        data = _read(path)
        spec, jobs_line = _build(path, _compose(_decode(data)))
    except _Bad as bad:
        raise _spec_error(path, bad.line, bad.field, bad.problem, bad.hint) from None
    spec = replace(spec, digest=hashlib.sha256(data).hexdigest())
    slots = layout_tasks(spec)
    _check_conflicts(spec, slots)
    _check_mode(spec, slots, jobs_line)
    return spec


def _build(path: str, root: yaml.Node) -> tuple[Spec, int]:
    f = _fields(root, "", _TOP_KEYS, required=("name", "hosts", "jobs"))
    value = {k: v for k, (_, v) in f.items()}
    ssh = _parse_ssh(value["ssh"], "ssh") if "ssh" in f else {}
    hosts = _parse_hosts(value["hosts"], ssh)
    base_dir = os.path.dirname(os.path.abspath(path))
    spec = Spec(
        path=path,
        name=_name(value["name"], "name"),
        python=_word(value["python"], "python") if "python" in f else Spec.python,
        workdir=_word(value["workdir"], "workdir") if "workdir" in f else Spec.workdir,
        env=_parse_env(value["env"]) if "env" in f else (),
        hosts=hosts,
        jobs=_parse_jobs(value["jobs"], {h.name: h for h in hosts}),
        train=_parse_train(value["train"], base_dir) if "train" in f else Train(),
    )
    return spec, _line(f["jobs"][0])
