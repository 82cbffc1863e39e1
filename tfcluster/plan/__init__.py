"""Spec -> Plan: a pure function (no I/O, no clock, no environment reads).

The plan says, for every host, how to reach it and which interpreter runs there,
and for every task where it runs, which GPUs it sees, its TF_CONFIG, its
environment and its exact command. Everything later (up, down, train, exec) takes
only the plan, so tests compare whole plans and nothing past this module reads the
spec. The one environment fact a plan depends on, the interpreter running
tfcluster, is an argument.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace

from tfcluster.host import HOST_DIR
from tfcluster.plan.names import task_key
from tfcluster.spec import (
    JAX_CPU_COLLECTIVES_ENV,
    JOB_NAMES,
    KERAS_BACKEND_ENV,
    LEGACY_KERAS_ENV,
    LEGACY_KERAS_VALUES,
    Checks,
    Progress,
    Restart,
    Slot,
    Spec,
    has_userinfo,
    is_secret,
    layout_tasks,
    mask_userinfo,
)
from tfcluster.spec.addresses import machine_of
from tfcluster.spec.model import JAX_PER_TASK_ENV, STOP_GRACE
from tfcluster.spec.shipped import ScriptScan
from tfcluster.transport.options import SshOptions

DEFAULT_PYTHON = Spec.python

REDACTED = "***"                         # for env names is_secret picks (the rule lives in spec)

# Which jobs get a tfcluster-started server, and which run the user's script, per mode.
SERVER_JOBS = {
    "between-graph": ("chief", "ps", "worker"),
    "classic": (),
    "coordinator": ("ps", "worker"),
    "mirrored": (),
    "keras-jax": (),
}
SCRIPT_JOBS = {
    "between-graph": ("chief", "worker", "evaluator"),
    "classic": ("chief", "ps", "worker", "evaluator"),
    "coordinator": ("chief", "evaluator"),
    "mirrored": ("chief", "worker", "evaluator"),
    "keras-jax": ("worker",),
}
# Env defaults the spec may override; everything tfcluster-specific it may not.
# TF's C++ INFO lines reach the saved logs and the hang watchdog; the live view hides them.
ENV_DEFAULTS = {"PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "0"}


@dataclass(frozen=True)
class HostPlan:
    name: str
    address: str
    local: bool
    gpus: int
    python: str                          # the interpreter every process on this host runs
    bindir: str                          # where the shim and the TF server live there
    ssh: SshOptions | None = None        # None for a local host
    preemptible: str = "no"              # whose notices a run watches for here (spec.model.PREEMPTIBLE)
    metadata_url: str | None = None      # the metadata service's base URL (None: 169.254.169.254)

    @property
    def watched(self) -> str:
        """How `plan` says this host's notices are watched."""
        if self.preemptible == "no":
            return "not watched (preemptible: no)"
        how = "whichever cloud's metadata service answers (auto)" if self.preemptible == "auto" else \
            f"{self.preemptible} notices"
        return f"watched ({how}" + (f", at {self.metadata_url})" if self.metadata_url else ")")

    @property
    def in_process(self) -> bool:
        """The shim runs from the package on tfcluster's own interpreter: one-shot commands
        need no process (shim_protocol.IN_PROCESS)."""
        return runs_in_process(self.bindir)


@dataclass(frozen=True)
class TaskPlan:
    job: str
    index: int
    host: str
    address: str
    port: int
    gpus: tuple[int, ...]
    is_chief: bool
    runs_server: bool
    tf_config: str                       # JSON, sorted keys
    env: tuple[tuple[str, str], ...]     # sorted by name; run-independent
    argv: tuple[str, ...] = ()           # the script and its arguments (no interpreter); ()
                                         # when no script runs here
    script_env: tuple[tuple[str, str], ...] = ()  # what the script's env changes from `env`

    @property
    def key(self) -> str:
        return task_key(self.job, self.index)

    @property
    def target(self) -> str:
        return f"{self.address}:{self.port}"

    @property
    def runs_script(self) -> bool:
        return bool(self.argv)


