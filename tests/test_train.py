"""`tfcluster train` end to end with real TensorFlow on this machine (local transport)."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.helpers import (
    free_ports,
    kill_group,
    kill_tagged_once_seen,
    local_spec,
    losses,
    manifest,
    only_run,
    read_until,
    result_of,
    start_tfcluster,
    tagged_processes,
    tfcluster,
    wait_for,
)

pytestmark = [pytest.mark.tf, pytest.mark.timeout(300)]


@pytest.fixture
def work(tmp_path, home):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return tmp_path, home, cwd


def test_between_graph_trains_to_the_exact_final_step_with_falling_loss(work):
    tmp, home, cwd = work
    spec = local_spec(tmp, args=["--steps", "200"])
    result = tfcluster("train", str(spec), home=home, cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "\nworker:0 │ step=" in result.stdout and "\nworker:1 │ step=" in result.stdout
    run = only_run(cwd / "runs")
    chief_log = (run / "worker-0.log").read_text()
    step, final_loss = result_of(chief_log)
    assert step == 200
    trace = losses(chief_log)
    assert final_loss < trace[0] / 2
    doc = manifest(run)
    assert doc["exit_code"] == 0 and doc["tasks"]["worker:0"]["script"]["exit_code"] == 0
    assert "worker:1" in doc["tasks"] and "tfcluster-result" in result.stderr + result.stdout
    assert oct(os.stat(run / "manifest.json").st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("mode,script,jobs", [
    ("classic", "template:classic", dict(ps=1, workers=2)),
    ("coordinator", "template:coordinator", dict(ps=1, workers=2, chief=1)),
    ("mirrored", "template:mirrored", dict(ps=0, workers=2)),
])
def test_each_tf2_and_classic_mode_runs_to_success(work, mode, script, jobs):
    tmp, home, cwd = work
    args = ["--job_name={job}", "--task_index={index}", "--ps_hosts={ps_hosts}",
            "--worker_hosts={worker_hosts}", "--steps", "100"] if mode == "classic" else ["--steps", "60"]
    spec = local_spec(tmp, mode=mode, script=script, args=args, **jobs)
    if mode == "classic":
        # on IPv6's loopback: `::1:2222` is itself an address with no port, so each task's
        # address goes to TF (its ClusterSpec, the session's master, {ps_hosts}) as `[::1]:2222`;
        # unbracketed, every server came up and no session ever opened
        spec.write_text(spec.read_text().replace("address: 127.0.0.1", "address: '::1'"))
    result = tfcluster("train", str(spec), home=home, cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if mode == "classic":
        assert re.search(r"ps:0 +│ ps:0 serving on \[::1\]:\d+\n", result.stdout), result.stdout[-3000:]
    run = only_run(cwd / "runs")
    chief = "chief-0.log" if jobs.get("chief") else "worker-0.log"
    step, loss = result_of((run / chief).read_text())
    assert step >= 60 and loss == loss  # not NaN
    if mode == "classic":
        assert step == 100
        # the ps task's script serves until the run's end stops it: not a failed exit
        ps_row = next(line.split() for line in result.stderr.splitlines() if line.startswith("ps:0 "))
        assert ps_row[2] == "stopped", result.stderr[-2000:]


def test_script_that_raises_at_import_names_task_exit_code_and_log_tail(work):
    tmp, home, cwd = work
    bad = tmp / "bad.py"
    bad.write_text("import os\nraise RuntimeError('boom at import on ' + os.environ['TFCLUSTER_JOB'])\n")
    spec = local_spec(tmp, script="bad.py")
    result = tfcluster("train", str(spec), home=home, cwd=cwd)
    assert result.returncode == 5, result.stderr[-2000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("tfcluster: error:")]
    assert len(error) == 1
    assert "failed with exit code 1" in error[0] and "worker:" in error[0]
    assert "RuntimeError: boom at import on worker" in result.stderr
    assert "Traceback" not in error[0]


def test_worker_killed_mid_run_is_restarted_and_run_ends_at_exact_step(work):
    tmp, home, cwd = work
    spec = local_spec(tmp, args=["--steps", "400", "--log_every", "10"], restart="on-failure")
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    out = kill_tagged_once_seen(proc, r"worker:1 .*step=", ":worker:1:script", wait=120, finish=200)
    assert proc.returncode == 0, out[-3000:]
    assert "restarting (1/3)" in out
    run = only_run(cwd / "runs")
    assert manifest(run)["tasks"]["worker:1"]["script"]["restarts"] == 1
    assert result_of((run / "worker-0.log").read_text())[0] == 400


def test_ctrl_c_stops_everything_and_exits_130(work):
    tmp, home, cwd = work
    spec = local_spec(tmp, args=["--steps", "100000", "--log_every", "20", "--min_step_time", "0.05"])
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:0 .*step=", timeout=120)
        assert len(tagged_processes()) >= 5  # 3 servers + 2 scripts
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 130, out[-2000:]
        wait_for(lambda: not tagged_processes(), timeout=10 - (time.monotonic() - t0) + 15,
                 what="every task gone after Ctrl-C")
    finally:
        kill_group(proc)


def test_timeout_ends_the_run_cleanly_with_exit_6(work):
    tmp, home, cwd = work
    # trains until stopped: at a real model's pace, not the CPU's (the suite's other tests share it)
    spec = local_spec(tmp, args=["--steps", "100000", "--min_step_time", "0.05"])
    result = tfcluster("train", str(spec), "--timeout", "25", home=home, cwd=cwd)
    assert result.returncode == 6, result.stderr[-2000:]
    assert "timeout" in result.stderr


def test_two_runs_on_one_up_cluster_are_isolated_and_servers_stay_up(work):
    tmp, home, cwd = work
    spec = local_spec(tmp, args=["--steps", "120", "--log_every", "10"])
    up = tfcluster("up", str(spec), home=home, cwd=cwd)
    assert up.returncode == 0, up.stderr
    try:
        for n in (1, 2):
            result = tfcluster("train", str(spec), home=home, cwd=cwd)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            assert "Using the running cluster" in result.stderr
        runs = sorted(d for d in (cwd / "runs").iterdir())
        assert len(runs) == 2
        for run in runs:
            log = (run / "worker-0.log").read_text()
            assert result_of(log)[0] == 120
            first_step = int(log.split("step=")[1].split()[0])
            assert first_step <= 40, f"run started from step {first_step}: state leaked between runs"
        status = tfcluster("status", str(spec), "--json", home=home, cwd=cwd)
        assert status.stdout.count('"running"') == 3
    finally:
        down = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert down.returncode == 0, down.stderr


def test_ps_killed_mid_run_is_restarted_and_training_resumes_from_checkpoint(work):
    tmp, home, cwd = work
    spec = local_spec(tmp, args=["--steps", "600", "--log_every", "20", "--model_dir", "{workdir}/ckpt"],
                      restart="on-failure")
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    out = kill_tagged_once_seen(proc, r"worker:0 .*step=(1[0-9]{2}|[2-9][0-9]{2})", ":ps:0:server",
                                wait=150, finish=240)
    assert proc.returncode == 0, out[-4000:]
    assert "ps:0 server on local exited with code 137; restarting (1/3)" in out
    run = only_run(cwd / "runs")
    assert manifest(run)["tasks"]["ps:0"]["server"]["restarts"] == 1
    chief = (run / "worker-0.log").read_text()
    assert result_of(chief)[0] == 600
    steps = [int(s.split()[0]) for s in chief.split("step=")[1:]]
    assert steps[0] < 100 < max(steps)


# Each script says it waits, then waits for the file in argv[1]; worker:1's first attempt exits 3.
WAITS = """
import os, sys, time
if os.environ["TFCLUSTER_TASK_INDEX"] == "1" and os.environ["TFCLUSTER_RESTART"] == "0":
    sys.exit(3)
