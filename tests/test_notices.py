"""A host that warns before it goes, on the bed of separate hosts (tests/netns.py): a fake of
its cloud's metadata service runs inside the host's own network namespace, at 127.0.0.1 there
(tests/metadata_fakes.py follows AWS's "Spot Instance interruption notices" with IMDSv2 and
Azure's "Scheduled Events for Linux VMs"), the spec points the host's `metadata_url` at it,
and the host is killed for real at the deadline. Real sshds, real TensorFlow (between-graph)."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.helpers import (
    kill_group,
    manifest,
    only_run,
    read_until,
    start_tfcluster,
    tagged_processes,
    tfcluster,
    wait_for,
)
from tests.notice_bed import FAKE_PORT, control, finish, start_fake, write_notice_spec

# A real deadline: judged beside at most one other test at a time, never the parallel part's load
# (scripts/test.sh: the alone tests' two lanes, the notices' one of them)
pytestmark = [pytest.mark.ssh, pytest.mark.tf, pytest.mark.alone, pytest.mark.xdist_group("notices")]


def notice_spec(tmp: Path, bed, name: str, *, watch: str | None, spare: bool, steps: int) -> Path:
    """ps:0 on h2, worker:0 (the chief) on h3, worker:1 on h4 (watched: `watch`), spare h5."""
    h2, h3, h4 = (bed.add(n) for n in ("h2", "h3", "h4"))
    h4_extra = {"preemptible": watch, "metadata_url": f"'http://127.0.0.1:{FAKE_PORT}'"} if watch else {}
    listed = f"  - {h2.spec()}\n  - {h3.spec()}\n  - {h4.spec(**h4_extra)}\n"
    if spare:
        listed += f"  - {bed.add('h5').spec(spare='true')}\n"
    return write_notice_spec(tmp, name, listed, steps)


@pytest.mark.timeout(480)
def test_a_spot_notice_30s_ahead_moves_the_workers_tasks_before_the_kill(tmp_path, home, ssh_home, bed):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = notice_spec(tmp_path, bed, "naws", watch="aws", spare=True, steps=2500)
    plan = tfcluster("plan", str(spec), home=home, cwd=cwd)
    assert f"h4: watched (aws notices, at http://127.0.0.1:{FAKE_PORT})" in plan.stdout, plan.stdout
    assert "h2: not watched (preemptible: no)" in plan.stdout
    start_fake(bed.hosts["h4"])
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        seen = "".join(read_until(proc, r"worker:1 .*step=[1-9]", timeout=200))
        assert "h4: watched (aws spot)" in seen, seen[-3000:]
        control(bed.hosts["h4"], "aws/action", action="terminate", **{"in": 30})
        noticed = time.time()
        deadline = noticed + 30
        said = "".join(read_until(proc, r"h4 warned: aws terminate notice, deadline \S+: moving worker:1 to h5", 60))
        assert re.search(r"h4: aws terminate notice: taken back at \S+ \(\d+s from now\)", said), said[-3000:]
        said = "".join(read_until(proc, r"worker:0 on h3 resumed at step \d+", 120))
        first_step = time.time() - noticed
        assert time.time() < deadline, f"the move took {first_step:.1f}s, past the deadline"
        wait_for(lambda: time.time() >= deadline, timeout=40, interval=0.2, what="the notice's deadline")
        bed.kill("h4")                  # the cloud takes it back, on time
        rest = finish(proc)
    finally:
        kill_group(proc)
    print(f"notice to the chief's first step after the move: {first_step:.1f}s")
    assert proc.returncode == 0, rest[-4000:]
    assert re.search(r"^notice: \d\d:\d\d:\d\d h4 aws terminate, deadline \S+ \(\d+s ahead\): moved: worker:1 moved "
                     r"to h5, every task restarted; 0 step\(s\) lost$", rest, re.MULTILINE), rest[-3000:]
    doc = manifest(only_run(cwd / "runs"))
    (notice,) = doc["notices"]
    assert (notice["host"], notice["source"], notice["kind"], notice["action"]) == ("h4", "aws", "terminate", "moved")
    assert abs(notice["deadline"] - deadline) < 3 and notice["move"] == {"to": "h5", "action": "restart"}
    assert notice["steps_lost"] == 0          # the chief saved as it stopped; it resumed from there
    (move,) = doc["moves"]
    assert move["why"].startswith("warned: aws terminate notice") and move["done_at"] < deadline, move
    print(f"notice to the new tasks started: {move['done_at'] - notice['at']:.1f}s")
    assert doc["tasks"]["worker:1"]["host"] == "h5" and doc["exit_code"] == 0
    listed = json.loads(tfcluster("runs", str(spec), "--json", home=home, cwd=cwd).stdout)
    (run,) = listed if isinstance(listed, list) else listed["runs"]
    assert run["notices"][0]["action"] == "moved" and run["notices"][0]["source"] == "aws"
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(360)
def test_a_notice_with_no_spare_ends_the_run_before_the_kill_with_a_checkpoint(tmp_path, home, ssh_home, bed):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = notice_spec(tmp_path, bed, "nnospare", watch="aws", spare=False, steps=5000)
    start_fake(bed.hosts["h4"])
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:1 .*step=[1-9]", timeout=200)
        control(bed.hosts["h4"], "aws/action", action="stop", **{"in": 30})
        rest = finish(proc, timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == 3, rest[-4000:]
    assert re.search(r"h4 is taken back at \S+ \(aws stop notice\) and no spare can take worker:1: the run ends "
                     r"before it, every script saving as it stops", rest), rest[-3000:]
    doc = manifest(only_run(cwd / "runs"))
    (notice,) = doc["notices"]
    assert notice["action"] == "ended the run" and notice["line"].startswith("no spare; copied model.ckpt-"), notice
    assert not doc["moves"]
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(360)
def test_an_azure_event_withdrawn_before_the_move_is_a_false_alarm(tmp_path, home, ssh_home, bed):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = notice_spec(tmp_path, bed, "nazure", watch="azure", spare=True, steps=1200)
    h4 = bed.hosts["h4"]
    start_fake(h4)
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        seen = "".join(read_until(proc, r"worker:1 .*step=[1-9]", timeout=200))
        assert "h4: watched (azure spot)" in seen, seen[-3000:]
        control(h4, "azure/event", id="EV-1", type="Preempt", **{"in": 120})
        read_until(proc, r"h4: azure Preempt notice: taken back at \S+ \(\d+s from now\); its tasks move at \S+, "
                         r"60s before", 30)
        control(h4, "azure/withdraw", id="EV-1")
        read_until(proc, r"h4: azure Preempt EV-1: false alarm withdrawn; nothing moved", 30)
        rest = finish(proc)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, rest[-4000:]
    doc = manifest(only_run(cwd / "runs"))
    (notice,) = doc["notices"]
    assert notice["action"] == "withdrawn" and notice["id"] == "EV-1", notice
    assert not doc["moves"] and doc["tasks"]["worker:1"]["host"] == "h4"
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(480)
def test_drain_with_a_deadline_too_short_to_move_saves_and_the_loss_moves_from_that_copy(
        tmp_path, home, ssh_home, bed):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = notice_spec(tmp_path, bed, "ndrain", watch=None, spare=True, steps=2500)
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:1 .*step=[1-9]", timeout=200)
        asked = tfcluster("drain", str(spec), "h4", "--deadline", "10s", "--wait", "60", home=home, cwd=cwd)
        assert asked.returncode == 0, asked.stdout + asked.stderr
        said = asked.stdout + asked.stderr
        assert re.search(r"asked the running train to drain h4 by \d\d:\d\d:\d\d \(10s\)", said), said
        # the chief (worker:0, on h3) gets the checkpoint request; a save after it is the copy
        saved = re.search(r"h4: saved: .*drain --deadline.*: saved only: \d+s left, under the 20s a move takes: "
                          r"checkpoint request to worker:0: copied model\.ckpt-(\d+) here, saved since; "
                          r"worker:1 move when h4 goes", said)
        assert saved, said
        bed.kill("h4")
        read_until(proc, r"h4: moving worker:1 to h5, every task restarting from the checkpoint", 90)
        rest = finish(proc)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, rest[-4000:]
    doc = manifest(only_run(cwd / "runs"))
    (notice,) = doc["notices"]
    assert (notice["source"], notice["kind"], notice["action"]) == ("drain", "--deadline", "saved only"), notice
    assert notice["move"] == {"to": "h5", "action": "restart"} and notice["steps_lost"] is not None, notice
    (move,) = doc["moves"]
    assert move["why"].startswith("lost:"), move
    chief_log = (only_run(cwd / "runs") / "worker-0.log").read_text(errors="replace")
    request = re.search(r"/model\.ckpt-(\d+) at step=\1 \(checkpoint request\)", chief_log)
    assert request, chief_log[-3000:]                               # the request reached the chief's script
    copied = int(saved.group(1))
    assert int(request.group(1)) <= copied <= move["resumed_step"], (request.group(0), copied, move)
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")
