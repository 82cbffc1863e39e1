"""`down`, `status`, `up` and `train` after the spec was edited under a running cluster: a
host left without tasks or dropped from `hosts:`, a server's port changed, the workdir
changed. Real processes on the local transport and the test sshd (tests/sshd.py), and hosts
that must be separate machines on the bed (tests/netns.py).

The servers are a stand-in for tfserver.py (tests/test_down.py's STANDIN: the hold
protocol, then a listener on the task's port; no TensorFlow, so an `up` takes a second):
the spec's `python:` is a wrapper that runs it for tfserver.py, keeping tfserver.py's path
on its command line as a real server's has it, and the real interpreter for the rest."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from io import StringIO
from pathlib import Path

import pytest

from tests.helpers import LISTENER, STANDIN, state_path, tagged_processes, tfcluster, wait_for
from tests.tf_launch import free_ports
from tfcluster.errors import PreflightError
from tfcluster.host.shim_ports import listeners
from tfcluster.launch.cluster import state
from tfcluster.launch.cluster.servers import start_detached
from tfcluster.launch.cluster.session import Session, server_tasks
from tfcluster.plan import Plan, build_plan
from tfcluster.spec import load_spec
from tfcluster.ui import UI

pytestmark = [pytest.mark.timeout(180)]

PYWRAP = '''#!/bin/sh
case "$1" in */tfserver.py) exec {python} {standin} "$@";; esac
exec {python} "$@"
'''


@pytest.fixture
def cwd(tmp_path):
    d = tmp_path / "cwd"
    d.mkdir()
    return d


def wrapper(tmp: Path) -> Path:
    standin = tmp / "standin.py"
    standin.write_text(STANDIN)
    path = tmp / "pywrap"
    path.write_text(PYWRAP.format(python=sys.executable, standin=standin))
    path.chmod(0o755)
    return path


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def tasks_running() -> list[str]:
    """`job:index` of every tagged process of this test session, sorted."""
    return sorted(":".join(tag.split(":")[2:4]) for tag in tagged_processes().values())


# -- hosts the edited spec gives no task ---------------------------------------------------

def two_machine_spec(tmp: Path, h1, h2, name: str, *, jobs: str, ports: list[int]) -> Path:
    """Hosts h1 and h2: two separate machines of the bed (tests/netns.py), each with its own
    processes, ports and nftables; the same `workdir: ~/w` on both."""
    return write(tmp / f"{name}.yaml", (
        f"name: {name}\npython: {wrapper(tmp)}\nworkdir: ~/w\nssh: {{connect_timeout: 5}}\n"
        f"hosts:\n  - {h1.spec()}\n  - {h2.spec()}\n"
        f"jobs:\n  ps: {{tasks: ['h1:{ports[0]}']}}\n{jobs}"
        "train:\n  mode: between-graph\n  script: template:between_graph\n"))


def test_down_and_status_cover_hosts_the_spec_left_without_tasks_or_dropped(tmp_path, home, ssh_home, bed, cwd):
    h1, h2 = bed.add("h1"), bed.add("h2")
    p = [25000, 25001, 25002]
    listed = f"  - {h2.spec()}\n"
    both = f"  worker: {{tasks: ['h1:{p[1]}', 'h2:{p[2]}']}}\n"
    h1_only = f"  worker: {{tasks: ['h1:{p[1]}']}}\n"
    spec = two_machine_spec(tmp_path, h1, h2, "moved", jobs=both, ports=p)
    no_task = write(tmp_path / "no-task.yaml", spec.read_text().replace(both, h1_only))
    dropped = write(tmp_path / "dropped.yaml", no_task.read_text().replace(listed, ""))
    closed = write(tmp_path / "closed.yaml", no_task.read_text().replace(
        listed, f"  - {{name: h2, address: {h2.address}, ssh: {{port: 2299}}}}\n"))    # no sshd there
    try:
        assert tfcluster("up", str(spec), home=home, cwd=cwd).returncode == 0
        assert tasks_running() == ["ps:0", "worker:0", "worker:1"]

        # h2 still under `hosts:` without a task: status shows its server, down stops it,
        # with no local state at all
        status = tfcluster("status", str(no_task), "--json", home=home, cwd=cwd)
        assert status.returncode == 0, status.stderr
        rows = [(r["task"], r["host"], r["status"], r["in_spec"]) for r in json.loads(status.stdout)["tasks"]]
        assert rows == [("ps:0", "h1", "running", True), ("worker:0", "h1", "running", True),
                        ("worker:1", "h2", "running", False)]
        shown = tfcluster("status", str(no_task), home=home, cwd=cwd)
        assert ("h2: worker:1 of cluster 'moved' runs but the spec has no such task there (the spec "
                f"changed since these were started); `tfcluster down {no_task}` stops it") in shown.stderr, shown.stderr
        state_path(home, spec).unlink()
        down = tfcluster("down", str(no_task), home=home, cwd=cwd)
        assert down.returncode == 0, down.stderr
        assert "h2: stopped 1 process(es)" in down.stderr and tasks_running() == []

        # h2 gone from `hosts:`: the state says `up` started a server there; down says it
        # cannot stop it with this spec, and which spec can
        assert tfcluster("up", str(spec), home=home, cwd=cwd).returncode == 0
        status = tfcluster("status", str(dropped), home=home, cwd=cwd)
        assert ("h2: `tfcluster up` started 1 server(s) there (local state), but the spec no longer "
                "lists it") in status.stderr, status.stderr
        down = tfcluster("down", str(dropped), home=home, cwd=cwd)
        assert down.returncode == 1, down.stderr
        assert ("host h2 is not in the spec any more: `tfcluster up` started 1 server(s) there, which "
                "this spec cannot stop (it has no address for h2)") in down.stderr, down.stderr
        assert "hint: run `tfcluster down` with the spec `up` used (the one that lists host h2)" in down.stderr
        assert "nothing of it runs" not in down.stderr
        assert tasks_running() == ["worker:1"] and state_path(home, spec).exists()

        # h2 listed without tasks but off, where the state says `up` started a server: a failure
        down = tfcluster("down", str(closed), home=home, cwd=cwd)
        assert down.returncode == 1 and "unreachable: h2" in down.stderr, down.stderr
        assert tasks_running() == ["worker:1"]
    finally:
        down = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert down.returncode == 0, down.stderr
    assert tasks_running() == [] and not state_path(home, spec).exists()

    # a spare host without tasks that is off, where nothing was started: a warning, exit 0
    down = tfcluster("down", str(closed), home=home, cwd=cwd)
    assert down.returncode == 0, down.stderr
    assert "warning: h2: not reached (" in down.stderr and "the spec gives it no task" in down.stderr
    status = tfcluster("status", str(closed), home=home, cwd=cwd)
    assert status.returncode == 0 and "warning: h2: not reached (" in status.stderr, status.stderr


# -- a server's port or the workdir changed ------------------------------------------------

def local_spec(tmp: Path, name: str, ports: list[int], workdir: str) -> Path:
    return write(tmp / f"{name}.yaml", (
        f"name: {name}\npython: {wrapper(tmp)}\nworkdir: {workdir}\n"
        "hosts:\n  - {name: local, address: 127.0.0.1}\n"
        f"jobs:\n  ps: {{tasks: ['local:{ports[0]}']}}\n"
        f"  worker: {{tasks: ['local:{ports[1]}', 'local:{ports[2]}']}}\n"
        "train:\n  mode: between-graph\n  script: template:between_graph\n"))


def test_up_and_train_refuse_a_running_server_on_another_port_than_the_spec_says(tmp_path, home, cwd):
    p = free_ports(4)
    spec = local_spec(tmp_path, "port", p[:3], "~/w")
    try:
        assert tfcluster("up", str(spec), home=home, cwd=cwd).returncode == 0
        spec.write_text(spec.read_text().replace(f"'local:{p[1]}'", f"'local:{p[3]}'"))
        line = f"tfcluster: error: host local: worker:0 runs on port {p[1]}, not the spec's {p[3]}"
        for command in ("up", "train"):
            refused = tfcluster(command, str(spec), home=home, cwd=cwd)
            assert refused.returncode == 4, (command, refused.stderr)
            assert line in refused.stderr, (command, refused.stderr)
            assert f"hint: run `tfcluster down {spec}`" in refused.stderr and f"then `tfcluster up {spec}`" in refused.stderr
            assert tasks_running() == ["ps:0", "worker:0", "worker:1"]
        status = tfcluster("status", str(spec), home=home, cwd=cwd)
        assert f"`tfcluster down {spec}` stops it (by its tag), then `tfcluster up {spec}` starts it" in status.stderr
        # what status and the hint say works
        assert tfcluster("down", str(spec), home=home, cwd=cwd).returncode == 0
        assert tfcluster("up", str(spec), home=home, cwd=cwd).returncode == 0
        rows = json.loads(tfcluster("status", str(spec), "--json", home=home, cwd=cwd).stdout)["tasks"]
        assert [(r["task"], r["status"], r["port_open"], r["started_port"]) for r in rows] == [
            ("ps:0", "running", True, None), ("worker:0", "running", True, None),
            ("worker:1", "running", True, None)]
    finally:
        down = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert down.returncode == 0, down.stderr
    assert tasks_running() == []


def test_a_port_held_by_this_cluster_under_another_workdir_names_that_workdir(tmp_path, home, cwd):
    p = free_ports(3)
    spec = local_spec(tmp_path, "wd", p, "~/w1")
    moved = write(tmp_path / "moved.yaml", spec.read_text().replace("~/w1", "~/w2"))
    hint = (f"started with workdir {home}/w1, not this spec's: run `tfcluster down` with the spec "
            "that has that workdir")
    try:
        assert tfcluster("up", str(spec), home=home, cwd=cwd).returncode == 0
        down = tfcluster("down", str(moved), home=home, cwd=cwd)
        assert down.returncode == 1 and "ports still busy: local:" in down.stderr, down.stderr
        assert f"hint: local:{p[0]} is held by a server of cluster 'wd' {hint}" in down.stderr, down.stderr
        up = tfcluster("up", str(moved), home=home, cwd=cwd)
        assert up.returncode == 4 and f"port {p[0]} for ps:0 is already in use" in up.stderr, up.stderr
        assert f"hint: it looks like a server of cluster 'wd' {hint}" in up.stderr, up.stderr
        assert tasks_running() == ["ps:0", "worker:0", "worker:1"]
    finally:
        down = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert down.returncode == 0, down.stderr
    assert tasks_running() == []


def test_a_port_held_by_the_cluster_a_renamed_spec_had_names_that_cluster(tmp_path, home, cwd):
    """`name:` edited while the cluster runs: `up` of the new name finds its ports held by the old
    one's servers, and their tag says whose (down's report reads the same holder text: the
    wording test below)."""
    p = free_ports(3)
    spec = local_spec(tmp_path, "old", p, "~/w1")
    renamed = write(tmp_path / "renamed.yaml", spec.read_text().replace("name: old", "name: new"))
    try:
        assert tfcluster("up", str(spec), home=home, cwd=cwd).returncode == 0
        up = tfcluster("up", str(renamed), home=home, cwd=cwd)
        assert up.returncode == 4 and f"port {p[0]} for ps:0 is already in use" in up.stderr, up.stderr
        assert ("hint: it is ps:0 of tfcluster cluster 'old': `tfcluster down` with that cluster's spec stops "
                "it, or change the port in this spec") in up.stderr, up.stderr
        assert tasks_running() == ["ps:0", "worker:0", "worker:1"]
    finally:
        down = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert down.returncode == 0, down.stderr
    assert tasks_running() == []


# -- wording -------------------------------------------------------------------------------

def test_a_holder_of_another_cluster_is_named_by_its_tag_and_one_of_this_name_as_anothers():
    """What the port's holder says of its tag (shim_ports.describe) makes the hint: another
    cluster's task, or this name's started by another HOME or workdir (a tag of another
    instance); a holder without a tag gets none."""
    from tfcluster.plan.names import other_cluster

    holder = "pid 7 (python /opt/tfcluster/host/tfserver.py), task ps:0 of tfcluster cluster '{}'"
    assert other_cluster(holder.format("old"), "new") == (
        "ps:0 of tfcluster cluster 'old': `tfcluster down` with that cluster's spec stops it")
    assert other_cluster(holder.format("lab"), "lab").startswith(
        "ps:0 of another cluster named 'lab', started with another workdir or HOME")
    assert other_cluster("pid 7 (nc -l 2222)", "lab") is None



@pytest.mark.parametrize("tasks, verb, pronoun", [(["worker:1"], "runs", "it"),
                                                  (["worker:1", "worker:2"], "run", "them")])
def test_status_warnings_agree_with_how_many_tasks_they_name(tasks, verb, pronoun):
    from tfcluster.launch.cluster.lifecycle import TaskRow
    from tfcluster.ui import UI
    from tfcluster.ui.views import print_status

    err = StringIO()
    rows = [TaskRow(t, "h", "h:1", "running", pid=7 + i, pid_file=False, in_spec=False)
            for i, t in enumerate(tasks)]
    plan = types.SimpleNamespace(name="x", spec_path="my lab.yaml")
    plan.again = lambda verb, *words: Plan.again(plan, verb, *words)
    print_status(UI(StringIO(), err, color=False), plan, rows)
    named = ", ".join(tasks)
    assert f"h: {named} of cluster 'x' {verb} but the spec has no such task there" in err.getvalue()
    assert f"`tfcluster down 'my lab.yaml'` stops {pronoun}\n" in err.getvalue()
    assert f"h: {named} of cluster 'x' {verb} with no pid file" in err.getvalue()


def test_a_port_taken_before_readiness_by_this_cluster_under_another_workdir_names_it(tmp_path, home):
    """The race the preflight cannot see: the port was free, then a server of this cluster
    from another workdir listens there before ours does. The readiness error's hint names
    that workdir, as the preflight's does."""
    p = free_ports(3)
    plan = build_plan(load_spec(str(local_spec(tmp_path, "wd", p, "~/w2"))))
    other = home / "w1" / "wd" / "bin" / "tfserver.py"     # where a server of `workdir: ~/w1` runs from
    other.parent.mkdir(parents=True)
    other.write_text(LISTENER)
    holder = subprocess.Popen([sys.executable, str(other), str(p[0])], start_new_session=True)
    try:
        wait_for(lambda: p[0] in listeners() or holder.poll() is not None, 10, what="the holder listening")
        with Session(plan, UI(StringIO(), StringIO(), color=False)) as session:
            session.open()
            with pytest.raises(PreflightError) as caught:
                start_detached(session, [t for t in server_tasks(plan) if t.key == "ps:0"],
                               "up-20261124-010203-0000", timeout=30)
    finally:
        holder.kill()
        holder.wait(10)
    assert f"port {p[0]} for ps:0 was taken by pid {holder.pid} (" in str(caught.value)
    assert caught.value.hint == (f"it looks like a server of cluster 'wd' started with workdir {home}/w1, "
                                 "not this spec's: run `tfcluster down` with the spec that has that workdir"), str(caught.value)
    assert tasks_running() == []


