"""`up` in one remote execution per host: the launcher's side of shim_up.py.

Each host gets one exec that stays open for the whole start: the bootstrap answers the
host's info and survey and starts its servers warm (they import TensorFlow, unbound,
while the checks run), reachability runs in the same exec, and GO starts the servers.
A check that fails on any host ends every conversation before GO: each host's shim stops
its warm servers and exits, and close() waits for that. docs/ARCHITECTURE.md, "The round
trips of `up`".
"""
from __future__ import annotations

import threading
from typing import Iterator

from tfcluster.host import shim_fs
from tfcluster.host import shim_protocol as proto
from tfcluster.launch.agent import HostAgent
from tfcluster.launch.records import TaskLaunch, start_request
from tfcluster.launch.attached import json_object, tail_text
from tfcluster.host import HOST_DIR
from tfcluster.launch.bootstrap import NO_SITE, bootstrap_argv, cluster_tree
from tfcluster.errors import HostError, PreflightError
from tfcluster.transport.base import Proc

EXIT_WAIT = 15.0     # the shim stops its warm servers (TERM, at most the grace, KILL) and exits


class UpExec:
    """One host's conversation. open() -> reach lines (reach.py) -> go() or close()."""

    def __init__(self, agent: HostAgent) -> None:
        self.agent = agent
        self.proc: Proc | None = None
        self.buf = b""
        self.warm: tuple[str, ...] = ()
        self.done = False            # every server of go() decided: nothing left to stop there
        self.starts = False          # its request started servers (warm ones, maybe)
        self._lock = threading.Lock()

    def server_argv(self) -> tuple[str, ...]:
        """The server's argv before the host is known (its `~/` is expanded there)."""
        a = self.agent
        bindir = HOST_DIR if a._in_process else a._wanted_bindir   # noqa: SLF001
        return (a.python, f"{bindir}/tfserver.py")

    def open(self, survey: tuple[str, list[int]], servers: list[tuple[str, int, TaskLaunch]],
             timeout: float, warm: bool = True) -> None:
        """Connect, bootstrap, answer info + survey (the agent adopts them), start `servers`
        warm when this host's own checks pass."""
        a = self.agent
        request = {"commands": {proto.INFO: {}, **a._survey_commands(*survey)},   # noqa: SLF001
                   "starts": [{"key": k, "port": p, "req": start_request(t, a.paths.root, p)} for k, p, t in servers],
                   "warm": warm, "timeout": timeout}
        self.starts = bool(servers)
        if a._in_process:   # noqa: SLF001 - tfcluster's own interpreter on this machine
            try:
                shim_fs.private_tree(cluster_tree(a.paths, a._wanted_bindir))   # noqa: SLF001
            except (shim_fs.Refused, OSError) as e:
                raise PreflightError(f"host {a.name}: {proto.describe_exception(e)}") from None
            a._bindir = HOST_DIR   # noqa: SLF001
            self._spawn([a.python, NO_SITE, f"{HOST_DIR}/shim.py", proto.UP], proto.json_line(request))
        else:
            boot, files = a.bootstrap_request(proto.UP)
            self._spawn(bootstrap_argv(a.python), proto.json_line(boot) + proto.json_line(request))
            boot = a.boot_verdict(self.next_line(), self.proc)
            if boot["stale"]:
                self.proc.wait(10.0)
                self._drop()
                a.ship_stale(boot["stale"], files)
                self._spawn([a.python, NO_SITE, f"{a._bindir}/shim.py", proto.UP], proto.json_line(request))   # noqa: SLF001
        answer = self.next_line()
        if answer is None or "answers" not in answer:
            raise self._ended(answer)
        self.warm = tuple(answer.get("warm") or ())
        a.adopt(a._checked_answers(answer["answers"]), survey)   # noqa: SLF001

    def go(self, keys: list[str]) -> Iterator[tuple[str, str, object]]:
        """Start these servers (warm ones get GO): (key, "started", pid), then (key, state,
        holder) as each is decided, as HostAgent.launch yields them."""
        self.proc.write(proto.json_line({"go": list(keys)}))
        pending = set(keys)
        while pending:
            answer = self.next_line()
            if answer is None or proto.error_of(answer) is not None:
                self.agent._check_cancelled()   # noqa: SLF001
                raise self._ended(answer)
            if "pid" in answer:
                yield answer["key"], "started", int(answer["pid"])
            else:
                pending.discard(answer["key"])
                self.done = not pending
                yield answer["key"], answer["state"], answer.get("holder")

    def next_line(self) -> dict | None:
        """The next JSON line (non-JSON noise, such as a login banner, is skipped); None at EOF."""
        while True:
            while b"\n" not in self.buf:
                chunk = self.proc.read()
                if not chunk:
                    return None
                self.buf += chunk
            line, self.buf = self.buf.split(b"\n", 1)
            answer = json_object(line)
            if answer is not None:
                return answer

    def close(self) -> bool:
        """End the conversation: before GO the shim stops its warm servers; wait for its exit
        (not after a go() that saw every server decided: the shim is leaving by itself).
        False when the shim did not exit cleanly (killed: Ctrl-C, a deadline), so that what
        it started may still run."""
        with self._lock:
            proc, self.proc = self.proc, None
        if proc is None:
            return True
        if self.done:
            self.agent.untrack(proc)
            return True
        try:
            proc.close_stdin()
        except OSError:
            pass
        rc = proc.wait(EXIT_WAIT)
        if rc is None:
            proc.kill()
        self.agent.untrack(proc)
        return rc == 0

    def _spawn(self, argv: list[str], data: bytes) -> None:
        self.agent._check_cancelled()   # noqa: SLF001
        self.proc = self.agent.transport.spawn(argv)
        self.agent.track(self.proc)
        self.buf = b""
        try:
            self.proc.write(data)
        except BrokenPipeError:     # it ended unread (no such python): its exit says why
            pass

    def _drop(self) -> None:
        proc, self.proc = self.proc, None
        self.agent.untrack(proc)
        proc.kill()

    def _ended(self, answer) -> HostError:
        problem = proto.error_of(answer)
        if problem is None:
            problem = "ended early: " + (tail_text(self.proc.read_stderr()) or "no output")
        return HostError(f"host {self.agent.name}: up: {problem}")


