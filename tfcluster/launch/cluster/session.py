"""A session on the plan's hosts: one HostAgent per host, opened in parallel, and the
steps `up` and `train` share (preflight, survey, starting servers, stopping a run).

Work on several hosts runs in daemon threads through `Session.parallel`. Ctrl-C (or
SIGTERM) reaches the main thread only: it stops waiting at once, tells every agent
to start nothing more and to drop what it is starting, and propagates as itself,
never as a host failure. The caller's cleanup then sweeps by tag.
"""
from __future__ import annotations

import shlex
import threading
from typing import Callable, Iterable, TypeVar

from tfcluster.diagnose.proxy import no_proxy_for
from tfcluster.errors import Terminated, TfclusterError
from tfcluster.host.shim_protocol import FLUSH_VAR, PROBE_VAR
from tfcluster.launch.agent import fence
from tfcluster.launch.agent.agent import HostAgent, HostInfo, Survey, TaskLaunch
from tfcluster.launch.cluster.hostloss import REOPEN_GRACE
from tfcluster.launch.cluster.hostpool import HostPool
from tfcluster.plan import HostPlan, Plan, TaskPlan, names

T = TypeVar("T")
R = TypeVar("R")

SETTLE_AFTER_INTERRUPT = 2.0   # seconds the host threads get to notice a Ctrl-C
STDOUT_FLUSH = "0.01"          # a script's stdout reaches its log at least this often (seconds)


def parallel(fn: Callable[[T], R], items: Iterable[T], limit: int = 32,
             on_interrupt: Callable[[], None] | None = None) -> dict[T, R | BaseException]:
    """Run fn over items in daemon threads; every item gets its result or its exception.

    An interrupt while waiting (KeyboardInterrupt, Terminated) calls `on_interrupt`,
    gives the threads SETTLE_AFTER_INTERRUPT seconds to wind down, and re-raises."""
    items = list(items)
    results: dict = {}
    if not items:
        return results
    pending = iter(items)
    lock = threading.Lock()
    done = threading.Event()
    stop = threading.Event()
    remaining = [len(items)]

    def worker() -> None:
        while not stop.is_set():
            with lock:
                item = next(pending, _END)
            if item is _END:
                return
            try:
                result = fn(item)
            except BaseException as exc:  # noqa: BLE001 - reported per item by the caller
                result = exc
            with lock:
                results[item] = result
                remaining[0] -= 1
                if not remaining[0]:
                    done.set()

    try:  # an interrupt may land while the threads are being started, too
        for _ in range(min(limit, len(items))):
            threading.Thread(target=worker, daemon=True, name="tfcluster-host").start()
        done.wait()
    except BaseException:
        stop.set()
        if on_interrupt is not None:
            on_interrupt()
        done.wait(SETTLE_AFTER_INTERRUPT)
        raise
    return {item: results[item] for item in items}


_END = object()


