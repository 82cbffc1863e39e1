"""Lost hosts: told apart from a dropped connection that comes back, said once, at once.

A host is lost when its SSH connection dropped and no new one opens within REOPEN_GRACE
seconds (its sshd is gone: the box died, rebooted, or was taken back), or when its connection
went silent, no packet answering the transport's keepalives (transport/liveness.py). A drop
that can be re-opened is no loss: the run goes on as before (a restart under its policy).

Every pump whose channel ended without an exit status asks `HostLosses.judge` (through
`after_drop`, the run's side, in run/attempts.py); the first one for a host decides, the
others get the same verdict. The supervisor's failure handling waits for verdicts under way
(`settled`), so a peer that failed because the host vanished is not blamed for it. What the
run does next is run/recovery.py's, under train.on_host_loss: with `fail` (the default
without a spare host) it ends, exit 3, naming the host (docs/design/host-loss.md). A host
already down when `up` or `train` begins: deadhosts.py.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tfcluster.errors import Cause, ConnectError

if TYPE_CHECKING:
    from tfcluster.transport.base import Transport

REOPEN_GRACE = 3.0          # seconds a dropped host gets to accept a new connection
HOLD_POLL = 0.2             # between two looks at a connection that must stay open through the grace


@dataclass(frozen=True)
class LostHost:
    host: str
    how: str                # "its SSH connection dropped and could not be re-opened in 3s (…)"
    tasks: tuple[str, ...]  # the tasks it held
    at: float               # time.time() of the verdict
    noticed: float          # time.time() the connection's end was noticed

    @property
    def line(self) -> str:
        return f"{self.host} lost: {self.how} ({', '.join(self.tasks)})"

    def error(self) -> ConnectError:
        return ConnectError(self.line, hint=f"the run cannot go on without {self.host}: bring it back "
                                            f"(or move its tasks to another host in the spec) and "
                                            f"run `train` again", cause=Cause.LOST)

    def record(self) -> dict:
        """The manifest's entry (watch/runs.py)."""
        return {"how": self.how, "tasks": list(self.tasks), "at": self.at, "noticed": self.noticed}


class HostLosses:
    """The verdicts on the hosts of one session, each decided once per drop."""

    def __init__(self, grace: float = REOPEN_GRACE) -> None:
        self.grace = grace
        self.lost: dict[str, LostHost] = {}
        self._alive_at: dict[str, float] = {}     # monotonic time a drop was found to be no loss
        self._cond = threading.Condition()
        self._judging: set[str] = set()

    def judge(self, host: str, transport: Transport, tasks: tuple[str, ...],
              noticed: float) -> tuple[LostHost | None, bool]:
        """(the verdict, whether this call reached it first) on `host`, whose connection was
        found ended at `noticed` (time.monotonic()). None: it is back, not lost."""
        with self._cond:
            while host in self._judging:
                self._cond.wait()
            if host in self.lost:
                return self.lost[host], False
            if self._alive_at.get(host, float("-inf")) >= noticed:
                return None, False
            self._judging.add(host)
            self._cond.notify_all()
        verdict = None
        try:
            verdict = self._decide(host, transport, tasks, noticed)
        finally:
            with self._cond:
                self._judging.discard(host)
                if verdict is None:
                    self._alive_at[host] = time.monotonic()
                else:
                    self.lost[host] = verdict
                self._cond.notify_all()
        return verdict, verdict is not None

    def _decide(self, host: str, transport: Transport, tasks: tuple[str, ...],
                noticed: float) -> LostHost | None:
        """A connection open when asked is no proof of life: a host whose processes die one
        by one has its sshd close its tasks' channels (no exit status) a moment before its
        connections end, and a verdict taken then said "back" and was never asked again. So
        a remote host is back only if a connection stays open (or is re-opened) through the
        whole grace; one that ends in it must be re-opened in what is left of it."""
        how = transport.lost         # said by the transport itself: silent
        deadline = time.monotonic() + self.grace
        while how is None:
            why = transport.reopen(max(0.0, deadline - time.monotonic()) or HOLD_POLL)
            if transport.lost is not None:
                how = transport.lost
            elif why is not None:
                how = f"its SSH connection dropped and could not be re-opened in {self.grace:g}s: {dial_reason(why, host)}"
            elif transport.is_local or time.monotonic() >= deadline:
                return None
            else:
                time.sleep(min(HOLD_POLL, max(0.0, deadline - time.monotonic())))
        now = time.time()
        return LostHost(host, how, tasks, now, now - (time.monotonic() - noticed))

    def awaited(self, host: str, within: float) -> None:
        """Wait (at most `within` s) for a verdict on `host` to begin: a task's own exit can
        reach the supervisor before its host's dropped channels reach their pumps."""
        deadline = time.monotonic() + within
        with self._cond:
            while host not in self._judging and host not in self.lost:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    return

    def settled(self, timeout: float) -> LostHost | None:
        """Wait (at most `timeout` s) for the verdicts under way; the first host lost, if any."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._judging and self._cond.wait(max(0.0, deadline - time.monotonic())):
                pass
            return min(self.lost.values(), key=lambda v: v.at, default=None)


def dial_reason(why: str, host: str) -> str:
    """The dial's error without the host's label it starts with (the line names the host) or
    the advice in parentheses it may end with: `connection refused`."""
    head, sep, rest = why.partition("): ")
    if sep and head.startswith(f"host {host} ("):
        why = rest
    return why.split(" (", 1)[0]

