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

from tfcluster.host import shim_protocol as proto
from tfcluster.launch.agent import HostAgent
from tfcluster.launch.records import HostInfo, TaskLaunch, start_request
from tfcluster.launch.attached import AttachedTask, handshake, json_object, tail_text
from tfcluster.launch.bootstrap import bootstrap_argv
from tfcluster.errors import HostError, PreflightError
from tfcluster.transport.base import Proc


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

    def __getattr__(self, name: str):
        return getattr(self._proc, name)


class HeldStart:
    """One deferred start: spawned at once, beaten from the start, started by go().

    With `batch` (prepare_holding) the exec is also the host's bootstrap: it checks the
    shipped files, answers the batch, then holds, so a host with a script costs one exec
    before its first task byte."""

    closes = True            # reach.py: its listeners close on a line of its own, not at exit

    def __init__(self, agent: HostAgent, launch: TaskLaunch, heartbeat_timeout: float,
                 grace: float, batch: dict | None = None, restart: dict | None = None) -> None:
        agent._check_cancelled()   # noqa: SLF001
        self.agent, self.launch, self._timeout = agent, launch, heartbeat_timeout
        self.buf = b""           # unread bytes of stdout (reach's lines, the batch's answer)
        self.request = {**start_request(launch, agent.paths.root), "attached": True, "defer": True,
                        "heartbeat_timeout": heartbeat_timeout, "grace": grace,
                        "deflate": agent.transport.deflate_logs}
        if restart:                   # the shim restarts the task in place (attempts.in_place)
            self.request["restart"] = restart
        if batch is None:
            self._spawn(agent._shim_argv(proto.START), proto.json_line(self.request))   # noqa: SLF001
            self.beat()
            return
        self.request["batch"] = {"commands": batch}
        boot, self._shipped = agent.bootstrap_request(proto.START)
        self._spawn(bootstrap_argv(agent.python), proto.json_line(boot) + proto.json_line(self.request))

    def _spawn(self, argv: list[str], data: bytes) -> None:
        try:
            self._raw = self.agent.transport.spawn(argv)
        except OSError as e:
            raise PreflightError(f"host {self.agent.name}: cannot run {self.agent.python}: {e}") from None
        self.agent.track(self._raw)
        self.proc = _Locked(self._raw)
        self.task = AttachedTask(self.proc, self._timeout / proto.HEARTBEATS_PER_TIMEOUT)
        try:
            self.proc.write(data)
        except BaseException:
            self.drop()
            raise

    def beat(self) -> None:
        self.agent._heartbeats.add(self.task)   # noqa: SLF001 - silence before GO stops the shim too

    def answers(self) -> dict:
        """The bootstrap's verdict and the batch's answers. Stale shim files are shipped
        and the held start runs again by path (a second exec, as for any stale host)."""
        a = self.agent
        boot = a.boot_verdict(self._next_line(ANSWER_TIMEOUT), self._raw)
        if boot["stale"]:
            self._raw.wait(10.0)
            self.drop()
            a.ship_stale(boot["stale"], self._shipped)
            self._spawn(a._shim_argv(proto.START), proto.json_line(self.request))   # noqa: SLF001
        answer = self._next_line(ANSWER_TIMEOUT)
        if answer is None or "answers" not in answer:
            why = proto.error_of(answer) or tail_text(self._raw.read_stderr()) or "no output"
            raise HostError(f"host {a.name}: shim start ended early: {why}")
        return a._checked_answers(answer["answers"])   # noqa: SLF001

    def _next_line(self, timeout: float) -> dict | None:
        """The next JSON line on stdout (noise such as a login banner is skipped); None at EOF,
        or when `timeout` seconds passed (the process is then dropped)."""
        timer = threading.Timer(timeout, self._raw.kill)
        timer.daemon = True
        timer.start()
        try:
            while True:
                while b"\n" not in self.buf:
                    chunk = self._raw.read()
                    if not chunk:
                        if not timer.is_alive():
                            raise HostError(f"host {self.agent.name}: no answer within {timeout:g}s")
                        return None
                    self.buf += chunk
                line, self.buf = self.buf.split(b"\n", 1)
                answer = json_object(line)
                if answer is not None:
                    return answer
        finally:
            timer.cancel()

    def go(self) -> AttachedTask:
        """GO: the shim starts the task and answers its pid."""
        where = f"host {self.agent.name}: {self.launch.tag}"
        try:
            self.agent._check_cancelled()   # noqa: SLF001
            if self.buf.strip():
                raise HostError(f"{where}: shim said {self.buf[:200]!r} before the task started")
            self.task.go()      # a shim already gone: the handshake reads why (its stderr)
            self.task.started(*handshake(self.proc, where))
            self._raw.on_stderr = self.task._heard   # noqa: SLF001 - from now on its stderr is the task's:
            self.task._heard()                       # noqa: SLF001 - restarts in place, its last word
        except BaseException:
            self.drop()
            raise
        finally:
            self.agent.untrack(self._raw)
        return self.task

    def drop(self) -> None:
        """Close the channel: the shim reads EOF and exits, having started nothing (after
        GO: it stops the task, as for any attached task)."""
        if hasattr(self, "task"):
            self.task.detach_kill()
        elif hasattr(self, "_raw"):
            self._raw.kill()
        if hasattr(self, "_raw"):
            self.agent.untrack(self._raw)


def prepare_holding(agent: HostAgent, survey, files: dict | None, launch: TaskLaunch,
                    heartbeat_timeout: float, grace: float,
                    restart: dict | None = None) -> tuple[HostInfo, HeldStart]:
    """HostAgent.prepare() and the host's first held start in one exec (not for a host
    answered in-process)."""
    held = HeldStart(agent, launch, heartbeat_timeout, grace, batch=agent.prepare_commands(survey, files),
                     restart=restart)
    try:
        info = agent.adopt(held.answers(), survey, files)
    except BaseException:
        held.drop()
        raise
    held.beat()
    return info, held