@dataclass(frozen=True)
class CheckpointPlan:
    """train.checkpoint as the run uses it (docs/spec.md, "Spare hosts")."""

    dir: str                             # on the chief's host, placeholders filled; may start with "~/"
    keep: int
    sync: float | None                   # seconds between copies to this machine; None: off
    max_bytes: int = 16 << 30            # the largest checkpoint a sync copies (spec.Checkpoint)


@dataclass(frozen=True)
class _Source:
    """What build_plan was given, so that Plan.moved re-plans the same spec."""

    spec: Spec
    local_python: str


@dataclass(frozen=True)
class Plan:
    name: str
    mode: str
    python: str
    cluster_dir: str                     # workdir/name, possibly starting with "~/"
    cluster: tuple[tuple[str, tuple[str, ...]], ...]
    tasks: tuple[TaskPlan, ...]
    spec_digest: str
    all_hosts: tuple[HostPlan, ...] = ()  # every host of the spec, by name
    script: str | None = None            # local path of the training script
    # (local path, path in the run dir, bytes), script first, as check_train_files listed them;
    # () when not checked (only `train` and `plan` check), with files_problem when refused
    files: tuple[tuple[str, str, int], ...] = ()
    files_problem: str | None = None
    secret_env: tuple[str, ...] = ()     # the spec's explicit lists (is_secret)
    public_env: tuple[str, ...] = ()
    restart: Restart = field(default_factory=Restart)
    timeout: float | None = None
    stop_grace: float = STOP_GRACE      # train.stop_grace: a script's SIGTERM-to-KILL seconds
    checks: Checks = field(default_factory=Checks)
    tensorboard: str | None = None       # LOGDIR on the chief's host, placeholders filled
    args: tuple[str, ...] = ()           # train.args as written (placeholders unfilled): the
                                         # engines of `render` fill them where the tasks run
    image: str | None = None             # train.image, for `render --to tfjob`
    progress: Progress = field(default_factory=Progress)   # train.progress, for metrics.py
    # Every task has TF_USE_LEGACY_KERAS set (train.keras: legacy, or the spec's env): its
    # `tf.keras` is tf_keras, which preflight requires (docs/modes.md, "Keras").
    legacy_keras: bool = False
    script_fits: bool | None = None      # the script calls `.fit(` (None: not read)
    script_scan: ScriptScan | None = None  # what its text says (spec.scan_scripts; None: not read)
    tf_ports: str = "auto"               # spec.tf_ports: close the task ports (auto, closed) or not
    # A lost host's tasks and where they may go (docs/spec.md, "Spare hosts"): the hosts marked
    # spare, in spec order (all_hosts has them; `hosts` only once a move gave them tasks), what
    # a run does when a host is lost (spare, shrink, fail: the spec's default resolved), and the
    # (lost host, spare) moves this plan applies, in order.
    spares: tuple[str, ...] = ()
    warm_spares: tuple[str, ...] = ()    # `spare: warm`: each keeps a standby (launch/run/standbys.py)
    on_host_loss: str = "fail"
    checkpoint: CheckpointPlan | None = None
    moves: tuple[tuple[str, str], ...] = ()
    source: _Source | None = field(default=None, compare=False, repr=False)

    @property
    def chief(self) -> TaskPlan | None:
        """The task whose script is the chief (None when no script runs)."""
        return next((t for t in self.tasks if t.is_chief and t.runs_script), None)

    @property
    def spec_path(self) -> str:
        """The spec's path as the command line gave it, for the commands a hint prints."""
        return self.source.spec.path if self.source is not None else "SPEC"

    def probes(self) -> str:
        """What the start-up probe reports in a script process ("" : no probe): the
        variables' placement, and model-not-ready waits, for TF1-style modes only."""
        if self.mode not in ("between-graph", "classic"):
            return ""
        wanted = (("placement", self.checks.placement), ("waits", self.checks.hang_after > 0))
        return ",".join(name for name, on in wanted if on)

    def is_secret(self, env_name: str) -> bool:
        """Whether env `env_name` is secret in this plan (the spec's rule and its lists)."""
        return is_secret(env_name, self.secret_env, self.public_env)

    def keeps_secret(self, env_name: str, value: str) -> bool:
        """Whether a rendered job must leave the value out: a secret name, or a URL's
        credentials in the value (has_userinfo)."""
        return self.is_secret(env_name) or has_userinfo(value)

    def task(self, key: str) -> TaskPlan:
        for t in self.tasks:
            if t.key == key:
                return t
        raise KeyError(key)

    def host(self, name: str) -> HostPlan:
        for h in self.all_hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def hosts_named(self, names) -> tuple[HostPlan, ...]:
        return tuple(self.host(n) for n in names)

    def command(self, task: TaskPlan, role: str = "script") -> tuple[str, ...]:
        """Exactly what runs for a task's script or server, interpreter included."""
        host = self.host(task.host)
        if role == "server":
            return (host.python, f"{host.bindir}/tfserver.py")
        return (host.python, *task.argv)

    @property
    def hosts(self) -> tuple[str, ...]:
        """Host names that run at least one task, in first-use order."""
        return tuple(dict.fromkeys(t.host for t in self.tasks))

    def tasks_on(self, host: str) -> tuple[TaskPlan, ...]:
        return tuple(t for t in self.tasks if t.host == host)

    def spare_problem(self, spare: str, lost: str) -> str | None:
        """Why `spare` cannot take every task of `lost` (None: it can): too few GPUs for them
        beside what it holds already, or a port of theirs taken by a task on its machine."""
        moving = self.tasks_on(lost)
        host = self.host(spare)
        need = sum(len(t.gpus) for t in moving) + sum(len(t.gpus) for t in self.tasks_on(spare))
        if need > host.gpus:
            return f"needs {need} GPU{'' if need == 1 else 's'}, has {host.gpus}"
        machine = machine_of(host.address)
        taken = {t.port: t for t in self.tasks if t.host != lost and machine_of(t.address) == machine}
        clash = next((t for t in moving if t.port in taken), None)
        if clash is not None:
            return f"port {clash.port} ({clash.key}) is {taken[clash.port].key}'s on its machine"
        return None

    def spare_for(self, lost: str, used: Iterable[str] = ()) -> str | None:
        """The first spare (spec order) not in `used`, holding no task yet, that can take
        every task of `lost` (spare_problem); None when none can or `lost` holds no task."""
        if not self.tasks_on(lost):
            return None
        skip = set(used)
        return next((s for s in self.spares if s not in skip and s != lost and not self.tasks_on(s)
                     and self.spare_problem(s, lost) is None), None)

    def moved(self, lost: str, spare: str) -> Plan:
        """The same spec planned again with every task of `lost` on `spare`: same job, index
        and port, GPUs numbered from 0 on the spare, and every TF_CONFIG, placeholder and
        address following. ValueError when `spare` is not a spare or `lost` holds no task."""
        if self.source is None:
            raise ValueError("this plan was not made by build_plan: it cannot be planned again")
        if spare not in self.spares:
            raise ValueError(f"{spare} is not a spare host of this plan (spares: {', '.join(self.spares) or 'none'})")
        if not self.tasks_on(lost):
            raise ValueError(f"host {lost} holds no task of this plan")
        return build_plan(self.source.spec, self.source.local_python, files=self.files,
                          files_problem=self.files_problem, script_fits=self.script_fits,
                          script_scan=self.script_scan,
                          moves=(*self.moves, (lost, spare)))


