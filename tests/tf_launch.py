"""Launch a TensorFlow cluster by hand on loopback: the baseline tfcluster replaces.

Free ports, one TF_CONFIG per process, the same environment contract tfcluster
gives scripts, each process in its own session with its output in
a file, and a ``kill_all`` that leaves nothing behind. Used by the template tests
and by the benchmarks ("launched by hand"); then what the templates print, read.

    with HandLaunch(tmp_path, tag="test:handlaunch") as launch:
        cluster = make_cluster(ps=1, worker=2)
        for i in range(1):
            launch.start_server(cluster, "ps", i)
        ...
        procs = [launch.start_script(script, cluster, "worker", i, run_id="r1") for i in range(2)]
        launch.wait_all(procs, timeout=120)
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"

# tfcluster's own server program (serves its TF_CONFIG's task forever, never exits by itself),
# run as the shim runs it: its lean import of TensorFlow's runtime costs a fifth of the CPU of
# `import tensorflow`, and the template tests start dozens of servers.
SERVER_PROGRAM = Path(__file__).resolve().parent.parent / "tfcluster" / "host" / "tfserver.py"


def free_ports(n: int, host: str = HOST) -> list[int]:
    """`n` distinct ports free right now (held open together so none repeats), on every
    address: a TF server binds all of them, and a test sshd listening on 127.0.0.2 would
    leave a port bindable on 127.0.0.1 yet taken for the task (seen once in CI). They come
    from below the kernel's ephemeral range: a port picked there could be any connection's
    source port by the time its task binds it (a test's SSH client held one, seen once in CI).
    `host` is where the tasks will be addressed; the check does not depend on it. Each test
    process picks from a slice of its own (`_slice`): a port free now is bound by its task only
    later, and a test in another process could have picked it meanwhile (seen once in CI, with
    the quick lane beside two workers: a plan's check found its ps's port held by another test's
    server)."""
    first, last = _slice(PORTS_FROM, _ephemeral_low())
    pick = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        for _ in range(200 * n):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind(("0.0.0.0", pick.randrange(first, last) if last - first > 1000 else 0))
            except OSError:             # in use: another
                s.close()
                continue
            socks.append(s)
        assert len(socks) == n, f"no {n} free ports in {first}-{last - 1}"
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


PORTS_FROM = 10000
SLICES = 5      # pytest-xdist's workers gw0-gw3 (`scripts/test.sh` runs at most 4), and one without


def _slice(low: int, high: int) -> tuple[int, int]:
    """This test process's part of [low, high): worker gwN's is slice N % 4, a process run
    without workers (the quick lane of `scripts/test.sh`, a plain `pytest`) the last."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) % (SLICES - 1) if re.fullmatch(r"gw\d+", worker) else SLICES - 1
    size = (high - low) // SLICES
    return low + index * size, low + (index + 1) * size


def _ephemeral_low() -> int:
    """The first port of the kernel's range for connections' source ports (32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def make_cluster(ps: int = 1, worker: int = 2, chief: int = 0, host: str = HOST) -> dict[str, list[str]]:
    """A cluster dict (TF_CONFIG's "cluster") on free ports; jobs with no tasks are left out."""
    sizes = {"chief": chief, "ps": ps, "worker": worker}
    ports = iter(free_ports(sum(sizes.values()), host))
    return {job: [f"{host}:{next(ports)}" for _ in range(n)] for job, n in sizes.items() if n}


def tf_config(cluster: dict, job: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})


def is_chief(cluster: dict, job: str, index: int) -> bool:
    return job == "chief" if "chief" in cluster else (job == "worker" and index == 0)


def script_env(cluster: dict, job: str, index: int, run_id: str, tag: str) -> dict[str, str]:
    """The environment tfcluster gives a script process."""
    env = dict(os.environ)
    env.update({
        "TF_CONFIG": tf_config(cluster, job, index),
        "TFCLUSTER_MASTER": f"grpc://{cluster[job][index]}",
        "TFCLUSTER_JOB": job,
        "TFCLUSTER_TASK_INDEX": str(index),
        "TFCLUSTER_IS_CHIEF": "1" if is_chief(cluster, job, index) else "0",
        "TFCLUSTER_RUN_ID": run_id,
        "TFCLUSTER_NUM_WORKERS": str(len(cluster.get("worker", []))),
        "TFCLUSTER_JOB_ID": f"{tag}:{job}:{index}",
        "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    })
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.monotonic)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()


class HandLaunch:
    """Owns every process it starts; `kill_all` (also on exit of the `with`) ends them all."""

    def __init__(self, log_dir: Path, tag: str = "test:handlaunch") -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.tag = tag
        self.procs: list[Proc] = []

    def __enter__(self) -> HandLaunch:
        return self

    def __exit__(self, *exc) -> None:
        self.kill_all()

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Proc:
        taken = {p.name for p in self.procs}
        if name in taken:  # a restarted task keeps the first one's log
            name = next(f"{name}.{n}" for n in range(2, 10**6) if f"{name}.{n}" not in taken)
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def start_server(self, cluster: dict, job: str, index: int, run_id: str = "servers") -> Proc:
        env = script_env(cluster, job, index, run_id, self.tag)
        return self.start(f"server-{job}{index}", [sys.executable, str(SERVER_PROGRAM)], env)

    def start_script(self, script: str | Path, cluster: dict, job: str, index: int,
                     run_id: str, args: list[str] = (), name: str | None = None) -> Proc:
        env = script_env(cluster, job, index, run_id, self.tag)
        name = name or f"{run_id}-{job}{index}"
        return self.start(name, [sys.executable, str(script), *args], env)

    def wait(self, proc: Proc, timeout: float) -> int:
        try:
            return proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{proc.name} still running after {timeout}s; output:\n"
                                 f"{proc.output()[-3000:]}") from None

    def wait_all(self, procs: list[Proc], timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        return [self.wait(p, max(0.1, deadline - time.monotonic())) for p in procs]

    def kill(self, proc: Proc) -> None:
        if proc.popen.poll() is None:
            try:
                os.killpg(proc.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.popen.wait()

    def kill_all(self) -> None:
        for proc in reversed(self.procs):
            self.kill(proc)


def wait_port(port: int, timeout: float, host: str = HOST, proc: Proc | None = None) -> None:
    """Wait until something accepts TCP connections on host:port (a started TF server)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            pass
        if proc is not None and proc.returncode is not None:
            raise AssertionError(f"{proc.name} exited {proc.returncode}:\n{proc.output()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listening on {host}:{port} after {timeout}s")
        time.sleep(0.1)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


# -- the templates, run by hand, and what they print ------------------------------------------

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
RESULT = re.compile(r"^tfcluster-result: global_step=(\d+) loss=([-+0-9.eE]+|nan|inf)$", re.M)
PROGRESS = re.compile(r"^step=(\d+) loss=([-+0-9.eE]+)", re.M)


def result(output: str) -> tuple[int, float]:
    found = RESULT.findall(output)
    assert found, f"no result line in:\n{output[-3000:]}"
    return int(found[-1][0]), float(found[-1][1])


def progress(output: str) -> list[tuple[int, float]]:
    return [(int(s), float(l)) for s, l in PROGRESS.findall(output)]


def assert_trained(outputs: list[str], steps: int | None = None) -> None:
    """The outputs of one run's processes: each has a result line (at exactly `steps`
    if given), and the loss fell from the earliest progress line of any of them (a
    worker that joins late starts from an already trained model)."""
    lines = sorted(line for out in outputs for line in progress(out))
    assert lines, "no progress lines in:\n" + "\n".join(out[-2000:] for out in outputs)
    for out in outputs:
        step, loss = result(out)
        assert loss < lines[0][1] / 10, f"loss did not fall: first {lines[0]}, final {loss}"
        if steps is not None:
            assert step == steps, f"final global_step {step} != --steps {steps}"


def checkpoint_step(model_dir: Path) -> int:
    """The step of the latest complete tf.compat.v1 checkpoint in model_dir (-1: none)."""
    try:
        text = (model_dir / "checkpoint").read_text()
    except OSError:
        return -1
    found = re.search(r'^model_checkpoint_path: ".*-(\d+)"', text, re.M)
    return int(found.group(1)) if found else -1


def assert_exit_0(launch: HandLaunch, procs, timeout: float) -> None:
    rcs = launch.wait_all(procs, timeout)
    for proc, rc in zip(procs, rcs):
        assert rc == 0, f"{proc.name} exited {rc}:\n{proc.output()[-3000:]}"


def start_servers(launch: HandLaunch, cluster: dict, jobs=("ps", "worker")) -> None:
    """tfcluster's own server program for every task of `jobs`, waited for by port."""
    servers = [(launch.start_server(cluster, job, i), addr)
               for job in jobs for i, addr in enumerate(cluster.get(job, []))]
    for proc, addr in servers:
        wait_port(port_of(addr), 60, proc=proc)


RESTORED = re.compile(r"^restored (\S+) at step=(\d+)$", re.MULTILINE)


def restored_step(output: str, model_dir: Path) -> int:
    found = RESTORED.findall(output)
    assert found, f"no 'restored ... at step=N' line in:\n{output[-3000:]}"
    assert Path(found[0][0]).parent == model_dir, found
    return int(found[0][1])