def test_train_and_up_refuse_a_running_cluster_with_servers_the_spec_dropped(tmp_path, home, cwd):
    p = free_ports(3)
    spec = local_spec(tmp_path, "fewer", p, "~/w")
    fewer = write(tmp_path / "fewer-edited.yaml",
                  spec.read_text().replace(f"'local:{p[1]}', 'local:{p[2]}'", f"'local:{p[1]}'"))
    try:
        assert tfcluster("up", str(spec), home=home, cwd=cwd).returncode == 0
        train = tfcluster("train", str(fewer), home=home, cwd=cwd)
        assert train.returncode == 1, train.stderr
        assert ("tfcluster: error: cluster 'fewer' runs 1 server(s) the spec no longer has: worker:1"
                in train.stderr), train.stderr
        assert f"hint: run `tfcluster down {fewer}` (it stops every server of the cluster)" in train.stderr
        assert "partly up" not in train.stderr
        assert tasks_running() == ["ps:0", "worker:0", "worker:1"]     # nothing started or stopped
        up = tfcluster("up", str(fewer), home=home, cwd=cwd)          # not "already up"
        assert up.returncode == 1 and "already up" not in up.stderr, up.stderr
        assert "runs 1 server(s) the spec no longer has: worker:1" in up.stderr, up.stderr
        assert tasks_running() == ["ps:0", "worker:0", "worker:1"]
        down = tfcluster("down", str(fewer), home=home, cwd=cwd)      # what the hint says works
        assert down.returncode == 0, down.stderr
        assert tasks_running() == []
    finally:
        tfcluster("down", str(spec), home=home, cwd=cwd)
    assert tasks_running() == []


