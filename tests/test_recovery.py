"""A lost host's tasks moved to a spare, or the run shrunk, produced for real: the host's
own sshd and everything started through it SIGKILLed (tests/test_host_loss.py's kill_host),
real TensorFlow in every mode. Each lost host and each spare has an sshd of its own on a
loopback address no other test uses."""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers import (
    free_ports,
    kill_group,
    manifest,
    only_run,
    read_until,
    start_tfcluster,
    tagged_processes,
    tfcluster,
    wait_for,
)
from tests.test_host_loss import kill_host, lone

pytestmark = [pytest.mark.ssh, pytest.mark.tf]

LOST_ADDRESS = "127.0.0.31"
SPARE_ADDRESS = "127.0.0.32"


def spec_with_spare(tmp: Path, sshd, lost, spare, name: str, *, mode: str = "between-graph",
                    steps: int = 3000, on_host_loss: str | None = None, extra: str = "") -> Path:
    """ps on h2, worker:0 (the chief) on h3, both on the shared sshd; worker:1 on h4, alone on
    its sshd; h5 the spare (none when `spare` is None)."""
    p = free_ports(3)
    hosts = (f"  - {{name: h2, address: 127.0.0.2}}\n  - {{name: h3, address: 127.0.0.3}}\n"
             f"  - {{name: h4, address: {lost.addresses[0]}, ssh: {{port: {lost.port}}}}}\n")
    if spare is not None:
        hosts += f"  - {{name: h5, address: {spare.addresses[0]}, spare: true, ssh: {{port: {spare.port}}}}}\n"
    text = (f"name: {name}\npython: {sys.executable}\nworkdir: {tmp / 'remote'}\n"
            f"ssh:\n  port: {sshd.port}\n  connect_timeout: 5\n"
            f"hosts:\n{hosts}"
            f"jobs:\n  ps: {{tasks: ['h2:{p[0]}']}}\n"
            f"  worker: {{tasks: ['h3:{p[1]}', 'h4:{p[2]}']}}\n"
            f"train:\n  mode: {mode}\n  script: template:between_graph\n"
            f"  args: ['--steps', '{steps}', '--log_every', '100', '--cleanup_timeout', '3']\n"
            + (f"  on_host_loss: {on_host_loss}\n" if on_host_loss else "") + extra)
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


def killed_mid_run(spec: Path, home, cwd: Path, started: str, kill, said: str | None,
                   timeout: float = 240) -> tuple[int, str]:
    """`train` until a line matching `started`, then `kill()` (the fault), then (when `said`)
    until a line matching it: (its exit code, what it printed after that)."""
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, started, timeout=200)
        kill()
        if said is not None:
            read_until(proc, said, timeout=60)
        rest = proc.communicate(timeout=timeout)[0]
    finally:
        kill_group(proc)
    return proc.returncode, rest


