"""The shim's JSON lines, read in one place: every conversation with a shim (HostAgent's
streams, `up`'s exec, a held start, reachability, an attached task's handshake) reads them
through `Lines`, and the shim's error envelope (shim_protocol.error_answer) is checked only
here, by `checked`. Words that are no JSON object (a host's login shell may talk) are skipped.
"""
from __future__ import annotations

import json
import threading
from typing import Callable, Protocol

from tfcluster.errors import HostError
from tfcluster.host import shim_protocol as proto
from tfcluster.transport.base import Proc

NOISE_KEPT = 4096    # bytes of skipped words kept for an error message (tail_text shows 300)
JSON_LINE_CAP = 1 << 20   # bytes of one line held: no answer of a shim is this long, words may be


def json_object(line: bytes) -> dict | None:
    """`line` as a JSON object; None for anything else (a host's login shell may talk)."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def last_json(out: bytes):
    """The last non-blank line of a one-shot command's output as JSON; None when it is none."""
    lines = [line for line in out.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1]) if lines else None
    except ValueError:
        return None


def tail_text(data: bytes, limit: int = 300) -> str:
    text = data.decode(errors="replace").strip()
    return text[-limit:].replace("\n", " | ")


def checked(answer, where: str, error: type[Exception] = HostError):
    """`answer` itself, unless it is the shim's error envelope: then `error` naming `where`."""
    problem = proto.error_of(answer)
    if problem is not None:
        raise error(f"{where}: {problem}")
    return answer


def checked_answers(answers: dict, where: str, unchecked=()) -> dict:
    """A batch's answers (command -> answer), each checked; an error answer of a command in
    `unchecked` is left to the caller."""
    for command, answer in answers.items():
        if command not in unchecked:
            checked(answer, f"{where}: {command}")
    return answers


def close_input(proc: Proc) -> None:
    """End the process's stdin: the shim reads EOF (an error here: it is gone already)."""
    try:
        proc.close_stdin()
    except OSError:
        pass


class Deadline:
    """Drops processes when a phase overruns its `seconds` (a read then returns EOF, and a
    reader says the deadline passed); on leaving it drops its own processes, whatever
    happened, but not the borrowed ones (a conversation is its owner's to close)."""

    def __init__(self, seconds: float, procs=()) -> None:
        self.procs = list(procs)
        self.borrowed: list[Proc] = []     # killed when the deadline passes, not on leaving
        self.expired = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.seconds = seconds
        self.restart(seconds)

    def add(self, proc: Proc, borrowed: bool = False) -> None:
        with self._lock:
            (self.borrowed if borrowed else self.procs).append(proc)
            late = self.expired
        if late:            # spawned after the deadline passed: never wait on it
            proc.kill()

    def restart(self, seconds: float) -> None:
        self.cancel()
        self.seconds = seconds
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
        self._kill_all(borrowed=True)

    def _kill_all(self, borrowed: bool = False) -> None:
        with self._lock:
            procs = self.procs + (self.borrowed if borrowed else [])
        for proc in procs:
            proc.kill()

    def __enter__(self) -> "Deadline":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()
        self._kill_all()


class Lines:
    """The JSON lines a shim writes on one of a process's streams (`read`: its stdout by
    default). `where` ("host h9: reach") names the speaker in errors; each read may name
    another (a conversation lends its lines to reachability). `timeout`: seconds each
    next() may wait before the process is dropped; a `deadline` (Deadline) may bound it."""

    def __init__(self, proc: Proc, where: str, *, read: Callable[[], bytes] | None = None,
                 timeout: float | None = None) -> None:
        self.proc, self.where, self.timeout = proc, where, timeout
        self._read = read or proc.read
        self.buf = b""           # bytes read and not yet a whole line
        self.overlong = False    # the line in buf lost its start (JSON_LINE_CAP): words, not an answer
        self.noise = b""         # the last words skipped (quoted when the shim ends without a word)
        self.line = b""          # the last JSON line, as read

    def next(self, where: str | None = None, deadline: Deadline | None = None) -> dict | None:
        """The next JSON object; None at EOF. A HostError when a deadline dropped the process."""
        own = None
        if deadline is None and self.timeout is not None:
            deadline = own = Deadline(self.timeout)
            own.add(self.proc, borrowed=True)
        try:
            while True:
                while b"\n" not in self.buf:
                    chunk = self._read()
                    if not chunk:
                        if deadline is not None and deadline.expired:
                            raise HostError(f"{where or self.where} did not answer within {deadline.seconds:g}s")
                        return None
                    self.buf += chunk
                    if len(self.buf) > JSON_LINE_CAP and b"\n" not in chunk:
                        # endless words (a login shell's): hold their end only, never parse them
                        self.buf, self.overlong = self.buf[-NOISE_KEPT:], True
                self.line, self.buf = self.buf.split(b"\n", 1)
                answer = None if self.overlong else json_object(self.line)
                self.overlong = False
                if answer is not None:
                    return answer
                self.noise = (self.noise + self.line + b"\n")[-NOISE_KEPT:]
        finally:
            if own is not None:
                own.cancel()

    def answer(self, key: str | None = None, where: str | None = None,
               deadline: Deadline | None = None) -> dict:
        """The next JSON object, which must hold `key`; the error envelope, an early end
        (with the shim's stderr) or another answer is a HostError."""
        return self.check(self.next(where, deadline), key, where)

    def check(self, answer: dict | None, key: str | None = None, where: str | None = None) -> dict:
        """What answer() makes of an answer next() returned."""
        where = where or self.where
        if answer is None:
            raise HostError(f"{where} ended early: {tail_text(self.proc.read_stderr()) or 'no output'}")
        checked(answer, where)
        if key is not None and key not in answer:
            raise HostError(f"{where}: unexpected answer {self.line[:200]!r}")
        return answer


class Conversation(Protocol):
    """A shim command that goes on after HostAgent opened it (upexec.UpExec, held.HeldStart)."""

    def attach(self, proc: Proc) -> Lines:
        """Take a process started for it (after a bootstrap that found stale files: the shim
        by path, its predecessor dropped first); returns the reader of its lines."""

    def interrupt(self) -> None:
        """Ctrl-C: drop its process while it is being started."""
