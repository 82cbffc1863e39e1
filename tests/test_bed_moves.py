"""Moves between separate machines (tests/netns.py): a host killed for real (every process
on it, its address then answering nothing) or gone silent (its packets dropped), its tasks
moved to a spare, judged by the moved task's own steps. On loopback hosts the dead host's
address still reached the spare's new server; here it reaches nothing."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.helpers import kill_group, manifest, only_run, read_until, start_tfcluster, tagged_processes, wait_for

pytestmark = [pytest.mark.ssh, pytest.mark.tf]

PORTS = (25000, 25001, 25002)      # each bed host has its own ports: no clash with any other test


def bed_spec(tmp: Path, bed, name: str, *, mode: str = "between-graph", steps: int = 3000,
             script: str = "between_graph", extra: str = "") -> Path:
    """ps on h2, worker:0 (the chief) on h3, worker:1 on h4, h5 the spare: four bed hosts."""
    h2, h3, h4, h5 = (bed.add(n) for n in ("h2", "h3", "h4", "h5"))
    text = (f"name: {name}\npython: {sys.executable}\nworkdir: {tmp / 'remote'}\n"
            f"ssh: {{connect_timeout: 5}}\n"
            f"hosts:\n  - {h2.spec()}\n  - {h3.spec()}\n  - {h4.spec()}\n  - {h5.spec(spare='true')}\n"
            f"jobs:\n  ps: {{tasks: ['h2:{PORTS[0]}']}}\n"
            f"  worker: {{tasks: ['h3:{PORTS[1]}', 'h4:{PORTS[2]}']}}\n"
            f"train:\n  mode: {mode}\n  script: template:{script}\n"
            f"  args: ['--steps', '{steps}', '--log_every', '50', '--model_dir', '{{workdir}}/ckpt'"
            + (", '--cleanup_timeout', '3'" if script == "between_graph" else "") + "]\n"
            "  checkpoint: {dir: '{workdir}/ckpt', keep: 2, sync: 2s}\n" + extra)
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


def faulted(spec: Path, home, cwd: Path, started: str, fault, said: str, timeout: float = 300) -> tuple[int, str]:
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, started, timeout=200)
        fault()
        read_until(proc, said, timeout=90)
        rest = proc.communicate(timeout=timeout)[0]
    finally:
        kill_group(proc)
    return proc.returncode, rest


@pytest.mark.timeout(480)
@pytest.mark.parametrize("fault", ["kill", "silence"])
def test_a_moved_worker_trains_on_the_spare_after_its_host_dies(tmp_path, home, ssh_home, bed, fault):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = bed_spec(tmp_path, bed, f"bmove{fault[0]}", steps=2500)
    rc, rest = faulted(spec, home, cwd, r"worker:1 .*step=[1-9]", lambda: getattr(bed, fault)("h4"),
                       r"h4: moving worker:1 to h5")
    assert rc == 0, rest[-4000:]
    doc = manifest(only_run(cwd / "runs"))
    (move,) = doc["moves"]
    # its ps dials worker:1 at the address it started with: every task restarts, from the checkpoint
    assert move["host"] == "h4" and move["to"] == "h5" and move["action"] == "restart", move
    assert move["resumed_step"] is not None, (move, rest[-4000:])
    assert doc["tasks"]["worker:1"]["host"] == "h5"
    # the moved worker itself trained on the spare: a step past any the run had said before
    assert doc["progress"]["worker:1"]["step"] > move["step_at"], (doc["progress"], move)
    assert re.search(r"worker:0 on h3 resumed at step \d+", rest), rest[-3000:]
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")
