"""TensorBoard on the chief's host (`train --tensorboard`, `train.tensorboard`): started with
the run, reached through a forwarded port over SSH, fetched for real, gone with the run."""
from __future__ import annotations

import http.server
import importlib.util
import os
import re
import signal
import stat
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.helpers import (
    kill_group,
    local_spec,
    only_run,
    read_until,
    start_tfcluster,
    tagged_processes,
    tfcluster,
    wait_for,
)
from tests.sshd import make_target
from tests.tf_launch import free_ports

# under pytest-xdist, one worker runs them all: TensorBoard's default port is one per machine
pytestmark = pytest.mark.xdist_group("tensorboard")

URL_LINE = r"TensorBoard: (http://127\.0\.0\.1:(\d+)/) \(logdir (.*) on (\S+)\)"

# The training script: runs until the test has fetched the page and drops the flag file
# (its deadline only bounds a test that failed before dropping it).
WAIT_SCRIPT = """\
import os, sys, time
flag, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
print("waiting for the flag", flush=True)
while not os.path.exists(flag):
    if time.monotonic() > deadline:
        sys.exit("no flag within the deadline")
    time.sleep(0.05)
print("flag seen", flush=True)
with open(flag) as f:
    sys.exit(3 if f.read() == "fail" else 0)
"""


@pytest.fixture
def tensorboard_installed() -> None:
    """The e2e tests need tensorboard for this interpreter (the `test` extra installs it)."""
    if importlib.util.find_spec("tensorboard") is None:
        message = "tensorboard is not installed (pip install -e '.[test]')"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)


def fetch(url: str) -> tuple[int, str]:
    """GET on loopback, never through a proxy from the environment."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=30) as response:
        return response.status, response.read().decode(errors="replace")


def tensorboard_processes() -> dict[int, str]:
    return {pid: tag for pid, tag in tagged_processes().items() if tag.endswith(":tensorboard")}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def listeners(pid: int) -> set[int]:
    proc = psutil.Process(pid)
    conns = proc.net_connections("tcp") if hasattr(proc, "net_connections") else proc.connections("tcp")
    return {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}


def write_wait_script(tmp: Path) -> Path:
    script = tmp / "wait_for_flag.py"
    script.write_text(WAIT_SCRIPT)
    return script


def serve_and_fetch(proc, host: str) -> tuple[str, int, int]:
    """Wait for the URL line, fetch the page, check TensorBoard is the run's.
    Returns (logdir shown, local port, TensorBoard's pid)."""
    lines = read_until(proc, URL_LINE, timeout=180)
    url, port, logdir, shown_host = re.search(URL_LINE, lines[-1]).groups()
    assert shown_host == host
    status, body = fetch(url)
    assert status == 200
    assert "<tf-tensorboard" in body or "TensorBoard" in body, body[:500]
    boards = tensorboard_processes()   # TensorBoard, and the data server it starts
    mains = [p for p in boards if "tensorboard.main" in psutil.Process(p).cmdline()]
    assert len(mains) == 1, boards
    pid = mains[0]
    assert boards[pid].endswith(":worker:0:tensorboard")
    children = {c.pid for c in psutil.Process(pid).children(recursive=True)}
    assert set(boards) - {pid} <= children, boards
    assert not any("tensorboard" in line.lower() and "│" in line for line in lines)  # not in the live view
    return logdir, int(port), pid


def end_run(proc, flag: Path, how: str) -> str:
    """End the run: the script finishes, fails, or the user presses Ctrl-C."""
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)   # a terminal's Ctrl-C reaches the whole group
    else:
        flag.write_text("fail" if how == "fail" else "ok")
    out, _ = proc.communicate(timeout=120)
    return out