@pytest.mark.timeout(420)
def test_a_lost_worker_moves_to_the_spare_and_the_run_finishes(tmp_path, home, ssh_home, sshd, sshd_factory):
    lost = lone(sshd_factory, ssh_home, LOST_ADDRESS)
    spare = lone(sshd_factory, ssh_home, SPARE_ADDRESS)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = spec_with_spare(tmp_path, sshd, lost, spare, "rspare", steps=2000)
    rc, rest = killed_mid_run(spec, home, cwd, r"worker:1 .*step=", lambda: kill_host(lost),
                              r"h4: moving worker:1 to h5", timeout=240)
    assert rc == 0, rest[-4000:]
    assert re.search(r"moved: .* h4 lost: its SSH connection dropped.*: worker:1 moved to h5", rest), rest[-3000:]
    doc = manifest(only_run(cwd / "runs"))
    assert doc["exit_code"] == 0
    (move,) = doc["moves"]
    assert move["host"] == "h4" and move["to"] == "h5" and move["action"] == "move"
    assert move["tasks"] == ["worker:1"] and move["steps_lost"] == 0, move
    assert doc["tasks"]["worker:1"]["host"] == "h5"
    assert doc["tasks"]["worker:1"]["script"]["restarts"] == 0      # a move is not a restart
    assert doc["progress"]["worker:0"]["step"] >= 1900
    listed = tfcluster("runs", str(spec), home=home, cwd=cwd)
    assert re.search(r"^rspare-\S+: \d\d:\d\d:\d\d h4 lost: worker:1 moved to h5; resumed at step \d+, "
                     r"0 step\(s\) lost$", listed.stdout, re.MULTILINE), listed.stdout
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(420)
def test_shrink_goes_on_without_a_lost_worker(tmp_path, home, ssh_home, sshd, sshd_factory):
    lost = lone(sshd_factory, ssh_home, LOST_ADDRESS)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = spec_with_spare(tmp_path, sshd, lost, None, "rshrink", steps=2000, on_host_loss="shrink")
    rc, rest = killed_mid_run(spec, home, cwd, r"worker:1 .*step=", lambda: kill_host(lost),
                              r"h4: going on without worker:1", timeout=240)
    assert rc == 0, rest[-4000:]
    assert re.search(r"^worker:1 +h4 +lost ", rest, re.MULTILINE), rest[-3000:]
    doc = manifest(only_run(cwd / "runs"))
    (move,) = doc["moves"]
    assert move["action"] == "shrink" and move["to"] is None
    assert doc["progress"]["worker:0"]["step"] >= 1900
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(300)
def test_no_spare_left_fails_as_before_naming_the_host(tmp_path, home, ssh_home, sshd, sshd_factory):
    """on_host_loss: spare, but the one spare is dead too: the run ends, exit 3, as without."""
    lost = lone(sshd_factory, ssh_home, LOST_ADDRESS)
    spare = lone(sshd_factory, ssh_home, SPARE_ADDRESS)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = spec_with_spare(tmp_path, sshd, lost, spare, "rnone", steps=5000000)
    def fault() -> None:
        kill_host(spare)
        kill_host(lost)

    rc, rest = killed_mid_run(spec, home, cwd, r"worker:1 .*step=", fault,
                              None, timeout=120)
    assert rc == 3, rest[-3000:]
    assert "h4: cannot recover: " in rest, rest[-3000:]
    assert re.search(r"tfcluster: error: h4 lost: .* \(worker:1\)", rest), rest[-3000:]
    wait_for(lambda: not tagged_processes(), timeout=90, what="no task left running")


def chief_spec(tmp: Path, sshd, lost, spare, name: str, *, mode: str, script: str, steps: int,
               jobs: str) -> Path:
    """`jobs` is the YAML of the jobs with the placeholders LOST, H2, H3 for ports' hosts;
    every task's script checkpoints to {workdir}/ckpt, which train.checkpoint copies back
    every 2 s."""
    hosts = (f"  - {{name: h2, address: 127.0.0.2}}\n  - {{name: h3, address: 127.0.0.3}}\n"
             f"  - {{name: h4, address: {lost.addresses[0]}, ssh: {{port: {lost.port}}}}}\n"
             f"  - {{name: h5, address: {spare.addresses[0]}, spare: true, ssh: {{port: {spare.port}}}}}\n")
    text = (f"name: {name}\npython: {sys.executable}\nworkdir: {tmp / 'remote'}\n"
            f"ssh:\n  port: {sshd.port}\n  connect_timeout: 5\n"
            f"hosts:\n{hosts}jobs:\n{jobs}"
            f"train:\n  mode: {mode}\n  script: template:{script}\n"
            f"  args: ['--steps', '{steps}', '--log_every', '50', '--model_dir', '{{workdir}}/ckpt'"
            + (", '--cleanup_timeout', '3'" if script == "between_graph" else "") + "]\n"
            "  checkpoint: {dir: '{workdir}/ckpt', keep: 2, sync: 2s}\n")
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


def pulled(cwd: Path) -> list[int]:
    """The steps of the checkpoints the launcher holds (`model.ckpt-300`, `ckpt-3`)."""
    names = (p.name.rpartition("-")[2] for p in (cwd / "runs").glob("*/checkpoints/*"))
    return sorted(int(n) for n in names if n.isdigit())


