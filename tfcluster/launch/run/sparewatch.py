"""The idle spares, watched while a run goes: one whose connection ended and will not open
again (its box died, or went silent: transport/liveness.py closes a silent connection) is
said the moment that is known and set aside, not found out at the next loss, when it is
needed. A spare holds no task, so no task's channel would say it (run/recovery.py takes the
spares that remain)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tfcluster.launch.cluster.session import Background

if TYPE_CHECKING:
    from tfcluster.launch.run.runstate import Run

LOOK_EVERY = 2.0        # seconds between looks at the spares' connections (in memory: free)


class SpareWatch:
    def __init__(self) -> None:
        self._next = 0.0
        self._asking: dict[str, Background] = {}     # spare -> its reopen, under way

    def tick(self, run: Run) -> None:
        pool = run.session.pool
        for spare, asked in list(self._asking.items()):
            if not asked.done():
                continue
            del self._asking[spare]
            try:
                why = asked.result()
            except Exception as exc:  # noqa: BLE001 - a reopen that raised is one that failed
                why = str(exc)
            if why is not None and pool.usable(spare) and not run.plan.tasks_on(spare):
                pool.set_aside(spare, f"lost while idle: {why}")
                run.ui.warn(f"spare {spare} lost: {why}; the run goes on without it (a host lost now "
                            f"needs another spare)")
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + LOOK_EVERY
        for spare in run.plan.spares:
            if spare in self._asking or run.plan.tasks_on(spare) or not pool.usable(spare):
                continue
            agent = run.session.agents.get(spare)
            if agent is not None and not agent.transport.connected():
                self._asking[spare] = Background(run.session.unreachable, spare)
