"""Issue 9's diagnoses: the placement-consistency check and the hang watchdog.

Unit tests of the pure parts (placement.py, watchdog.py), the start-up probe run in a
real interpreter, and end-to-end runs that produce each failure for real with scripts
written the way users write them (tests/scripts/)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import (
    kill_group,
    local_spec,
    manifest,
    only_run,
    read_until,
    start_tfcluster,
    tagged_processes,
    tfcluster,
    wait_for,
)
from tfcluster.diagnose import placement as pl
from tfcluster.diagnose import watchdog as wd
from tfcluster.host import HOST_DIR

SCRIPTS = Path(__file__).parent / "scripts"
ALLOW_SCRIPTS = f"  allow_outside: [{SCRIPTS}]\n"   # the specs live in tmp, the scripts here
PROBE_DIR = Path(HOST_DIR) / "probe"


@pytest.fixture
def work(tmp_path, home):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return tmp_path, home, cwd


# -- placement: pure -----------------------------------------------------------------------

def report(task: str, *rows) -> bytes:
    import json
    return b"tfcluster-placement: " + json.dumps({"task": task, "vars": [list(r) for r in rows]}).encode()


def test_devices_normalise_to_job_and_task_and_own_task_is_this_task():
    assert pl.normalise("/job:ps/replica:0/task:1/device:CPU:0", "worker:0") == "/job:ps/task:1"
    assert pl.normalise("/job:ps/task:1", "worker:0") == "/job:ps/task:1"
    assert pl.normalise("/job:worker/task:1", "worker:1") == "this task"
    assert pl.normalise("/job:worker/task:1", "worker:0") == "/job:worker/task:1"
    assert pl.normalise("", "worker:0") == pl.normalise("/device:GPU:0", "worker:0") == "this task"


def test_first_differing_variable_in_creation_order_names_both_tasks_and_devices():
    check = pl.PlacementCheck(["worker:0", "worker:1", "worker:2"])
    a = pl.parse(report("worker:0", ["step:0", "/job:ps/task:0", [], "int64"],
                        ["b:0", "/job:ps/task:1", [4], "float32"], ["a:0", "/job:ps/task:0", [4], "float32"]))
    b = pl.parse(report("worker:1", ["step:0", "/job:ps/task:0", [], "int64"],
                        ["a:0", "/job:ps/task:1", [4], "float32"], ["b:0", "/job:ps/task:0", [4], "float32"]))
    assert check.add(b) is None                      # alone: nothing to compare
    found = check.add(a)
    assert found == pl.Mismatch("b:0", "device", "worker:0", "/job:ps/task:1", "worker:1", "/job:ps/task:0")
    assert found.message() == ("placement mismatch: variable 'b:0' has device /job:ps/task:1 in worker:0 "
                               "but /job:ps/task:0 in worker:1")
    assert check.summary() == found.message()


def test_local_variables_on_each_workers_own_task_are_consistent_and_shape_differences_are_not():
    check = pl.PlacementCheck(["worker:0", "worker:1"])
    assert check.add(pl.parse(report("worker:0", ["local:0", "/job:worker/task:0", [2], "float32"]))) is None
    assert check.add(pl.parse(report("worker:1", ["local:0", "/job:worker/task:1", [2], "float32"]))) is None
    assert check.summary() == "consistent across 2 tasks (1 variables)"
    shaped = pl.PlacementCheck(["worker:0", "worker:1"])
    shaped.add(pl.parse(report("worker:0", ["w:0", "/job:ps/task:0", [2], "float32"])))
    found = shaped.add(pl.parse(report("worker:1", ["w:0", "/job:ps/task:0", [3], "float32"])))
    assert (found.what, found.value_a, found.value_b) == ("shape", "[2]", "[3]")


def test_reports_from_unknown_tasks_and_garbage_lines_are_ignored():
    check = pl.PlacementCheck(["worker:0"])
    assert pl.parse(b"tfcluster-placement: {not json") is None
    assert pl.parse(b"step=1 loss=2") is None
    assert check.add(pl.parse(report("ps:0", ["w:0", "/job:ps/task:0", [], "float32"]))) is None
    assert check.summary().startswith("no task reported")


# -- watchdog: pure ------------------------------------------------------------------------

SESSION_LINE = (b"I0000 00:00:1795407056.226120   11206 master.cc:278] CreateSession still waiting "
                b"for response from worker: /job:worker/replica:0/task:1")


def test_a_createsession_wait_is_due_once_it_has_lasted_hang_after_and_repeats_at_a_bounded_rate():
    dog = wd.Watchdog(hang_after=20)
    dog.saw("worker:0", SESSION_LINE, now=100.0)      # TF says so 10 s into the wait
    assert dog.due(105.0, {"worker:0"}) == []
    dog.saw("worker:0", SESSION_LINE, now=110.0)
    [wait] = dog.due(110.0, {"worker:0"})
    assert (wait.waiter, wait.kind, wait.target, wait.start) == ("worker:0", "session", "worker:1", 90.0)
    dog.saw("worker:0", SESSION_LINE, now=120.0)
    assert dog.due(120.0, {"worker:0"}) == []          # said 10 s ago: not again yet
    for t in range(130, 180, 10):
        dog.saw("worker:0", SESSION_LINE, now=float(t))
    assert dog.due(171.0, {"worker:0"}) != []          # repeat = max(60, 3 x hang_after)


def test_a_wait_that_stopped_or_whose_waiter_ended_is_dropped_and_the_server_log_counts_as_its_task():
    dog = wd.Watchdog(hang_after=20)
    dog.saw("worker:0.server", SESSION_LINE, now=100.0)
    assert dog.due(140.0, {"worker:0"}) == []           # no message for 40 s: the wait ended
    dog.saw("worker:0.server", SESSION_LINE, now=200.0)
    dog.saw("worker:0.server", SESSION_LINE, now=210.0)
    assert dog.due(211.0, set()) == []                  # worker:0 no longer runs


def test_not_ready_waits_are_on_the_chief_and_connection_failures_map_addresses_to_tasks():
    dog = wd.Watchdog(hang_after=20, targets={"127.0.0.1:2222": "ps:0"}, chief="worker:0")
    dog.saw("worker:1", b"tfcluster-not-ready: Variables not initialized: w, b", now=0.0)
    dog.saw("worker:1", b"tfcluster-not-ready: Variables not initialized: w, b", now=21.0)
    [wait] = dog.due(21.0, {"worker:1"})
    assert (wait.kind, wait.target, wait.detail) == ("not-ready", "worker:0", "w, b")
    dog.saw("worker:0", b"UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: "
                        b"ipv4:127.0.0.1:2222: Failed to connect to remote host: Connection refused", now=30.0)
    dog.saw("worker:0", b"ipv4:127.0.0.1:2222: Failed to connect to remote host: Connection refused", now=51.0)
    [wait] = dog.due(51.0, {"worker:0", "worker:1"})
    assert (wait.kind, wait.target, wait.detail) == ("unavailable", "ps:0", "127.0.0.1:2222")


def test_silence_is_reported_only_past_the_repeat_interval_and_not_while_a_known_wait_explains_it():
    dog = wd.Watchdog(hang_after=20)
    dog.silent("worker:1", since=0.0, now=59.0)
    assert dog.due(59.0, {"worker:1"}) == []
    dog.silent("worker:1", since=0.0, now=61.0)
    [wait] = dog.due(61.0, {"worker:1"})
    assert wait.kind == "silent"
    quiet = wd.Watchdog(hang_after=20)
    quiet.silent("worker:0", since=0.0, now=100.0)
    quiet.saw("worker:0", SESSION_LINE, now=90.0)
    quiet.saw("worker:0", SESSION_LINE, now=100.0)
    assert [w.kind for w in quiet.due(100.0, {"worker:0"})] == ["session"]


def test_a_script_that_prints_once_a_long_epoch_is_silent_by_habit_until_twice_its_longest_gap():
    """Keras' verbose=2 line once a 65 s epoch: the first silence of 60 s is said (nothing is
    known of its habit yet); after it printed at 65 s, the next is said only past 130 s."""
    dog = wd.Watchdog(hang_after=20)
    dog.silent("worker:0", since=0.0, now=61.0)
    assert [w.kind for w in dog.due(61.0, {"worker:0"})] == ["silent"]
    dog.silent("worker:0", since=65.0, now=66.0)          # it printed at 65 s
    dog.silent("worker:0", since=65.0, now=65.0 + 129.0)
    assert dog.due(65.0 + 129.0, {"worker:0"}) == []
    dog.silent("worker:0", since=65.0, now=65.0 + 131.0)
    assert [w.kind for w in dog.due(65.0 + 131.0, {"worker:0"})] == ["silent"]


def test_a_quiet_watchdog_says_what_it_watched_not_that_nothing_hung(tmp_path):
    """It sees TF's session waits only: a script stuck before its session is no such wait."""
    from tfcluster.diagnose.checks import RunChecks
    from tfcluster.plan import build_plan
    from tfcluster.spec import load_spec

    plan = build_plan(load_spec(str(local_spec(tmp_path, extra="  checks: {hang_after: 45s}\n"))))
    checks = RunChecks(plan, ui=None, log_dir=str(tmp_path), wake=lambda: None)
    assert checks.summary()["hang"] == "no session wait over 45s"
    checks.diagnoses = 2
    assert checks.summary()["hang"] == "2 diagnosis(es)"
    checks.said = {"worker:1 silent": 2}
    assert checks.summary()["hang"] == "2 diagnosis(es): worker:1 silent (2×)"


