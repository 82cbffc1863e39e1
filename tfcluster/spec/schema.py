"""The spec's schema: its sections (env, ssh, hosts, jobs, train) read off the node tree.

`_build` turns the root node into a `Spec`; every field is checked where it is read, so
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
from tfcluster.spec.addresses import _USER_RE, _address, _jump_host
from tfcluster.spec.envs import parse_env, parse_names
from tfcluster.spec.layout import _per_host, _task_count
from tfcluster.spec.model import (HOST_KEY_POLICIES, JOB_NAMES, LOCAL_ADDRESSES, MAX_TASKS, MODES,
                                  PLACEHOLDERS, RESTART_POLICIES, Checks, Host, Job, Progress, Restart,
                                  Spec, SshSettings, Train)
from tfcluster.spec.progress import parse_progress
from tfcluster.spec.yamltree import (_AnyKey, _Bad, _bool, _choice, _duration, _fields, _int,
                                     _is_plain, _line, _list, _name, _path, _positive, _str, _sub,
                                     _suggest, _word)

_TOP_KEYS = ("name", "python", "workdir", "env", "secret_env", "public_env", "ssh", "hosts", "jobs",
             "train")
_SSH_KEYS = ("user", "port", "identity_file", "known_hosts", "host_key_policy", "jump_host",
             "connect_timeout")
_HOST_KEYS = ("name", "address", "gpus", "ssh")
_JOB_KEYS = ("count", "per_gpu", "hosts", "port", "gpus", "tasks")
_TRAIN_KEYS = ("mode", "script", "files", "allow_outside", "args", "restart", "timeout", "checks",
               "tensorboard", "image", "progress")
_CHECK_KEYS = ("placement", "reachability", "proxy_guard", "hang_after")


def _build(path: str, root: yaml.Node) -> tuple[Spec, dict[str, int]]:
    """The spec, and the lines of its `jobs:` key (where a missing job is reported) and its
    `env:` key (0 without one)."""
    f = _fields(root, "", _TOP_KEYS, required=("name", "hosts", "jobs"))
    value = {k: v for k, (_, v) in f.items()}
    ssh = _parse_ssh(value["ssh"], "ssh") if "ssh" in f else {}
    hosts = _parse_hosts(value["hosts"], ssh)
    base_dir = os.path.dirname(os.path.abspath(path))
    env = parse_env(value["env"], _line(f["env"][0])) if "env" in f else ()
    secret = parse_names(value["secret_env"], "secret_env", env) if "secret_env" in f else ()
    spec = Spec(
        path=path,
        name=_name(value["name"], "name"),
        python=_word(value["python"], "python") if "python" in f else Spec.python,
        workdir=_workdir(value["workdir"]) if "workdir" in f else Spec.workdir,
        env=env,
        secret_env=secret,
        public_env=parse_names(value["public_env"], "public_env", env, secret) if "public_env" in f else (),
        hosts=hosts,
        jobs=_parse_jobs(value["jobs"], {h.name: h for h in hosts}),
        train=_parse_train(value["train"], base_dir) if "train" in f else Train(),
    )
    return spec, {"jobs": _line(f["jobs"][0]), "env": _line(f["env"][0]) if "env" in f else 0}


def _workdir(node: yaml.Node) -> str:
    """Absolute or under `~`: a relative one would be relative to wherever each command
    runs (the cluster's identity is its resolved directory), a different cluster each time."""
    value = _word(node, "workdir")
    if not (value.startswith("/") or value == "~" or value.startswith("~/")):
        raise _Bad(_line(node), "workdir", f"must be absolute or start with ~/: {value!r}")
    return value


# --------------------------------------------------------------------------- ssh, hosts


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
    _check_job_gpus(job, field, f)
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


def _check_job_gpus(job: Job, field: str, f: dict) -> None:
    if job.name == "ps" and (job.per_gpu or job.gpus):
        key = "per_gpu" if job.per_gpu else "gpus"
        raise _Bad(_line(f[key][0]), _sub(field, key), "ps tasks never get GPUs",
                   hint="ps tasks run with CUDA_VISIBLE_DEVICES=\"\"; remove this key")


def _check_port_room(job: Job, node: yaml.Node, field: str, hosts: dict[str, Host]) -> None:
    # ports count up per host, so the last one must still be a port
    for name, n in _per_host(job, hosts).items():
        if job.port is not None and job.port + n - 1 > 65535:
            raise _Bad(_line(node), field,
                       f"{n} tasks on host {name} need ports {job.port}-{job.port + n - 1}, "
                       "past 65535")


# --------------------------------------------------------------------------- train

def _parse_train(node: yaml.Node, base_dir: str) -> Train:
    """train: as written. Paths are checked for syntax only: whether the script and files
    exist is check_train_files' business, so commands that never ship them (down, status,
    logs) still work once a script has moved. Fields are read in file-schema order so the
    first problem reported stays the same."""
    f = _fields(node, "train", _TRAIN_KEYS)
    value = {k: v for k, (_, v) in f.items()}
    mode = _choice(value["mode"], "train.mode", MODES, "mode") if "mode" in f else MODES[0]
    source = _path(value["script"], "train.script") if "script" in f else None
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
        timeout=_duration(value["timeout"], "train.timeout") if "timeout" in f else None,
        checks=_checks(value["checks"]) if "checks" in f else Checks(),
        tensorboard=_tensorboard(value["tensorboard"]) if "tensorboard" in f else None,
        image=_image(value["image"]) if "image" in f else None,
        progress=parse_progress(value["progress"]) if "progress" in f else Progress(),
        args_line=_line(value["args"]) if "args" in f else 0,
        args_lines=tuple(line for _, line in args),
        allow_outside=tuple(d for d, _ in outside),
        allow_outside_lines=tuple(line for _, line in outside),
        script_source=source,
        script_line=_line(value["script"]) if "script" in f else 0,
        files_lines=tuple(line for _, line in files),
    )


