"""Shared lab machines: `down` stops only the caller's processes of the caller's
cluster, forged pid records kill nothing, and readiness means our own listening socket.

Real processes, a real second Unix user (`tfcother`, tests/users.py), the real shim; the
only thing faked is a guard around os.killpg/os.kill that refuses pid <= 1, so a
regression can fail a test but never signal the whole machine.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers import LISTENER, cli_env, tagged_processes, tfcluster, wait_for
from tests.tf_launch import free_ports
from tfcluster.errors import PreflightError
from tfcluster.host import shim_ports, shim_procs
from tfcluster.launch.agent.agent import HostAgent, TaskLaunch
from tfcluster.launch.agent.bootstrap import SHIPPED
from tfcluster.launch.cluster.servers import start_detached
from tfcluster.launch.cluster.session import Session, server_tasks
from tfcluster.plan import build_plan
from tfcluster.plan.names import ClusterPaths, Tag
from tfcluster.spec import load_spec
from tfcluster.transport.local import LocalTransport
from tfcluster.ui import UI

pytestmark = [pytest.mark.timeout(120)]

PACKAGE = Path(__file__).resolve().parent.parent / "tfcluster" / "host"
RUN = "up-20261123-010203-b0b0"


@pytest.fixture
def guard(monkeypatch):
    """os.killpg/os.kill refuse pid <= 1 (kill(-1) would reach every process on the machine)
    and record every signal sent, so a test can say which groups were signalled."""
    sent = []
    real_killpg, real_kill = os.killpg, os.kill

    def killpg(pgid, sig):
        assert pgid > 1, f"killpg({pgid}, {sig}) refused by the test"
        sent.append(("group", pgid, sig))
        return real_killpg(pgid, sig)

    def kill(pid, sig):
        assert pid > 1, f"kill({pid}, {sig}) refused by the test"
        sent.append(("pid", pid, sig))
        return real_kill(pid, sig)

    monkeypatch.setattr(os, "killpg", killpg)
    monkeypatch.setattr(os, "kill", kill)
    return sent


@pytest.fixture(scope="module")
def other_python(other_user) -> str:
    """An interpreter the other user may run (the shim needs only the standard library)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            if other_user.run([candidate, "-c", "import sys; assert sys.version_info >= (3, 8)"]).returncode == 0:
                return candidate
        except OSError:
            continue
    pytest.skip("no Python >= 3.8 the other user may run")


class OtherShim:
    """The real shim in the other user's own cluster dir, run as that user."""

    def __init__(self, user, python: str, name: str = "lab") -> None:
        self.user, self.python = user, python
        self.top = f"tfc-{uuid.uuid4().hex[:8]}"
        self.paths = ClusterPaths(f"~/{self.top}/{name}")     # expanded with the user's HOME
        bindir = Path(user.home) / self.top / name / "bin"
        for shipped in SHIPPED:
            (bindir / shipped).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(PACKAGE / shipped, bindir / shipped)
        for path in [Path(user.home) / self.top, *(Path(user.home) / self.top).rglob("*")]:
            os.chown(path, user.uid, user.gid)
        self.shim = str(bindir / "shim.py")

    def call(self, command: str, request: dict):
        result = self.user.run([self.python, self.shim, command], input=json.dumps(request) + "\n")
        assert result.returncode == 0, result.stdout + result.stderr
        return json.loads(result.stdout.splitlines()[-1])

    def start(self, tag: str, argv: list[str]) -> int:
        """A detached task exactly as `tfcluster up` starts one (own session, tag, pid file)."""
        request = {"tag": tag, "argv": argv, "env": {}, "cwd": self.paths.rundir(RUN),
                   "log": self.paths.log(RUN, "ps:0", "server"), "pidfile": self.paths.pidfile(tag),
                   "cluster_dir": self.paths.root}
        return int(self.call("start", request)["pid"])

    def prefix_request(self, prefix: str) -> dict:
        return {"piddir": self.paths.piddir, "tag_prefix": prefix, "cluster_dir": self.paths.root}

    def remove(self) -> None:
        shutil.rmtree(Path(self.user.home) / self.top, ignore_errors=True)


