"""The test's side of a host that warns, on the bed of separate hosts (tests/netns.py): the
fake metadata service (tests/metadata_fakes.py) started inside a host's namespaces and driven
over the bed's bridge, and the spec the notice tests train with."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.helpers import kill_group, wait_for

P = (25100, 25101, 25102)
FAKE_PORT = 18080
FAKE = str(Path(__file__).with_name("metadata_fakes.py"))


def start_fake(host) -> subprocess.Popen:
    """The fake metadata service inside `host`'s namespaces (it dies with the host)."""
    enter = ["nsenter", "-t", str(host.sshd.proc.pid), "-n", "-p", "-m", "--"]
    proc = subprocess.Popen(enter + [sys.executable, FAKE, str(FAKE_PORT), "1"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def control(host, what: str, **body) -> dict:
    """The test's side of the fake, from this machine over the bed's bridge."""
    request = urllib.request.Request(f"http://{host.address}:{FAKE_PORT}/_fake/{what}",
                                     data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=5) as r:
        return json.loads(r.read())


def write_notice_spec(tmp: Path, name: str, listed: str, steps: int) -> Path:
    """ps:0 on h2, worker:0 (the chief) on h3, worker:1 on h4, between-graph, on the `listed` hosts."""
    text = (f"name: {name}\npython: {sys.executable}\nworkdir: {tmp / 'remote'}\nssh: {{connect_timeout: 5}}\n"
            f"hosts:\n{listed}jobs:\n  ps: {{tasks: ['h2:{P[0]}']}}\n"
            f"  worker: {{tasks: ['h3:{P[1]}', 'h4:{P[2]}']}}\n"
            f"train:\n  mode: between-graph\n  script: template:between_graph\n"
            f"  args: ['--steps', '{steps}', '--log_every', '50', '--model_dir', '{{workdir}}/ckpt', "
            f"'--cleanup_timeout', '3']\n"
            f"  checkpoint: {{dir: '{{workdir}}/ckpt', keep: 2, sync: 2s}}\n")
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


def kill_at(bed, deadlines: dict[str, float]) -> None:
    """Each warned host killed at its deadline, as its cloud would, in deadline order."""
    for host, deadline in sorted(deadlines.items(), key=lambda kv: kv[1]):
        wait_for(lambda d=deadline: time.time() >= d, timeout=120, interval=0.2, what=f"{host}'s deadline")
        bed.kill(host)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        kill_group(proc)