def _script(node: yaml.Node, value: str, base_dir: str) -> str:
    if value.startswith("template:"):
        return _template(node, value[len("template:"):])
    return os.path.abspath(os.path.join(base_dir, value))


def _template(node: yaml.Node, name: str) -> str:
    names = templates.template_names()
    if name not in names:
        problem = _suggest(name, names, "template") if names else f"unknown template {name!r}; none are installed"
        raise _Bad(_line(node), "train.script", problem)
    return templates.template_path(name)


def _files(node: yaml.Node, base_dir: str) -> list[tuple[str, int]]:
    """(path as written, line) per entry."""
    out = []
    for i, item in enumerate(_list(node, "train.files")):
        value = _path(item, _sub("train.files", i))
        if not value:   # it would join to the spec's directory and ship all of it
            raise _Bad(_line(item), _sub("train.files", i),
                       f"not found: {os.path.join(base_dir, value)}",
                       hint="file paths are relative to the spec's directory")
        out.append((value, _line(item)))
    return out


def _outside(node: yaml.Node) -> list[tuple[str, int]]:
    """train.allow_outside: (directory as written, line) per entry; whether each is a
    directory is check_train_files' business, like the files themselves."""
    out = []
    for i, item in enumerate(_list(node, "train.allow_outside")):
        value = _path(item, _sub("train.allow_outside", i))
        if not value:
            raise _Bad(_line(item), _sub("train.allow_outside", i), "must name a directory, got an empty string")
        out.append((value, _line(item)))
    return out


def _args(node: yaml.Node) -> list[tuple[str, int]]:
    out = []
    for i, item in enumerate(_list(node, "train.args")):
        value = _str(item, _sub("train.args", i))
        _check_placeholders(value, _line(item), _sub("train.args", i))
        out.append((value, _line(item)))
    return out


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


def _checks(node: yaml.Node) -> Checks:
    f = _fields(node, "train.checks", _CHECK_KEYS)
    flags = {k: _bool(f[k][1], f"train.checks.{k}") for k in ("placement", "reachability", "proxy_guard")
             if k in f}
    if "hang_after" in f:
        hang = f["hang_after"][1]
        flags["hang_after"] = 0.0 if _is_off(hang) else _duration(hang, "train.checks.hang_after")
    return Checks(**flags)


def _is_off(node: yaml.Node) -> bool:
    return _is_plain(node) and node.value.lower() in ("0", "false", "off")


def _tensorboard(node: yaml.Node) -> str:
    value = _path(node, "train.tensorboard")
    if not value:
        raise _Bad(_line(node), "train.tensorboard", "must name a log directory, got an empty string")
    _check_placeholders(value, _line(node), "train.tensorboard")
    return value


def _image(node: yaml.Node) -> str:
    value = _path(node, "train.image")
    if not value or any(c.isspace() for c in value):
        raise _Bad(_line(node), "train.image", f"must be a container image reference, got {value!r}",
                   hint="e.g. image: tensorflow/tensorflow:2.15.0-gpu")
    return value


def _restart(node: yaml.Node) -> Restart:
    f = _fields(node, "train.restart", ("policy", "max_restarts"))
    policy = (_choice(f["policy"][1], "train.restart.policy", RESTART_POLICIES, "restart policy")
              if "policy" in f else Restart.policy)
    most = (_int(f["max_restarts"][1], "train.restart.max_restarts", 0, 1_000_000)
            if "max_restarts" in f else Restart.max_restarts)
    if "max_restarts" in f and "policy" not in f:     # the default `never`: nothing would restart
        raise _Bad(_line(f["max_restarts"][1]), "train.restart.max_restarts",
                   "restarts nothing without a policy (the default is never): set "
                   "train.restart.policy to on-failure or exit-code")
    return Restart(policy=policy, max_restarts=most)
