"""`down` and `status` ask each host only which machine it is: no `nvidia-smi` runs there
(on a GPU box without persistence mode each call can take seconds, on every host, at every
`status --watch` refresh). `plan --check` still asks for the GPUs. The fake `nvidia-smi`
notes each call in a file; this machine has no GPU."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import cli_env, this_python_renamed
from tests.tf_launch import free_ports

pytestmark = pytest.mark.timeout(120)

FAKE_SMI = """#!/bin/sh
echo "$*" >> {calls}
case "$*" in
  "--query-gpu=driver_version --format=csv,noheader") echo 550.54.15; echo 550.54.15 ;;
  *) exit 1 ;;
esac
"""


@pytest.mark.parametrize("shim", ["in-process", "subprocess"])
def test_down_and_status_run_no_nvidia_smi_where_plan_check_does(tmp_path, home, shim):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "smi-calls"
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI.format(calls=calls))
    (bin_dir / "nvidia-smi").chmod(0o755)
    python = ""
    if shim == "subprocess":      # another path to this interpreter: the shim runs as a process of its own
        python = f"python: {this_python_renamed(bin_dir)}\n"
    ps, worker = free_ports(2)
    spec = tmp_path / "gpus.yaml"
    spec.write_text(f"name: lightinfo\n{python}hosts:\n  - {{name: a, address: 127.0.0.1, gpus: 2}}\n"
                    f"jobs:\n  ps: {{tasks: ['a:{ps}']}}\n  worker: {{tasks: ['a:{worker}']}}\n")
    env = {**cli_env(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def tfcluster(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tfcluster", *args, str(spec)], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path, env=env)

    for command in (["status"], ["status", "--json"], ["down"]):
        result = tfcluster(*command)
        assert result.returncode == 0, (command, result.stdout + result.stderr)
        assert not calls.exists(), (command, calls.read_text())
    result = tfcluster("plan", "--check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls.read_text().splitlines() == ["--query-gpu=driver_version --format=csv,noheader"]
