"""The fence across a move, on separate hosts (tests/netns.py): a second Unix user on any host
of a running cluster, the spare included, is refused at every task port of every host, before
a host is lost and after every task restarted on the spare; so is the owner's own process
outside the cluster (another TF server of the same user would otherwise relay a stranger in)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import kill_group, manifest, only_run, read_until, start_tfcluster, tagged_processes, wait_for
from tests.netns import PYTHON, SSH_PORT, TableWatch, refused_everywhere

pytestmark = [pytest.mark.ssh, pytest.mark.tf]


def ps_two_workers_and_a_spare(tmp_path: Path, bed, name: str, train: str) -> Path:
    """The spec `name`: a ps on h2, workers on h3 and h4, the idle spare h5; between-graph,
    `train` the rest of its train section (YAML lines)."""
    hosts = [bed.add(n) for n in ("h2", "h3", "h4")]
    spare = bed.add("h5")
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(
        f"name: {name}\npython: {sys.executable}\nworkdir: {tmp_path / 'remote'}\nssh: {{connect_timeout: 5}}\n"
        f"hosts:\n" + "".join(f"  - {h.spec()}\n" for h in hosts) + f"  - {spare.spec(spare='true')}\n"
        "jobs:\n  ps: {tasks: ['h2:25000']}\n  worker: {tasks: ['h3:25001', 'h4:25002']}\n"
        "train:\n  mode: between-graph\n  script: template:between_graph\n" + train)
    return spec


@pytest.mark.timeout(480)
def test_a_second_user_is_refused_at_every_task_port_before_and_after_a_move(tmp_path, home, ssh_home, bed,
                                                                            other_user):
    if not os.path.exists(PYTHON):
        pytest.fail(f"{PYTHON} is needed to dial as the second user")
    spec = ps_two_workers_and_a_spare(
        tmp_path, bed, "fmove",
        "  args: ['--steps', '5000000', '--log_every', '50', '--model_dir', '{workdir}/ckpt', '--cleanup_timeout', '3',\n"
        "         '--min_step_time', '0.1']\n"    # trains until stopped: at a real model's pace, not the CPU's
        "  checkpoint: {dir: '{workdir}/ckpt', keep: 2, sync: 2s}\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    addr = {h.name: h.address for h in bed.hosts.values()}
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:1 .*step=[1-9]", timeout=200)
        refused_everywhere(bed, [[addr["h2"], 25000], [addr["h3"], 25001], [addr["h4"], 25002]], other_user)
        watch = TableWatch([bed.hosts["h2"], bed.hosts["h3"]], "tfcluster_fmove_")
        bed.kill("h4")
        read_until(proc, r"worker:0 on h3 resumed at step \d+", timeout=150)
        read_until(proc, r"worker:1 .*step=", timeout=60)      # worker:1 trains on h5
        gaps = watch.stop()
        refused_everywhere(bed, [[addr["h2"], 25000], [addr["h3"], 25001], [addr["h5"], 25002]], other_user)
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    finally:
        kill_group(proc)
    assert proc.returncode == 130, rest[-3000:]
    # the hosts that kept their tasks kept their tables through the move: never a moment open
    assert watch.samples >= 20, f"too few looks at the tables ({watch.samples}) to judge the move"
    assert not gaps, f"a host's table was missing during the move: {gaps}"
    assert not re.search(r"TensorFlow's ports .* stay open", rest), rest[-3000:]
    doc = manifest(only_run(cwd / "runs"))
    assert doc["tasks"]["worker:1"]["host"] == "h5"
    wait_for(lambda: not tagged_processes(), timeout=30, what="no task left on any host")
    for host in bed.hosts.values():
        if host.state == "up":
            wait_for(lambda h=host: "tfcluster_" not in h.run(["nft", "list", "tables"]).stdout, timeout=20,
                     what=f"no table of the cluster left on {host.name}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("command,fault,spare", [("train", "port-taken", "true"), ("train", "host-refuses-login", "true"),
                                                 ("train", "port-taken", "warm"), ("up", "port-taken", "true"),
                                                 ("up", "host-refuses-login", "true")])
def test_a_train_or_up_that_ends_before_its_servers_start_leaves_no_table_on_any_host(
        command, fault, spare, tmp_path, home, ssh_home, bed):
    """No shim of the run is left to take the table of the ps's host (it runs no script) or of
    the idle spare when the run or `up` ends early: a worker's port taken on h3 (the checks
    refuse it), or h3 refusing the login after the other hosts' first exec put their tables
    (the hosts' opening fails). Every table must go all the same; on one kernel h3's shim took
    the table of the same name, and hid this."""
    h2, h3, h4 = bed.add("h2"), bed.add("h3"), bed.add("h4")
    h3_entry = h3.spec() if fault == "port-taken" else \
        f"{{name: h3, address: {h3.address}, ssh: {{port: {SSH_PORT}, user: nosuchuser}}}}"
    spec = tmp_path / "fearly.yaml"
    spec.write_text(
        f"name: fearly\npython: {sys.executable}\nworkdir: {tmp_path / 'remote'}\nssh: {{connect_timeout: 5}}\n"
        f"hosts:\n  - {h2.spec()}\n  - {h3_entry}\n  - {h4.spec(spare=spare)}\n"
        "jobs:\n  ps: {tasks: ['h2:25000']}\n  worker: {tasks: ['h3:25001', 'h3:25002']}\n"
        "train:\n  mode: between-graph\n  script: template:between_graph\n")
    listen = ("import socket, sys\ns = socket.socket(); s.bind(('0.0.0.0', 25002)); s.listen(1)\n"
              "print('up', flush=True)\nsys.stdin.read()\n")
    holder = subprocess.Popen(["nsenter", "-t", str(h3.sshd.proc.pid), "-n", "-p", "-m", "--",
                               sys.executable, "-S", "-c", listen], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "up\n"
        cwd = tmp_path / "cwd"
        cwd.mkdir()
        proc = start_tfcluster(command, str(spec), home=home, cwd=cwd)
        try:
            out = proc.communicate(timeout=180)[0]
        finally:
            kill_group(proc)
        assert proc.returncode != 0, out[-3000:]
        assert ("25002" if fault == "port-taken" else "h3") in out.split("tfcluster: error:")[-1], out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        wait_for(lambda: not tagged_processes(), timeout=20, what="no process of the run left on any host")
        for host in (h2, h3, h4):
            wait_for(lambda h=host: "tfcluster_" not in h.run(["nft", "list", "tables"]).stdout, timeout=20,
                     what=f"no table of the cluster left on {host.name}")
    finally:
        holder.kill()
        holder.wait(10)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("command,delay", [("train", 0.05), ("train", 0.2), ("up", 0.05), ("up", 0.2)])
def test_ctrl_c_while_the_hosts_open_leaves_no_table_on_any_host(command, delay, tmp_path, home, ssh_home, bed):
    """Ctrl-C a moment after the run starts connecting: some hosts have answered their opening
    batch, and closed the ports with it (the ps's host, which runs no script; the idle spare),
    while others are still opening. Exit 130, and every table goes with the run: the stop
    takes those of the hosts that answered, though the opening as a whole never finished."""
    spec = ps_two_workers_and_a_spare(tmp_path, bed, "fintr", "  args: ['--steps', '5000000']\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = start_tfcluster(command, str(spec), home=home, cwd=cwd)
    try:
        seen = read_until(proc, r"[Cc]onnecting to \d+ host", timeout=60)
        time.sleep(delay)   # where the Ctrl-C lands: each host's opening takes a few tenths here
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    finally:
        kill_group(proc)
    out = "".join(seen) + rest
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    wait_for(lambda: not tagged_processes(), timeout=20, what="no process of the run left on any host")
    for host in bed.hosts.values():    # a shim that was installing one takes it back once it sees the launcher gone
        wait_for(lambda h=host: "tfcluster_" not in h.run(["nft", "list", "tables"]).stdout, timeout=20,
                 what=f"no table of the cluster left on {host.name}")