print("waiting", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
print("step=1 loss=0.5", flush=True)
"""
ROW = re.compile(r"^(\S+) +local +(\S+) +(\d+) +[\d.]+s", re.M)     # task, exit, restarts


def server_pid(task: str) -> int | None:
    pids = [p for p, tag in tagged_processes().items() if tag.endswith(f":{task}:server")]
    return pids[0] if len(pids) == 1 else None


def test_summary_and_manifest_show_restarted_servers_and_scripts_counted_from_their_first_start(work):
    tmp, home, cwd = work
    (tmp / "waits.py").write_text(WAITS)
    go = tmp / "go"
    spec = local_spec(tmp, script=str(tmp / "waits.py"), args=[str(go)], restart="on-failure")
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        lines = read_until(proc, r"worker:1 +│ waiting", timeout=120)       # its restart runs
        killed_at = time.time()
        for task, after in (("ps:0", r"ps:0 +│ tfcluster: server ps:0 listening"),
                            ("worker:1", r"worker:1 server on local exited with code 137; restarting")):
            old = server_pid(task)
            os.kill(old, signal.SIGKILL)
            lines += read_until(proc, after, timeout=60)
            wait_for(lambda: server_pid(task) not in (None, old), 60, what=f"{task}'s server restarted")
        go.touch()
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    text = "".join(lines) + out
    assert proc.returncode == 0, text[-4000:]
    rows = {m[1]: (m[2], int(m[3])) for m in ROW.finditer(text)}
    # worker:0's server only served: no row
    assert {k: r[1] for k, r in rows.items()} == {"worker:0": 0, "worker:1": 1, "ps:0": 1, "worker:1.server": 1}
    assert rows["worker:1"][0] == "0"
    run = only_run(cwd / "runs")
    tasks = manifest(run)["tasks"]
    for task, role in (("ps:0", "server"), ("worker:1", "server"), ("worker:1", "script")):
        entry = tasks[task][role]
        assert entry["restarts"] == 1 and entry["started"] < entry["last_restart"] <= entry["ended"], entry
    assert tasks["ps:0"]["server"]["started"] < killed_at < tasks["ps:0"]["server"]["last_restart"]
    assert tasks["worker:0"]["script"]["last_restart"] is None
    runs = json.loads(tfcluster("runs", str(spec), "--json", home=home, cwd=cwd).stdout)["runs"]
    assert runs[0]["restarts"] == sum(r[1] for r in rows.values()) == 3


def test_sigkill_of_tfcluster_mid_run_takes_every_task_down(work):
    tmp, home, cwd = work
    spec = local_spec(tmp, args=["--steps", "100000", "--log_every", "20", "--min_step_time", "0.05"])
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:1 .*step=", timeout=120)
        assert len(tagged_processes()) >= 5
        proc.kill()  # the launcher only: its shims must notice and clean up on their own
        proc.wait(10)
        wait_for(lambda: not tagged_processes(), timeout=20, what="tasks gone after the launcher died")
    finally:
        kill_group(proc)


def test_old_style_script_in_between_graph_mode_gets_a_hint_to_use_classic(work):
    tmp, home, cwd = work
    script = tmp / "oldstyle.py"
    # What TF's old mnist_replica.py does first: build its own server on its task's port.
    script.write_text(
        "import json, os, tensorflow as tf\n"
        "c = json.loads(os.environ['TF_CONFIG'])\n"
        "tf.compat.v1.train.Server(tf.train.ClusterSpec(c['cluster']), job_name=c['task']['type'],\n"
        "                          task_index=c['task']['index'])\n")
    spec = local_spec(tmp, script=str(script))
    result = tfcluster("train", str(spec), home=home, cwd=cwd)
    assert result.returncode == 5, result.stderr[-2000:]
    assert "needs `train.mode: classic`" in result.stderr


def test_sigterm_stops_the_run_in_order_writes_the_manifest_and_exits_143(work):
    tmp, home, cwd = work
    spec = local_spec(tmp, args=["--steps", "100000", "--log_every", "20", "--min_step_time", "0.05"])
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:0 .*step=", timeout=120)
        proc.terminate()  # what `timeout`, a scheduler or systemd sends
        out, _ = proc.communicate(timeout=40)
    finally:
        kill_group(proc)
    assert proc.returncode == 143, out[-2000:]
    assert "terminated (SIGTERM)" in out
    doc = manifest(only_run(cwd / "runs"))
    assert doc["outcome"] == "terminated" and doc["exit_code"] == 143
    wait_for(lambda: not tagged_processes(), timeout=15, what="every task gone after SIGTERM")


# The chief ends at once (its last checkpoint written); the evaluator, as SidecarEvaluator with
# max_evaluations does, evaluates that checkpoint after it, then ends.
EVALUATES_LAST = """\
import os, pathlib, sys, time
if os.environ["TFCLUSTER_JOB"] == "chief":
    pathlib.Path("ckpt-final").write_text("3")
    print("chief: saved ckpt-final", flush=True)
    sys.exit(0)
deadline = time.monotonic() + 60
while not pathlib.Path("ckpt-final").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
time.sleep(2)                                   # the evaluation itself
print("evaluator: evaluated ckpt-final", flush=True)
"""


def test_an_evaluator_evaluates_the_chiefs_last_checkpoint_before_the_run_ends(tmp_path, home):
    """Coordinator mode with TensorFlow's SidecarEvaluator pattern: the evaluator is not stopped
    the moment the chief succeeds; it has the peers' grace to evaluate the last checkpoint."""
    (tmp_path / "train.py").write_text(EVALUATES_LAST)
    ports = free_ports(4)
    spec = tmp_path / "ev.yaml"
    spec.write_text("name: ev\nhosts:\n  - {name: local, address: 127.0.0.1}\njobs:\n"
                    f"  chief: {{tasks: ['local:{ports[0]}']}}\n  ps: {{tasks: ['local:{ports[1]}']}}\n"
                    f"  worker: {{tasks: ['local:{ports[2]}']}}\n  evaluator: {{tasks: ['local:{ports[3]}']}}\n"
                    "train:\n  mode: coordinator\n  script: train.py\n")
    r = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "evaluator:0 │ evaluator: evaluated ckpt-final" in r.stdout, r.stdout[-2000:]
    assert re.search(r"^\s*evaluator:0\s+local\s+0\s", r.stderr + r.stdout, re.M), r.stderr[-2000:]
    assert "stragglers" not in r.stderr + r.stdout