def redact_env(env: tuple[tuple[str, str], ...] | dict[str, str], marked=(), public=()) -> dict[str, str]:
    """`env` as shown: every secret value (is_secret, with the spec's secret_env and
    public_env) as ***, and a URL's userinfo in any other as *** (mask_userinfo)."""
    items = env.items() if isinstance(env, dict) else env
    return {k: (REDACTED if is_secret(k, marked, public) else mask_userinfo(v)) for k, v in items}


def env_redactor(marked=(), public=()):
    """redact_env for many envs that share their names (every task of a plan): each name is
    judged once."""
    secret: dict[str, bool] = {}

    def redact(env) -> dict[str, str]:
        out = {}
        for k, v in (env.items() if isinstance(env, dict) else env):
            s = secret.get(k)
            if s is None:
                s = secret[k] = is_secret(k, marked, public)
            out[k] = REDACTED if s else mask_userinfo(v)
        return out
    return redact


def interpreter(spec_python: str, local: bool, local_python: str) -> str:
    """The one decision of which Python runs on a host: the spec's, except that a local
    host left at the default `python3` runs tfcluster's own (it has TensorFlow when
    tfcluster was installed with [tf]; a `python3` on PATH outside the venv may not)."""
    return local_python if local and spec_python == DEFAULT_PYTHON else spec_python


