"""GPU assignment on a host whose GPUs come from a fake `nvidia-smi` (this machine has
none): a GPU worker per GPU, CUDA_VISIBLE_DEVICES per process, ps on CPU, and in
between-graph mode the script (a client) sees no GPU while its server owns one."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import cli_env
from tests.tf_launch import free_ports

pytestmark = [pytest.mark.tf, pytest.mark.timeout(240)]

FAKE_SMI = """#!/bin/sh
case "$*" in
  "--query-gpu=driver_version --format=csv,noheader") echo 550.54.15; echo 550.54.15 ;;
  -L) echo "GPU 0: Fake GPU (UUID: GPU-0)"; echo "GPU 1: Fake GPU (UUID: GPU-1)" ;;
  *) exit 1 ;;
esac
"""

# Writes what it sees, and what its task's server sees, then ends the run.
PROBE = """import json, os, sys
server = {}
for pid in os.listdir('/proc'):
    try:
        env = dict(l.split('=', 1) for l in open(f'/proc/{pid}/environ').read().split('\\0') if '=' in l)
    except OSError:
        continue
    tag = env.get('TFCLUSTER_JOB_ID', '')
    if tag.endswith(':server') and env.get('TFCLUSTER_CLUSTER') == 'gpus':
        server[tag.split(':')[2] + ':' + tag.split(':')[3]] = env.get('CUDA_VISIBLE_DEVICES')
me = os.environ['TFCLUSTER_JOB'] + ':' + os.environ['TFCLUSTER_TASK_INDEX']
json.dump({'script': os.environ['CUDA_VISIBLE_DEVICES'], 'servers': server},
          open(os.path.join(sys.argv[1], me + '.json'), 'w'))
"""


def with_fake_smi(tmp_path, home) -> dict:
    """tfcluster's environment with FAKE_SMI first on its PATH: a host with 2 GPUs."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(FAKE_SMI)
    (fake / "nvidia-smi").chmod(0o755)
    return {**cli_env(home), "PATH": f"{fake}:{os.environ['PATH']}"}


def test_gpu_workers_servers_own_the_gpu_and_scripts_see_none(tmp_path, home):
    (tmp_path / "probe.py").write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    ps, w = free_ports(2), free_ports(1)[0]
    spec = tmp_path / "gpus.yaml"
    spec.write_text(
        "name: gpus\nhosts:\n  - {name: local, address: 127.0.0.1, gpus: 2}\n"
        f"jobs:\n  ps: {{tasks: ['local:{ps[0]}']}}\n"
        f"  worker: {{per_gpu: true, hosts: [local], port: {w}}}\n"
        f"train:\n  mode: between-graph\n  script: probe.py\n  args: ['{out}']\n")
    env = with_fake_smi(tmp_path, home)
    result = subprocess.run([sys.executable, "-m", "tfcluster", "train", str(spec)], capture_output=True,
                            text=True, timeout=200, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    seen = {f.stem: json.loads(f.read_text()) for f in out.iterdir()}
    assert set(seen) == {"worker:0", "worker:1"}
    for name, got in seen.items():
        assert got["script"] == "", name                       # a client: no GPU
        assert got["servers"]["ps:0"] == ""                     # ps on CPU
        assert got["servers"]["worker:0"] == "0" and got["servers"]["worker:1"] == "1"


def test_a_host_with_fewer_gpus_than_the_spec_says_fails_preflight(tmp_path, home):
    ps, port = free_ports(2)
    spec = tmp_path / "four.yaml"
    spec.write_text("name: four\nhosts:\n  - {name: local, address: 127.0.0.1, gpus: 4}\n"
                    f"jobs:\n  ps: {{tasks: ['local:{ps}']}}\n"
                    f"  worker: {{per_gpu: true, hosts: [local], port: {port}}}\n")
    env = with_fake_smi(tmp_path, home)
    result = subprocess.run([sys.executable, "-m", "tfcluster", "up", str(spec)], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 4, result.stderr
    assert "host local: the spec gives it 4 GPUs but it has 2" in result.stderr
    assert "Starting" not in result.stderr


@pytest.mark.parametrize("gpus,warned", [("", True), (", gpus: 0", False), (", gpus: 2", False)])
def test_a_host_with_gpus_the_spec_does_not_give_is_warned_of_once_unless_gpus_0_says_so(tmp_path, home,
                                                                                         gpus, warned):
    ps, port = free_ports(2)
    spec = tmp_path / "cpu.yaml"
    spec.write_text(f"name: cpu\nhosts:\n  - {{name: local, address: 127.0.0.1{gpus}}}\n"
                    f"jobs:\n  ps: {{tasks: ['local:{ps}']}}\n  worker: {{tasks: ['local:{port}']}}\n")
    env = with_fake_smi(tmp_path, home)
    result = subprocess.run([sys.executable, "-m", "tfcluster", "plan", str(spec), "--check"], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "GPU(s) but the spec gives it none" in line]
    assert len(said) == (1 if warned else 0), result.stderr
    if warned:
        assert said[0] == ("tfcluster: warning: host local has 2 GPU(s) but the spec gives it none, so its tasks run "
                           "on the CPU (CUDA_VISIBLE_DEVICES is empty for them): set `gpus: 2` on the host to use "
                           "them (and `per_gpu: true` on a job for a task per GPU), or `gpus: 0` to say the CPU is "
                           "meant")
