"""One progress model across several `model.fit` calls, verbose levels and both Kerases; the
loss as Keras means it (each epoch's end); a loss-only `train.progress` in the summary.

The samples in tests/data/keras_fits/ were written once by the real Keras with stdout a
pipe (`python capture.py` there, whose docstring says what each script does): four fits of
110 steps in all, the last `Epoch 3/3`; and worker 0 of two tf_keras workers under
MultiWorkerMirroredStrategy, whose bar sums the loss over the workers within an epoch."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tfcluster.watch import metrics
from tfcluster.watch.footer import progress_line
from tests.helpers import local_spec, only_run, tfcluster

DATA = Path(__file__).parent / "data" / "keras_fits"
FITS = [f"{k}-fits-v{v}.txt" for k in ("keras3", "tf_keras") for v in (1, 2)]
EPOCH_ENDS = [20, 40, 60, 70, 90, 110]       # 2 epochs, 1, 1 of 10 batches, epochs 2-3 of 3
LOSS = re.compile(rb" loss: ([0-9.]+)")


def sample(name: str) -> bytes:
    return (DATA / name).read_bytes()


def updates(data: bytes) -> list[bytes]:
    """Every `\\r` update and line, in order, as LogMux gives them to its watchers."""
    return [seg for line in data.split(b"\n") for seg in line.split(b"\r") if seg]


def epoch_losses(data: bytes) -> list[float]:
    """The loss of each line that ends a training epoch (its last update), as Keras printed it;
    evaluate's lines (4/4) are not."""
    out = []
    for line in data.split(b"\n"):
        last = line.split(b"\r")[-1].replace(b"\x08", b"")
        last = re.sub(rb"\x1b\[[0-9;]*m", b"", last)
        if re.match(rb"\s*(20/20|10/10) ", last) and LOSS.search(last):
            out.append(float(LOSS.search(last).group(1)))
    return out


@pytest.mark.parametrize("name", FITS)
def test_four_fits_give_one_global_step_the_last_fits_epoch_and_each_epochs_loss(name):
    data = sample(name)
    t = metrics.Tracker()
    steps = []
    for i, update in enumerate(updates(data)):
        said = t.feed("worker:0", update, now=100 + i * 0.05)
        if said is not None and said.step is not None:
            steps.append(said.step)
    s = t.state("worker:0")
    assert (s.step, s.epoch, s.epochs, s.fit, s.target) == (110, 3, 3, 4, 110)
    assert steps == sorted(steps) and steps[-1] == 110      # never back: no second "step 1"
    ends = epoch_losses(data)
    assert len(ends) == 6 and s.loss == ends[-1]
    points = metrics.points(data.split(b"\n"), metrics.Tracker(), "worker:0")
    assert points == list(zip(EPOCH_ENDS, ends))       # the plot: each epoch's end, nothing within
    line = progress_line(t.tasks, elapsed=9, now=s.last[0])
    assert line.startswith("step 110/110 (100%) · fit 4 · epoch 3/3 · ") and f"loss {ends[-1]:.4g}" in line


def test_a_one_epoch_fit_is_told_from_evaluate_by_its_size_or_its_val_metrics():
    t = metrics.Tracker()
    for line in (b"Epoch 1/2", b"20/20 - 1s - 9ms/step - loss: 0.9", b"Epoch 2/2", b"20/20 - 1s - 9ms/step - loss: 0.8",
                 b"20/20 - 1s - 9ms/step - loss: 0.7",                       # fit(epochs=1): the same size
                 b"4/4 - 0s - 6ms/step - loss: 9.9",                         # evaluate: another size
                 b"2/2 - 0s - 6ms/step",                                     # predict: no loss
                 b"10/10 - 1s - 9ms/step - loss: 0.6 - val_loss: 0.65"):     # fit(epochs=1, validation_data)
        t.feed("w", line)
    s = t.state("w")
    assert (s.step, s.fit, s.epoch, s.loss, s.metrics) == (70, 3, 1, 0.6, {"val_loss": 0.65})


def test_an_evaluate_the_probe_brackets_is_no_fit_though_its_bars_are_a_fits_size():
    """`evaluate` on the fit's own dataset prints the bars a `fit(epochs=1)` would; the probe's
    lines around it say which it is, and a one-epoch fit after it still counts."""
    t = metrics.Tracker()
    for line in (b"Epoch 1/2", b"20/20 - 1s - 9ms/step - loss: 0.9", b"Epoch 2/2", b"20/20 - 1s - 9ms/step - loss: 0.8",
                 b"tfcluster-keras: evaluate",
                 b"20/20 - 0s - 3ms/step - loss: 0.5",          # the same size as the fit's epochs
                 b"tfcluster-keras: evaluate done",
                 b"20/20 - 1s - 9ms/step - loss: 0.7"):         # fit(epochs=1): a fit again
        t.feed("w", line)
    s = t.state("w")
    assert (s.step, s.fit, s.loss) == (60, 2, 0.7)
    t = metrics.Tracker()
    for line in (b"Epoch 2/2", b"20/20 - 1s - 9ms/step - loss: 0.8", b"tfcluster-keras: evaluate",
                 b"20/20 - 0s - 3ms/step - loss: 0.5"):
        t.feed("w", line)
    assert (t.state("w").step, t.state("w").fit, t.state("w").loss) == (40, 1, 0.8)   # not evaluate's


