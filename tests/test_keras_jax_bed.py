"""keras-jax mode between hosts that are separate machines (the bed, tests/netns.py). JAX's CPU
collectives (gloo) give the other processes the address their host's hostname resolves to;
jax passes gloo no interface. Here, as on a stock Debian or cloud image, the hostname resolves
to loopback: the run is refused before anything starts, naming the host and the fix. With each
host's /etc/hosts mapping the hostname to its own address, the same run trains across the
hosts, and a lost host's processes move to the spare, every process restarted from the
checkpoint."""
from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from tests.helpers import jax_python, kill_group, manifest, only_run, read_until, start_tfcluster, tagged_processes, tfcluster, wait_for
from tests.netns import dial_from
from tfcluster.errors import ExitCode

pytestmark = [pytest.mark.ssh, pytest.mark.tf]

EPOCHS, EPOCH_STEPS = 6, 32     # the template's 2048 examples in global batches of 64
DIGEST = re.compile(r"weights sha256=([0-9a-f]{16}) process=(\d)")


def write_spec(tmp_path: Path, bed, name: str, spare: bool = False, epochs: int = EPOCHS) -> Path:
    hosts = "".join(f"  - {bed.add(n).spec()}\n" for n in ("h3", "h4"))
    if spare:
        hosts += f"  - {bed.add('h5').spec(spare='true')}\n"
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(
        f"name: {name}\npython: {jax_python()}\nworkdir: {tmp_path / 'remote'}\nssh: {{connect_timeout: 5}}\n"
        f"hosts:\n{hosts}jobs:\n  worker: {{tasks: ['h3:26100', 'h4:26101']}}\n"
        f"train:\n  mode: keras-jax\n  script: template:keras_jax\n"
        f"  args: ['--epochs', '{epochs}', '--model_dir', '{{workdir}}/ckpt']\n"
        "  checkpoint: {dir: '{workdir}/ckpt', keep: 2, sync: 2s}\n  timeout: 480\n")
    return spec


def name_each_host(tmp_path: Path, bed, names) -> None:
    """Each host's /etc/hosts (its own mount namespace) maps the machine's hostname to its address."""
    me = socket.gethostname()
    for n in names:
        host = bed.hosts[n]
        hosts = tmp_path / f"hosts-{n}"
        hosts.write_text(f"127.0.0.1 localhost\n{host.address} {me}\n")
        done = host.run(["mount", "--bind", str(hosts), "/etc/hosts"], timeout=20)
        assert done.returncode == 0, done.stderr


def pulled(cwd: Path) -> list[int]:
    names = (p.name.rpartition("-")[2] for p in (cwd / "runs").glob("*/checkpoints/*"))
    return sorted(int(n) for n in names if n.isdigit())


@pytest.mark.timeout(240)
def test_a_hostname_resolving_to_loopback_is_refused_before_anything_starts(tmp_path, home, ssh_home, bed):
    if not socket.gethostbyname(socket.gethostname()).startswith("127."):
        pytest.skip("this machine's hostname resolves to a routable address: the refusal cannot happen here")
    spec = write_spec(tmp_path, bed, "kjl")
    run = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=180)
    assert run.returncode == ExitCode.PREFLIGHT, run.stdout[-2000:] + run.stderr[-2000:]
    first = next(line for line in run.stderr.splitlines() if line.startswith("tfcluster: error:"))
    assert re.match(rf"tfcluster: error: host h3: its hostname '{re.escape(socket.gethostname())}' resolves to "
                    r"127\.[0-9.]+ there; JAX's CPU collectives \(gloo\)", first), run.stderr
    assert f"`{bed.hosts['h3'].address} {socket.gethostname()}`" in run.stderr
    assert not tagged_processes()
    assert not any(log.stat().st_size for log in tmp_path.glob("runs/*/worker-*.log"))    # nothing started


@pytest.mark.timeout(540)
@pytest.mark.parametrize("lost, task", [("h4", "worker:1"), ("h3", "worker:0")],
                         ids=["process-1", "process-0-the-coordinator"])
