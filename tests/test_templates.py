"""The shipped training templates, on real TensorFlow clusters launched by hand on loopback.

Each cluster's processes start together (TF import costs seconds each); every
process carries TFCLUSTER_JOB_ID and is killed in a finally (HandLaunch.__exit__).
"""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import need_tensorflow, wait_for
from tests.tf_launch import (
    TEMPLATES,
    HandLaunch,
    assert_exit_0,
    assert_trained,
    checkpoint_step,
    RESTORED,
    make_cluster,
    progress,
    restored_step,
    result,
    start_servers,
)

need_tensorflow()


def run_between_graph(launch, cluster, run_id, steps, extra=()):
    procs = [launch.start_script(TEMPLATES / "between_graph.py", cluster, "worker", i, run_id,
                                 [f"--steps={steps}", *extra]) for i in range(2)]
    assert_exit_0(launch, procs, 120)
    return procs


@pytest.mark.tf
@pytest.mark.timeout(150)
def test_between_graph_resumes_from_model_dir_after_everything_restarts(tmp_path):
    steps = 800
    model_dir = tmp_path / "model"
    with HandLaunch(tmp_path / "first", tag="test:handlaunch") as launch:
        cluster = make_cluster(ps=1, worker=2)
        start_servers(launch, cluster)
        procs = [launch.start_script(TEMPLATES / "between_graph.py", cluster, "worker", i, "r1",
                                     [f"--steps={steps}", f"--model_dir={model_dir}"])
                 for i in range(2)]
        # The saver writes model.ckpt-0 as soon as the session exists: wait for a later one.
        wait_for(lambda: checkpoint_step(model_dir) > 0, 90, what="a checkpoint after step 0")
        assert all(p.returncode is None for p in procs), "finished before the kill"
    # Everything (ps included) is dead now; a fresh cluster on the same ports.
    with HandLaunch(tmp_path / "second", tag="test:handlaunch") as launch:
        start_servers(launch, cluster)
        procs = run_between_graph(launch, cluster, "r2", steps, [f"--model_dir={model_dir}"])
        for proc in procs:
            assert result(proc.output())[0] == steps
        first_step = progress(procs[0].output())[0][0]
        assert first_step > steps // 10, f"did not resume: first step {first_step}"
        assert 0 < restored_step(procs[0].output(), model_dir) < first_step


@pytest.mark.tf
@pytest.mark.timeout(120)
def test_classic_builds_its_own_servers_and_ends_at_exact_step(tmp_path):
    """Also: --min_step_time paces each worker's steps (this toy model's take about 1 ms)."""
    steps, pace = 200, 0.05
    with HandLaunch(tmp_path, tag="test:handlaunch") as launch:
        cluster = make_cluster(ps=1, worker=2)

        def flags(job, i):
            return [f"--job_name={job}", f"--task_index={i}", "--ps_hosts=" + ",".join(cluster["ps"]),
                    "--worker_hosts=" + ",".join(cluster["worker"]), f"--steps={steps}"]

        ps = launch.start_script(TEMPLATES / "classic.py", cluster, "ps", 0, "c", flags("ps", 0))
        workers = [launch.start_script(TEMPLATES / "classic.py", cluster, "worker", 0, "c",
                                       flags("worker", 0) + [f"--min_step_time={pace}"]),
                   # worker 1 learns its place from TF_CONFIG alone
                   launch.start_script(TEMPLATES / "classic.py", cluster, "worker", 1, "c",
                                       [f"--steps={steps}", f"--min_step_time={pace}"])]
        wait_for(lambda: "step=" in workers[0].output() or workers[0].returncode is not None, 90,
                 interval=0.01, what="worker 0's first step")
        first = time.monotonic()
        assert_exit_0(launch, workers, 120)
        took = time.monotonic() - first
        assert ps.returncode is None, "the ps must serve until it is stopped"
        assert_trained([p.output() for p in workers], steps)
        local = int(re.search(r"local_steps=(\d+)", workers[0].output()).group(1))
        # its first step was seen, at most 0.01 s late; each of the others took at least `pace`
        assert took >= (local - 1) * pace - 0.01, (took, local)


@pytest.mark.tf
@pytest.mark.timeout(120)
def test_coordinator_finishes_when_a_worker_is_killed_mid_run(tmp_path):
    steps = 600
    with HandLaunch(tmp_path, tag="test:handlaunch") as launch:
        cluster = make_cluster(ps=1, worker=2, chief=1)
        start_servers(launch, cluster)
        chief = launch.start_script(TEMPLATES / "coordinator.py", cluster, "chief", 0, "k",
                                    [f"--steps={steps}", "--log_every=20"])
        wait_for(lambda: len(progress(chief.output())) >= 3 or chief.returncode is not None,
                 90, what="the coordinator training")
        assert chief.returncode is None, "finished before the kill"
        launch.kill(next(p for p in launch.procs if p.name == "server-worker1"))
        assert_exit_0(launch, [chief], 100)
        assert_trained([chief.output()])
        # A step that was running on the dead worker is re-run elsewhere; if the dead
        # worker had already applied it, it counts twice, so only a lower bound holds.
        assert result(chief.output())[0] >= steps


