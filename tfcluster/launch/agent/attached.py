"""Attached tasks: a task whose shim stays connected to this process.

The shim copies the task's log to its stdout, reads control lines (heartbeats,
STOP) from its stdin, and stops the task when they end: a launcher that dies or
stops beating takes its tasks with it. One thread per host sends the heartbeats.
With a restart policy the shim restarts its task in place; this side sees where one
attempt's output ends and confirms the next (docs/design/restarts.md, "Restarts in place").
"""
from __future__ import annotations

import collections
import json
import threading
import time
import zlib

from tfcluster.errors import HostError
from tfcluster.host import shim_protocol as proto
from tfcluster.launch.agent.lines import Lines, checked, json_object, tail_text
from tfcluster.transport.base import Proc

HANDSHAKE_TIMEOUT = 60.0
INFLATE_MAX = 1 << 20    # inflated bytes per read(): LogMux's batches stay bounded


class AttachedTask:
    """Output, exit code, STOP and heartbeats of one attached task.

    A task the shim restarts in place is one stream of attempts: `on_restart(rc)` is
    called (from whichever thread notices) once an attempt has ended and every byte it
    wrote has been read and handed on (the reader is back in read()); the next attempt's
    output follows only after resume(), or never, after stop()."""

    def __init__(self, proc: Proc, heartbeat_interval: float, said: dict | None = None,
                 err: bytes = b"") -> None:
        self.pid = 0
        self._inflate = None       # a zlib decompressor when the shim deflates its stdout
        self._before_mark: bytes | None = None   # ... and the last bytes read before its mark
        self._proc = proc          # keep it: a collected paramiko stdin closes the channel
        self._interval = heartbeat_interval
        self._next_beat = time.monotonic() + heartbeat_interval
        self._lock = threading.Lock()
        self._dropped = False
        self._ctl = threading.Lock()    # the fields below
        self._err = b""             # the shim's stderr after the handshake, not yet a whole line
        self._swept = False
        self._out = 0               # stdout bytes read() returned
        self._fed = 0               # ... of which the reader is done with (it asked for more)
        self._restarts: collections.deque = collections.deque()   # restarts whose boundary is ahead
        self._next: dict | None = None  # the restart passed, waiting for resume() or stop()
        self.on_restart = None          # callable(rc), set by the reader before its first read()
        if said is not None:
            self.started(said, err)

    def started(self, said: dict, err: bytes = b"") -> None:
        """The shim's handshake (see handshake()): the task's pid, what followed it on
        stderr, and whether its stdout is deflated (docs/design/logs.md, "Deflated logs")."""
        with self._ctl:
            self.pid, self._err = int(said["pid"]), err
            if said.get("deflate") is True:
                self._inflate, self._before_mark = zlib.decompressobj(-15), b""
        self._proc.on_stderr = self._heard   # from now on its stderr is the task's:
        self._heard()                        # restarts in place, its last word

    def read(self) -> bytes:
        """Next chunk of the task's output; b"" at EOF."""
        with self._ctl:
            self._fed = self._out
            ended = self._pass_boundary()
        self._tell(ended)
        chunk = self._proc.read() if self._inflate is None else self._inflated()
        with self._ctl:
            self._out += len(chunk)
        return chunk

    def _inflated(self) -> bytes:
        """The next inflated bytes of the shim's deflated stdout (what precedes its
        DEFLATE_MARK is dropped); b"" at its end."""
        z = self._inflate
        try:
            while True:
                if z.unconsumed_tail:
                    out = z.decompress(z.unconsumed_tail, INFLATE_MAX)
                else:
                    raw = self._proc.read()
                    if not raw:
                        return z.flush()
                    if self._before_mark is not None:
                        raw = self._past_mark(raw)
                    out = z.decompress(raw, INFLATE_MAX)
                if out:
                    return out
        except zlib.error as e:
            raise HostError(f"its shim's log stream is not deflate data ({e})") from None

    def _past_mark(self, raw: bytes) -> bytes:
        seen = self._before_mark + raw
        at = seen.find(proto.DEFLATE_MARK)
        if at < 0:
            self._before_mark = seen[-len(proto.DEFLATE_MARK):]
            return b""
        self._before_mark = None
        return seen[at + len(proto.DEFLATE_MARK):]

    def wait(self, timeout: float | None = None) -> int | None:
        """The task's exit code (128+N when killed by signal N), None if still running."""
        rc = self._proc.wait(timeout)
        if rc is not None:       # an attempt's end said on stderr as the shim exited
            self._heard()
        return rc

    def swept(self) -> bool:
        """The shim has exited and said its own sweep left nothing of the task's tag
        (its last stderr line); False while it runs, or when it could not say so."""
        if self._proc.wait(0) is None:
            return False
        with self._ctl:
            self._take(final=True)
            return self._swept

    def restarted(self) -> bool:
        """The shim restarted the task in place; that attempt waits for resume() or stop()."""
        return self._next is not None

    def resume(self) -> bool:
        """Confirm the restart in place: its output follows. False when there is none.
        True even when the shim is gone by now: the pump then reports that attempt lost."""
        with self._ctl:
            said, self._next = self._next, None
        if said is None:
            return False
        self.pid = int(said["pid"])
        self._send(proto.CONTINUE_LINE)
        return True

    def _heard(self) -> None:
        with self._ctl:
            self._take()
            ended = self._pass_boundary()
        self._tell(ended)

    def _tell(self, ended: int | None) -> None:
        if ended is not None:
            self.on_restart(ended)

    def _take(self, final: bool = False) -> None:
        """Parse the shim's stderr lines (under _ctl): restarts in place, its last word."""
        self._err += self._proc.read_stderr()
        *lines, self._err = self._err.split(b"\n")
        if final and self._err:
            lines, self._err = lines + [self._err], b""
        for line in lines:
            said = json_object(line)
            if said is None:
                continue
            if said.get(proto.SWEPT) is True:
                self._swept = True
            if proto.RESTARTED in said and all(type(said.get(k)) is int for k in ("exit", "pid", "at")):
                self._restarts.append(said)

    def _pass_boundary(self) -> int | None:
        """(under _ctl) The exit code of an attempt that ended with all of its output
        handed on, once; None while there is none. The next needs resume() first."""
        if (self._restarts and self._next is None and self.on_restart is not None
                and self._fed >= int(self._restarts[0]["at"])):
            self._next = self._restarts.popleft()
            return int(self._next["exit"])
        return None

    def stop(self, keep_fence: bool = False) -> None:
        """Ask the shim to stop the task: TERM, grace, KILL, tag sweep. `keep_fence`: the
        cluster's next tasks start on this host (a move), so its fence table stays even when
        this was its last task."""
        self._send(proto.STOP_KEEP_LINE if keep_fence else proto.STOP_LINE)

    def request_save(self) -> bool:
        """The checkpoint request to the task (SIGUSR1, through its shim); False once the
        shim is gone."""
        return self._send(proto.SAVE_LINE)

    def go(self, tf_config: str | None = None) -> bool:
        """Let a task started with `hold` (a warm server) go on: it binds its port now, serving
        the cluster of `tf_config` where given (one held before its cluster was known)."""
        if tf_config is None:
            return self._send(proto.GO_LINE)
        return self._send(proto.GO_WITH + json.dumps(json.loads(tf_config)).encode() + b"\n")

    def detach_kill(self) -> None:
        """Drop the channel; the shim's stdin-EOF watchdog kills the task."""
        with self._lock:
            self._dropped = True
            self._proc.kill()

    def _send(self, data: bytes) -> bool:
        with self._lock:
            if self._dropped:
                return False
            try:
                self._proc.write(data)
                return True
            except OSError:
                self._dropped = True   # the shim is gone: nothing left to keep alive
                return False

    def beat(self, now: float) -> bool:
        """Send a heartbeat if one is due; False once the shim is gone."""
        if now < self._next_beat:
            return not self._dropped
        self._next_beat = now + self._interval
        return self._send(proto.HEARTBEAT_LINE)


