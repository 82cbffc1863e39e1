"""The ways multi-process JAX ends, produced for real and named by the diagnosis.

Each case runs real JAX processes on this machine (the extras layer's Python, CPU, gloo), as
mode keras-jax starts them, and makes the fault happen: a coordinator nobody serves, a process
restarted alone, a process that stops answering, a peer gone mid-collective, a barrier only one
process reaches (through jax's own client, as checkpoint libraries call it), processes with
different device counts (Keras' own `keras.distribution.initialize()`). The output each process
really printed goes to `signatures.diagnose`, as a failed task's tail does in a run. JAX's
timeouts are shortened through `jax.distributed.initialize`'s own arguments, so a case takes
seconds; the messages are those of the default timeouts (only the wait differs).
"""
from __future__ import annotations

import os
import subprocess
import textwrap

import pytest

from tests.helpers import jax_python
from tests.jax_procs import Jax
from tfcluster.diagnose import signatures

pytestmark = pytest.mark.tf

# A process of a two-process JAX job: joins the coordinator, then does what `ACT` says.
PROGRAM = textwrap.dedent("""
    import os, signal, sys, time
    import jax
    pid, act = int(sys.argv[1]), sys.argv[2]
    jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"], num_processes=2,
                               process_id=pid, initialization_timeout=int(os.environ.get("INIT_TIMEOUT", "30")),
                               heartbeat_timeout_seconds=3, shutdown_timeout_seconds=3)
    print("joined", pid, flush=True)
    if act == "die":
        os._exit(1)                     # gone without a word to the coordinator, as a killed process
    if act == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)     # alive but silent: no heartbeat
    if act == "barrier":                 # a barrier the other process never reaches (orbax's saves wait at one)
        from jax._src import distributed
        distributed.global_state.client.wait_at_barrier("save", 2000)
    if act == "allreduce":
        from jax.experimental import multihost_utils
        while True:
            multihost_utils.process_allgather(jax.numpy.ones(4))
    time.sleep(60)
""")


@pytest.fixture
def jax(tmp_path):
    job = Jax(tmp_path, PROGRAM)
    yield job
    job.close()


def ended(proc: subprocess.Popen, timeout: float = 60) -> bytes:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode != 0, out[-2000:]
    return out


def ends_named(proc: subprocess.Popen, name: str, said: bytes = b"", timeout: float = 60) -> None:
    """`proc` fails, its output holds `said`, and the diagnosis of its tail is `name`."""
    out = ended(proc, timeout)
    assert said in out, out[-2000:]
    found = signatures.diagnose("keras-jax", out[-8000:], "worker")
    assert (found.name if found else None) == name, out[-2000:]


@pytest.mark.timeout(90)
def test_a_coordinator_nobody_serves_is_named_as_unreachable_not_as_a_dead_peer(jax):
    """Process 1 starts and process 0 never does (its host down, its script failed first).
    jax ends it with the same `Terminating process ... another task died` line a dead peer
    gives, and the call it failed in (RegisterTask) on the next line: that is what says which."""
    ends_named(jax.start("1", "wait", env={"INIT_TIMEOUT": "3"}), "jax-coordinator-unreachable", b"RegisterTask")


@pytest.mark.timeout(120)
def test_a_process_restarted_alone_is_refused_as_a_new_incarnation(jax):
    first = jax.start("0", "wait")
    gone = jax.start("1", "die")
    jax.joined(first)
    ended(gone)
    jax.start("1", "wait", env={"INIT_TIMEOUT": "5"})         # the same process id again, alone
    ends_named(first, "jax-incarnation", b"different incarnation")


@pytest.mark.timeout(120)
def test_a_process_that_stops_answering_ends_the_others_at_the_heartbeat_timeout(jax):
    first = jax.start("0", "wait")
    silent = jax.start("1", "stop")
    jax.joined(first)
    jax.joined(silent)
    ends_named(first, "jax-peer-died", b"stopped sending heartbeats")


@pytest.mark.timeout(120)
def test_a_peer_killed_mid_collective_ends_the_others(jax):
    first = jax.start("0", "allreduce")
    other = jax.start("1", "allreduce")
    jax.joined(first)
    jax.joined(other)
    other.kill()
    ends_named(first, "jax-peer-died")


@pytest.mark.timeout(120)
def test_a_barrier_the_other_process_never_reaches_times_out(jax):
    waiting = jax.start("0", "barrier")
    other = jax.start("1", "wait")
    jax.joined(other)
    ends_named(waiting, "jax-barrier", b"Barrier timed out")


