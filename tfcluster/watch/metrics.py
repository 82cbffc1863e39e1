"""Global step, loss and target step read off task output lines (pure, no I/O).

One parser for every reader: `train`'s progress record and summary, `runs`, `plot`, and
the live footer. Scripts print `step=N loss=X` (the templates do, and end with
`tfcluster-result: global_step=N loss=X`); `train.progress` in the spec overrides the
patterns for scripts that print otherwise. Each pattern has one capturing group: the
number. Lines are bytes (as LogMux and the saved logs have them); a cheap substring test
runs before any regex, so a line without the pattern's literal costs one `in`.

Incremental use (the footer, `train`'s recorder):

    tracker = Tracker(plan.progress, target_of(plan.progress, task.argv))
    tracker.feed("worker:0", b"step=120 loss=0.25", now=time.time())
    tracker.state("worker:0")   # TaskProgress(step=120, loss=0.25, target=300, ...) or None
"""
from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

_NUMBER = rb"([-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|nan|inf))"
# `step=3`, `Step: 3`, `global_step=3`; not `last_step=300` (a target) nor `steps=300`
DEFAULT_STEP = r"(?:global_|\b)[Ss]tep\s*[=:]\s*(\d+)\b"
# `loss=0.25`, `Loss: 1e-3`; not `val_loss=` (another quantity)
DEFAULT_LOSS = r"\b[Ll]oss\s*[=:]\s*" + _NUMBER.decode()
# script arguments that name the final step: `--steps 300`, `--max_steps=300`
TARGET_FLAGS = ("--steps", "--max_steps", "--train_steps", "--num_steps", "--last_step",
                "--total_steps", "--num_train_steps")
RATE_WINDOW = 10.0     # seconds of recent progress behind TaskProgress.recent_rate
RATE_SPAN = 1.0        # seconds of arrival times a recent rate needs at least


@dataclass
class TaskProgress:
    """What one task's lines said so far. Times are what the caller passed as `now`."""

    step: int | None = None
    loss: float | None = None
    target: int | None = None
    first: tuple[float, int] | None = None      # (time, step) of the first step seen
    last: tuple[float, int] | None = None       # (time, step) of the latest
    samples: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))

    @property
    def steps_per_s(self) -> float | None:
        """Steps per second from the first step line to the latest (None: under two)."""
        return _rate(self.first, self.last)

    def recent_rate(self, window: float = RATE_WINDOW, now: float | None = None,
                    span: float = RATE_SPAN) -> float | None:
        """Steps per second over the `window` seconds that end at `now` (the clock of the
        times fed; default: the latest step line's): the steps since the window's first step
        line of the current attempt, over the time from that line to `now`. None when no step
        line came within the window (a stall), or the window's lines span under `span`
        seconds (a batch of lines says nothing of the speed)."""
        if not self.samples:
            return None
        end = self.samples[-1]
        now = end[0] if now is None else max(now, end[0])
        if now - end[0] > window:
            return None
        start = end
        for sample in reversed(self.samples):
            if now - sample[0] > window or sample[1] > start[1]:   # outside, or an earlier attempt's
                break
            start = sample
        if end[0] - start[0] < span or now <= start[0]:
            return None
        return (end[1] - start[1]) / (now - start[0])


def _rate(a: tuple[float, int] | None, b: tuple[float, int] | None) -> float | None:
    if a is None or b is None or b[0] <= a[0] or b[1] < a[1]:
        return None
    return (b[1] - a[1]) / (b[0] - a[0])


class Pattern:
    """One compiled pattern with its prefilter: the longest literal the regex requires."""

    def __init__(self, regex: str) -> None:
        self.regex = re.compile(regex.encode("utf-8"))
        self.literal = required_literal(self.regex)

    def find(self, line: bytes) -> bytes | None:
        if self.literal and self.literal not in line:
            return None
        match = self.regex.search(line)
        return match.group(1) if match else None


class Tracker:
    """Per-task progress from fed lines. `progress`: anything with `step`, `loss` (regex
    strings or None for the defaults) and `target` (int or None), e.g. Plan.progress."""

    def __init__(self, progress=None, target: int | None = None,
                 targets: dict[str, int | None] | None = None) -> None:
        self.step = Pattern(getattr(progress, "step", None) or DEFAULT_STEP)
        self.loss = Pattern(getattr(progress, "loss", None) or DEFAULT_LOSS)
        self.target = target
        self.targets = targets or {}
        self.tasks: dict[str, TaskProgress] = {}

    @property
    def markers(self) -> tuple[bytes, ...]:
        """Substrings one of which every progress line contains (b"": every line may)."""
        return (self.step.literal, self.loss.literal)

    def parse(self, line: bytes) -> tuple[int | None, float | None]:
        """(step, loss) the line says, each None when it does not."""
        step, loss = self.step.find(line), self.loss.find(line)
        try:
            return (None if step is None else int(step)), (None if loss is None else float(loss))
        except ValueError:      # a custom pattern's group that is not a number
            return None, None

    def feed(self, key: str, line: bytes | str, now: float | None = None) -> bool:
        """One line of `key`; True when it said a step or a loss."""
        if isinstance(line, str):
            line = line.encode("utf-8", "replace")
        step, loss = self.parse(line)
        if step is None and loss is None:
            return False
        t = self.tasks.get(key)
        if t is None:
            t = self.tasks[key] = TaskProgress(target=self.targets.get(key, self.target))
        if step is not None:
            t.step = step
            if now is not None:
                t.last = (now, t.step)
                if t.first is None or t.step < t.first[1]:   # a restart from an older step
                    t.first = t.last
                t.samples.append(t.last)
        if loss is not None:
            t.loss = loss
        return True

    def feed_block(self, key: str, block: bytes, now: float | None = None) -> None:
        """Several `\\n`-separated lines of `key`."""
        if any(m in block for m in self.markers):
            for line in block.split(b"\n"):
                self.feed(key, line, now)

    def state(self, key: str) -> TaskProgress | None:
        return self.tasks.get(key)


def points(lines: Iterable[bytes], tracker: Tracker) -> list[tuple[int, float]]:
    """(step, loss) of every line that gives a loss, its step the latest seen (the plot's
    curve); lines before any step are left out."""
    out = []
    step = None
    for line in lines:
        if not any(m in line for m in tracker.markers):
            continue
        said, loss = tracker.parse(line)
        step = said if said is not None else step
        if loss is not None and step is not None:
            out.append((step, loss))
    return out


def target_of(progress, argv: Sequence[str]) -> int | None:
    """The final step: `train.progress.target`, else a step-count flag among `argv`."""
    if getattr(progress, "target", None):
        return int(progress.target)
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in TARGET_FLAGS:
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if value.isdigit():
                return int(value)
    return None


def required_literal(regex: re.Pattern) -> bytes:
    """The longest run of literal bytes in the pattern's top-level sequence (every match
    contains it); b"" when there is none or case is ignored."""
    if regex.flags & re.IGNORECASE:
        return b""
    try:
        import re._parser as parser  # Python 3.11+
    except ImportError:                      # pragma: no cover - 3.10
        import sre_parse as parser  # type: ignore[no-redef]
    best, run = b"", bytearray()
    for op, arg in parser.parse(regex.pattern, regex.flags):
        if op is parser.LITERAL:
            run.append(arg)
            continue
        best, run = max(best, bytes(run), key=len), bytearray()
    return max(best, bytes(run), key=len)