class Background:
    """fn(*args) on a thread; result() joins it and returns its value or raises its error."""

    def __init__(self, fn, *args) -> None:
        self._out: list = []
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True,
                                        name="tfcluster-background")
        self._thread.start()

    def _run(self, fn, args) -> None:
        try:
            self._out.append((True, fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - raised by result()
            self._out.append((False, exc))

    def done(self) -> bool:
        return bool(self._out)

    def result(self):
        self._thread.join()
        ok, value = self._out[0]
        if not ok:
            raise value
        return value


def raise_first(results: dict, what: str) -> None:
    """Raise the first failure, mentioning how many other items failed too. An interrupt
    that reached a host thread is re-raised as itself."""
    failures = [(k, e) for k, e in results.items() if isinstance(e, BaseException)]
    for _key, exc in failures:
        if isinstance(exc, (KeyboardInterrupt, Terminated)):
            raise exc
    if not failures:
        return
    key, exc = failures[0]
    if not isinstance(exc, TfclusterError):
        exc = TfclusterError(f"{what} {key}: {type(exc).__name__}: {exc}")
    if len(failures) > 1:
        others = ", ".join(str(k) for k, _ in failures[1:])
        exc.message = f"{exc.message} (also failed: {others})"
        exc.args = (exc.message,)
        scans = [e.scan for _, e in failures if getattr(e, "scan", None)]
        if len(scans) > 1:      # every unknown key in one line per port, not the first host's alone
            exc.hint = _scan_hint(scans)
    raise exc


def _scan_hint(scans: list[tuple[int, str, str]]) -> str:
    grouped: dict[tuple[int, str], list[str]] = {}
    for port, address, known in scans:
        grouped.setdefault((port, known), []).append(shlex.quote(address))
    lines = [f"`ssh-keyscan -p {port} {' '.join(addresses)} >> {known}`" for (port, known), addresses in grouped.items()]
    return (f"run {' and '.join(lines)} after checking the fingerprints ({len(scans)} hosts), "
            "or set ssh.host_key_policy: accept-new")


def by_host(items, host=lambda t: t.host) -> dict[str, list]:
    grouped: dict[str, list] = {}
    for item in items:
        grouped.setdefault(host(item), []).append(item)
    return grouped


def make_agent(host: HostPlan, cluster_dir: str) -> HostAgent:
    from tfcluster.transport import make_transport

    transport = make_transport(host.name, host.address, local=host.local, ssh=host.ssh)
    return HostAgent(host.name, transport, host.python, cluster_dir, bindir=host.bindir, in_process=host.in_process)


class Session:
    """One HostAgent per host of the plan, prepared (connected, shim shipped) in parallel."""

    def __init__(self, plan: Plan, ui, hosts: Iterable[str] | None = None, *, light: bool = False) -> None:
        """`light`: each host's `info` says only which machine it is (down, status), so no
        `nvidia-smi` or version lookup runs there; infos then hold no versions or GPUs."""
        self.plan = plan
        self.light = light
        self.ui = ui
        self.paths = names.ClusterPaths(plan.cluster_dir)
        # by default the hosts with tasks and the spares (docs/spec.md, "Spare hosts"): a spare
        # that cannot be opened or fails a check is set aside with a warning, never a failure
        self.host_names = tuple(hosts) if hosts is not None else tuple(dict.fromkeys((*plan.hosts, *plan.spares)))
        self.agents: dict[str, HostAgent] = {}
        self.infos: dict[str, HostInfo] = {}
        self.no_proxy = no_proxy_for(plan)    # every task's start request carries these
        # asked with open()'s survey: `up` and `train` close the task ports, `status` asks
        # whether they are (launch/agent/fence.py); None: not asked
        self.fence: str | None = fence.STATUS if light else fence.INSTALL
        self.pool = HostPool()                # which hosts can take tasks now (launch/cluster/hostpool.py)

    def adopt(self, plan: Plan) -> None:
        """The plan after a move to a spare (run/recovery.py): its tasks' hosts and addresses."""
        self.plan = plan
        self.no_proxy = no_proxy_for(plan)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def parallel(self, fn: Callable[[T], R], items: Iterable[T], limit: int = 32) -> dict:
        return parallel(fn, items, limit, on_interrupt=self.interrupt)

    def interrupt(self) -> None:
        for agent in list(self.agents.values()):
            agent.interrupt()

    def agent(self, name: str) -> HostAgent:
        """The host's agent, created (not yet connected) on first use."""
        if name not in self.agents:
            self.agents[name] = make_agent(self.plan.host(name), self.plan.cluster_dir)
            self.agents[name].info_request = {"light": True} if self.light else {}
        return self.agents[name]

    def open(self, *, strict: bool = True, survey: list[TaskPlan] | None = None,
             ship: tuple[list, str, set[str]] | None = None, prepare: Callable | None = None) -> dict:
        """Connect and prepare every host; returns name -> HostInfo | exception.

        `survey`: tasks whose ports (and this cluster's processes) the same round trip
        should look at, for a survey() that follows. `ship` = (files, run dir, hosts): the
        same round trip places those files from each host's cache (shipping.ship then
        sends only what a cache lacked). `prepare(name, survey, files)`: prepares the host
        in place of HostAgent.prepare (train also starts its held scripts, run/startup.py)."""
        for name in self.host_names:
            self.agent(name)
        ports = by_host(survey or [])
        prefix = names.cluster_prefix(self.plan.name)

        def one(name: str) -> HostInfo:
            wanted = (prefix, [t.port for t in ports.get(name, [])]) if survey is not None else None
            agent = self.agents[name]
            if self.fence and survey is not None:
                agent.fence_request = fence.request(self.plan, name, self.fence)
            files = agent.files_request(ship[0], ship[1]) if ship and name in ship[2] and ship[0] else None
            return prepare(name, wanted, files) if prepare is not None else agent.prepare(wanted, files)

        results = self.parallel(one, self.host_names)
        for name, result in results.items():
            if not isinstance(result, BaseException):
                self.infos[name] = result
        if strict:
            failed = {h: r for h, r in results.items() if fence.idle_spare(self.plan, h)
                      and isinstance(r, Exception) and not isinstance(r, Terminated)}
            self.set_aside({h: _unprefixed(h, str(e)) for h, e in failed.items()})
            raise_first({h: r for h, r in results.items() if h not in failed}, "host")
        if self.fence in (fence.INSTALL, fence.PROBE) and survey is not None:
            self.set_aside(fence.spare_problems(self.plan, self.fence_answers()))
            fence.report(self.plan, self.ui, self.fence_answers(), self.fence)
        return results

    def unreachable(self, host: str) -> str | None:
        """Why `host` cannot be reached now: its connection dropped and no new one opened within
        REOPEN_GRACE; None when it can (or it was never opened)."""
        agent = self.agents.get(host)
        return None if agent is None else agent.transport.reopen(REOPEN_GRACE)

    def reached(self) -> list[str]:
        """The hosts an opening reached: those that answered (every one in `infos`), and those
        whose answer a Ctrl-C cut short (their batch's table may be there all the same; the
        opening as a whole raised, so `infos` holds none of them)."""
        return [name for name, agent in self.agents.items() if agent.reached]

    def set_aside(self, spares: dict[str, str]) -> None:
        """Spares that cannot take tasks (spare -> why): one warning each, and the session
        goes on without them."""
        for name, why in spares.items():
            self.ui.warn(f"spare {name} not usable: {why}")
            self.pool.set_aside(name, why)
            self.infos.pop(name, None)
        self.host_names = tuple(h for h in self.host_names if h not in spares)
        self.drop(spares)

    def fence_answers(self) -> dict[str, dict | None]:
        """Each opened host's answer to its `fence` request (None where none was asked)."""
        return {name: agent.fence_answer for name, agent in self.agents.items()
                if agent.fence_request is not None}

    def drop(self, hosts: Iterable[str]) -> None:
        """Forget hosts that could not be opened (their agents hold nothing)."""
        for name in hosts:
            agent = self.agents.pop(name, None)
            if agent is not None:
                agent.close()

    def close(self) -> None:
        parallel(lambda a: a.close(), list(self.agents.values()))
        self.agents.clear()

    # -- naming what a run starts -------------------------------------------------------

    def launch_for(self, task: TaskPlan, run_id: str, role: str, argv,
                   extra_env: dict[str, str] | None = None, private_tmp: bool = False) -> TaskLaunch:
        tag = names.Tag(self.plan.name, run_id, task.job, task.index, role)
        env = dict(task.env)
        if role == "script":
            env.update(task.script_env)
            probe = self.plan.probes()
            if probe:
                env[PROBE_VAR] = probe
            env.setdefault(FLUSH_VAR, STDOUT_FLUSH)   # the spec's `env:` may set "0": unbuffered
        env["TFCLUSTER_RUN_ID"] = run_id
        env.update(extra_env or {})
        return TaskLaunch(tag=str(tag), argv=tuple(argv), env=env, cwd=self.paths.rundir(run_id),
                          log=self.paths.log(run_id, task.key, role), pidfile=self.paths.pidfile(tag),
                          no_proxy=self.no_proxy, private_tmp=private_tmp)

    def survey(self, tasks: list[TaskPlan]) -> tuple[dict[str, object], dict]:
        """One round trip per host: live servers of this cluster (task key -> TaskStatus) and
        who holds the given tasks' ports ((host, port) -> holder or None)."""
        ports = by_host(tasks)
        prefix = names.cluster_prefix(self.plan.name)
        results: dict[str, Survey | BaseException] = self.parallel(
            lambda h: self.agents[h].survey(prefix, [t.port for t in ports.get(h, [])]),
            list(self.agents))
        raise_first(results, "host")
        live, busy = {}, {}
        for host, found in results.items():
            busy.update({(host, port): holder for port, holder in found.ports.items()})
            live.update(_live_servers(found.statuses))
        return live, busy

    def serves_already(self) -> bool | None:
        """Whether the surveys the hosts' opening batches asked (not yet read by survey())
        found a live server of this cluster, `up`'s; None where no host answered one."""
        seen = [st for st in (a.surveyed() for a in list(self.agents.values())) if st is not None]
        return any(_live_servers(st) for st in seen) if seen else None

    def stop_run(self, prefix: str, grace: float, hosts: Iterable[str] | None = None) -> dict:
        """Stop every process with this tag prefix on every connected host, or on `hosts` (a
        lost host's processes are stopped by their shims, which lost their launcher)."""
        hosts = [h for h in (self.agents if hosts is None else hosts)
                 if h in self.agents and h not in self.pool.lost and not self.pool.gone_by_now(h)]
        return parallel(lambda h: self.agents[h].stop(prefix, grace), hosts)

    def take_tables(self, prefix: str, hosts: Iterable[str]) -> None:
        """The run's stop on `hosts`, where nothing of it runs: each takes the table the run put
        there, once nothing of the cluster is left (shim_fence.release_if_idle). Quiet: the
        run's own end or error follows, and this is never the reason it is not said."""
        hosts = list(hosts)
        if hosts:
            try:
                self.stop_run(prefix, grace=0, hosts=hosts)
            except Exception:  # noqa: BLE001 - what the run says next is what matters
                pass


def _live_servers(statuses) -> dict[str, object]:
    """Task key -> status of the live servers among a host's statuses (warm ones and those no
    record names are not servers of the cluster yet)."""
    live = {}
    for st in statuses:
        tag = names.Tag.parse(st.tag)
        if st.alive and not st.warm and not st.unrecorded and tag is not None and tag.role == "server":
            live[tag.key] = st
    return live


def _unprefixed(host: str, text: str) -> str:
    """An error's text without its leading `host NAME: ` or `host NAME (ADDRESS): ` (the
    warning names the host): `127.0.0.9:22: connection refused`."""
    if text.startswith(f"host {host}: "):
        return text[len(f"host {host}: "):]
    if text.startswith(f"host {host} (") and "): " in text:
        address, _, rest = text[len(f"host {host} ("):].partition("): ")
        return f"{address}: {rest}"
    return text


def server_tasks(plan: Plan) -> list[TaskPlan]:
    return [t for t in plan.tasks if t.runs_server]