@pytest.mark.tf
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how,code", [("finish", 0), ("fail", 5), ("ctrl-c", 130)])
def test_local_run_serves_tensorboard_and_stops_it_with_the_run(tmp_path, home, tensorboard_installed,
                                                                how, code):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    flag = tmp_path / "flag"
    spec = local_spec(tmp_path, mode="mirrored", script=str(write_wait_script(tmp_path)),
                      args=[str(flag), "240"], ps=0, workers=1, name="tbl")
    proc = start_tfcluster("train", str(spec), "--tensorboard", str(tmp_path / "tb-{job}{index}"),
                           home=home, cwd=cwd)
    try:
        logdir, port, pid = serve_and_fetch(proc, "local")
        assert logdir == str(tmp_path / "tb-worker0")           # the chief's placeholders
        assert port in listeners(pid)                          # a local chief: no forwarding
        # its info file in the run's private directory, never in /tmp/.tensorboard-info (0777,
        # not sticky: another user's link planted there would have root's TensorBoard write
        # through it)
        tmpdir = psutil.Process(pid).environ()["TMPDIR"]
        assert stat.S_IMODE(os.stat(tmpdir).st_mode) == 0o700 and "/runs/tbl-" in tmpdir, tmpdir
        assert wait_for(lambda: os.path.exists(f"{tmpdir}/.tensorboard-info/pid-{pid}.info"), timeout=30)
        assert not os.path.lexists(f"/tmp/.tensorboard-info/pid-{pid}.info")
        out = end_run(proc, flag, how)
    finally:
        flag.touch()
        kill_group(proc)
    assert proc.returncode == code, out[-3000:]
    assert gone(pid) and not tensorboard_processes()           # its data server too
    saved = (only_run(cwd / "runs") / "tensorboard.log").read_text()
    assert f"127.0.0.1:{port}" in saved                        # TensorBoard's own banner, saved
    assert "TensorBoard" not in out                            # shown nowhere, no warning either


def ssh_spec_one_host(tmp: Path, sshd, script: Path, flag: Path, tensorboard: str) -> Path:
    port = free_ports(1)[0]
    path = tmp / "tbs.yaml"
    path.write_text(
        f"name: tbs\npython: {sys.executable}\nworkdir: {tmp / 'remote'}\n"
        f"ssh:\n  port: {sshd.port}\n  connect_timeout: 5\n"
        "hosts:\n  - {name: h3, address: 127.0.0.3}\n"
        f"jobs:\n  worker: {{tasks: ['h3:{port}']}}\n"
        f"train:\n  mode: mirrored\n  script: {script}\n  args: ['{flag}', '240']\n"
        f"  tensorboard: {tensorboard}\n")
    return path