def handshake(proc: Proc, where: str) -> tuple[dict, bytes]:
    """The shim's first JSON line on stderr: {"pid": N, "deflate": bool}, or the error
    envelope. Returns that line and what followed it (a restart in place may already be
    said): AttachedTask.started() takes both. Lines before
    it are the host's login shell (a .bashrc's warnings; pyenv's rehash races when shells
    start together): skipped, and quoted only if the shim then exits without a word."""
    lines = Lines(proc, where, read=_stderr_until_exit(proc, where))
    control = lines.next()
    if control is None:
        raise HostError(f"{where}: shim exited: {tail_text(lines.noise + lines.buf) or 'no output'}")
    return checked(control, where), lines.buf


def _stderr_until_exit(proc: Proc, where: str):
    """A read() of the shim's stderr that waits for bytes: b"" once the shim exited."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT

    def read() -> bytes:
        while True:
            chunk = proc.read_stderr()
            if chunk:
                return chunk
            if proc.wait(0.02) is not None:
                return proc.read_stderr()
            if time.monotonic() > deadline:
                raise HostError(f"{where}: shim did not start the task within {HANDSHAKE_TIMEOUT:g}s")
    return read


class Heartbeats:
    """One thread per host beating for every attached task until closed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: list[AttachedTask] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    def add(self, task: AttachedTask) -> None:
        with self._lock:
            self._tasks.append(task)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"tfcluster-hb-{self.name}",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._closing.wait(0.25):
            now = time.monotonic()
            with self._lock:
                tasks = list(self._tasks)
            gone = [task for task in tasks if not task.beat(now)]
            if gone:
                with self._lock:
                    self._tasks = [t for t in self._tasks if t not in gone]

    def close(self) -> None:
        """Stop beating and drop every channel (their shims then stop the tasks)."""
        self._closing.set()
        with self._lock:
            tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.detach_kill()