@pytest.mark.timeout(420)
def test_a_lost_chief_restarts_every_task_on_the_spare_from_the_launchers_copy(
        tmp_path, home, ssh_home, sshd, sshd_factory):
    """No shared filesystem: the chief's checkpoints die with its box (the test deletes them
    with the host), and the run resumes from the copy the launcher pulled."""
    lost = lone(sshd_factory, ssh_home, LOST_ADDRESS)
    spare = lone(sshd_factory, ssh_home, SPARE_ADDRESS)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = free_ports(3)
    spec = chief_spec(tmp_path, sshd, lost, spare, "rchief", mode="between-graph", script="between_graph",
                      steps=1500, jobs=f"  ps: {{tasks: ['h2:{p[0]}']}}\n"
                                       f"  worker: {{tasks: ['h4:{p[1]}', 'h3:{p[2]}']}}\n")

    def fault() -> None:
        wait_for(lambda: any(pulled(cwd)), timeout=120, what="a checkpoint past step 0 pulled to the launcher")
        kill_host(lost)
        shutil.rmtree(tmp_path / "remote" / "rchief" / "ckpt")     # the chief's disk, gone with it

    rc, rest = killed_mid_run(spec, home, cwd, r"worker:0 .*step=", fault, r"h4: moving worker:0 to h5, every "
                              r"task restarting from the checkpoint \(the chief is gone", timeout=300)
    assert rc == 0, rest[-4000:]
    assert re.search(r"worker:0 +│ restored \S+ at step=\d+", rest), rest[-4000:]
    doc = manifest(only_run(cwd / "runs"))
    (move,) = doc["moves"]
    assert move["action"] == "restart" and move["to"] == "h5" and move["checkpoint"], move
    assert move["resumed_step"] is not None and 0 < move["resumed_step"] <= move["step_at"], move
    assert doc["tasks"]["worker:0"]["host"] == "h5"
    assert doc["progress"]["worker:0"]["step"] >= 1400
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", ["coordinator", "mirrored"])
def test_a_lost_worker_restarts_the_strategys_cluster_on_the_spare_from_the_checkpoint(
        tmp_path, home, ssh_home, sshd, sshd_factory, mode):
    """ParameterServerStrategy's coordinator and MultiWorkerMirroredStrategy fix their cluster
    at their start: a worker's new address means every task starts again, from the checkpoint."""
    lost = lone(sshd_factory, ssh_home, LOST_ADDRESS)
    spare = lone(sshd_factory, ssh_home, SPARE_ADDRESS)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = free_ports(4)
    if mode == "coordinator":
        jobs = (f"  chief: {{tasks: ['h2:{p[0]}']}}\n  ps: {{tasks: ['h3:{p[1]}']}}\n"
                f"  worker: {{tasks: ['h3:{p[2]}', 'h4:{p[3]}']}}\n")
        watched, steps = "chief:0", 4000     # the coordinator outlives a lost worker: long enough to see it
    else:
        jobs = f"  worker: {{tasks: ['h3:{p[0]}', 'h4:{p[1]}']}}\n"
        watched, steps = "worker:0", 500
    spec = chief_spec(tmp_path, sshd, lost, spare, f"r{mode[:5]}", mode=mode, script=mode, steps=steps,
                      jobs=jobs)
    def fault() -> None:
        wait_for(lambda: any(pulled(cwd)), timeout=120, what="a checkpoint past step 0 pulled to the launcher")
        kill_host(lost)

    rc, rest = killed_mid_run(spec, home, cwd, rf"{watched} .*step=", fault,
                              r"h4: moving worker:1 to h5, every task restarting from the checkpoint \(", timeout=300)
    assert rc == 0, rest[-4000:]
    assert re.search(rf"{watched} +│ restored \S+ at step=[1-9]\d*", rest), rest[-4000:]
    doc = manifest(only_run(cwd / "runs"))
    (move,) = doc["moves"]
    assert move["action"] == "restart" and move["to"] == "h5", move
    # resumed from a checkpoint, not from scratch (the coordinator's saves may run ahead of its prints)
    assert move["resumed_step"] is not None and move["resumed_step"] > 0, move
    assert doc["tasks"]["worker:1"]["host"] == "h5"
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(420)
def test_drain_moves_the_chief_at_its_checkpoint_losing_no_step(tmp_path, home, ssh_home, sshd, sshd_factory):
    """`tfcluster drain SPEC h4` from another terminal: the chief saves as it stops (SIGTERM),
    every task starts again on the spare from that checkpoint, and `drain` says so."""
    lost = lone(sshd_factory, ssh_home, LOST_ADDRESS)
    spare = lone(sshd_factory, ssh_home, SPARE_ADDRESS)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = free_ports(3)
    spec = chief_spec(tmp_path, sshd, lost, spare, "rdrain", mode="between-graph", script="between_graph",
                      steps=1500, jobs=f"  ps: {{tasks: ['h2:{p[0]}']}}\n"
                                       f"  worker: {{tasks: ['h4:{p[1]}', 'h3:{p[2]}']}}\n")

    def fault() -> None:
        drain = tfcluster("drain", str(spec), "h4", "--wait", "120", home=home, cwd=cwd)
        assert drain.returncode == 0, drain.stdout + drain.stderr
        assert re.search(r"h4: moved: .* h4 drained: worker:0 moved to h5, every task restarted",
                         drain.stdout + drain.stderr), drain.stdout + drain.stderr

    rc, rest = killed_mid_run(spec, home, cwd, r"worker:0 .*step=[1-9]\d\d", fault, None, timeout=300)
    assert rc == 0, rest[-4000:]
    doc = manifest(only_run(cwd / "runs"))
    (move,) = doc["moves"]
    assert move["why"] == "drained" and move["action"] == "restart" and move["to"] == "h5", move
    assert move["steps_lost"] == 0, move
    assert doc["tasks"]["worker:0"]["host"] == "h5" and doc["progress"]["worker:0"]["step"] >= 1400
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


