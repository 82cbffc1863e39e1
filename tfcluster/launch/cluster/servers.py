"""Starting the cluster's TF servers and waiting until each listens on its port.

`up` starts detached servers (they outlive it) with one `launch` round trip per host;
`train` starts attached ones through the supervisor and waits here. Both report each
server as it becomes ready, and name the first that did not, with its log's tail. Ready
means the listening socket on the port is the started process's own: a port someone else
took after the preflight is reported with its holder.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from tfcluster.errors import ConnectError, DeadlineError, HostError, PreflightError, TfclusterError
from tfcluster.host.shim_protocol import DEFAULT_GRACE
from tfcluster.launch.cluster.session import Background, Session, by_host, raise_first
from tfcluster.plan import TaskPlan, names

READY_TIMEOUT = 120.0


@dataclass
class Started:
    task: TaskPlan
    tag: str
    pid: int
    log: str


def start_detached(session: Session, tasks: list[TaskPlan], run_id: str,
                   timeout: float = READY_TIMEOUT, execs: dict | None = None) -> list[Started]:
    """Start a detached server per task and wait until each is ready (one round trip per
    host, or none: `execs` are `up`'s open conversations, agent/upexec.py). On any failure, or
    Ctrl-C, everything started here is stopped first."""
    grouped = by_host(tasks)
    started: dict[str, Started] = {}

    def events(host: str):
        agent = session.agents[host]
        launches = {t.key: (t, session.launch_for(t, run_id, "server", agent.server_argv()))
                    for t in grouped[host]}
        stream = (execs[host].go(list(launches)) if execs and host in execs
                  else agent.launch([(k, t.port, l) for k, (t, l) in launches.items()], timeout))
        for key, state, value in stream:
            if state == "started":
                task, launch = launches[key]
                started[key] = Started(task, launch.tag, value, launch.log)
            yield key, state, value

    try:
        _raise_unready(session, _decide(session, grouped, [t.key for t in tasks], events), started, timeout)
    except TfclusterError as exc:     # a host's conversation ended, or its GO could not be written
        gone = _gone(session, list(grouped)) if execs else {}
        session.stop_run(names.run_prefix(session.plan.name, run_id), DEFAULT_GRACE,
                         [h for h in session.agents if h not in gone])
        if gone:    # its conversation ended as its host went: a loss, said as one
            host, why = next(iter(gone.items()))
            raise ConnectError(f"host {host} was lost while its servers started ({why}); every server this "
                               f"`up` started was stopped",
                               hint=f"run {session.plan.again('up')} again: a host still down then has its "
                                    f"servers started on a spare, where the spec has one") from None
        raise exc
    except BaseException:
        session.stop_run(names.run_prefix(session.plan.name, run_id), DEFAULT_GRACE)
        raise
    return list(started.values())


def _gone(session: Session, hosts: list[str]) -> dict[str, str]:
    """The hosts among `hosts` whose connection dropped and will not re-open: host -> why."""
    found = session.parallel(session.unreachable, hosts)
    return {h: why for h, why in found.items() if isinstance(why, str)}


def wait_ready(session: Session, started: list[Started], timeout: float = READY_TIMEOUT) -> None:
    """Block until every started server listens on its port (its own socket); raise naming
    the first that did not."""
    grouped = by_host(started, lambda s: s.task.host)

    def events(host: str):
        return session.agents[host].wait_ready([(s.task.key, s.task.port, s.pid) for s in grouped[host]], timeout)

    results = _decide(session, grouped, [s.task.key for s in started], events)
    _raise_unready(session, results, {s.task.key: s for s in started}, timeout)


@dataclass
class Watch:
    """watch_ready's question, asked: the servers it watches, and the hosts' answers to come."""
    keys: set[str]
    answers: Background


def watch_ready(session: Session, started: list[Started], settle: float,
                timeout: float = READY_TIMEOUT) -> Watch:
    """wait_ready asked now and judged later (check_ready): for held servers whose GO comes
    once the servers they replace have stopped (within `settle` seconds: till then a port
    another process holds is theirs), so that asking costs nothing after the GO."""
    grouped = by_host(started, lambda s: s.task.host)

    def events(host: str):
        return session.agents[host].wait_ready([(s.task.key, s.task.port, s.pid) for s in grouped[host]],
                                               timeout, settle)

    keys = [s.task.key for s in started]
    # no "still waiting" lines: nothing is awaited before the GO, which may be seconds away
    return Watch(set(keys), Background(_decide, session, grouped, keys, events, False))


def check_ready(session: Session, watch: Watch, started: list[Started],
                timeout: float = READY_TIMEOUT) -> None:
    """Block until every started server listens on its port, as wait_ready, with `watch`'s
    answers for those it watched (one it watched that was not started after all, a held server
    stopped instead of its GO, is not judged) and a wait_ready of their own for the rest."""
    keys = {s.task.key for s in started}
    answers = watch.answers.result()
    failed = {h for h, decided in answers.items() if isinstance(decided, Exception)}   # asked anew below
    results = {h: [d for d in decided if d[0] in keys] if isinstance(decided, list) else decided
               for h, decided in answers.items() if h not in failed}
    _raise_unready(session, results, {s.task.key: s for s in started}, timeout)
    rest = [s for s in started if s.task.key not in watch.keys or s.task.host in failed]
    if rest:
        wait_ready(session, rest, timeout)


def _decide(session: Session, hosts, keys: list[str], events, waiting: bool = True) -> dict:
    """Every host's `events(host)` ((key, state, value) as its servers start and are
    decided), in parallel, each ready one reported as it comes: host -> the decided
    (key, state, holder), or the host's error. `waiting`: the lines say how long it has
    been, and say it every TICK seconds without news."""
    progress = _Progress(session, keys, waiting)

    def one(host: str) -> list[tuple[str, str, str | None]]:
        decided = []
        for key, state, value in events(host):
            if state == "started":
                continue
            decided.append((key, state, value))
            if state == "ready":
                progress.ready(key)
        return decided

    try:
        return session.parallel(one, hosts)
    finally:
        progress.close()


def _raise_unready(session: Session, results: dict, started: dict[str, Started], timeout: float) -> None:
    raise_first(results, "host")
    for decided in results.values():
        for key, outcome, holder in decided:
            if outcome == "taken":
                task = started[key].task
                other = names.other_workdir(holder, session.plan.name)
                raise PreflightError(f"host {task.host}: port {task.port} for {key} was taken by "
                                     f"{holder} before the server could listen on it",
                                     hint=f"it looks like {other}" if other else
                                     "choose another port in the spec, or stop that process")
            if outcome != "ready":
                _raise_not_ready(session, started[key], outcome, timeout)


class _Progress:
    """A line per server as it becomes ready, naming the ones still awaited, and every
    TICK seconds without news a line saying what is still awaited and for how long."""

    TICK = 5.0
    NAMED = 4           # names shown before "+N more"

    def __init__(self, session: Session, keys: list[str], waiting: bool = True) -> None:
        self.session, self.total, self.t0, self.timed = session, len(keys), time.monotonic(), waiting
        self.pending = list(keys)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.last_news = self.t0
        if waiting:
            threading.Thread(target=self._tick, name="tfcluster-progress", daemon=True).start()

    def ready(self, key: str) -> None:
        with self.lock:
            if key in self.pending:
                self.pending.remove(key)
            count = self.total - len(self.pending)
            self.last_news = now = time.monotonic()
            waiting = f"; waiting for {self._names()}" if self.pending else ""
            took = f"{now - self.t0:.1f}s, " if self.timed else ""
            self.session.ui.info(f"  ✓ {key:<10} ready on {self.session.plan.task(key).target}"
                                 f"  ({took}{count}/{self.total}{waiting})")

    def _tick(self) -> None:
        while not self.done.wait(1.0):
            with self.lock:
                now = time.monotonic()
                if self.pending and now - self.last_news >= self.TICK:
                    self.last_news = now
                    self.session.ui.info(f"  … {now - self.t0:.0f}s: still waiting for {self._names()}")

    def _names(self) -> str:
        shown = ", ".join(self.pending[:self.NAMED])
        more = len(self.pending) - self.NAMED
        return shown + (f" (+{more} more)" if more > 0 else "")

    def close(self) -> None:
        self.done.set()


def _raise_not_ready(session: Session, s: Started, outcome: str, timeout: float) -> None:
    try:
        tail = session.agents[s.task.host].tail(s.log, 15)
    except TfclusterError:
        tail = ""
    where = f"{s.task.key} on {s.task.host} ({s.task.target})"
    details = f"last lines of {s.task.key}'s log ({s.log}):\n{tail}" if tail.strip() else None
    if outcome == "timeout":
        raise DeadlineError(f"{where}: server not ready after {timeout:.0f}s", details=details)
    raise HostError(f"{where}: server exited before it was ready", details=details)
