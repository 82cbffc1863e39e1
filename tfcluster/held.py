"""Deferred attached starts: a script's shim is started before the checks end, and starts
its task only on GO.

The shim's start (a login shell and an interpreter on the host, ~0.1-0.2 s of CPU) then
overlaps reachability, the shipping of stale files and the servers' start instead of
following them. Until GO the shim starts nothing; the first one on each host also holds
that host's side of reachability (reach.py speaks its lines to it), so the check costs no
exec of its own there. A check that fails drops the channels: each shim reads EOF and
exits, having started nothing. docs/ARCHITECTURE.md, "Checks before a run".
"""
from __future__ import annotations

import threading

from tfcluster import shim_protocol as proto
from tfcluster.agent import HostAgent
from tfcluster.agent_types import TaskLaunch, start_request
from tfcluster.attached import AttachedTask, handshake
from tfcluster.errors import HostError, PreflightError
from tfcluster.transport.base import Proc


class _Locked:
    """A process whose stdin has one writer at a time: the heartbeat thread and reach's
    lines share it, and a line must never be cut by another."""

    def __init__(self, proc: Proc) -> None:
        self._proc = proc
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self._lock:
            self._proc.write(data)

    def __getattr__(self, name: str):
        return getattr(self._proc, name)


class HeldStart:
    """One deferred start: spawned at once, beaten from the start, started by go()."""

    closes = True            # reach.py: its listeners close on a line of their own, not at exit

    def __init__(self, agent: HostAgent, launch: TaskLaunch, heartbeat_timeout: float,
                 grace: float) -> None:
        agent._check_cancelled()   # noqa: SLF001
        self.agent, self.launch = agent, launch
        self.buf = b""           # reach's unread bytes of stdout
        request = {**start_request(launch, agent.paths.root), "attached": True, "defer": True,
                   "heartbeat_timeout": heartbeat_timeout, "grace": grace}
        try:
            self._raw = agent.transport.spawn(agent._shim_argv(proto.START))   # noqa: SLF001
        except OSError as e:
            raise PreflightError(f"host {agent.name}: cannot run {agent.python}: {e}") from None
        agent.track(self._raw)
        self.proc = _Locked(self._raw)
        self.task = AttachedTask(self.proc, 0, heartbeat_timeout / proto.HEARTBEATS_PER_TIMEOUT)
        try:
            self.proc.write(proto.json_line(request))
        except BaseException:
            self.drop()
            raise
        agent._heartbeats.add(self.task)   # noqa: SLF001 - silence before GO stops the shim too

    def go(self) -> AttachedTask:
        """GO: the shim starts the task and answers its pid."""
        where = f"host {self.agent.name}: {self.launch.tag}"
        try:
            self.agent._check_cancelled()   # noqa: SLF001
            if self.buf.strip():
                raise HostError(f"{where}: shim said {self.buf[:200]!r} before the task started")
            if not self.task.go():
                raise HostError(f"{where}: the shim went away before GO")
            self.task.pid = handshake(self.proc, where)
        except BaseException:
            self.drop()
            raise
        finally:
            self.agent.untrack(self._raw)
        return self.task

    def drop(self) -> None:
        """Close the channel: the shim reads EOF and exits, having started nothing (after
        GO: it stops the task, as for any attached task)."""
        self.task.detach_kill() if hasattr(self, "task") else self._raw.kill()
        self.agent.untrack(self._raw)
