"""A long traceback or tensor dump in the live view: its first and last lines, one line saying
how many are left out; the saved log keeps every byte. The rule (logscan.Fold), the LogMux
that applies it, and real runs of tests/scripts/long_failure.py: a deep traceback, and
TensorFlow's own print of a (32, 28, 28) tensor inside an exception, as Keras 3 prints a
PerReplica batch. docs/running.md, "The live view"."""
from __future__ import annotations

import io
from pathlib import Path

import pytest

from tests.helpers import known_spec, tagged_processes, tfcluster, wait_for
from tfcluster.watch.logmux import LogMux
from tfcluster.watch.logscan import FOLD_KEEP, Fold

pytestmark = [pytest.mark.timeout(120)]

FRAMES = [line for i in range(30) for line in (f'  File "train.py", line {i}, in f{i}', f"    f{i + 1}()")]
TRACE = ["Traceback (most recent call last):", *FRAMES, "ValueError: deep", "after"]
ROWS = [f"        [0.{i:08d}, 0.5 , ..., 0.25 ]," for i in range(40)]
TENSOR = ["ValueError: Attempt to convert a value (PerReplica:{",
          "  0: <tf.Tensor: shape=(40, 4), dtype=float32, numpy=", "array([[0.1, 0.2, 0.3, 0.4],", *ROWS,
          "       [0.9, 0.9, 0.9, 0.9]], shape=(40, 4), dtype=float32)>",
          "}) with an unsupported type (<class 'PerReplica'>) to a Tensor."]


def shown(*blocks: list[str]) -> list[str]:
    fold = Fold()
    out = [fold.feed("\n".join(block).encode()) for block in blocks]
    out.append(fold.flush())
    return b"\n".join(b for b in out if b is not None).decode().split("\n")


def test_a_long_traceback_keeps_its_first_and_last_frames_and_counts_the_rest():
    head, tail = FOLD_KEEP["traceback"]
    lines = shown(TRACE)
    hidden = len(FRAMES) - head - tail
    assert lines == [TRACE[0], *FRAMES[:head],
                     f"[tfcluster] … {hidden} lines of traceback frames folded (the saved log has them)",
                     *FRAMES[-tail:], "ValueError: deep", "after"]


def test_a_tensor_dump_is_folded_across_batches_and_its_last_lines_come_at_its_end():
    head, tail = FOLD_KEEP["tensor"]
    split = 20                      # the dump arrives in two chunks of the live stream
    lines = shown(TENSOR[:split], TENSOR[split:])
    rows = TENSOR[2:-1]
    assert lines == [*TENSOR[:2], *rows[:head],
                     f"[tfcluster] … {len(rows) - head - tail} lines of tensor values folded (the saved log has them)",
                     *rows[-tail:], TENSOR[-1]]


def test_short_runs_and_ordinary_output_pass_as_they_are():
    short = ["Traceback (most recent call last):", *FRAMES[:6], "KeyError: 'x'"]
    assert shown(short) == short
    plain = b"step=1 loss=0.5\nstep=2 loss=0.4"
    fold = Fold()
    assert fold.feed(plain) is plain and fold.flush() is None
    # a dump the output ends in: its held end comes at the task's end
    assert shown(TENSOR[:-1])[-1] == TENSOR[-2]


def test_logmux_folds_the_live_view_and_saves_every_byte(tmp_path):
    out = io.BytesIO()
    data = ("\n".join(TRACE) + "\n").encode()
    with LogMux(out, ["worker:0"], color=False, save_dir=str(tmp_path / "run"), fold=True) as mux:
        mux.feed("worker:0", data[:500])
        mux.feed("worker:0", data[500:])
        assert any("lines of traceback frames folded" in line for line in mux.tail("worker:0", 100))
    live = out.getvalue().decode().splitlines()
    assert len(live) == len(TRACE) - len(FRAMES) + sum(FOLD_KEEP["traceback"]) + 1
    assert all(line.startswith("worker:0 │ ") for line in live)
    assert (tmp_path / "run" / "worker-0.log").read_bytes() == data
    unfolded = io.BytesIO()
    with LogMux(unfolded, ["worker:0"], color=False) as mux:      # --verbose: every line
        mux.feed("worker:0", data)
    assert len(unfolded.getvalue().splitlines()) == len(TRACE)


def live_lines(r, key: str = "worker:0") -> list[str]:
    return [line.split(" │ ", 1)[1] for line in r.stdout.splitlines() if line.startswith(f"{key} │ ")]


def test_a_deep_traceback_is_folded_live_and_whole_in_the_saved_log(tmp_path, home):
    spec = known_spec(tmp_path, "long_failure.py", "mirrored", {"worker": 1}, [])
    r = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=100)
    assert r.returncode == 5, r.stderr[-2000:]
    live = live_lines(r)
    marks = [line for line in live if "lines of traceback frames folded" in line]
    assert len(marks) == 1 and "ValueError: the deep call failed" in live, r.stdout[-3000:]
    hidden = int(marks[0].split("… ")[1].split()[0])
    log = next(Path(tmp_path, "runs").glob("*/worker-0.log")).read_text()
    frames = log[log.index("Traceback"):log.index("ValueError")].splitlines()[1:]
    assert hidden == len(frames) - sum(FOLD_KEEP["traceback"]) and hidden > 100
    wait_for(lambda: not tagged_processes(), 15, what="nothing of the run left")


@pytest.mark.tf
@pytest.mark.timeout(180)
def test_tensorflows_own_tensor_print_is_folded_live(tmp_path, home):
    spec = known_spec(tmp_path, "long_failure.py", "mirrored", {"worker": 1}, ["--tensor"])
    r = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=160)
    assert r.returncode == 5, r.stderr[-2000:]
    live = live_lines(r)
    assert any("lines of tensor values folded (the saved log has them)" in line for line in live), r.stdout[-3000:]
    assert live[-1].endswith("shape=(32, 28, 28), dtype=float32)>) to a Tensor.") and len(live) < 20
    log = next(Path(tmp_path, "runs").glob("*/worker-0.log")).read_text()
    dump = log[log.index("ValueError: Attempt"):log.rindex("to a Tensor.")]
    assert dump.count("\n") > 80            # every row of the dump is saved
    wait_for(lambda: not tagged_processes(), 15, what="nothing of the run left")