def shim_bindir(local: bool, python: str, cluster_dir: str, local_python: str | None = None) -> str:
    """The one decision of where a host's shim and TF server live: tfcluster's own
    interpreter on this machine runs them straight from the package (and answers one-shot
    commands in-process); every other host from the cluster's bin directory."""
    own = local and python == (local_python or sys.executable)
    return HOST_DIR if own else f"{cluster_dir}/bin"


def runs_in_process(bindir: str) -> bool:
    """`bindir` (shim_bindir's) is the package's own: the host is answered in-process."""
    return bindir == HOST_DIR


def _host_plan(host, spec: Spec, cluster_dir: str, local_python: str) -> HostPlan:
    python = interpreter(spec.python, host.local, local_python)
    # the spec's SshSettings and the transport's SshOptions carry the same fields; neither
    # layer imports the other, so the plan copies one into the other by name
    ssh = None if host.local else SshOptions(**{f.name: getattr(host.ssh, f.name)
                                                for f in fields(SshOptions)})
    return HostPlan(name=host.name, address=host.address, local=host.local, gpus=host.gpus,
                    python=python, bindir=shim_bindir(host.local, python, cluster_dir, local_python), ssh=ssh,
                    preemptible=host.preemptible, metadata_url=host.metadata_url)


def build_plan(spec: Spec, local_python: str | None = None, *,
               files: tuple[tuple[str, str, int], ...] = (), files_problem: str | None = None,
               script_fits: bool | None = None, script_scan: ScriptScan | None = None,
               moves: tuple[tuple[str, str], ...] = ()) -> Plan:
    """`local_python`: the interpreter running tfcluster (default sys.executable). `files`:
    what check_train_files listed (the plan of a command that ships nothing has none).
    `script_fits`: whether the script calls `.fit(` (spec.script_calls_fit; None: not read).
    `moves`: (lost host, spare) pairs, applied in order (Plan.moved)."""
    local_python = local_python or sys.executable
    slots = _move(spec, layout_tasks(spec), moves)
    addresses = {h.name: h.address for h in spec.hosts}
    cluster_dir = _join(spec.workdir, spec.name)
    cluster = _cluster_dict(spec.train.mode, slots, addresses)
    chief = "chief:0" if any(s.job == "chief" for s in slots) else "worker:0"
    placeholders = {
        "workdir": cluster_dir,
        "num_workers": str(sum(1 for s in slots if s.job == "worker")),
        **{f"{job}_hosts": ",".join(cluster.get(job, ())) for job in ("chief", "ps", "worker")},
    }
    # Every TF_CONFIG embeds the whole cluster: serialise it once, not once per task
    # (1,000 tasks would otherwise cost 1,000 dumps of a 1,000-entry cluster).
    cluster_json = json.dumps(cluster, sort_keys=True, separators=(",", ":"))
    tasks = tuple(
        _task_plan(spec, slot, addresses[slot.host], cluster_json, chief, placeholders)
        for slot in slots
    )
    return Plan(
        name=spec.name,
        mode=spec.train.mode,
        python=spec.python,
        cluster_dir=cluster_dir,
        cluster=tuple((job, tuple(cluster[job])) for job in JOB_NAMES if job in cluster),
        tasks=tasks,
        spec_digest=spec.digest,
        all_hosts=tuple(_host_plan(h, spec, cluster_dir, local_python)
                        for h in sorted(spec.hosts, key=lambda h: h.name)),
        script=spec.train.script,
        files=files,
        files_problem=files_problem,
        secret_env=spec.secret_env,
        public_env=spec.public_env,
        restart=spec.train.restart,
        timeout=spec.train.timeout,
        stop_grace=spec.train.stop_grace,
        checks=spec.train.checks,
        tensorboard=_tensorboard(spec, slots, placeholders),
        args=spec.train.args,
        image=spec.train.image,
        progress=spec.train.progress,
        legacy_keras=spec.train.keras == "legacy" or dict(spec.env).get(LEGACY_KERAS_ENV) in LEGACY_KERAS_VALUES,
        script_fits=script_fits,
        script_scan=script_scan,
        tf_ports=spec.tf_ports,
        spares=tuple(h.name for h in spec.spares),
        warm_spares=tuple(h.name for h in spec.spares if h.warm),
        on_host_loss=spec.train.on_host_loss or ("spare" if spec.spares else "fail"),
        checkpoint=_checkpoint(spec, slots, placeholders),
        moves=tuple(moves),
        source=_Source(spec, local_python),
    )


