"""A lost host's tasks moved to a spare, or the run shrunk, produced for real on the bed of
separate hosts (tests/netns.py): each host a namespace of its own, killed (every process on it,
its address then answering nothing) or silenced (its packets dropped), real TensorFlow in every
mode. On loopback hosts a dead host's address still reached the spare's new server, so a move
could pass there and fail between machines; here it cannot."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (
    kill_group,
    manifest,
    only_run,
    read_until,
    start_tfcluster,
    tagged_processes,
    tfcluster,
    wait_for,
)
from tests.notice_bed import FAKE_PORT, control, finish, kill_at, start_fake

pytestmark = [pytest.mark.ssh, pytest.mark.tf]

P = (25000, 25001, 25002, 25003)    # each bed host has its own ports: no clash with any other test


def bed_spec(tmp: Path, bed, name: str, jobs: str, *, mode: str = "between-graph",
             script: str = "between_graph", steps: int = 3000, spares: tuple[str, ...] = ("h5",),
             checkpoint: bool = True, on_host_loss: str | None = None, pace: float = 0.1,
             extra: dict[str, dict] | None = None, spare: str = "true") -> Path:
    """Bed hosts h2, h3, h4 and the spares (h5); `jobs` is the YAML of the jobs. With
    `checkpoint`, every task's script checkpoints to {workdir}/ckpt, which train.checkpoint
    copies back every 2 s. The between-graph and classic templates step at most every `pace`
    seconds a worker, the coordinator schedules a step at most that often: a run's length in
    seconds is then the machine's speed's no longer, and the CPU goes to the move, not to steps
    a fast box would have run past the fault. Ten steps a second a worker is pace enough: each
    global step costs about 30 ms of CPU over the scripts and the servers on 2 slow cores, and
    at twice the rate (and twice the steps, for the same timeline) the steps took a quarter of
    a move test's CPU. `extra`: more fields of a host's entry, by name;
    `spare`: the spares' kind (`warm`: each holds standbys)."""
    hosts = [bed.add(n) for n in ("h2", "h3", "h4")]
    listed = "".join(f"  - {h.spec(**(extra or {}).get(h.name, {}))}\n" for h in hosts)
    listed += "".join(f"  - {bed.add(n).spec(spare=spare)}\n" for n in spares)
    args = ["--steps", str(steps), "--log_every", "50"]
    if checkpoint:
        args += ["--model_dir", "{workdir}/ckpt"]
    if script == "between_graph":
        args += ["--cleanup_timeout", "3"]
    if script in ("between_graph", "classic", "coordinator", "mirrored") and pace:
        args += ["--min_step_time", str(pace)]
    text = (f"name: {name}\npython: {sys.executable}\nworkdir: {tmp / 'remote'}\n"
            f"ssh: {{connect_timeout: 5}}\nhosts:\n{listed}jobs:\n{jobs}"
            f"train:\n  mode: {mode}\n  script: template:{script}\n"
            f"  args: [{', '.join(repr(a) for a in args)}]\n"
            + ("  checkpoint: {dir: '{workdir}/ckpt', keep: 2, sync: 2s}\n" if checkpoint else "")
            + (f"  on_host_loss: {on_host_loss}\n" if on_host_loss else ""))
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


PS_AND_TWO_WORKERS = f"  ps: {{tasks: ['h2:{P[0]}']}}\n  worker: {{tasks: ['h3:{P[1]}', 'h4:{P[2]}']}}\n"
CHIEF_ON_H4 = f"  ps: {{tasks: ['h2:{P[0]}']}}\n  worker: {{tasks: ['h4:{P[1]}', 'h3:{P[2]}']}}\n"


def killed_mid_run(spec: Path, home, cwd: Path, started: str, kill, said: str | None,
                   timeout: float = 240) -> tuple[int, str]:
    """`train` until a line matching `started`, then `kill()` (the fault), then (when `said`)
    until a line matching it: (its exit code, what it printed after that)."""
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, started, timeout=200)
        kill()
        if said is not None:
            read_until(proc, said, timeout=90)
        rest = proc.communicate(timeout=timeout)[0]
    finally:
        kill_group(proc)
    return proc.returncode, rest


