"""Global step, epoch, loss, the other metrics and the target step read off task output
lines (pure, no I/O).

One parser for every reader: `train`'s progress record and summary, `runs`, `plot`, and
the live footer. Scripts print `step=N loss=X` (the templates do, and end with
`tfcluster-result: global_step=N loss=X`); `train.progress` in the spec overrides the
patterns for scripts that print otherwise. Each pattern has one capturing group: the
number. Keras' `model.fit` progress (Keras 3 and tf_keras: `Epoch 2/3`, the bar's
`140/210 ━━━ … - loss: 0.31 - accuracy: 0.91`, the `verbose=2` line per epoch; kerasbar reads
those) is taken too, without any pattern: its global step is (epoch - 1) × steps per epoch + the bar's
batch, its target epochs × steps per epoch (docs/running.md, "Keras' progress"). Lines
are bytes (as LogMux and the saved logs have them); a cheap substring test
runs before any regex, so a line without a marker costs one `in` per marker.

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

from tfcluster.watch.kerasbar import (
    KERAS_BAR_MARKS,
    KERAS_EPOCH,
    KERAS_EPOCH_MARK,
    KERAS_WHOLE,
    NUMBER,
    KerasFit,
    keras_bar,
    keras_line,
    keras_metrics,
)
from tfcluster.watch.logscan import KERAS_CALL_MARK, PROBE_MARKS

# `step=3`, `Step: 3`, `global_step=3`; not `last_step=300` (a target) nor `steps=300`
DEFAULT_STEP = r"(?:global_|\b)[Ss]tep\s*[=:]\s*(\d+)\b"
# `loss=0.25`, `Loss: 1e-3`; not `val_loss=` nor keras-io's `Test loss: 2.30` after `evaluate`
# (other quantities)
DEFAULT_LOSS = (r"(?<![Tt]est )(?<![Vv]al )(?<![Ee]val )(?<![Vv]alidation )\b[Ll]oss\s*[=:]\s*"
                + NUMBER.decode())
# script arguments that name the final step: `--steps 300`, `--max_steps=300`
TARGET_FLAGS = ("--steps", "--max_steps", "--train_steps", "--num_steps", "--last_step",
                "--total_steps", "--num_train_steps")
RATE_WINDOW = 10.0     # seconds of recent progress behind TaskProgress.recent_rate
RATE_SPAN = 1.0        # seconds of arrival times a recent rate needs at least
# seconds of arrival times a run's rate (the summary's steps/s) needs at least: 20 times the
# 10 ms a script's stdout is flushed at (host/probe/sitecustomize.py), so when its lines arrive
# moves the rate by 5 % at most
RUN_RATE_SPAN = 0.2

_PROBE = b"tfcluster-"      # in each of PROBE_MARKS: one `in` for every other line
# the note LogMux writes between two attempts of a task (diagnose.signatures.restart_note),
# as its saved log and the watchers have it: `[tfcluster] exited with code 1; restarting (1/3)`
RESTART_NOTE = (b"[tfcluster] exited with code ", b"; restarting (")


@dataclass
class TaskProgress:
    """What one task's lines said so far. Times are what the caller passed as `now`."""

    step: int | None = None
    loss: float | None = None
    target: int | None = None
    first: tuple[float, int] | None = None      # (time, step) of the first step seen
    last: tuple[float, int] | None = None       # (time, step) of the latest
    samples: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))
    epoch: int | None = None                    # Keras' `Epoch k/N`: k
    epochs: int | None = None                   # and N
    metrics: dict[str, float] = field(default_factory=dict)   # Keras' other metrics, latest
    fit: int | None = None                      # which of the attempt's `model.fit` calls (1, 2, ...)

    @property
    def steps_per_s(self) -> float | None:
        """Steps per second from the first step line to the latest. None under two, or when
        they came within RUN_RATE_SPAN seconds of each other: a run whose every line came in
        one read (a fast GPU's few short epochs) says nothing of its speed, not 75,600 steps/s."""
        rate = _rate(self.first, self.last)
        return rate if rate is not None and self.last[0] - self.first[0] >= RUN_RATE_SPAN else None

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


@dataclass(slots=True)
class Reading:
    """What one line (or one `\\r` update of it) said; None fields: it did not say."""

    step: int | None = None
    loss: float | None = None
    epoch: tuple[int, int] | None = None        # (k, N) of `Epoch k/N`, or of the bar's epoch
    target: int | None = None                   # epochs × steps per epoch, from Keras
    metrics: dict[str, float] | None = None     # Keras' metrics other than the loss
    fit: int | None = None                      # Keras: which fit of the attempt
    epoch_end: bool = False                     # Keras: the epoch's last update (its loss is the epoch's)


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


