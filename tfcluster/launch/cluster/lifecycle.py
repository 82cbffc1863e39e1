"""The cluster's lifecycle commands: `up`, `down`, `status`, and `plan --check`.

Each takes the plan (never the spec) and a UI, drives the hosts through a Session,
and raises a TfclusterError for the CLI's one error boundary to report.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from tfcluster.diagnose import proxy
from tfcluster.errors import ConnectError, ExitCode, TfclusterError
from tfcluster.host.shim_protocol import DEFAULT_GRACE, PORT_SETTLE
from tfcluster.launch.agent import fence, upexec
from tfcluster.launch.cluster import deadhosts, state
from tfcluster.launch.cluster.preflight import check_moved_beside_live, check_started_ports, check_versions, preflight
from tfcluster.launch.cluster.reach import check_reachability
from tfcluster.launch.cluster.servers import READY_TIMEOUT, Started, start_detached
from tfcluster.launch.cluster.session import Session, server_tasks
from tfcluster.plan import Plan, TaskPlan, host_port, names


def up(plan: Plan, ui, timeout: float = READY_TIMEOUT, allow_skew: bool = False) -> int:
    servers = server_tasks(plan)
    if not servers:
        ui.info(f"mode {plan.mode!r} runs no tfcluster servers: nothing to start "
                f"({plan.again('train')} starts the scripts)")
        return ExitCode.OK
    with state.lock(plan, "up"), Session(plan, ui) as session:
        plan = deadhosts.around_dead_hosts(session, ui)      # a host down already: its spare
        servers = server_tasks(plan)
        t0 = time.monotonic()
        run_id = names.new_run_id("up")
        ui.info(f"Connecting to {len(plan.hosts)} host(s)…")
        # One exec per host from here to the end (agent/upexec.py); closing it before GO stops
        # the servers it started warm.
        try:
            execs = upexec.open_all(session, servers, run_id, timeout)
        except BaseException:
            session.take_tables(names.run_prefix(plan.name, run_id), _idle(session, plan))
            raise
        done = False
        try:
            live, busy = session.survey(servers)
            check_started_ports(plan, servers, live)
            check_moved_beside_live(plan, live)
            missing = [t for t in servers if t.key not in live]
            if not missing:
                ui.ok(f"cluster {plan.name!r} is already up ({len(servers)} servers); nothing started")
                done = True
                return ExitCode.OK
            if live:
                ui.info(f"{len(live)} server(s) already running; starting the {len(missing)} missing")
            check_versions(session, allow_skew=allow_skew)
            preflight(session, missing, busy=busy)
            if plan.checks.reachability:   # every host reaches every server; live ones are dialled
                check_reachability(session, servers, served=set(live), execs=execs)
            ui.info(f"Starting {len(missing)} server(s)…")
            started = start_detached(session, missing, run_id, timeout, execs=execs)
            done = True
        finally:
            upexec.close_all(session, execs, names.run_prefix(plan.name, run_id), keep=done)
            if not done:        # a failed `up`: each spare's shim takes its table at EOF; this is the
                                # launcher's own take, for a shim that was gone before it could
                session.take_tables(names.run_prefix(plan.name, run_id), _idle(session, plan))
        _record(plan, run_id, started, live)
        ui.ok(f"cluster {plan.name!r} is up: {len(servers)} servers in {time.monotonic() - t0:.1f}s")
        return ExitCode.OK


def _idle(session: Session, plan: Plan) -> list[str]:
    """The hosts an opening reached with no task (the spares)."""
    return [h for h in session.reached() if not plan.tasks_on(h)]


def _record(plan: Plan, run_id: str, started: list[Started], live: dict) -> None:
    """What this `up` started, beside what earlier ones did (`hosts`, until `down`), and where
    the tasks of a down host were placed (`plan.moves`): the truth for every command until
    `down` (state.placed_by_up)."""
    old = state.load(state.key(plan)) or state.UpState()
    hosts = old.hosts     # every host an `up` started servers on, until `down`
    tasks = {k: v for k, v in old.tasks.items() if k in live}
    for s in started:
        tasks[s.task.key] = {"host": s.task.host, "port": s.task.port, "pid": s.pid,
                             "tag": s.tag, "log": s.log, "started": time.time()}
        hosts.setdefault(s.task.host, []).append(s.tag)
    state.save(state.key(plan), state.UpState(name=plan.name, spec_sha256=plan.spec_digest, run_id=run_id,
                                              tasks=tasks, hosts=hosts, moves=plan.moves))


def down(plan: Plan, ui, grace: float = DEFAULT_GRACE) -> int:
    """Stop everything of this cluster on every host of the spec, tasks or not, and on those
    the local state says `up` started servers on; name the hosts that could not be reached.
    Tasks `up` started on a spare instead of a down host are looked for there (state.py,
    placed_by_up); the down host is looked at too, when it answers."""
    with state.lock(plan, "down"):
        saved = state.load(state.key(plan))
        plan = state.placed_by_up(plan, ui, saved)
        return _down(plan, ui, grace, state.started_on(saved))


def _down(plan: Plan, ui, grace: float, recorded: dict[str, list[str]]) -> int:
    with Session(plan, ui, _hosts_to_look_at(plan), light=True) as session:
        # One exec per warm host (HostAgent.down): info, the stop, and the wait, on the host,
        # until its ports of the cluster bind again (up to PORT_SETTLE).
        opened, reports = _stop_all(session, names.cluster_prefix(plan.name), grace, PORT_SETTLE)
        unreachable = {h: e for h, e in opened.items() if isinstance(e, BaseException)}
        session.drop(unreachable)
        unreachable = _warn_spare(ui, plan, unreachable, recorded)
        survivors = _report_down(ui, reports, opened)
        stopped = [tag for r in reports.values() if not isinstance(r, BaseException) for tag, _ in r.stopped]
        dropped = _dropped_hosts(plan, recorded, stopped)
        busy = [(h, port, holder) for h, r in reports.items() if not isinstance(r, BaseException)
                for port, holder in r.busy]
        others = [b for b in busy if names.other_users(b[2])]   # never this cluster's: down leaves them
        busy = [b for b in busy if b not in others]
        ports_busy = [f"{h}:{port}" + (f" ({holder})" if holder and holder != "in use" else "")
                      for h, port, holder in busy]
        refused = [e for e in unreachable.values() if not isinstance(e, ConnectError)]
        if refused and not survivors and not ports_busy and not dropped and len(refused) == len(unreachable):
            raise refused[0]        # reached but refused (e.g. a directory not ours): its own error
        problems = [f"unreachable: {'; '.join(_unreached(h, e) for h, e in unreachable.items())}"] \
            if unreachable else []
        problems += [f"survivors: {', '.join(survivors)}"] if survivors else []
        problems += [f"ports still busy: {', '.join(ports_busy)}"] if ports_busy else []
        problems += [f"host {h} is not in the spec any more: `tfcluster up` started {n} server(s) there, "
                     f"which this spec cannot stop (it has no address for {h})" for h, n in dropped.items()]
        if problems:
            raise TfclusterError(f"cluster {plan.name!r} not fully stopped ({'; '.join(problems)})",
                                 hint=_down_hint(plan, unreachable, survivors, dropped, busy))
        state.clear(state.key(plan))
        if others:
            ui.warn(f"{len(others)} port(s) of the spec held by another user's process, not this cluster's: "
                    + ", ".join(f"{h}:{port} ({holder})" for h, port, holder in others))
            ui.ok(f"cluster {plan.name!r} is down: nothing of it runs")
            return ExitCode.OK
        ui.ok(f"cluster {plan.name!r} is down: nothing of it runs and its ports are free")
        return ExitCode.OK


def _stop_all(session: Session, prefix: str, grace: float, settle: float) -> tuple[dict, dict]:
    """Open every host of the session and stop what `prefix` names there, in that round trip.

    Returns (host -> HostInfo or the error that kept it closed, host -> StopReport or the
    HostError of its stop) for the hosts opened; a report's `busy` names this host's
    ports of the plan still held `settle` seconds after the stop."""
    if not prefix:
        raise ValueError("stop needs a tag prefix (an empty one would match every cluster)")
    reports: dict = {}

    def down(name: str, _survey, _files):
        info, reports[name] = session.agents[name].down(
            prefix, grace, settle, [t.port for t in session.plan.tasks_on(name)])
        return info

    return session.open(strict=False, prepare=down), reports


def _unreached(host: str, error: BaseException) -> str:
    """`h9 (127.0.0.9:1): connection refused`: the host named once, not inside its own error."""
    text = str(error)
    return text[len("host "):] if text.startswith((f"host {host} ", f"host {host}:")) else f"{host} ({text})"


def _hosts_to_look_at(plan: Plan) -> list[str]:
    """The hosts with tasks first, then every other host of the spec: a host the spec left
    without tasks may still run what an `up` of an earlier spec started there."""
    return list(dict.fromkeys([*plan.hosts, *(h.name for h in plan.all_hosts)]))


def _warn_spare(ui, plan: Plan, unreachable: dict, recorded: dict) -> dict:
    """The unreachable hosts that matter: a host without tasks in the spec, where `up` (by
    the local state) started nothing, may be a spare that is off; a host whose tasks `up`
    started on a spare (plan.moves) was down then. Each gets a warning."""
    moved = {lost: spare for lost, spare in plan.moves}
    left = [h for h in unreachable if h not in plan.hosts and (h in moved or h not in recorded)]
    for h in left:
        if h in moved:
            ui.warn(f"{h}: not reached ({unreachable[h]}); its tasks were moved to {moved[h]}, so it is "
                    f"left out ({plan.again('down')} once it is back stops anything of the cluster left there)")
        else:
            ui.warn(f"{h}: not reached ({unreachable[h]}); the spec gives it no task and the local "
                    f"state has no server started there, so it is left out")
    return {h: e for h, e in unreachable.items() if h not in left}


def _dropped_hosts(plan: Plan, recorded: dict, stopped: list[str]) -> dict[str, int]:
    """Host -> how many of the servers `up` started there are unaccounted for, for each host
    of the local state the spec no longer lists (no address: nothing can reach it). A
    server a sweep on another host of its machine stopped is accounted for."""
    listed = {h.name for h in plan.all_hosts}
    left = {h: [t for t in tags if not any(names.same_task(t, s) for s in stopped)]
            for h, tags in recorded.items() if h not in listed}
    return {h: len(tags) for h, tags in left.items() if tags}


def _down_hint(plan: Plan, unreachable: dict, survivors: list, dropped: dict, busy: list) -> str:
    hints = []
    if dropped:
        hints.append(f"run `tfcluster down` with the spec `up` used (the one that lists "
                     f"{', '.join(f'host {h}' for h in dropped)}); if those servers are gone for good, "
                     f"remove {state.state_file(state.key(plan))}")
    if unreachable:
        hints.append(f"run {plan.again('down')} again once the hosts are reachable")
    elif survivors:
        hints.append("a process that outlives SIGKILL is stuck in the kernel (e.g. on a hung mount); "
                     f"run {plan.again('down')} again later")
    if hints:
        return "; ".join(hints)
    for host, port, holder in busy:
        other = names.other_workdir(holder, plan.name) or names.other_cluster(holder, plan.name)
        if other:
            return f"{host}:{port} is held by {other}"
    return ("nothing tagged as this cluster's runs any more; down leaves the holders named alone "
            "(another user's process, a program outside tfcluster, or a task's child that left "
            "its session and environment)")


def _report_down(ui, reports: dict, infos: dict) -> list[str]:
    """One line per host. Hosts of a spec can be one machine (127.0.0.x, two names of one
    box): every host's stop sweeps the cluster's tag there, at once, so a process is counted
    under the first host (by name) of its machine that stopped it, not under each."""
    survivors, counted = [], {}      # (machine, pid, tag) -> the host it is counted under
    for host, report in sorted(reports.items()):
        if isinstance(report, BaseException):
            survivors.append(f"{host} ({report})")
            continue
        machine = getattr(infos.get(host), "machine_id", "") or host
        keys = [(machine, pid, tag) for tag, pid in report.stopped]
        new = [k for k in keys if k not in counted]
        others = sorted({counted[k] for k in keys if k in counted})
        counted.update((k, host) for k in new)
        if new:
            ui.info(f"  {host}: stopped {len(new)} process(es)")
        elif others:
            ui.info(f"  {host}: nothing more running (the same machine as {', '.join(others)})")
        else:
            ui.info(f"  {host}: nothing running")
        survivors += [f"{host} pid {pid} ({tag})" for tag, pid in report.survivors]
    return survivors


@dataclass(frozen=True)
class TaskRow:
    """One row of `status`: a planned task and what was found of it."""

    task: str
    host: str
    address: str
    status: str                 # running | stopped | unreachable
    pid: int | None = None
    uptime_s: float | None = None
    port_open: bool | None = None
    pid_file: bool | None = None    # running: found through its pid file (False: by its tag alone)
    started_port: int | None = None  # running on another port than the spec's (its pid file says)
    in_spec: bool = True            # False: a task of this cluster the spec has no longer


def status(plan: Plan, ui) -> tuple[list[TaskRow], dict[str, BaseException]]:
    """One row per planned task, one per process of this cluster no task of the spec names
    (on every host of the spec, tasks or not), and the hosts that could not be reached."""
    recorded = state.started_on(state.load(state.key(plan)))
    with Session(plan, ui, _hosts_to_look_at(plan), light=True) as session:
        for name in session.host_names:      # pid files can be gone while the tasks run
            session.agent(name).sweep_status = True
        opened = session.open(strict=False, survey=list(plan.tasks))
        unreachable = {h: e for h, e in opened.items() if isinstance(e, BaseException)}
        unreachable = _warn_spare(ui, plan, unreachable, recorded)
        prefix = names.cluster_prefix(plan.name)
        found = {h: session.agents[h].survey(prefix, [t.port for t in plan.tasks_on(h)])
                 for h in session.host_names if not isinstance(opened.get(h), BaseException)}
        rows: list[TaskRow] = []
        for host in session.host_names:
            if host in unreachable:   # not reached, or reached and refused (a workdir not ours): the error says
                what = "unreachable" if isinstance(unreachable[host], ConnectError) else "refused"
                rows += [TaskRow(t.key, t.host, t.target, what) for t in plan.tasks_on(host)]
            elif host in found:
                rows += [r for r in _host_rows(session, host, found)   # one machine seen as two hosts: once
                         if r.in_spec or not any(not s.in_spec and s.pid == r.pid for s in rows)]
        for host, tags in recorded.items():
            if not any(h.name == host for h in plan.all_hosts):
                ui.warn(f"{host}: `tfcluster up` started {len(tags)} server(s) there (local state), but the "
                        f"spec no longer lists it, so they cannot be looked at or stopped with this spec; "
                        f"`tfcluster down` with the spec `up` used stops them")
        running = {r.host for r in rows if r.status == "running"}
        fenced = fence.status_line(plan, session.fence_answers(), running)
        if fenced and running:
            ui.info(fenced)
        return rows, unreachable


def _host_rows(session: Session, host: str, surveys: dict) -> list[TaskRow]:
    tasks = session.plan.tasks_on(host)
    found = surveys[host]
    rows = []
    for task in tasks:
        # a task's own pid file first; a process found by its tag alone only without one; its
        # server before its script (the row's port is the server's, so its pid and uptime are too)
        mine = sorted((s for s in found.statuses if s.alive and not s.warm and _is_task(s.tag, task)),
                      key=lambda s: (s.unrecorded, _role(s.tag) != "server"))
        st = mine[0] if mine else None
        moved = st.port if st and st.port not in (None, task.port) else None
        rows.append(TaskRow(task.key, task.host, task.target, "running" if st else "stopped",
                            st.pid if st else None, _uptime(st), bool(found.ports.get(task.port)),
                            (not st.unrecorded) if st else None, moved))
    # the spec changed since `up`: this cluster's processes no task of it names any more, or
    # whose task the spec now places on a host that does not see them (two hosts of a spec
    # may be one machine, which sees the same processes)
    address = session.plan.host(host).address
    for st in found.statuses:
        tag = names.Tag.parse(st.tag)
        if st.alive and not st.warm and tag and not any(
                _is_task(st.tag, t) and _sees(surveys, t.host, st) for t in session.plan.tasks):
            rows.append(TaskRow(tag.key, host, host_port(address, st.port) if st.port else "-", "running",
                                st.pid, _uptime(st), None, not st.unrecorded, in_spec=False))
    return rows


def _sees(surveys: dict, host: str, st) -> bool:
    """Whether `host`'s survey found this very process (an unreached host: assumed so)."""
    return host not in surveys or any(s.pid == st.pid and s.tag == st.tag for s in surveys[host].statuses)