def test_clusters_named_alike_with_other_workdirs_keep_their_own_lock_and_state(tmp_path, home, cwd):
    """Their processes never crossed (the tags hold the workdir); the local lock and state
    were keyed by the name alone: one's `train` made the other's `up` busy, and one's
    `down` deleted the other's record of where its servers run."""
    p = free_ports(6)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = local_spec(tmp_path / "a", "lab", p[:3], "~/wa")
    b = local_spec(tmp_path / "b", "lab", p[3:], "~/wb")
    try:
        for spec in (a, b):
            assert tfcluster("up", str(spec), home=home, cwd=cwd).returncode == 0
        assert state_path(home, a) != state_path(home, b)
        assert state_path(home, a).exists() and state_path(home, b).exists()
        with state.lock(build_plan(load_spec(str(a))), "train"):      # a `train` of a runs
            assert tfcluster("up", str(b), home=home, cwd=cwd).returncode == 0
            busy = tfcluster("up", str(a), home=home, cwd=cwd)
            assert busy.returncode == 7, busy.stderr
            assert "tfcluster: error: cluster 'lab' (workdir ~/wa) is busy: pid " in busy.stderr, busy.stderr
        assert tfcluster("down", str(a), home=home, cwd=cwd).returncode == 0
        assert not state_path(home, a).exists() and state_path(home, b).exists()
        assert tasks_running() == ["ps:0", "worker:0", "worker:1"]           # b's, untouched
    finally:
        for spec in (a, b):
            tfcluster("down", str(spec), home=home, cwd=cwd)
    assert tasks_running() == [] and not state_path(home, b).exists()
