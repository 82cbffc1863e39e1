"""What a loaded spec is: frozen dataclasses and the public constants they draw on.

Nothing here parses or validates; the loader builds these only from checked input.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

MODES = ("between-graph", "classic", "coordinator", "mirrored")
JOB_NAMES = ("chief", "ps", "worker", "evaluator")   # canonical order everywhere
RESTART_POLICIES = ("never", "on-failure", "exit-code")
HOST_KEY_POLICIES = ("reject", "accept-new")
LOCAL_ADDRESSES = ("localhost", "127.0.0.1", "::1")
MAX_TASKS = 10_000                # bounds the layout work whatever counts the file asks for
PLACEHOLDERS = ("job", "index", "ps_hosts", "worker_hosts", "chief_hosts", "workdir",
                "num_workers")


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
class Checks:
    """train.checks: the diagnoses tfcluster runs around a training (docs/ARCHITECTURE.md)."""

    placement: bool = True            # compare variable placement across workers
    reachability: bool = True         # every host reaches every task address before scripts start
    proxy_guard: bool = True          # extend no_proxy with the cluster's addresses
    hang_after: float = 20.0          # seconds of waiting before the watchdog speaks (0: off)


@dataclass(frozen=True)
class Train:
    mode: str = "between-graph"
    script: str | None = None         # absolute local path (resolved against the spec's dir)
    files: tuple[str, ...] = ()       # as written, relative to the spec's dir
    args: tuple[str, ...] = ()        # unexpanded; placeholders checked by the loader
    restart: Restart = field(default_factory=Restart)
    timeout: float | None = None      # seconds
    checks: Checks = field(default_factory=Checks)
    tensorboard: str | None = None    # LOGDIR (unexpanded placeholders) for TensorBoard on the chief
    args_line: int = 0
    # What check_train_files needs to report a missing file exactly as written, long after
    # loading: the script as the spec wrote it ("template:NAME" or a path; None when the
    # spec has none or the command line replaced it) and the lines of script and files.
    script_source: str | None = None
    script_line: int = 0
    files_lines: tuple[int, ...] = ()


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
