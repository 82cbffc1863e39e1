"""Limits against blow-ups: a page of YAML must not make a plan of gigabytes.

Every task's TF_CONFIG lists the whole cluster and a `{worker_hosts}` argument does too,
so a plan grows with the square of the task count. These checks compute the sizes the
plan *would* have, from the placed tasks, before anything is built (docs/design/spec-safety.md, "Spec safety").
"""
from __future__ import annotations

import string

from tfcluster.spec.envs import secret_in, secret_problem
from tfcluster.spec.model import MAX_ARG_BYTES, MAX_ARGS, MAX_PLAN_BYTES, MAX_TASK_BYTES, Slot, Spec, url_password
from tfcluster.spec.yamltree import BadValue

OVERHEAD = 64       # bytes a plan spends per env entry or argument besides its text
FIXED_ENV = 512     # tfcluster's own variables per task (TFCLUSTER_*, CUDA_VISIBLE_DEVICES, ...)


def _arg_field(spec: Spec, i: int) -> tuple[int, str]:
    """(line, field) of argument i: the spec's train.args[i], or one from the command line."""
    lines = spec.train.args_lines
    if lines:
        return lines[i], f"train.args[{i}]"
    return 0, f"script argument {i + 1}"


def url_problem(url: str) -> tuple[str, str]:
    """(problem, hint) for an argument holding a URL with a password (`url`, masked)."""
    return (f"holds the password of a URL ({url}); script arguments are visible in `ps` on every "
            "host: read it from the environment",
            "put the URL in env: under a secret name (DB_URL with secret_env: [DB_URL], or a name "
            "with PASS, TOKEN, DSN...), which travels on the shim's stdin and is shown as ***, and "
            "read os.environ in the script")


def check_args(spec: Spec) -> None:
    """train.args (or the command line's): how many, and none carrying a secret env value
    or a URL's password."""
    args, secrets = spec.train.args, spec.secrets()
    if len(args) > MAX_ARGS:
        where = (spec.train.args_line, "train.args") if spec.train.args_lines else (0, "script arguments")
        raise BadValue(*where, f"{len(args)} arguments; at most {MAX_ARGS}")
    for i, arg in enumerate(args):
        name = secret_in(arg, secrets)
        if name:
            raise BadValue(*_arg_field(spec, i), *secret_problem(name))
        url = url_password(arg)
        if url:
            raise BadValue(*_arg_field(spec, i), *url_problem(url))


def check_tensorboard(spec: Spec) -> None:
    """train.tensorboard (or --tensorboard) goes on TensorBoard's command line, visible in `ps`
    on the chief's host as an argument is: no secret env value, no URL's password."""
    logdir = spec.train.tensorboard
    if logdir is None:
        return
    line, field = (spec.train.tensorboard_line, "train.tensorboard") if spec.train.tensorboard_line \
        else (0, "--tensorboard")
    name = secret_in(logdir, spec.secrets())
    if name:
        raise BadValue(line, field, f"contains the value of secret env {name}; TensorBoard's --logdir is "
                                    "visible in `ps` on the chief's host",
                       hint=f"if {name} is not secret, list it in public_env")
    url = url_password(logdir)
    if url:
        raise BadValue(line, field, f"holds the password of a URL ({url}); TensorBoard's --logdir is visible "
                                    "in `ps` on the chief's host, and in plans and manifests",
                       hint="give TensorBoard the storage's credentials through env: (AWS_SECRET_ACCESS_KEY, "
                            "GOOGLE_APPLICATION_CREDENTIALS, ...), not in the URL")


def _values(spec: Spec, slots: tuple[Slot, ...]) -> dict[str, int]:
    """The length of every placeholder's value, the longest any task gets."""
    addresses = {h.name: h.address for h in spec.hosts}
    hosts = {"chief": -1, "ps": -1, "worker": -1}    # one comma fewer than entries
    for s in slots:
        if s.job in hosts:
            hosts[s.job] += len(addresses[s.host]) + 1 + len(str(s.port)) + 1
    workers = sum(1 for s in slots if s.job == "worker")
    return {
        "workdir": len(spec.workdir) + 1 + len(spec.name),
        "num_workers": len(str(workers)),
        **{f"{job}_hosts": max(n, 0) for job, n in hosts.items()},
        "job": max((len(s.job) for s in slots), default=0),
        "index": max((len(str(s.index)) for s in slots), default=1),
    }


def expanded_size(arg: str, values: dict[str, int]) -> int:
    """Bytes of `arg` with its placeholders filled (the longest of any task)."""
    return sum(len(text.encode("utf-8", "surrogatepass")) + (values[name] if name else 0)
               for text, name, _, _ in string.Formatter().parse(arg))


def check_plan_size(spec: Spec, slots: tuple[Slot, ...], jobs_line: int, env_line: int) -> None:
    """Each argument after expansion, each task, and the whole plan, within their limits."""
    values = _values(spec, slots)
    sizes = [expanded_size(a, values) for a in spec.train.args]
    for i, size in enumerate(sizes):
        if size > MAX_ARG_BYTES:
            raise BadValue(*_arg_field(spec, i),
                       f"expands to {size} bytes; one argument may be at most {MAX_ARG_BYTES} "
                       "(execve's MAX_ARG_STRLEN)", hint=_HINT)
    cluster = sum(values[f"{job}_hosts"] + 16 for job in ("chief", "ps", "worker"))
    parts = {"jobs": cluster + 64,          # TF_CONFIG
             "env": FIXED_ENV + sum(len(k) + len(v) + 2 for k, v in spec.env),
             "train.args": sum(sizes)}
    lines = {"jobs": jobs_line, "env": env_line, "train.args": spec.train.args_line}
    field = max(parts, key=parts.get)        # the field named: the largest part
    largest = f"the largest part is {_PARTS[field]}"
    task = sum(parts.values())
    if task > MAX_TASK_BYTES:
        raise BadValue(lines[field], field,
                   f"a task's TF_CONFIG, env and arguments come to {task} bytes ({largest}); "
                   f"at most {MAX_TASK_BYTES}, as execve takes about 2 MiB", hint=_HINT)
    per_task = task + OVERHEAD * (len(spec.env) + len(spec.train.args) + 12)
    total = per_task * len(slots)
    if total > MAX_PLAN_BYTES:
        raise BadValue(lines[field], field,
                   f"{len(slots)} tasks × {per_task} bytes each (TF_CONFIG, env and arguments; "
                   f"{largest}) make a plan of {total / 2**20:.0f} MiB; at most "
                   f"{MAX_PLAN_BYTES >> 20} MiB", hint=_HINT)


_PARTS = {"jobs": "TF_CONFIG, which lists every task", "env": "env", "train.args": "the arguments"}


_HINT = ("TF_CONFIG and each {ps_hosts}/{worker_hosts} argument list every task, so they grow "
         "with the cluster: fewer tasks, or read the cluster from TF_CONFIG in the script")
