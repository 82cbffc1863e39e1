"""The hang watchdog in keras-jax mode: silence within JAX's own timeouts is JAX waiting as
designed, not a hang; past them, the diagnosis names the timeout of the phase.

The lines are XLA's, as jax 0.10.2 printed them here with TF_CPP_MIN_LOG_LEVEL=0 (two real
processes on loopback: connect, one killed, the other's shutdown barrier ending at the
heartbeat timeout). The watchdog is pure (the clock is an argument); the plan is a real one.
"""
from __future__ import annotations

from pathlib import Path

from tfcluster.diagnose import watchdog as wd
from tfcluster.diagnose.checks import RunChecks
from tfcluster.plan import build_plan
from tfcluster.spec import load_spec

CONNECTED = (b"I1128 11:24:13.665569   23335 client.cc:133] Connected to distributed JAX controller")
SHUTDOWN = (b"I1128 11:24:15.922765   23335 client.cc:151] Distributed task shutdown initiated.")
CONNECTING = b"I1128 11:23:34.955676   13213 grpc_credentials.cc:30] gRPC insecure client credentials are used."


def jax_dog() -> wd.Watchdog:
    return wd.Watchdog(hang_after=20, coordinator="worker:0")


def feed(dog: wd.Watchdog, key: str, line: bytes, now: float) -> None:
    """What LogMux hands the watchdog in keras-jax mode: lines holding one of its markers."""
    if any(m in line for m in wd.MARKERS + wd.JAX_MARKERS):
        dog.saw(key, line, now)


def test_a_process_connecting_is_not_called_hung_within_jaxs_initialization_timeout():
    dog = jax_dog()
    feed(dog, "worker:1", CONNECTING, now=1.0)           # not a marker: still connecting
    dog.silent("worker:1", since=0.0, now=300.0, started=0.0)
    assert dog.due(300.0, {"worker:0", "worker:1"}) == []    # the TF modes would have spoken at 60 s
    dog.silent("worker:1", since=0.0, now=331.0, started=0.0)
    [wait] = dog.due(331.0, {"worker:0", "worker:1"})
    assert (wait.waiter, wait.detail, wait.target) == ("worker:1", "jax-init", "worker:0")
    facts = wd.Facts(host="h2", address="127.0.0.2:7600", state="running", pid=42, quiet_for=320.0)
    line = wd.explain(wait, facts, 331.0, "h3", "runs/x/worker-0.log")
    assert "for process 0's coordinator, worker:0 (h2, 127.0.0.2:7600): worker:0 is running (pid 42" in line
    assert "initialization_timeout (300s by default)" in line
    assert line.endswith("process 0's log: runs/x/worker-0.log")


def test_after_connecting_the_bound_is_the_heartbeat_timeout_and_a_restart_connects_again():
    dog = jax_dog()
    feed(dog, "worker:0", CONNECTED, now=10.0)
    dog.silent("worker:0", since=20.0, now=149.0, started=0.0)
    assert dog.due(149.0, {"worker:0"}) == []
    dog.silent("worker:0", since=20.0, now=151.0, started=0.0)
    [wait] = dog.due(151.0, {"worker:0"})
    assert wait.detail == "jax-run" and wait.target is None
    line = wd.explain(wait, None, 151.0, "h2", "runs/x/worker-0.log")
    assert "no process of the run has printed anything for 131s" in line
    assert "heartbeat timeout (heartbeat_timeout_seconds, 100s by default)" in line
    # a new attempt (all restart together) connects anew: the connected line was the old one's
    dog.silent("worker:0", since=400.0, now=500.0, started=400.0)
    assert dog.due(500.0, {"worker:0"}) == []
    dog.silent("worker:0", since=400.0, now=731.0, started=400.0)
    [wait] = dog.due(731.0, {"worker:0"})
    assert (wait.detail, wait.target) == ("jax-init", None)     # process 0 waits for the others
    assert "for every other process to register" in wd.explain(wait, None, 731.0, "h2", "log")


def test_shutdown_is_bounded_by_jaxs_shutdown_timeout_and_said_once_for_all_processes():
    dog = jax_dog()
    for key in ("worker:0", "worker:1"):
        feed(dog, key, CONNECTED, now=10.0)
        feed(dog, key, SHUTDOWN, now=50.0)
    for now in (329.0, 381.0):
        for key in ("worker:0", "worker:1"):
            dog.silent(key, since=50.0, now=now, started=0.0)
        due = dog.due(now, {"worker:0", "worker:1"})
    assert [(w.waiter, w.detail) for w in due] == [("worker:0", "jax-shutdown")]
    line = wd.explain(due[0], None, 381.0, "h2", "log")
    assert "shutdown_timeout_seconds (300s by default)" in line and "heartbeat_timeout_seconds (100s)" in line


def test_outside_keras_jax_mode_the_jax_lines_change_nothing():
    dog = wd.Watchdog(hang_after=20)
    dog.saw("worker:0", CONNECTED, now=0.0)
    dog.silent("worker:0", since=0.0, now=61.0, started=0.0)
    [wait] = dog.due(61.0, {"worker:0"})
    assert wait.detail == "" and "may be stuck" in wd.explain(wait, None, 61.0, "h", "log")


def test_a_keras_jax_runs_watchdog_knows_process_0_and_watches_jaxs_lines(tmp_path: Path):
    (tmp_path / "t.py").write_text("print(1)\n")
    spec = tmp_path / "s.yaml"
    spec.write_text("name: kjw\nhosts:\n  - {name: a, address: 10.0.0.1}\n  - {name: b, address: 10.0.0.2}\n"
                    "jobs:\n  worker: {count: 2, hosts: [a, b], port: 7600}\n"
                    "train: {mode: keras-jax, script: t.py}\n")
    checks = RunChecks(build_plan(load_spec(str(spec))), ui=None, log_dir=str(tmp_path), wake=lambda: None)
    assert checks.watchdog is not None and checks.watchdog.coordinator == "worker:0"
    assert set(wd.JAX_MARKERS) <= set(checks.markers)
    assert checks.summary()["hang"] == "no process silent past JAX's timeouts"
