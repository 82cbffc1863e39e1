"""A ConnectError's cause, from what real sockets give, and the one decision made on it: which
hosts are down before a run begins (launch/cluster/deadhosts.py), taken from the cause, never
from the message's words. Only loopback and 198.18.0.0/15 addresses, the latter inside a
network namespace of the test's own (its routes go with it)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from tests.helpers import connect_error
from tests.sshd import Target
from tfcluster.errors import Cause, ConnectError
from tfcluster.launch.cluster.deadhosts import DOWN_CAUSES, around_dead_hosts
from tfcluster.launch.cluster.hostpool import HostPool
from tfcluster.plan import build_plan
from tfcluster.spec import load_spec
from tfcluster.transport.ssh_config import SYSTEM_CONFIG_VAR, SshOptions

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def dial(home, monkeypatch, transports):
    """connect() to address:port with no ssh config of the machine's: the ConnectError."""
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.setenv(SYSTEM_CONFIG_VAR, "")

    def connect(address: str, port: int, timeout: float = 2.0) -> ConnectError:
        return connect_error(transports(Target("gpu0", address, SshOptions(port=port, connect_timeout=timeout))))
    return connect


def test_a_closed_port_is_refused(dial):
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]           # bound, never listening: the kernel answers RST
        err = dial("127.0.0.2", port)
    assert err.cause is Cause.REFUSED and err.cause in DOWN_CAUSES
    assert err.message == f"host gpu0 (127.0.0.2:{port}): connection refused (is sshd running on that port?)"


def _serve(answer: bytes | None):
    """A server on 127.0.0.1 that is no sshd: each connection gets `answer` after the first
    bytes it sends (a web server's error to a line that is no request), or nothing, held open."""
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    held = []

    def loop():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            if answer is not None:
                try:
                    conn.settimeout(5)
                    conn.recv(1024)
                    conn.sendall(answer)
                except OSError:
                    pass
                conn.close()

    threading.Thread(target=loop, daemon=True).start()
    return server, held


