"""Warm spares (`spare: warm`) and make before break (docs/hostloss.md, "Warm spares").

The host's side with real processes (host/shim_warm.py, host/shim_standby.py): a standby
becomes its task in its own process (same pid, the task's tag where the kernel shows it), and a
standby that cannot (a variable read at start-up differs, or it died) gives way to a cold start
that says why. A standby here imports `json` instead of TensorFlow (TFCLUSTER_STANDBY_IMPORT): the mechanism
is the same, and the TensorFlow runs are the bed's (tests/test_warm_bed.py).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.helpers import (
    wait_for,
)
from tfcluster.errors import SpecError
from tfcluster.host import shim_procs, shim_standby, shim_warm
from tfcluster.spec.loader import load_spec

# -- the host's side -----------------------------------------------------------------------


def _requests(tmp: Path, *, standby_env: dict | None = None, task_env: dict | None = None) -> tuple[dict, dict]:
    cluster = tmp / "c"
    cluster.mkdir(mode=0o700, exist_ok=True)
    script = tmp / "task.py"
    script.write_text(textwrap.dedent("""\
        import os, sys
        print("task", os.getpid(), os.environ["TFCLUSTER_JOB_ID"], os.environ["TF_CONFIG"], sys.argv[1:], flush=True)
        sys.stdin.read()   # until its shim's stop: EOF (devnull) returns at once, so it waits on a signal
        import signal; signal.pause()
        """))
    base = {"TFCLUSTER_STANDBY_IMPORT": "json", "TF_CONFIG": '{"task": "guessed"}'}
    # a cluster instance of its own: a standby's stop sweeps its tag, so a test beside this one
    # (another xdist worker) with the same tag would stop this test's standby
    cluster_tag = f"lab@{uuid.uuid4().hex[:12]}"
    standby = {"tag": f"{cluster_tag}:run-1:standby:1:script", "argv": [sys.executable, "task.py"],
               "env": dict(base, **(standby_env or {})), "cwd": str(tmp), "log": str(cluster / "standby-1.log"),
               "pidfile": str(cluster / "standby.pid"), "cluster_dir": str(cluster)}
    task = {"tag": f"{cluster_tag}:run-1:worker:1:script", "argv": [sys.executable, "task.py", "--steps", "3"],
            "env": dict(base, TF_CONFIG='{"task": "worker:1"}', **(task_env or {})), "cwd": str(tmp),
            "log": str(cluster / "worker-1.log"), "pidfile": str(cluster / "worker-1.pid"), "cluster_dir": str(cluster)}
    return standby, task


def _stopped(proc) -> None:
    shim_procs.signal_quietly(proc.pid, signal.SIGKILL, group=True)
    proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_a_standby_becomes_its_task_in_its_own_process_with_the_tasks_tag(tmp_path):
    # started as worker:0 (a warm spare guesses the first host it could take), it becomes
    # worker:1: tfcluster's own variables are read by the script only, after the take
    standby_req, task_req = _requests(tmp_path, standby_env={"TFCLUSTER_TASK_INDEX": "0", "TFCLUSTER_IS_CHIEF": "1"},
                                      task_env={"TFCLUSTER_TASK_INDEX": "1", "TFCLUSTER_IS_CHIEF": "0"})
    standby = shim_warm.Standby(standby_req)
    assert standby.ready.wait(30) and standby.ready_s is not None
    standby_pid = standby.proc.pid
    assert json.loads(Path(standby_req["pidfile"]).read_text())["standby"] is True
    proc, log, _offset, said = standby.take(task_req)
    try:
        assert said["warm"] is True and proc.pid == standby_pid, said
        wait_for(lambda: "task" in Path(log).read_text(), timeout=20, what="the task's first line")
        line = Path(log).read_text().split("\n")[0].split(" ", 4)
        assert line[1:4] == [str(standby_pid), task_req["tag"], '{"task":'], line     # its TF_CONFIG, not the guess
        assert "worker:1" in line[4] and "['--steps', '3']" in line[4], line
        # where the sweeps and `status` read it: the task's tag, and its pid file verifies
        assert shim_procs.tag_of(standby_pid) == task_req["tag"]
        record = json.loads(Path(task_req["pidfile"]).read_text())
        assert shim_procs.verified(record) and record["pid"] == standby_pid
        assert not Path(standby_req["pidfile"]).exists()
    finally:
        _stopped(proc)


@pytest.mark.timeout(60)
def test_a_standby_started_with_another_value_of_a_start_up_variable_gives_way_to_a_cold_start(tmp_path):
    """PYTHONHASHSEED is read as the interpreter starts: a standby started without the task's
    value would run it with the wrong one."""
    standby_req, task_req = _requests(tmp_path, task_env={"PYTHONHASHSEED": "7"})
    standby = shim_warm.Standby(standby_req)
    assert standby.ready.wait(30)
    proc, _log, _offset, said = standby.take(task_req)
    try:
        assert said["warm"] is False and "PYTHONHASHSEED" in said["why"], said
        assert proc.pid != standby.proc.pid
        assert standby.proc.poll() is not None      # stopped, its pid file gone
        assert not Path(standby_req["pidfile"]).exists()
        wait_for(lambda: shim_procs.tag_of(proc.pid) == task_req["tag"], timeout=20, what="the cold task's tag")
    finally:
        _stopped(proc)


def test_only_variables_read_after_the_interpreters_start_may_differ_at_a_take():
    started = {"TFCLUSTER_JOB": "worker", "TFCLUSTER_TASK_INDEX": "0", "TF_CONFIG": "{}", "TFCLUSTER_PROBE": "",
               "PYTHONHASHSEED": "1", "TFCLUSTER_STANDBY_IMPORT": "tensorflow"}
    wanted = dict(started, TFCLUSTER_JOB="chief", TFCLUSTER_TASK_INDEX="3", TF_CONFIG='{"task": 1}')
    assert shim_standby.differs(started, wanted) == []
    wanted.update(TFCLUSTER_PROBE="placement", PYTHONHASHSEED="2", TFCLUSTER_STANDBY_IMPORT="tensorflow,keras")
    assert shim_standby.differs(started, wanted) == ["PYTHONHASHSEED", "TFCLUSTER_PROBE", "TFCLUSTER_STANDBY_IMPORT"]


@pytest.mark.timeout(60)
def test_a_standby_killed_for_real_gives_way_to_a_cold_start_that_says_so(tmp_path):
    standby_req, task_req = _requests(tmp_path)
    standby = shim_warm.Standby(standby_req)
    assert standby.ready.wait(30)
    os.kill(standby.proc.pid, signal.SIGKILL)
    standby.proc.wait(timeout=10)
    proc, _log, _offset, said = standby.take(task_req)
    try:
        assert said == {"warm": False, "why": "its standby had exited (killed by signal 9)"}, said
        wait_for(lambda: shim_procs.tag_of(proc.pid) == task_req["tag"], timeout=20, what="the cold task's tag")
    finally:
        _stopped(proc)


def test_spare_warm_is_a_spare_and_a_bad_value_names_the_three(tmp_path):
    base = ("name: w\nhosts:\n  - {name: a, address: 10.0.0.1}\n  - {name: b, address: 10.0.0.2, spare: %s}\n"
            "jobs:\n  worker: {tasks: ['a:2222']}\ntrain: {script: template:mirrored, mode: mirrored}\n")
    (tmp_path / "w.yaml").write_text(base % "warm")
    spec = load_spec(str(tmp_path / "w.yaml"))
    (spare,) = spec.spares
    assert spare.name == "b" and spare.warm
    (tmp_path / "w.yaml").write_text(base % "hot")
    with pytest.raises(SpecError) as got:
        load_spec(str(tmp_path / "w.yaml"))
    assert "spare: must be true, false or warm" in got.value.message