def test_a_task_that_never_printed_is_said_silent_once_a_minute_not_at_every_tick(tmp_path):
    """A script that has printed nothing since its start 90 s ago: the run's checks, ticked
    five times on the real clocks, say it once. Its start was reckoned on the monotonic clock
    again at every tick, a hair apart each time, and each tick then saw a new silence (two
    warnings a second, 2,208 in ten minutes). Only the diagnosis itself (which dials the
    task's host) is left out: what the ticks hand it is recorded."""
    import time
    from types import SimpleNamespace

    from tfcluster.diagnose.checks import RunChecks
    from tfcluster.plan import build_plan
    from tfcluster.spec import load_spec

    plan = build_plan(load_spec(str(local_spec(tmp_path, mode="mirrored", script="template:mirrored", ps=0))))
    checks = RunChecks(plan, ui=None, log_dir=str(tmp_path), wake=lambda: None)
    said: list[str] = []

    def record(due, procs, mux) -> None:
        said.extend(w.waiter for w in due)
        checks._diagnosing.release()

    checks._diagnose = record
    proc = SimpleNamespace(role="script", exit_code=None, handle=object(), task=plan.task("worker:0"),
                           key="worker:0", attempt_started=time.time() - 90)
    quiet = SimpleNamespace(last_output=lambda key: None)
    for _ in range(5):
        checks.tick([proc], quiet)
        wait_for(lambda: checks._diagnosing.acquire(blocking=False) and not checks._diagnosing.release(),
                 timeout=10, what="the diagnosis thread done")
    assert said == ["worker:0"], said


