"""Shared helpers for the end-to-end tests: write specs on free ports, run the CLI."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.tf_launch import free_ports

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "templates"
RESULT = re.compile(r"tfcluster-result: global_step=(\d+) loss=([0-9.eE+-]+|nan|inf)")
LOSS = re.compile(r"loss=([0-9.eE+-]+)")


def local_spec(tmp: Path, *, mode: str = "between-graph", script: str = "template:between_graph",
               args: list[str] | None = None, ps: int = 1, workers: int = 2, chief: int = 0,
               restart: str | None = None, name: str = "t", extra: str = "") -> Path:
    """A spec for 127.0.0.1 tasks on free ports (local transport, no SSH)."""
    ports = iter(free_ports(ps + workers + chief))
    jobs = []
    for job, n in (("chief", chief), ("ps", ps), ("worker", workers)):
        if n:
            tasks = ", ".join(f'"local:{next(ports)}"' for _ in range(n))
            jobs.append(f"  {job}: {{tasks: [{tasks}]}}")
    text = (f"name: {name}\nhosts:\n  - {{name: local, address: 127.0.0.1}}\njobs:\n" + "\n".join(jobs)
            + f"\ntrain:\n  mode: {mode}\n  script: {script}\n  args: {json.dumps(args or [])}\n")
    if restart:
        text += f"  restart: {{policy: {restart}, max_restarts: 3}}\n"
    text += extra
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


def cli_env(home: Path) -> dict[str, str]:
    return {**os.environ, "HOME": str(home), "NO_COLOR": "1", "COLUMNS": "200"}


def tfcluster(*args: str, home: Path, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfcluster", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=cli_env(home))


def start_tfcluster(*args: str, home: Path, cwd: Path) -> subprocess.Popen:
    """tfcluster in its own process group, as a shell would run it in the foreground."""
    return subprocess.Popen([sys.executable, "-m", "tfcluster", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=cwd, env=cli_env(home), text=True,
                            start_new_session=True)


def read_until(proc: subprocess.Popen, pattern: str, timeout: float) -> list[str]:
    """Lines of proc's output up to and including the first matching `pattern`."""
    deadline = time.monotonic() + timeout
    lines = []
    regex = re.compile(pattern)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if regex.search(line):
            return lines
    raise AssertionError(f"no line matching {pattern!r} within {timeout}s; got:\n{''.join(lines[-30:])}")


def kill_tagged_once_seen(proc: subprocess.Popen, pattern: str, tag_suffix: str, *, wait: float,
                          finish: float) -> str:
    """Read a running tfcluster's output until `pattern`, SIGKILL the one task process whose
    tag ends with `tag_suffix` (`:worker:1:script`, `:ps:0:server`), then return the rest of
    the output once tfcluster exits. tfcluster's group is killed whatever happens."""
    from tests.conftest import tagged_processes

    try:
        read_until(proc, pattern, timeout=wait)
        victims = [pid for pid, tag in tagged_processes().items() if tag.endswith(tag_suffix)]
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        return proc.communicate(timeout=finish)[0]
    finally:
        kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def only_run(runs: Path) -> Path:
    dirs = [d for d in runs.iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def result_of(log: str) -> tuple[int, float]:
    found = RESULT.findall(log)
    assert found, f"no result line in:\n{log[-2000:]}"
    step, loss = found[-1]
    return int(step), float(loss)


def losses(log: str) -> list[float]:
    return [float(x) for x in LOSS.findall(log)]


def ssh_spec(tmp: Path, sshd, *, name: str = "sshc", ssh_extra: str = "", env: str = "",
             train: str = "", ports: list[int] | None = None) -> Path:
    """Three SSH hosts on loopback, 1 ps + 2 workers, each task on its own port."""
    p = ports or free_ports(3)
    workdir = tmp / "remote"
    text = (
        f"name: {name}\npython: {sys.executable}\nworkdir: {workdir}\n{env}"
        f"ssh:\n  port: {sshd.port}\n  connect_timeout: 5\n{ssh_extra}"
        "hosts:\n  - {name: h2, address: 127.0.0.2}\n  - {name: h3, address: 127.0.0.3}\n"
        "  - {name: h4, address: 127.0.0.4}\n"
        f"jobs:\n  ps: {{tasks: ['h2:{p[0]}']}}\n  worker: {{tasks: ['h3:{p[1]}', 'h4:{p[2]}']}}\n{train}"
    )
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


def this_python_renamed(directory: Path, name: str = "python-other") -> str:
    """This interpreter under another path, as a user's wrapper script would give it: the
    local host then runs the shim as a process of its own (its own interpreter runs it
    in-process). A wrapper, not a symlink: a symlink to a venv's python outside the venv
    no longer finds the venv's packages."""
    wrapper = Path(directory) / name
    if not wrapper.exists():
        wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        wrapper.chmod(0o755)
    return str(wrapper)
