"""The spec's schema: its sections (env, ssh, hosts, jobs, train) read off the node tree.

`build` turns the root node into a `Spec`; every field is checked where it is read, so
the first problem in file order is the one reported. Checks that need the whole layout
(port conflicts, the jobs a mode needs) run after, in layout.py.
"""
from __future__ import annotations

import os
import re
import string
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import yaml

from tfcluster.spec import templates
from tfcluster.spec.addresses import USER_RE, parse_address, parse_jump_host
from tfcluster.spec.envs import parse_env, parse_names
from tfcluster.spec.layout import per_host, task_count
from tfcluster.spec.model import (
    HOST_KEY_POLICIES,
    HOST_LOSS_POLICIES,
    JAX_PER_TASK_ENV,
    JOB_NAMES,
    KERAS_BACKEND_ENV,
    KERAS_CHOICES,
    LEGACY_KERAS_ENV,
    LEGACY_KERAS_VALUES,
    LOCAL_ADDRESSES,
    MAX_TASKS,
    MODES,
    PLACEHOLDERS,
    PREEMPTIBLE,
    RESTART_POLICIES,
    STOP_GRACE,
    STOP_GRACE_MAX,
    TF_PORTS,
    Checkpoint,
    Checks,
    Host,
    Job,
    Progress,
    Restart,
    Spec,
    SshSettings,
    Train,
)
from tfcluster.spec.progress import parse_progress
from tfcluster.spec.yamltree import (
    DURATION_WORDS,
    AnyKey,
    BadValue,
    as_bool,
    as_choice,
    as_duration,
    as_int,
    as_list,
    as_name,
    as_path,
    as_str,
    as_word,
    fields_of,
    is_plain,
    kind_of,
    line_of,
    parse_duration,
    sub_field,
    suggest,
    unknown,
)

_TOP_KEYS = ("name", "python", "workdir", "env", "secret_env", "public_env", "ssh", "hosts", "jobs",
             "train", "tf_ports")
_SSH_KEYS = ("user", "port", "identity_file", "known_hosts", "host_key_policy", "jump_host",
             "connect_timeout")
_HOST_KEYS = ("name", "address", "gpus", "ssh", "spare", "preemptible", "metadata_url")
_JOB_KEYS = ("count", "per_gpu", "hosts", "port", "gpus", "tasks")
_TRAIN_KEYS = ("mode", "script", "files", "allow_outside", "args", "restart", "timeout", "stop_grace", "checks",
               "tensorboard", "image", "progress", "keras", "on_host_loss", "checkpoint")
