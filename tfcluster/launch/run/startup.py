"""The start of a `train`: the checks, the servers, the files and the scripts, overlapped.

Every remote execution costs a login shell and an interpreter start on the host, so the
steps that need one run side by side (docs/design/remote-execs.md, "Checks before a run"):
the files were placed from each host's cache in the bootstrap's round trip (Session.open),
and only stale ones ship, on a thread, from the end of the preflight; the scripts' shims
start **held** (agent/held.py) and the servers warm, both before reachability, which the held
shims carry; after it passed, the servers get GO and become ready, then the scripts get
GO. Nothing of a script runs before reachability passed, and a failed check leaves
nothing running: the held shims exit on EOF, the warm servers are stopped by the run's
shutdown. Starting, pumping and restarting one process: attempts.py.
"""
from __future__ import annotations

from tfcluster.errors import TfclusterError
from tfcluster.launch.agent.held import HeldStart, prepare_holding
from tfcluster.launch.agent.records import HostInfo
from tfcluster.launch.cluster.preflight import (
    check_moved_beside_live,
    check_started_ports,
    check_versions,
    preflight,
)
from tfcluster.launch.cluster.reach import check_reachability
from tfcluster.launch.cluster.servers import Started, wait_ready
from tfcluster.launch.cluster.session import Background, Session, raise_first, server_tasks
from tfcluster.launch.cluster.shipping import ship
from tfcluster.launch.run import attempts
from tfcluster.launch.run.runstate import Options, Run, StartSlot, Supervised
from tfcluster.plan import TaskPlan, names


class Holder:
    """The scripts' held starts (agent/held.py), made on each host's thread by Session.open's
    `prepare`: a host's first one is its bootstrap's exec too, the others follow it, and
    they start while the other hosts are prepared and the checks run. Nothing of a script
    runs before GO."""

    def __init__(self, session: Session, run_id: str, options: Options) -> None:
        self.session, self.run_id, self.options = session, run_id, options
        self.procs = [Supervised(t, "script", t.key) for t in session.plan.tasks if t.runs_script]
        self.held: dict[str, HeldStart] = {}

    def prepare(self, host: str, survey: tuple[str, list[int]] | None,
                files: dict | None) -> HostInfo:
        """Session.open's preparation of one host: with a script there, the bootstrap's exec
        is that script's held start (one exec for both); the host's other scripts follow."""
        agent = self.session.agents[host]
        mine = [p for p in self.procs if p.task.host == host]
        hb, grace = self.options.heartbeat, self.options.grace
        plan = self.session.plan
        if mine and not agent.in_process:
            info, self.held[mine[0].key] = prepare_holding(
                agent, survey, files, attempts.launch_of(self.session, self.run_id, mine[0]), hb, grace,
                restart=attempts.in_place(plan, mine[0]))
            mine = mine[1:]
        else:
            info = agent.prepare(survey, files)
        for p in mine:
            self.held[p.key] = HeldStart(agent, attempts.launch_of(self.session, self.run_id, p), hb, grace,
                                         restart=attempts.in_place(plan, p))
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
        unshipped = plan.script_scan.unshipped_line() if plan.script_scan else None
        if unshipped:
            ui.warn(unshipped)
        servers, live = _prepare_servers(run)
        # In classic mode the scripts build their own servers, in keras-jax mode process 0 serves
        # JAX's coordinator on its port: their ports must be free too.
        preflight(session, [p.task for p in holder.procs], ports=plan.mode in ("classic", "keras-jax"))
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


def _go_all(run: Run, procs: list[Supervised], held: dict[str, HeldStart]) -> None:
    run.procs.extend(p for p in procs if p not in run.procs)  # summary order = plan order

    def one(i: int) -> None:
        p = procs[i]
        slot = StartSlot()
        run.starts.append(slot)
        proc = held.pop(p.key)
        p.handle = slot.handle = proc.go()
        attempts.attach(run, p)
    raise_first({procs[i].key: r for i, r in run.session.parallel(one, range(len(procs))).items()}, "task")


def _prepare_servers(run: Run) -> tuple[list[TaskPlan], set[str]]:
    """(servers this run starts, keys of the live `up` servers it reuses instead)."""
    servers = server_tasks(run.plan)
    if not servers:
        run.reuses_up = False
        return [], set()
    live, busy = run.session.survey(servers)
    run.reuses_up = bool(live)
    check_started_ports(run.plan, servers, live)
    if live and len(live) == len(servers):
        run.ui.info(f"Using the running cluster ({len(live)} servers from `tfcluster up`)")
        return [], set(live)
    check_moved_beside_live(run.plan, live)     # a host down under `up`'s servers: their spare's would not be dialled
    if live:
        raise TfclusterError(
            f"cluster {run.plan.name!r} is partly up ({len(live)} of {len(servers)} servers running)",
            hint=f"run {run.plan.again('up')} to start the missing servers, or {run.plan.again('down')}")
    preflight(run.session, servers, busy=busy)
    return servers, set()


def _warm_servers(run: Run, servers: list[TaskPlan], hold: bool) -> list[Supervised]:
    """Start the servers attached; with `hold` they import TF and wait for GO unbound."""
    if not servers:
        return []
    run.owns_servers = True
    procs = [Supervised(t, "server", names.mux_key(t.key, "server", t.runs_script)) for t in servers]
    attempts.start_all(run, procs, hold=hold)
    return procs


def _release_servers(run: Run, procs: list[Supervised]) -> None:
    if not procs:
        return
    run.ui.info(f"Starting {len(procs)} server(s)…")
    for p in procs:
        p.handle.go()
    wait_ready(run.session, [Started(p.task, p.launch.tag, p.handle.pid, p.launch.log) for p in procs])
