"""tfserver.py's import of TensorFlow: lean (server_lib without `tensorflow/__init__.py`) by
default, the full import where plugins would be missed, when asked, or when the lean one
fails (a re-exec: same pid). Real TensorFlow, real servers on loopback."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import need_tensorflow, wait_for
from tfcluster.host import shim_ports

need_tensorflow()

pytestmark = pytest.mark.tf   # every test here starts real TensorFlow

TFSERVER = Path(__file__).resolve().parent.parent / "tfcluster" / "host" / "tfserver.py"

# Which classes server_classes() chose, and whether tensorflow's Python API was loaded;
# then a real server from them, on the port given, until it accepts one connection.
CHOICE = f"""
import json, socket, sys
sys.path.insert(0, {str(TFSERVER.parent)!r})
import tfserver
Server, ClusterSpec = tfserver.server_classes()
port = int(sys.argv[1])
server = Server(ClusterSpec({{"ps": ["127.0.0.1:%d" % port]}}), job_name="ps", task_index=0,
                protocol="grpc", start=True)
socket.create_connection(("127.0.0.1", port), timeout=10).close()
print(json.dumps({{"module": Server.__module__, "api": hasattr(sys.modules["tensorflow"], "constant"),
                  "plugins": tfserver.plugin_dirs()}}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def choice(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHOICE, str(free_port())], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_default_is_the_lean_import_and_its_server_serves():
    got = choice({})
    assert got == {"module": "tensorflow.python.training.server_lib", "api": False, "plugins": []}


def test_a_plugin_directory_or_the_variable_means_the_full_import(tmp_path):
    plugins = tmp_path / "tensorflow-plugins"
    plugins.mkdir()
    (plugins / "README").write_text("a pluggable device's libraries would be here\n")
    got = choice({"PYTHONPATH": str(tmp_path)})
    assert got["api"] is True and got["plugins"] == [str(plugins)]
    assert choice({"TFCLUSTER_SERVER_IMPORT": "full"})["api"] is True


# Injected fault: the lean import fails (a TensorFlow whose layout we do not know); the full
# import, after the re-exec, is not touched.
POISON = """
import os, sys
if os.environ.get("TFCLUSTER_SERVER_IMPORT") != "full":
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name == "tensorflow.python.training.server_lib":
                raise ImportError("refused by the test")
    sys.meta_path.insert(0, Refuse())
"""


def test_a_failed_lean_import_becomes_the_full_one_in_the_same_process(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(POISON)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TFCLUSTER_JOB_ID": "test-tfserver:ps:0",
           "TF_CONFIG": json.dumps({"cluster": {"ps": [f"127.0.0.1:{port}"]}, "task": {"type": "ps", "index": 0}})}
    log = tmp_path / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, str(TFSERVER)], env=env, stdin=subprocess.DEVNULL,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def ready():
            assert proc.poll() is None, log.read_text()[-2000:]
            state, _ = shim_ports.readiness(proc.pid, port, shim_ports.listeners())
            return state == "ready" and "listening on" in log.read_text()   # it binds, then says so
        wait_for(ready, 120, what="the re-executed server listening")
        text = log.read_text()
        assert "lean TensorFlow import failed (ImportError: refused by the test)" in text
        assert f"tfcluster: server ps:0 listening on 127.0.0.1:{port}" in text
    finally:
        proc.kill()
        proc.wait(30)
