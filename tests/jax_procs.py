"""Real JAX processes on this machine, started by hand as mode keras-jax starts them (the extras
layer's Python), for the tests that make a multi-process JAX job end one way or another."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests.helpers import jax_python
from tests.tf_launch import free_ports


class Jax:
    """JAX processes of one case, started as mode keras-jax starts them (CPU, gloo, the
    coordinator on this machine), all killed at its end."""

    def __init__(self, tmp: Path, program: str | None = None):
        self.program = tmp / "job.py"
        if program is not None:
            self.program.write_text(program)
        self.port, = free_ports(1)
        self.procs: list[subprocess.Popen] = []

    def next_job(self) -> None:
        """The processes started from now on are another job: a coordinator port of its own."""
        self.port, = free_ports(1)

    def start(self, *args: str, env: dict | None = None, script: Path | None = None) -> subprocess.Popen:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "KERAS_", "JAX_"))}
        proc = subprocess.Popen(
            [jax_python(), str(script or self.program), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**base, "JAX_PLATFORMS": "cpu", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
                 "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{self.port}", **(env or {})})
        self.procs.append(proc)
        return proc

    def joined(self, proc: subprocess.Popen) -> None:
        line = proc.stdout.readline()       # bounded: the program joins or ends within INIT_TIMEOUT
        assert line.startswith(b"joined"), line + proc.stdout.read()

    def close(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate(timeout=20)