def _move(spec: Spec, slots: tuple[Slot, ...], moves: tuple[tuple[str, str], ...]) -> tuple[Slot, ...]:
    """The slots with each move applied in turn: a lost host's tasks on its spare, whose
    GPUs are numbered from 0 in task order (a spare holds no task of its own)."""
    if not moves:
        return slots
    for lost, spare in moves:
        slots = tuple(replace(s, host=spare) if s.host == lost else s for s in slots)
    spares = {h.name: h for h in spec.spares}
    used: dict[str, int] = {}
    out = []
    for slot in slots:
        if slot.host in spares:
            start = used.get(slot.host, 0)
            used[slot.host] = start + len(slot.gpus)
            if used[slot.host] > spares[slot.host].gpus:
                raise ValueError(f"spare {slot.host} has {spares[slot.host].gpus} GPUs, too few for the tasks "
                                 f"moved there")
            slot = replace(slot, gpus=tuple(range(start, start + len(slot.gpus))))
        out.append(slot)
    return tuple(out)


def _tensorboard(spec: Spec, slots, placeholders: dict[str, str]) -> str | None:
    """train.tensorboard with the chief's placeholders filled (TensorBoard runs there)."""
    if not spec.train.tensorboard:
        return None
    return _on_chief(spec.train.tensorboard, slots, placeholders)


def _checkpoint(spec: Spec, slots, placeholders: dict[str, str]) -> CheckpointPlan | None:
    """train.checkpoint with its directory's placeholders filled as the chief's."""
    ckpt = spec.train.checkpoint
    if ckpt is None:
        return None
    return CheckpointPlan(dir=_on_chief(ckpt.dir, slots, placeholders), keep=ckpt.keep, sync=ckpt.sync,
                          max_bytes=ckpt.max_bytes)


def _on_chief(text: str, slots, placeholders: dict[str, str]) -> str:
    chief = next((s for s in slots if s.job == "chief"), None) or next(
        (s for s in slots if s.job == "worker"), None)
    values = {**placeholders, "job": chief.job if chief else "", "index": str(chief.index) if chief else "0"}
    return text.format(**values)


def _join(workdir: str, name: str) -> str:
    return workdir.rstrip("/") + "/" + name


def _cluster_dict(mode: str, slots, addresses: dict[str, str]) -> dict[str, list[str]]:
    """The TF cluster: job -> ["address:port", ...]. The evaluator is never part of it."""
    jobs = ("chief", "worker") if mode == "mirrored" else ("chief", "ps", "worker")
    cluster: dict[str, list[str]] = {}
    for slot in slots:
        if slot.job in jobs:
            cluster.setdefault(slot.job, []).append(f"{addresses[slot.host]}:{slot.port}")
    return cluster