def keras_process(jax, script, process_id: int, **env: str) -> subprocess.Popen:
    """One of two processes of a Keras `script`, with the variables mode keras-jax gives it."""
    return jax.start(script=script, env={"KERAS_BACKEND": "jax", "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
                                         "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{jax.port}",
                                         "KERAS_DISTRIBUTION_PROCESS_ID": str(process_id), **env})


def both_diagnosed(jax, script, name: str) -> list[signatures.Diagnosis]:
    """Both processes of `script` fail, each diagnosed as `name`."""
    found = []
    for proc in [keras_process(jax, script, 0), keras_process(jax, script, 1)]:
        out = ended(proc, 90)
        found.append(signatures.diagnose("keras-jax", out[-8000:], "worker"))
        assert found[-1] is not None and found[-1].name == name, out[-2000:]
    return found


@pytest.mark.timeout(120)
def test_processes_with_different_device_counts_fail_in_keras_initialize(jax, tmp_path):
    """As the template starts: keras.distribution.initialize() from the KERAS_DISTRIBUTION_*
    variables; one process sees 2 CPU devices (XLA_FLAGS), the other 1."""
    script = tmp_path / "fit.py"
    script.write_text("import keras\nkeras.distribution.initialize()\n"
                      "keras.distribution.set_distribution(\n"
                      "    keras.distribution.DataParallel(devices=keras.distribution.list_devices()))\n")
    procs = [keras_process(jax, script, 0),
             keras_process(jax, script, 1, XLA_FLAGS="--xla_force_host_platform_device_count=2")]
    for proc in procs:
        ends_named(proc, "jax-device-count", timeout=90)


@pytest.mark.timeout(120)
def test_a_mesh_shaped_for_another_device_count_is_named_with_the_counts(jax, tmp_path):
    """keras-io's distribution guide as written: a DeviceMesh of shape (8,) for one host's 8
    GPUs, here two processes of one CPU device each."""
    script = tmp_path / "guide.py"
    script.write_text("import keras\nkeras.distribution.initialize()\n"
                      "devices = keras.distribution.list_devices()\n"
                      "mesh_1d = keras.distribution.DeviceMesh(shape=(8,), axis_names=['data'], devices=devices)\n")
    for found in both_diagnosed(jax, script, "keras-mesh-shape"):
        assert "shape=(8,)" in found.line and "devices.shape=(2,)" in found.line, found.line


@pytest.mark.timeout(120)
def test_a_per_process_array_put_on_every_processs_devices_is_named_with_the_fix(jax, tmp_path):
    """keras-io's "Multi-GPU distributed training with JAX" puts each batch on a sharding of the
    mesh with jax.device_put; over several processes, each with its own slice of the data, JAX
    sees a value that should be the same everywhere and is not."""
    script = tmp_path / "put.py"
    script.write_text("import numpy as np\nimport jax\nimport keras\nkeras.distribution.initialize()\n"
                      "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
                      "mesh = Mesh(np.array(jax.devices()), ('batch',))\n"
                      "jax.device_put(np.full((2, 4), float(jax.process_index())), NamedSharding(mesh, P('batch')))\n")
    for found in both_diagnosed(jax, script, "jax-device-put-differs"):
        assert "make_array_from_process_local_data" in found.fix, found.fix


@pytest.mark.timeout(60)
def test_keras_distribution_under_a_tensorflow_mode_is_told_to_use_mode_keras_jax(tmp_path):
    """keras-io's distribution guide sets KERAS_BACKEND=jax itself and calls initialize(): under
    a TensorFlow mode no coordinator is named; with Keras' default backend, TensorFlow has no
    initialize() at all. Either way the fix is the mode."""
    script = tmp_path / "guide.py"
    script.write_text("import os\nos.environ.setdefault('KERAS_BACKEND', 'jax')\nimport keras\n"
                      "keras.distribution.initialize()\n")
    for backend, name in (("jax", "jax-no-coordinator"), ("tensorflow", "keras-backend-not-jax")):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "KERAS_", "JAX_"))}
        done = subprocess.run([jax_python(), str(script)], capture_output=True, timeout=50,
                              env={**env, "JAX_PLATFORMS": "cpu", "KERAS_BACKEND": backend})
        assert done.returncode != 0, done.stdout[-2000:]
        out = done.stdout + done.stderr
        found = signatures.diagnose("mirrored", out[-8000:], "worker")
        assert found is not None and found.name == name, out[-2000:]
        assert found.fix.startswith("set `train.mode: keras-jax`"), found.fix
    assert signatures.diagnose("keras-jax", out[-8000:], "worker").fix.startswith("remove the script's own KERAS_BACKEND")