@pytest.mark.tf
@pytest.mark.timeout(90)
def test_every_template_rejects_an_unknown_flag_with_exit_2(tmp_path):
    with HandLaunch(tmp_path, tag="test:handlaunch") as launch:
        cluster = make_cluster(ps=1, worker=1)
        names = ["between_graph", "classic", "coordinator", "mirrored"]
        procs = [launch.start_script(TEMPLATES / f"{n}.py", cluster, "worker", 0, n, ["--bogus=1"])
                 for n in names]
        for proc, rc in zip(procs, launch.wait_all(procs, 80)):
            assert rc == 2, f"{proc.name} exited {rc}:\n{proc.output()[-2000:]}"
            assert "unrecognized arguments: --bogus" in proc.output()


@pytest.mark.tf
@pytest.mark.timeout(150)
def test_mirrored_ends_on_sigterm_though_its_strategy_catches_it(tmp_path):
    """MultiWorkerMirroredStrategy, built with a cluster, installs its own SIGTERM handler (a
    preemption notice) and trains on; a run's stop is SIGTERM, so without the template's
    handler each worker ran the whole grace until SIGKILL."""
    with HandLaunch(tmp_path, tag="test:handlaunch") as launch:
        cluster = make_cluster(ps=0, worker=2)
        procs = [launch.start_script(TEMPLATES / "mirrored.py", cluster, "worker", i, "m",
                                     ["--steps=10000000", "--log_every=20"]) for i in range(2)]
        wait_for(lambda: all(len(progress(p.output())) >= 2 for p in procs)
                 or any(p.returncode is not None for p in procs), 100, what="both workers training")
        assert all(p.returncode is None for p in procs), [p.output()[-2000:] for p in procs]
        for p in procs:
            os.kill(p.popen.pid, signal.SIGTERM)
        codes = launch.wait_all(procs, 30)      # without the handler: still training, no exit
        assert all(code != 0 for code in codes), codes


# A SIGTERM mid-training (a run's stop, a drain, a move to a spare) saves where the run
# was, exits 128+15, and a second run on the same --model_dir says where it resumed.
SAVED = re.compile(r"^saved (\S+) at step=(\d+)$", re.MULTILINE)
STOPPED = 128 + 15


def saved_step(output: str) -> int:
    found = SAVED.findall(output)
    assert found, f"no 'saved ... at step=N' line in:\n{output[-3000:]}"
    return int(found[-1][1])


def sigterm_mid_training(launch: HandLaunch, procs, signalled) -> int:
    """Wait until every one of `procs` printed progress past its first step, SIGTERM
    `signalled`, wait for all of `procs` to exit 128+15; the highest step any printed."""
    wait_for(lambda: all(len(progress(p.output())) >= 3 for p in procs)
             or any(p.returncode is not None for p in procs), 60, what="training under way")
    assert all(p.returncode is None for p in procs), [p.output()[-2000:] for p in procs]
    for p in signalled:
        os.kill(p.popen.pid, signal.SIGTERM)
    for proc, rc in zip(procs, launch.wait_all(procs, 20)):
        assert rc == STOPPED, f"{proc.name} exited {rc}:\n{proc.output()[-3000:]}"
    return max(step for p in procs for step, _ in progress(p.output()))


def assert_resumed(proc, model_dir: Path, at: int, steps: int) -> None:
    out = proc.output()
    assert restored_step(out, model_dir) == at
    first = progress(out)[0][0]
    assert at < first <= at + 5, f"first step {first} after a restore at {at}"
    assert result(out)[0] == steps


@pytest.mark.tf
@pytest.mark.timeout(90)
@pytest.mark.parametrize("template", ["between_graph", "classic"])
def test_monitored_session_template_saves_on_sigterm_and_resumes(tmp_path, template):
    """The chief's MonitoredTrainingSession closes normally on SIGTERM: its saver writes the
    step reached (run 1 checkpoints every 10,000 steps, so no periodic one is taken), and a new
    run on the same ps restores it into its own container."""
    model_dir = tmp_path / "model"
    with HandLaunch(tmp_path, tag="test:handlaunch") as launch:
        cluster = make_cluster(ps=1, worker=1)
        script = TEMPLATES / f"{template}.py"
        if template == "classic":
            launch.start_script(script, cluster, "ps", 0, "servers")
        else:
            start_servers(launch, cluster)

        def worker(run_id, steps):
            return launch.start_script(script, cluster, "worker", 0, run_id,
                                       [f"--steps={steps}", f"--model_dir={model_dir}", "--log_every=20"])

        first = worker("r1", 100_000)
        reached = sigterm_mid_training(launch, [first], [first])
        at = saved_step(first.output())
        assert reached <= at < reached + 20, f"saved at {at}, printed up to {reached}"
        assert checkpoint_step(model_dir) == at
        second = worker("r2", at + 40)
        assert_exit_0(launch, [second], 60)
        assert_resumed(second, model_dir, at, at + 40)