def test_drain_refuses_a_host_the_spec_lacks_and_a_cluster_not_training(tmp_path, home):
    spec = tmp_path / "d.yaml"
    spec.write_text(f"name: dnone\npython: {sys.executable}\nhosts:\n  - {{name: a, address: localhost}}\n"
                    "jobs:\n  worker: {count: 1, hosts: [a], port: 23999}\ntrain:\n  mode: mirrored\n"
                    "  script: template:mirrored\n")
    bad = tfcluster("drain", str(spec), "zz", home=home, cwd=tmp_path)
    assert bad.returncode == 2 and "no host named 'zz' (hosts: a)" in bad.stderr, bad.stderr
    idle = tfcluster("drain", str(spec), "a", home=home, cwd=tmp_path)
    assert idle.returncode == 1 and "no `tfcluster train` of cluster 'dnone' is running" in idle.stderr, idle.stderr


@pytest.mark.timeout(300)
def test_train_with_a_host_down_from_the_start_runs_its_tasks_on_the_spare(
        tmp_path, home, ssh_home, sshd, sshd_factory):
    lost = lone(sshd_factory, ssh_home, LOST_ADDRESS)
    spare = lone(sshd_factory, ssh_home, SPARE_ADDRESS)
    kill_host(lost)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = spec_with_spare(tmp_path, sshd, lost, spare, "rdown", steps=300)
    result = tfcluster("train", str(spec), home=home, cwd=cwd, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "h4 is down (connection refused): worker:1 start on spare h5 instead" in out, out[-4000:]
    doc = manifest(only_run(cwd / "runs"))
    assert doc["tasks"]["worker:1"]["host"] == "h5" and doc["tasks"]["worker:1"]["script"]["exit_code"] == 0
    assert doc["plan"]["moves"] == [{"lost": "h4", "to": "h5"}]
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")
