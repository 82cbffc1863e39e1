"""Reachability: the shim's `reach` against real loopback sockets, the
check failing for real over SSH on hosts whose addresses only ssh understands, and the
spec refusing a cluster that mixes loopback with other addresses."""
from __future__ import annotations

import io
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import tagged_processes, tfcluster, wait_for
from tests.tf_launch import free_ports
from tfcluster.host import shim_net
from tfcluster.errors import PreflightError
from tfcluster.launch.cluster.reach import Failure, _error, can_connect, check_reachability
from tfcluster.launch.cluster.session import Session
from tfcluster.plan import build_plan
from tfcluster.spec import load_spec
from tfcluster.ui import UI

pytestmark = [pytest.mark.timeout(120)]

SHIM = Path(__file__).resolve().parent.parent / "tfcluster" / "host" / "shim.py"
UNRESOLVABLE = "gpu-a.invalid"      # RFC 6761: never resolves


def plain_bindable(port: int) -> bool:
    """Bindable without SO_REUSEADDR: no listener and no TIME_WAIT left on the port."""
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


@pytest.fixture
def refused_port():
    """A port bound but not listening: a connection to it is refused, and nobody else takes it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()


@pytest.fixture
def full_port():
    """A listener whose accept queue is full: the kernel drops further SYNs (a real timeout)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    held = []
    for _ in range(8):
        c = socket.socket()
        c.settimeout(0.3)
        try:
            c.connect(("127.0.0.1", port))
            held.append(c)
        except OSError:
            c.close()
            break
    else:
        pytest.fail("the accept queue never filled")
    yield port
    for c in held:
        c.close()
    listener.close()


# ------------------------------------------------------------------ shim_net in-process

def test_probe_names_each_cause(refused_port, full_port):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        open_port = listener.getsockname()[1]
        assert shim_net.probe("127.0.0.1", open_port, 2.0) is None
        assert shim_net.probe("127.0.0.1", refused_port, 2.0) == "connection refused"
        assert shim_net.probe(UNRESOLVABLE, open_port, 2.0) == "name does not resolve"
        assert shim_net.probe("127.0.0.1", full_port, 0.5) == "timed out after 0.5s"


def test_probe_all_answers_every_target_in_parallel(refused_port, full_port):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        targets = [["127.0.0.1", port], ["127.0.0.1", refused_port], [UNRESOLVABLE, port]]
        targets += [["127.0.0.1", full_port]]
        t0 = time.monotonic()
        results = shim_net.probe_all(targets, 1.0)
        took = time.monotonic() - t0
    assert results == {f"127.0.0.1:{port}": None, f"127.0.0.1:{refused_port}": "connection refused",
                       f"{UNRESOLVABLE}:{port}": "name does not resolve",
                       f"127.0.0.1:{full_port}": "timed out after 1s"}
    assert took < 3.0, took     # one timeout, not the sum of them


def test_probe_all_opens_more_connections_than_it_holds_at_once_and_frees_them(refused_port):
    """More targets than MAX_INFLIGHT, on several loopback addresses, half of them refused:
    every answer right, and no socket left open afterwards."""
    listeners = []
    try:
        for address in ("127.0.0.1", "127.0.0.2", "127.0.0.3"):
            for _ in range(2):
                s = socket.socket()
                s.bind((address, 0))
                s.listen(1024)
                listeners.append(s)
        open_targets = [[s.getsockname()[0], s.getsockname()[1]] for s in listeners]
        targets = (open_targets * 60)[:shim_net.MAX_INFLIGHT + 100]
        targets += [["127.0.0.1", refused_port], ["127.0.0.2", refused_port]] * 50
        fds = len(os.listdir("/proc/self/fd"))
        results = shim_net.probe_all(targets, 5.0)
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        for s in listeners:
            s.close()
    want = {f"{a}:{p}": None for a, p in open_targets}
    want.update({f"127.0.0.{i}:{refused_port}": "connection refused" for i in (1, 2)})
    assert results == want


