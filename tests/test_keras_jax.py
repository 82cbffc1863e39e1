"""Mode keras-jax: Keras 3 `model.fit` on the JAX backend over several processes, for real.

Real JAX (CPU, gloo collectives) and real sshd on loopback hosts 127.0.0.2-3: two processes
of the shipped template (templates/keras_jax.py) train to the same weights (each prints a
digest of its weights); a process killed mid-run makes every process restart from process
0's checkpoint, and the run reaches its last epoch; a script that picks another Keras
backend is diagnosed with its fix. The plan's side (variables, placement, refusals) is
tested without processes at the end.
"""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers import (
    NFT,
    cgroup_fence_or_skip,
    cluster_tables,
    dial,
    free_ports,
    gone_after_ctrl_c,
    jax_python,
    kill_group,
    kill_tagged_once_seen,
    manifest,
    only_run,
    read_until,
    start_tfcluster,
    tagged_processes,
    tfcluster,
    wait_for,
)
from tfcluster.errors import SpecError
from tfcluster.plan import build_plan
from tfcluster.spec import load_spec

DIGEST = re.compile(r"weights sha256=([0-9a-f]{16}) process=(\d)")
EPOCH_STEPS = 32                 # the template's 2048 examples in global batches of 64


def jax_spec(tmp: Path, sshd, *, name: str, args: str, extra: str = "", processes: int = 2) -> Path:
    hosts = [f"h{2 + i}" for i in range(processes)]
    tasks = ", ".join(f"'{h}:{port}'" for h, port in zip(hosts, free_ports(processes)))
    text = (f"name: {name}\npython: {jax_python()}\nworkdir: {tmp / 'remote'}\n"
            f"ssh:\n  port: {sshd.port}\n  connect_timeout: 5\n"
            "hosts:\n" + "".join(f"  - {{name: {h}, address: 127.0.0.{h[1:]}}}\n" for h in hosts) +
            f"jobs:\n  worker: {{tasks: [{tasks}]}}\n"
            f"train:\n  mode: keras-jax\n  script: template:keras_jax\n  args: {args}\n  timeout: 400\n{extra}")
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


def digests(run_dir: Path, processes: int = 2) -> dict[str, str]:
    """worker key -> the digest of the weights it ended with (its last attempt's)."""
    out = {}
    for key in (f"worker-{i}" for i in range(processes)):
        found = DIGEST.findall((run_dir / f"{key}.log").read_text(errors="replace"))
        assert found, f"{key} printed no digest:\n{(run_dir / f'{key}.log').read_text()[-3000:]}"
        out[key] = found[-1][0]
    return out


@pytest.mark.tf
@pytest.mark.timeout(420)
def test_three_processes_train_to_the_same_weights_and_progress_comes_from_process_0(tmp_path, home, ssh_home, sshd):
    # a global batch of 48 over 3 processes, 1536 examples: EPOCH_STEPS steps an epoch
    spec = jax_spec(tmp_path, sshd, name="kjfit", processes=3,
                    args='["--epochs", "3", "--batch_size", "48", "--examples", "1536"]')
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = tfcluster("train", str(spec), home=home, cwd=cwd, timeout=400)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    run = only_run(cwd / "runs")
    tasks = manifest(run)["tasks"]
    assert {k: t["script"]["exit_code"] for k, t in tasks.items()} == {"worker:0": 0, "worker:1": 0, "worker:2": 0}
    found = digests(run, processes=3)
    assert found["worker-0"] == found["worker-1"] == found["worker-2"], found
    log0 = (run / "worker-0.log").read_text()
    assert "process 0 of 3: 1 local device(s), 3 in all" in log0
    assert f"global_step={3 * EPOCH_STEPS}" in log0
    # every process joined before JAX started (the probe's report, diagnose/strategy.py)
    assert "strategy check: jax.distributed, 3 processes joined on worker:0, worker:1, worker:2" in out, out[-3000:]
    # Keras' own epoch lines, read as for any Keras run: process 0's step in the summary
    row = next(line for line in out.splitlines() if line.lstrip().startswith("worker:0") and " h2 " in line)
    assert str(3 * EPOCH_STEPS) in row.split(), row
    assert not tagged_processes()


