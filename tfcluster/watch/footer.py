"""The live footer of `train` in a terminal: two lines pinned under the scrolling task
output (docs/design/logs.md, "Live footer").

    step 1,200/2,000 (60%) · epoch 2/3 · 42.1 steps/s · ETA 0:19 · elapsed 0:35 · loss 0.0123 · accuracy 0.91
    running worker:0,worker:1 · restarting 1/3 worker:2 · serving ps:0

Built from what the run already knows: each script's step, loss and target (metrics.py,
through the run's ProgressLog) and each supervised process's state. LogMux draws it; the
text is rebuilt about once a second, never per output line, so the log path stays as
fast as without it.
"""
from __future__ import annotations

import collections
import os
import shutil
import time
from dataclasses import replace

from tfcluster.plan import policy
from tfcluster.watch.metrics import RATE_WINDOW, metric_items

REFRESH = 0.5          # seconds between rebuilds of the footer's text
SHOWN_KEYS = 4         # task keys listed per state before "+N"


def clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def progress_line(states: dict, elapsed: float, now: float | None = None) -> str:
    """The first line: global step and target, Keras' fit (from its second) and epoch, rate,
    ETA, elapsed, latest loss (Keras': its last finished epoch's) and Keras' other metrics. `now` is on the clock of the step lines' times (default
    time.time(), as runs.ProgressLog stamps them); with no step line in the last
    RATE_WINDOW, the stall replaces rate and ETA."""
    now = time.time() if now is None else now
    seen = [s for s in states.values() if s.step is not None]
    if not seen:
        return f"elapsed {clock(elapsed)} · waiting for the first step"
    latest = max(seen, key=lambda s: (s.step, s.last[0] if s.last else 0))
    target = max((s.target for s in states.values() if s.target), default=None)
    parts = [f"step {latest.step:,}" + (f"/{target:,} ({min(100, 100 * latest.step // target)}%)"
                                         if target else "")]
    if latest.fit is not None and latest.fit > 1:     # Keras: a script's later `model.fit`
        parts.append(f"fit {latest.fit}")
    if latest.epoch is not None:
        parts.append(f"epoch {latest.epoch}/{latest.epochs}")
    rates = [r for r in (s.recent_rate(now=now) for s in seen) if r]
    rate = max(rates, default=None)      # every task reports the one global step
    newest = max((s.last[0] for s in seen if s.last), default=None)
    if rate:
        parts.append(f"{rate:,.1f} steps/s")
        if target and latest.step < target:
            parts.append(f"ETA {clock((target - latest.step) / rate)}")
    elif newest is not None and now - newest > RATE_WINDOW and not (target and latest.step >= target):
        parts.append(f"no new step for {clock(now - newest)}")
    parts.append(f"elapsed {clock(elapsed)}")
    if latest.loss is not None:
        parts.append(f"loss {latest.loss:.4g}")
    parts += [f"{name} {value:.4g}" for name, value in metric_items(latest.metrics)]
    return " · ".join(parts)


class RateHistory:
    """Each task's step lines of the last RATE_WINDOW, gathered across rebuilds: a state
    from runs.ProgressLog carries only its latest 16, under a second of a fast stepper."""

    def __init__(self, window: float = RATE_WINDOW) -> None:
        self.window = window
        self.kept: dict[str, collections.deque] = {}

    def update(self, states: dict, now: float) -> dict:
        """`states` with each one's samples replaced by its kept window, `now` on their clock."""
        out = {}
        for key, state in states.items():
            kept = self.kept.setdefault(key, collections.deque())
            if state.samples:
                first = state.samples[0][0]
                while kept and kept[-1][0] >= first:
                    kept.pop()
                kept.extend(state.samples)
            while len(kept) > 1 and now - kept[0][0] > self.window:
                kept.popleft()
            out[key] = replace(state, samples=collections.deque(kept))
        return out


def task_state(proc, restart_max: int, has_output: bool) -> str:
    """starting, running, restarting n/m, serving, done, failed (exit N), stopping."""
    if proc.exit_code is not None and proc.ended is not None:
        if proc.exit_code == 0:
            return "done"
        return "stopped" if policy.ended_by_stop(proc.stopping, proc.exit_code) else f"failed (exit {proc.exit_code})"
    if proc.stopping:
        return "stopping"
    if proc.role == "server":
        return "serving"
    if proc.restarts:
        return f"restarting {proc.restarts}/{restart_max}" if not has_output else \
            f"running (restart {proc.restarts}/{restart_max})"
    return "running" if has_output else "starting"


def tasks_line(procs, restart_max: int, has_output) -> str:
    """The second line: each state with the tasks in it, scripts first."""
    groups: dict[str, list[str]] = {}
    for proc in sorted(procs, key=lambda p: p.role != "script"):
        if proc.role == "server" and proc.task.runs_script:
            continue          # a between-graph worker's own server: its script speaks for it
        state = task_state(proc, restart_max, has_output(proc.key))
        groups.setdefault(state, []).append(proc.task.key)
    parts = []
    for state, keys in groups.items():
        shown = ",".join(keys[:SHOWN_KEYS]) + (f" +{len(keys) - SHOWN_KEYS}" if len(keys) > SHOWN_KEYS else "")
        parts.append(f"{state} {shown}")
    return " · ".join(parts)


def fit(line: str, width: int) -> str:
    """One terminal row: a footer line that wrapped would break the redraw."""
    width = max(10, width - 1)
    return line if len(line) <= width else line[:width - 1] + "…"


def wanted(stdout, quiet: bool) -> bool:
    """A footer only on a real terminal that shows task output."""
    return not quiet and stdout.isatty() and os.environ.get("TERM", "") != "dumb"


class LiveFooter:
    """Rebuilds the footer's text from the run's state at most once per REFRESH."""

    def __init__(self, mux, progress, restart_max: int) -> None:
        self.mux, self.progress, self.restart_max = mux, progress, restart_max
        self.started = time.monotonic()
        self._last = 0.0
        self.history = RateHistory()

    def refresh(self, procs, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < REFRESH:
            return
        self._last = now
        width = shutil.get_terminal_size((100, 24)).columns
        wall = time.time()          # the clock of the step lines' times
        states = self.history.update(self.progress.states(), wall)
        lines = [progress_line(states, now - self.started, wall),
                 tasks_line(procs, self.restart_max, lambda k: self.mux.last_output(k) is not None)]
        self.mux.set_footer([fit(line, width) for line in lines])

    def close(self) -> None:
        self.mux.set_footer([])
