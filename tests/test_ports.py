"""The host's table of listening sockets (tfcluster/shim_ports.py): sock_diag netlink, and
/proc/net/tcp{,6} where netlink is refused, give the same answer for real sockets."""
from __future__ import annotations

import os
import socket

import pytest

from tfcluster.host import shim_ports


def proc_listeners() -> dict[int, dict[str, int]]:
    found: dict[int, dict[str, int]] = {}
    for port, state, uid, inode in shim_ports.sockets():
        if state == shim_ports.LISTEN:
            found.setdefault(port, {})[inode] = uid
    return found


def inode_of(sock: socket.socket) -> str:
    return os.readlink(f"/proc/self/fd/{sock.fileno()}")[len("socket:["):-1]


@pytest.fixture
def sockets_here():
    """A v4 listener, a v6 listener (where ::1 exists), and an established pair."""
    opened = []

    def sock(family=socket.AF_INET):
        s = socket.socket(family, socket.SOCK_STREAM)
        opened.append(s)
        return s
    v4 = sock()
    v4.bind(("127.0.0.1", 0))
    v4.listen()
    v6 = None
    if socket.has_ipv6:
        try:
            v6 = sock(socket.AF_INET6)
            v6.bind(("::1", 0))
            v6.listen()
        except OSError:
            v6 = None
    client = sock()
    client.connect(v4.getsockname())
    server_side, _ = v4.accept()
    opened.append(server_side)
    yield v4, v6, client
    for s in opened:
        s.close()


def test_netlink_and_proc_agree_on_our_listeners(sockets_here):
    v4, v6, client = sockets_here
    ours = [s for s in (v4, v6) if s is not None]
    diag, proc = shim_ports._diag_listeners(), proc_listeners()
    for s in ours:
        port = s.getsockname()[1]
        assert diag[port] == proc[port] == {inode_of(s): os.geteuid()}
    # the client's end of an established connection listens on nothing
    assert client.getsockname()[1] not in diag
    table = shim_ports.listeners()
    assert all(table[s.getsockname()[1]] == diag[s.getsockname()[1]] for s in ours)


def test_a_closed_listener_leaves_the_table(sockets_here):
    v4, _, _ = sockets_here
    port = v4.getsockname()[1]
    assert port in shim_ports.listeners()
    v4.close()
    assert port not in shim_ports._diag_listeners()
    assert port not in proc_listeners()


def test_where_netlink_is_refused_proc_answers(sockets_here, monkeypatch):
    # A kernel without sock_diag (or a sandbox refusing AF_NETLINK) cannot be had here:
    # the refusal is injected, the sockets are real.
    v4, _, _ = sockets_here

    def refused():
        raise PermissionError("netlink refused")
    monkeypatch.setattr(shim_ports, "_diag_listeners", refused)
    port = v4.getsockname()[1]
    assert shim_ports.listeners()[port] == {inode_of(v4): os.geteuid()}
