"""A host that warns, the edge cases, on the bed of separate hosts (tests/netns.py), each
with a fake of its cloud's metadata service inside the host's own network namespace
(tests/metadata_fakes.py: AWS "Spot Instance interruption notices" with IMDSv2; GCE "Detect
if a VM was preempted" with wait_for_change), real sshds and real TensorFlow (between-graph),
each warned host killed for real at its deadline:

- two hosts warned at once, the chief's over AWS and a worker's over GCE, with a spare for
  each: both move in one restart, before either deadline (GCE end to end);
- `drain --deadline` with 20 s or more left moves the host, and a notice that comes while
  every task restarts from that move rides along with it instead of waiting for its end.

Each run is one TF run for several cases: TF runs are what these tests cost."""
from __future__ import annotations

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
    wait_for,
)
from tests.notice_bed import FAKE_PORT, control, finish, kill_at, start_fake, write_notice_spec

# A real deadline: judged beside at most one other test at a time, never the parallel part's load
# (scripts/test.sh: the alone tests' two lanes, the notices' one of them)
pytestmark = [pytest.mark.ssh, pytest.mark.tf, pytest.mark.alone, pytest.mark.xdist_group("notices")]

URL = f"'http://127.0.0.1:{FAKE_PORT}'"


def edge_spec(tmp: Path, bed, name: str, *, watch: dict[str, str], spares: int, steps: int) -> Path:
    """ps:0 on h2, worker:0 (the chief) on h3, worker:1 on h4, `spares` spares from h5;
    `watch`: host -> its cloud."""
    hosts = [bed.add(n) for n in ("h2", "h3", "h4")] + [bed.add(f"h{5 + i}") for i in range(spares)]
    listed = ""
    for h in hosts:
        extra = {"preemptible": watch[h.name], "metadata_url": URL} if h.name in watch else {}
        if h.name >= "h5":
            extra["spare"] = "true"
        listed += f"  - {h.spec(**extra)}\n"
    return write_notice_spec(tmp, name, listed, steps)


