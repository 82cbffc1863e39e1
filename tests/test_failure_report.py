"""What `train` says of a task that failed: the heading of the log tail names the log it
shows (a server's is `worker:1.server`, not the script's `worker:1`). Real processes on the
local host; the servers are a stand-in (no TensorFlow) that prints a line and listens."""
from __future__ import annotations

import sys

import pytest

from tests.helpers import STANDIN, kill_tagged_once_seen, start_tfcluster, tagged_processes, wait_for
from tests.tf_launch import free_ports

pytestmark = pytest.mark.timeout(90)

TALKING = STANDIN.replace("s = socket.create_server", 'print("standin serving", port, flush=True)\n'
                                                     "s = socket.create_server", 1)
PYWRAP = '''#!/bin/sh
case "$1" in */tfserver.py) exec {python} {standin} "$@";; esac
exec {python} "$@"
'''
SCRIPT = 'import time\nprint("script up", flush=True)\ntime.sleep(60)\n'


def test_a_failed_servers_log_tail_is_headed_with_its_own_name(tmp_path, home):
    assert "standin serving" in TALKING
    (tmp_path / "standin.py").write_text(TALKING)
    wrapper = tmp_path / "pywrap"
    wrapper.write_text(PYWRAP.format(python=sys.executable, standin=tmp_path / "standin.py"))
    wrapper.chmod(0o755)
    (tmp_path / "wait.py").write_text(SCRIPT)
    p = free_ports(3)
    spec = tmp_path / "fail.yaml"
    spec.write_text(f"name: fail\npython: {wrapper}\nhosts:\n  - {{name: a, address: 127.0.0.1}}\n"
                    f"jobs:\n  ps: {{tasks: ['a:{p[0]}']}}\n  worker: {{tasks: ['a:{p[1]}', 'a:{p[2]}']}}\n"
                    "train:\n  mode: between-graph\n  script: wait.py\n")
    proc = start_tfcluster("train", str(spec), home=home, cwd=tmp_path)
    out = kill_tagged_once_seen(proc, r"worker:1 .*script up", ":worker:1:server", wait=60, finish=60)
    assert proc.returncode == 5, out[-3000:]
    assert "worker:1 server on a failed with exit code 137" in out, out[-3000:]
    heading = out.index("last lines of worker:1.server:")
    assert "standin serving" in out[heading:], out[-3000:]
    wait_for(lambda: not tagged_processes(), 15, what="nothing of the run left")
