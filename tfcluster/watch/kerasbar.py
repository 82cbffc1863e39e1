"""Keras' `model.fit` progress as it prints it (pure, no I/O): the `Epoch k/N` lines, the bar's
updates (`140/210 ━━━ … - loss: 0.31 - accuracy: 0.91`) and the `verbose=2` line per epoch,
in Keras 3 and tf_keras alike, and where a task's fits stand from them (KerasFit). metrics'
Tracker reads them into steps, targets and metrics (docs/running.md, "Keras' progress")."""
from __future__ import annotations

import re

from tfcluster.watch.logscan import CSI

# a number as Python and Keras print it (metrics' loss pattern reads it too)
NUMBER = rb"([-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|nan|inf))"
# Keras' progress, as Keras 3 and tf_keras print it to a pipe (tests/data/keras_progress/):
# every bar update is `\b` × the last width, `\r`, the bar; the epoch's last update ends
# the line. Every bar names its time per step (`22ms/step`) or, in tf_keras, its `ETA: `.
KERAS_EPOCH_MARK = b"Epoch "
KERAS_BAR_MARKS = (b"/step", b"ETA: ")
KERAS_EPOCH = re.compile(rb"\s*Epoch (\d+)/(\d+)\s*\Z")
_KERAS_BAR = re.compile(rb"\s*(\d+)/(\d+|Unknown) ")
KERAS_WHOLE = re.compile(rb"\s*\d+/\d+ - ")     # verbose=2: an epoch (or evaluate) in one line
_KERAS_METRIC = re.compile(rb" - ([A-Za-z_][\w.]*): " + NUMBER + rb"(?= |\Z)")


class KerasFit:
    """Where one task's `model.fit` calls stand, from its `Epoch k/N` lines and its bars
    (docs/running.md, "Keras' progress"), one global step across every `fit` of an attempt.

    Keras prints `Epoch k/N` only for a fit of more than one epoch: a fit of one epoch is a
    pass of bars and nothing else, as `evaluate`'s and `predict`'s are. A pass is a bar
    whose batch goes back or whose size changes. One that follows an `Epoch` line is that
    epoch's; one without is a fit of one epoch when it has a loss and either no fit came
    before it, or it repeats the size of the last fit's epochs (`fit(epochs=1)` in a loop),
    or it ends with `val_` metrics (only `fit` prints them: it counts from there); any
    other (`evaluate`, `predict` with no loss) is no step. A new fit, with its `Epoch` line
    or without, counts on from the step the last one reached. The first fit of an attempt
    that starts at `Epoch k/N` (`initial_epoch`, a restore) starts at epoch k's first step.

    An epoch ends at its bar's last update (`N/N` without `ETA: `): only there is the loss
    the epoch's own mean, which the updates before it are not always (tf_keras under
    MultiWorkerMirroredStrategy sums them over the workers)."""

    __slots__ = ("base", "batch", "counted", "done", "epoch", "epochs", "first", "fits", "last_size",
                 "pass_batch", "pass_total", "passing", "per_epoch", "skipped")

    def __init__(self) -> None:
        self.fits = 0              # fits seen in this attempt; the current one's number
        self.base = 0              # global steps before the current fit
        self.done = 0              # steps of the current fit's finished epochs
        self.skipped = 0           # epochs a resumed first fit starts after, at its epoch size
        self.epoch: int | None = None
        self.epochs: int | None = None
        self.first = 1             # the current fit's first epoch
        self.per_epoch: int | None = None    # the current fit's epoch size, once a bar said it
        self.last_size: int | None = None    # the last counted epoch's size
        self.batch = 0             # the current epoch's batch
        self.passing = False       # a pass of bars is under way
        self.counted = False       # and it is the current fit's epoch
        self.pass_batch = 0
        self.pass_total: int | None = None

    @property
    def step(self) -> int:
        return self.base + self.skipped * (self.per_epoch or 0) + self.done + self.batch

    @property
    def target(self) -> int | None:
        if not (self.epochs and self.per_epoch):
            return None
        return self.base + (self.skipped + self.epochs - self.first + 1) * self.per_epoch

    def start(self, k: int, n: int) -> None:
        """An `Epoch k/N` line: the current fit's next epoch, or a new fit."""
        if self.fits and n == self.epochs and self.epoch is not None and k == self.epoch + 1:
            self.done += self.batch
        else:
            self._new_fit(k, n)
        self.epoch, self.epochs, self.batch = k, n, 0
        self.passing, self.counted, self.pass_batch, self.pass_total = True, True, 0, None

    def _new_fit(self, k: int, n: int) -> None:
        self.base = self.step if self.fits else 0
        self.fits += 1
        self.done, self.batch, self.per_epoch = 0, 0, None
        self.skipped = k - 1 if self.fits == 1 else 0
        self.first, self.epoch, self.epochs = k, k, n

    def end_pass(self) -> None:
        """The bars so far are over (an `evaluate` ended): the next is a new pass."""
        self.passing, self.pass_batch, self.pass_total = False, 0, None

    def bar(self, batch: int, total: int | None, loss: bool, val: bool, whole: bool = False) -> int | None:
        """The global step of this bar; None: no step of a fit. `whole`: a `verbose=2` line,
        a pass of its own (unless an `Epoch` line just began one)."""
        fresh = self.passing and self.pass_batch == 0
        if not (fresh or self.passing and not whole and batch >= self.pass_batch
                and (self.pass_total is None or total == self.pass_total)):
            self.passing, self.pass_batch, self.pass_total = True, 0, None    # a new pass
            self.counted = loss and (not self.fits or val or (total is not None and total == self.last_size))
            if self.counted:
                self._new_fit(1, 1)
        elif not self.counted and loss and val:     # a pass only `fit` ends so: a fit after all
            self.counted = True
            self._new_fit(1, 1)
        self.pass_batch = batch
        self.pass_total = total if total is not None else self.pass_total
        if not self.counted:
            return None
        self.batch = batch
        if total is not None:
            self.per_epoch = self.last_size = total
        return self.step


def keras_line(line: bytes) -> bytes | None:
    """A line (one `\\r` update) with Keras' escapes and backspaces taken out; None when it
    has none of Keras' markers (the cheap test, before any regex)."""
    if b"Epoch " not in line and b"/step" not in line and b"ETA: " not in line:   # the marks, unrolled
        return None
    if b"\b" in line:
        line = line.replace(b"\b", b"")
    return CSI.sub(b"", line) if b"\x1b" in line else line


def keras_bar(line: bytes) -> tuple[int, int | None] | None:
    """(batch, total or None for `Unknown`) of a Keras bar line (escapes taken out)."""
    if not any(m in line for m in KERAS_BAR_MARKS):
        return None
    m = _KERAS_BAR.match(line)
    if m is None:
        return None
    return int(m.group(1)), None if m.group(2) == b"Unknown" else int(m.group(2))


def keras_metrics(line: bytes) -> dict[str, float]:
    """`name: value` of a Keras bar line, in its order (the loss included)."""
    out = {}
    for name, value in _KERAS_METRIC.findall(line):
        try:
            out[name.decode()] = float(value)
        except ValueError:
            continue
    return out