# TF's stall messages. BLOCKED is real: TF 2.21, a session on worker:0's in-process server whose
# step failed on ps:0 (an assert) while worker:0's own part of it slept in a py_func; TF said
# so once, 120 s into the step, which is too long for a test, so the test feeds the lines.
# TWICE is the text TF's recent_request_ids.cc builds (not produced here: it needs a RunGraph
# call resent after a dropped connection).
BLOCKED = (
    b"E0000 00:00:1795736994.870149    5262 master_session.cc:580] RunStep still blocked after 60 seconds. "
    b"Failed with error status: INVALID_ARGUMENT: From /job:ps/replica:0/task:0:\n"
    b"assertion failed: [flag set] [Condition x == y did not hold element-wise:] [x "
    b"(assert_equal_1/ReadVariableOp:0) = ] [1] [y (assert_equal_1/y:0) = ] [0]\n"
    b"\t [[{{function_node assert_equal_1_Assert_AssertGuard_false_18}}{{node Assert}}]]\n"
    b"Recent warning and error logs:\n"
    b"  W0000 00:00:1795736874.870612    5125 local_rendezvous.cc:412] Local rendezvous is aborting with "
    b"status: INVALID_ARGUMENT: assertion failed: [flag set] [Condition x == y did not hold element-wise:] "
    b"[x (assert_equal_1/ReadVariableOp:0) = ] [1] [y (assert_equal_1/y:0) = ] [0]\n"
    b"\t [[{{function_node assert_equal_1_Assert_AssertGuard_false_18}}{{node Assert}}]]\n"
    b"E0000 00:00:1795736994.870256    5262 master_session.cc:585] - No response from RunGraph call to "
    b"worker: /job:worker/replica:0/task:0\n")