def test_a_port_that_speaks_another_protocol_is_said_so_not_blamed_on_maxstartups(dial):
    server, held = _serve(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    port = server.getsockname()[1]
    try:
        err = dial("127.0.0.1", port)
    finally:
        server.close()
    assert err.cause is Cause.HANDSHAKE, err.message
    assert err.message == (f"host gpu0 (127.0.0.1:{port}): port {port} answers, but not as an SSH server "
                           f"(it said 'HTTP/1.1 400 Bad Request')"), err.message
    assert err.hint == "check the host's ssh.port (or Port in ~/.ssh/config)"


def test_a_port_that_accepts_and_says_nothing_is_no_handshake_within_the_timeout(dial):
    server, held = _serve(None)
    port = server.getsockname()[1]
    try:
        err = dial("127.0.0.1", port, timeout=1.0)
    finally:
        server.close()
        for conn in held:
            conn.close()
    assert err.cause is Cause.HANDSHAKE, err.message
    assert err.message == f"host gpu0 (127.0.0.1:{port}): no SSH handshake within 1s", err.message


def test_a_connect_nobody_answers_times_out(dial):
    """A full accept queue drops the SYNs beyond it, as a powered-off machine's address leaves
    them unanswered: the TCP connect times out, before any SSH is spoken."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=2):     # fills the queue
            err = dial("127.0.0.1", port, timeout=0.5)
    assert err.cause is Cause.TIMEOUT and err.cause in DOWN_CAUSES
    assert err.message == f"host gpu0 (127.0.0.1:{port}): unreachable: connect timed out after 0.5s"


def test_a_listener_that_never_speaks_ssh_is_no_dead_host(dial):
    """The TCP connect succeeds; the handshake's timeout is the host's sshd's, not a dead host."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        err = dial("127.0.0.1", port, timeout=0.5)
    assert err.cause is Cause.HANDSHAKE and err.cause not in DOWN_CAUSES
    assert err.message.startswith(f"host gpu0 (127.0.0.1:{port}): "), err.message
    assert "SSH handshake" in err.message, err.message


# In a network namespace of its own, made for this process alone: no default route (every
# address is ENETUNREACH but those routed), an `unreachable` route (EHOSTUNREACH, what the last
# router or our own ARP says of a machine that is gone) and a `blackhole` one (EINVAL: a local
# rule that discards, which says nothing of the host).
IN_NAMESPACE = textwrap.dedent("""
    import json, os, subprocess, sys
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "route", "add", "unreachable", "198.18.255.0/24"], check=True)
    subprocess.run(["ip", "route", "add", "blackhole", "198.18.254.0/24"], check=True)
    from tfcluster.errors import ConnectError
    from tfcluster.transport.ssh import SshTransport
    from tfcluster.transport.ssh_config import SshOptions
    out = {}
    for address in sys.argv[1:]:
        t = SshTransport("gpu0", address, SshOptions(port=22, connect_timeout=2.0))
        try:
            t.connect()
            out[address] = None
        except ConnectError as e:
            out[address] = [e.cause.value, e.message]
        finally:
            t.close()
    print(json.dumps(out))
""")


def in_own_namespace(home, *addresses: str) -> dict:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1)")
    flags = ["--net"] if os.geteuid() == 0 else ["--net", "--map-root-user"]
    env = {**os.environ, "HOME": str(home), SYSTEM_CONFIG_VAR: "", "PYTHONPATH": os.getcwd()}
    env.pop("SSH_AUTH_SOCK", None)
    probe = subprocess.run([unshare, *flags, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace: {probe.stderr.decode().strip()}")
    done = subprocess.run([unshare, *flags, sys.executable, "-c", IN_NAMESPACE, *addresses],
                          capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_no_route_to_the_host_is_unreachable_and_a_blackhole_is_not(home):
    got = in_own_namespace(home, "198.18.255.7", "198.18.252.7", "198.18.254.7")
    assert got["198.18.255.7"] == ["unreachable", "host gpu0 (198.18.255.7:22): unreachable: no route to host"]
    assert got["198.18.252.7"] == ["unreachable", "host gpu0 (198.18.252.7:22): unreachable: network is unreachable"]
    assert got["198.18.254.7"] == ["other", "host gpu0 (198.18.254.7:22): cannot connect: Invalid argument"]
    assert Cause.UNREACHABLE in DOWN_CAUSES and Cause.OTHER not in DOWN_CAUSES


# --- the decision taken on it --------------------------------------------------------------

SPEC = """\
name: t
hosts:
  - {name: a, address: 10.0.0.1}
  - {name: b, address: 10.0.0.2}
  - {name: z, address: 10.0.0.9, spare: true}
  - {name: y, address: 10.0.0.8, spare: true}
jobs:
  ps: {count: 1, hosts: [a], port: 2222}
  worker: {count: 1, hosts: [b], port: 2300}
"""


class Session:
    """What around_dead_hosts asks of a session: each host's connect() fails as `errors` say."""

    def __init__(self, plan, errors: dict[str, ConnectError]) -> None:
        self.plan, self.errors, self.dropped = plan, errors, set()
        self.host_names = tuple(plan.hosts) + tuple(plan.spares)
        self.pool = HostPool()

    def agent(self, host: str):
        def connect() -> None:
            if host in self.errors:
                raise self.errors[host]
        return SimpleNamespace(transport=SimpleNamespace(connect=connect))

    def parallel(self, fn, items) -> dict:
        out = {}
        for item in items:
            try:
                out[item] = fn(item)
            except Exception as e:    # noqa: BLE001 - as session.parallel returns it
                out[item] = e
        return out

    def drop(self, hosts) -> None:
        self.dropped |= set(hosts)

    def adopt(self, plan) -> None:
        self.plan = plan


@pytest.fixture
def plan(home, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(SPEC)
    return build_plan(load_spec(str(path)))


@pytest.mark.parametrize("cause", sorted(DOWN_CAUSES, key=lambda c: c.value))
def test_a_host_down_by_its_cause_starts_its_tasks_on_a_spare_whatever_its_message_says(plan, cause):
    said = []
    session = Session(plan, {"a": ConnectError("host a (10.0.0.1:22): some words", cause=cause)})
    moved = around_dead_hosts(session, SimpleNamespace(warn=said.append, info=said.append))
    assert {t.key: t.host for t in moved.tasks} == {"ps:0": "z", "worker:0": "b"} and session.plan is moved
    assert session.dropped == {"a"} and "a" not in session.host_names
    assert said == ["a is down (some words): ps:0 start on spare z instead"]


@pytest.mark.parametrize("cause", [c for c in Cause if c not in DOWN_CAUSES])
def test_a_host_that_answers_is_no_dead_host_even_when_its_message_sounds_like_one(plan, cause):
    said = []
    session = Session(plan, {"a": ConnectError("host a (10.0.0.1:22): connection refused, unreachable, "
                                               "no route to host", cause=cause)})
    assert around_dead_hosts(session, SimpleNamespace(warn=said.append, info=said.append)) is plan
    assert session.plan is plan and not session.dropped and not said