def tf_config_json(cluster_json: str, job: str, index: int) -> str:
    """Exactly json.dumps({"cluster": ..., "task": {...}}, sort_keys=True, compact)."""
    return f'{{"cluster":{cluster_json},"task":{{"index":{index},"type":{json.dumps(job)}}}}}'


def _task_plan(spec: Spec, slot, address: str, cluster_json: str, chief: str, placeholders) -> TaskPlan:
    mode = spec.train.mode
    key = task_key(slot.job, slot.index)
    runs_server = slot.job in SERVER_JOBS[mode]
    tf_config = tf_config_json(cluster_json, slot.job, slot.index)
    env = dict(ENV_DEFAULTS)
    env.update(spec.env)
    env.update({
        "TF_CONFIG": tf_config,
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in slot.gpus),
        "TFCLUSTER_CLUSTER": spec.name,
        "TFCLUSTER_JOB": slot.job,
        "TFCLUSTER_TASK_INDEX": str(slot.index),
        "TFCLUSTER_IS_CHIEF": "1" if key == chief else "0",
        "TFCLUSTER_NUM_WORKERS": placeholders["num_workers"],
    })
    if spec.train.keras == "legacy":     # every task, servers too: one Keras across the cluster
        env[LEGACY_KERAS_ENV] = "1"
    if mode == "keras-jax":
        env.update(jax_env(placeholders["worker_hosts"].split(",")[0], placeholders["num_workers"],
                           slot.index, bool(slot.gpus), spec.env))
    if runs_server:
        env["TFCLUSTER_MASTER"] = f"grpc://{address}:{slot.port}"
    argv: tuple[str, ...] = ()
    if slot.job in SCRIPT_JOBS[mode] and spec.train.script:
        values = {**placeholders, "job": slot.job, "index": str(slot.index)}
        args = tuple(a.format(**values) for a in spec.train.args)
        argv = (os.path.basename(spec.train.script), *args)
    # A between-graph script is only a client of its task's server, which owns the GPU:
    # a client that touched the GPU would take nearly all of its memory by default.
    client_only = mode == "between-graph" and runs_server and argv and slot.gpus
    return TaskPlan(
        job=slot.job, index=slot.index, host=slot.host, address=address, port=slot.port,
        gpus=tuple(slot.gpus), is_chief=key == chief, runs_server=runs_server,
        tf_config=tf_config, env=tuple(sorted(env.items())), argv=argv,
        script_env=(("CUDA_VISIBLE_DEVICES", ""),) if client_only else (),
    )


# The two variables that hold the coordinator's address: an engine that chooses the addresses
# itself (render --to slurm) fills them in where the processes run.
JAX_COORDINATOR_ENV = ("KERAS_DISTRIBUTION_JOB_ADDRESSES", "JAX_COORDINATOR_ADDRESS")
# Every variable jax_env may set: per process, never the spec's env for all.
JAX_ENV = (*JAX_PER_TASK_ENV, KERAS_BACKEND_ENV, JAX_CPU_COLLECTIVES_ENV)


