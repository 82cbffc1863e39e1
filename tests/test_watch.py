"""Watching runs: step/loss parsing, `runs`, `plot`, `logs -f`, `status --watch`,
the summary's step and steps/s, and which failures get the restart hint.

The end-to-end runs use mirrored mode with a script that prints `step=N loss=X` lines
and imports no TensorFlow: each train takes a few seconds."""
from __future__ import annotations

import json
import re
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import cli_env, kill_group, local_spec, plot_python, read_until, start_tfcluster, tfcluster, wait_for
from tfcluster.watch import metrics
from tfcluster.watch.plotting import rates, run_series, sparkline, text_plot
from tfcluster.watch.runs import read_manifest

pytestmark = pytest.mark.timeout(240)

STEPS = textwrap.dedent("""\
    import argparse, os, sys, time
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--fail_at", type=int, default=0)
    p.add_argument("--go", default="")
    a = p.parse_args()
    idx = int(os.environ["TFCLUSTER_TASK_INDEX"])
    loss = 2.0
    for step in range(1, a.steps + 1):
        if a.go and step == a.steps // 2 + 1:
            print(f"worker {idx} waits for the go file", flush=True)
            while not os.path.exists(a.go):
                time.sleep(0.05)
        loss *= 0.9
        print(f"worker {idx} step={step} loss={loss:.6f}", flush=True)
        if a.fail_at == step and idx == 1:
            sys.exit(3)
        time.sleep(0.04)
    print(f"tfcluster-result: global_step={a.steps} loss={loss:.6f}", flush=True)
""")
LINE = re.compile(r"step=(\d+) loss=([0-9.]+)")


def spec_for(tmp: Path, script: str = "steps.py", body: str = STEPS, **kw) -> Path:
    (tmp / script).write_text(body)
    return local_spec(tmp, mode="mirrored", script=script, ps=0, workers=2, name="w", **kw)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A run that succeeds and one whose worker:1 fails twice (one restart), in one runs/."""
    tmp = tmp_path_factory.mktemp("runs")
    home, cwd = tmp / "home", tmp / "cwd"
    home.mkdir()
    cwd.mkdir()
    spec = spec_for(tmp, args=["--steps", "30"], restart="on-failure",
                    extra="")
    spec.write_text(spec.read_text().replace("max_restarts: 3", "max_restarts: 1"))
    ok = tfcluster("train", str(spec), home=home, cwd=cwd)
    bad = tfcluster("train", str(spec), "--", "--steps", "30", "--fail_at", "12", home=home, cwd=cwd)
    return tmp, home, cwd, spec, ok, bad


# -- metrics.py ------------------------------------------------------------------------

def test_metrics_reads_the_templates_lines_and_the_target_from_the_arguments():
    t = metrics.Tracker()
    # the prefilter: one `in` each for any other line (the last: a restart's note, metrics.RESTART_NOTE)
    assert t.markers == (b"tep", b"oss", b"Epoch ", b"; restarting (", b"tfcluster-keras: ")
    assert t.parse(b"step=120 loss=0.250000") == (120, 0.25)
    assert t.parse(b"tfcluster-result: global_step=300 loss=0.012000") == (300, 0.012)
    assert t.parse(b"Step: 7, Loss: 1e-3") == (7, 0.001)
    assert t.parse(b"last_step=300 val_loss=2 steps=4") == (None, None)   # not this run's step/loss
    for other in (b"Test loss: 2.3052", b"test loss=0.5", b"Validation loss: 1.5", b"eval loss: 3"):
        assert t.parse(other) == (None, None), other        # an evaluation's, not training's
    assert t.parse(b"epoch 2, train loss: 0.75") == (None, 0.75)
    assert metrics.target_of(None, ["--steps", "500"]) == 500
    assert metrics.target_of(None, ["--max_steps=80", "--steps", "x"]) == 80
    assert metrics.target_of(None, ["--lr", "3"]) is None


def test_tracker_keeps_the_latest_step_loss_and_rate_per_task():
    t = metrics.Tracker(targets={"worker:0": 100})
    for i, now in enumerate((10.0, 11.0, 12.0, 14.0)):
        assert t.feed("worker:0", f"step={i * 10} loss={1 / (i + 1)}".encode(), now)
    assert not t.feed("worker:0", b"nothing here", 15.0)
    s = t.state("worker:0")
    assert (s.step, s.loss, s.target) == (30, 0.25, 100)
    assert s.steps_per_s == pytest.approx(30 / 4)
    assert s.recent_rate(window=2.5) == pytest.approx(10 / 2)
    assert t.state("worker:1") is None


def test_step_lines_that_came_in_one_burst_give_no_rate_not_a_huge_one():
    """A fast GPU's three short epochs, read in one chunk: 16 steps 0.2 ms apart are no rate."""
    t = metrics.Tracker()
    for step, now in ((8, 100.0), (16, 100.0001), (24, 100.0002)):
        t.feed("worker:0", f"step={step} loss=1".encode(), now)
    assert t.state("worker:0").steps_per_s is None
    t.feed("worker:0", b"step=40 loss=1", 100.5)        # then a line half a second later: a rate
    assert t.state("worker:0").steps_per_s == pytest.approx(32 / 0.5)