def test_a_target_whose_first_address_refuses_is_tried_on_the_next():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        results = {}
        inet = (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        shim_net._connect_all([("k", [(*inet, ("127.0.0.7", port)), (*inet, ("127.0.0.1", port))]),
                               ("r", [(*inet, ("127.0.0.7", port))])], results, 2.0)
    assert results == {"k": None, "r": "connection refused"}


def test_a_busy_port_is_reported_with_its_holder_not_fatal():
    with socket.socket() as mine:
        mine.bind(("0.0.0.0", 0))
        mine.listen(1)
        busy = mine.getsockname()[1]
        free = free_ports(1)[0]
        sockets, problems = shim_net.listen([busy, free])
        try:
            assert list(sockets) == [free]
            assert problems[str(busy)].startswith(f"pid {os.getpid()} (")
        finally:
            shim_net.Acceptor(sockets.values()).close()


def test_listener_is_dual_stack_and_leaves_the_port_clean():
    port = free_ports(1)[0]
    sockets, busy = shim_net.listen([port])
    assert not busy
    acceptor = shim_net.Acceptor(sockets.values())
    try:
        for address in ("127.0.0.1", "::1", "127.0.0.2"):
            assert shim_net.probe(address, port, 2.0) is None, address
        wait_for(lambda: len(acceptor.accepted) == 3, 5, what="three accepted connections")
    finally:
        acceptor.close()
    assert plain_bindable(port)   # closed with a reset: no TIME_WAIT that would stop a TF server


# ------------------------------------------------------------------ the shim process

class ShimReach:
    """`python shim.py reach` as shipped (siblings imported from its own directory)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SHIM), "reach"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, obj) -> None:
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def answer(self, timeout: float = 20.0) -> dict:
        line = self.lines.get(timeout=timeout)
        assert line is not None, self.proc.stderr.read().decode()
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)


def test_reach_listens_connects_and_closes_when_stdin_ends(refused_port):
    port = free_ports(1)[0]
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        busy = taken.getsockname()[1]
        shim = ShimReach()
        try:
            shim.send({"listen": [port, busy], "lifetime": 60})
            first = shim.answer()
            assert first["listening"] == [port]
            assert first["busy"][str(busy)].startswith(f"pid {os.getpid()} (")
            shim.send({"targets": [["127.0.0.1", port], ["localhost", port], ["::1", port],
                                   ["127.0.0.1", refused_port], [UNRESOLVABLE, port]], "timeout": 2})
            assert shim.answer()["results"] == {
                f"127.0.0.1:{port}": None, f"localhost:{port}": None, f"::1:{port}": None,
                f"127.0.0.1:{refused_port}": "connection refused",
                f"{UNRESOLVABLE}:{port}": "name does not resolve"}
            assert not plain_bindable(port)       # still listening until stdin ends
            shim.proc.stdin.close()
            assert shim.proc.wait(5) == 0
        finally:
            shim.close()
    assert plain_bindable(port)


def test_reach_closes_its_listeners_by_itself_when_the_launcher_goes_silent():
    port = free_ports(1)[0]
    shim = ShimReach()
    try:
        shim.send({"listen": [port], "lifetime": 1.5})
        assert shim.answer()["listening"] == [port]
        assert shim.proc.wait(10) == 0          # stdin still open: the lifetime ended it
    finally:
        shim.close()
    assert plain_bindable(port)


def test_reach_with_targets_in_the_request_connects_only(refused_port):
    shim = ShimReach()
    try:
        shim.send({"targets": [["127.0.0.1", refused_port]], "timeout": 1})
        assert shim.answer() == {"results": {f"127.0.0.1:{refused_port}": "connection refused"}}
        assert shim.proc.wait(5) == 0
    finally:
        shim.close()


# ------------------------------------------------------------------ mixed loopback (spec)

def write_to(path, text: str):
    path.write_text(text)
    return path


def test_plan_refuses_a_cluster_mixing_loopback_with_other_addresses(tmp_path, home):
    spec = tmp_path / "mix.yaml"
    spec.write_text("name: mix\nhosts:\n  - {name: gpu0, address: 10.1.0.11}\n"
                    "  - {name: me, address: localhost}\n"
                    "  - {name: spare, address: 127.0.0.1}\n"
                    "jobs:\n  ps: {count: 1, hosts: [me], port: 2222}\n"
                    "  worker: {count: 1, hosts: [gpu0], port: 2300}\n")
    result = tfcluster("plan", str(spec), home=home, cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"tfcluster: error: {spec}:4: hosts[1].address: host me is at loopback address localhost "
        f"but host gpu0 is at 10.1.0.11: tasks on gpu0 would dial localhost and reach themselves, "
        f"not me",
        "hint: give host me an address the other hosts reach (its hostname or IP), or put every "
        "task on loopback"]
    # loopback in other words: IPv4-mapped, and a rooted name (which is also a valid address)
    for address in ("'::ffff:127.0.0.1'", "localhost."):
        other = spec.read_text().replace("address: localhost}", f"address: {address}}}")
        mixed = tfcluster("plan", str(write_to(tmp_path / "mix2.yaml", other)), home=home, cwd=tmp_path, timeout=60)
        assert mixed.returncode == 2 and "would dial" in mixed.stderr, (address, mixed.stderr)
    # A loopback host that runs no task mixes nothing.
    spec.write_text(spec.read_text().replace("hosts: [me]", "hosts: [gpu0]"))
    assert tfcluster("plan", str(spec), home=home, cwd=tmp_path, timeout=60).returncode == 0


# ------------------------------------------------------------------ for real, over SSH

def alias_spec(tmp_path: Path, sshd, ssh_home: Path, checks: str = "") -> tuple[Path, list[int]]:
    """Two SSH hosts whose addresses are ~/.ssh/config aliases: ssh reaches them, but a TF
    task would dial `gpu-a:PORT`, which does not resolve."""
    (ssh_home / "config").write_text("Host gpu-a\n  HostName 127.0.0.2\nHost gpu-b\n  HostName 127.0.0.3\n")
    ports = free_ports(3)
    spec = tmp_path / "alias.yaml"
    spec.write_text(
        f"name: alias\npython: {sys.executable}\nworkdir: {tmp_path / 'remote'}\n"
        f"ssh:\n  port: {sshd.port}\n  connect_timeout: 5\n"
        "hosts:\n  - {name: gpu-a, address: gpu-a}\n  - {name: gpu-b, address: gpu-b}\n"
        f"jobs:\n  ps: {{tasks: ['gpu-a:{ports[0]}']}}\n"
        f"  worker: {{tasks: ['gpu-a:{ports[1]}', 'gpu-b:{ports[2]}']}}\n"
        "train:\n  mode: between-graph\n  script: template:between_graph\n  args: ['--steps', '20']\n"
        + checks)
    return spec, ports


def shims_of(workdir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(workdir) in arg and arg.endswith("shim.py") for arg in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


@pytest.mark.ssh
def test_train_exits_4_naming_host_task_and_address_when_an_alias_does_not_resolve(
        tmp_path, home, ssh_home, sshd):
    spec, (p0, p1, p2) = alias_spec(tmp_path, sshd, ssh_home)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = tfcluster("train", str(spec), home=home, cwd=cwd, timeout=120)
    assert result.returncode == 4, result.stdout[-3000:] + result.stderr[-3000:]
    err = result.stderr
    assert (f"tfcluster: error: host gpu-a cannot reach ps:0 at gpu-a:{p0}: name does not resolve"
            in err.splitlines()), err
    assert "hint: gpu-a must resolve on every host, as the tasks dial it (an ~/.ssh/config alias " \
           "only works for ssh)" in err
    for host in ("gpu-a", "gpu-b"):       # every failing pair is listed
        for task, address in (("ps:0", f"gpu-a:{p0}"), ("worker:0", f"gpu-a:{p1}"),
                              ("worker:1", f"gpu-b:{p2}")):
            assert f"  host {host} cannot reach {task} at {address}: name does not resolve" in err
    assert "6 failing pairs:" in err
    assert "Checking that 2 host(s) reach 3 task address(es)" in err
    assert "Starting" not in err + result.stdout          # no server, no script
    # Nothing left running: no task, no shim of this cluster, no listener on a task port.
    assert not tagged_processes()
    wait_for(lambda: not shims_of(tmp_path / "remote"), 10, what="the reach shims to exit")
    assert all(plain_bindable(p) for p in (p0, p1, p2))


@pytest.mark.ssh
def test_plan_check_reports_it_and_the_switch_turns_it_off(tmp_path, home, ssh_home, sshd):
    spec, (p0, _, _) = alias_spec(tmp_path, sshd, ssh_home)
    result = tfcluster("plan", str(spec), "--check", home=home, cwd=tmp_path, timeout=120)
    assert result.returncode == 4, result.stderr[-3000:]
    assert f"tfcluster: error: host gpu-a cannot reach ps:0 at gpu-a:{p0}: name does not resolve" in result.stderr

    spec, _ = alias_spec(tmp_path, sshd, ssh_home, checks="  checks: {reachability: false}\n")
    result = tfcluster("plan", str(spec), "--check", home=home, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "preflight passed" in result.stderr
    assert "reach" not in result.stderr
    wait_for(lambda: not shims_of(tmp_path / "remote"), 10, what="the shims to exit")


# ------------------------------------------------------------------ the package side, locally

def local_plan(tmp_path: Path, mode: str = "between-graph", ports=None, address: str = "127.0.0.1"):
    ports = ports or free_ports(3)
    spec = tmp_path / "loc.yaml"
    jobs = (f"  ps: {{tasks: ['local:{ports[0]}']}}\n" if mode != "mirrored" else "") + \
        f"  worker: {{tasks: ['local:{ports[1]}', 'local:{ports[2]}']}}\n"
    spec.write_text(f"name: loc\nworkdir: {tmp_path / 'remote'}\nhosts:\n  - {{name: local, address: '{address}'}}\n"
                    f"jobs:\n{jobs}train:\n  mode: {mode}\n")
    return spec, build_plan(load_spec(str(spec)))


def test_an_ipv6_task_nothing_answers_at_is_named_with_its_bracketed_address(tmp_path, home):
    """On IPv6's loopback: worker:1 counted as served already, so no rehearsal listener
    stands in for it, and nothing listens at its port: the check names it at `[::1]:PORT`."""
    ports = free_ports(3)
    _, plan = local_plan(tmp_path, ports=ports, address="::1")
    with Session(plan, UI(io.StringIO(), io.StringIO())) as session:
        session.open()
        with pytest.raises(PreflightError) as refused:
            check_reachability(session, served={"worker:1"}, timeout=2)
    assert refused.value.message == f"host local cannot reach worker:1 at [::1]:{ports[2]}: connection refused"
    assert refused.value.hint.startswith(f"nothing listens at [::1]:{ports[2]} as seen from local: a firewall "
                                         "rejects the port, or ::1 names another machine"), refused.value.hint


def test_can_connect_reports_each_target_without_listening(tmp_path, home, refused_port):
    _, plan = local_plan(tmp_path)
    with socket.socket() as listener, Session(plan, UI(io.StringIO(), io.StringIO())) as session:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        session.open()
        assert can_connect(session, "local", [("127.0.0.1", port), ("127.0.0.1", refused_port),
                                              (UNRESOLVABLE, port)], timeout=2) == {
            f"127.0.0.1:{port}": None, f"127.0.0.1:{refused_port}": "connection refused",
            f"{UNRESOLVABLE}:{port}": "name does not resolve"}


def test_a_port_held_by_another_process_is_exit_4_where_the_scripts_would_bind_it(tmp_path, home):
    """Mirrored mode: the scripts bind their own ports, which no server preflight covers;
    the rehearsal listener finds the one taken."""
    ports = free_ports(3)
    with socket.socket() as squatter:
        squatter.bind(("0.0.0.0", ports[2]))
        squatter.listen(1)
        spec, _ = local_plan(tmp_path, "mirrored", ports)
        result = tfcluster("plan", str(spec), "--check", home=home, cwd=tmp_path, timeout=60)
    assert result.returncode == 4, result.stderr
    assert f"tfcluster: error: host local: port {ports[2]} of worker:1 is already in use (pid {os.getpid()} (" \
        in result.stderr
    assert all(plain_bindable(p) for p in ports[:2])


@pytest.mark.parametrize("reason,hint", [
    ("connection refused", "nothing listens at 10.0.0.1:2222 as seen from b: a firewall rejects the "
                           "port, or 10.0.0.1 names another machine than host a"),
    ("timed out after 5s", "a firewall drops the packets from b to 10.0.0.1:2222 (or the address "
                           "is not routable from there)"),
    ("name does not resolve", "10.0.0.1 must resolve on every host"),
    ("no route to host", "check the routes and firewalls between b and a"),
])
def test_each_cause_gets_its_hint(tmp_path, reason, hint):
    spec = tmp_path / "ab.yaml"
    spec.write_text("name: ab\nhosts:\n  - {name: a, address: 10.0.0.1}\n  - {name: b, address: 10.0.0.2}\n"
                    "jobs:\n  ps: {tasks: ['a:2222']}\n  worker: {tasks: ['b:2300']}\n")
    plan = build_plan(load_spec(str(spec)))
    one = _error([Failure("b", "ps:0", "10.0.0.1:2222", reason)], plan)
    assert one.message == f"host b cannot reach ps:0 at 10.0.0.1:2222: {reason}"
    assert one.hint.startswith(hint) and one.hint.endswith("train.checks.reachability: false to skip this check")
    assert one.exit_code == 4 and one.details is None
    two = _error([Failure("b", "ps:0", "10.0.0.1:2222", reason), Failure("a", "worker:0", "10.0.0.2:2300", reason)], plan)
    assert two.details.splitlines() == ["2 failing pairs:", f"  {one.message}",
                                        f"  host a cannot reach worker:0 at 10.0.0.2:2300: {reason}"]