TWICE = (b"The same RunGraph request was received twice. session_handle: \"c0ffee\" graph_handle: "
         b"\"0000000000000003\" step_id: 4121873442 request_id: 9012")


def feed_lines(dog: wd.Watchdog, key: str, data: bytes, now: float) -> None:
    """What LogMux hands the watchdog: each line holding one of its markers."""
    for line in data.split(b"\n"):
        if any(m in line for m in wd.MARKERS):
            dog.saw(key, line, now)


def test_a_blocked_runstep_is_due_at_once_naming_the_failed_task_and_the_one_with_no_answer():
    dog = wd.Watchdog(hang_after=20)
    feed_lines(dog, "worker:0", BLOCKED, now=500.0)
    [wait] = dog.due(500.0, {"worker:0"})
    assert (wait.waiter, wait.kind, wait.target, wait.start) == ("worker:0", "runstep", "worker:0", 380.0)
    line = wd.explain(wait, None, 500.0, "a", "runs/x/worker-0.log")
    assert line == ("worker:0's training step is stuck: TensorFlow's RunStep has been blocked for 120s (the "
                    "step failed: INVALID_ARGUMENT from ps:0), still waiting for its own part of the step: an "
                    "op of worker:0 does not return and cannot be cancelled (a py_func, a blocking read or "
                    "queue, a call into another library); its log: runs/x/worker-0.log. The run ends at "
                    "train.timeout")


def test_a_runstep_blocked_on_another_task_says_its_state_and_what_to_check():
    dog = wd.Watchdog(hang_after=20)
    feed_lines(dog, "worker:0.server", BLOCKED.replace(b"/job:worker/replica:0/task:0", b"/job:ps/replica:0/task:1"),
               now=500.0)                               # between-graph: the master is worker:0's server
    [wait] = dog.due(500.0, {"worker:0"})
    assert (wait.waiter, wait.target) == ("worker:0", "ps:1")
    facts = wd.Facts("b", "127.0.0.1:2231", "running", pid=7, port=None, quiet_for=70)
    line = wd.explain(wait, facts, 500.0, "a", "runs/x/ps-1.server.log")
    assert line.startswith("worker:0's training step is stuck: TensorFlow's RunStep has been blocked for 120s "
                           "(the step failed: INVALID_ARGUMENT from ps:0), still waiting for ps:1 (b, "
                           "127.0.0.1:2231): ps:1 is running (pid 7, last output 70s ago). Likely: ps:1 is "
                           "stopped, hung or unreachable"), line
    assert "runs/x/ps-1.server.log" in line and "\n" not in line


def test_a_blocked_runstep_is_said_instead_of_its_silence_and_again_each_minute_until_it_writes():
    dog = wd.Watchdog(hang_after=20)
    dog.silent("worker:0", since=0.0, now=500.0)
    feed_lines(dog, "worker:0", BLOCKED, now=500.0)
    assert [w.kind for w in dog.due(500.0, {"worker:0"})] == ["runstep"]
    dog.silent("worker:0", since=0.0, now=561.0)
    assert [w.kind for w in dog.due(561.0, {"worker:0"})] == ["runstep"]     # TF said it once; we repeat
    dog.silent("worker:0", since=570.0, now=600.0)       # it wrote at 570: the step went on
    assert [w.kind for w in dog.due(600.0, {"worker:0"})] == []