@pytest.mark.tf
@pytest.mark.timeout(560)
def test_a_killed_process_restarts_every_process_from_the_checkpoint(tmp_path, home, ssh_home, sshd):
    epochs = 12
    spec = jax_spec(tmp_path, sshd, name="kjkill",
                    args=f'["--epochs", "{epochs}", "--model_dir", "{{workdir}}/ckpt"]',
                    extra="  restart: {policy: on-failure, max_restarts: 2}\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    # process 0 saved epochs 1 and 2 (steps 32 and 64) when it starts epoch 3; kill process 1 then
    out = kill_tagged_once_seen(proc, r"worker:0 .*Epoch 3/", ":worker:1:script", wait=300, finish=240)
    assert proc.returncode == 0, out[-5000:]
    assert "worker:1 on h3 exited with code" in out and "restarting every process from the checkpoint (1/2)" in out, \
        out[-5000:]
    restored = re.search(r"restored \S+/ckpt/ckpt-(\d+) at step=(\d+)", out)
    assert restored and int(restored.group(1)) >= 2 * EPOCH_STEPS, out[-5000:]
    # numbered by its step; an epoch's end: a killed process joins no save, so none was made mid-epoch
    assert int(restored.group(2)) == int(restored.group(1)) and int(restored.group(1)) % EPOCH_STEPS == 0
    run = only_run(cwd / "runs")
    found = digests(run)
    assert found["worker-0"] == found["worker-1"], found
    assert f"global_step={epochs * EPOCH_STEPS}" in (run / "worker-0.log").read_text()
    tasks = manifest(run)["tasks"]
    assert {k: (t["script"]["exit_code"], t["script"]["restarts"]) for k, t in tasks.items()} == \
        {"worker:0": (0, 1), "worker:1": (0, 1)}, tasks
    assert not tagged_processes()


@pytest.mark.tf
@pytest.mark.timeout(240)
def test_a_script_that_picks_another_backend_is_diagnosed(tmp_path, home):
    """keras-io's examples start with `os.environ["KERAS_BACKEND"] = "tensorflow"`: the
    script then overrides the backend the mode set, and keras.distribution.initialize() has
    nothing to run on. One local process shows it (the backend is chosen per process)."""
    (tmp_path / "main.py").write_text(
        'import os\nos.environ["KERAS_BACKEND"] = "tensorflow"\nimport keras\n'
        'keras.distribution.initialize()\n')
    spec = local_processes(tmp_path, "kjbackend", jax_python(), "main.py", 1)
    result = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=220)
    out = result.stdout + result.stderr
    assert result.returncode == 5, out[-3000:]        # a task failed (docs: exit codes)
    assert "ran on a Keras backend other than JAX" in out, out[-3000:]
    assert "remove the script's own KERAS_BACKEND setting" in out, out[-3000:]
    assert not tagged_processes()


# Keras' guides train one process: run as they are, two processes train two copies
ALONE_FIT = ("import keras\nimport numpy as np\n{init}"
             "x, y = np.zeros((64, 4), 'float32'), np.zeros((64, 1), 'float32')\n"
             "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])\n"
             "model.compile(optimizer='sgd', loss='mse')\n"
             "model.fit(x, y, epochs=100000, verbose=2)\n")


