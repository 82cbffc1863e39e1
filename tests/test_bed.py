"""The separate-host bed itself (tests/netns.py): what makes its hosts separate machines,
checked, so a test of moves or the fence on it cannot pass by sharing one kernel's sockets."""
from __future__ import annotations

import socket
import sys

import pytest

from tests.helpers import wait_for

pytestmark = [pytest.mark.ssh]

LISTEN = ("import socket,sys;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
          "s.bind(('0.0.0.0',int(sys.argv[1])));s.listen();print('ok',flush=True);"
          "import time;time.sleep(120)")


def _connects(address: str, port: int) -> str:
    try:
        with socket.create_connection((address, port), timeout=2):
            return "connected"
    except OSError as e:
        return type(e).__name__


def _listen(host, port: int):
    import subprocess
    enter = ["nsenter", "-t", str(host.sshd.proc.pid), "-n", "-p", "-m", "--"]
    proc = subprocess.Popen(enter + [sys.executable, "-c", LISTEN, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ok"
    return proc


def test_a_listener_answers_on_its_own_host_only(bed):
    h2, h3 = bed.add("h2"), bed.add("h3")
    proc = _listen(h2, 24001)
    try:
        assert _connects(h2.address, 24001) == "connected"
        assert _connects(h3.address, 24001) == "ConnectionRefusedError"     # not a shared socket
        assert _connects("127.0.0.1", 24001) == "ConnectionRefusedError"
        seen = h3.run(["ps", "-eo", "pid,args"]).stdout                   # its own process list
        assert "sshd" in seen and LISTEN[:20] not in seen
    finally:
        proc.kill()
        proc.wait(10)


def test_a_dead_host_answers_nothing_and_keeps_no_process(bed):
    h2 = bed.add("h2")
    proc = _listen(h2, 24002)
    listener = proc.pid
    assert h2.pids(), "the listener runs on h2"
    bed.kill("h2")
    proc.wait(10)
    assert not h2.pids()
    # a powered-off box: no refusal, no answer (the blackhole route keeps the packet here)
    assert _connects(h2.address, 24002) == "TimeoutError"
    assert not __import__("psutil").pid_exists(listener) or proc.poll() is not None


def test_a_silent_host_drops_every_packet_and_keeps_running(bed):
    h2 = bed.add("h2")
    proc = _listen(h2, 24003)
    try:
        bed.silence("h2")
        assert _connects(h2.address, 24003) == "TimeoutError"
        assert proc.poll() is None                      # its processes run on
    finally:
        proc.kill()
        proc.wait(10)


def test_the_bed_leaves_nothing(bed):
    import subprocess
    bed.add("h2")
    ns = bed.hosts["h2"].ns
    bed.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert ns not in listed
    # the index stays claimed until the fixture ends: no other bed can have made this bridge again
    wait_for(lambda: subprocess.run(["ip", "link", "show", "dev", bed.bridge], capture_output=True).returncode != 0,
             timeout=10, what="the bridge removed")


def test_a_beds_index_is_its_own_until_its_fixture_ends(bed):
    """Two beds at once never share an index, and a bed closed twice (by its test, then by its
    fixture) never removes what a later bed made: an index is claimed for the fixture's life."""
    import os
    import subprocess

    from tests.netns import _ip, _new_bridge
    bed.close()
    index, bridge, lock = _new_bridge()
    try:
        assert index != bed.index
        bed.close()
        assert subprocess.run(["ip", "link", "show", "dev", bridge], capture_output=True).returncode == 0
    finally:
        _ip("link", "delete", bridge, check=False)
        os.close(lock)
