"""`up` with a host already down, on separate machines (tests/netns.py): its tasks' servers
start on the spare, and that placement is the truth for every later command until `down`:
`status` and `train` look for them on the spare, `down` stops them there and clears it. On
loopback hosts the down host's address would still reach the spare's server; here it
reaches nothing, so a command that planned from the spec alone would fail."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import manifest, only_run, state_path, tagged_processes, tfcluster, wait_for

pytestmark = [pytest.mark.ssh, pytest.mark.tf]

PORTS = (25000, 25001, 25002)      # each bed host has its own ports: no clash with any other test
SAID = "worker:1 runs on spare h5 (moved there by `up`: h4 was down)"


def spec_of(tmp: Path, bed, name: str) -> Path:
    """ps on h2, worker:0 (the chief) on h3, worker:1 on h4, h5 the spare."""
    h2, h3, h4, h5 = (bed.add(n) for n in ("h2", "h3", "h4", "h5"))
    text = (f"name: {name}\npython: {sys.executable}\nworkdir: {tmp / 'remote'}\n"
            f"ssh: {{connect_timeout: 5}}\n"
            f"hosts:\n  - {h2.spec()}\n  - {h3.spec()}\n  - {h4.spec()}\n  - {h5.spec(spare='true')}\n"
            f"jobs:\n  ps: {{tasks: ['h2:{PORTS[0]}']}}\n"
            f"  worker: {{tasks: ['h3:{PORTS[1]}', 'h4:{PORTS[2]}']}}\n"
            f"train:\n  mode: between-graph\n  script: template:between_graph\n"
            f"  args: ['--steps', '200', '--log_every', '50']\n")
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.mark.timeout(420)
def test_up_with_a_host_down_keeps_its_tasks_on_the_spare_for_status_train_and_down(
        tmp_path, home, ssh_home, bed):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = spec_of(tmp_path, bed, "bup")
    bed.kill("h4")                   # down before `up`: no sshd, its address answers nothing
    try:
        up = tfcluster("up", str(spec), home=home, cwd=cwd)
        assert up.returncode == 0, up.stderr[-4000:]
        assert "h4 is down (" in up.stderr and "worker:1 start on spare h5 instead" in up.stderr, up.stderr
        saved = json.loads(state_path(home, spec).read_text())
        assert saved["moves"] == [{"lost": "h4", "to": "h5"}], saved
        assert saved["tasks"]["worker:1"]["host"] == "h5", saved

        status = tfcluster("status", str(spec), "--json", home=home, cwd=cwd)
        assert status.returncode == 0, status.stderr
        rows = {r["task"]: r for r in json.loads(status.stdout)["tasks"]}
        assert rows["worker:1"]["host"] == "h5" and rows["worker:1"]["status"] == "running", rows
        assert all(r["status"] == "running" and r["in_spec"] for r in rows.values()), rows
        assert status.stderr.count(SAID) == 1, status.stderr
        assert "h4: not reached" in status.stderr and "its tasks were moved to h5" in status.stderr

        again = tfcluster("up", str(spec), home=home, cwd=cwd)      # h4 still down: the move stands
        assert again.returncode == 0 and "is already up" in again.stderr, again.stderr
        assert SAID in again.stderr and "start on spare" not in again.stderr, again.stderr
        assert json.loads(state_path(home, spec).read_text())["moves"] == [{"lost": "h4", "to": "h5"}]

        train = tfcluster("train", str(spec), home=home, cwd=cwd, timeout=300)
        out = train.stdout + train.stderr
        assert train.returncode == 0, out[-4000:]
        assert SAID in out, out[-4000:]
        doc = manifest(only_run(cwd / "runs"))
        assert doc["tasks"]["worker:1"]["host"] == "h5", doc["tasks"]["worker:1"]
        assert doc["tasks"]["worker:1"]["script"]["exit_code"] == 0, doc["tasks"]["worker:1"]
        assert doc["plan"]["moves"] == [{"lost": "h4", "to": "h5"}]
        assert doc["progress"]["worker:1"]["step"] >= 150, doc["progress"]
    finally:
        down = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert down.returncode == 0, down.stderr
    assert "h5: stopped 1 process(es)" in down.stderr, down.stderr
    assert "h4: not reached" in down.stderr, down.stderr
    assert not state_path(home, spec).exists()
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(420)
def test_up_again_after_a_host_died_under_its_servers_refuses_to_start_one_on_the_spare_beside_them(
        tmp_path, home, ssh_home, bed):
    """The cluster is up; h4 dies. A second `up` would start worker:1's server on the spare
    beside ps:0 and worker:0, which were started with h4's address in their cluster spec and
    would dial it for ever: refused, exit 3, nothing started, with the way out (a `train` too,
    which said the cluster was partly up and sent the user to that `up`); `down` then
    `up` starts every server with the spare's address, and `status` finds them there."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = spec_of(tmp_path, bed, "bupd")
    try:
        assert tfcluster("up", str(spec), home=home, cwd=cwd).returncode == 0
        bed.kill("h4")
        again = tfcluster("up", str(spec), home=home, cwd=cwd)
        assert again.returncode == 3, again.stderr[-3000:]
        assert ("tfcluster: error: h4 is down, and its servers would start on h5 beside ps:0, worker:0, which run "
                "with h4's address in their cluster spec") in again.stderr, again.stderr
        assert f"hint: run `tfcluster down {spec}`" in again.stderr, again.stderr
        train = tfcluster("train", str(spec), home=home, cwd=cwd)     # the same refusal, not "partly up"
        assert train.returncode == 3 and "partly up" not in train.stderr, train.stderr[-3000:]
        assert ("tfcluster: error: h4 is down, and its servers would start on h5 beside ps:0, worker:0"
                in train.stderr), train.stderr[-3000:]
        tags = tagged_processes()
        assert not any(":worker:1:" in tags.get(p, "") for p in bed.hosts["h5"].pids()), "started on the spare"
        down = tfcluster("down", str(spec), home=home, cwd=cwd)
        assert down.returncode == 1 and "unreachable: h4 (" in down.stderr, down.stderr    # documented: exit 1
        fresh = tfcluster("up", str(spec), home=home, cwd=cwd)
        assert fresh.returncode == 0 and "worker:1 start on spare h5 instead" in fresh.stderr, fresh.stderr
        status = tfcluster("status", str(spec), "--json", home=home, cwd=cwd)
        rows = {r["task"]: (r["host"], r["status"]) for r in json.loads(status.stdout)["tasks"]}
        assert rows == {"ps:0": ("h2", "running"), "worker:0": ("h3", "running"), "worker:1": ("h5", "running")}, rows
    finally:
        down = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert not state_path(home, spec).exists()
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(240)
def test_hosts_of_one_image_on_their_own_network_each_take_the_same_port(tmp_path, home, ssh_home, bed):
    """The README's layout, a worker per host on one port. The bed's hosts share one machine id
    (one root filesystem, as VMs cloned from one image do) but each has its own network, so its
    own ports: preflight takes them as the separate machines they are."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    h2, h3, h4 = (bed.add(n) for n in ("h2", "h3", "h4"))
    assert h3.run(["cat", "/etc/machine-id"]).stdout == h4.run(["cat", "/etc/machine-id"]).stdout
    spec = tmp_path / "same.yaml"
    spec.write_text(f"name: same\npython: {sys.executable}\nworkdir: {tmp_path / 'remote'}\n"
                    f"ssh: {{connect_timeout: 5}}\nhosts:\n  - {h2.spec()}\n  - {h3.spec()}\n  - {h4.spec()}\n"
                    f"jobs:\n  ps: {{tasks: ['h2:{PORTS[0]}']}}\n"
                    f"  worker: {{tasks: ['h3:{PORTS[1]}', 'h4:{PORTS[1]}']}}\n"
                    "train:\n  mode: between-graph\n  script: template:between_graph\n")
    check = tfcluster("plan", str(spec), "--check", home=home, cwd=cwd)
    assert check.returncode == 0, check.stderr[-3000:]
    assert "same machine" not in check.stderr


@pytest.mark.timeout(420)
def test_a_host_lost_while_up_starts_its_servers_is_said_as_a_loss_and_up_again_uses_the_spare(
        tmp_path, home, ssh_home, bed):
    """h4 dies as `up` says it starts the servers (warm: each binds on GO): its conversation
    ends, and that is a lost host (exit 3, every server of that `up` stopped), not `up ended
    early: no output` (exit 1); the `up` the hint gives then starts worker:1 on the spare."""
    from tests.helpers import kill_group, read_until, start_tfcluster
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = spec_of(tmp_path, bed, "bupk")
    proc = start_tfcluster("up", str(spec), home=home, cwd=cwd)
    try:
        seen = read_until(proc, r"Starting \d+ server", timeout=200)
        bed.kill("h4")
        rest = proc.communicate(timeout=120)[0]
    finally:
        kill_group(proc)
    out = "".join(seen) + rest
    assert proc.returncode == 3, out[-3000:]
    assert "error: host h4 was lost while its servers started (" in out and "ended early" not in out, out[-3000:]
    assert "again: a host still down then has its servers started on a spare" in out, out[-3000:]
    wait_for(lambda: not tagged_processes(), timeout=60, what="no server of that `up` left on any host")
    up = tfcluster("up", str(spec), home=home, cwd=cwd)
    try:
        assert up.returncode == 0 and "worker:1 start on spare h5 instead" in up.stderr, up.stderr[-3000:]
    finally:
        down = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert down.returncode == 0, down.stderr
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")