@pytest.mark.tf
@pytest.mark.timeout(240)
@pytest.mark.parametrize("init, what, summary, fix", [
    ("", "ran JAX without joining the other processes (no keras.distribution.initialize() or "
         "jax.distributed.initialize() before its first JAX computation): each of the 2 processes trains "
         "its own copy of the model, never synchronised",
     "no jax.distributed.initialize() on worker:", "hint: call keras.distribution.initialize() first"),
    ("keras.distribution.initialize()\n",
     "ran model.fit with no keras.distribution set: the processes joined, but each of the 2 fits its own "
     "copy of the model on its own devices, never synchronised",
     "no keras.distribution on worker:",
     "hint: set one before building the model: keras.distribution.set_distribution("
     "keras.distribution.DataParallel(devices=keras.distribution.list_devices()))"),
], ids=["never-joined", "joined-without-a-distribution"])
def test_processes_that_each_train_their_own_copy_are_stopped_with_the_fix(tmp_path, home, init, what, summary, fix):
    """A fit of 100,000 epochs: only the check ends it, exit 8, with what the first process to
    show it did (the summary names those that had shown it by the stop)."""
    (tmp_path / "alone.py").write_text(ALONE_FIT.format(init=init))
    spec = local_processes(tmp_path, "kjalone", jax_python(), "alone.py", 2)
    result = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=200)
    out = result.stdout + result.stderr
    assert result.returncode == 8, out[-4000:]
    error = next(line for line in result.stderr.splitlines() if line.startswith("tfcluster: error: "))
    assert re.fullmatch(r"tfcluster: error: strategy mismatch: worker:[01] " + re.escape(what), error), error
    assert f"strategy check: {summary}" in out, out[-3000:]
    assert fix in result.stderr, result.stderr[-3000:]
    # said before the run too where the text shows it: no call that joins the processes
    warned = "tfcluster: warning: alone.py: keras-jax mode: the script calls neither" in result.stderr
    assert warned == (init == ""), result.stderr[-3000:]
    assert not tagged_processes()


@pytest.mark.tf
@pytest.mark.timeout(240)
def test_a_script_that_fails_just_after_showing_a_mismatch_is_a_failure_with_its_own_error(tmp_path, home):
    """keras-io's 2023 distribution guide begins `jax.devices("gpu")`, before joining: that starts
    JAX's backend (a mismatch: the process never joined) and then raises on a CPU host. The run
    ends as the failure it is, exit 5, its own error shown, the mismatch said beside it."""
    (tmp_path / "guide.py").write_text('import jax\nimport keras\nprint("devices", flush=True)\n'
                                       'devices = jax.devices("gpu")\n')
    spec = local_processes(tmp_path, "kjguide", jax_python(), "guide.py", 2)
    result = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=200)
    out = result.stdout + result.stderr
    assert result.returncode == 5, out[-4000:]
    assert re.search(r"tfcluster: error: worker:[01] on me failed with exit code 1", result.stderr), out[-3000:]
    assert "RuntimeError: Unknown backend" in result.stderr, result.stderr[-3000:]
    assert re.search(r"tfcluster: warning: strategy mismatch: worker:[01] ran JAX without joining", result.stderr)
    assert not tagged_processes()


@pytest.mark.timeout(120)
def test_plan_check_says_which_ports_the_table_will_close(tmp_path, home):
    """No TensorFlow server runs in this mode: the table closes its task ports (JAX's
    coordinator on worker 0's), and the line says so, not "TensorFlow's ports"."""
    if os.geteuid() != 0 or NFT is None:
        pytest.skip("the table is made by root with nft: without them it is never promised")
    (tmp_path / "t.py").write_text("print(1)\n")
    spec = local_processes(tmp_path, "kjcheck", jax_python(), "t.py", 2)
    result = tfcluster("plan", str(spec), "--check", home=home, cwd=tmp_path, timeout=100)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "The task ports will be closed to other users on every host (nftables)" in out, out[-3000:]
    assert "TensorFlow's ports" not in out


def picked_ports(task_ports: set[int]) -> dict[int, set[int]]:
    """pid -> the ports a tagged process listens on that no task port names (JAX's gloo)."""
    found = {}
    for pid in tagged_processes():
        try:
            ports = {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN} - task_ports
        except psutil.Error:
            continue
        if ports:
            found[pid] = ports
    return found


