"""Carrying out a plan on real hosts: preflight, `up`, `down`, `status`, `exec`.

Every effect lives here and in supervisor.py (STYLE.md §1). Hosts are driven
through `HostAgent`s, one per host, opened in parallel; the launcher never
knows whether a host is local or reached over SSH.
"""
from __future__ import annotations

import concurrent.futures as cf
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

from tfcluster import state
from tfcluster.errors import (DeadlineError, ExitCode, PreflightError,
                              TaskError, TfclusterError)
from tfcluster.plan import Plan, TaskPlan
from tfcluster.spec import Spec

T = TypeVar("T")
R = TypeVar("R")

READY_TIMEOUT = 120.0
DEFAULT_PYTHON = "python3"


def new_run_id(kind: str) -> str:
    return f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def tag_for(plan: Plan, run_id: str, task: TaskPlan, role: str) -> str:
    """The process tag: `cluster:run:job:index:role`; `cluster:` selects the whole cluster."""
    return f"{plan.name}:{run_id}:{task.job}:{task.index}:{role}"


def cluster_prefix(plan: Plan) -> str:
    return f"{plan.name}:"


def parallel(fn: Callable[[T], R], items: Iterable[T], limit: int = 32) -> dict[T, R | BaseException]:
    """Run fn over items in threads; every item gets its result or its exception."""
    items = list(items)
    if not items:
        return {}
    with cf.ThreadPoolExecutor(max_workers=min(limit, len(items))) as pool:
        futures = {item: pool.submit(fn, item) for item in items}
        out: dict[T, R | BaseException] = {}
        for item, future in futures.items():
            try:
                out[item] = future.result()
            except BaseException as exc:  # noqa: BLE001 - reported per item by the caller
                out[item] = exc
        return out


def raise_first(results: dict, what: str) -> None:
    """Raise the first failure, mentioning how many other items failed too."""
    failures = [(k, e) for k, e in results.items() if isinstance(e, BaseException)]
    if not failures:
        return
    key, exc = failures[0]
    if not isinstance(exc, TfclusterError):
        exc = TfclusterError(f"{what} {key}: {type(exc).__name__}: {exc}")
    if len(failures) > 1:
        others = ", ".join(str(k) for k, _ in failures[1:])
        exc.message = f"{exc.message} (also failed: {others})"
        exc.args = (exc.message,)
    raise exc


def _python_for(host, python: str) -> str:
    """The spec's interpreter; for a local host left at the default `python3`, the one
    running tfcluster (it has TensorFlow when tfcluster was installed with [tf], which a
    `python3` found on PATH outside the user's venv may not)."""
    if host.local and python == DEFAULT_PYTHON:
        return sys.executable
    return python


class Session:
    """One HostAgent per host of the plan, prepared (connected, shim shipped) in parallel."""

    def __init__(self, spec: Spec, plan: Plan, ui, hosts: Iterable[str] | None = None) -> None:
        self.spec = spec
        self.plan = plan
        self.ui = ui
        self.host_names = tuple(hosts) if hosts is not None else plan.hosts
        self.agents: dict = {}
        self.infos: dict = {}

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _agent(self, name: str):
        from tfcluster.agent import HostAgent
        from tfcluster.transport import make_transport

        host = self.spec.host(name)
        agent = HostAgent(name, make_transport(host), _python_for(host, self.plan.python),
                          self.plan.cluster_dir)
        self.agents[name] = agent
        return agent

    def open(self, names: Iterable[str] | None = None, *, strict: bool = True,
             survey: list[TaskPlan] | None = None) -> dict:
        """Connect and prepare every host; returns name -> HostInfo | exception.

        `survey`: tasks whose ports (and this cluster's processes) the same round trip
        should look at, for a survey() that follows."""
        names = tuple(names) if names is not None else self.host_names
        for name in names:
            if name not in self.agents:
                self._agent(name)
        by_host = _by_host(survey or [])
        prefix = cluster_prefix(self.plan)

        def prepare(name: str):
            ports = [t.port for t in by_host.get(name, [])]
            return self.agents[name].prepare((prefix, ports) if survey is not None else None)

        results = parallel(prepare, names)
        for name, result in results.items():
            if not isinstance(result, BaseException):
                self.infos[name] = result
        if strict:
            raise_first(results, "host")
        return results

    def close(self) -> None:
        parallel(lambda a: a.close(), list(self.agents.values()))
        self.agents.clear()


