"""Ctrl-C at every phase of `up` and `train`, local and over SSH: exit 130 with
"interrupted" (never a host failure), promptly, and nothing left running.

Each case waits for the line that opens a phase and sends SIGINT to tfcluster's
process group, as a terminal's Ctrl-C does. Where the signal lands inside the
phase varies from run to run; the contract holds wherever it lands.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers import (
    kill_group,
    local_spec,
    read_until,
    cluster_tables,
    ssh_spec,
    start_tfcluster,
    tagged_processes,
    wait_for,
)
from tfcluster.plan import STOP_GRACE  # a script's last checkpoint after Ctrl-C (train.stop_grace)

pytestmark = [pytest.mark.tf, pytest.mark.timeout(240), pytest.mark.alone]   # how soon Ctrl-C ends a run: judged alone

PROMPT = STOP_GRACE + 10.0   # "about a second plus the stop grace", with room for a busy machine

TRAIN = "train:\n  mode: between-graph\n  script: template:between_graph\n" \
        "  args: ['--steps', '100000', '--log_every', '20', '--min_step_time', '0.05']\n"

# (command, the line that opens the phase, a second Ctrl-C once stopping has begun)
PHASES = {
    "up-connecting": ("up", r"Connecting to", False),
    "up-starting": ("up", r"Starting \d+ server", False),
    "train-connecting": ("train", r"connecting to", False),
    "train-reach": ("train", r"Checking that \d+ host\(s\) reach", False),
    "train-starting": ("train", r"Starting \d+ server", False),
    "train-shipping": ("train", r"ready on .*, 3/3\)", False),
    "train-running": ("train", r"worker:1 .*step=", False),
    "train-stopping": ("train", r"worker:0 .*step=", True),
}


_NAMES = {"local": "intr", "ssh": "intrssh"}


def _spec(transport: str, tmp_path, request):
    if transport == "local":
        return local_spec(tmp_path, args=["--steps", "100000", "--log_every", "20", "--min_step_time", "0.05"],
                          name=_NAMES[transport])
    sshd = request.getfixturevalue("sshd")
    request.getfixturevalue("ssh_home")
    return ssh_spec(tmp_path, sshd, name=_NAMES[transport], train=TRAIN)


@pytest.mark.parametrize("transport", ["local", pytest.param("ssh", marks=pytest.mark.ssh)])
@pytest.mark.parametrize("phase", list(PHASES))
def test_ctrl_c_exits_130_promptly_and_leaves_nothing(phase, transport, tmp_path, home, request):
    command, marker, twice = PHASES[phase]
    spec = _spec(transport, tmp_path, request)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = start_tfcluster(command, str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, marker, timeout=150)
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        if twice:
            read_until(proc, r"Stopping every task", timeout=PROMPT)
            os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=PROMPT + 30)
        elapsed = time.monotonic() - t0
        assert proc.returncode == 130, out[-3000:]
        assert "tfcluster: error: interrupted" in out, out[-3000:]
        assert "KeyboardInterrupt" not in out and "Traceback" not in out, out[-3000:]
        assert "host " not in out.split("tfcluster: error:")[-1], out[-3000:]
        assert elapsed < PROMPT, f"took {elapsed:.1f}s to stop after Ctrl-C"
        wait_for(lambda: not tagged_processes(), timeout=10, what="every task gone after Ctrl-C")
        wait_for(lambda: not cluster_tables(_NAMES[transport]), timeout=5, what="the fence's table to go")
    finally:
        kill_group(proc)


def test_sigterm_stops_a_run_as_ctrl_c_does_and_a_second_one_at_once(tmp_path, home):
    """SIGTERM to the launcher alone (as `timeout`, a scheduler or systemd send it): the same
    ordered stop as Ctrl-C, told as SIGTERM's (a second one stops at once), exit 143."""
    spec = local_spec(tmp_path, args=["--steps", "100000", "--log_every", "20", "--min_step_time", "0.05"],
                      name="intrterm")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:0 .*step=", timeout=150)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        read_until(proc, r"Stopping every task \(SIGTERM again to stop at once\)", timeout=PROMPT)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=PROMPT + 30)
        assert proc.returncode == 143, out[-3000:]
        assert "second SIGTERM: stopping everything now" in out, out[-3000:]
        assert "tfcluster: error: terminated (SIGTERM)" in out, out[-3000:]
        assert "Ctrl-C" not in out and "Traceback" not in out, out[-3000:]
        assert time.monotonic() - t0 < PROMPT, "took too long to stop after SIGTERM"
        wait_for(lambda: not tagged_processes(), timeout=10, what="every task gone after SIGTERM")
        wait_for(lambda: not cluster_tables("intrterm"), timeout=5, what="the fence's table to go")
    finally:
        kill_group(proc)


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.15, 0.3, 0.6])
def test_ctrl_c_at_varied_moments_of_starting_servers_leaves_nothing(delay, tmp_path, home):
    """The moment matters for races (a server spawned just as the stop sweep runs): the
    signal lands `delay` seconds into "Starting servers". The delay is where the fault is
    injected, not a wait for anything."""
    spec = local_spec(tmp_path, name="intrv")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = start_tfcluster("up", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"Starting \d+ server", timeout=150)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=PROMPT + 30)
        # a late signal may find `up` already done (exit 0); then `down` must clean up
        assert proc.returncode in (0, 130), out[-3000:]
        if proc.returncode == 130:
            assert "tfcluster: error: interrupted" in out and "Traceback" not in out, out[-3000:]
            wait_for(lambda: not tagged_processes(), timeout=10, what="every server gone after Ctrl-C")
            wait_for(lambda: not cluster_tables("intrv"), timeout=5, what="the fence's table to go")
    finally:
        kill_group(proc)
        if tagged_processes():
            from tests.helpers import tfcluster
            tfcluster("down", str(spec), home=home, cwd=cwd)