@pytest.mark.tf
@pytest.mark.timeout(240)
def test_the_ports_jaxs_collectives_picked_are_closed_to_another_user_while_it_trains(tmp_path, home, other_user):
    """Gloo's pair listeners are on ports the kernel picks, not the task ports; before the
    table closed every port of the cluster's processes, a second user connected to both
    processes' of this run. Now that user and the owner's own processes outside the cluster
    are refused there, the run trains on through it, and Ctrl-C takes the table away."""
    cgroup_fence_or_skip()
    ports = free_ports(2)
    spec = tmp_path / "kjfence.yaml"
    spec.write_text(f"name: kjfence\npython: {jax_python()}\nworkdir: {tmp_path / 'remote'}\n"
                    "hosts:\n  - {name: me, address: localhost}\n"
                    f"jobs:\n  worker: {{tasks: ['me:{ports[0]}', 'me:{ports[1]}']}}\n"
                    "train:\n  mode: keras-jax\n  script: template:keras_jax\n"
                    "  args: ['--epochs', '100000']\n  timeout: 200\n")
    proc = start_tfcluster("train", str(spec), home=home, cwd=tmp_path)
    try:
        read_until(proc, r"│ Epoch 2/", timeout=150)
        picked = wait_for(lambda: (found := picked_ports(set(ports))) and len(found) == 2 and found, 30,
                          what="both processes' gloo listeners")
        targets = [f"127.0.0.1:{p}" for found in picked.values() for p in sorted(found)]
        for user in (other_user, None):              # another user; the owner's process outside the cluster
            assert dial(*targets, user=user) == {t: "ConnectionRefusedError" for t in targets}, user
        assert len(cluster_tables("kjfence")) == 1
        read_until(proc, r"│ Epoch \d+/", timeout=60)        # still training
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 130
    finally:
        kill_group(proc)
    gone_after_ctrl_c("kjfence")


ONE_RAISES = ("import keras\nimport numpy as np\nimport jax\n"
              "keras.distribution.initialize()\n"
              "keras.distribution.set_distribution(keras.distribution.DataParallel("
              "devices=keras.distribution.list_devices(), auto_shard_dataset=False))\n"
              "me = jax.process_index()\n"
              "x, y = np.zeros((64, 4), 'float32'), np.zeros((64, 1), 'float32')\n"
              "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])\n"
              "model.compile(optimizer='sgd', loss='mse')\n"
              "class Boom(keras.callbacks.Callback):\n"
              "    def on_epoch_begin(self, epoch, logs=None):\n"
              "        if epoch == 2 and me == 1:\n"
              "            raise RuntimeError('a bug in process 1 only')\n"
              "model.fit(x, y, batch_size=16, epochs=100000, verbose=2 if me == 0 else 0, callbacks=[Boom()])\n")


@pytest.mark.tf
@pytest.mark.timeout(240)
def test_an_exception_in_one_process_fails_the_run_at_once_with_that_exception(tmp_path, home):
    """keras-io's guides as a user writes them, with a bug that raises in one process only, in
    the middle of a fit: the other waits for it inside a collective, and JAX's exit would have
    it wait at a barrier for the other (300 s). The run ends as that process's failure, exit 5,
    its exception shown: waited out, the barrier would outlast the run's own timeout (200 s,
    exit 6)."""
    (tmp_path / "boom.py").write_text(ONE_RAISES)
    spec = local_processes(tmp_path, "kjboom", jax_python(), "boom.py", 2)
    result = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=230)
    out = result.stdout + result.stderr
    assert result.returncode == 5, out[-4000:]
    assert "tfcluster: error: worker:1 on me failed with exit code 1" in result.stderr, out[-3000:]
    assert "RuntimeError: a bug in process 1 only" in result.stderr, result.stderr[-3000:]
    # the probe's frames in the traceback say what they are, not look like tfcluster failing
    assert "# tfcluster's start-up probe: your call, unchanged" in out, out[-3000:]
    assert not tagged_processes()


@pytest.mark.tf
@pytest.mark.timeout(240)
def test_the_template_under_a_tensorflow_mode_refuses_to_train_copies(tmp_path, home):
    """The keras-jax template given to mode mirrored: no coordinator to join, so each worker
    would train its own copy and the run would say it succeeded. It stops instead, naming the mode."""
    spec = local_processes(tmp_path, "kjmirr", jax_python(), "template:keras_jax", 2)
    spec.write_text(spec.read_text().replace("mode: keras-jax", "mode: mirrored"))
    result = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=200)
    out = result.stdout + result.stderr
    assert result.returncode == 5, out[-4000:]
    assert "2 workers and no JAX coordinator to join: each would train its own copy" in result.stderr, out[-3000:]
    assert "set train.mode: keras-jax" in result.stderr, out[-3000:]
    assert "succeeded" not in out and not tagged_processes(), out[-3000:]


