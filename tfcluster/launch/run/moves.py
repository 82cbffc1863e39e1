"""The record of a run's moves: when a host was given up (lost or drained), why, what the
run did (policy.on_host_loss), to where, the step the run had reached and the one it resumed
from. The supervisor fills the resumed step from the progress lines that follow (tick), says
it once, and the records go to the summary and the manifest (`moves`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tfcluster.launch.cluster.session import Background
from tfcluster.launch.run import ckptlag
from tfcluster.plan import policy

if TYPE_CHECKING:
    from tfcluster.launch.run.ckptsync import CheckpointSync
    from tfcluster.launch.run.runstate import Run


@dataclass
class Move:
    host: str                       # the host given up
    why: str                        # "lost: silent for 20s, …" | "drained"
    action: str                     # policy.MOVE | SHRINK | RESTART
    reason: str                     # why this action (policy.on_host_loss)
    tasks: tuple[str, ...]
    at: float                       # time.time() of the decision
    step_at: int | None             # the run's step then (the furthest any script said)
    spare: str | None = None
    done_at: float | None = None    # the new tasks started (time.time())
    watch: str | None = None        # the task whose first step after done_at is the resumed one
    resumed: int | None = None
    checkpoint: str | None = None   # the checkpoint pushed to the new host, if any

    @property
    def steps_lost(self) -> int | None:
        if self.step_at is None or self.resumed is None:
            return None
        return max(0, self.step_at - self.resumed)

    def line(self) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(self.at))
        what = ", ".join(self.tasks)
        if self.action == policy.SHRINK:
            head = f"{when} {self.host} {self.why}: went on without {what}"
        elif self.done_at is None:      # stopped (Ctrl-C, a failure) before the tasks started there
            return f"{when} {self.host} {self.why}: moving {what} to {self.spare}; the run ended before they started there"
        else:
            head = f"{when} {self.host} {self.why}: {what} moved to {self.spare}"
            if self.action == policy.RESTART:
                head += ", every task restarted"
        if self.checkpoint:
            head += f" from {self.checkpoint}"
        if self.resumed is not None:
            head += f"; resumed at step {self.resumed}, {self.steps_lost} step(s) lost"
        elif self.action != policy.SHRINK:
            head += "; no step seen since"
        return head

    def record(self) -> dict:
        return {"host": self.host, "why": self.why, "action": self.action, "reason": self.reason,
                "tasks": list(self.tasks), "to": self.spare, "at": self.at, "step_at": self.step_at,
                "done_at": self.done_at, "resumed_step": self.resumed, "steps_lost": self.steps_lost,
                "checkpoint": self.checkpoint}


@dataclass
class Recovery:
    """The moves of one run (the hosts it gave up are the session's HostPool's)."""

    moves: list[Move] = field(default_factory=list)
    checkpoints: CheckpointSync | None = None        # train.checkpoint's copies, if configured
    looked: float = 0.0                              # monotonic time drains.poll last looked
    lag: ckptlag.LagWatch = field(default_factory=ckptlag.LagWatch)   # the checkpoint lag, said once
    after_resume: list = field(default_factory=list)   # work a move left for once every move resumed: off its path

    def unproven(self) -> Move | None:
        """The first move after which the task it watches never stepped: a failed recovery,
        however the run ended (a chief that finishes while a moved worker waits for a ps that
        dials its old address would otherwise read as a success)."""
        return next((m for m in self.moves if m.done_at is not None and m.watch is not None
                     and m.resumed is None), None)

    def tick(self, run: Run) -> None:
        """Fill each move's resumed step from the first step its task said after it, and say it;
        say once when the newest checkpoint kept here lags far behind the step (ckptlag.py)."""
        if run.progress is None:
            return
        ckptlag.look(run)
        for move in self.moves:
            if move.resumed is not None or move.done_at is None or move.watch is None:
                continue
            got = run.progress.tracker.state(move.watch)
            after = [s for s in list(got.samples) if s[0] >= move.done_at] if got is not None else []
            if after:
                move.resumed = after[0][1]
                run.ui.info(f"{move.watch} on {run.plan.task(move.watch).host} resumed at step {move.resumed} "
                            f"({move.steps_lost} step(s) lost)")
        if self.after_resume and self.unproven() is None:
            work, self.after_resume = self.after_resume, []
            for fn in work:
                Background(fn)