def jax_env(coordinator: str, processes: str, index: int, gpus: bool,
            spec_env: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """What a process of mode keras-jax gets besides every task's variables (docs/modes.md, "Mode
    jax"): the backend, and the coordinator (worker 0's address and port), the process count
    and its id, once in the names `keras.distribution.initialize()` reads and once in the
    names a JAX program passes to `jax.distributed.initialize` (which reads only
    JAX_COORDINATOR_ADDRESS itself). A host without GPUs gets gloo, the CPU collectives that
    run across processes, unless env: names another."""
    env = {KERAS_BACKEND_ENV: "jax", **dict.fromkeys(JAX_COORDINATOR_ENV, coordinator),
           "KERAS_DISTRIBUTION_NUM_PROCESSES": processes, "KERAS_DISTRIBUTION_PROCESS_ID": str(index),
           "JAX_NUM_PROCESSES": processes, "JAX_PROCESS_ID": str(index)}
    if not gpus and JAX_CPU_COLLECTIVES_ENV not in dict(spec_env):
        env[JAX_CPU_COLLECTIVES_ENV] = "gloo"
    return env


def plan_to_dict(plan: Plan, *, redact: bool = True) -> dict:
    """A JSON-ready view of the plan (secrets redacted unless asked otherwise).

    The cluster appears once; each task's TF_CONFIG is {"cluster": <cluster>, "task":
    <tf_config_task>} (repeating the cluster per task would grow with tasks squared)."""
    hosts = {h.name: h for h in plan.all_hosts}
    redactor = env_redactor(plan.secret_env, plan.public_env)

    def task(t: TaskPlan) -> dict:
        env = redactor(t.env) if redact else dict(t.env)
        del env["TF_CONFIG"]
        host = hosts[t.host]
        return {
            "task": t.key, "job": t.job, "index": t.index, "host": t.host,
            "address": t.address, "port": t.port, "gpus": list(t.gpus),
            "chief": t.is_chief, "server": t.runs_server,
            "server_command": [host.python, f"{host.bindir}/tfserver.py"] if t.runs_server else [],
            "script": [host.python, *(map(mask_userinfo, t.argv) if redact else t.argv)] if t.runs_script else [],
            "script_env": dict(t.script_env),
            "tf_config_task": {"type": t.job, "index": t.index}, "env": env,
        }
    restart = plan.restart
    return {
        "name": plan.name, "mode": plan.mode, "python": plan.python,
        "cluster_dir": plan.cluster_dir, "spec_sha256": plan.spec_digest,
        "restart": {"policy": restart.policy, "max_restarts": restart.max_restarts},
        "timeout": plan.timeout,
        "stop_grace": plan.stop_grace,
        "checks": {"placement": plan.checks.placement, "reachability": plan.checks.reachability,
                   "proxy_guard": plan.checks.proxy_guard, "hang_after": plan.checks.hang_after},
        "tensorboard": plan.tensorboard,
        "keras": "legacy" if plan.legacy_keras else "auto",
        "progress": {"step": plan.progress.step, "loss": plan.progress.loss,
                     "target": plan.progress.target},
        "files": [{"path": path, "to": dest, "bytes": size} for path, dest, size in plan.files],
        "files_problem": plan.files_problem,
        "hosts": [{"name": h.name, "address": h.address, "local": h.local, "gpus": h.gpus,
                   "python": h.python, "preemptible": h.preemptible, "metadata_url": h.metadata_url}
                  for h in plan.all_hosts],
        "on_host_loss": plan.on_host_loss,
        "spares": [spare_to_dict(plan, name) for name in plan.spares],
        "moves": [{"lost": lost, "to": spare} for lost, spare in plan.moves],
        "checkpoint": None if plan.checkpoint is None else {
            "dir": plan.checkpoint.dir, "keep": plan.checkpoint.keep, "sync": plan.checkpoint.sync,
            "max_bytes": plan.checkpoint.max_bytes},
        "cluster": {job: list(addrs) for job, addrs in plan.cluster},
        "tasks": [task(t) for t in plan.tasks],
    }


def spare_to_dict(plan: Plan, name: str) -> dict:
    """A spare as `plan` shows it: for each host with tasks, whether the spare could take
    them all (`takes`), or why not."""
    host = plan.host(name)
    fits = {h: plan.spare_problem(name, h) for h in plan.hosts if h != name}
    return {"name": name, "address": host.address, "gpus": host.gpus, "warm": name in plan.warm_spares,
            "holds": [t.key for t in plan.tasks_on(name)],
            "takes": [h for h, problem in fits.items() if problem is None],
            "cannot_take": {h: problem for h, problem in fits.items() if problem is not None}}