@pytest.mark.timeout(480)
def test_two_hosts_warned_at_once_both_move_in_one_restart_before_either_deadline(
        tmp_path, home, ssh_home, bed):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = edge_spec(tmp_path, bed, "ntwo", watch={"h3": "aws", "h4": "gce"}, spares=2, steps=3000)
    start_fake(bed.hosts["h3"])
    start_fake(bed.hosts["h4"])
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        seen = "".join(read_until(proc, r"worker:1 .*step=[1-9]", timeout=200))
        assert "h3: watched (aws spot)" in seen and "h4: watched (gce spot)" in seen, seen[-3000:]
        control(bed.hosts["h3"], "aws/action", action="terminate", **{"in": 30})
        control(bed.hosts["h4"], "gce/set", key="preempted", value="TRUE")    # GCE: ~30 s from now
        noticed = time.time()
        deadlines = {"h3": noticed + 30, "h4": noticed + 30}
        said = "".join(read_until(proc, r"worker:0 on h\d resumed at step \d+", 150))
        resumed = time.time()
        kill_at(bed, deadlines)
        rest = finish(proc)
    finally:
        kill_group(proc)
    print(f"two notices to the chief's first step after the move: {resumed - noticed:.1f}s")
    out = seen + said + rest
    (tmp_path / "train.out").write_text(out)        # kept with the test's tmp_path, to read
    assert proc.returncode == 0, out[-5000:]
    assert re.search(r"h4: gce preempted notice: taken back at \S+ \(\d+s from now\)", said), said[-3000:]
    assert resumed < min(deadlines.values()), f"resumed {resumed - noticed:.1f}s after the notices"
    doc = manifest(only_run(cwd / "runs"))
    by_host = {n["host"]: n for n in doc["notices"]}
    assert set(by_host) == {"h3", "h4"}, doc["notices"]
    assert by_host["h3"]["action"] == by_host["h4"]["action"] == "moved", doc["notices"]
    assert by_host["h4"]["source"] == "gce" and by_host["h4"]["kind"] == "preempted"
    # one restart for both: every task stopped and started once, not twice
    assert len(doc["moves"]) == 2 and all(m["done_at"] < min(deadlines.values()) for m in doc["moves"]), doc["moves"]
    assert {doc["tasks"]["worker:0"]["host"], doc["tasks"]["worker:1"]["host"]} == {"h5", "h6"}
    assert out.count("every task restarting from the checkpoint") == 1, out[-5000:]
    for host in ("h3", "h4"):
        assert re.search(rf"^notice: \d\d:\d\d:\d\d {host} \w+ \w+, deadline \S+ \(\d+s ahead\): moved: worker:\d "
                         rf"moved to h[56]", rest, re.MULTILINE), rest[-3000:]
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(480)
def test_drain_with_a_deadline_to_move_and_a_notice_during_its_restart_rides_along(
        tmp_path, home, ssh_home, bed):
    """`drain h3 --deadline 40s` moves the chief's host (over 20 s left); h4's GCE notice,
    set the moment that move begins (every task stopping, saving), moves with it."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = edge_spec(tmp_path, bed, "nride", watch={"h4": "gce"}, spares=2, steps=3000)
    start_fake(bed.hosts["h4"])
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        seen = "".join(read_until(proc, r"worker:1 .*step=[1-9]", timeout=200))
        assert "h4: watched (gce spot)" in seen, seen[-3000:]
        drain = start_tfcluster("drain", str(spec), "h3", "--deadline", "40s", "--wait", "120",
                                home=home, cwd=cwd)
        try:
            asked = time.time()
            said = "".join(read_until(proc, r"h3 warned: drain --deadline notice, deadline \S+: moving worker:0 to h5", 60))
            control(bed.hosts["h4"], "gce/set", key="preempted", value="TRUE")
            warned = time.time()
            said += "".join(read_until(proc, r"worker:0 on h\d resumed at step \d+", 150))
            resumed = time.time()
            drained = finish(drain, timeout=60)
        finally:
            kill_group(drain)
        kill_at(bed, {"h3": asked + 40, "h4": warned + 30})
        rest = finish(proc)
    finally:
        kill_group(proc)
    out = seen + said + rest
    (tmp_path / "train.out").write_text(out)
    print(f"drain to the chief's first step: {resumed - asked:.1f}s; gce notice to it: {resumed - warned:.1f}s")
    assert proc.returncode == 0, out[-5000:]
    assert drain.returncode == 0, drained
    assert re.search(r"h3: moved: .*drain --deadline.*moved: worker:0 moved to h5", drained), drained
    assert re.search(r"h4 warned: gce preempted notice, deadline \S+: moving worker:1 to h6 in the same restart "
                     r"as h3's", said), said[-3000:]
    assert resumed < warned + 30
    assert out.count("every task restarting from the checkpoint") == 1, out[-5000:]
    doc = manifest(only_run(cwd / "runs"))
    by_host = {n["host"]: n for n in doc["notices"]}
    assert (by_host["h3"]["source"], by_host["h3"]["action"]) == ("drain", "moved"), doc["notices"]
    assert (by_host["h4"]["source"], by_host["h4"]["action"]) == ("gce", "moved"), doc["notices"]
    assert by_host["h4"]["move"] == {"to": "h6", "action": "restart"}
    assert doc["tasks"]["worker:0"]["host"] == "h5" and doc["tasks"]["worker:1"]["host"] == "h6"
    assert re.search(r"^notice: \S+ h4 gce preempted, deadline \S+ \(\d+s ahead\): moved: worker:1 moved to h6, "
                     r"every task restarted, with h3's move; \d+ step\(s\) lost$", rest, re.MULTILINE), rest[-3000:]
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")