def local_processes(tmp_path: Path, name: str, python: str, script: str, n: int) -> Path:
    """Mode keras-jax, `n` processes on this machine, run by `python`."""
    tasks = ", ".join(f"'me:{port}'" for port in free_ports(n))
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(f"name: {name}\npython: {python}\nworkdir: {tmp_path / 'remote'}\n"
                    "hosts:\n  - {name: me, address: localhost}\n"
                    f"jobs:\n  worker: {{tasks: [{tasks}]}}\n"
                    f"train:\n  mode: keras-jax\n  script: {script}\n  timeout: 200\n")
    return spec


def test_a_python_without_jax_is_refused_before_anything_starts(tmp_path, home):
    """The suite's own venv has no jax (scripts/test.sh layers it apart): the preflight finds
    it missing for the host's Python, names both and how to install it, and starts nothing."""
    if importlib.util.find_spec("jax") is not None:
        pytest.skip(f"{sys.executable} has jax: the fault needs a Python without it")
    (tmp_path / "t.py").write_text("print(1)\n")
    spec = local_processes(tmp_path, "kjnojax", sys.executable, "t.py", 1)
    result = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=120)
    assert result.returncode == 4, result.stdout + result.stderr      # preflight (docs: exit codes)
    assert f"host me: jax is not installed for {sys.executable}" in result.stderr, result.stderr
    assert "-m pip install jax" in result.stderr, result.stderr
    assert not tagged_processes()

# -- the plan (no processes) -----------------------------------------------------------

def write(tmp: Path, body: str, hosts: str = "  - {name: a, address: 10.0.0.1, gpus: 4}\n"
          "  - {name: b, address: 10.0.0.2, gpus: 4}\n") -> Path:
    path = tmp / "s.yaml"
    path.write_text(f"name: kj\nhosts:\n{hosts}{body}")
    (tmp / "t.py").write_text("print(1)\n")
    return path