# a top-level key written under train, or train's at the top: said where it belongs
_TOP_HOMES = {k: "at the spec's top level" for k in _TOP_KEYS if k not in ("name", "ssh", "hosts", "train")}
_TRAIN_HOMES = {k: "under train:" for k in _TRAIN_KEYS}
_CHECK_KEYS = ("placement", "reachability", "proxy_guard", "hang_after")
_CHECKPOINT_KEYS = ("dir", "keep", "sync", "max_bytes")
# train.checkpoint.max_bytes: bytes, or a number with a unit (decimal kB..TB, binary KiB..TiB)
_SIZE_RE = re.compile(r"(\d{1,15}(?:\.\d{1,6})?)\s*(B|kB|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?")
_SIZE_UNITS = {None: 1, "B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_MAX_BYTES_RANGE = (1 << 20, 1 << 50)
MAX_CHECKPOINTS_KEPT = 1_000


def build(path: str, root: yaml.Node) -> tuple[Spec, dict[str, int]]:
    """The spec, and the lines of its `jobs:` key (where a missing job is reported) and its
    `env:` key (0 without one)."""
    f = fields_of(root, "", _TOP_KEYS, required=("name", "hosts", "jobs"), homes=_TRAIN_HOMES)
    value = {k: v for k, (_, v) in f.items()}
    ssh = _parse_ssh(value["ssh"], "ssh") if "ssh" in f else {}
    hosts = _parse_hosts(value["hosts"], ssh)
    base_dir = os.path.dirname(os.path.abspath(path))
    env = parse_env(value["env"], line_of(f["env"][0])) if "env" in f else ()
    secret = parse_names(value["secret_env"], "secret_env", env) if "secret_env" in f else ()
    spec = Spec(
        path=path,
        name=as_name(value["name"], "name"),
        python=_python(value["python"]) if "python" in f else Spec.python,
        workdir=_workdir(value["workdir"]) if "workdir" in f else Spec.workdir,
        env=env,
        secret_env=secret,
        public_env=parse_names(value["public_env"], "public_env", env, secret) if "public_env" in f else (),
        hosts=hosts,
        jobs=_parse_jobs(value["jobs"], {h.name: h for h in hosts}),
        train=_parse_train(value["train"], base_dir) if "train" in f else Train(),
        tf_ports=as_choice(value["tf_ports"], "tf_ports", TF_PORTS, "tf_ports") if "tf_ports" in f else Spec.tf_ports,
    )
    _check_keras_env(spec.train, env)
    _check_jax_env(spec.train, value.get("env"))
    _check_host_loss(spec)
    return spec, {"jobs": line_of(f["jobs"][0]), "env": line_of(f["env"][0]) if "env" in f else 0}


def _python(node: yaml.Node) -> str:
    """A name PATH finds (`python3`), an absolute path, or one under `~/`: a relative path
    would be found from where each process starts (the shim in the home, the script in its
    run's directory), so the checks would pass and the tasks not start."""
    value = as_word(node, "python")
    if "/" in value and not (value.startswith("/") or value.startswith("~/")):
        raise BadValue(line_of(node), "python", f"must be a name on PATH, absolute, or start with ~/: {value!r} "
                       "would be looked for from each process's own directory (a script's is its run's)",
                       hint=f"python: ~/{value.removeprefix('./')} (from the home) or an absolute path")
    return value


def _workdir(node: yaml.Node) -> str:
    """Absolute or under `~`: a relative one would be relative to wherever each command
    runs (the cluster's identity is its resolved directory), a different cluster each time."""
    value = as_word(node, "workdir")
    if not (value.startswith("/") or value == "~" or value.startswith("~/")):
        raise BadValue(line_of(node), "workdir", f"must be absolute or start with ~/: {value!r}")
    return value


# --------------------------------------------------------------------------- ssh, hosts


def _parse_ssh(node: yaml.Node, field: str) -> dict[str, Any]:
    """Only the fields this mapping sets, so a host's ssh overrides the spec's field by field."""
    out: dict[str, Any] = {}
    for key, (_, value) in fields_of(node, field, _SSH_KEYS).items():
        out[key] = _SSH_PARSERS[key](value, sub_field(field, key))
    return out


def _ssh_user(node: yaml.Node, field: str) -> str:
    value = as_str(node, field)
    if not USER_RE.fullmatch(value):
        raise BadValue(line_of(node), field, f"invalid user name {value!r}")
    return value


_SSH_PARSERS: dict[str, Callable[[yaml.Node, str], Any]] = {
    "user": _ssh_user,
    "port": lambda n, f: as_int(n, f, 1, 65535),
    "identity_file": as_path,
    "known_hosts": as_path,
    "host_key_policy": lambda n, f: as_choice(n, f, HOST_KEY_POLICIES, "host key policy"),
    "jump_host": parse_jump_host,
    "connect_timeout": as_duration,
}


def _parse_hosts(node: yaml.Node, ssh: dict[str, Any]) -> tuple[Host, ...]:
    items = as_list(node, "hosts")
    if not items:
        raise BadValue(line_of(node), "hosts", "must list at least one host")
    hosts: dict[str, Host] = {}
    for i, item in enumerate(items):
        host = _parse_host(item, sub_field("hosts", i), ssh)
        if host.name in hosts:
            raise BadValue(host.line, sub_field(sub_field("hosts", i), "name"),
                       f"duplicate host name {host.name!r} (first on line {hosts[host.name].line})")
        hosts[host.name] = host
    return tuple(hosts.values())


def _parse_host(node: yaml.Node, field: str, ssh: dict[str, Any]) -> Host:
    f = fields_of(node, field, _HOST_KEYS, required=("name", "address"))
    own = _parse_ssh(f["ssh"][1], sub_field(field, "ssh")) if "ssh" in f else {}
    address = parse_address(f["address"][1], sub_field(field, "address"))
    return Host(
        name=as_name(f["name"][1], sub_field(field, "name")),
        address=address,
        gpus=as_int(f["gpus"][1], sub_field(field, "gpus"), 0, 4096) if "gpus" in f else 0,
        gpus_set="gpus" in f,
        local=address in LOCAL_ADDRESSES and "ssh" not in f,
        ssh=SshSettings(**{**ssh, **own}),
        line=line_of(node),
        spare="spare" in f and _spare(f["spare"][1], sub_field(field, "spare")) != "false",
        warm="spare" in f and _spare(f["spare"][1], sub_field(field, "spare")) == "warm",
        preemptible=as_choice(f["preemptible"][1], sub_field(field, "preemptible"), PREEMPTIBLE,
                              "preemptible") if "preemptible" in f else "no",
        metadata_url=_metadata_url(f["metadata_url"][1], sub_field(field, "metadata_url"))
        if "metadata_url" in f else None,
    )


def _spare(node: yaml.Node, field: str) -> str:
    """`spare`: true, false, or warm (a spare that keeps a standby ready: docs/hostloss.md,
    "Warm spares")."""
    if is_plain(node) and node.value.lower() == "warm":
        return "warm"
    if not is_plain(node) or node.value.lower() not in ("true", "false"):
        raise BadValue(line_of(node), field, f"must be true, false or warm, got {kind_of(node, typed=True)}",
                       hint="warm: the spare keeps Python and TensorFlow started for a move (docs/hostloss.md)")
    return node.value.lower()


_METADATA_URL = re.compile(r"http://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?")


def _metadata_url(node: yaml.Node, field: str) -> str:
    """A cloud metadata service's base URL: plain http (as every cloud serves it), a host,
    an optional port and path; nothing a shell or an HTTP request line could take apart."""
    value = as_str(node, field)
    match = _METADATA_URL.fullmatch(value)
    if match is None or int((match.group(2) or ":80")[1:]) > 65535:
        raise BadValue(line_of(node), field, f"must be http://HOST[:PORT], got {value!r}",
                       hint="the metadata service's address, e.g. http://169.254.169.254")
    return value.rstrip("/")


def _not_spare(host: Host, node: yaml.Node, field: str) -> None:
    """A job places no task on a spare: it waits, idle, for a host to be lost."""
    if host.spare:
        raise BadValue(line_of(node), field, f"{host.name} is a spare: it takes tasks only when a host is lost",
                       hint=f"remove spare: true from host {host.name} to give it tasks")


# --------------------------------------------------------------------------- jobs

def _parse_jobs(node: yaml.Node, hosts: dict[str, Host]) -> tuple[Job, ...]:
    found = fields_of(node, "jobs", AnyKey())
    for key, (key_node, _) in found.items():
        if key not in JOB_NAMES:
            raise unknown(line_of(key_node), sub_field("jobs", key), key, JOB_NAMES, "job", "jobs are ")
    jobs = [_parse_job(name, *found[name], hosts) for name in JOB_NAMES if name in found]
    total = sum(task_count(job, hosts) for job in jobs)
    if total > MAX_TASKS:
        raise BadValue(line_of(node), "jobs", f"{total} tasks in all; at most {MAX_TASKS} are supported")
    return tuple(jobs)


def _parse_job(name: str, key_node: yaml.Node, node: yaml.Node, hosts: dict[str, Host]) -> Job:
    field = sub_field("jobs", name)
    f = fields_of(node, field, _JOB_KEYS)
    if "tasks" in f:
        job = _parse_task_job(name, field, f, hosts)
    else:
        job = _parse_counted_job(name, field, node, f, hosts)
    job = replace(job, line=line_of(key_node))
    _check_job_gpus(job, field, f)
    return job


def _parse_task_job(name: str, field: str, f: dict, hosts: dict[str, Host]) -> Job:
    mixed = [k for k in ("count", "per_gpu", "hosts", "port") if k in f]
    if mixed:
        raise BadValue(line_of(f[mixed[0]][0]), sub_field(field, mixed[0]),
                   "cannot be combined with 'tasks' (list every task, or use count/per_gpu, "
                   "hosts and port)")
    items = as_list(f["tasks"][1], sub_field(field, "tasks"))
    tasks = tuple(_parse_task(item, sub_field(sub_field(field, "tasks"), i), hosts)
                  for i, item in enumerate(items))
    return Job(name=name, tasks=tasks, gpus=_job_gpus(field, f), gpus_set="gpus" in f)


def _parse_task(node: yaml.Node, field: str, hosts: dict[str, Host]) -> tuple[str, int]:
    value = as_str(node, field)
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise BadValue(line_of(node), field, f"must be 'host:port', got {value!r}")
    if host not in hosts:
        raise BadValue(line_of(node), field, suggest(host, hosts, "host"))
    _not_spare(hosts[host], node, field)
    if not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        raise BadValue(line_of(node), field, f"port must be an integer from 1 to 65535, got {port!r}")
    return host, int(port)


def _parse_counted_job(name: str, field: str, node: yaml.Node, f: dict,
                       hosts: dict[str, Host]) -> Job:
    if "count" in f and "per_gpu" in f:
        raise BadValue(line_of(f["per_gpu"][0]), sub_field(field, "per_gpu"),
                   "cannot be combined with 'count' (per_gpu starts one task per GPU)")
    per_gpu = "per_gpu" in f and as_bool(f["per_gpu"][1], sub_field(field, "per_gpu"))
    for key in ("hosts", "port") if per_gpu else ("count", "hosts", "port"):
        if key not in f:
            raise BadValue(line_of(node), sub_field(field, key), "missing required key",
                       hint="a job is {count: N, hosts: [...], port: P}, {per_gpu: true, "
                            "hosts: [...], port: P} or {tasks: ['host:port', ...]}")
    count = None if per_gpu else as_int(f["count"][1], sub_field(field, "count"), 0, MAX_TASKS)
    gpus = _job_gpus(field, f)     # checked even with per_gpu, which refuses the key
    job = Job(name=name, count=count, per_gpu=per_gpu,
              hosts=_job_hosts(f["hosts"][1], sub_field(field, "hosts"), hosts, per_gpu),
              port=as_int(f["port"][1], sub_field(field, "port"), 1, 65535),
              gpus=1 if per_gpu else gpus, gpus_set="gpus" in f)
    _check_port_room(job, f["port"][1], sub_field(field, "port"), hosts)
    return job


def _job_gpus(field: str, f: dict) -> int:
    if "gpus" not in f:
        return 0
    if "per_gpu" in f and as_bool(f["per_gpu"][1], sub_field(field, "per_gpu")):
        raise BadValue(line_of(f["gpus"][0]), sub_field(field, "gpus"),
                   "cannot be combined with per_gpu (per_gpu gives each task one GPU)")
    return as_int(f["gpus"][1], sub_field(field, "gpus"), 0, 4096)


def _job_hosts(node: yaml.Node, field: str, hosts: dict[str, Host], per_gpu: bool) -> tuple[str, ...]:
    names: list[str] = []
    items = as_list(node, field)
    if not items:
        raise BadValue(line_of(node), field, "must name at least one host")
    for i, item in enumerate(items):
        name = as_str(item, sub_field(field, i))
        if name not in hosts:
            raise BadValue(line_of(item), sub_field(field, i), suggest(name, hosts, "host"))
        _not_spare(hosts[name], item, sub_field(field, i))
        if name in names:
            raise BadValue(line_of(item), sub_field(field, i), f"host {name!r} is listed twice")
        if per_gpu and not hosts[name].gpus:
            raise BadValue(line_of(item), sub_field(field, i),
                       f"per_gpu needs GPUs but host {name} has none (set gpus: on the host)")
        names.append(name)
    return tuple(names)


def _check_job_gpus(job: Job, field: str, f: dict) -> None:
    if job.name == "ps" and (job.per_gpu or job.gpus):
        key = "per_gpu" if job.per_gpu else "gpus"
        raise BadValue(line_of(f[key][0]), sub_field(field, key), "ps tasks never get GPUs",
                   hint="ps tasks run with CUDA_VISIBLE_DEVICES=\"\"; remove this key")


def _check_port_room(job: Job, node: yaml.Node, field: str, hosts: dict[str, Host]) -> None:
    # ports count up per host, so the last one must still be a port
    for name, n in per_host(job, hosts).items():
        if job.port is not None and job.port + n - 1 > 65535:
            raise BadValue(line_of(node), field,
                       f"{n} tasks on host {name} need ports {job.port}-{job.port + n - 1}, "
                       "past 65535")


# --------------------------------------------------------------------------- train

def _parse_train(node: yaml.Node, base_dir: str) -> Train:
    """train: as written. Paths are checked for syntax only: whether the script and files
    exist is check_train_files' business, so commands that never ship them (down, status,
    logs) still work once a script has moved. Fields are read in file-schema order so the
    first problem reported stays the same."""
    f = fields_of(node, "train", _TRAIN_KEYS, homes=_TOP_HOMES)
    value = {k: v for k, (_, v) in f.items()}
    mode = as_choice(value["mode"], "train.mode", MODES, "mode") if "mode" in f else MODES[0]
    source = as_path(value["script"], "train.script") if "script" in f else None
    script = _script(value["script"], source, base_dir) if source is not None else None
    files = _files(value["files"], base_dir) if "files" in f else ()
    outside = _outside(value["allow_outside"]) if "allow_outside" in f else ()
    args = _args(value["args"]) if "args" in f else ()
    return Train(
        mode=mode,
        script=script,
        files=tuple(name for name, _ in files),
        args=tuple(a for a, _ in args),
        restart=_restart(value["restart"]) if "restart" in f else Restart(),
        timeout=as_duration(value["timeout"], "train.timeout") if "timeout" in f else None,
        stop_grace=_stop_grace(value["stop_grace"]) if "stop_grace" in f else STOP_GRACE,
        checks=_checks(value["checks"]) if "checks" in f else Checks(),
        tensorboard=_tensorboard(value["tensorboard"]) if "tensorboard" in f else None,
        tensorboard_line=line_of(value["tensorboard"]) if "tensorboard" in f else 0,
        image=_image(value["image"]) if "image" in f else None,
        progress=parse_progress(value["progress"]) if "progress" in f else Progress(),
        keras=as_choice(value["keras"], "train.keras", KERAS_CHOICES, "keras") if "keras" in f else "auto",
        keras_line=line_of(value["keras"]) if "keras" in f else 0,
        args_line=line_of(value["args"]) if "args" in f else 0,
        args_lines=tuple(line for _, line in args),
        allow_outside=tuple(d for d, _ in outside),
        allow_outside_lines=tuple(line for _, line in outside),
        script_source=source,
        script_line=line_of(value["script"]) if "script" in f else 0,
        files_lines=tuple(line for _, line in files),
        on_host_loss=(as_choice(value["on_host_loss"], "train.on_host_loss", HOST_LOSS_POLICIES, "on_host_loss")
                      if "on_host_loss" in f else None),
        on_host_loss_line=line_of(value["on_host_loss"]) if "on_host_loss" in f else 0,
        checkpoint=_checkpoint(value["checkpoint"]) if "checkpoint" in f else None,
    )


def _stop_grace(node: yaml.Node) -> float:
    seconds = as_duration(node, "train.stop_grace")
    if not 0 < seconds <= STOP_GRACE_MAX:
        raise BadValue(line_of(node), "train.stop_grace",
                       f"must be more than 0 and at most {STOP_GRACE_MAX:g}s; got {kind_of(node, typed=True)}",
                       hint="the seconds a script has after SIGTERM to save, before KILL (default 10s)")
    return seconds


def _check_host_loss(spec: Spec) -> None:
    """`on_host_loss: spare` needs a spare to move a lost host's tasks to."""
    if spec.train.on_host_loss == "spare" and not spec.spares:
        raise BadValue(spec.train.on_host_loss_line, "train.on_host_loss",
                       "spare needs a spare host, and no host entry says spare: true",
                       hint="add a host with spare: true, or set on_host_loss to shrink or fail")


def _check_keras_env(train: Train, env: tuple[tuple[str, str], ...]) -> None:
    """`train.keras: legacy` sets TF_USE_LEGACY_KERAS=1; an env: that unsets it contradicts it."""
    value = dict(env).get(LEGACY_KERAS_ENV)
    if train.keras == "legacy" and value is not None and value not in LEGACY_KERAS_VALUES:
        raise BadValue(train.keras_line, "train.keras",
                       f"legacy sets {LEGACY_KERAS_ENV}=1, but env: sets it to {value!r}",
                       hint=f"drop {LEGACY_KERAS_ENV} from env:, or train.keras")


def _check_jax_env(train: Train, env: yaml.Node | None) -> None:
    """Mode keras-jax sets each process's id, the process count and the coordinator in the names
    Keras and JAX read, and runs Keras on JAX: an env: that sets one of those, another
    backend, or tf_keras (a TensorFlow Keras) contradicts the mode."""
    if train.mode != "keras-jax":
        return
    if train.keras == "legacy":
        raise BadValue(train.keras_line, "train.keras",
                       "legacy is tf_keras, a TensorFlow Keras, and mode keras-jax runs Keras 3 on JAX",
                       hint="drop train.keras, or pick mode mirrored for tf_keras")
    for key_node, value in (env.value if isinstance(env, yaml.MappingNode) else ()):
        name = key_node.value
        if name in JAX_PER_TASK_ENV:
            raise BadValue(line_of(key_node), sub_field("env", name), f"{name} is set by tfcluster for each task",
                           hint="mode keras-jax gives every process its id, the process count and the coordinator")
        if name == KERAS_BACKEND_ENV and value.value != "jax":
            raise BadValue(line_of(key_node), sub_field("env", name),
                           f"mode keras-jax runs Keras on JAX, but env: sets {name}={value.value!r}",
                           hint=f"drop {name} from env: (tfcluster sets it to jax)")


def _script(node: yaml.Node, value: str, base_dir: str) -> str:
    if value.startswith("template:"):
        return _template(node, value[len("template:"):])
    return os.path.abspath(os.path.join(base_dir, value))


def _template(node: yaml.Node, name: str) -> str:
    names = templates.template_names()
    if name not in names:
        problem = suggest(name, names, "template") if names else f"unknown template {name!r}; none are installed"
        raise BadValue(line_of(node), "train.script", problem)
    return templates.template_path(name)


def _files(node: yaml.Node, base_dir: str) -> list[tuple[str, int]]:
    """(path as written, line) per entry."""
    out = []
    for i, item in enumerate(as_list(node, "train.files")):
        value = as_path(item, sub_field("train.files", i))
        if not value:   # it would join to the spec's directory and ship all of it
            raise BadValue(line_of(item), sub_field("train.files", i),
                       f"not found: {os.path.join(base_dir, value)}",
                       hint="file paths are relative to the spec's directory")
        out.append((value, line_of(item)))
    return out


def _outside(node: yaml.Node) -> list[tuple[str, int]]:
    """train.allow_outside: (directory as written, line) per entry; whether each is a
    directory is check_train_files' business, like the files themselves."""
    out = []
    for i, item in enumerate(as_list(node, "train.allow_outside")):
        value = as_path(item, sub_field("train.allow_outside", i))
        if not value:
            raise BadValue(line_of(item), sub_field("train.allow_outside", i), "must name a directory, got an empty string")
        out.append((value, line_of(item)))
    return out


def _args(node: yaml.Node) -> list[tuple[str, int]]:
    out = []
    for i, item in enumerate(as_list(node, "train.args")):
        value = as_str(item, sub_field("train.args", i))
        check_placeholders(value, line_of(item), sub_field("train.args", i))
        out.append((value, line_of(item)))
    return out


def check_placeholders(value: str, line: int, field: str) -> None:
    """Exactly `{name}` with a known name: the planner fills them with str.format."""
    try:
        parts = list(string.Formatter().parse(value))
    except ValueError as exc:
        raise BadValue(line, field, f"malformed placeholder in {value!r} ({exc}); "
                                "write {{ and }} for literal braces") from None
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if name not in PLACEHOLDERS or spec or conversion:
            raise BadValue(line, field, f"unknown placeholder {shown}; known: {', '.join(PLACEHOLDERS)}",
                       hint="write {{ and }} for literal braces")


def _checks(node: yaml.Node) -> Checks:
    f = fields_of(node, "train.checks", _CHECK_KEYS)
    flags = {k: as_bool(f[k][1], f"train.checks.{k}") for k in ("placement", "reachability", "proxy_guard")
             if k in f}
    if "hang_after" in f:
        hang = f["hang_after"][1]
        flags["hang_after"] = 0.0 if _is_off(hang) else _duration_or_off(hang, "train.checks.hang_after")
    return Checks(**flags)


def _checkpoint(node: yaml.Node) -> Checkpoint:
    """train.checkpoint: {dir, keep, sync, max_bytes}; `dir` takes the placeholders train.args does
    ({job} and {index} are the chief's), `sync` a duration or off."""
    f = fields_of(node, "train.checkpoint", _CHECKPOINT_KEYS, required=("dir",))
    directory = as_path(f["dir"][1], "train.checkpoint.dir")
    if not directory:
        raise BadValue(line_of(f["dir"][1]), "train.checkpoint.dir", "must name a directory, got an empty string")
    check_placeholders(directory, line_of(f["dir"][1]), "train.checkpoint.dir")
    if not directory.startswith(("/", "~/", "{workdir}")) and directory != "~":
        # the script's own cwd is its run's directory, new each run; the shims' is the home
        raise BadValue(line_of(f["dir"][1]), "train.checkpoint.dir",
                       f"must be absolute, start with ~/ or {{workdir}}, got {directory!r}: relative to what the "
                       "script sees, its run's directory, it would be a new one each run (nothing to resume from)",
                       hint=f"dir: '{{workdir}}/{directory}' (the same path in the script's --model_dir or "
                            "checkpoint code)")
    sync: float | None = Checkpoint.sync
    if "sync" in f:
        sync_node = f["sync"][1]
        off = is_plain(sync_node) and sync_node.value.lower() in ("off", "false")
        sync = None if off else _duration_or_off(sync_node, "train.checkpoint.sync",
                                                 hint="off: the checkpoints are on a filesystem every host shares")
    return Checkpoint(
        dir=directory,
        keep=as_int(f["keep"][1], "train.checkpoint.keep", 1, MAX_CHECKPOINTS_KEPT) if "keep" in f else Checkpoint.keep,
        sync=sync,
        line=line_of(node),
        max_bytes=_size(f["max_bytes"][1], "train.checkpoint.max_bytes", *_MAX_BYTES_RANGE)
        if "max_bytes" in f else Checkpoint.max_bytes,
    )


def _size(node: yaml.Node, field: str, lo: int, hi: int) -> int:
    """A size: `17179869184`, `16GiB`, `500 MB`; from `lo` to `hi` bytes."""
    found = _SIZE_RE.fullmatch(node.value) if is_plain(node) else None
    if found is None or (found.group(2) is None and "." in found.group(1)):
        raise BadValue(line_of(node), field, f"must be a size in bytes (17179869184, 16GiB, 500MB), "
                                             f"got {kind_of(node, typed=True)}")
    number, unit = found.group(1), _SIZE_UNITS[found.group(2)]
    value = int(float(number) * unit) if "." in number else int(number) * unit
    if not lo <= value <= hi:
        raise BadValue(line_of(node), field, f"must be from 1 MiB to 1 PiB, got {node.value[:20]}")
    return value


def _duration_or_off(node: yaml.Node, field: str, hint: str | None = None) -> float:
    """A duration where `off` is the other answer (the caller took that one): the error says both."""
    seconds = parse_duration(node.value if isinstance(node, yaml.ScalarNode) else "")
    if seconds is None:
        raise BadValue(line_of(node), field, f"must be {DURATION_WORDS}, or off; got {kind_of(node, typed=True)}",
                       hint=hint)
    return seconds


def _is_off(node: yaml.Node) -> bool:
    return is_plain(node) and node.value.lower() in ("0", "false", "off")


def _tensorboard(node: yaml.Node) -> str:
    value = as_path(node, "train.tensorboard")
    if not value:
        raise BadValue(line_of(node), "train.tensorboard", "must name a log directory, got an empty string")
    check_placeholders(value, line_of(node), "train.tensorboard")
    return value


def _image(node: yaml.Node) -> str:
    value = as_path(node, "train.image")
    if not value or any(c.isspace() for c in value):
        raise BadValue(line_of(node), "train.image", f"must be a container image reference, got {value!r}",
                   hint="e.g. image: tensorflow/tensorflow:2.15.0-gpu")
    return value


def _restart(node: yaml.Node) -> Restart:
    f = fields_of(node, "train.restart", ("policy", "max_restarts"))
    policy = (as_choice(f["policy"][1], "train.restart.policy", RESTART_POLICIES, "restart policy")
              if "policy" in f else Restart.policy)
    most = (as_int(f["max_restarts"][1], "train.restart.max_restarts", 0, 1_000_000)
            if "max_restarts" in f else Restart.max_restarts)
    if "max_restarts" in f and "policy" not in f:     # the default `never`: nothing would restart
        raise BadValue(line_of(f["max_restarts"][1]), "train.restart.max_restarts",
                   "restarts nothing without a policy (the default is never): set "
                   "train.restart.policy to on-failure or exit-code")
    return Restart(policy=policy, max_restarts=most)