def test_a_rungraph_received_twice_is_said_at_once_with_what_to_check():
    dog = wd.Watchdog(hang_after=20)
    dog.saw("worker:1", TWICE, now=5.0)
    [wait] = dog.due(5.0, {"worker:1"})
    assert (wait.kind, wait.target) == ("twice", None)
    line = wd.explain(wait, wd.Facts(proxy="http_proxy"), 5.0, "b", "runs/x/worker-1.log")
    assert line.startswith("worker:1 on b: TensorFlow aborted a step because a task got its RunGraph call "
                           "twice ('The same RunGraph request was received twice'): the call was sent again")
    assert "a proxy is set (http_proxy)" in line and "\n" not in line
    assert dog.due(30.0, {"worker:1"}) == []               # said once, not again within a minute


@pytest.mark.parametrize("facts, expected", [
    (wd.Facts("local", "127.0.0.1:2231", "finished", exit_code=0), "device_filters=['/job:ps', '/job:worker/task:0']"),
    (wd.Facts("local", "127.0.0.1:2231", "failed", exit_code=3), "exited with code 3"),
    (wd.Facts("local", "127.0.0.1:2231", "running", pid=7, port="connection refused", quiet_for=12,
              last_line="booting"), "is running (pid 7, last output 12s ago: 'booting'). Its port does not "
                                     "accept connections from h0 (connection refused)"),
    (wd.Facts("local", "127.0.0.1:2231", "running", pid=7, port=None, proxy="https_proxy"), "A proxy is set"),
])
def test_each_cause_gets_its_own_explanation(facts, expected):
    wait = wd.Wait("worker:0", "session", "worker:1", "", start=0.0, last=25.0)
    line = wd.explain(wait, facts, 25.0, "h0", "runs/x/worker-1.log")
    assert line.startswith("worker:0 has waited 25s for worker:1 (local, 127.0.0.1:2231): worker:1 ")
    assert expected in line and "\n" not in line


# -- the probe in a real interpreter -------------------------------------------------------

PROBED = """
import os, subprocess, sys
import tensorflow as tf
tf.compat.v1.disable_eager_execution()
with tf.compat.v1.device("/job:ps/task:1"):
    v = tf.compat.v1.get_variable("v", [2, 3])
tf.compat.v1.Session().close()
tf.compat.v1.Session().close()          # only the first session reports
print("child PYTHONPATH:", os.environ.get("PYTHONPATH"), flush=True)
print("user sitecustomize ran:", os.environ.get("USER_SITE_RAN"), flush=True)
"""