def test_a_lost_host_with_a_spare_completes_the_run_there_from_the_checkpoint(tmp_path, home, ssh_home, bed,
                                                                            lost, task):
    """Process 0's host is also the coordinator's (and the checkpoints' writer): with it gone,
    every process meets at the spare's address, from the launcher's copy of the checkpoint."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = write_spec(tmp_path, bed, "kjs", spare=True)
    name_each_host(tmp_path, bed, ("h3", "h4", "h5"))
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:0 .*Epoch 3/", timeout=300)
        wait_for(lambda: any(pulled(cwd)), timeout=120, what="a checkpoint pulled to the launcher")
        bed.kill(lost)
        read_until(proc, rf"{lost}: moving {task} to h5, every (task|process) restarting from the checkpoint",
                   timeout=120)
        rest = proc.communicate(timeout=360)[0]
    finally:
        kill_group(proc)
    assert proc.returncode == 0, rest[-5000:]
    restored = re.search(r"restored \S+/ckpt-(\d+) at step=(\d+)", rest)
    assert restored and int(restored.group(1)) >= 1, rest[-5000:]
    run = only_run(cwd / "runs")
    doc = manifest(run)
    (move,) = doc["moves"]
    assert move["to"] == "h5" and move["resumed_step"], move
    assert doc["tasks"][task]["host"] == "h5"
    ends = {k: DIGEST.findall((run / f"{k}.log").read_text(errors="replace"))[-1][0] for k in ("worker-0", "worker-1")}
    assert ends["worker-0"] == ends["worker-1"], ends
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")


@pytest.mark.timeout(540)
def test_a_drain_resumes_every_process_at_the_step_their_stop_saved(tmp_path, home, ssh_home, bed, other_user):
    """`tfcluster drain` of process 1's host: the stop reaches the processes one by one, they
    agree on a step and save it together (saving is a collective), and restarted with process
    1 on the spare they resume at that step, inside its epoch: no step done twice."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = write_spec(tmp_path, bed, "kjd", spare=True, epochs=12)     # time for the drain to come mid-run
    name_each_host(tmp_path, bed, ("h3", "h4", "h5"))
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:0 .*Epoch 3/", timeout=300)
        # gloo trains between the hosts through tables that close every port it listens on: on
        # h3, another user is refused at the ports worker:0's gloo picked (no task port names them)
        for name in ("h3", "h4", "h5"):
            listing = bed.hosts[name].run(["nft", "list", "ruleset"], timeout=20).stdout
            assert "meta mark set meta mark | 0x20000000" in listing, (name, listing)
        h3 = bed.hosts["h3"]
        listening = h3.run(["ss", "-Hltnp"], timeout=20).stdout
        picked = sorted({int(m) for m in re.findall(r":(\d+)\s+\S+\s+users:\(\(\"python", listening)} - {26100})
        assert picked, listening
        said = dial_from(h3, [[h3.address, p] for p in picked], other_user.uid)
        assert set(said.values()) == {"ConnectionRefusedError"} and len(said) == len(picked), said
        drain = tfcluster("drain", str(spec), "h4", "--wait", "120", home=home, cwd=cwd)
        said = drain.stdout + drain.stderr
        assert drain.returncode == 0, said
        assert re.search(r"h4: moved: .* h4 drained: worker:1 moved to h5, every task restarted", said), said
        rest = proc.communicate(timeout=360)[0]
    finally:
        kill_group(proc)
    assert proc.returncode == 0, rest[-5000:]
    stopped = re.findall(r"worker:([01]) +│ stopped by SIGTERM \(to this process or another\) at step=(\d+)", rest)
    assert sorted(k for k, _ in stopped) == ["0", "1"] and len({s for _, s in stopped}) == 1, rest[-5000:]
    step = int(stopped[0][1])
    assert step > 2 * EPOCH_STEPS, step                  # in epoch 3, where the drain came
    assert re.search(rf"worker:0 +│ saved \S+/ckpt-{step} at step={step} \(stop\)", rest), rest[-5000:]
    assert re.search(rf"worker:0 +│ restored \S+/ckpt-{step} at step={step}\n", rest), rest[-5000:]
    run = only_run(cwd / "runs")
    doc = manifest(run)
    (move,) = doc["moves"]
    assert move["why"] == "drained" and move["to"] == "h5" and move["steps_lost"] == 0, move
    assert move["resumed_step"] == step and doc["tasks"]["worker:1"]["host"] == "h5", move
    ends = {k: DIGEST.findall((run / f"{k}.log").read_text(errors="replace"))[-1][0] for k in ("worker-0", "worker-1")}
    assert ends["worker-0"] == ends["worker-1"], ends
    wait_for(lambda: not tagged_processes(), timeout=60, what="no task left running")