def test_each_process_gets_the_backend_the_coordinator_and_its_id_and_all_of_its_hosts_gpus(tmp_path):
    spec = write(tmp_path, "jobs:\n  worker: {count: 2, hosts: [a, b], port: 7600}\n"
                           "train: {mode: keras-jax, script: t.py}\n")
    plan = build_plan(load_spec(str(spec)))
    envs = {t.key: dict(t.env) for t in plan.tasks}
    for i, key in enumerate(("worker:0", "worker:1")):
        env = envs[key]
        assert env["KERAS_BACKEND"] == "jax"
        assert env["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == env["JAX_COORDINATOR_ADDRESS"] == "10.0.0.1:7600"
        assert env["KERAS_DISTRIBUTION_NUM_PROCESSES"] == env["JAX_NUM_PROCESSES"] == "2"
        assert env["KERAS_DISTRIBUTION_PROCESS_ID"] == env["JAX_PROCESS_ID"] == str(i)
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
        assert "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in env      # GPUs: NCCL, not gloo
    assert not any(t.runs_server for t in plan.tasks)


def test_per_gpu_gives_one_process_per_gpu_and_cpu_hosts_get_gloo(tmp_path):
    spec = write(tmp_path, "jobs:\n  worker: {per_gpu: true, hosts: [a], port: 7600}\n"
                           "train: {mode: keras-jax, script: t.py}\n")
    plan = build_plan(load_spec(str(spec)))
    assert [(t.key, t.gpus, dict(t.env)["JAX_PROCESS_ID"]) for t in plan.tasks] == \
        [(f"worker:{i}", (i,), str(i)) for i in range(4)]
    spec = write(tmp_path, "jobs:\n  worker: {count: 1, hosts: [c], port: 7600}\n"
                           "train: {mode: keras-jax, script: t.py}\n",
                 hosts="  - {name: c, address: 10.0.0.3}\n")
    env = dict(build_plan(load_spec(str(spec))).tasks[0].env)
    assert env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo" and env["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.parametrize("body,line,message", [
    ("jobs:\n  ps: {count: 1, hosts: [a], port: 2222}\n  worker: {count: 1, hosts: [b], port: 7600}\n"
     "train: {mode: keras-jax, script: t.py}\n", 6, "jobs.ps: mode keras-jax takes no ps tasks"),
    # an evaluator is refused by name, not by the GPUs a worker would take by default
    ("jobs:\n  worker: {count: 1, hosts: [a], port: 7600}\n  evaluator: {count: 1, hosts: [a], port: 7700}\n"
     "train: {mode: keras-jax, script: t.py}\n", 7, "jobs.evaluator: mode keras-jax takes no evaluator tasks"),
    # two processes on one host would each take all of its GPUs: the message says why it needs 8
    ("jobs:\n  worker: {count: 2, hosts: [a], port: 7600}\n"
     "train: {mode: keras-jax, script: t.py}\n", 6,
     "jobs.worker: host a has 4 GPUs but its tasks need 8 (mode keras-jax gives each process every GPU of its host)"),
    ("env: {KERAS_BACKEND: tensorflow}\njobs:\n  worker: {count: 1, hosts: [a], port: 7600}\n"
     "train: {mode: keras-jax, script: t.py}\n", 5, "env.KERAS_BACKEND: mode keras-jax runs Keras on JAX"),
    ("env: {JAX_PROCESS_ID: '3'}\njobs:\n  worker: {count: 1, hosts: [a], port: 7600}\n"
     "train: {mode: keras-jax, script: t.py}\n", 5, "env.JAX_PROCESS_ID: JAX_PROCESS_ID is set by tfcluster"),
])
def test_what_the_mode_refuses_is_one_line_naming_the_field(tmp_path, body, line, message):
    with pytest.raises(SpecError) as err:
        load_spec(str(write(tmp_path, body)))
    assert f"s.yaml:{line}: {message}" in str(err.value), str(err.value)


def test_processes_with_different_gpu_counts_are_refused(tmp_path):
    spec = write(tmp_path, "jobs:\n  worker: {count: 2, hosts: [a, b], port: 7600}\n"
                           "train: {mode: keras-jax, script: t.py}\n",
                 hosts="  - {name: a, address: 10.0.0.1, gpus: 4}\n  - {name: b, address: 10.0.0.2, gpus: 2}\n")
    with pytest.raises(SpecError, match="worker:0 gets 4 GPUs and worker:1 2: JAX needs the same number"):
        load_spec(str(spec))


# -- the signatures, on lines JAX 0.10.2 and Keras 3.15.1 printed here -------------------
# (two processes started by hand: one with XLA_FLAGS=--xla_force_host_platform_device_count=2;
# and process 1 SIGKILLed mid-epoch, process 0's log after its 100 s heartbeat timeout)

DEVICE_COUNT = b"""Traceback (most recent call last):
  File "/work/main/.venv/lib/python3.11/site-packages/keras/src/backend/jax/distribution_lib.py", line 129, in initialize_rng
    global_seed = jax.pmap(
  File "/work/main/.venv/lib/python3.11/site-packages/jax/_src/pmap.py", line 701, in _get_mesh_devices
    assert all(
AssertionError
"""
PEER_DIED = (b"jax.errors.JaxRuntimeError: INTERNAL: Error dispatching computation: Gloo all-reduce failed: "
             b"[external/gloo/gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:28044: Connection reset by peer\n"
             b"E1128 11:04:26.148502   22083 coordination_service.cc:1549] [17209706471296935920] Use error polling "
             b"to propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy "
             b"(stopped sending heartbeats):\n"
             b"F1128 11:04:26.158113   21974 client.h:80] Terminating process because the JAX distributed service "
             b"detected fatal errors. This most likely indicates that another task died\n")


@pytest.mark.parametrize("tail,name", [(DEVICE_COUNT, "jax-device-count"), (PEER_DIED, "jax-peer-died"),
                                       (b"AssertionError\n", None)])
def test_jax_endings_are_named(tail, name):
    from tfcluster.diagnose import signatures

    found = signatures.diagnose("keras-jax", tail, "worker")
    assert (found.name if found else None) == name
