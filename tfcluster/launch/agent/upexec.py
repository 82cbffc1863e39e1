"""`up` in one remote execution per host: the launcher's side of shim_launch.up.

Each host gets one exec that stays open for the whole start: the bootstrap answers the
host's info and survey and starts its servers warm (they import TensorFlow, unbound,
while the checks run), reachability runs in the same exec, and GO starts the servers.
A check that fails on any host ends every conversation before GO: each host's shim stops
its warm servers and exits, and close() waits for that. docs/design/remote-execs.md, "The round
trips of `up`".
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Iterator

from tfcluster.errors import HostError
from tfcluster.host import shim_protocol as proto
from tfcluster.launch.agent.lines import Lines, close_input
from tfcluster.launch.agent.records import HostInfo, TaskLaunch, event_of, start_request
from tfcluster.plan import names
from tfcluster.transport.base import Proc

if TYPE_CHECKING:
    from tfcluster.launch.agent.agent import HostAgent

EXIT_WAIT = 15.0     # the shim stops its warm servers (TERM, at most the grace, KILL) and exits


class UpExec:
    """One host's conversation. open() -> reach lines (cluster/reach.py) -> go() or close()."""

    def __init__(self, agent: HostAgent) -> None:
        self.agent = agent
        self.proc: Proc | None = None
        self.lines: Lines | None = None
        self.warm: tuple[str, ...] = ()
        self.done = False            # every server of go() decided: nothing left to stop there
        self.starts = False          # its request started servers (warm ones, maybe)
        self.went = False            # GO sent: the shim keeps the table its batch put in
        self._lock = threading.Lock()

    def server_argv(self) -> tuple[str, ...]:
        """The server's argv before the host is known (its `~/` is expanded there)."""
        return (self.agent.python, f"{self.agent.bindir}/tfserver.py")

    def open(self, survey: tuple[str, list[int]], servers: list[tuple[str, int, TaskLaunch]],
             timeout: float, warm: bool = True) -> HostInfo:
        """Connect, bootstrap, answer info + survey (the agent adopts them), start `servers`
        warm when this host's own checks pass. Returns the host's info."""
        request = {"starts": [{"key": k, "port": p, "req": start_request(t, self.agent.paths.root, p)}
                              for k, p, t in servers],
                   "warm": warm, "timeout": timeout}
        self.starts = bool(servers)
        answer = self.agent.open_conversation(self, proto.UP, request, survey=survey,
                                              batch=lambda req, commands: {"commands": commands, **req})
        self.warm = tuple(answer.get("warm") or ())
        return self.agent.info

    def attach(self, proc: Proc) -> Lines:
        """The process of this conversation (HostAgent.open_conversation); one before it (a
        bootstrap that found stale files) is dropped."""
        if self.proc is not None:
            self.proc.kill()
        self.proc = proc
        self.lines = Lines(proc, f"host {self.agent.name}: up")
        return self.lines

    def interrupt(self) -> None:
        proc = self.proc
        if proc is not None:
            proc.kill()

    def end_reach(self, deadline) -> None:
        """Reachability is done: its listeners close at GO, not before (nothing to say)."""

    def go(self, keys: list[str]) -> Iterator[tuple[str, str, object]]:
        """Start these servers (warm ones get GO): (key, "started", pid), then (key, state,
        holder) as each is decided, as HostAgent.launch yields them."""
        self.proc.write(proto.json_line({"go": list(keys)}))
        self.went = True
        pending = set(keys)
        while pending:
            try:
                answer = self.lines.check(self.lines.next())
            except HostError:
                self.agent.check_cancelled()     # dropped by Ctrl-C: that, not its early end
                raise
            key, state, value = event_of(answer)
            if state != "started":
                pending.discard(key)
                self.done = not pending
            yield key, state, value

    def keep(self) -> None:
        """`up` succeeded and starts nothing here (a spare, a host whose servers all run): GO
        with no server, so the shim keeps the table its batch put in. A conversation that ends
        without GO (a failed check, Ctrl-C, the launcher killed before it read the answer) has
        its shim take that table back once nothing of the cluster runs there."""
        with self._lock:
            proc = self.proc
        if proc is not None and not self.went:
            proc.write(proto.json_line({"go": []}))
            self.went = True

    def next_line(self) -> dict | None:
        """The next JSON line (non-JSON noise, such as a login banner, is skipped); None at EOF."""
        return self.lines.next()

    def close(self) -> bool:
        """End the conversation: before GO the shim stops its warm servers; wait for its exit
        (not after a go() that saw every server decided: the shim is leaving by itself).
        False when the shim did not exit cleanly (killed: Ctrl-C, a deadline), so that what
        it started may still run."""
        with self._lock:
            proc, self.proc = self.proc, None
        if proc is None or self.done:
            return True
        close_input(proc)
        rc = proc.wait(EXIT_WAIT)
        if rc is None:
            proc.kill()
        return rc == 0


def open_all(session, servers, run_id: str, timeout: float) -> dict[str, UpExec]:
    """One conversation per host of the session, opened in parallel as Session.open opens
    them (the session's infos and the agents' surveys filled alike)."""
    execs = {name: UpExec(session.agent(name)) for name in session.host_names}

    def open_host(name: str, survey, _files) -> HostInfo:
        ex = execs[name]
        launches = [(t.key, t.port, session.launch_for(t, run_id, "server", ex.server_argv()))
                    for t in servers if t.host == name]
        return ex.open(survey, launches, timeout)

    try:
        session.open(survey=list(servers), prepare=open_host)
    except BaseException:
        close_all(session, execs, names.run_prefix(session.plan.name, run_id))
        raise
    return execs


def close_all(session, execs: dict[str, UpExec], run_prefix: str, keep: bool = False) -> None:
    """Close every conversation (`keep`: the `up` succeeded, UpExec.keep first); where one did
    not end cleanly (its shim killed, so its warm servers may live on until their import
    ends), stop this run's processes by tag."""
    def close(name: str) -> bool:
        if keep:
            execs[name].keep()
        return execs[name].close()

    closed = session.parallel(close, list(execs))
    unclean = [name for name, ok in closed.items() if ok is not True and execs[name].starts]
    if unclean:
        session.parallel(lambda name: session.agents[name].stop(run_prefix, proto.DEFAULT_GRACE), unclean)
