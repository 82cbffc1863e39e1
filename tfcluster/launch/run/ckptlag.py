"""How far the newest checkpoint kept here lags behind the run's step, said while the run goes
on (once) and at a move (what the restore will cost) (docs/hostloss.md, "When the newest
checkpoint lags").

A move restores the newest copy the checkpoint sync kept here (ckptsync.py): every step
since it is done again, and a script that saves rarely loses much without a word (TF1's
MonitoredTrainingSession saves every 600 s unless told otherwise). The lag is the chief's
step now less the step of that copy. It is judged only once a sync has looked at the chief's
checkpoint directory (before that nothing is known), and said when it exceeds

    max(LAG_STEPS, LAG_SECONDS × the chief's steps per second)

that is: never for a short run's first thousand steps, and otherwise when more than five
minutes of training would be redone; five minutes so that a script on MonitoredTrainingSession's
10-minute default is told before its first save. The decision is pure (`lagging`, `warning`,
`restore_cost`); `look` is the one hook, called from the supervisor's tick.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tfcluster.ui.units import duration
from tfcluster.watch.runs import step_of

if TYPE_CHECKING:
    from tfcluster.launch.run.runstate import Run

LAG_STEPS = 1000          # steps a lag is allowed whatever the rate
LAG_SECONDS = 300.0       # seconds of training (at the chief's rate) a lag is allowed


@dataclass(frozen=True)
class Lag:
    newest: str | None        # the newest copy kept here (its name), None: none yet
    newest_step: int          # its step (0: none yet, the run restarts from the start)
    step: int                 # the chief's step now
    rate: float | None        # the chief's steps per second, None: not known

    @property
    def steps(self) -> int:
        return self.step - self.newest_step


def allowed(rate: float | None) -> int:
    """The lag, in steps, that is not worth a word at `rate` steps per second."""
    return max(LAG_STEPS, int(LAG_SECONDS * rate) if rate else 0)


def lagging(lag: Lag) -> bool:
    return lag.steps > allowed(lag.rate)


def warning(lag: Lag, sync: float | None) -> str:
    """The one warning line: the numbers, what they cost, and the fix."""
    newest = (f"newest checkpoint kept here: {lag.newest} (step {lag.newest_step:,})" if lag.newest
              else "no checkpoint kept here yet (a restore starts over at step 0)")
    cost = f"{lag.steps:,} steps"
    if lag.rate:
        cost += f", about {duration(lag.steps / lag.rate)} of training,"
    synced = f"; train.checkpoint.sync copies it every {duration(sync)}" if sync else ""
    return (f"checkpoints lag: {newest}, current step {lag.step:,}: {cost} would be done again if the chief's "
            f"host were lost. Save more often (MonitoredTrainingSession saves every 600 s unless "
            f"save_checkpoint_secs or save_checkpoint_steps says otherwise; Keras: BackupAndRestore(save_freq=N), "
            f"ModelCheckpoint(save_freq=N); tf.train.CheckpointManager: call save() more often){synced}")


def restore_cost(checkpoint: str | None, step_at: int | None) -> str | None:
    """What a move's restore will cost, said as it moves: None when the step is unknown."""
    if step_at is None:
        return None
    at = 0 if checkpoint is None else step_of(checkpoint)
    if at is None:
        return f"restoring {checkpoint} (its step unknown); the run was at step {step_at:,}"
    source = f"from {checkpoint} (step {at:,})" if checkpoint else "from step 0 (no checkpoint kept here)"
    if at >= step_at:       # saved as its tasks stopped, after the last step a script printed
        return f"restoring {source}: the newest step, none will be done again"
    return f"restoring {source}: the run was at step {step_at:,}, {step_at - at:,} step(s) will be done again"


class LagWatch:
    """Says the lag once per run, the first time a look finds it too far behind."""

    def __init__(self) -> None:
        self.said = False

    def look(self, run: Run) -> str | None:
        """The warning to say now (said once), or None."""
        if self.said:
            return None
        sync = run.recovery.checkpoints
        chief = run.plan.chief
        if sync is None or chief is None or run.progress is None or getattr(sync, "looked", None) is None:
            return None
        got = run.progress.tracker.state(chief.key)
        if got is None or got.step is None:
            return None
        newest = sync.looked[1]
        step = newest.step if newest is not None else 0
        if newest is not None and step is None:       # a name without -N: nothing to compare
            return None
        lag = Lag(newest.name if newest is not None else None, step, got.step,
                  got.recent_rate() or got.steps_per_s)
        if not lagging(lag):
            return None
        self.said = True
        return warning(lag, sync.config.sync if sync.config is not None else None)


def look(run: Run) -> None:
    """The supervisor's tick: the lag said once, as a warning, when it is too far behind."""
    said = run.recovery.lag.look(run)
    if said is not None:
        run.ui.warn(said)