@pytest.mark.timeout(480)
@pytest.mark.parametrize("fault,mode", [("kill", "between-graph"), ("silence", "between-graph"), ("kill", "classic")])
def test_a_lost_workers_host_restarts_every_task_and_the_moved_worker_trains_on_the_spare(
        tmp_path, home, ssh_home, bed, fault, mode):
    """Its ps dials worker:1 at the address it started with: a worker moved alone would never
    step. Every task restarts on the new cluster, from the checkpoint, and worker:1 steps on h5."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    script = mode.replace("-", "_")
    # worker:0 steps on alone until the loss is seen (a silent host: 20 s), at 10 steps a second
    spec = bed_spec(tmp_path, bed, f"rmove{fault[0]}{mode[0]}", PS_AND_TWO_WORKERS, mode=mode,
                    steps=500 if fault == "silence" else 300,
                    script=script)
    rc, rest = killed_mid_run(spec, home, cwd, r"worker:1 .*step=[1-9]", lambda: getattr(bed, fault)("h4"),
                              r"h4: moving worker:1 to h5, every task restarting from the checkpoint \(a ps "
                              r"dials each worker at the address it started with\)", timeout=300)
    assert rc == 0, rest[-4000:]
    doc = manifest(only_run(cwd / "runs"))
    (move,) = doc["moves"]
    assert move["host"] == "h4" and move["to"] == "h5" and move["action"] == "restart", move
    assert move["resumed_step"] is not None, (move, rest[-4000:])
    assert doc["tasks"]["worker:1"]["host"] == "h5"
    assert doc["tasks"]["worker:1"]["script"]["restarts"] == 0      # a move is not a restart
    # the moved worker itself trained on the spare: a step past any the run had said before
    assert doc["progress"]["worker:1"]["step"] > move["step_at"], (doc["progress"], move)
    assert re.search(r"worker:0 on h3 resumed at step \d+", rest), rest[-3000:]
    listed = tfcluster("runs", str(spec), home=home, cwd=cwd)
    assert re.search(rf"^rmove{fault[0]}{mode[0]}-\S+: \d\d:\d\d:\d\d h4 lost: worker:1 moved to h5, every task restarted"
                     r"(?: from \S+)?; resumed at step \d+, \d+ step\(s\) lost$", listed.stdout, re.MULTILINE), listed.stdout
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(480)
def test_two_hosts_lost_at_once_then_the_spare_that_took_the_ps_each_restart_the_run_on_spares(
        tmp_path, home, ssh_home, bed):
    """The ps's host and a worker's die together, with three spares: the first loss's restart
    takes the second along, each to a spare of its own (a restart that started worker:1 on its
    dead host failed, exit 3); then the spare that took ps:0 dies too, and ps:0 restarts on the
    third. The run reaches its target from the checkpoints."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = bed_spec(tmp_path, bed, "rtwice", PS_AND_TWO_WORKERS, steps=500, spares=("h5", "h6", "h7"))
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:1 .*step=[1-9]", timeout=200)
        bed.kill("h2")
        bed.kill("h4")
        seen = read_until(proc, r"h[24]: moving \S+ to h[56] in the same restart as h[24]'s", timeout=120)
        seen += read_until(proc, r"worker:0 on h3 resumed at step \d+", timeout=150)
        ps_on = "h5" if any("moving ps:0 to h5" in line for line in seen) else "h6"
        bed.kill(ps_on)
        seen += read_until(proc, rf"{ps_on}: moving ps:0 to h7, every task restarting", timeout=90)
        rest = proc.communicate(timeout=300)[0]
    finally:
        kill_group(proc)
    out = "".join(seen) + rest
    assert proc.returncode == 0, out[-4000:]
    doc = manifest(only_run(cwd / "runs"))
    first, along, second = sorted(doc["moves"][:2], key=lambda m: m["host"]) + doc["moves"][2:]
    assert (first["host"], along["host"], {first["to"], along["to"]}) == ("h2", "h4", {"h5", "h6"}), doc["moves"]
    assert (second["host"], second["to"]) == (ps_on, "h7"), doc["moves"]
    assert all(m["resumed_step"] is not None and m["action"] == "restart" for m in doc["moves"]), doc["moves"]
    assert doc["tasks"]["ps:0"]["host"] == "h7" and set(doc["hosts_lost"]) == {"h2", "h4", ps_on}
    assert doc["progress"]["worker:0"]["step"] >= 450
    assert out.count("every task restarting") == 2, out[-4000:]       # one restart per loss event
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(420)
def test_shrink_goes_on_without_a_lost_worker(tmp_path, home, ssh_home, bed):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = bed_spec(tmp_path, bed, "rshrink", PS_AND_TWO_WORKERS, steps=200, spares=(), checkpoint=False,
                    on_host_loss="shrink")
    rc, rest = killed_mid_run(spec, home, cwd, r"worker:1 .*step=", lambda: bed.kill("h4"),
                              r"h4: going on without worker:1", timeout=240)
    assert rc == 0, rest[-4000:]
    assert re.search(r"^worker:1 +h4 +lost ", rest, re.MULTILINE), rest[-3000:]
    doc = manifest(only_run(cwd / "runs"))
    (move,) = doc["moves"]
    assert move["action"] == "shrink" and move["to"] is None
    assert doc["progress"]["worker:0"]["step"] >= 150
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(300)
def test_no_spare_left_fails_as_before_naming_the_host(tmp_path, home, ssh_home, bed):
    """on_host_loss: spare, but the one spare dies first: that is said at once (it held no task
    whose channel would say it: the run found out only at the next loss), and when h4 goes the
    run ends, exit 3, as without a spare. The chief saved as it stopped: that save, newer than
    the sync's last copy, is the one the launcher keeps."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = bed_spec(tmp_path, bed, "rnone", PS_AND_TWO_WORKERS, steps=5000000)
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:1 .*step=", timeout=200)
        bed.kill("h5")
        seen = read_until(proc, r"spare h5 lost: .*; the run goes on without it", timeout=30)
        bed.kill("h4")
        rest = proc.communicate(timeout=120)[0]
    finally:
        kill_group(proc)
    out = "".join(seen) + rest
    assert proc.returncode == 3, out[-3000:]
    assert "h4: cannot recover: no spare host (or none left) can take its workers" in out, out[-3000:]
    assert re.search(r"tfcluster: error: h4 lost: .* \(worker:1\)", out), out[-3000:]
    assert "spare h5 not usable" not in out, out[-3000:]        # said once, when it went
    wait_for(lambda: not tagged_processes(), timeout=90, what="no task left running")
    saved = re.search(r'^model_checkpoint_path: "[^"]*-(\d+)"', (tmp_path / "remote" / "rnone" / "ckpt" / "checkpoint").read_text(), re.M)
    assert saved and pulled(cwd) and pulled(cwd)[-1] == int(saved[1]), (pulled(cwd), saved, out[-3000:])
    assert re.search(rf"checkpoint kept here: model\.ckpt-{saved[1]} \([0-9.]+ kB, runs/rnone-[-0-9a-f]+/checkpoints/"
                     rf"model\.ckpt-{saved[1]}/\)", out), out[-3000:]


def pulled(cwd: Path) -> list[int]:
    """The steps of the checkpoints the launcher holds (`model.ckpt-300`, `ckpt-3`)."""
    names = (p.name.rpartition("-")[2] for p in (cwd / "runs").glob("*/checkpoints/*"))
    return sorted(int(n) for n in names if n.isdigit())


@pytest.mark.timeout(420)
def test_a_lost_chief_restarts_every_task_on_the_spare_from_the_launchers_copy(
        tmp_path, home, ssh_home, bed):
    """No shared filesystem: the chief's checkpoints die with its box (the test deletes them
    with the host), and the run resumes from the copy the launcher pulled."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = bed_spec(tmp_path, bed, "rchief", CHIEF_ON_H4, steps=400)

    def fault() -> None:
        wait_for(lambda: any(pulled(cwd)), timeout=120, what="a checkpoint past step 0 pulled to the launcher")
        bed.kill("h4")
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
    assert doc["progress"]["worker:0"]["step"] >= 350
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", ["coordinator", "mirrored"])
def test_a_lost_worker_restarts_the_strategys_cluster_on_the_spare_from_the_checkpoint(
        tmp_path, home, ssh_home, bed, mode):
    """ParameterServerStrategy's coordinator and MultiWorkerMirroredStrategy fix their cluster
    at their start: a worker's new address means every task starts again, from the checkpoint."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = P
    if mode == "coordinator":
        jobs = (f"  chief: {{tasks: ['h2:{p[0]}']}}\n  ps: {{tasks: ['h3:{p[1]}']}}\n"
                f"  worker: {{tasks: ['h3:{p[2]}', 'h4:{p[3]}']}}\n")
        # the coordinator outlives a lost worker: 30 s of steps at 25 a second, long enough to see it
        watched, steps, pace = "chief:0", 750, 0.04
    else:
        jobs = f"  worker: {{tasks: ['h3:{p[0]}', 'h4:{p[1]}']}}\n"
        watched, steps, pace = "worker:0", 500, 0.0
    spec = bed_spec(tmp_path, bed, f"r{mode[:5]}", jobs, mode=mode, script=mode, steps=steps, pace=pace)
    def fault() -> None:
        wait_for(lambda: any(pulled(cwd)), timeout=120, what="a checkpoint past step 0 pulled to the launcher")
        bed.kill("h4")

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


# the chief's host drained, per mode: (jobs, the chief, steps, pace). The coordinator's steps are
# scheduled at 25 a second, mirrored steps at the machine's pace
DRAINED = {
    "between-graph": (CHIEF_ON_H4, "worker:0", 400, 0.1),
    "classic": (CHIEF_ON_H4, "worker:0", 400, 0.1),
    "coordinator": (f"  chief: {{tasks: ['h4:{P[0]}']}}\n  ps: {{tasks: ['h2:{P[1]}']}}\n"
                    f"  worker: {{tasks: ['h3:{P[2]}', 'h2:{P[3]}']}}\n", "chief:0", 400, 0.04),
    "mirrored": (f"  worker: {{tasks: ['h4:{P[0]}', 'h3:{P[1]}']}}\n", "worker:0", 600, 0.0),
}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", list(DRAINED))
def test_drain_moves_the_chief_at_its_checkpoint_losing_no_step(tmp_path, home, ssh_home, bed, mode):
    """`tfcluster drain SPEC h4` from another terminal, in every mode: the chief saves as it
    stops (SIGTERM; under MultiWorkerMirroredStrategy every worker saves together), every
    task starts again on the spare from that checkpoint, and `drain` says so. A notice with
    time enough to move is this same drain (test_notices)."""
    jobs, chief, steps, pace = DRAINED[mode]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = bed_spec(tmp_path, bed, f"rd{mode[:5]}", jobs, mode=mode, script=mode.replace("-", "_"),
                    steps=steps, pace=pace)

    def fault() -> None:
        drain = tfcluster("drain", str(spec), "h4", "--wait", "120", home=home, cwd=cwd)
        assert drain.returncode == 0, drain.stdout + drain.stderr
        assert re.search(rf"h4: moved: .* h4 drained: {chief} moved to h5, every task restarted",
                         drain.stdout + drain.stderr), drain.stdout + drain.stderr
        if mode != "between-graph":
            return
        # while the run goes on, status and drain plan with its move: the chief is on h5, and
        # h5, a spare holding it now, is drained as any host (no spare left: the run says so)
        shown = tfcluster("status", str(spec), "--json", home=home, cwd=cwd)
        rows = {r["task"]: r for r in json.loads(shown.stdout)["tasks"]}
        assert (rows[chief]["host"], rows[chief]["status"]) == ("h5", "running"), shown.stdout + shown.stderr
        assert f"{chief} runs on spare h5 (moved there by the running train: h4 was lost or drained)" in shown.stderr
        again = tfcluster("drain", str(spec), "h5", "--wait", "60", home=home, cwd=cwd)
        assert again.returncode == 1 and "h5: failed:" in again.stdout + again.stderr, again.stdout + again.stderr

    rc, rest = killed_mid_run(spec, home, cwd, rf"{chief} .*step=[1-9]\d\d", fault, None, timeout=300)
    assert rc == 0, rest[-4000:]
    doc = manifest(only_run(cwd / "runs"))
    (move,) = doc["moves"]
    assert move["why"] == "drained" and move["action"] == "restart" and move["to"] == "h5", move
    assert move["resumed_step"] is not None and move["steps_lost"] == 0, move
    assert doc["tasks"][chief]["host"] == "h5" and doc["progress"][chief]["step"] >= steps - 100
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")
    for host in bed.hosts.values():     # the drained host and the spare kept no table either
        wait_for(lambda h=host: "tfcluster_" not in h.run(["nft", "list", "tables"]).stdout, timeout=20,
                 what=f"no table of the cluster left on {host.name}")


# The chief's host warned 30 s ahead by its cloud, in the modes test_notices does not train, a
# cloud each: (the cloud, how its fake is told, what the run names the notice, steps, pace, the
# spare's kind). Each run steps on past the deadline, so the kill comes while it trains on the
# spare. The coordinator's spare is warm: the notice's move takes the chief's standby there and
# the servers' twins held by then, as a lost host's move does (test_warm_bed).
WARNED = {
    "classic": ("gce", ("gce/set", {"key": "preempted", "value": "TRUE"}), "gce preempted", 750, 0.1, "true"),
    "coordinator": ("azure", ("azure/event", {"id": "EV-7", "type": "Preempt", "in": 30}), "azure Preempt",
                    850, 0.04, "warm"),
    "mirrored": ("aws", ("aws/action", {"action": "terminate", "in": 30}), "aws terminate", 400, 0.1, "true"),
}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", list(WARNED))
def test_a_notice_30s_ahead_moves_the_chief_before_the_kill_losing_no_step(tmp_path, home, ssh_home, bed, mode):
    """A notice is the drain's trigger (test_notices trains between-graph): here the chief's
    host is warned by a fake of its cloud's metadata service inside its own namespace, and
    killed at the deadline. Every task starts again on the spare, before the deadline, from
    the checkpoint the scripts saved as they stopped; the run outlives the host, no step lost."""
    jobs, chief, _, _ = DRAINED[mode]
    cloud, (what, body), named, steps, pace, spare = WARNED[mode]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    watched = {"preemptible": cloud, "metadata_url": f"'http://127.0.0.1:{FAKE_PORT}'"}
    spec = bed_spec(tmp_path, bed, f"rn{mode[:5]}", jobs, mode=mode, script=mode, steps=steps, pace=pace,
                    extra={"h4": watched}, spare=spare)
    start_fake(bed.hosts["h4"])
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        seen = "".join(read_until(proc, rf"{chief} .*step=[1-9]\d\d", timeout=200))
        assert f"h4: watched ({cloud} spot)" in seen, seen[-3000:]
        control(bed.hosts["h4"], what, **body)
        deadline = time.time() + 30
        said = "".join(read_until(proc, rf"{chief} on h5 resumed at step \d+", 120))
        assert time.time() < deadline, "the chief stepped again after the deadline"
        kill_at(bed, {"h4": deadline})
        assert proc.poll() is None, "the run ended before its host's deadline: its end shows nothing"
        rest = finish(proc)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, rest[-4000:]
    assert re.search(rf"h4: {named} notice: taken back at \S+ \(\d+s from now\)", seen + said), said[-3000:]
    assert re.search(rf"^notice: \d\d:\d\d:\d\d h4 {named}, deadline \S+ \(\d+s ahead\): moved: {chief} moved "
                     rf"to h5, every task restarted; 0 step\(s\) lost$", rest, re.MULTILINE), rest[-3000:]
    doc = manifest(only_run(cwd / "runs"))
    (notice,) = doc["notices"]
    assert (notice["host"], notice["source"], notice["action"]) == ("h4", cloud, "moved"), notice
    assert notice["steps_lost"] == 0 and notice["move"] == {"to": "h5", "action": "restart"}, notice
    (move,) = doc["moves"]
    assert move["done_at"] < deadline and move["steps_lost"] == 0, move
    assert doc["tasks"][chief]["host"] == "h5" and doc["progress"][chief]["step"] >= steps - 100
    if spare == "warm":     # the summary's lines: the chief's standby and every server held took
        assert re.search(rf"^standby: warm standby on h5 took {chief} \(pid \d+", rest, re.MULTILINE), rest[-3000:]
        assert re.search(r"^standby: held before the break: server\(s\) ps:0, worker:0, worker:1 ", rest,
                         re.MULTILINE), rest[-3000:]
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


def test_drain_refuses_a_host_the_spec_lacks_and_a_cluster_not_training(tmp_path, home):
    spec = tmp_path / "d.yaml"
    spec.write_text(f"name: dnone\npython: {sys.executable}\nhosts:\n  - {{name: a, address: localhost}}\n"
                    "jobs:\n  worker: {count: 1, hosts: [a], port: 23999}\ntrain:\n  mode: mirrored\n"
                    "  script: template:mirrored\n")
    bad = tfcluster("drain", str(spec), "zz", home=home, cwd=tmp_path)
    assert bad.returncode == 2 and "no host named 'zz' (hosts: a)" in bad.stderr, bad.stderr
    close = tfcluster("drain", str(spec), "aa", home=home, cwd=tmp_path)
    assert close.returncode == 2 and "no host named 'aa' (hosts: a); did you mean 'a'?" in close.stderr, close.stderr
    idle = tfcluster("drain", str(spec), "a", home=home, cwd=tmp_path)
    assert idle.returncode == 1 and "no `tfcluster train` of cluster 'dnone' is running" in idle.stderr, idle.stderr


@pytest.mark.timeout(300)
def test_train_with_a_host_down_from_the_start_runs_its_tasks_on_the_spare(
        tmp_path, home, ssh_home, bed):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = bed_spec(tmp_path, bed, "rdown", PS_AND_TWO_WORKERS, steps=300, checkpoint=False, pace=0)
    bed.kill("h4")
    result = tfcluster("train", str(spec), home=home, cwd=cwd, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert re.search(r"h4 is down \(.+\): worker:1 start on spare h5 instead", out), out[-4000:]
    doc = manifest(only_run(cwd / "runs"))
    assert doc["tasks"]["worker:1"]["host"] == "h5" and doc["tasks"]["worker:1"]["script"]["exit_code"] == 0
    assert doc["plan"]["moves"] == [{"lost": "h4", "to": "h5"}]
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(300)
def test_ctrl_c_while_a_drain_restarts_every_task_leaves_nothing_on_any_host(tmp_path, home, ssh_home, bed):
    """Ctrl-C lands while the drained host's move restarts every task: exit 130 within the
    stop's grace (5 s) + 5 s, no traceback, and nothing of the cluster left on any host, its
    processes and its nftables tables alike."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = bed_spec(tmp_path, bed, "rintr", PS_AND_TWO_WORKERS, steps=5000000)
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    drain = None
    try:
        read_until(proc, r"worker:1 .*step=[1-9]", timeout=200)
        drain = start_tfcluster("drain", str(spec), "h4", "--wait", "60", home=home, cwd=cwd)
        before = read_until(proc, r"h4 drained: moving worker:1 to h5", timeout=60)
        os.killpg(proc.pid, signal.SIGINT)
        began = time.monotonic()
        rest = proc.communicate(timeout=60)[0]
        took = time.monotonic() - began
    finally:
        kill_group(proc)
        if drain is not None:
            kill_group(drain)
    out = "".join(before) + rest
    assert proc.returncode == 130, out[-3000:]
    assert took <= 15, took        # grace 5 s + 5 s, and a loaded machine's slack
    assert "Traceback" not in out and "Exception in thread" not in out, out[-3000:]
    # worker:1's row names the host it last ran on: h4 when the stop came before it started on h5
    unstarted = "moving worker:1 to h5; the run ended before they started there" in out
    assert re.search(rf"^\s*worker:1\s+{'h4' if unstarted else 'h5'}\s", out, re.M), out[-3000:]
    wait_for(lambda: not tagged_processes(), timeout=20, what="no task left on any host")
    for host in bed.hosts.values():
        wait_for(lambda h=host: "tfcluster_" not in h.run(["nft", "list", "tables"]).stdout, timeout=20,
                 what=f"no table of the cluster left on {host.name}")
