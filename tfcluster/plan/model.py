"""The plan's records: every host (how to reach it, which interpreter runs there, where the
shim lives) and every task (where it runs, its GPUs, TF_CONFIG, environment and command), and
the queries the launcher asks of them (a task's host, the spare that can take a lost host's
tasks). Built by build.py; shown by view.py.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tfcluster.host import HOST_DIR
from tfcluster.plan.names import task_key
from tfcluster.safetext import shell_word
from tfcluster.spec import Checks, Progress, Restart, Spec, has_userinfo, is_secret
from tfcluster.spec.addresses import host_port, machine_of
from tfcluster.spec.model import STOP_GRACE
from tfcluster.spec.shipped import ScriptScan
from tfcluster.transport.options import SshOptions

DEFAULT_PYTHON = Spec.python

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
    gpus_set: bool = False               # the spec wrote `gpus:` (0 too): preflight.unused_gpus

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
        return host_port(self.address, self.port)

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
class Source:
    """What build_plan was given, and build_plan itself, so that Plan.moved re-plans the same
    spec (this module does not import the builder, which imports it)."""

    spec: Spec
    local_python: str
    build: Callable[..., Plan]


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
    source: Source | None = field(default=None, compare=False, repr=False)

    @property
    def chief(self) -> TaskPlan | None:
        """The task whose script is the chief (None when no script runs)."""
        return next((t for t in self.tasks if t.is_chief and t.runs_script), None)

    @property
    def spec_path(self) -> str:
        """The spec's path as the command line gave it, for the commands a hint prints."""
        return self.source.spec.path if self.source is not None else "SPEC"

    def again(self, verb: str, *words: str) -> str:
        """`tfcluster VERB SPEC WORDS...` with this spec's path, as a hint prints it (each word
        quoted for a shell)."""
        return "`" + " ".join(["tfcluster", verb, *map(shell_word, (self.spec_path, *words))]) + "`"

    def probes(self) -> str:
        """What the start-up probe reports in a script process ("" : no probe): the
        variables' placement, and model-not-ready waits, for TF1-style modes; in mode
        keras-jax with two or more processes, whether they joined (diagnose/strategy.py)."""
        if self.mode == "keras-jax":
            processes = [t for t in self.tasks if t.runs_script]
            return "jax" if self.checks.placement and len(processes) > 1 else ""
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

    def idle_gpus(self) -> list[str]:
        """One line per host whose spec gives it GPUs (`gpus: N`) while none of its tasks that
        could use one (chief, worker, evaluator: a ps stays on the CPU) takes any: they run
        with an empty CUDA_VISIBLE_DEVICES, on the CPU, which nothing else would say."""
        out = []
        for host in self.all_hosts:
            users = [t for t in self.tasks_on(host.name) if t.job != "ps"]
            if host.gpus and users and not any(t.gpus for t in users):
                keys = ", ".join(t.key for t in users[:3]) + (" …" if len(users) > 3 else "")
                out.append(f"host {host.name} has `gpus: {host.gpus}` but none of its tasks takes one: "
                           f"{keys} run{'s' if len(users) == 1 else ''} on the CPU (CUDA_VISIBLE_DEVICES=''); "
                           f"give the job `gpus: K` (K GPUs a task) or `per_gpu: true` (a task per GPU)")
        return out

    def spare_problem(self, spare: str, lost: str) -> str | None:
        """Why `spare` cannot take every task of `lost` (None: it can): too few GPUs for them
        beside what it holds already, or a port of theirs taken by a task on its machine."""
        moving = self.tasks_on(lost)
        host = self.host(spare)
        need, held = sum(len(t.gpus) for t in moving), sum(len(t.gpus) for t in self.tasks_on(spare))
        if need + held > host.gpus:
            return (f"has {host.gpus} GPU{'' if host.gpus == 1 else 's'}, {lost}'s tasks need {need}"
                    + (f" beside the {held} its own hold" if held else ""))
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
        return self.source.build(self.source.spec, self.source.local_python, files=self.files,
                                 files_problem=self.files_problem, script_fits=self.script_fits,
                                 script_scan=self.script_scan,
                                 moves=(*self.moves, (lost, spare)))


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