# -- preflight -------------------------------------------------------------------------------

def preflight(session: Session, tasks: list[TaskPlan], *, ports: bool = True,
              busy: dict[tuple[str, int], str | None] | None = None) -> None:
    """Hosts are fit for these tasks: TF importable, GPUs present and, when the tasks bind
    their ports (`ports`), those free (`busy`: (host, port) -> holder from a survey already
    made, else the ports are asked now)."""
    infos = session.infos
    spec = session.spec
    for name in dict.fromkeys(t.host for t in tasks):
        info = infos[name]
        if not info.tf_version:
            raise PreflightError(
                f"host {name}: tensorflow is not installed for {session.plan.python}",
                hint=f"install it there, e.g. `tfcluster exec SPEC --hosts {name} -- "
                     f"{session.plan.python} -m pip install tensorflow`, or set `python:` in the spec")
        wanted = spec.host(name).gpus
        if wanted and info.gpus < wanted:
            raise PreflightError(f"host {name}: the spec gives it {wanted} GPUs but it has {info.gpus}")
    _warn_version_skew(session.ui, infos)
    if ports:
        _check_same_machine_ports(infos, tasks)
        _check_ports_free(session, tasks, busy)


def _warn_version_skew(ui, infos: dict) -> None:
    for field in ("python_version", "tf_version"):
        versions = {getattr(i, field) for i in infos.values() if getattr(i, field)}
        if len(versions) > 1:
            detail = ", ".join(f"{n}={getattr(i, field)}" for n, i in sorted(infos.items()))
            ui.warn(f"hosts differ in {field.replace('_', ' ')}: {detail}")


def _check_same_machine_ports(infos: dict, tasks: list[TaskPlan]) -> None:
    seen: dict[tuple[str, int], TaskPlan] = {}
    for task in tasks:
        machine = infos[task.host].machine_id or task.host
        other = seen.setdefault((machine, task.port), task)
        if other is not task and other.host != task.host:
            raise PreflightError(
                f"hosts {other.host} and {task.host} are the same machine (machine-id) and "
                f"{other.key} and {task.key} both use port {task.port}; a TF server binds every interface",
                hint="give the tasks different ports")


def _check_ports_free(session: Session, tasks: list[TaskPlan], busy=None) -> None:
    if busy is None:
        by_host = _by_host(tasks)
        results = parallel(lambda h: session.agents[h].check_ports([t.port for t in by_host[h]]), by_host)
        raise_first(results, "host")
        busy = {(h, port): holder for h, ports in results.items() for port, holder in ports.items()}
    for task in tasks:
        holder = busy.get((task.host, task.port))
        if holder:
            raise PreflightError(
                f"host {task.host}: port {task.port} for {task.key} is already in use ({holder})",
                hint="stop whatever holds it (`tfcluster down` if it is an old cluster), "
                     "or change the port in the spec")


def _by_host(items, host=lambda t: t.host) -> dict[str, list]:
    grouped: dict[str, list] = {}
    for item in items:
        grouped.setdefault(host(item), []).append(item)
    return grouped


# -- servers ---------------------------------------------------------------------------------

@dataclass
class Started:
    task: TaskPlan
    tag: str
    pid: int
    log: str


def launch_for(plan: Plan, task: TaskPlan, run_id: str, role: str, argv, extra_env=None, cwd=None):
    from tfcluster.agent import TaskLaunch

    tag = tag_for(plan, run_id, task, role)
    env = dict(task.env)
    env["TFCLUSTER_RUN_ID"] = run_id
    env.update(extra_env or {})
    stem = f"{task.job}-{task.index}" + (".server" if role == "server" else "")
    return TaskLaunch(
        tag=tag, argv=tuple(argv), env=env,
        cwd=cwd or f"{plan.cluster_dir}/runs/{run_id}",
        log=f"{plan.cluster_dir}/runs/{run_id}/{stem}.log",
        pidfile=f"{plan.cluster_dir}/pids/{tag.replace(':', '_')}.pid",
    )


