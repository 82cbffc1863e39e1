"""What a loaded spec is: frozen dataclasses and the public constants they draw on.

Nothing here parses or validates; the loader builds these only from checked input.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

MODES = ("between-graph", "classic", "coordinator", "mirrored", "keras-jax")
# Mode keras-jax (Keras 3 and JAX programs, docs/modes.md): the variables Keras and JAX read to
# start their distributed runtime, which tfcluster sets per process; the backend is set too,
# and on a host without GPUs the CPU collectives that work across processes (gloo).
JAX_PER_TASK_ENV = ("KERAS_DISTRIBUTION_JOB_ADDRESSES", "KERAS_DISTRIBUTION_NUM_PROCESSES",
                    "KERAS_DISTRIBUTION_PROCESS_ID", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                    "JAX_PROCESS_ID")
KERAS_BACKEND_ENV = "KERAS_BACKEND"
JAX_CPU_COLLECTIVES_ENV = "JAX_CPU_COLLECTIVES_IMPLEMENTATION"
JOB_NAMES = ("chief", "ps", "worker", "evaluator")   # canonical order everywhere
RESTART_POLICIES = ("never", "on-failure", "exit-code")
# train.on_host_loss: what a run does when a host is lost (docs/spec.md, "Spare hosts"); the
# default is `spare` when the spec has a spare host, else `fail`
HOST_LOSS_POLICIES = ("spare", "shrink", "fail")
HOST_KEY_POLICIES = ("reject", "accept-new")
# train.keras: `auto` leaves `tf.keras` to TensorFlow (Keras 3 from TF 2.16); `legacy` sets
# LEGACY_KERAS_ENV for every task, so that `tf.keras` is tf_keras (docs/modes.md, "Keras").
KERAS_CHOICES = ("auto", "legacy")
LEGACY_KERAS_ENV = "TF_USE_LEGACY_KERAS"
LEGACY_KERAS_VALUES = ("1", "true", "True")     # what TensorFlow reads as set
LOCAL_ADDRESSES = ("localhost", "127.0.0.1", "::1")
TF_PORTS = ("auto", "closed", "open")      # Spec.tf_ports
# hosts[].preemptible: which cloud's notices a run watches on the host (docs/hostloss.md, "When
# a host warns"); `auto` asks the three metadata services at a run's start, `no` (the default)
# asks nothing
PREEMPTIBLE = ("auto", "aws", "gce", "azure", "no")
MAX_TASKS = 10_000                # bounds the layout work whatever counts the file asks for
PLACEHOLDERS = ("job", "index", "ps_hosts", "worker_hosts", "chief_hosts", "workdir",
                "num_workers")

# Limits against blow-ups (docs/design/spec-safety.md, "Spec safety"): a page of YAML must not
# become gigabytes.
MAX_ENV_ENTRIES = 1_000
MAX_ENV_BYTES = 256 * 1024        # all of env: together
MAX_ARGS = 1_000
MAX_ARG_BYTES = 128 * 1024        # execve's MAX_ARG_STRLEN: one argument or one NAME=value
MAX_TASK_BYTES = 1 << 20          # a task's TF_CONFIG, env and args (execve's ARG_MAX is ~2 MiB)
MAX_PLAN_BYTES = 64 << 20         # every task's together, as the plan holds them
MAX_SHIP_FILES = 10_000
MAX_SHIP_BYTES = 256 << 20        # train.script and train.files together

# Env names shown as *** (docs/design/spec-safety.md, "Spec safety"): any name containing one of
# these, upper-cased, plus the spec's secret_env, less its public_env.
SECRET_MARKERS = ("PASS", "PWD", "AUTH", "PRIVATE", "CREDENTIAL", "TOKEN", "SECRET", "KEY", "DSN",
                  "WEBHOOK", "COOKIE", "SESSION")
# And whatever its name, a URL's userinfo (`scheme://user:password@`): shown as `scheme://***@`,
# and a value holding one is rendered as a secret.
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s]*@")
MIN_SECRET_CHARS = 4              # a shorter secret value is not looked for in train.args
# A URL with a password (`scheme://user:password@host`) in train.args is refused: arguments are
# visible in `ps` on every host (docs/spec.md, "Secrets").
_URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:[^/\s]+@\S*")


def is_secret(name: str, marked=(), public=()) -> bool:
    """Whether env `name` is secret: listed in `marked` (secret_env), else not when listed
    in `public` (public_env), else when it contains a marker."""
    if name in marked:
        return True
    if name in public:
        return False
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def has_userinfo(value: str) -> bool:
    """Whether `value` holds a URL with a user (and maybe a password) before its host."""
    return "@" in value and _USERINFO.search(value) is not None


def mask_userinfo(value: str) -> str:
    """`value` with every URL's userinfo as `***`: `http://u:p@proxy:3128` -> `http://***@proxy:3128`."""
    return _USERINFO.sub(r"\1***@", value) if "@" in value else value


def url_password(value: str) -> str | None:
    """The first URL in `value` that holds a password, as shown (mask_userinfo, at most 80
    characters); None when there is none."""
    found = _URL_PASSWORD.search(value) if "@" in value else None
    return mask_userinfo(found.group())[:80] if found else None


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
    spare: bool = False              # no task until a host is lost (docs/spec.md, "Spare hosts")
    warm: bool = False               # `spare: warm`: it keeps a standby with TensorFlow imported
    gpus_set: bool = False           # `gpus:` written (0 included): else GPUs found there are warned of
    preemptible: str = "no"          # PREEMPTIBLE: whose notices a run watches for on it
    metadata_url: str | None = None  # the metadata service's base URL, when not 169.254.169.254