def test_custom_patterns_and_their_prefilter():
    class P:
        step, loss, target = r"iter (\d+)", r"xent=([0-9.]+)", 9
    t = metrics.Tracker(P())
    assert t.markers == (b"iter ", b"xent=", b"Epoch ", b"; restarting (", b"tfcluster-keras: ", b"/step", b"ETA: ")  # Keras' bars need their own
    assert t.parse(b"iter 5 xent=0.5 step=99") == (5, 0.5)
    assert metrics.target_of(P(), ["--steps", "1"]) == 9


def test_a_custom_patterns_group_that_takes_the_sentences_stop_along_keeps_both_numbers():
    """The custom-loop tutorial's `Epoch: 2, accuracy: 0.1, train_loss: 2.304688.`: the loss
    group takes the full stop; a group that is no number at all loses that value, not the other."""
    class P:
        step, loss, target = r"Epoch: (\d+),", r"train_loss: ([0-9.]+)", 2
    t = metrics.Tracker(P())
    said = t.feed("w", b"Epoch: 2, accuracy: 0.1, train_loss: 2.304688.")
    assert (said.step, said.loss) == (2, 2.304688) and t.state("w").step == 2

    class Q:
        step, loss, target = r"Epoch: (\d+),", r"train_loss: (\S+)", 2
    assert metrics.Tracker(Q()).parse(b"Epoch: 3, train_loss: n/a") == (3, None)


def test_rates_span_a_second_and_restart_after_a_step_goes_back():
    samples = [(0.0, 0), (0.5, 10), (1.0, 20), (2.0, 40), (3.0, 5), (4.0, 25), (20.0, 345)]
    assert rates(samples, span=1.0) == [(20, 20.0), (40, 20.0), (25, 20.0), (345, 20.0)]
    short = [(0.0, 0), (0.25, 10), (0.5, 20)]     # shorter than the span: a tenth of it
    assert rates(short, span=1.0) == [(10, 40.0), (20, 40.0)]
    assert sparkline([(0, 1.0), (9, 2.0)], 0, 9, 4) == "▁▁▁█"


# -- the spec --------------------------------------------------------------------------

@pytest.mark.parametrize("progress,where,problem", [
    ("{step: 'iter ('}", "train.progress.step", "invalid regular expression"),
    ("{loss: 'loss=[0-9.]+'}", "train.progress.loss", "has 0 capturing groups"),
    ("{loss: '(a)(b)'}", "train.progress.loss", "has 2 capturing groups"),
    ("{step: '(s)(\\d+)'}", "train.progress.step", "'(s)(\\d+)' has 2 capturing groups"),   # as written
    ("{target: lots}", "train.progress.target", "must be a decimal integer"),
    ("{stepp: 'x(1)'}", "train.progress.stepp", "did you mean 'step'"),
])
def test_bad_train_progress_is_one_line_naming_file_line_and_field(tmp_path, progress, where, problem):
    spec = spec_for(tmp_path, extra=f"  progress: {progress}\n")
    result = subprocess.run([sys.executable, "-m", "tfcluster", "plan", str(spec)], capture_output=True,
                            text=True, env=cli_env(tmp_path))
    assert result.returncode == 2
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"tfcluster: error: {spec}:10: {where}: ") and problem in first, result.stderr
    assert "Traceback" not in result.stderr