def test_a_restarted_attempt_counts_its_fits_afresh():
    t = metrics.Tracker()
    t.feed_block("worker:0", sample("keras3-fits-v2.txt"))
    assert t.state("worker:0").step == 110
    # the note LogMux writes between two attempts (the saved log and the watchers have it)
    t.feed("worker:0", b"[tfcluster] exited with code 1; restarting (1/3)")
    for line in (b"Epoch 1/2", b"20/20 - 1s - 64ms/step - loss: 0.7"):
        t.feed("worker:0", line)
    assert (t.state("worker:0").step, t.state("worker:0").fit) == (20, 1)


def test_tf_keras_multi_worker_loss_is_each_epochs_not_the_bars_sum_over_the_workers():
    data = sample("tf_keras-mwms-v1.txt")
    bar = [float(m) for m in re.findall(rb"ETA: \S+ - loss: ([0-9.]+)", data)]
    ends = epoch_losses(data)
    assert len(ends) == 2 and bar and max(bar) > 1.5 * max(ends)    # what misled: the sum, mid-epoch
    t = metrics.Tracker()
    said = [r.loss for u in updates(data) if (r := t.feed("worker:0", u)) is not None and r.loss is not None]
    assert said == ends and t.state("worker:0").loss == ends[-1]
    assert metrics.points(data.split(b"\n"), metrics.Tracker(), "worker:0") == [(10, ends[0]), (20, ends[1])]


def test_a_loss_only_progress_pattern_is_in_trains_summary(tmp_path, home):
    (tmp_path / "xent.py").write_text(
        "import sys\nfor i in range(1, 6):\n    print(f'iteration {i} xent={1 / 2 ** i}', flush=True)\n")
    spec = local_spec(tmp_path, mode="mirrored", script="xent.py", ps=0, workers=1, name="x",
                      extra="  progress: {loss: 'xent=([0-9.]+)'}\n")
    result = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stderr.splitlines() if line.startswith("worker:0  ")]
    assert len(rows) == 1 and rows[0].rstrip().endswith("iteration 5 xent=0.03125"), result.stderr
    row = json.loads(tfcluster("runs", str(spec), "--json", home=home, cwd=tmp_path).stdout)["runs"][0]
    assert row["loss"] == 0.03125 and row["step"] is None


# -- a real script with three fits through `train` (tf) ----------------------------------

THREE_FITS = """\
import os, time
import numpy as np
import tensorflow as tf
keras = tf.keras
rng = np.random.default_rng(0)
x = rng.random((320, 8), dtype="float32")
y = (rng.random(320) > 0.5).astype("float32")
model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(4, activation="relu"),
                          keras.layers.Dense(1, activation="sigmoid")])
model.compile(optimizer="adam", loss="binary_crossentropy")
ends = []
def batch_end(batch, logs):
    time.sleep(0.05)
    ends.append(time.time())
timed = keras.callbacks.LambdaCallback(on_train_batch_end=batch_end)
model.fit(x, y, batch_size=16, epochs=2, verbose=2, callbacks=[timed])      # Epoch 1/2, 2/2
print("evaluating", flush=True)
model.evaluate(x, y, batch_size=16, verbose=2)                               # 20/20, as fit's epochs
print("evaluated", flush=True)
model.fit(x, y, batch_size=16, epochs=1, verbose=2, callbacks=[timed])      # no Epoch line
model.fit(x, y, batch_size=16, epochs=3, verbose=2, callbacks=[timed])
model.evaluate(x, y, batch_size=16)
print(f"measured {len(ends)} steps at {(len(ends) - 1) / (ends[-1] - ends[0]):.3f} steps/s", flush=True)
"""


@pytest.mark.tf
@pytest.mark.timeout(300)
def test_three_fits_give_runs_the_last_fits_step_and_epoch_a_right_rate_and_a_plot_without_sawtooth(tmp_path, home):
    from tfcluster.watch.plotting import run_series
    from tfcluster.watch.runs import read_manifest

    (tmp_path / "fits.py").write_text(THREE_FITS)
    spec = local_spec(tmp_path, mode="mirrored", script="fits.py", ps=0, workers=1, name="f")
    result = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    measured = re.search(r"measured (\d+) steps at ([0-9.]+) steps/s", result.stdout)
    assert measured and measured.group(1) == "120", result.stdout[-2000:]
    assert metrics.KERAS_LOSS_NOTE in result.stderr           # the mid-epoch caveat, once
    assert result.stderr.count(metrics.KERAS_LOSS_NOTE) == 1
    row = json.loads(tfcluster("runs", str(spec), "--json", home=home, cwd=tmp_path).stdout)["runs"][0]
    assert (row["step"], row["epoch"], row["epochs"], row["fit"]) == (120, 3, 3, 3), row
    rate = float(measured.group(2))
    assert 0.6 * rate < row["steps_per_s"] < 1.2 * rate, (row["steps_per_s"], rate)
    table = tfcluster("runs", str(spec), home=home, cwd=tmp_path).stdout
    assert re.search(r"succeeded +0 +120 +3/3 \(fit 3\) +[0-9.]+", table), table
    run = only_run(tmp_path / "runs")
    series = run_series(str(run), read_manifest(str(run)))["worker:0"]
    assert [step for step, _ in series.loss] == [20, 40, 60, 80, 100, 120]     # one point an epoch
    fits = re.sub(r"evaluating\n.*?evaluated\n", "", result.stdout, flags=re.S)    # evaluate's own 20/20 line
    ends = [float(m) for m in re.findall(r"20/20 - .* loss: ([0-9.]+)", fits)]
    assert [loss for _, loss in series.loss] == ends
    steps = [step for step, _ in series.rate]
    assert steps == sorted(steps) and steps[-1] == 120 and all(r > 0 for _, r in series.rate)