@dataclass(frozen=True)
class Job:
    """One job as written. Exactly one of (`count`/`per_gpu` + `hosts` + `port`) or `tasks`."""

    name: str
    count: int | None = None
    per_gpu: bool = False
    gpus: int = 0                     # GPUs per task (per_gpu implies 1)
    gpus_set: bool = False            # `gpus:` written (mode keras-jax: else each task gets all of its host's)
    hosts: tuple[str, ...] = ()
    port: int | None = None
    tasks: tuple[tuple[str, int], ...] | None = None   # explicit (host name, port)
    line: int = 0


@dataclass(frozen=True)
class Restart:
    policy: str = "never"
    max_restarts: int = 3


@dataclass(frozen=True)
class Checks:
    """train.checks: the diagnoses tfcluster runs around a training (docs/design/diagnoses.md)."""

    placement: bool = True            # compare variable placement across workers
    reachability: bool = True         # every host reaches every task address before scripts start
    proxy_guard: bool = True          # extend no_proxy with the cluster's addresses
    hang_after: float = 20.0          # seconds of waiting before the watchdog speaks (0: off)


@dataclass(frozen=True)
class Progress:
    """train.progress: how the script's lines say its step and loss (metrics.py reads
    them). None: the defaults (`step=N`, `global_step=N`, `loss=X`; the target from a
    `--steps N`-style argument)."""

    step: str | None = None           # regex, one capturing group: the global step
    loss: str | None = None           # regex, one capturing group: the loss
    target: int | None = None         # the final step


@dataclass(frozen=True)
class Checkpoint:
    """train.checkpoint: where the chief's script keeps its checkpoints, and how often the
    launcher copies the newest complete one back (docs/spec.md, "Spare hosts")."""

    dir: str                          # as written: placeholders ({workdir}, ...) unfilled
    keep: int = 2                     # checkpoints kept (the launcher's copies too)
    sync: float | None = 120.0        # seconds between copies; None: `sync: off` (a shared filesystem)
    line: int = 0                     # line of train.checkpoint
    max_bytes: int = 16 << 30         # a checkpoint larger than this is not copied (docs/spec.md)


# train.stop_grace's default: a script's seconds between SIGTERM (Ctrl-C, a stop, a move) and
# KILL, to save its last checkpoint; STOP_GRACE_MAX its bound (a stop that waits longer is a hang).
STOP_GRACE = 10.0
STOP_GRACE_MAX = 3600.0


@dataclass(frozen=True)
class Train:
    mode: str = "between-graph"
    script: str | None = None         # absolute local path (resolved against the spec's dir)
    files: tuple[str, ...] = ()       # as written, relative to the spec's dir
    args: tuple[str, ...] = ()        # unexpanded; placeholders checked by the loader
    restart: Restart = field(default_factory=Restart)
    timeout: float | None = None      # seconds
    stop_grace: float = STOP_GRACE    # seconds
    checks: Checks = field(default_factory=Checks)
    tensorboard: str | None = None    # LOGDIR (unexpanded placeholders) for TensorBoard on the chief
    tensorboard_line: int = 0         # (0: from the command line)
    image: str | None = None          # container image for `render --to tfjob`
    progress: Progress = field(default_factory=Progress)
    keras: str = "auto"               # KERAS_CHOICES
    keras_line: int = 0
    args_line: int = 0
    args_lines: tuple[int, ...] = ()  # each argument's line (empty: from the command line)
    allow_outside: tuple[str, ...] = ()   # directories, besides the spec's, files may come from
    allow_outside_lines: tuple[int, ...] = ()
    # What check_train_files needs to report a missing file exactly as written, long after
    # loading: the script as the spec wrote it ("template:NAME" or a path; None when the
    # spec has none or the command line replaced it) and the lines of script and files.
    script_source: str | None = None
    script_line: int = 0
    files_lines: tuple[int, ...] = ()
    on_host_loss: str | None = None   # HOST_LOSS_POLICIES; None: the default (see above)
    on_host_loss_line: int = 0
    checkpoint: Checkpoint | None = None


@dataclass(frozen=True)
class Spec:
    path: str                         # the file as given
    name: str
    python: str = "python3"
    workdir: str = "~/.tfcluster"
    env: tuple[tuple[str, str], ...] = ()   # in file order; the planner sorts
    secret_env: tuple[str, ...] = ()        # env names shown as *** whatever their name
    public_env: tuple[str, ...] = ()        # env names shown although they contain a marker
    hosts: tuple[Host, ...] = ()
    jobs: tuple[Job, ...] = ()              # canonical JOB_NAMES order
    train: Train = field(default_factory=Train)
    # TF's task ports: `auto` closes them to other users where tfcluster can (root or
    # `sudo -n nft` on the host) and warns where not; `closed` refuses to run where it cannot;
    # `open` leaves them open, silently (docs/security.md, "TensorFlow's ports")
    tf_ports: str = "auto"
    digest: str = ""                  # sha256 of the file's bytes

    @property
    def base_dir(self) -> str:
        return os.path.dirname(os.path.abspath(self.path))

    def secrets(self) -> tuple[tuple[str, str], ...]:
        """The env entries that are secret (is_secret), in file order."""
        return tuple((k, v) for k, v in self.env if is_secret(k, self.secret_env, self.public_env))

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    @property
    def spares(self) -> tuple[Host, ...]:
        """The hosts marked `spare: true`, in file order."""
        return tuple(h for h in self.hosts if h.spare)

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
