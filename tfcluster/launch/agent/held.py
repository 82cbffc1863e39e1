"""Deferred attached starts: a script's shim is started before the checks end, and starts
its task only on GO.

The shim's start (a login shell and an interpreter on the host, ~0.1-0.2 s of CPU) then
overlaps reachability, the shipping of stale files and the servers' start instead of
following them. Until GO the shim starts nothing; the first one on each host also holds
that host's side of reachability (cluster/reach.py speaks its lines to it), so the check costs no
exec of its own there. A check that fails drops the channels: each shim reads EOF and
exits, having started nothing. docs/design/remote-execs.md, "Checks before a run".
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from tfcluster.errors import HostError
from tfcluster.host import shim_protocol as proto
from tfcluster.launch.agent.attached import AttachedTask, handshake
from tfcluster.launch.agent.lines import Deadline, Lines
from tfcluster.launch.agent.records import HostInfo, TaskLaunch, start_request
from tfcluster.transport.base import Proc

if TYPE_CHECKING:
    from tfcluster.launch.agent.agent import HostAgent

ANSWER_TIMEOUT = 60.0     # the bootstrap's and the batch's answers (HostAgent's run() waits as long)


class _Locked:
    """A process whose stdin has one writer at a time: the heartbeat thread and reach's
    lines share it, and a line must never be cut by another."""

    def __init__(self, proc: Proc) -> None:
        self._proc = proc
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self._lock:
            self._proc.write(data)

    @property
    def on_stderr(self):
        return self._proc.on_stderr

    @on_stderr.setter
    def on_stderr(self, hear) -> None:     # the transport calls the process's own
        self._proc.on_stderr = hear

    def __getattr__(self, name: str):
        return getattr(self._proc, name)


class HeldStart:
    """One deferred start: spawned at once, beaten from the start, started by go().

    With `bootstrap` (prepare_holding) the exec is also the host's bootstrap: it checks the
    shipped files, answers prepare()'s batch (info, `survey`, `files`), then holds, so a
    host with a script costs one exec before its first task byte."""

    def __init__(self, agent: HostAgent, launch: TaskLaunch, heartbeat_timeout: float, grace: float,
                 restart: dict | None = None, *, bootstrap: bool = False, survey=None, files=None,
                 extra: dict | None = None) -> None:
        agent.check_cancelled()
        self.agent, self.launch, self._timeout = agent, launch, heartbeat_timeout
        self.proc: _Locked | None = None     # its process, stdin shared with the heartbeats
        self.lines: Lines | None = None      # its stdout: reach's lines, the batch's answer
        self.task: AttachedTask | None = None
        self._holding = True                 # until go() or drop(): interrupt() drops it
        request = {**start_request(launch, agent.paths.root), "attached": True, "defer": True,
                   "heartbeat_timeout": heartbeat_timeout, "grace": grace,
                   "deflate": agent.transport.deflate_logs}
        if restart:                   # the shim restarts the task in place (attempts.in_place)
            request["restart"] = restart
        request.update(extra or {})   # a warm standby's (agent/standby.py)
        batch = (lambda req, commands: {**req, "batch": {"commands": commands}}) if bootstrap else None
        try:
            agent.open_conversation(self, proto.START, request, batch=batch, survey=survey, files=files)
        except BaseException:
            self.drop()
            raise
        agent.keep_alive(self.task)   # silence before GO stops the shim too

    def attach(self, proc: Proc) -> Lines:
        """Its process (HostAgent.open_conversation); one before it (a bootstrap that found
        stale files) is dropped."""
        if self.task is not None:
            self.task.detach_kill()
        self.proc = _Locked(proc)
        self.task = AttachedTask(self.proc, self._timeout / proto.HEARTBEATS_PER_TIMEOUT)
        self.lines = Lines(self.proc, f"host {self.agent.name}: shim start", timeout=ANSWER_TIMEOUT)
        return self.lines

    def interrupt(self) -> None:
        if self._holding and self.proc is not None:
            self.proc.kill()

    def end_reach(self, deadline: Deadline) -> None:
        """Reachability is done on every host: its listeners close on a line of their own,
        and it says so before anything binds."""
        self.proc.write(proto.json_line({"close": True}))
        self.lines.answer("closed", f"host {self.agent.name}: reach", deadline)

    def go(self) -> AttachedTask:
        """GO: the shim starts the task and answers its pid."""
        where = f"host {self.agent.name}: {self.launch.tag}"
        try:
            self.agent.check_cancelled()
            if self.lines.buf.strip():
                raise HostError(f"{where}: shim said {self.lines.buf[:200]!r} before the task started")
            self.task.go()      # a shim already gone: the handshake reads why (its stderr)
            self.task.started(*handshake(self.proc, where))   # from now on its stderr is the task's
        except BaseException:
            self.drop()
            raise
        finally:
            self._holding = False
        return self.task

    def drop(self) -> None:
        """Close the channel: the shim reads EOF and exits, having started nothing (after
        GO: it stops the task, as for any attached task)."""
        self._holding = False
        if self.task is not None:
            self.task.detach_kill()


def prepare_holding(agent: HostAgent, survey, files: dict | None, launch: TaskLaunch,
                    heartbeat_timeout: float, grace: float,
                    restart: dict | None = None) -> tuple[HostInfo, HeldStart]:
    """HostAgent.prepare() and the host's first held start in one exec (not for a host
    answered in-process)."""
    held = HeldStart(agent, launch, heartbeat_timeout, grace, restart, bootstrap=True, survey=survey, files=files)
    return agent.info, held