@pytest.mark.tf
@pytest.mark.ssh
@pytest.mark.timeout(300)
def test_ssh_run_forwards_tensorboard_through_the_connection(tmp_path, home, ssh_home, sshd,
                                                            tensorboard_installed):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    flag = tmp_path / "flag"
    spec = ssh_spec_one_host(tmp_path, sshd, write_wait_script(tmp_path), flag,
                             str(tmp_path / "tb-{job}-{index}"))
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        logdir, port, pid = serve_and_fetch(proc, "h3")
        assert logdir == str(tmp_path / "tb-worker-0")
        # The page came through tfcluster's forwarded port, not from TensorBoard directly:
        # tfcluster listens on it, TensorBoard listens elsewhere (on the host's loopback).
        tree = [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
        remote_ports = wait_for(lambda: set().union(*(listeners(p) for p in tree)), 20,
                                what="TensorBoard's listening socket")
        assert port in listeners(proc.pid) and port not in remote_ports
        out = end_run(proc, flag, "finish")
    finally:
        flag.touch()
        kill_group(proc)
    assert proc.returncode == 0, out[-3000:]
    assert gone(pid) and not tensorboard_processes()
    assert "TensorBoard" not in out
    saved = (only_run(cwd / "runs") / "tensorboard.log").read_text()
    assert any(f"127.0.0.1:{p}/" in saved for p in remote_ports)   # its banner, saved here


def test_a_chief_without_tensorboard_warns_once_and_trains(tmp_path, home):
    """`python -S` sees no site-packages, so no tensorboard. The preflight wants TensorFlow
    installed, which this script never imports: a bare dist-info on the path says it is."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    dist = tmp_path / "fake-site" / "tensorflow-2.99.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorflow\nVersion: 2.99.0\n")
    python = tmp_path / "python-without-site"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={dist.parent}${{PYTHONPATH:+:$PYTHONPATH}} "
                      f"exec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    script = tmp_path / "ok.py"
    script.write_text("print('trained', flush=True)\n")
    spec = local_spec(tmp_path, mode="mirrored", script=str(script), ps=0, workers=1, name="tbn",
                      extra="  tensorboard: logs\n")
    spec.write_text(f"python: {python}\n" + spec.read_text())
    result = tfcluster("train", str(spec), home=home, cwd=cwd, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "TensorBoard" in line]
    assert len(warnings) == 1 and "not installed" in warnings[0] and "pip install tensorboard" in warnings[0]
    assert "worker:0 │ trained" in result.stdout


def test_forwarder_carries_connections_and_closes_cleanly(home, ssh_home, sshd):
    """SshTransport.forward on its own, to a small HTTP server on a test sshd "host"."""
    from tfcluster.transport.ssh import SshTransport

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"hello {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    transport = SshTransport(*make_target("h2", "127.0.0.2", sshd))
    transport.connect()
    try:
        before = {t.ident for t in threading.enumerate()}
        fwd = transport.forward(server.server_port, local_port=server.server_port)
        assert fwd.local_port != server.server_port          # taken (same machine): another one
        for i in range(3):                                   # several connections, one at a time
            assert fetch(f"http://127.0.0.1:{fwd.local_port}/x{i}") == (200, f"hello /x{i}")
        results = []
        fetchers = [threading.Thread(target=lambda i=i: results.append(
            fetch(f"http://127.0.0.1:{fwd.local_port}/p{i}"))) for i in range(4)]
        for t in fetchers:
            t.start()
        for t in fetchers:
            t.join(30)
        assert sorted(results) == [(200, f"hello /p{i}") for i in range(4)]
        fwd.close()
        fwd.close()                                          # idempotent
        wait_for(lambda: not [t for t in threading.enumerate()
                              if t.ident not in before and "forward" in t.name],
                 timeout=10, what="the forwarder's threads to end")
        with pytest.raises(OSError):
            fetch(f"http://127.0.0.1:{fwd.local_port}/")
    finally:
        transport.close()
        server.shutdown()
        server.server_close()


def test_nothing_listening_on_the_host_closes_the_local_connection(home, ssh_home, sshd):
    from tfcluster.transport.ssh import SshTransport

    closed_port = free_ports(1)[0]
    transport = SshTransport(*make_target("h2", "127.0.0.2", sshd))
    transport.connect()
    try:
        fwd = transport.forward(closed_port)
        started = time.monotonic()
        with pytest.raises(OSError):                      # refused there: closed here, no hang
            fetch(f"http://127.0.0.1:{fwd.local_port}/")
        assert time.monotonic() - started < 20
        fwd.close()
    finally:
        transport.close()


def test_command_line_logdir_overrides_the_spec_and_is_checked(tmp_path, home):
    from tfcluster.errors import UsageError
    from tfcluster.plan import build_plan
    from tfcluster.spec import load_spec, with_train_overrides

    spec = load_spec(str(local_spec(tmp_path, mode="mirrored", ps=0, workers=2, name="tbo",
                                    extra="  tensorboard: spec-{index}\n")))
    assert build_plan(spec).tensorboard == "spec-0"
    assert build_plan(with_train_overrides(spec, tensorboard="~/tb/{job}")).tensorboard == "~/tb/worker"
    for bad, problem in (("tb/{nope}", "unknown placeholder"), ("", "empty"), ("a\nb", "newline")):
        with pytest.raises(UsageError, match=problem):
            with_train_overrides(spec, tensorboard=bad)
    result = tfcluster("train", str(tmp_path / "tbo.yaml"), "--tensorboard", "{oops}", "--dry-run",
                       home=home, cwd=tmp_path)
    assert result.returncode == 2 and "--tensorboard" in result.stderr and "oops" in result.stderr
