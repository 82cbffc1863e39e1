"""`tfcluster plot`: loss and steps/s per task against the step, from a run's saved files.

Loss comes from the saved logs (metrics.py reads each line, and each update of a Keras
progress bar, whose global step counts on across epochs). Steps per second need times,
which the logs do not have: they come from progress.tsv (when each step line reached this
machine, recorded by `train`). A run without one (saved before it existed) gets one
average rate per task, from its first to its last step over the script's run time in the
manifest. matplotlib is imported only for a PNG (`-o FILE.png`).
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from tfcluster.errors import UsageError
from tfcluster.localfs import open_saved, saved_lines, write_output
from tfcluster.plan.names import log_file
from tfcluster.watch import runs
from tfcluster.watch.follow import patterns_of
from tfcluster.watch.metrics import Tracker, points

WIDTH = 48                # columns of a terminal plot
BARS = "▁▂▃▄▅▆▇█"
RATE_SPAN = 1.0           # seconds a steps/s sample spans at least


@dataclass
class Series:
    loss: list[tuple[int, float]] = field(default_factory=list)      # (step, loss)
    rate: list[tuple[int, float]] = field(default_factory=list)      # (step, steps/s)
    rate_source: str = "arrival times"                               # or "average"
    epoch: tuple[int, int] | None = None                             # Keras' last `Epoch k/N`


def run_series(directory: str, doc: dict, progress=None, warn=None) -> dict[str, Series]:
    """task -> Series, for each script task whose log gives a step and a loss or a rate.
    Logs are read line by line (lines cut: localfs.saved_lines); one that is no regular
    file is left out, and `warn` told so."""
    keys = [t.get("task") for t in (doc.get("plan") or {}).get("tasks") or []
            if isinstance(t, dict) and t.get("script")]
    keys = [k for k in keys if isinstance(k, str)] or runs.task_logs(directory, "")
    times = runs.read_progress(directory, warn)
    out = {}
    for key in keys:
        path = os.path.join(directory, log_file(key))
        try:
            f = open_saved(path)
        except OSError as e:
            if not isinstance(e, FileNotFoundError):
                runs.refused(warn, path, e)
            continue
        with f:
            tracker = Tracker(patterns_of(doc, progress))
            series = Series(loss=points(saved_lines(f), tracker, key))
            fit = tracker.fits.get(key)
            series.epoch = (fit.epoch, fit.epochs) if fit is not None else None
            if times.get(key):
                series.rate = rates(times[key])
            else:
                f.seek(0)
                series.rate, series.rate_source = _average(doc, key, saved_lines(f), progress), "average"
        if series.loss or series.rate:
            out[key] = series
    return out


def rates(samples: list[tuple[float, int]], span: float = RATE_SPAN) -> list[tuple[int, float]]:
    """(step, steps/s) from (time, step) samples: each over at least `span` seconds back
    (lines arrive in batches, so neighbours alone would give noise). A step that goes
    back (a restart from a checkpoint) starts over; a step said again (the final result
    line after the last step line) tells nothing new and is left out."""
    samples = [s for i, s in enumerate(samples) if not i or s[1] != samples[i - 1][1]]
    out: list[tuple[int, float]] = []
    start = 0
    if len(samples) > 1:       # a short run still gets a curve: a tenth of it at least
        span = min(span, max((samples[-1][0] - samples[0][0]) / 10, 1e-3))
    j = 0
    for i, (t, step) in enumerate(samples):
        if i and step < samples[i - 1][1]:
            start = j = i
        # j only moves on: within an attempt the times only grow (one pass, not one per sample)
        while j + 1 < i and t - samples[j + 1][0] >= span:
            j += 1
        t0, s0 = samples[j]
        if t - t0 >= span and step >= s0:
            out.append((step, (step - s0) / (t - t0)))
    (t0, s0), (t1, s1) = (samples[start], samples[-1]) if samples else ((0, 0), (0, 0))
    if not out and t1 > t0 and s1 > s0:     # a run shorter than `span`: its one average
        out = [(s0, (s1 - s0) / (t1 - t0)), (s1, (s1 - s0) / (t1 - t0))]
    return out


def _average(doc: dict, key: str, lines: Iterable[bytes], progress) -> list[tuple[int, float]]:
    script = ((doc.get("tasks") or {}).get(key) or {}).get("script") or {}
    started, ended = script.get("started"), script.get("ended")
    if not isinstance(started, (int, float)) or not isinstance(ended, (int, float)) or ended <= started:
        return []
    tracker = Tracker(patterns_of(doc, progress))
    first = last = None
    for line in lines:
        for r in tracker.read(key, line):
            if r.step is not None:
                first = r.step if first is None else first
                last = r.step
    if first is None:
        return []
    rate = (last - first) / (ended - started)
    return [(first, rate), (last, rate)]


# -- the terminal ----------------------------------------------------------------------

def text_plot(run_id: str, series: dict[str, Series], width: int = WIDTH) -> list[str]:
    """A few lines per task: loss and steps/s as sparklines over the step range."""
    lines = [f"run {run_id}: loss and steps/s against the step, {width} columns per task"]
    for key, s in series.items():
        steps = [p[0] for p in s.loss + s.rate]
        lo, hi = min(steps), max(steps)
        lines.append(f"{key}  steps {lo}–{hi}" + (f" · epoch {s.epoch[0]}/{s.epoch[1]}" if s.epoch else ""))
        if s.loss:
            values = [v for _, v in s.loss]
            scaled = _log_scale(values)
            bars = sparkline(s.loss, lo, hi, width, math.log10 if scaled else None)
            lines.append(f"  loss     {_num(values[0]):>9} {bars} {_num(values[-1])}"
                         f"  (min {_num(min(values))}{', log scale' if scaled else ''})")
        if s.rate:
            values = [v for _, v in s.rate]
            lines.append(f"  steps/s  {_num(values[0]):>9} {sparkline(s.rate, lo, hi, width, floor=0.0)} "
                         f"{_num(values[-1])}  (mean {_num(sum(values) / len(values))}"
                         f"{', one average: no arrival times saved' if s.rate_source == 'average' else ''})")
    return lines


def sparkline(data: list[tuple[int, float]], lo: int, hi: int, width: int, transform=None,
              floor: float | None = None) -> str:
    """One character per column of the step range [lo, hi]: the mean of its points, on
    the scale of the data's min (or `floor`) to max; a column without points repeats the
    one before (blank before the first)."""
    sums, counts = [0.0] * width, [0] * width
    for step, value in data:
        if not math.isfinite(value) or (transform and value <= 0):
            continue
        col = 0 if hi == lo else min(width - 1, (step - lo) * width // (hi - lo + 1))
        sums[col] += transform(value) if transform else value
        counts[col] += 1
    cols = [sums[i] / counts[i] if counts[i] else None for i in range(width)]
    known = [c for c in cols if c is not None]
    if not known:
        return " " * width
    bottom, top = min(known) if floor is None else floor, max(known)
    out, last = [], None
    for c in cols:
        last = c if c is not None else last
        if last is None:
            out.append(" ")
        else:
            level = 0 if top == bottom else round((last - bottom) / (top - bottom) * (len(BARS) - 1))
            out.append(BARS[level])
    return "".join(out)


def _log_scale(values: list[float]) -> bool:
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and min(finite) > 0 and max(finite) / min(finite) > 100


def _num(value: float) -> str:
    return f"{value:.4g}"


# -- a PNG -----------------------------------------------------------------------------

PNG_SIZE = (9.0, 6.0)     # inches; at PNG_DPI: 900 x 600 pixels
PNG_DPI = 100


def write_png(path: str, run_id: str, series: dict[str, Series]) -> None:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("plot -o needs matplotlib, which is not installed",
                         hint="pip install 'tfcluster[plot]' (or pip install 'matplotlib>=3.7'); "
                              "without -o, plot draws in the terminal") from None
    matplotlib.use("Agg")        # no display needed, none opened
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_rate) = plt.subplots(2, 1, sharex=True, figsize=PNG_SIZE, dpi=PNG_DPI)
    try:
        for key, s in series.items():
            if s.loss:
                ax_loss.plot([p[0] for p in s.loss], [p[1] for p in s.loss],
                             label=key + (f" (epoch {s.epoch[0]}/{s.epoch[1]})" if s.epoch else ""))
            if s.rate:
                ax_rate.plot([p[0] for p in s.rate], [p[1] for p in s.rate], label=key,
                             linestyle="--" if s.rate_source == "average" else "-")
        if _log_scale([p[1] for s in series.values() for p in s.loss]):
            ax_loss.set_yscale("log")
        ax_loss.set_title(f"run {run_id}")
        ax_loss.set_ylabel("loss")
        ax_rate.set_ylabel("steps/s")
        ax_rate.set_xlabel("global step")
        for ax in (ax_loss, ax_rate):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(loc="best", fontsize="small")
        write_output(path, lambda f: fig.savefig(f, format="png"), "plot -o")   # 0600, no link followed
    finally:
        plt.close(fig)