@pytest.mark.tf
@pytest.mark.timeout(120)
def test_probe_reports_the_first_sessions_variables_and_chains_the_users_sitecustomize(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    env = {**os.environ, "PYTHONPATH": f"{PROBE_DIR}{os.pathsep}{user}", "TFCLUSTER_PROBE": "placement,waits",
           "TFCLUSTER_JOB": "worker", "TFCLUSTER_TASK_INDEX": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, "-c", PROBED], env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    reports = [line for line in out.stderr.splitlines() if line.startswith("tfcluster-placement: ")]
    assert len(reports) == 1
    parsed = pl.parse(reports[0].encode())
    assert parsed == pl.Report("worker:1", (pl.Variable("v:0", "/job:ps/task:1", "[2, 3]", "float32"),))
    assert f"child PYTHONPATH: {user}" in out.stdout        # the task's children are not probed
    assert "user sitecustomize ran: yes" in out.stdout


def test_probe_off_loads_nothing_and_still_chains(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("print('user site', flush=True)\n")
    code = "import sys; print([type(f).__name__ for f in sys.meta_path if 'After' in str(f)])"
    env = {**os.environ, "PYTHONPATH": f"{PROBE_DIR}{os.pathsep}{user}", "TFCLUSTER_PROBE": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert out.stdout.splitlines() == ["user site", "[]"], out


# -- end to end ----------------------------------------------------------------------------

@pytest.mark.tf
@pytest.mark.timeout(300)
def test_variables_created_from_a_set_stop_the_run_with_exit_8_naming_variable_tasks_and_devices(work):
    tmp, home, cwd = work
    spec = local_spec(tmp, script=str(SCRIPTS / "set_order.py"), ps=2, workers=2, name="setorder",
                      extra=ALLOW_SCRIPTS)
    out = tfcluster("train", str(spec), "--runs-dir", str(tmp / "runs"), home=home, cwd=cwd, timeout=240)
    assert out.returncode == 8, out.stdout + out.stderr
    error = [line for line in out.stderr.splitlines() if "placement mismatch" in line]
    assert error, out.stderr

    m = re.search(r"placement mismatch: variable 'layer\d+:0' has device /job:ps/task:(\d) in worker:0 "
                  r"but /job:ps/task:(\d) in worker:1", error[0])
    assert m and m.group(1) != m.group(2), error[0]
    assert "create the variables in a fixed order" in out.stderr
    run = only_run(tmp / "runs")
    assert manifest(run)["exit_code"] == 8
    assert manifest(run)["checks"]["placement"].startswith("placement mismatch: variable 'layer")
    assert "tfcluster-placement" not in out.stdout      # the reports are saved, never shown live
    assert "tfcluster-placement" in (run / "worker-1.log").read_text()
    wait_for(lambda: not tagged_processes(), 20, what="every task stopped")


@pytest.mark.tf
@pytest.mark.timeout(300)
def test_the_same_script_with_the_check_off_is_not_stopped_by_it(work):
    tmp, home, cwd = work
    spec = local_spec(tmp, script=str(SCRIPTS / "set_order.py"), ps=2, workers=2, name="setoff",
                      extra=ALLOW_SCRIPTS + "  timeout: 25s\n  checks: {placement: false, hang_after: off}\n")
    out = tfcluster("train", str(spec), "--runs-dir", str(tmp / "runs"), home=home, cwd=cwd, timeout=240)
    assert out.returncode == 6, out.stdout + out.stderr          # only train.timeout ends it
    assert "placement mismatch" not in out.stderr and "placement check: off" in out.stderr
    assert manifest(only_run(tmp / "runs"))["checks"] == {"placement": "off"}


@pytest.mark.tf
@pytest.mark.timeout(300)
def test_a_late_worker_gets_a_diagnosis_naming_it_its_host_and_its_closed_port_and_the_run_goes_on(work):
    tmp, home, cwd = work
    go = tmp / "go"
    spec = local_spec(tmp, mode="classic", script=str(SCRIPTS / "late_worker.py"), ps=1, workers=2, name="late",
                      extra=ALLOW_SCRIPTS)
    spec.write_text(spec.read_text().replace("train:\n", f"env: {{LATE_WORKER_GO: '{go}'}}\ntrain:\n"))
    port = int(re.search(r"worker: \{tasks: \[\"local:\d+\", \"local:(\d+)\"", spec.read_text()).group(1))
    proc = start_tfcluster("train", str(spec), "--runs-dir", str(tmp / "runs"), home=home, cwd=cwd)
    try:
        lines = read_until(proc, r"worker:0 has waited \d+s for worker:1", timeout=150)
        started = next(i for i, line in enumerate(lines) if "Starting the script" in line)
        diagnosis = lines[-1]
        assert f"worker:1 (local, 127.0.0.1:{port}): worker:1 is running (pid " in diagnosis
        assert "worker 1: waiting for the go file" in diagnosis          # its last line
        assert "Its port does not accept connections from local (connection refused)" in diagnosis
        assert "has not started its TF server yet" in diagnosis
        assert not any("CreateSession still waiting" in line for line in lines)   # INFO: saved, not live
        assert started < len(lines) - 1
        go.write_text("")
        rest = proc.communicate(timeout=150)[0]
    finally:
        kill_group(proc)
    assert proc.returncode == 0, rest
    run = only_run(tmp / "runs")
    assert "CreateSession still waiting for response from worker: /job:worker/replica:0/task:1" in \
        (run / "worker-0.log").read_text()
    assert re.fullmatch(r"\d+ diagnosis\(es\): worker:0 waited for worker:1( \(\d+×\))?", manifest(run)["checks"]["hang"])
