"""`render --to slurm` submitted to a real one-node Slurm (tests/slurm.py): the embedded
default trains to its exact final step and ends by itself; ps tasks stop when the workers
are done, a failing worker fails the job, two jobs on one node take different ports, a
missing secret stops the job before any task runs, mode keras-jax's processes find their
coordinator on the port the job surveyed. Nothing is left running."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.helpers import LOCAL, jax_python, tfc, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

# A classic-mode stand-in script without TensorFlow: a ps serves (sleeps) until stopped,
# worker 1 exits with argv[1], every other worker exits 0.
CLASSIC = """\
import os, sys, time
job, index = os.environ["TFCLUSTER_JOB"], int(os.environ["TFCLUSTER_TASK_INDEX"])
print(f"{job}:{index} started", flush=True)
if job == "ps":
    while True:
        time.sleep(1)
sys.exit(int(sys.argv[1]) if index == 1 else 0)
"""
# A mirrored-mode stand-in: binds its own TF_CONFIG address, holds it until the release file.
HOLD = """\
import json, os, socket, sys, time
config = json.loads(os.environ["TF_CONFIG"])
task = config["task"]
address = config["cluster"][task["type"]][task["index"]]
host, port = address.rsplit(":", 1)
s = socket.socket()
s.bind((host, int(port)))
s.listen()
print(f"bound {address}", flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.1)
sys.exit(0 if os.path.exists(sys.argv[1]) else 1)
"""


# A stand-in that takes SIGUSR1 as the templates do (a checkpoint request: saves, goes on) and
# holds until the release file; exits 3 if no request reached it.
ASKED = """\
import os, signal, sys, time
asked = []
signal.signal(signal.SIGUSR1, lambda *_: asked.append(print("checkpoint request", flush=True)))
print("started", flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.1)
sys.exit(0 if asked else 3)
"""


@pytest.fixture
def cluster(slurm_cluster, tmp_path):
    """The session's Slurm; after the test no job is queued or running, no job process is
    left, and no task left its private directory behind in the job's TMPDIR."""
    tmp = tmp_path / "jobtmp"
    tmp.mkdir()
    slurm_cluster.env["TMPDIR"] = str(tmp)
    yield slurm_cluster
    del slurm_cluster.env["TMPDIR"]
    left = slurm_cluster.jobs_not_over()
    slurm_cluster.cancel_all()
    slurm_cluster.wait_no_job_processes()
    assert not left, f"jobs still queued or running after the test: {left}"
    assert not list(tmp.iterdir()), "a task left its directory behind"


def render(spec: str | Path, out: Path) -> Path:
    result = tfc("render", str(spec), "--to", "slurm", "-o", str(out))
    assert result.returncode == 0, result.stderr
    return out / next(n for n in os.listdir(out) if n.endswith(".sbatch"))


def submit(cluster, script: Path, timeout: float) -> dict:
    job_id = cluster.submit(script, script.parent)
    result = cluster.wait(job_id, timeout)
    result["output"] = cluster.output_of(job_id)
    print(result["output"][-6000:])
    return result


def spec_file(tmp_path: Path, mode: str, script: str, args: list[str], jobs: str, env: str = "") -> Path:
    (tmp_path / "task.py").write_text(script)
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"""name: stub
hosts: [{{name: local, address: localhost}}]
{env}jobs:
{jobs}
train:
  mode: {mode}
  script: task.py
  args: {args!r}
""")
    return spec


@pytest.mark.tf
def test_the_embedded_default_trains_to_its_exact_step_on_slurm(cluster, tmp_path):
    script = render(LOCAL, tmp_path)
    result = submit(cluster, script, timeout=240)
    out = result["output"]
    assert (result["state"], result["exit_code"]) == ("COMPLETED", "0:0"), out[-3000:]
    for worker in ("worker:0", "worker:1"):
        assert f"{worker} │ tfcluster-result: global_step=300 " in out
        assert f"{worker} │ tfcluster: exited with code 0" in out
    assert re.search(r"^worker:\d │ step=\d+ loss=", out, re.M)        # live lines, prefixed
    assert "ps:0     │ tfcluster: every worker is done; stopping" in out
    assert "ps:0     │ tfcluster: exited with code 0" in out
    # TF_CONFIG came from the node's address and the ports step 1 found, not the spec's 22220
    assert re.search(r"ps:0     │ tfcluster: server ps:0 listening on 127\.0\.0\.1:\d+", out)
    assert "22220" not in out


def test_ps_stop_when_the_workers_are_done_and_a_failing_worker_fails_the_job(cluster, tmp_path):
    jobs = "  ps: {count: 1, hosts: [local], port: 22220}\n  worker: {count: 2, hosts: [local], port: 22230}"
    ok = submit(cluster, render(spec_file(tmp_path, "classic", CLASSIC, ["0"], jobs), tmp_path / "ok"), 60)
    assert (ok["state"], ok["exit_code"]) == ("COMPLETED", "0:0"), ok["output"]
    assert "ps:0     │ tfcluster: every worker is done; stopping" in ok["output"]

    bad = submit(cluster, render(spec_file(tmp_path, "classic", CLASSIC, ["3"], jobs), tmp_path / "bad"), 60)
    assert bad["state"] == "FAILED", bad["output"]
    assert "worker:1 │ tfcluster: exited with code 3" in bad["output"]
    assert "Exited with exit code 3" in bad["output"]          # srun's own word on the task


