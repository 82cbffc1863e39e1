"""The keras-jax template's stop and checkpoint request between real JAX processes (the extras
layer's Python, CPU, gloo), started by hand as mode keras-jax starts them.

Saving is a collective, so a signal to one process must become a save by all of them at the
same step: a SIGUSR1 to process 1 alone is a checkpoint every process joins, and training goes
on; a SIGTERM to process 1 alone (tfcluster's stop reaches the processes one by one) makes
every process save the same step, mid-epoch (JAX's preemption sync point), and end 143. Started again, they resume at that
step, inside the epoch, and end on the very weights of a run that was never stopped.
"""
from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers import read_until
from tests.jax_procs import Jax

pytestmark = pytest.mark.tf

TEMPLATE = Path(__file__).resolve().parent.parent / "templates" / "keras_jax.py"
# 8192 examples in global batches of 64: 128 steps an epoch, long enough for a stop to land
# inside one (JAX's preemption notice takes 0.3-0.6 s to reach every process here)
EPOCHS, STEPS, EXAMPLES = 4, 128, 8192
DIGEST = re.compile(rb"weights sha256=([0-9a-f]{16}) process=(\d)")


@pytest.fixture
def jax(tmp_path):
    job = Jax(tmp_path)
    yield job
    job.close()


def start_pair(jax: Jax, model_dir: Path) -> list[subprocess.Popen]:
    jax.next_job()
    env = {"KERAS_BACKEND": "jax", "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{jax.port}",
           "KERAS_DISTRIBUTION_NUM_PROCESSES": "2", "PYTHONUNBUFFERED": "1"}
    args = ("--epochs", str(EPOCHS), "--examples", str(EXAMPLES), "--model_dir", str(model_dir))
    return [jax.start(*args, script=TEMPLATE, env={**env, "KERAS_DISTRIBUTION_PROCESS_ID": str(i)}) for i in (0, 1)]


def ends(procs: list[subprocess.Popen], model_dir: Path, seen: bytes = b"",
         timeout: float = 120) -> tuple[list[int], list[bytes]]:
    """Each process's exit code and output (process 0's with what was read of it before);
    the outputs are kept beside `model_dir`, to read."""
    outs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    outs[0] = seen + outs[0]
    for i, (proc, out) in enumerate(zip(procs, outs)):
        (model_dir.parent / f"{model_dir.name}-process-{i}-{proc.pid}.out").write_bytes(out)
    return [proc.returncode for proc in procs], outs


def digest(outs: list[bytes]) -> str:
    found = {m.group(2): m.group(1) for out in outs for m in DIGEST.finditer(out)}
    assert set(found) == {b"0", b"1"} and len(set(found.values())) == 1, found     # both processes, alike
    return found[b"0"].decode()


@pytest.mark.timeout(400)
def test_a_signal_to_one_process_saves_every_process_at_one_step_and_a_stop_resumes_mid_epoch(jax, tmp_path):
    # a checkpoint request to process 1 alone, in epoch 1: saved together, trained on to the end
    procs = start_pair(jax, tmp_path / "asked")
    seen = b"".join(read_until(procs[0], rb"^Epoch 1/", timeout=120))
    procs[1].send_signal(signal.SIGUSR1)
    codes, outs = ends(procs, tmp_path / "asked", seen)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    asked = re.search(rb"saved \S+/ckpt-(\d+) at step=\1 \(checkpoint request\)", outs[0])
    # a request is looked for every 10 steps (a gather): saved at one of those, inside the epoch
    assert asked and int(asked.group(1)) % 10 == 0 and int(asked.group(1)) < STEPS, outs[0][-3000:]
    never_stopped = digest(outs)

    # a stop to process 1 alone, from epoch 2 on: every process saves the same step and ends 143
    model_dir = tmp_path / "stopped"
    procs = start_pair(jax, model_dir)
    seen = b"".join(read_until(procs[0], rb"^Epoch 2/", timeout=120))
    procs[1].send_signal(signal.SIGTERM)
    codes, outs = ends(procs, model_dir, seen, timeout=60)
    assert codes == [143, 143], outs[0][-3000:] + outs[1][-3000:]
    steps = [re.findall(rb"stopped by SIGTERM \(to this process or another\) at step=(\d+)", out) for out in outs]
    assert steps[0] and steps[0] == steps[1], outs[0][-3000:] + outs[1][-3000:]
    stopped = int(steps[0][0])
    assert STEPS < stopped < EPOCHS * STEPS, stopped                # after the signal, before the end
    assert re.search(rb"saved \S+/ckpt-%d at step=%d \(stop\)" % (stopped, stopped), outs[0]), outs[0][-3000:]
    assert (model_dir / f"ckpt-{stopped}.index").exists()

    # started again: at that step, inside the epoch, to the weights of the run never stopped
    procs = start_pair(jax, model_dir)
    codes, outs = ends(procs, model_dir)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert re.search(rb"restored \S+/ckpt-%d at step=%d\n" % (stopped, stopped), outs[0]), outs[0][-3000:]
    start, done = divmod(stopped, STEPS)
    if done:        # inside an epoch (all but one time in STEPS): its rest, then the others
        assert b"epoch %d of %d, its step %d of %d" % (start, EPOCHS, done, STEPS) in outs[0], outs[0][-3000:]
    assert b"tfcluster-result: global_step=%d " % (EPOCHS * STEPS) in outs[0]
    assert digest(outs) == never_stopped