def alive(pid: int) -> bool:
    return shim_procs.is_alive(pid)


def spec_file(path: Path, workdir: Path, ports: list[int], name: str = "lab") -> Path:
    path.write_text(f"name: {name}\nworkdir: {workdir}\nhosts:\n  - {{name: local, address: 127.0.0.1}}\n"
                    f"jobs:\n  ps: {{tasks: ['local:{ports[0]}']}}\n  worker: {{tasks: ['local:{ports[1]}']}}\n")
    return path


def foreign_listener(user, python: str, port: int) -> subprocess.Popen:
    proc = user.popen([python, "-c", LISTENER, str(port)], start_new_session=True)
    wait_for(lambda: port in shim_ports.listeners() or proc.poll() is not None, 10,
             what=f"{user.name} listening on {port}")
    assert proc.poll() is None, f"{user.name} could not listen on {port}"
    return proc


def reap(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def kill_quietly(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def test_the_host_adds_the_clusters_identity_and_tags_still_parse(tmp_path, home):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    ident = shim_procs.instance_id
    assert ident(f"{tmp_path}/a/lab") != ident(f"{tmp_path}/b/lab")          # same name, two workdirs
    assert ident("~/.tfcluster/lab") == ident(f"{home}/.tfcluster/lab")      # as the host resolves it
    assert ident(f"{tmp_path}/link/lab") == ident(f"{tmp_path}/real/lab")    # one directory, one cluster
    text = shim_procs.qualify(str(Tag("lab", RUN, "worker", 3, "server")), "~/.tfcluster/lab")
    tag = Tag.parse(text)
    assert (tag.cluster, tag.instance, tag.key) == ("lab", ident("~/.tfcluster/lab"), "worker:3")
    assert str(tag) == text and text.startswith(shim_procs.qualify("lab:", "~/.tfcluster/lab"))
    assert not text.startswith(shim_procs.qualify("lab:", f"{tmp_path}/a/lab"))
    for bad in ("", "lab", ":run:", text):
        with pytest.raises(shim_procs.ShimError):
            shim_procs.qualify(bad, "~/.tfcluster/lab")


# ------------------------------------------------------------------ (1) another user

def test_roots_down_of_a_cluster_named_like_anothers_leaves_the_other_users_tasks(
        tmp_path, home, other_user, other_python):
    spec = spec_file(tmp_path / "lab.yaml", tmp_path / "rootwork", free_ports(2))
    mine = ClusterPaths(str(tmp_path / "rootwork" / "lab"))
    other = OtherShim(other_user, other_python)
    tag = str(Tag("lab", RUN, "ps", 0, "server"))
    # Root's exact tag, as root's own server would carry it: the other user can set any
    # environment, so only the owner check keeps root's `down` off this process.
    forged_tag = shim_procs.qualify(tag, mine.root)
    forged = other_user.popen(["sleep", "300"], env=other_user.env(TFCLUSTER_JOB_ID=forged_tag),
                              start_new_session=True)
    theirs = None
    try:
        theirs = other.start(tag, ["sleep", "300"])   # the other user's `lab`, started by its shim
        wait_for(lambda: shim_procs.tag_of(forged.pid) == forged_tag, 10, what="the forged tag")
        # ... and a record in root's own pid dir naming it with the right start time and tag
        os.makedirs(shim_procs.expand(mine.piddir), mode=0o700)
        record = {"pid": forged.pid, "start_time": shim_procs.proc_stat(forged.pid)[1], "tag": forged_tag,
                  "argv": ["sleep", "300"], "log": "x.log", "started_at": 0}
        Path(mine.pidfile(tag)).write_text(json.dumps(record))

        down = tfcluster("down", str(spec), home=home, cwd=tmp_path)

        assert down.returncode == 0, down.stderr
        assert "local: nothing running" in down.stderr
        assert alive(theirs) and alive(forged.pid)
        assert shim_procs.tag_of(theirs).startswith("lab@") and shim_procs.tag_of(theirs) != forged_tag
        status = other.call("status", other.prefix_request("lab:"))
        assert [(s["pid"], s["alive"]) for s in status] == [(theirs, True)]
        # the other user's own `down` (its shim's stop) still stops its task, and only it
        stopped = other.call("stop", {**other.prefix_request("lab:"), "grace": 2})
        assert [s["pid"] for s in stopped["stopped"]] == [theirs] and stopped["survivors"] == []
        assert not alive(theirs) and alive(forged.pid)
    finally:
        reap(forged)
        kill_quietly(*([theirs] if theirs else []))
        other.remove()


# ------------------------------------------------------------------ (2) same name, same user

def start_like_up(spec: Path) -> dict[int, str]:
    """Start the spec's servers exactly as `up` does (Session.launch_for, the shim's `launch`:
    same tags, pid files and logs), running `sleep` instead of TensorFlow. pid -> tag."""
    plan = build_plan(load_spec(str(spec)))
    with Session(plan, UI(io.StringIO(), io.StringIO(), color=False)) as session:
        session.open()
        launches = [(t.key, 0, session.launch_for(t, RUN, "server", ("sleep", "300")))
                    for t in server_tasks(plan)]
        events = list(session.agents["local"].launch(launches, 0.2))
    pids = [v for _key, state, v in events if state == "started"]
    return {pid: shim_procs.tag_of(pid) for pid in pids}


def statuses(spec: Path, home: Path, cwd: Path) -> set[tuple[str, str, int | None]]:
    rows = json.loads(tfcluster("status", str(spec), "--json", home=home, cwd=cwd).stdout)["tasks"]
    return {(r["task"], r["status"], r["pid"]) for r in rows}


def running(tags: dict[int, str]) -> set[tuple[str, str, int]]:
    return {(Tag.parse(t).key, "running", p) for p, t in tags.items()}


@pytest.mark.tf
def test_two_same_named_clusters_of_one_user_survive_each_others_down(tmp_path, home):
    ports = free_ports(4)
    a = spec_file(tmp_path / "a.yaml", tmp_path / "work-a", ports[:2])   # both named `lab`
    b = spec_file(tmp_path / "b.yaml", tmp_path / "work-b", ports[2:])
    stopped = {"ps:0": ("ps:0", "stopped", None), "worker:0": ("worker:0", "stopped", None)}
    try:
        b_tasks = start_like_up(b)
        up = tfcluster("up", str(a), home=home, cwd=tmp_path)   # real TF servers
        assert up.returncode == 0, up.stderr
        assert "is up: 2 servers" in up.stderr      # b's servers were not taken for a's
        a_tasks = {p: t for p, t in tagged_processes().items() if p not in b_tasks}
        assert len(a_tasks) == 2 and len({t.split(":")[0] for t in {**a_tasks, **b_tasks}.values()}) == 2

        down_b = tfcluster("down", str(b), home=home, cwd=tmp_path)

        assert down_b.returncode == 0 and "local: stopped 2 process(es)" in down_b.stderr, down_b.stderr
        assert tagged_processes() == a_tasks
        assert statuses(a, home, tmp_path) == running(a_tasks)
        assert statuses(b, home, tmp_path) == set(stopped.values())
        b_tasks = start_like_up(b)

        down_a = tfcluster("down", str(a), home=home, cwd=tmp_path)

        assert down_a.returncode == 0 and "local: stopped 2 process(es)" in down_a.stderr, down_a.stderr
        assert tagged_processes() == b_tasks
        assert statuses(b, home, tmp_path) == running(b_tasks)
    finally:
        downs = [tfcluster("down", str(spec), home=home, cwd=tmp_path) for spec in (b, a)]
    assert [d.returncode for d in downs] == [0, 0], [d.stderr for d in downs]
    assert not tagged_processes()


# ------------------------------------------------------------------ (3) forged pid records

@pytest.fixture
def agent(home):
    a = HostAgent("local", LocalTransport(), sys.executable, "~/.tfcluster/lab")
    a.prepare()
    yield a
    a.close()


def start_task(agent: HostAgent, tag: str) -> int:
    paths = agent.paths
    t = TaskLaunch(tag, ("sleep", "300"), {}, paths.rundir(RUN), paths.log(RUN, "ps:0", "server"),
                   paths.pidfile(tag))
    events = list(agent.launch([("ps:0", 0, t)], 0.2))   # all of it: a launch left early stops its tasks
    return next(v for _key, state, v in events if state == "started")


def test_forged_pid_records_kill_nothing_untagged(agent, home, guard):
    tag = str(Tag("lab", RUN, "ps", 0, "server"))
    task = start_task(agent, tag)
    piddir = Path(shim_procs.expand(agent.paths.piddir))
    real = json.loads((piddir / Path(agent.paths.pidfile(tag)).name).read_text())
    assert real["pid"] == task and "pgid" not in real
    victim = subprocess.Popen(["sleep", "300"], start_new_session=True)   # untagged, leads its group
    try:
        victim_start = shim_procs.proc_stat(victim.pid)[1]
        forged = {
            "victim-group": {**real, "pgid": victim.pid},     # the real task, the victim's group
            "group-1": {**real, "pgid": 1},                     # would be kill(-1)
            "negative": {**real, "pid": -victim.pid, "pgid": -1},
            "garbage": {"pid": "x", "pgid": "y", "start_time": None, "tag": real["tag"]},
            "bool": {**real, "pid": True},
            "victim": {**real, "pid": victim.pid, "start_time": victim_start},  # right start, no tag
        }
        for name, record in forged.items():
            (piddir / f"{name}.pid").write_text(json.dumps(record))
        (piddir / "list.pid").write_text(json.dumps([1, 2]))
        (piddir / "started.pid").write_text(json.dumps({**real, "started_at": "x"}))
        statuses = agent.status("lab:")
        assert {(s.pid, s.alive) for s in statuses} == {(task, True), (victim.pid, False)}

        report = agent.stop("lab:", grace=2)

        assert report.stopped == ((real["tag"], task),) and report.survivors == ()
        assert victim.poll() is None, "the untagged victim was killed"
        groups = {target for kind, target, _sig in guard if kind == "group"}
        assert groups == {task}          # the live task's own group, whatever the records said
        assert not alive(task)
    finally:
        reap(victim)


def test_stop_kills_no_group_once_no_verified_member_lives(agent, guard):
    # A task whose group holds only itself: TERM ends it, and no KILL goes to its group
    # afterwards (by then nothing verified keeps the pgid from being reused).
    task = start_task(agent, str(Tag("lab", RUN, "ps", 0, "server")))

    agent.stop("lab:", grace=2)

    assert [(kind, target, sig) for kind, target, sig in guard if kind == "group"] == [
        ("group", task, signal.SIGTERM)]


# ------------------------------------------------------------------ (4) readiness

def test_wait_names_another_users_listener_instead_of_ready(agent, other_user, other_python):
    port, free = free_ports(2)
    holder = foreign_listener(other_user, other_python, port)
    try:
        tag = str(Tag("lab", RUN, "ps", 0, "server"))
        task = TaskLaunch(tag, (sys.executable, "-c", LISTENER, str(free)), {}, "~", "~/l.log",
                          agent.paths.pidfile(tag))
        events = list(agent.launch([("ps:0", port, task)], 30))
        assert [state for _key, state, _v in events] == ["started", "taken"]
        assert f"pid {holder.pid} (" in events[1][2] and events[1][2].endswith(f", user {other_user.name}")
        # the same started process, asked about its own port, is ready
        waited = list(agent.wait_ready([("ps:0", free, events[0][2])], 30))
        assert waited == [("ps:0", "ready", None)]
    finally:
        agent.stop("lab:", grace=1)
        reap(holder)


def test_a_descendant_listening_counts_as_ready_and_a_dead_server_as_exited(agent):
    port = free_ports(1)[0]
    tag = str(Tag("lab", RUN, "ps", 0, "server"))
    wrapper = ("import subprocess, sys\n"
               f"subprocess.run([sys.executable, '-c', {LISTENER!r}, '{port}'])\n")
    task = TaskLaunch(tag, (sys.executable, "-c", wrapper), {}, "~", "~/l.log", agent.paths.pidfile(tag))
    try:
        events = list(agent.launch([("ps:0", port, task)], 30))
        assert [state for _key, state, _v in events] == ["started", "ready"]
    finally:
        agent.stop("lab:", grace=1)
    quitter = TaskLaunch(tag, ("true",), {}, "~", "~/l.log", agent.paths.pidfile(tag))
    assert [s for _k, s, _v in agent.launch([("ps:0", port, quitter)], 30)] == ["started", "exited"]


@pytest.mark.tf
def test_up_reports_a_port_taken_by_another_user_with_its_holder(tmp_path, home, other_user, other_python):
    port = free_ports(2)[1]
    plan = build_plan(load_spec(str(spec_file(tmp_path / "lab.yaml", tmp_path / "work", [port - 1, port]))))
    worker = [t for t in server_tasks(plan) if t.key == "worker:0"]   # one TF server is enough
    # taken after the preflight would have passed: straight to starting the servers
    holder = foreign_listener(other_user, other_python, port)
    try:
        with Session(plan, UI(io.StringIO(), io.StringIO(), color=False)) as session:
            session.open()
            with pytest.raises(PreflightError) as caught:
                start_detached(session, worker, "up-20261123-010203-0000", timeout=60)
    finally:
        reap(holder)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"host local: port {port} for worker:0 was taken by pid {holder.pid} (")
    assert f", user {other_user.name} before the server could listen on it" in message
    assert not tagged_processes()     # the server it started was stopped again


def test_a_tag_is_read_wherever_it_sits_in_the_environment():
    """tag_of scans /proc/PID/environ for the first TFCLUSTER_JOB_ID= entry: first, middle,
    last, empty, absent, or only inside another variable's value (not a tag)."""
    var = shim_procs.TAG_VAR
    cases = [({var: "lab@1:a", "X": "1"}, "lab@1:a"), ({"X": "1", var: "lab@1:b", "Y": "2"}, "lab@1:b"),
             ({"X": "1", var: "lab@1:c"}, "lab@1:c"), ({"X": "1", var: ""}, ""),
             ({"X": f"{var}=lab@1:forged"}, None), ({"X": "1"}, None)]
    procs = [subprocess.Popen(["sleep", "60"], env=env) for env, _ in cases]
    try:
        assert [shim_procs.tag_of(p.pid) for p in procs] == [want for _, want in cases]
    finally:
        reap(*procs)


def test_down_succeeds_when_only_another_users_process_holds_a_port_of_the_spec(
        tmp_path, home, other_user, other_python):
    """Nothing of the cluster ever ran; another user listens on one of its ports. `down` said
    "not fully stopped", exit 1: untrue, and nothing down could or should do about it."""
    port = free_ports(2)[1]
    spec = spec_file(tmp_path / "lab.yaml", tmp_path / "work", [port - 1, port])
    holder = foreign_listener(other_user, other_python, port)
    try:
        down = subprocess.run([sys.executable, "-m", "tfcluster", "down", str(spec)], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path, env=cli_env(home))
    finally:
        reap(holder)
    assert down.returncode == 0, down.stderr
    assert (f"warning: 1 port(s) of the spec held by another user's process, not this cluster's: "
            f"local:{port} (pid {holder.pid} (") in down.stderr, down.stderr
    assert f"user {other_user.name})" in down.stderr
    assert "✓ cluster 'lab' is down: nothing of it runs\n" in down.stderr