def test_a_server_that_fails_to_start_is_named_by_its_task_with_its_exit_code(cluster, tmp_path):
    """A node's Python without TensorFlow: each task's TF server exits before listening; the
    line says whose it is (it came unprefixed) and the task's code follows, as any task's."""
    spec = tmp_path / "notf.yaml"
    spec.write_text("name: notf\npython: /usr/bin/python3\nhosts: [{name: local, address: localhost}]\n"
                    "jobs:\n  ps: {count: 1, hosts: [local], port: 22220}\n"
                    "  worker: {count: 1, hosts: [local], port: 22230}\n"
                    "train: {mode: between-graph, script: template:between_graph}\n")
    env = dict(cluster.env)
    cluster.env.pop("TFCLUSTER_PYTHON", None)
    try:
        result = submit(cluster, render(spec, tmp_path / "s"), 60)
    finally:
        cluster.env.clear()
        cluster.env.update(env)
    out = result["output"]
    assert result["state"] == "FAILED", out[-3000:]
    # the first to fail ends the job (--kill-on-bad-exit): the other may be stopped before its word
    said = [task for task in ("ps:0     │ ", "worker:0 │ ")
            if re.search(rf"^{re.escape(task)}tfcluster: its TF server exited with code \d+ before listening$",
                         out, re.M) and f"{task}tfcluster: exited with code 2" in out]
    assert said, out[-3000:]
    assert not re.search(r"^tfcluster: ", out, re.M), out[-3000:]


def test_two_jobs_on_one_node_take_different_ports(cluster, tmp_path):
    release = tmp_path / "release"
    jobs = "  worker: {count: 2, hosts: [local], port: 22230}"
    ids = [cluster.submit(render(spec_file(tmp_path, "mirrored", HOLD, [str(release)], jobs),
                                 tmp_path / name), tmp_path / name) for name in ("a", "b")]

    def bound() -> list[str]:
        found = []
        for job_id in ids:
            path = Path(cluster.job(job_id).get("StdOut", "/nonexistent"))
            found += re.findall(r"│ bound (\S+)", path.read_text()) if path.exists() else []
        return found

    addresses = wait_for(lambda: len(bound()) == 4 and bound(), 60, interval=0.2,
                         what="both jobs' tasks holding their ports at once")
    release.write_text("")
    results = [cluster.wait(job_id, 60) for job_id in ids]
    assert [(r["state"], r["exit_code"]) for r in results] == [("COMPLETED", "0:0")] * 2
    assert len(set(addresses)) == 4, addresses
    assert not any(a.endswith((":22230", ":22231")) for a in addresses)


def test_a_checkpoint_request_to_the_batch_shell_reaches_the_tasks_and_the_job_goes_on(cluster, tmp_path):
    """`scancel --batch --signal=USR1` (or a site's `--signal=B:USR1@...`): the batch shell,
    whose default for SIGUSR1 is to die (and the job with it, FAILED), passes it on."""
    release = tmp_path / "release"
    jobs = "  worker: {count: 2, hosts: [local], port: 22230}"
    script = render(spec_file(tmp_path, "mirrored", ASKED, [str(release)], jobs), tmp_path / "s")
    job_id = cluster.submit(script, script.parent)

    def said(words: str) -> int:
        path = Path(cluster.job(job_id).get("StdOut", "/nonexistent"))
        return path.read_text().count(f"│ {words}") if path.exists() else 0

    wait_for(lambda: said("started") == 2, 60, interval=0.2, what="both tasks started")
    cluster.run("scancel", "--batch", "--signal=USR1", job_id)
    wait_for(lambda: said("checkpoint request") == 2, 30, interval=0.2, what="the request at both tasks")
    release.write_text("")
    result = cluster.wait(job_id, 60)
    out = cluster.output_of(job_id)
    assert (result["state"], result["exit_code"]) == ("COMPLETED", "0:0"), out[-3000:]
    assert out.count("tfcluster: exited with code 0") == 2, out[-3000:]


def test_a_missing_secret_stops_the_job_before_any_task(cluster, tmp_path):
    jobs = "  worker: {count: 1, hosts: [local], port: 22230}"
    spec = spec_file(tmp_path, "mirrored", HOLD, ["/nonexistent"], jobs,
                     env="env: {HUB_TOKEN: hunter22}\n")
    script = render(spec, tmp_path / "s")
    assert "hunter22" not in script.read_text()
    cluster.env.pop("HUB_TOKEN", None)
    result = submit(cluster, script, 60)
    assert result["state"] == "FAILED"
    assert "HUB_TOKEN: set HUB_TOKEN in the environment you run sbatch from" in result["output"]
    assert "bound" not in result["output"]


@pytest.mark.tf
def test_keras_jax_processes_meet_at_the_coordinator_the_job_surveyed_and_end_with_one_model(cluster, tmp_path):
    spec = tmp_path / "kj.yaml"
    spec.write_text(f"""name: kjslurm
python: {jax_python()}
hosts: [{{name: local, address: localhost}}]
jobs:
  worker: {{count: 2, hosts: [local], port: 22240}}
train:
  mode: keras-jax
  script: template:keras_jax
  args: ["--epochs", "2", "--examples", "512"]
""")
    result = submit(cluster, render(spec, tmp_path / "out"), timeout=240)
    out = result["output"]
    assert (result["state"], result["exit_code"]) == ("COMPLETED", "0:0"), out[-4000:]
    for me in (0, 1):     # one JAX runtime across both processes, not two alone
        assert re.search(rf"^worker:{me} │ process {me} of 2: 1 local device\(s\), 2 in all", out, re.M), out[-3000:]
    by_process = {p: d for d, p in re.findall(r"weights sha256=([0-9a-f]{16}) process=(\d)", out)}
    assert set(by_process) == {"0", "1"} and len(set(by_process.values())) == 1, by_process
    for worker in ("worker:0", "worker:1"):
        assert f"{worker} │ tfcluster: exited with code 0" in out
    assert "22240" not in out        # the coordinator is on the port step 1 found, not the spec's
