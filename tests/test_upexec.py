"""`up`'s one exec per host (upexec.py + shim_launch.py) through the local transport: warm
servers, GO, and what an aborted conversation leaves (nothing). The server here is a small
program speaking tfserver.py's hold protocol (tfserver.py itself: the last test, with TF)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.helpers import bindable, tagged_processes, wait_for
from tfcluster.host import shim_protocol as proto
from tfcluster.launch.agent.agent import HostAgent, TaskLaunch
from tfcluster.launch.agent.upexec import UpExec
from tfcluster.plan import names
from tfcluster.plan.names import ClusterPaths
from tfcluster.transport.local import LocalTransport

REPO = Path(__file__).resolve().parent.parent
CLUSTER_DIR = "~/.tfcluster/uplab"
PATHS = ClusterPaths(CLUSTER_DIR)
C = f"upx{uuid.uuid4().hex[:8]}"

# tfserver.py's hold protocol, without TensorFlow: with TFCLUSTER_HOLD=1 bind only after GO.
SERVER = textwrap.dedent("""
    import os, socket, sys, time
    if os.environ.pop("TFCLUSTER_HOLD", None) == "1" and sys.stdin.readline() != "GO\\n":
        sys.exit(0)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(sys.argv[1])))
    s.listen()
    time.sleep(600)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def server(port: int, run: str = "up-1") -> tuple[str, int, TaskLaunch]:
    tag = str(names.Tag(C, run, "ps", 0, "server"))
    return ("ps:0", port, TaskLaunch(tag=tag, argv=(sys.executable, "-c", SERVER, str(port)), env={},
                                     cwd="~", log=f"{CLUSTER_DIR}/runs/{run}/ps-0.server.log",
                                     pidfile=PATHS.pidfile(tag)))


@pytest.fixture
def agent(home):
    a = HostAgent("local", LocalTransport(), sys.executable, CLUSTER_DIR)
    yield a
    a.stop(names.cluster_prefix(C), grace=1)
    a.close()


def ours() -> dict[int, str]:
    return {pid: tag for pid, tag in tagged_processes().items() if tag.startswith(C)}


def test_a_warm_server_waits_unbound_and_closing_before_go_leaves_nothing(agent, home):
    port = free_port()
    ex = UpExec(agent)
    ex.open((names.cluster_prefix(C), [port]), [server(port)], timeout=30)
    assert ex.warm == ("ps:0",)
    # running (seen once its exec is through: on a busy machine that can trail the shim's answer)
    wait_for(lambda: len(ours()) == 1, timeout=10, what="the warm server's process")
    assert bindable(port)                                # not listening
    [status] = agent.status(names.cluster_prefix(C))
    assert status.alive and status.warm                  # not counted as a server
    pidfile = Path(os.path.expanduser(PATHS.pidfile(server(port)[2].tag)))
    assert pidfile.exists()

    ex.close()

    assert not ours() and not pidfile.exists() and bindable(port)


def test_go_releases_the_warm_server_and_streams_its_readiness(agent, home):
    port = free_port()
    ex = UpExec(agent)
    ex.open((names.cluster_prefix(C), [port]), [server(port)], timeout=30)
    events = list(ex.go(["ps:0"]))
    ex.close()
    assert [(k, s) for k, s, _v in events] == [("ps:0", "started"), ("ps:0", "ready")]
    assert not bindable(port)
    [status] = agent.status(names.cluster_prefix(C))
    assert status.alive and not status.warm and status.pid == events[0][2]


def test_no_warm_start_when_a_port_is_taken_and_go_names_the_holder(agent, home):
    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        ex = UpExec(agent)
        ex.open((names.cluster_prefix(C), [port]), [server(port)], timeout=30)
        assert ex.warm == () and not ours()
        assert agent.survey(names.cluster_prefix(C), [port]).ports[port]   # the survey names it
        ex.close()
    finally:
        holder.close()
    assert not ours()


def test_reach_lines_run_in_the_conversation_and_its_listeners_close_before_go(agent, home):
    port = free_port()
    ex = UpExec(agent)
    ex.open((names.cluster_prefix(C), [port]), [server(port)], timeout=30)
    ex.proc.write(proto.json_line({"listen": [port]}))
    assert ex.next_line() == {"listening": [port], "busy": {}}
    ex.proc.write(proto.json_line({"targets": [["127.0.0.1", port]], "timeout": 5}))
    assert ex.next_line() == {"results": {f"127.0.0.1:{port}": None}}
    assert not bindable(port)                            # the rehearsal listener
    states = [s for _k, s, _v in ex.go(["ps:0"])]       # GO: listener closed, then the server binds
    ex.close()
    assert states == ["started", "ready"]