@pytest.mark.tf
@pytest.mark.timeout(90)
def test_coordinator_saves_on_sigterm_and_resumes(tmp_path):
    """The coordinator lets what it scheduled finish, saves at the step reached, exits
    128+15; a new coordinator on the same servers restores it."""
    model_dir = tmp_path / "model"
    with HandLaunch(tmp_path, tag="test:handlaunch") as launch:
        cluster = make_cluster(ps=1, worker=1, chief=1)
        start_servers(launch, cluster)

        def chief(run_id, steps):
            return launch.start_script(TEMPLATES / "coordinator.py", cluster, "chief", 0, run_id,
                                       [f"--steps={steps}", f"--model_dir={model_dir}", "--log_every=20"])

        first = chief("r1", 100_000)
        reached = sigterm_mid_training(launch, [first], [first])
        at = saved_step(first.output())
        assert reached <= at, f"saved at {at}, printed up to {reached}"
        second = chief("r2", at + 40)
        assert_exit_0(launch, [second], 60)
        assert restored_step(second.output(), model_dir) == at
        assert result(second.output())[0] == at + 40      # no worker failed: no step re-run


@pytest.mark.tf
@pytest.mark.timeout(120)
def test_mirrored_workers_save_together_when_one_is_sigtermed_and_resume(tmp_path):
    """A SIGTERM to worker 1 alone stops both workers after the same step (the all-reduce
    carries it), both save that step, and a new cluster resumes it although only the chief
    restores (worker 1 gets the chief's values by all-reduce, as on a host without the
    checkpoint)."""
    model_dir = tmp_path / "model"
    with HandLaunch(tmp_path, tag="test:handlaunch") as launch:
        def workers(run_id, steps):
            cluster = make_cluster(ps=0, worker=2)
            return [launch.start_script(TEMPLATES / "mirrored.py", cluster, "worker", i, run_id,
                                        [f"--steps={steps}", f"--model_dir={model_dir}", "--log_every=20"])
                    for i in range(2)]

        first = workers("r1", 100_000)
        reached = sigterm_mid_training(launch, first, [first[1]])
        at = saved_step(first[0].output())
        assert reached <= at < reached + 20, f"saved at {at}, printed up to {reached}"
        assert not (model_dir / ".tmp-worker-1").exists()
        second = workers("r2", at + 40)
        assert_exit_0(launch, second, 60)
        assert_resumed(second[0], model_dir, at, at + 40)
        assert result(second[1].output())[0] == at + 40
        assert not RESTORED.search(second[1].output()), "only the chief restores"


@pytest.mark.tf
@pytest.mark.timeout(60)
def test_a_template_stuck_inside_tensorflow_ends_itself_after_sigterm(tmp_path):
    """The ps gone, the chief waits inside TensorFlow for a new session and never gets back
    to its loop: the SIGTERM it got ends it 4 s later, exit 128+15, before the launcher's
    KILL (5 s), saying so."""
    with HandLaunch(tmp_path, tag="test:handlaunch") as launch:
        cluster = make_cluster(ps=1, worker=1)
        start_servers(launch, cluster)
        chief = launch.start_script(TEMPLATES / "between_graph.py", cluster, "worker", 0, "s",
                                    ["--steps=100000", f"--model_dir={tmp_path / 'model'}", "--log_every=20"])
        wait_for(lambda: len(progress(chief.output())) >= 2 or chief.returncode is not None, 60,
                 what="training under way")
        launch.kill(next(p for p in launch.procs if p.name == "server-ps0"))
        os.kill(chief.popen.pid, signal.SIGTERM)
        signalled = time.monotonic()
        assert launch.wait(chief, 15) == STOPPED, chief.output()[-3000:]
        assert 3.5 < time.monotonic() - signalled < 8, "ended by its own deadline"
        assert "still inside TensorFlow 4s later, leaving without saving" in chief.output()


@pytest.mark.tf
@pytest.mark.timeout(120)
def test_a_sigterm_during_the_paces_wait_stops_and_saves_at_once(tmp_path):
    """--min_step_time 60: after its first step the chief waits out its pace; a SIGTERM
    then ends that wait, and the loop stops and saves as after any step, long before the
    pace would have let it. Not by the 4 s stop deadline either: that path says so and
    leaves without saving (judged by its words and the checkpoint, not by a few seconds of
    a loaded machine's clock)."""
    with HandLaunch(tmp_path, tag="test:handlaunch") as launch:
        cluster = make_cluster(ps=1, worker=1)
        start_servers(launch, cluster)
        chief = launch.start_script(TEMPLATES / "between_graph.py", cluster, "worker", 0, "p",
                                    ["--steps=100000", f"--model_dir={tmp_path / 'model'}", "--min_step_time=60"])
        wait_for(lambda: progress(chief.output()) or chief.returncode is not None, 60, what="the first step")
        os.kill(chief.popen.pid, signal.SIGTERM)
        signalled = time.monotonic()
        assert launch.wait(chief, 15) == STOPPED, chief.output()[-3000:]
        assert time.monotonic() - signalled < 30, "ended by the pace, not by the SIGTERM"
        assert "still inside TensorFlow" not in chief.output()
        assert "worker:0 stopped by SIGTERM" in chief.output() and checkpoint_step(tmp_path / "model") >= 1