def test_train_progress_is_carried_into_the_plan(tmp_path):
    spec = spec_for(tmp_path, extra="  progress: {step: 'iter (\\d+)', target: 40}\n")
    result = subprocess.run([sys.executable, "-m", "tfcluster", "plan", str(spec), "--json"],
                            capture_output=True, text=True, env=cli_env(tmp_path))
    assert json.loads(result.stdout)["progress"] == {"step": r"iter (\d+)", "loss": None, "target": 40}


# -- runs, the summary, plot ------------------------------------------------------------

def printed(log: str) -> list[tuple[int, float]]:
    return [(int(s), float(x)) for s, x in LINE.findall(log)]


def test_runs_lists_a_succeeding_and_a_failing_run_with_restarts_final_step_and_loss(two_runs):
    tmp, home, cwd, spec, ok, bad = two_runs
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert bad.returncode == 5, bad.stderr[-2000:]
    result = tfcluster("runs", str(spec), "--json", home=home, cwd=cwd)
    doc = json.loads(result.stdout)
    first, second = doc["runs"]
    assert doc["order"] == "oldest first" and first["run"] < second["run"]
    assert (first["outcome"], first["exit_code"], first["restarts"]) == ("succeeded", 0, 0)
    assert (second["outcome"], second["exit_code"], second["restarts"]) == ("failed", 5, 1)
    assert "worker:1 on local failed with exit code 3" in second["message"]
    for row in (first, second):   # the chief's last step and loss, as its log says
        log = (cwd / "runs" / row["run"] / "worker-0.log").read_text()
        assert (row["task"], row["step"], row["loss"]) == ("worker:0", *printed(log)[-1])
    assert first["step"] == 30 and first["duration"] > 0
    table = tfcluster("runs", str(spec), home=home, cwd=cwd).stdout
    assert "succeeded" in table and "failed (exit 5)" in table and table.index(first["run"]) < table.index(second["run"])


def test_summary_has_each_workers_final_step_and_steps_per_second(two_runs):
    _tmp, _home, cwd, _spec, ok, _bad = two_runs
    rows = [line for line in ok.stderr.splitlines() if re.match(r"worker:[01]  ", line)]   # plain columns: piped
    assert len(rows) == 2, ok.stderr[-3000:]
    assert "step" in ok.stderr and "steps/s" in ok.stderr
    for row in rows:
        cells = re.split(r"\s{2,}", row.strip())
        assert cells[5] == "30" and 2 < float(cells[6]) < 100, row   # 30 steps in about 1.5 s
    run = sorted((cwd / "runs").iterdir())[0]
    recorded = read_manifest(str(run))["progress"]["worker:1"]
    assert recorded["step"] == 30 and recorded["target"] == 30 and recorded["steps_per_s"] > 2


def test_plot_png_and_terminal_come_from_the_saved_logs(two_runs):
    _tmp, home, cwd, spec, _ok, _bad = two_runs
    run = sorted((cwd / "runs").iterdir())[0]
    series = run_series(str(run), read_manifest(str(run)))
    for key in ("worker:0", "worker:1"):
        assert series[key].loss == printed((run / f"{key.replace(':', '-')}.log").read_text())
        assert series[key].rate and all(2 < r < 100 for _, r in series[key].rate)
        assert series[key].rate_source == "arrival times"
    png = cwd / "x.png"
    result = tfcluster("plot", str(spec), "--run", run.name, "-o", str(png), home=home, cwd=cwd,
                       python=plot_python())
    assert result.returncode == 0, result.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (900, 600) and len(data) > 10_000
    text = tfcluster("plot", str(spec), "--run", run.name, home=home, cwd=cwd).stdout
    assert text.count("steps 1–30") == 2 and "loss" in text and "steps/s" in text
    assert "1.8 " in text and "0.08478" in text        # first and last loss of the script
    assert text_plot("r", series)[1] == "worker:0  steps 1–30"