def start_servers(session: Session, tasks: list[TaskPlan], run_id: str,
                  timeout: float = READY_TIMEOUT) -> list[Started]:
    """Start a detached server per task and wait until each accepts connections (one
    round trip per host). On any failure everything started here is stopped first."""
    plan = session.plan
    by_host = _by_host(tasks)
    started: dict[str, Started] = {}
    progress = _Progress(session, len(tasks))

    def run_host(host: str) -> dict[str, str]:
        agent = session.agents[host]
        launches = {t.key: (t, launch_for(plan, t, run_id, "server", agent.server_argv()))
                    for t in by_host[host]}
        outcomes = {}
        for key, state, pid in agent.launch([(k, t.port, l) for k, (t, l) in launches.items()], timeout):
            task, launch = launches[key]
            if state == "started":
                started[key] = Started(task, launch.tag, pid, launch.log)
                continue
            outcomes[key] = state
            if state == "ready":
                progress.ready(key)
        return outcomes

    try:
        results = parallel(run_host, by_host)
        raise_first(results, "host")
        for outcomes in results.values():
            for key, state in outcomes.items():
                if state != "ready":
                    _raise_not_ready(session, started[key], state, timeout)
    except BaseException:
        stop_run(session, f"{plan.name}:{run_id}:")
        raise
    return list(started.values())


class _Progress:
    """One line per server as it becomes ready, with elapsed time and a count."""

    def __init__(self, session: Session, total: int) -> None:
        self.session, self.total, self.t0 = session, total, time.monotonic()
        self.count = 0
        self.lock = threading.Lock()

    def ready(self, key: str) -> None:
        with self.lock:
            self.count += 1
            self.session.ui.info(f"  ✓ {key:<10} ready on {self.session.plan.task(key).target}"
                                 f"  ({time.monotonic() - self.t0:.1f}s, {self.count}/{self.total})")


def wait_ready(session: Session, started: list[Started], timeout: float) -> None:
    """Block until every started server accepts connections; raise naming the first that did not."""
    by_host = _by_host(started, lambda s: s.task.host)
    progress = _Progress(session, len(started))

    def wait_host(host: str) -> list[tuple[str, str]]:
        items = [(s.task.key, s.task.port, s.pid) for s in by_host[host]]
        decided = []
        for key, outcome in session.agents[host].wait_ready(items, timeout):
            decided.append((key, outcome))
            if outcome == "ready":
                progress.ready(key)
        return decided

    results = parallel(wait_host, by_host)
    raise_first(results, "host")
    for host, decided in results.items():
        for key, outcome in decided:
            if outcome != "ready":
                _raise_not_ready(session, next(s for s in by_host[host] if s.task.key == key), outcome, timeout)


def _raise_not_ready(session: Session, s: Started, outcome: str, timeout: float) -> None:
    try:
        tail = session.agents[s.task.host].tail(s.log, 15)
    except TfclusterError:
        tail = ""
    where = f"{s.task.key} on {s.task.host} ({s.task.target})"
    details = f"last lines of {s.task.key}'s log ({s.log}):\n{tail}" if tail.strip() else None
    if outcome == "timeout":
        raise DeadlineError(f"{where}: server not ready after {timeout:.0f}s", details=details)
    raise TaskError(f"{where}: server exited before it was ready", details=details,
                    exit_code=ExitCode.ERROR)


def stop_run(session: Session, prefix: str, grace: float = 5.0) -> dict:
    """Stop every process with this tag prefix on every connected host."""
    return parallel(lambda h: session.agents[h].stop(prefix, grace), list(session.agents))


# -- commands --------------------------------------------------------------------------------

def server_tasks(plan: Plan) -> list[TaskPlan]:
    return [t for t in plan.tasks if t.runs_server]


