"""The start of a `train`: the checks, the servers, the files and the scripts, overlapped.

Every remote execution costs a login shell and an interpreter start on the host, so the
steps that need one run side by side (docs/ARCHITECTURE.md, "Checks before a run"):
the files were placed from each host's cache in the bootstrap's round trip (Session.open),
and only stale ones ship, on a thread, from the end of the preflight; the scripts' shims
start **held** (held.py) and the servers warm, both before reachability, which the held
shims carry; after it passed, the servers get GO and become ready, then the scripts get
GO. Nothing of a script runs before reachability passed, and a failed check leaves
nothing running: the held shims exit on EOF, the warm servers are stopped by the run's
shutdown. Restarts start one process at once (start()).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from tfcluster import names
from tfcluster.errors import TfclusterError
from tfcluster.agent_types import HostInfo
from tfcluster.held import HeldStart, prepare_holding
from tfcluster.plan import Plan, TaskPlan
from tfcluster.preflight import check_versions, preflight
from tfcluster.reach import check_reachability
from tfcluster.runs import ProgressLog
from tfcluster.servers import Started, wait_ready
from tfcluster.session import Background, Session, raise_first, server_tasks
from tfcluster.shipping import ship


@dataclass
class Supervised:
    """One supervised process: a script, or a server this run owns."""

    task: TaskPlan
    role: str                       # "script" | "server"
    key: str                        # LogMux key
    handle: object = None           # AttachedTask
    launch: object = None           # TaskLaunch of the current attempt
    started: float = 0.0
    ended: float | None = None
    exit_code: int | None = None
    restarts: int = 0
    attempt: int = 0
    stopping: bool = False


@dataclass
class Run:
    plan: Plan
    ui: object
    options: object                 # supervisor.Options
    run_id: str
    session: Session
    mux: object
    events: "queue.Queue[tuple[Supervised, int, int]]" = field(default_factory=queue.Queue)
    procs: list[Supervised] = field(default_factory=list)
    owns_servers: bool = False
    checks: object = None           # diagnoses.RunChecks
    board: object = None            # board.Board: TensorBoard on the chief's host, if asked for
    progress: ProgressLog | None = None   # each script's step, loss and rate (progress.tsv)
    footer: object = None           # footer.LiveFooter on a terminal, from the scripts' start
    starts: list = field(default_factory=list)   # per attached start: [its AttachedTask or None]
    files: list | None = None       # shipping.collect_files(plan), read before connecting


class Holder:
    """The scripts' held starts (held.py), made on each host's thread by Session.open's
    `prepare`: a host's first one is its bootstrap's exec too, the others follow it, and
    they start while the other hosts are prepared and the checks run. Nothing of a script
    runs before GO."""

    def __init__(self, session: Session, run_id: str, options) -> None:
        self.session, self.run_id, self.options = session, run_id, options
        self.procs = [Supervised(t, "script", t.key) for t in session.plan.tasks if t.runs_script]
        self.held: dict[str, HeldStart] = {}

    def prepare(self, host: str, survey, files: dict | None) -> HostInfo:
        """Session.open's preparation of one host: with a script there, the bootstrap's exec
        is that script's held start (one exec for both); the host's other scripts follow."""
        agent = self.session.agents[host]
        mine = [p for p in self.procs if p.task.host == host]
        hb, grace = self.options.heartbeat, self.options.grace
        if mine and not agent.in_process:
            info, self.held[mine[0].key] = prepare_holding(agent, survey, files,
                                                           _launch(self.session, self.run_id, mine[0]), hb, grace)
            mine = mine[1:]
        else:
            info = agent.prepare(survey, files)
        for p in mine:
            self.held[p.key] = HeldStart(agent, _launch(self.session, self.run_id, p), hb, grace)
        return info

    def first_per_host(self) -> dict[str, HeldStart]:
        first: dict[str, HeldStart] = {}
        for p in self.procs:
            first.setdefault(p.task.host, self.held[p.key])
        return first

    def drop(self) -> None:
        """Those not started: each shim exits on EOF, having run nothing."""
        for key in list(self.held):
            self.held.pop(key).drop()


def begin(run: Run, holder: Holder) -> None:
    """Checks, servers, files, scripts: returns once every script has started."""
    plan, ui, session = run.plan, run.ui, run.session
    try:
        check_versions(session, allow_skew=run.options.allow_skew)
        servers, live = _prepare_servers(run)
        # In classic mode the scripts build their own servers: their ports must be free too.
        preflight(session, [p.task for p in holder.procs], ports=plan.mode == "classic")
        shipping = Background(ship, session, [p.task for p in holder.procs], run.run_id, run.files)
        # The servers start warm (TF imported, port not bound) while reachability runs.
        warm = _warm_servers(run, servers, hold=plan.checks.reachability)
        if plan.checks.reachability:   # live servers are dialled; other ports get a rehearsal
            check_reachability(session, served=live, execs=holder.first_per_host())
        _release_servers(run, warm)      # on failure the shipping thread is left to end (a daemon)
        ui.info(shipping.result())
        ui.info(f"Starting the script on {len(holder.procs)} task(s): "
                f"{', '.join(p.key for p in holder.procs)}")
        _go_all(run, holder.procs, holder.held)
    finally:
        holder.drop()


def _go_all(run: Run, procs: list[Supervised], held: dict) -> None:
    run.procs.extend(p for p in procs if p not in run.procs)  # summary order = plan order

    def one(i: int) -> None:
        p = procs[i]
        slot = [None]
        run.starts.append(slot)
        proc = held.pop(p.key)
        p.handle = slot[0] = proc.go()
        _started(run, p)
    raise_first({procs[i].key: r for i, r in run.session.parallel(one, range(len(procs))).items()}, "task")


def _prepare_servers(run: Run) -> tuple[list[TaskPlan], set[str]]:
    """(servers this run starts, keys of the live `up` servers it reuses instead)."""
    servers = server_tasks(run.plan)
    if not servers:
        return [], set()
    live, busy = run.session.survey(servers)
    if live and len(live) == len(servers):
        run.ui.info(f"Using the running cluster ({len(live)} servers from `tfcluster up`)")
        return [], set(live)
    if live:
        raise TfclusterError(
            f"cluster {run.plan.name!r} is partly up ({len(live)} of {len(servers)} servers running)",
            hint="run `tfcluster up SPEC` to start the missing servers, or `tfcluster down SPEC`")
    preflight(run.session, servers, busy=busy)
    return servers, set()


def _warm_servers(run: Run, servers: list[TaskPlan], hold: bool) -> list[Supervised]:
    """Start the servers attached; with `hold` they import TF and wait for GO unbound."""
    if not servers:
        return []
    run.owns_servers = True
    procs = [Supervised(t, "server", names.mux_key(t.key, "server", t.runs_script)) for t in servers]
    start_all(run, procs, hold=hold)
    return procs


def _release_servers(run: Run, procs: list[Supervised]) -> None:
    if not procs:
        return
    run.ui.info(f"Starting {len(procs)} server(s)…")
    for p in procs:
        p.handle.go()
    wait_ready(run.session, [Started(p.task, p.launch.tag, p.handle.pid, p.launch.log) for p in procs])


def start_all(run: Run, procs: list[Supervised], hold: bool = False) -> None:
    """Start processes in parallel: each start is a round trip (a handshake with its shim),
    and 32 workers one after another would take seconds before the last one runs."""
    run.procs.extend(p for p in procs if p not in run.procs)  # summary order = plan order
    results = run.session.parallel(lambda i: start(run, procs[i], hold), range(len(procs)))
    raise_first({procs[i].key: r for i, r in results.items()}, "task")


def start(run: Run, proc: Supervised, hold: bool = False) -> None:
    """Start one process now (a server, or a script's restart)."""
    agent = run.session.agents[proc.task.host]
    slot = [None]
    run.starts.append(slot)
    proc.handle = slot[0] = agent.start_attached(_launch(run.session, run.run_id, proc),
                                                 heartbeat_timeout=run.options.heartbeat,
                                                 grace=run.options.grace, hold=hold)
    _started(run, proc)


def _launch(session: Session, run_id: str, proc: Supervised):
    agent = session.agents[proc.task.host]
    argv = agent.server_argv() if proc.role == "server" else session.plan.command(proc.task)
    extra = {"TFCLUSTER_RESTART": str(proc.restarts)}
    proc.launch = session.launch_for(proc.task, run_id, proc.role, argv, extra)
    return proc.launch


def _started(run: Run, proc: Supervised) -> None:
    proc.started = time.time()
    proc.ended = proc.exit_code = None
    proc.attempt += 1
    if proc not in run.procs:
        run.procs.append(proc)
    threading.Thread(target=_pump, args=(run, proc, proc.handle, proc.attempt),
                     name=f"pump-{proc.key}", daemon=True).start()


def _pump(run: Run, proc: Supervised, handle, attempt: int) -> None:
    """Feed one process's output to the mux; report its exit on the event queue."""
    try:
        while chunk := handle.read():
            run.mux.feed(proc.key, chunk)
        rc = handle.wait(30)
    except Exception as exc:  # noqa: BLE001 - a lost channel is an exit like any other
        run.mux.note(proc.key, f"lost contact with {proc.task.host}: {exc}")
        rc = None
    if rc is None or rc < 0:  # the channel closed with no exit status: connection lost
        if not proc.stopping:
            run.mux.note(proc.key, f"lost contact with {proc.task.host} (connection dropped); "
                                   f"its shim stops the task")
        rc = 255
    run.events.put((proc, attempt, rc))
