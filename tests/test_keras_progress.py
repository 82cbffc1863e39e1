"""Keras' `model.fit` progress, read and folded: the parser on real Keras output, the live
view's one bar line per epoch per task, and (tf) a real `model.fit` run through `train`.

The samples in tests/data/keras_progress/ were written once by the real Keras with stdout
a pipe, as tfcluster runs scripts: `python capture.py` there (Keras 3.15 as `tf.keras` of
TensorFlow 2.21) and `TF_USE_LEGACY_KERAS=1 python capture.py` (tf_keras 2.21). Each is
`fit` for 3 epochs of 20 batches with validation data, then `evaluate` (4 batches) and
`predict` (2) with their own bars; sizes known (arrays), `repeat()` with
`steps_per_epoch`, and unknown (a filtered dataset: `1/Unknown` in the first epoch);
verbose=1 (a bar update per batch: `\\b`s, `\\r`, Keras 3's escapes and `━`, tf_keras'
`[====>...]` and `ETA:`) and verbose=2 (one line per epoch)."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from tfcluster.watch import logmux, metrics
from tfcluster.watch.footer import progress_line
from tfcluster.watch.logmux import LogMux

DATA = Path(__file__).parent / "data" / "keras_progress"
SAMPLES = sorted(p.name for p in DATA.glob("*.txt"))
FIT_LOSS = re.compile(rb"loss: ([0-9.]+)")


def sample(name: str) -> bytes:
    return (DATA / name).read_bytes()


def fit_lines(data: bytes) -> list[bytes]:
    """The last update of each line that ends an epoch (the epoch's own, as Keras printed it)."""
    return [line.split(b"\r")[-1] for line in data.split(b"\n") if b"val_loss: " in line]


def as_written(data: bytes) -> list[bytes]:
    """The sample cut where Keras wrote: each bar update (`\\b`s, `\\r`, the bar) and each line."""
    return [c for c in re.split(rb"(?<!\x08)(?=\x08+\r)|(?<=\n)", data) if c]


# -- the parser -------------------------------------------------------------------------

def test_the_samples_are_all_there():
    assert len(SAMPLES) == 12, SAMPLES
    assert all(b"Epoch 3/3" in sample(name) for name in SAMPLES)


@pytest.mark.parametrize("name", SAMPLES)
def test_fit_gives_the_global_step_epoch_loss_metrics_and_target(name):
    data = sample(name)
    t = metrics.Tracker()
    t.feed_block("worker:0", data, now=1.0)
    s = t.state("worker:0")
    last = fit_lines(data)[-1]                  # evaluate's and predict's bars come after it
    assert (s.step, s.epoch, s.epochs, s.target) == (60, 3, 3, 60)
    assert s.loss == float(FIT_LOSS.search(last.split(b" - val_")[0]).group(1))
    assert set(s.metrics) == {"accuracy", "val_loss", "val_accuracy"}
    assert s.metrics["val_loss"] == float(re.search(rb"val_loss: ([0-9.]+)", last).group(1))


@pytest.mark.parametrize("name", [n for n in SAMPLES if n.endswith("-v1.txt")])
def test_every_bar_update_counts_on_across_epochs(name):
    t = metrics.Tracker()
    steps = [r.step for line in sample(name).split(b"\n") for r in t.read("w", line) if r.step is not None]
    assert steps == sorted(steps) and steps[-1] == 60
    assert len(set(steps)) > 30                 # a bar update per batch (a sleep in each)
    assert steps.count(60) <= 2                 # the epoch's end (tf_keras: also its ETA 0s one)
    if "unknown" in name:                       # `n/Unknown` in epoch 1, then 20 a epoch
        assert 21 in steps and 20 in steps


def test_an_unknown_epoch_size_counts_on_from_the_epochs_before():
    t = metrics.Tracker()
    lines = [b"Epoch 1/2", b"     15/Unknown 3s 19ms/step - loss: 0.5", b"     30/Unknown 4s 19ms/step - loss: 0.4",
             b"30/30 4s 19ms/step - loss: 0.4", b"Epoch 2/2", b"     12/Unknown 1s 9ms/step - loss: 0.3"]
    said = [t.feed("w", line) for line in lines]
    assert [r.step for r in said] == [None, 15, 30, 30, None, 42]
    assert t.state("w").target == 60            # Keras said epoch 1's size at its end
    assert t.state("w").loss == 0.4             # epoch 1's: epoch 2 has not ended


def test_a_resumed_fit_starts_at_its_initial_epoch():
    t = metrics.Tracker()
    for line in (b"Epoch 3/5", b"10/100 [==>....] - ETA: 5s - loss: 0.2000"):
        t.feed("w", line)
    assert (t.state("w").step, t.state("w").target, t.state("w").epoch) == (210, 500, 3)


def test_evaluate_and_predict_bars_after_fit_are_no_steps():
    t = metrics.Tracker()
    for line in (b"Epoch 1/1", b"20/20 - 1s - 38ms/step - accuracy: 0.5 - loss: 0.6972",
                 b"4/4 - 0s - 6ms/step - accuracy: 0.4 - loss: 9.9", b"1/2 - 0s - 6ms/step",
                 b"     3/Unknown 0s 6ms/step - loss: 8.8"):
        t.feed("w", line)
    assert (t.state("w").step, t.state("w").loss) == (20, 0.6972)
    t = metrics.Tracker()           # no fit before: a bar with a loss is a fit of one epoch (Keras
    said = t.feed("w", b"4/4 - 0s - 6ms/step - loss: 9.9")     # prints no `Epoch 1/1`), a script's Progbar too
    assert (said.step, said.loss, said.epoch) == (4, 9.9, (1, 1))
    t = metrics.Tracker()           # predict's (no loss) is nothing
    assert t.feed("w", b"2/2 - 0s - 6ms/step") is None and t.state("w") is None


def test_the_placement_probe_line_is_no_step():
    # as host/probe/sitecustomize.py writes it: a placed variable, and one with no device
    for device in (b"/job:ps/replica:0/task:0/device:CPU:0", b""):
        probe = (b'tfcluster-placement: {"task":"worker:0","pid":7,"vars":[["global_step:0","' + device
                 + b'",[],"int64"]],"truncated":false}')
        t = metrics.Tracker()
        assert not t.feed("worker:0", probe) and t.state("worker:0") is None
        assert t.parse(probe) == (None, None) and metrics.points([probe, b"loss=1"], t) == []
    assert t.parse(b"global_step:15000") == (15000, None)      # the same words from the script count


def test_a_spec_step_pattern_wins_over_the_bars_and_a_spec_target_over_keras():
    class P:
        step, loss, target = r"iter (\d+)", None, 1000
    t = metrics.Tracker(P(), targets={"w": 1000})
    t.feed("w", b"Epoch 2/3")
    t.feed("w", b"20/20 [==========] - 1s 50ms/step - loss: 0.5000 - accuracy: 0.7500")
    s = t.state("w")
    assert (s.step, s.loss, s.epoch, s.target, s.metrics) == (None, 0.5, 2, 1000, {"accuracy": 0.75})
    t.feed("w", b"iter 77 and 6/20 [====>...] - ETA: 1s - loss: 0.4000")
    assert t.state("w").step == 77


def test_the_footer_shows_step_epoch_eta_loss_and_metrics():
    t = metrics.Tracker()
    t.feed("worker:0", b"Epoch 2/3")
    for i in range(1, 21):          # a batch every 0.5 s
        t.feed("worker:0", f"{i:2d}/20 \x1b[1m0s\x1b[0m 5ms/step - accuracy: 0.9100 - loss: 0.3100\x08\x08".encode(),
               now=100 + i / 2)
    line = progress_line(t.tasks, elapsed=35, now=110.0)
    assert line == "step 40/60 (66%) · epoch 2/3 · 2.0 steps/s · ETA 0:10 · elapsed 0:35 · loss 0.31 · accuracy 0.91"


# -- the live view ----------------------------------------------------------------------

def fold(name: str, tmp_path, **kw) -> tuple[list[str], bytes, list[int]]:
    """The sample through a LogMux as Keras wrote it: shown lines, the saved log, and the
    steps the watcher (ProgressLog's place) was told."""
    data, out, steps = sample(name), io.BytesIO(), []
    t = metrics.Tracker()

    def watcher(key: str, line: bytes) -> None:
        said = t.feed(key, line)
        if said is not None and said.step is not None:
            steps.append(said.step)
    mux = LogMux(out, ["worker:0"], color=False, save_dir=str(tmp_path / "run"), watch=(t.markers, watcher), **kw)
    for chunk in as_written(data):
        mux.feed("worker:0", chunk)
    mux.close()
    shown = out.getvalue().decode().splitlines()
    return shown, (tmp_path / "run" / "worker-0.log").read_bytes(), steps


@pytest.mark.parametrize("name", [n for n in SAMPLES if n.endswith("-v1.txt")])
def test_the_live_view_shows_one_bar_line_per_epoch_and_the_saved_log_every_update(name, tmp_path):
    shown, saved, steps = fold(name, tmp_path)
    assert saved == sample(name)
    bars = [line for line in shown if "/step" in line]
    assert len(bars) == 3 + 2                   # an epoch's last update each; evaluate's; predict's
    assert [line.count("val_loss: ") for line in bars] == [1, 1, 1, 0, 0]
    assert len(shown) == 3 * 2 + 2 + 1          # with the 3 `Epoch k/3` lines and `done`
    assert steps == sorted(steps) and len(set(steps)) > 30 and steps[-1] == 60   # every update watched


def test_a_bar_slower_than_the_fold_interval_is_shown_now_and_then(tmp_path, monkeypatch):
    monkeypatch.setattr(logmux, "FOLD_EVERY", 0.0)   # every other update is "30 s later"
    shown, _, _ = fold("keras3-known-v1.txt", tmp_path)
    assert len([line for line in shown if "/step" in line]) > 20
    shown, _, _ = fold("keras3-known-v1.txt", tmp_path / "b", collapse=False)
    assert len([line for line in shown if "/step" in line]) > 60     # collapse=False: every update


def test_other_carriage_return_progress_is_not_folded(tmp_path):
    out = io.BytesIO()
    mux = LogMux(out, ["w", "k"], color=False)
    for chunk in (b"copy 10%\rcopy 20%\r", b"copy 30%\r", b"copy 40%\n"):
        mux.feed("w", chunk)
    for chunk in (b"Epoch 1/1\n\r 1/3 [=>..] - ETA: 1s - loss: 0.5", b"\x08\x08\r 2/3 [==>.] - ETA: 1s - loss: 0.4",
                  b"\x08\x08\r 3/3 [====] - ETA: 0s - loss: 0.3", b"\x08\x08\r3/3 [====] - 1s 9ms/step - loss: 0.3\n"):
        mux.feed("k", chunk)
    mux.close()
    assert out.getvalue().decode().splitlines() == [
        "w │ copy 20%", "w │ copy 30%", "w │ copy 40%",      # the latest of each batch, as before
        "k │ Epoch 1/1", "k │ 3/3 [====] - 1s 9ms/step - loss: 0.3"]


# -- a real model.fit through `train` (tf) ------------------------------------------------

FIT = """\
import contextlib, os, time
import numpy as np
import tensorflow as tf
keras = tf.keras
index = int(os.environ["TFCLUSTER_TASK_INDEX"])
strategy = tf.distribute.MultiWorkerMirroredStrategy() if os.environ.get("MWMS") else None
rng = np.random.default_rng(index)
x = rng.random((320, 8), dtype="float32")
y = (rng.random(320) > 0.5).astype("float32")
with strategy.scope() if strategy else contextlib.nullcontext():
    model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
slow = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: time.sleep(0.15))
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()
model.fit(data, epochs=3, steps_per_epoch=20, validation_data=(x[:32], y[:32]), verbose=1, callbacks=[slow])
"""
BAR_END = re.compile(rb"20/20\b.*val_loss: ")   # an epoch's end, Keras 3 (escapes after 20/20) or tf_keras


def keras_spec(tmp_path, workers: int, extra: str = "") -> Path:
    from tests.helpers import local_spec

    (tmp_path / "fit.py").write_text(FIT)
    return local_spec(tmp_path, mode="mirrored", script="fit.py", ps=0, workers=workers, name="k", extra=extra)


def after_the_run(spec: Path, cwd: Path, home: Path, keys: list[str]) -> None:
    """What the saved run gives `runs` and `plot`; every update of the bars in the saved logs."""
    from tests.helpers import only_run, tfcluster
    from tfcluster.watch.plotting import run_series
    from tfcluster.watch.runs import read_manifest

    run = only_run(cwd / "runs")
    for key in keys:
        saved = (run / f"{key.replace(':', '-')}.log").read_bytes()
        assert len(BAR_END.findall(saved)) == 3 and saved.count(b"\r") > 3 * 10, saved[-2000:]
    row = json.loads(tfcluster("runs", str(spec), "--json", home=home, cwd=cwd).stdout)["runs"][0]
    last = fit_lines((run / "worker-0.log").read_bytes())[-1]
    assert (row["step"], row["epoch"], row["epochs"]) == (60, 3, 3)
    assert row["loss"] == float(FIT_LOSS.search(last).group(1)) and "val_loss" in row["metrics"]
    table = tfcluster("runs", str(spec), home=home, cwd=cwd).stdout
    assert re.search(r"succeeded +0 +60 +3/3 +[0-9.]+", table), table
    series = run_series(str(run), read_manifest(str(run)))
    assert sorted(series) == keys and all([s for s, _ in series[k].loss] == [20, 40, 60] for k in keys)
    text = tfcluster("plot", str(spec), home=home, cwd=cwd).stdout
    assert re.search(r"worker:0  steps \d+–60 · epoch 3/3", text) and "loss" in text, text


@pytest.mark.tf
@pytest.mark.timeout(300)
def test_keras3_fit_in_a_terminal_has_a_footer_one_bar_line_per_epoch_runs_and_plot(tmp_path, home):
    from tests.terminal import run_in_pty, screen_lines

    spec = keras_spec(tmp_path, workers=1)
    rc, data = run_in_pty(["train", str(spec)], tmp_path, timeout=240)
    assert rc == 0, data.decode(errors="replace")[-3000:]
    dot = " · ".encode()
    footer = re.compile(rb"step (\d+)/60 \(\d+%\)" + dot + rb"epoch ([123])/3" + dot + rb"[0-9.]+ steps/s" + dot
                        + rb"ETA [0-9:]+" + dot + rb"elapsed [0-9:]+" + dot + rb"loss [0-9.]+" + dot + rb"(val_loss|accuracy) ")
    seen = footer.findall(data)        # the metrics' end is cut (…) at the terminal's width
    assert len({step for step, _, _ in seen}) >= 3 and {epoch for _, epoch, _ in seen} >= {b"2", b"3"}, seen
    assert {metric for _, _, metric in seen} == {b"val_loss"}     # a finished epoch's metrics, val_loss first
    lines = screen_lines(data)
    assert len(BAR_END.findall(data)) == 3 and data.count(b"/step") == 3      # one bar line an epoch
    assert [line for line in lines if line.startswith("worker:0 │ Epoch ")] == [
        f"worker:0 │ Epoch {k}/3" for k in (1, 2, 3)]
    summary = [line for line in lines if re.match(r"│ worker:0 +│ local", line)]
    assert len(summary) == 1 and re.search(r"│ +60 +│", summary[0]) and "epoch 3/3 · loss " in summary[0], lines[-20:]
    after_the_run(spec, tmp_path, home, ["worker:0"])


@pytest.mark.tf
@pytest.mark.timeout(300)
def test_tf_keras_multi_worker_fit_folds_each_workers_bars_and_reads_the_step(tmp_path, home):
    from tests.helpers import tfcluster

    spec = keras_spec(tmp_path, workers=2, extra='env: {TF_USE_LEGACY_KERAS: "1", MWMS: "1"}\n')
    result = tfcluster("train", str(spec), home=home, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for key in ("worker:0", "worker:1"):
        mine = [line for line in result.stdout.splitlines() if line.startswith(f"{key} │ ")]
        bars = [line for line in mine if "/step" in line or "ETA: " in line]
        assert len(bars) == 3 and all(BAR_END.search(line.encode()) for line in bars), mine
    rows = [line for line in result.stderr.splitlines() if re.match(r"worker:[01]  ", line)]
    assert len(rows) == 2 and all(re.split(r"\s{2,}", row.strip())[5] == "60" for row in rows), result.stderr
    after_the_run(spec, tmp_path, home, ["worker:0", "worker:1"])


def test_runs_and_plot_read_a_keras_log_that_has_no_recorded_progress(tmp_path):
    from tfcluster.watch.follow import run_rows
    from tfcluster.watch.plotting import run_series, text_plot

    run = tmp_path / "lab-20260101-000000-aaaa"
    run.mkdir()
    plan = {"tasks": [{"task": "worker:0", "chief": True, "script": ["python3", "fit.py"]}]}
    (run / "manifest.json").write_text(json.dumps({"outcome": "running", "started": 1.0, "plan": plan}))
    data = sample("tf_keras-unknown-v1.txt")
    (run / "worker-0.log").write_bytes(data)
    row = run_rows(str(tmp_path), "lab")[0]
    fit_loss = float(FIT_LOSS.search(fit_lines(data)[-1]).group(1))
    assert (row["step"], row["epoch"], row["epochs"], row["loss"]) == (60, 3, 3, fit_loss)
    series = run_series(str(run), json.loads((run / "manifest.json").read_text()))["worker:0"]
    assert series.epoch == (3, 3) and series.loss[-1] == (60, fit_loss)
    assert [step for step, _ in series.loss] == [20, 40, 60]     # each epoch's end, Keras' own mean
    assert text_plot("r", {"worker:0": series})[1] == "worker:0  steps 20–60 · epoch 3/3"   # no times: no rate


def test_logs_replays_a_keras_run_as_one_bar_line_an_epoch(tmp_path, home):
    from tests.helpers import local_spec, tfcluster

    spec = local_spec(tmp_path, mode="mirrored", script="fit.py", ps=0, workers=1, name="lab")
    run = tmp_path / "runs" / "lab-20260101-000000-aaaa"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"outcome": "succeeded", "exit_code": 0, "started": 1.0}))
    (run / "worker-0.log").write_bytes(sample("keras3-unknown-v1.txt") * 40)   # lines across 64 KiB reads
    out = tfcluster("logs", str(spec), home=home, cwd=tmp_path).stdout.splitlines()
    assert len([line for line in out if "/step" in line]) == 40 * (3 + 2)
    assert len([line for line in out if line.startswith("worker:0 │ Epoch ")]) == 40 * 3
