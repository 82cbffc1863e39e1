"""A lost host, produced for real: its sshd and every process started through it SIGKILLed
(dropped), or its packets dropped by an nftables table of our own (silent). Each host here has
an sshd of its own on a loopback address no other test uses, so killing or silencing it
touches nothing else. Bounds are the design's targets times two (a loaded machine): a dropped
host declared lost in 10 s, a silent one in 60 s (docs/design/host-loss.md)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
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
from tests.sshd import kill_host, lone
from tfcluster.launch.cluster.hostloss import HostLosses
from tfcluster.transport.ssh import SshTransport
from tfcluster.transport.ssh_config import SshOptions

pytestmark = [pytest.mark.ssh, pytest.mark.alone]   # detection within seconds: judged on a machine not shared with other tests

NFT = shutil.which("nft") or next((p for p in ("/usr/sbin/nft", "/sbin/nft") if os.access(p, os.X_OK)), None)
DROPPED_ADDRESS = "127.0.0.27"
SILENT_ADDRESS = "127.0.0.28"
TABLE = f"tfcluster_test_silent_{os.getpid()}"


@pytest.fixture
def nft():
    if os.geteuid() != 0:
        pytest.skip("dropping packets needs root (CI runs as root)")
    if NFT is None or subprocess.run([NFT, "list", "tables"], capture_output=True, timeout=10, check=False).returncode:
        pytest.skip("nftables is not installed or not usable here (scripts/test.sh installs it)")
    yield NFT
    _unsilence()          # whatever the test did


@contextmanager
def silenced(address: str, port: int):
    """Every packet to or from `address`:`port` dropped on input, both ways: the host is still
    there, its sshd and tasks run, and nothing it sends or is sent arrives."""
    rules = (f"table inet {TABLE} {{\n"
             f"  chain input {{\n    type filter hook input priority -10; policy accept;\n"
             f"    ip daddr {address} tcp dport {port} drop\n"
             f"    ip saddr {address} tcp sport {port} drop\n  }}\n}}\n")
    subprocess.run([NFT, "-f", "-"], input=rules, text=True, check=True, timeout=10)
    try:
        yield
    finally:
        _unsilence()


def _unsilence() -> None:
    subprocess.run([NFT, "delete", "table", "inet", TABLE], capture_output=True, timeout=10, check=False)


# -- the transport: keepalives that want an answer ------------------------------------------

def test_silent_connection_is_closed_and_said_within_its_bound(nft, sshd_factory, ssh_home):
    server = lone(sshd_factory, ssh_home, SILENT_ADDRESS)
    t = SshTransport("h9", SILENT_ADDRESS, SshOptions(port=server.port, connect_timeout=5))
    t.keepalive_interval, t.silent_after = 1.0, 4.0
    try:
        proc = t.spawn(["sleep", "60"])
        watch = t._watches[0]
        wait_for(lambda: watch.probes >= 3, timeout=10, what="three probes")
        assert t.lost is None and not proc.chan.closed   # quiet, answered: alive
        with silenced(SILENT_ADDRESS, server.port):
            began = time.monotonic()
            assert proc.read() == b""                   # the channel ends as a dropped one does
            took = time.monotonic() - began
            assert t.lost == "silent for 4s, no answer to keepalives"
            assert 3.5 <= took <= 8, took
    finally:
        t.close()


def test_server_alive_settings_of_the_ssh_config_set_the_keepalive(nft, sshd_factory, ssh_home):
    """As ssh(1) reads them: a probe after ServerAliveInterval quiet seconds, the host given up
    after ServerAliveCountMax unanswered ones."""
    server = lone(sshd_factory, ssh_home, SILENT_ADDRESS)
    (ssh_home / "config").write_text(f"Host {SILENT_ADDRESS}\n  ServerAliveInterval 1\n"
                                     f"  ServerAliveCountMax 2\n")
    t = SshTransport("h9", SILENT_ADDRESS, SshOptions(port=server.port, connect_timeout=5))
    try:
        proc = t.spawn(["sleep", "60"])
        with silenced(SILENT_ADDRESS, server.port):
            began = time.monotonic()
            assert proc.read() == b""
            assert t.lost == "silent for 3s, no answer to keepalives"
            assert time.monotonic() - began <= 6
    finally:
        t.close()


def test_busy_connection_is_never_called_silent(sshd_factory, ssh_home):
    """Output counts as heard: a connection whose host only streams never gets a probe."""
    server = lone(sshd_factory, ssh_home, SILENT_ADDRESS)
    t = SshTransport("h9", SILENT_ADDRESS, SshOptions(port=server.port, connect_timeout=5))
    t.keepalive_interval, t.silent_after = 1.0, 3.0
    try:
        proc = t.spawn(["sh", "-c", "for i in $(seq 40); do echo $i; sleep 0.1; done"])
        out = b""
        while chunk := proc.read():
            out += chunk
        assert out.split()[-1] == b"40" and t.lost is None
        assert all(w.probes == 0 for w in t._watches)
    finally:
        t.close()


def test_idle_connection_is_probed_and_stays(sshd_factory, ssh_home):
    server = lone(sshd_factory, ssh_home, SILENT_ADDRESS)
    t = SshTransport("h9", SILENT_ADDRESS, SshOptions(port=server.port, connect_timeout=5))
    t.keepalive_interval, t.silent_after = 0.5, 2.0
    try:
        t.connect()
        watch = t._watches[0]
        wait_for(lambda: watch.probes >= 4, timeout=10, what="four probes")
        assert t.lost is None and t.run(["echo", "ok"]).stdout == b"ok\n"
    finally:
        t.close()


HOLDER = """
import sys, time
from tfcluster.transport.ssh import SshTransport
from tfcluster.transport.ssh_config import SshOptions
t = SshTransport("h9", sys.argv[1], SshOptions(port=int(sys.argv[2]), connect_timeout=5))
t.keepalive_interval, t.silent_after = 1.0, 3.0
chan = t.spawn(["sleep", "60"])
print("ready", flush=True)
sys.stdin.readline()
time.sleep(1.5)            # the watcher's first looks after SIGCONT
print(t.lost, chan.chan.closed, flush=True)
t.close()
"""


def test_a_stopped_launcher_does_not_call_its_hosts_silent(sshd_factory, ssh_home, home):
    """Ctrl-Z, a suspended laptop: the launcher's clock jumps, the host said nothing because
    nobody asked. The watcher asks again before it judges."""
    server = lone(sshd_factory, ssh_home, SILENT_ADDRESS)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, SILENT_ADDRESS, str(server.port)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "HOME": str(home)})
    try:
        assert holder.stdout.readline() == "ready\n"
        holder.send_signal(signal.SIGSTOP)
        time.sleep(5)          # the fault itself: stopped past silent_after
        holder.send_signal(signal.SIGCONT)
        out, _ = holder.communicate("go\n", timeout=30)
        assert out == "None False\n"
    finally:
        holder.kill()
        holder.wait(10)


def test_dropped_host_is_lost_after_the_grace_and_a_reopened_one_is_not(sshd_factory, ssh_home):
    server = lone(sshd_factory, ssh_home, DROPPED_ADDRESS)
    t = SshTransport("h8", DROPPED_ADDRESS, SshOptions(port=server.port, connect_timeout=5))
    losses = HostLosses(grace=1.5)
    try:
        t.connect()
        for c in t.connections:          # the connection drops; sshd still listens: re-opened
            c.transport.sock.shutdown(2)
        wait_for(lambda: not any(c.active() for c in t.connections), timeout=5, what="the drop")
        assert losses.judge("h8", t, ("worker:1",), time.monotonic()) == (None, False)
        assert t.run(["echo", "back"]).stdout == b"back\n"
        kill_host(server)
        wait_for(lambda: not any(c.active() for c in t.connections), timeout=5, what="the death")
        noticed = time.monotonic()
        verdict, first = losses.judge("h8", t, ("worker:1",), noticed)
        took = time.monotonic() - noticed
        assert first and 1.5 <= took < 3, took
        assert verdict.line == ("h8 lost: its SSH connection dropped and could not be re-opened in "
                                "1.5s: connection refused (worker:1)")
        assert losses.judge("h8", t, ("worker:1",), time.monotonic()) == (verdict, False)
        assert losses.settled(0) is verdict
    finally:
        t.close()


# -- a train run ---------------------------------------------------------------------------

def two_host_spec(tmp: Path, bed, name: str) -> Path:
    """h2 (ps), h3 (worker:0) and h4 (worker:1): separate hosts of the bed (tests/netns.py)."""
    hosts = "".join(f"  - {bed.add(n).spec()}\n" for n in ("h2", "h3", "h4"))
    text = (f"name: {name}\npython: {sys.executable}\nworkdir: {tmp / 'remote'}\n"
            f"ssh: {{connect_timeout: 5}}\nhosts:\n{hosts}"
            "jobs:\n  ps: {tasks: ['h2:25000']}\n  worker: {tasks: ['h3:25001', 'h4:25002']}\n"
            "train:\n  mode: between-graph\n  script: template:between_graph\n"
            "  args: ['--steps', '5000000', '--log_every', '20', '--min_step_time', '0.05']\n"
            "  restart: {policy: on-failure, max_restarts: 3}\n")
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


def lines_until(proc: subprocess.Popen, pattern: str, timeout: float) -> tuple[float, list[str]]:
    """Seconds until a line matching `pattern`, and the lines read."""
    began = time.monotonic()
    lines = read_until(proc, pattern, timeout)
    return time.monotonic() - began, lines


def assert_ended_clean(proc: subprocess.Popen, cwd: Path, how: str, held: str) -> None:
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 3, rest[-3000:]
    assert re.search(rf"tfcluster: error: h4 lost: {how} \({held}\)", rest), rest[-3000:]
    doc = manifest(only_run(cwd / "runs"))
    assert doc["exit_code"] == 3 and doc["hosts_lost"]["h4"]["tasks"] == [held]
    assert re.match(how, doc["hosts_lost"]["h4"]["how"])
    worker = doc["tasks"][held]
    assert re.match(how, worker["host_lost"]) and worker["script"]["restarts"] == 0
    assert re.search(rf"^{held} +h4 +lost +0 ", rest, re.MULTILINE), rest[-3000:]    # the summary's row


@pytest.mark.tf
@pytest.mark.timeout(360)
def test_train_names_a_dropped_host_lost_within_ten_seconds(tmp_path, home, ssh_home, bed):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = start_tfcluster("train", str(two_host_spec(tmp_path, bed, "hdrop")), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:1 .*step=", timeout=200)
        bed.kill("h4")      # every process on it, then its link: its address answers nothing
        how = r"its SSH connection dropped and could not be re-opened in 3s: .+"
        took, _ = lines_until(proc, rf"h4 lost: {how} \(worker:1\)", timeout=60)
        assert took <= 10, took
        assert_ended_clean(proc, cwd, how, "worker:1")
    finally:
        kill_group(proc)
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.tf
@pytest.mark.timeout(400)
def test_train_names_a_silent_host_lost_within_sixty_seconds(tmp_path, home, ssh_home, bed):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = start_tfcluster("train", str(two_host_spec(tmp_path, bed, "hsilent")), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:1 .*step=", timeout=200)
        bed.silence("h4")   # its packets dropped, its processes running on
        how = r"silent for 20s, no answer to keepalives"
        took, _ = lines_until(proc, rf"h4 lost: {how} \(worker:1\)", timeout=90)
        assert took <= 60, took
        assert_ended_clean(proc, cwd, how, "worker:1")
    finally:
        kill_group(proc)
    # the silent host's shims stop their tasks once the launcher's heartbeats stop (30 s)
    wait_for(lambda: not tagged_processes(), timeout=90, what="no task left running")