def test_plot_without_matplotlib_is_one_line_with_the_pip_command(two_runs, tmp_path):
    _tmp, home, cwd, spec, _ok, _bad = two_runs
    code = ("import sys; sys.modules['matplotlib'] = None; from tfcluster.cli import main; "
            f"sys.exit(main(['plot', {str(spec)!r}, '-o', {str(tmp_path / 'y.png')!r}]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                            env=cli_env(home))
    assert result.returncode == 2
    assert result.stderr.startswith("tfcluster: error: plot -o needs matplotlib")
    assert "pip install 'tfcluster[plot]'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "y.png").exists()


# -- logs -f ---------------------------------------------------------------------------

def test_logs_follow_prints_a_live_run_as_it_goes_and_ends_with_it(tmp_path, home):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    go = tmp_path / "go"
    spec = spec_for(tmp_path, args=["--steps", "20", "--go", str(go)])
    train = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    follower = stopped = None
    try:
        def waiting():
            logs = list((cwd / "runs").glob("*/worker-*.log"))
            return len(logs) == 2 and all("waits for the go file" in p.read_text() for p in logs)
        wait_for(waiting, timeout=120, what="both workers waiting for the go file")
        follower = start_tfcluster("logs", str(spec), "-f", home=home, cwd=cwd)
        stopped = start_tfcluster("logs", str(spec), "--follow", "--task", "worker:1", home=home, cwd=cwd)
        before = read_until(follower, r"worker:1 +│ worker 1 waits for the go file", timeout=60)
        assert any("is running: following its logs" in line for line in before)
        one = read_until(stopped, r"worker:1 +│ worker 1 waits", timeout=60)
        stopped.send_signal(signal.SIGINT)                 # Ctrl-C: quietly, 130
        rest, _ = stopped.communicate(timeout=30)
        assert "worker:1 │ worker 1 step=1 " in "".join(one) and "worker:0" not in "".join(one) + rest
        assert stopped.returncode == 130 and "Traceback" not in rest and "error" not in rest, rest
        assert follower.poll() is None                     # the run goes on: so does -f
        go.write_text("go")
        out, _ = follower.communicate(timeout=120)
        assert follower.returncode == 0, out[-2000:]
        assert train.wait(120) == 0
        text = "".join(before) + out
        for idx in (0, 1):
            steps = [int(s) for s in re.findall(rf"worker:{idx} +│ worker {idx} step=(\d+)", text)]
            assert steps == list(range(1, 21)), text[-3000:]
            assert re.search(rf"worker:{idx} +│ tfcluster-result: global_step=20 ", text)
        assert out.rstrip().endswith("succeeded")
    finally:
        for proc in (follower, stopped, train):
            if proc is not None:
                kill_group(proc)


# -- status --watch --------------------------------------------------------------------

def test_status_watch_on_a_pipe_prints_refreshes_until_ctrl_c(tmp_path, home):
    spec = spec_for(tmp_path)
    proc = start_tfcluster("status", str(spec), "--watch", "--interval", "0.2", home=home, cwd=tmp_path)
    try:
        seen = read_until(proc, r"0/2 tasks running", timeout=60)
        seen += read_until(proc, r"0/2 tasks running", timeout=60)
        assert sum("cluster 'w'" in line for line in seen) == 2
        assert sum("every 0.2s, Ctrl-C to stop" in line for line in seen) == 2
        assert "" in [line.strip() for line in seen]        # a blank line between refreshes
        assert sum("worker:1" in line and "stopped" in line for line in seen) == 2
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
        assert proc.returncode == 130 and "Traceback" not in rest, rest
    finally:
        kill_group(proc)


# -- the restart hint ------------------------------------------------------------------

@pytest.mark.parametrize("body,code,hint", [
    ("def broken(:\n    pass\n", 1, False),                               # SyntaxError
    ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", 137, True),  # the OOM killer's way
])
def test_only_a_failure_a_restart_could_fix_gets_the_restart_hint(tmp_path, home, body, code, hint):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = spec_for(tmp_path, script="die.py", body=body)
    result = tfcluster("train", str(spec), home=home, cwd=cwd)
    assert result.returncode == 5, result.stderr[-2000:]
    assert f"failed with exit code {code}" in result.stderr
    assert ("train.restart" in result.stderr) is hint, result.stderr[-1500:]


def test_progress_log_records_each_step_line_from_many_threads_and_hands_out_copies(tmp_path):
    import threading

    from tfcluster.plan import build_plan
    from tfcluster.spec import load_spec
    from tfcluster.watch.runs import ProgressLog, read_progress

    plan = build_plan(load_spec(str(spec_for(tmp_path, args=["--steps", "400"]))))
    log = ProgressLog(plan, str(tmp_path))
    mux_key_lines = {key: [f"step={i} loss={1 / i:.4f}".encode() for i in range(1, 201)] + [b"no numbers"]
                     for key in ("worker:0", "worker:1")}
    threads = [threading.Thread(target=lambda k=k: [log.on_line(k, line) for line in mux_key_lines[k]])
               for k in mux_key_lines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.on_line("worker:0.server", b"step=999 loss=1")        # a server's lines are not a script's
    states = log.states()
    log.close()
    recorded = read_progress(str(tmp_path))
    assert sorted(recorded) == ["worker:0", "worker:1"]
    assert [s for _, s in recorded["worker:1"]] == list(range(1, 201))
    assert (states["worker:0"].step, states["worker:0"].loss, states["worker:0"].target) == (200, 0.005, 400)
    assert log.summary()["worker:1"]["step"] == 200
    states["worker:0"].step = -1                                # a copy: the log keeps its own
    assert log.tracker.state("worker:0").step == 200


@pytest.mark.parametrize("mode,keras,workers,why", [("mirrored", "legacy", 2, True), ("mirrored", "legacy", 1, False),
                                                   ("mirrored", "auto", 2, False), ("keras-jax", "auto", 2, False)])
def test_the_keras_loss_note_gives_tf_keras_mwms_sum_as_its_why_only_where_tf_keras_runs_it(tmp_path, mode, keras,
                                                                                           workers, why):
    """tf_keras under MultiWorkerMirroredStrategy (mode mirrored, two workers or more) sums the
    bars' loss over the workers; Keras 3 and one worker do not."""
    from tfcluster.plan import build_plan
    from tfcluster.spec import load_spec
    from tfcluster.watch.runs import ProgressLog

    (tmp_path / "steps.py").write_text(STEPS)
    spec = local_spec(tmp_path, mode=mode, script="steps.py", ps=0, workers=workers, name="w",
                      extra=f"  keras: {keras}\n")
    log = ProgressLog(build_plan(load_spec(str(spec))), str(tmp_path))
    assert log.loss_note() is None                              # no Keras epoch seen yet
    log.on_line("worker:0", b"Epoch 1/3")
    log.on_line("worker:0", b"8/8 - 1s - 112ms/step - loss: 10.3172")
    log.close()
    note = log.loss_note()
    assert note.startswith(metrics.KERAS_LOSS_NOTE)
    assert ("MultiWorkerMirroredStrategy" in note) is why, note


def test_runs_lists_old_manifests_and_calls_a_run_whose_tfcluster_is_gone_died(tmp_path):
    from tfcluster.watch.follow import run_rows

    plan = {"tasks": [{"task": "worker:0", "chief": True, "script": ["python3", "t.py"]}]}
    manifests = {   # as older tfclusters wrote them: no pid, no progress
        "lab-20260101-000000-aaaa": {"outcome": "succeeded", "exit_code": 0, "started": 10.0, "ended": 70.0,
                                     "mode": "mirrored", "plan": plan,
                                     "tasks": {"worker:0": {"script": {"restarts": 2}}}},
        "lab-20260101-000100-bbbb": {"outcome": "running", "started": 100.0, "plan": plan},
        "lab-20260101-000200-cccc": {"outcome": "running", "started": 200.0, "plan": plan,
                                     "pid": 2 ** 22 + 1, "pid_start": 1},   # no such process
    }
    for run_id, doc in manifests.items():
        (tmp_path / run_id).mkdir()
        (tmp_path / run_id / "manifest.json").write_text(json.dumps(doc))
        (tmp_path / run_id / "worker-0.log").write_text("step=5 loss=0.5\nstep=9 loss=0.25\n")
    (tmp_path / "lab-x-20260101-000000-dddd").mkdir()         # another cluster's run
    rows = run_rows(str(tmp_path), "lab")
    assert [r["run"] for r in rows] == list(manifests)
    assert [(r["outcome"], r["restarts"], r["step"], r["loss"]) for r in rows] == [
        ("succeeded", 2, 9, 0.25), ("running?", 0, 9, 0.25), ("died", 0, 9, 0.25)]
    assert rows[0]["duration"] == 60.0 and rows[2]["duration"] is None
    assert rows[0]["message"] == "succeeded" and "without writing the outcome" in rows[2]["message"]