def _uptime(st) -> float | None:
    return round(st.uptime_s, 1) if st and st.uptime_s is not None else None


def _role(tag_text: str) -> str | None:
    tag = names.Tag.parse(tag_text)
    return tag.role if tag else None


def _is_task(tag_text: str, task: TaskPlan) -> bool:
    tag = names.Tag.parse(tag_text)
    return tag is not None and (tag.job, tag.index) == (task.job, task.index)


def unreachable_error(unreachable: dict[str, BaseException]) -> TfclusterError:
    """Exit 3 naming every host `status` could not reach (the first one's own message)."""
    first = next(iter(unreachable.values()))
    others = list(unreachable)[1:]
    message = str(first) + (f" (also unreachable: {', '.join(others)})" if others else "")
    hint = getattr(first, "hint", None)
    code = first.exit_code if isinstance(first, TfclusterError) else ExitCode.CONNECT
    return TfclusterError(message, hint=hint, exit_code=code)


def check(plan: Plan, ui, allow_skew: bool = False) -> None:
    """`plan --check`: connect, report the hosts' versions, run the preflight checks, start nothing."""
    with Session(plan, ui) as session:
        ui.info(f"Checking {len(plan.hosts)} host(s)…")
        session.fence = fence.PROBE       # could the ports be closed? (the survey carries the question)
        session.open(survey=[])
        check_versions(session, allow_skew=allow_skew, report=True)
        binders = [t for t in plan.tasks if t.runs_server or (plan.mode in ("classic", "keras-jax") and t.runs_script)]
        preflight(session, binders)
        ui.ok("preflight passed: every host can run its tasks and every port is free")
        if plan.tf_ports != "open" and all((a or {}).get("can") for a in session.fence_answers().values()):
            what = fence.exposed(plan)[0]      # TensorFlow's ports, or mode keras-jax's task ports
            ui.info(f"{what[:1].upper()}{what[1:]} will be closed to other users on every host (nftables)")
        if plan.checks.reachability:
            check_reachability(session)
        proxy.report(session, ui)

