"""Every benchmark in benchmarks/ runs with --smoke (tiny sizes, 1 rep), exits 0 and prints
its baseline-vs-tfcluster ratio line. The numbers themselves are not asserted: they belong
in benchmarks/README.md, measured on a quiet machine with full sizes."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def needs_sshd(test):
    """The benchmark starts sshds of its own (benchmarks/_common.py): the ssh class."""
    have = os.path.exists("/usr/sbin/sshd") and shutil.which("ssh")
    return pytest.mark.ssh(pytest.mark.skipif(not have, reason="OpenSSH server/client not installed")(test))


def _smoke(name: str, timeout: float, python: str = sys.executable) -> str:
    r = subprocess.run([python, str(BENCH / name), "--smoke", "--bare-login"],
                       capture_output=True, text=True, timeout=timeout, cwd=BENCH)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "RATIO " in r.stdout, out[-4000:]
    assert "cleanup: no process of this benchmark survives" in r.stdout, out[-4000:]
    return r.stdout


def test_plan_scale_benchmark_runs_small_and_leaves_nothing_running():
    _smoke("plan_scale.py", 60)


def test_log_throughput_benchmark_runs_small_and_leaves_nothing_running():
    r = subprocess.run([sys.executable, str(BENCH / "log_throughput.py"), "--smoke"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "LogMux/raw" in r.stdout


@needs_sshd
@pytest.mark.skipif(not shutil.which("pdsh"), reason="pdsh not installed")
def test_exec_fanout_benchmark_runs_small_and_leaves_nothing_running():
    _smoke("exec_fanout.py", 90)


@needs_sshd
def test_log_stream_benchmark_runs_small_and_leaves_nothing_running():
    out = _smoke("log_stream.py", 120)
    assert "verified:" in out


@needs_sshd
def test_rss_stream_benchmark_runs_small_and_leaves_nothing_running():
    assert "TARGET rss_stream" in _smoke("rss_stream.py", 150)


@pytest.mark.tf
def test_up_local_benchmark_runs_small_and_leaves_nothing_running():
    _smoke("up_local.py", 180)


@pytest.mark.tf
@needs_sshd
def test_up_ssh_benchmark_runs_small_and_leaves_nothing_running():
    _smoke("up_ssh.py", 180)


@pytest.mark.tf
def test_train_steps_benchmark_runs_small_and_leaves_nothing_running():
    _smoke("train_steps.py", 240)


@pytest.mark.tf
def test_fence_cost_benchmark_runs_small_and_leaves_nothing_running():
    _smoke("fence_cost.py", 240)


def test_restart_latency_benchmark_runs_small_and_leaves_nothing_running():
    _smoke("restart_latency.py", 120)


def test_saved_runs_benchmark_runs_small_and_leaves_nothing_running():
    _smoke("saved_runs.py", 120)


@needs_sshd
@pytest.mark.skipif(not shutil.which("pdsh"), reason="pdsh not installed")
def test_scale_up_benchmark_runs_small_and_leaves_nothing_running():
    _smoke("scale_up.py", 240)


@needs_sshd
def test_host_loss_benchmark_runs_small_and_leaves_nothing_running():
    out = _smoke("host_loss.py", 120)
    assert "TARGET host_loss dropped" in out


@needs_sshd
@pytest.mark.tf
def test_ckpt_pull_benchmark_runs_small_and_leaves_nothing_running():
    assert "RATIO ckpt_push" in _smoke("ckpt_pull.py", 150)


@needs_sshd
@pytest.mark.tf
def test_recovery_benchmark_runs_small_and_leaves_nothing_running():
    assert "steps lost, script" in _smoke("recovery.py", 180)


def _bed_unavailable() -> str | None:
    from tests.netns import _unavailable
    return _unavailable()


@needs_sshd
@pytest.mark.tf
def test_kills_benchmark_runs_small_and_leaves_nothing_running():
    """A real kill on the bed of separate hosts (tests/netns.py) in the way that was once judged
    a task's failure (the host's tasks dying before its sshd), judged lost."""
    why = _bed_unavailable()
    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the separate-host test bed cannot run: {why}")
        pytest.skip(f"the separate-host test bed cannot run: {why}")
    r = subprocess.run([sys.executable, str(BENCH / "kills.py"), "--smoke", "--bare-login", "--kill", "tasks-first"],
                       capture_output=True, text=True, timeout=420, cwd=BENCH)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "judged lost: 1/1" in r.stdout, out[-4000:]
    assert "cleanup: no process of this benchmark survives" in r.stdout, out[-4000:]


@needs_sshd
@pytest.mark.tf
def test_keras_jax_benchmark_runs_small_and_leaves_nothing_running():
    from tests.helpers import jax_python
    out = _smoke("keras_jax.py", 300, python=jax_python())
    for row in ("keras_jax_ready", "keras_jax_first_epoch", "keras_jax_two_processes"):
        assert f"RATIO {row}" in out, out[-3000:]
