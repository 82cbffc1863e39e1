"""Warm spares on the bed of separate hosts (tests/netns.py), real TensorFlow: a worker's host
killed with a warm spare moves onto the standby the spare held, fenced before it ever listened;
a standby killed for real falls back to a cold start, with the line saying so."""
from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from tests.helpers import kill_group, manifest, only_run, read_until, start_tfcluster, tagged_processes, wait_for
from tests.netns import TableWatch, refused_everywhere
from tfcluster.host import shim_procs

# -- on the bed ------------------------------------------------------------------------------

P = (25100, 25101, 25102)


def _warm_spec(tmp: Path, bed, name: str, extra: str = "") -> Path:
    hosts = [bed.add(n) for n in ("h2", "h3", "h4")]
    text = (f"name: {name}\npython: {sys.executable}\nworkdir: {tmp / 'remote'}\nssh: {{connect_timeout: 5}}\n"
            "hosts:\n" + "".join(f"  - {h.spec()}\n" for h in hosts) + f"  - {bed.add('h5').spec(spare='warm')}\n"
            f"jobs:\n  ps: {{tasks: ['h2:{P[0]}']}}\n  worker: {{tasks: ['h3:{P[1]}', 'h4:{P[2]}']}}\n"
            "train:\n  mode: between-graph\n  script: template:between_graph\n"
            # at most 10 steps a second a worker: the run outlasts the move on any machine, and no
            # CPU goes to the steps a fast box would run before the kill
            "  args: ['--steps', '400', '--log_every', '50', '--model_dir', '{workdir}/ckpt', '--cleanup_timeout', '3',\n"
            "         '--min_step_time', '0.1']\n"
            "  checkpoint: {dir: '{workdir}/ckpt', keep: 2, sync: 2s}\n" + extra)
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


