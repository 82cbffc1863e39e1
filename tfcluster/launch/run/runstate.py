"""The record of one `train` run, shared by its start (startup.py), its attempts
(attempts.py) and its supervisor: the options it was asked for, what runs, each supervised
process's attempts, and the parts the run holds (the UI, the log multiplexer, the checks,
TensorBoard, the footer)."""
from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tfcluster.host.shim_protocol import DEFAULT_HEARTBEAT_TIMEOUT
from tfcluster.launch.run.moves import Recovery
from tfcluster.plan import STOP_GRACE, Plan, TaskPlan
from tfcluster.watch.runs import ProgressLog

if TYPE_CHECKING:
    from tfcluster.diagnose.checks import RunChecks
    from tfcluster.launch.agent.attached import AttachedTask
    from tfcluster.launch.agent.records import TaskLaunch
    from tfcluster.launch.cluster.session import Session
    from tfcluster.launch.run.notices import Notices
    from tfcluster.launch.run.standbys import Standbys
    from tfcluster.ui import UI
    from tfcluster.watch.board import Board
    from tfcluster.watch.footer import LiveFooter
    from tfcluster.watch.logmux import LogMux

@dataclass
class Options:
    """How `train` was asked to run (the command line's options)."""

    show: tuple[str, ...] = ()
    quiet: bool = False
    runs_dir: str = "runs"
    grace: float = STOP_GRACE       # the plan's train.stop_grace
    heartbeat: float = DEFAULT_HEARTBEAT_TIMEOUT
    verbose: bool = False           # show TF's start-up chatter too
    allow_skew: bool = False        # hosts on other Python/TF minor versions: warn, go on


@dataclass
class Supervised:
    """One supervised process: a script, or a server this run owns."""

    task: TaskPlan
    role: str                       # "script" | "server"
    key: str                        # LogMux key
    handle: AttachedTask | None = None
    launch: TaskLaunch | None = None    # of the current attempt
    started: float = 0.0            # its first attempt's start: the summary's and manifest's
    restarted: float | None = None  # its last restart's start (None: never restarted)
    ended: float | None = None
    exit_code: int | None = None
    restarts: int = 0
    attempt: int = 0
    stopping: bool = False
    host_lost: str | None = None    # how its host was found lost (launch/cluster/hostloss.py)

    @property
    def attempt_started(self) -> float:
        """When the current attempt started."""
        return self.restarted or self.started


@dataclass
class StartSlot:
    """One attached start, counted before it is asked for: a start under way, or one that
    failed, has no handle (the run's end then waits for no sweep it cannot see)."""

    handle: AttachedTask | None = None


@dataclass
class Run:
    plan: Plan
    ui: UI
    options: Options
    run_id: str
    session: Session
    mux: LogMux
    events: "queue.Queue[tuple[Supervised, int, int]]" = field(default_factory=queue.Queue)
    procs: list[Supervised] = field(default_factory=list)
    owns_servers: bool = False
    reuses_up: bool | None = None    # its servers are `up`'s (None: not decided yet)
    checks: RunChecks | None = None
    board: Board | None = None      # TensorBoard on the chief's host, if asked for
    progress: ProgressLog | None = None   # each script's step, loss and rate (progress.tsv)
    footer: LiveFooter | None = None    # on a terminal, from the scripts' start
    starts: list[StartSlot] = field(default_factory=list)   # every attached start, in order
    files: list | None = None       # shipping.collect_files(plan), read before connecting
    recovery: Recovery = field(default_factory=Recovery)   # hosts given up, tasks moved (recovery.py)
    notices: Notices | None = None      # hosts that warned before going (notices.py; the supervisor's)
    standbys: Standbys | None = None    # warm standbys (standbys.py; the supervisor's)