def _number(text: bytes | None, kind):
    """A pattern's group as a number; None when it is none. A custom pattern's group often
    takes the sentence's punctuation along (`([0-9.]+)` on `train_loss: 2.30.`): that goes."""
    if text is None:
        return None
    try:
        return kind(text)
    except ValueError:
        try:
            return kind(text.rstrip(b".,;:"))
        except ValueError:
            return None


class Tracker:
    """Per-task progress from fed lines. `progress`: anything with `step`, `loss` (regex
    strings or None for the defaults) and `target` (int or None), e.g. Plan.progress.
    A `step` regex of the spec's wins over Keras' bars (their epochs and metrics are still
    read); a `target` of the spec's wins over Keras' and the arguments'."""

    def __init__(self, progress=None, target: int | None = None,
                 targets: dict[str, int | None] | None = None) -> None:
        self.custom_step = bool(getattr(progress, "step", None))
        self.custom_loss = bool(getattr(progress, "loss", None))
        self.fixed_target = bool(getattr(progress, "target", None))
        self.step = Pattern(getattr(progress, "step", None) or DEFAULT_STEP)
        self.loss = Pattern(getattr(progress, "loss", None) or DEFAULT_LOSS)
        self.target = target
        self.targets = targets or {}
        self.tasks: dict[str, TaskProgress] = {}
        self.fits: dict[str, KerasFit] = {}
        self.aside: set[str] = set()     # tasks inside a Keras `evaluate` or `predict`

    @property
    def markers(self) -> tuple[bytes, ...]:
        """Substrings one of which every progress line contains (b"": every line may); a
        marker that holds another is left out (the other finds its lines). Every Keras bar
        of `fit` says `loss: `, which the default loss pattern's literal finds: only a
        custom loss pattern needs the bars' own markers."""
        found = (self.step.literal, self.loss.literal, KERAS_EPOCH_MARK, RESTART_NOTE[1], KERAS_CALL_MARK)
        found += KERAS_BAR_MARKS if self.custom_loss else ()
        return tuple(m for i, m in enumerate(found)
                     if m not in found[:i] and not any(o and o != m and o in m for o in found))

    def parse(self, line: bytes) -> tuple[int | None, float | None]:
        """(step, loss) the patterns find in the line, each None when they do not (no
        Keras: its step depends on the lines before; `read` has it)."""
        if _PROBE in line and any(m in line for m in PROBE_MARKS):
            return None, None
        return self._patterns(line)

    def _patterns(self, line: bytes) -> tuple[int | None, float | None]:
        return _number(self.step.find(line), int), _number(self.loss.find(line), float)

    def read(self, key: str, line: bytes) -> list[Reading]:
        """What `key`'s line says, one Reading per `\\r` update that says something (the
        state of `key`'s Keras fit moves on)."""
        if _PROBE in line and any(m in line for m in PROBE_MARKS):   # tfcluster's own (`global_step:0`)
            if line.startswith(KERAS_CALL_MARK):
                self._keras_call(key, line[len(KERAS_CALL_MARK):].strip())
            return []
        if line.startswith(RESTART_NOTE[0]) and RESTART_NOTE[1] in line:
            self.restarted(key)
            return []
        out = []
        for seg in line.split(b"\r") if b"\r" in line else (line,):
            got = self._read_one(key, seg)
            if got is not None:
                out.append(got)
        return out

    def _read_one(self, key: str, seg: bytes) -> Reading | None:
        clean = keras_line(seg)
        got = self._keras(key, clean) if clean is not None else None
        if got is None:
            step, loss = self._patterns(seg)
            return None if step is None and loss is None else Reading(step, loss)
        if self.custom_step or self.custom_loss:
            step, loss = self._patterns(seg)
            got.step = step if self.custom_step else got.step
            got.loss = loss if self.custom_loss else got.loss
        return got

    def _keras(self, key: str, line: bytes) -> Reading | None:
        """A Reading of a Keras line (a bar that is no step of a fit: an empty one); None:
        not Keras', or a bar with no loss and no fit before it (the patterns read it, as
        any line). Only an epoch's last update gives the loss and the metrics."""
        m = KERAS_EPOCH.match(line) if KERAS_EPOCH_MARK in line else None
        fit = self.fits.get(key)
        if m is not None:
            if fit is None:
                fit = self.fits[key] = KerasFit()
            fit.start(int(m.group(1)), int(m.group(2)))
            return Reading(epoch=(fit.epoch, fit.epochs), target=fit.target, fit=fit.fits)
        bar = keras_bar(line)
        if bar is None:
            return None
        if key in self.aside:            # an `evaluate` or `predict` the probe said began
            return Reading()
        metrics = keras_metrics(line)
        loss = metrics.pop("loss", None)
        if fit is None:
            if loss is None:
                return None
            fit = self.fits[key] = KerasFit()
        batch, total = bar
        step = fit.bar(batch, total, loss is not None, any(name.startswith("val_") for name in metrics),
                       KERAS_WHOLE.match(line) is not None)
        if step is None:
            return Reading()
        end = total is not None and batch == total and b"ETA: " not in line
        return Reading(step=step, loss=loss if end else None, epoch=(fit.epoch, fit.epochs), target=fit.target,
                       metrics=metrics if end else None, fit=fit.fits, epoch_end=end)

    def _keras_call(self, key: str, what: bytes) -> None:
        """The probe's word that `key`'s script began an `evaluate` or `predict` (its bars
        are no steps), or ended it (the next pass is judged afresh)."""
        if what.endswith(b" done"):
            self.aside.discard(key)
            fit = self.fits.get(key)
            if fit is not None:
                fit.end_pass()
        else:
            self.aside.add(key)

    def restarted(self, key: str) -> None:
        """`key`'s next attempt begins: its fits count from nothing again (its step goes
        back to where the new attempt says it is)."""
        self.fits.pop(key, None)
        self.aside.discard(key)

    def feed(self, key: str, line: bytes | str, now: float | None = None) -> Reading | None:
        """One line of `key`; what it said (the last update's step and loss), or None when
        it said no step, loss or epoch."""
        if isinstance(line, str):
            line = line.encode("utf-8", "replace")
        if b"/" not in line and _PROBE not in line and b"\r" not in line:
            # the common line: the patterns only (every line of Keras has its `k/N`)
            step, loss = self._patterns(line)
            if step is None and loss is None:
                return None
            said = Reading(step, loss)
            self._apply(key, said, now)
            return said
        said = None
        for r in self.read(key, line):
            if r.step is None and r.loss is None and r.epoch is None:
                continue
            said = r
            self._apply(key, r, now)
        return said

    def _apply(self, key: str, r: Reading, now: float | None) -> None:
        t = self.tasks.get(key)
        if t is None:
            t = self.tasks[key] = TaskProgress(target=self.targets.get(key, self.target))
        if r.step is not None:
            t.step = r.step
            if now is not None:
                t.last = (now, t.step)
                if t.first is None or t.step < t.first[1]:   # a restart from an older step
                    t.first = t.last
                t.samples.append(t.last)
        if r.loss is not None:
            t.loss = r.loss
        if r.epoch is None:
            return
        t.epoch, t.epochs = r.epoch
        if r.target is not None and not self.fixed_target:
            t.target = r.target
        if r.fit is not None:
            t.fit = r.fit
        if r.metrics:
            t.metrics.update(r.metrics)

    def feed_block(self, key: str, block: bytes, now: float | None = None) -> None:
        """Several `\\n`-separated lines of `key`."""
        if any(m in block for m in self.markers):
            for line in block.split(b"\n"):
                self.feed(key, line, now)

    def state(self, key: str) -> TaskProgress | None:
        return self.tasks.get(key)