def survey(session: Session, tasks: list[TaskPlan]) -> tuple[dict[str, object], dict]:
    """One round trip per host: live servers of this cluster (task key -> TaskStatus) and
    who holds the given tasks' ports ((host, port) -> holder or None)."""
    by_host = _by_host(tasks)
    prefix = cluster_prefix(session.plan)
    results = parallel(lambda h: session.agents[h].survey(prefix, [t.port for t in by_host.get(h, [])]),
                       list(session.agents))
    raise_first(results, "host")
    live, busy = {}, {}
    for host, (statuses, ports) in results.items():
        busy.update({(host, port): holder for port, holder in ports.items()})
        for st in statuses:
            parts = st.tag.split(":")
            if st.alive and parts[-1] == "server":
                live[f"{parts[2]}:{parts[3]}"] = st
    return live, busy


def up(spec: Spec, plan: Plan, ui, timeout: float = READY_TIMEOUT) -> int:
    servers = server_tasks(plan)
    if not servers:
        ui.info(f"mode {plan.mode!r} runs no tfcluster servers: nothing to start "
                f"(`tfcluster train` starts the scripts)")
        return ExitCode.OK
    with state.ClusterLock(plan.name, "up"), Session(spec, plan, ui) as session:
        t0 = time.monotonic()
        ui.info(f"Connecting to {len(plan.hosts)} host(s)…")
        session.open(survey=servers)
        live, busy = survey(session, servers)
        missing = [t for t in servers if t.key not in live]
        if not missing:
            ui.ok(f"cluster {plan.name!r} is already up ({len(servers)} servers); nothing started")
            return ExitCode.OK
        if live:
            ui.info(f"{len(live)} server(s) already running; starting the {len(missing)} missing")
        preflight(session, missing, busy=busy)
        run_id = new_run_id("up")
        ui.info(f"Starting {len(missing)} server(s)…")
        started = start_servers(session, missing, run_id, timeout)
        _record(plan, run_id, started, live)
        ui.ok(f"cluster {plan.name!r} is up: {len(servers)} servers in {time.monotonic() - t0:.1f}s")
        return ExitCode.OK


def _record(plan: Plan, run_id: str, started: list[Started], live: dict) -> None:
    old = state.load(plan.name) or {}
    tasks = {k: v for k, v in old.get("tasks", {}).items() if k in live}
    for s in started:
        tasks[s.task.key] = {"host": s.task.host, "port": s.task.port, "pid": s.pid,
                             "tag": s.tag, "log": s.log, "started": time.time()}
    state.save(plan.name, {"name": plan.name, "spec_sha256": plan.spec_digest,
                           "run_id": run_id, "tasks": tasks})


def down(spec: Spec, plan: Plan, ui, grace: float = 5.0) -> int:
    """Stop everything of this cluster on every host; name hosts that could not be reached."""
    hosts = [h.name for h in spec.hosts if h.name in plan.hosts]
    with state.ClusterLock(plan.name, "down"), Session(spec, plan, ui, hosts) as session:
        opened = session.open(strict=False)
        unreachable = {h: e for h, e in opened.items() if isinstance(e, BaseException)}
        session.agents = {h: a for h, a in session.agents.items() if h not in unreachable}
        reports = stop_run(session, cluster_prefix(plan), grace)
        survivors = _report_down(ui, reports)
        ports_busy = _ports_still_busy(session)
        for host, exc in unreachable.items():
            ui.error(str(exc))
        if unreachable or survivors or ports_busy:
            problems = [f"unreachable: {', '.join(unreachable)}"] if unreachable else []
            problems += [f"survivors: {', '.join(survivors)}"] if survivors else []
            problems += [f"ports still busy: {', '.join(ports_busy)}"] if ports_busy else []
            raise TfclusterError(f"cluster {plan.name!r} not fully stopped ({'; '.join(problems)})",
                                 hint="run `tfcluster down` again once the hosts are reachable")
        state.clear(plan.name)
        ui.ok(f"cluster {plan.name!r} is down: nothing of it runs and its ports are free")
        return ExitCode.OK


def _report_down(ui, reports: dict) -> list[str]:
    survivors = []
    for host, report in sorted(reports.items()):
        if isinstance(report, BaseException):
            survivors.append(f"{host} ({report})")
            continue
        n = len(report.stopped)
        ui.info(f"  {host}: {'stopped ' + str(n) + ' process(es)' if n else 'nothing running'}")
        survivors += [f"{host} pid {pid} ({tag})" for tag, pid in report.survivors]
    return survivors