def open_all(session, servers, run_id: str, timeout: float) -> dict[str, UpExec]:
    """One conversation per host of the session, opened in parallel; the session's infos
    and the agents' surveys are filled as Session.open(survey=servers) fills them."""
    from tfcluster.plan import names
    from tfcluster.launch.session import by_host, raise_first

    prefix = names.cluster_prefix(session.plan.name)
    grouped = by_host(servers)
    execs = {name: UpExec(session.agent(name)) for name in session.host_names}

    def open_host(name: str):
        ex = execs[name]
        tasks = grouped.get(name, [])
        launches = [(t.key, t.port, session.launch_for(t, run_id, "server", ex.server_argv())) for t in tasks]
        ex.open((prefix, [t.port for t in tasks]), launches, timeout)
        return ex.agent._info   # noqa: SLF001

    try:
        results = session.parallel(open_host, session.host_names)
        for name, result in results.items():
            if not isinstance(result, BaseException):
                session.infos[name] = result
        raise_first(results, "host")
    except BaseException:
        close_all(session, execs, names.run_prefix(session.plan.name, run_id))
        raise
    return execs


def close_all(session, execs: dict[str, UpExec], run_prefix: str) -> None:
    """Close every conversation; where one did not end cleanly (its shim killed, so its warm
    servers may live on until their import ends), stop this run's processes by tag."""
    from tfcluster.launch.session import parallel

    closed = parallel(lambda name: execs[name].close(), list(execs))
    unclean = [name for name, ok in closed.items() if ok is not True and execs[name].starts]
    if unclean:
        parallel(lambda name: session.agents[name].stop(run_prefix, proto.DEFAULT_GRACE), unclean)