def points(lines: Iterable[bytes], tracker: Tracker, key: str = "") -> list[tuple[int, float]]:
    """(step, loss) of every line (and `\\r` update) that gives a loss, its step the latest
    seen (the plot's curve: a Keras fit's at each epoch's end); lines before any step are
    left out, and a Keras epoch's end said again at the same step (Keras 3 ends an epoch
    with two updates) replaces the one before."""
    out: list[tuple[int, float]] = []
    step = None
    markers = tracker.markers
    for line in lines:
        if not any(m in line for m in markers):
            continue
        for r in tracker.read(key, line):
            step = r.step if r.step is not None else step
            if r.loss is not None and step is not None:
                if r.epoch_end and out and out[-1][0] == step:
                    out[-1] = (step, r.loss)
                else:
                    out.append((step, r.loss))
    return out


# said once under `train`'s summary of a run that trained with model.fit (docs/running.md)
KERAS_LOSS_NOTE = ("loss: Keras' mean over each finished epoch, as `fit` returns it; the bar's values within an "
                   "epoch are not shown")
MWMS_SUMS = " (tf_keras under MultiWorkerMirroredStrategy sums those over the workers)"   # mode mirrored's why


def keras_said(got: TaskProgress) -> str:
    """A Keras script's fit (from its second), last epoch, loss and metrics, as one line
    (`train`'s summary); "" for another script."""
    if got.epoch is None:
        return ""
    parts = ([f"fit {got.fit}"] if got.fit is not None and got.fit > 1 else []) + [f"epoch {got.epoch}/{got.epochs}"]
    parts += [f"loss {got.loss:.4g}"] if got.loss is not None else []
    return " · ".join(parts + [f"{name} {value:.4g}" for name, value in metric_items(got.metrics)])


def metric_items(metrics: dict[str, float]) -> list[tuple[str, float]]:
    """Keras' other metrics as shown (footer, summary): val_loss first, the loss's own
    measure on held-out data, then the rest in Keras' order."""
    return sorted(metrics.items(), key=lambda item: item[0] != "val_loss")


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