def test_an_attached_start_with_hold_binds_only_after_go(agent, home):
    """train's warm servers: the attached shim passes GO to the task's stdin."""
    port = free_port()
    task = agent.start_attached(server(port, run="r-1")[2], hold=True)
    [status] = agent.status(names.cluster_prefix(C))
    assert status.alive and status.warm and bindable(port)
    task.go()
    wait_for(lambda: not bindable(port), timeout=30, what="the released server to bind")
    [status] = agent.status(names.cluster_prefix(C))
    assert status.alive and not status.warm
    task.stop()
    assert task.wait(30) is not None and not ours()


def held_tfserver(port: int, stdin: bytes) -> subprocess.CompletedProcess:
    """tfserver.py for ps:0 on `port`, held (TFCLUSTER_HOLD=1), given `stdin`."""
    env = dict(os.environ, TFCLUSTER_HOLD="1", CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
               TF_CONFIG='{"cluster": {"ps": ["127.0.0.1:%d"]}, "task": {"type": "ps", "index": 0}}' % port)
    return subprocess.run([sys.executable, str(REPO / "tfcluster/host/tfserver.py")], env=env,
                          input=stdin, capture_output=True, timeout=180)


@pytest.mark.tf
def test_tfserver_held_exits_unbound_when_its_stdin_ends(tmp_path):
    port = free_port()
    proc = held_tfserver(port, b"")
    assert proc.returncode == 0 and b"listening" not in proc.stdout
    assert bindable(port)


def test_the_up_shim_exits_0_at_once_while_the_launcher_keeps_its_stdin_open():
    """`up` keeps the exec's stdin open to the end; the shim's stdin reader (a daemon
    thread) is then inside a read holding the buffer's lock. Python's teardown waited 1 s for
    it and aborted ("Fatal Python error: _enter_buffered_busy", SIGABRT) after every `up`."""
    shim = subprocess.Popen([sys.executable, "-S", str(REPO / "tfcluster" / "host" / "shim.py"), proto.UP],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        shim.stdin.write(b'{"commands": {}, "starts": []}\n')
        shim.stdin.flush()
        assert shim.stdout.readline() == b'{"answers": {}, "warm": []}\n'
        shim.stdin.write(b'{"go": []}\n')
        shim.stdin.flush()
        rc = shim.wait(timeout=30)             # stdin still open
        err = shim.stderr.read()
    finally:
        shim.kill()
        shim.wait()
        shim.stdin.close()
    assert rc == 0 and err == b"", (rc, err[:300])


@pytest.mark.tf
@pytest.mark.timeout(240)
def test_a_held_tfserver_serves_the_cluster_its_go_carries(agent, home):
    """A server held before its cluster was known (launch/run/heldservers.py: held once the run
    stepped, for the next move) gets its TF_CONFIG with GO, through the attached shim: it binds
    the address that config gives it, not the one it was started with."""
    started_port, given_port, other = free_port(), free_port(), free_port()
    config = lambda port: json.dumps({"cluster": {"ps": [f"127.0.0.1:{port}"], "worker": [f"127.0.0.1:{other}"]},  # noqa: E731
                                      "task": {"type": "ps", "index": 0}})
    tag = str(names.Tag(C, "r-2", "ps", 0, "server"))
    launch = TaskLaunch(tag=tag, argv=(sys.executable, str(REPO / "tfcluster/host/tfserver.py")),
                        env={"TF_CONFIG": config(started_port), "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2"},
                        cwd="~", log=f"{CLUSTER_DIR}/runs/r-2/ps-0.server.log", pidfile=PATHS.pidfile(tag))
    task = agent.start_attached(launch, hold=True)
    assert task.go(config(given_port))
    log = Path(os.path.expanduser(launch.log))
    wait_for(lambda: log.exists() and "listening on" in log.read_text(), timeout=180, what="the server to listen")
    assert f"ps:0 listening on 127.0.0.1:{given_port}" in log.read_text()
    assert not bindable(given_port) and bindable(started_port)
    task.stop()
    assert task.wait(30) is not None and not ours()


@pytest.mark.tf
def test_a_held_tfserver_refuses_a_go_for_another_task_and_stays_unbound(tmp_path):
    port = free_port()
    go = 'GO {"cluster": {"ps": ["127.0.0.1:%d"], "worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}\n'
    proc = held_tfserver(port, (go % port).encode())
    assert proc.returncode == 2 and b"GO names worker:0, this server is ps:0" in proc.stderr, proc.stderr[-500:]
    assert bindable(port)