def _standby_pid(tmp: Path, name: str, n: int = 1) -> int | None:
    """The pid of standby `n` once it is ready to take a task (its pid file, its log's last
    line), as its host numbers it: the pid the run's line names. The first is h5's, the warm
    spare's (the hosts running scripts get theirs, a restart's, once the run has stepped)."""
    if n not in _ready(tmp, name):
        return None
    for path in (tmp / "remote" / name / "pids").glob(f"*_standby_{n}_script.pid"):
        try:
            return int(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None
    return None


def _ready(tmp: Path, name: str) -> set[int]:
    """The numbers of the run's standbys that have said they are ready."""
    return {int(p.stem.rpartition("-")[2]) for p in (tmp / "remote" / name / "runs").glob("*/standby-*.log")
            if "standby ready" in p.read_text(errors="replace")}


def _here(host, pid: int) -> int:
    """The pid seen from this machine of the process `host` (a PID namespace of its own)
    numbers `pid`: the last field of its NSpid line."""
    for mine in host.pids():
        try:
            with open(f"/proc/{mine}/status") as f:
                ns = next(line.split()[1:] for line in f if line.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        if int(ns[-1]) == pid:
            return mine
    raise AssertionError(f"no process {pid} on {host.name}")


@pytest.mark.ssh
@pytest.mark.tf
@pytest.mark.timeout(480)
def test_a_lost_workers_host_moves_onto_the_warm_spares_standby_fenced_before_it_listened(
        tmp_path, home, ssh_home, bed, other_user):

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = _warm_spec(tmp_path, bed, "wwarm")
    h5 = bed.hosts["h5"]
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:1 .*step=[1-9]", timeout=200)
        standby = wait_for(lambda: _standby_pid(tmp_path, "wwarm"), timeout=120, what="h5's standby")
        # the spare's table was there before the standby: nothing of it ever listened unfenced
        assert "tfcluster_" in h5.run(["nft", "list", "tables"]).stdout
        assert shim_procs.tag_of(_here(h5, standby)).split(":")[2:4] == ["standby", "1"]
        # once the run stepped, worker:0 and worker:1 each got a standby of their own on their
        # host, for the restart a move makes of every task
        wait_for(lambda: _ready(tmp_path, "wwarm") == {1, 2, 3}, timeout=120, what="the restart's standbys")
        restart_pids = {_standby_pid(tmp_path, "wwarm", n) for n in (2, 3)}
        # and every server a held twin (TensorFlow imported, unbound), its cluster to come with
        # the move's GO: a move then starts no server but on the spare
        wait_for(lambda: all(sum(t.endswith(f":{k}:server") for t in tagged_processes().values()) == 2
                             for k in ("ps:0", "worker:0", "worker:1")), timeout=120, what="a held twin of each server")
        addr = {h.name: h.address for h in bed.hosts.values()}
        h2 = bed.hosts["h2"]
        old, new = f"{addr['h4']} . {P[2]}", f"{addr['h5']} . {P[2]}"     # worker:1's target, before and after
        watch = TableWatch([h2, bed.hosts["h3"]], "tfcluster_wwarm_")
        bed.kill("h4")
        # while the grace decides, each other host's table closes both clusters' ports: the
        # move binds under it, with no remote execution between the stop and its servers' GO
        wait_for(lambda: (lambda t: old in t and new in t)(h2.run(["nft", "list", "ruleset"]).stdout),
                 timeout=60, what="h2's table closing worker:1's old and new address")
        # either way the take says how it went: a cold start's line is the failure's reason
        said = "".join(read_until(proc, r"warm standby on h5 took worker:1 \(pid \d+|worker:1 on h5: cold start",
                                  timeout=150))
        assert f"warm standby on h5 took worker:1 (pid {standby}," in said, said[-2000:]
        # make before break from the drop, not from the verdict: the survivors' standbys and the
        # new cluster's servers start while the grace runs, and every server is taken held
        prepared = said.index("h4: its connection dropped; its move to h5 is being prepared")
        assert prepared < said.index("h4 lost:"), said[-3000:]
        assert "held before the break: server(s) ps:0, worker:0, worker:1 (" in said, said[-3000:]
        trained = "".join(read_until(proc, r"worker:1 .*step=", timeout=120))   # the standby trains as worker:1
        if not re.search(r"resumed at step \d+", trained):
            read_until(proc, r"resumed at step \d+", timeout=60)
        # once the moved tasks train, the tables are this cluster's alone
        wait_for(lambda: (lambda t: old not in t and new in t)(h2.run(["nft", "list", "ruleset"]).stdout),
                 timeout=60, what="h2's table naming worker:1's new address alone")
        gaps = watch.stop()
        refused_everywhere(bed, [[addr["h2"], P[0]], [addr["h3"], P[1]], [addr["h5"], P[2]]], other_user)
        rest = proc.communicate(timeout=300)[0]
    finally:
        kill_group(proc)
    assert proc.returncode == 0, rest[-4000:]
    assert watch.samples >= 20 and not gaps, (watch.samples, gaps)      # the fence never opened in the move
    assert re.search(r"standby: warm standby on h5 took worker:1 \(pid \d+, TensorFlow imported in", rest), rest[-3000:]
    # the survivor restarted on the standby it held since the run stepped, not one the move made
    took = re.search(r"standby: warm standby on h3 took worker:0 \(pid (\d+), TensorFlow imported in", rest)
    assert took and int(took.group(1)) in restart_pids, (restart_pids, rest[-3000:])
    doc = manifest(only_run(cwd / "runs"))
    assert doc["tasks"]["worker:1"]["host"] == "h5" and doc["moves"][0]["resumed_step"] is not None
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.ssh
@pytest.mark.tf
@pytest.mark.timeout(480)
def test_a_warm_spare_whose_standby_died_starts_the_moved_task_cold_and_says_why(tmp_path, home, ssh_home, bed):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = _warm_spec(tmp_path, bed, "wdead")
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:1 .*step=[1-9]", timeout=200)
        standby = wait_for(lambda: _standby_pid(tmp_path, "wdead"), timeout=120, what="h5's standby")
        here = _here(bed.hosts["h5"], standby)
        os.kill(here, signal.SIGKILL)
        wait_for(lambda: not shim_procs.is_alive(here), timeout=10, what="the standby gone")
        bed.kill("h4")
        said = "".join(read_until(proc, r"worker:1 on h5: cold start: its standby had exited \(killed by signal 9\)",
                          timeout=150))
        assert "warm standby on h5 took" not in said
        rest = proc.communicate(timeout=300)[0]
    finally:
        kill_group(proc)
    assert proc.returncode == 0, rest[-4000:]
    doc = manifest(only_run(cwd / "runs"))
    assert doc["tasks"]["worker:1"]["host"] == "h5" and doc["moves"][0]["resumed_step"] is not None
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.ssh
@pytest.mark.tf
@pytest.mark.timeout(480)
def test_a_dropped_connection_whose_host_is_back_drops_the_move_prepared_for_it(tmp_path, home, ssh_home, bed):
    """h4's SSH connection dies (the sshd process carrying it killed), h4 itself stays up:
    while the grace decides, the move to the warm spare is prepared (standbys, servers held);
    the connection re-opens, so that is dropped, the running servers keep their pid files, and
    worker:1 restarts in place over the new connection (train.restart)."""
    import psutil

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = _warm_spec(tmp_path, bed, "wback", "  restart: {policy: on-failure, max_restarts: 3}\n")
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:1 .*step=[1-9]", timeout=200)
        wait_for(lambda: _standby_pid(tmp_path, "wback"), timeout=120, what="h5's standby")
        script = next(p for p, tag in tagged_processes().items() if tag.endswith(":worker:1:script"))
        carriers = [p for p in psutil.Process(script).parents()         # sshd, or sshd-session since OpenSSH 9.8
                    if p.name().startswith("sshd") and "-D" not in p.cmdline()]
        assert carriers, [p.cmdline() for p in psutil.Process(script).parents()]
        carriers[-1].kill()                     # its connection's sshd: the TCP session ends
        said = "".join(read_until(proc, r"h4 is back: what was prepared for its move is dropped", timeout=120))
        assert "h4: its connection dropped; its move to h5 is being prepared" in said, said[-3000:]
        assert "h4 lost:" not in said
        pids = tmp_path / "remote" / "wback" / "pids"
        record = json.loads(next(pids.glob("*_ps_0_server.pid")).read_text())
        assert psutil.pid_exists(_here(bed.hosts["h2"], record["pid"])), record   # the live ps keeps its record
        rest = proc.communicate(timeout=300)[0]
    finally:
        kill_group(proc)
    assert proc.returncode == 0, rest[-4000:]
    doc = manifest(only_run(cwd / "runs"))
    assert not doc.get("moves") and doc["tasks"]["worker:1"]["host"] == "h4", doc.get("moves")
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task, standby or held server left running")