def _ports_still_busy(session: Session, settle: float = 5.0) -> list[str]:
    """Ports of the cluster that cannot be bound again. A just-killed server's socket may
    take a moment to go, so re-check for up to `settle` seconds before calling it busy."""
    def check(host: str) -> list[str]:
        ports = [t.port for t in session.plan.tasks_on(host)]
        busy = session.agents[host].check_ports(ports)
        return [f"{host}:{p}" for p, holder in busy.items() if holder]

    deadline = time.monotonic() + settle
    while True:
        results = parallel(check, list(session.agents))
        busy = [item for r in results.values() if not isinstance(r, BaseException) for item in r]
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.25)


def status(spec: Spec, plan: Plan, ui) -> list[dict]:
    """One row per planned task (plus any unplanned process found with the cluster's tag)."""
    with Session(spec, plan, ui) as session:
        opened = session.open(strict=False, survey=list(plan.tasks))
        rows = []
        for host in plan.hosts:
            result = opened[host]
            if isinstance(result, BaseException):
                rows += [_row(t, "unreachable", None, None, None) for t in plan.tasks_on(host)]
                continue
            rows += _host_rows(session, host)
        return rows


def _host_rows(session: Session, host: str) -> list[dict]:
    tasks = session.plan.tasks_on(host)
    statuses, busy = session.agents[host].survey(cluster_prefix(session.plan), [t.port for t in tasks])
    rows = []
    for task in tasks:
        mine = [s for s in statuses if s.alive and s.tag.split(":")[2:4] == [task.job, str(task.index)]]
        st = mine[0] if mine else None
        rows.append(_row(task, "running" if st else "stopped", st.pid if st else None,
                         st.uptime_s if st else None, bool(busy.get(task.port))))
    return rows


def _row(task: TaskPlan, status_: str, pid, uptime, port_open) -> dict:
    return {"task": task.key, "host": task.host, "address": task.target, "status": status_,
            "pid": pid, "uptime_s": round(uptime, 1) if uptime is not None else None,
            "port_open": port_open}


def exec_on_hosts(spec: Spec, ui, argv: list[str], hosts: list[str], out) -> int:
    """Run argv on each host in parallel, output prefixed per host; exit code = worst."""
    from tfcluster.logs import LogMux
    from tfcluster.transport import make_transport

    wrapped = ["sh", "-c", 'exec "$@" 2>&1', "sh", *argv]  # merge stderr on the host; argv stays quoted
    mux = LogMux(out, hosts, color=ui.color)

    def run_one(name: str) -> int:
        transport = make_transport(spec.host(name))
        try:
            transport.connect()
            proc = transport.spawn(wrapped)
            while chunk := proc.read(65536):
                mux.feed(name, chunk)
            return proc.wait()
        finally:
            mux.close_task(name)
            transport.close()

    results = parallel(run_one, hosts, limit=64)
    mux.close()
    worst, hints = 0, []
    for name, rc in results.items():
        if isinstance(rc, BaseException):
            ui.error(str(rc) if isinstance(rc, TfclusterError) else f"host {name}: {rc}")
            if getattr(rc, "hint", None) and rc.hint not in hints:
                hints.append(rc.hint)
            worst = max(worst, int(ExitCode.CONNECT))
        elif rc:
            ui.warn(f"host {name}: exit code {rc}")
            worst = max(worst, rc)
    for hint in hints:
        ui.stderr.write(f"hint: {hint}\n")
    return worst


def check(spec: Spec, plan: Plan, ui) -> None:
    """`plan --check`: connect, run the preflight checks, start nothing."""
    with Session(spec, plan, ui) as session:
        ui.info(f"Checking {len(plan.hosts)} host(s)…")
        session.open()
        for name in plan.hosts:
            info = session.infos[name]
            ui.ok(f"{name}: python {info.python_version}, tensorflow {info.tf_version or 'MISSING'}, "
                  f"{info.gpus} GPU(s), machine {info.machine_id[:8] or '?'}")
        binders = [t for t in plan.tasks if t.runs_server or (plan.mode == "classic" and t.runs_script)]
        preflight(session, binders)
        ui.ok("preflight passed: every host can run its tasks and every port is free")
