"""The script contract's checkpoint request: SIGUSR1 to a template saves a checkpoint within
a bound and training goes on; the request's checkpoint is what a run that then loses the
host resumes from. One real TensorFlow cluster per mode family, launched by hand on
loopback (tests/tf_launch.py): MonitoredTrainingSession (between_graph; classic shares its
hook), ParameterServerStrategy's coordinator, MultiWorkerMirroredStrategy."""
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
    make_cluster,
    progress,
    restored_step,
    result,
    start_servers,
)

need_tensorflow()

pytestmark = pytest.mark.tf

ASKED = re.compile(r"^saved (\S+) at step=(\d+) \(checkpoint request\)$", re.MULTILINE)
# From the signal to the checkpoint on disk: the step under way, then one save (loaded
# 2-core machine: well under a second; the bound leaves room for a slow step).
BOUND = 10.0


def request_and_wait(launch: HandLaunch, procs, signalled, chief) -> tuple[str, int, float]:
    """Once every one of `procs` is training, SIGUSR1 to `signalled`; the checkpoint the chief
    says it saved for the request, its step and how long it took. Everyone still runs."""
    wait_for(lambda: all(len(progress(p.output())) >= 3 for p in procs)
             or any(p.returncode is not None for p in procs), 90, what="training under way")
    assert all(p.returncode is None for p in procs), [p.output()[-2000:] for p in procs]
    asked = time.monotonic()
    os.kill(signalled.popen.pid, signal.SIGUSR1)
    wait_for(lambda: ASKED.search(chief.output()) or chief.returncode is not None, BOUND,
             interval=0.05, what="the requested checkpoint")
    took = time.monotonic() - asked
    path, step = ASKED.search(chief.output()).groups()
    assert all(p.returncode is None for p in procs), "a checkpoint request must not end a task"
    return path, int(step), took


def assert_on_disk(path: str) -> None:
    assert Path(path + ".index").exists(), f"{path}.index not written"
    state = (Path(path).parent / "checkpoint").read_text()
    assert f'model_checkpoint_path: "{Path(path).name}"' in state or path in state, state


@pytest.mark.timeout(120)
def test_between_graph_saves_on_the_request_and_a_lost_chief_resumes_from_it(tmp_path):
    model_dir = tmp_path / "model"
    with HandLaunch(tmp_path, tag="test:handlaunch") as launch:
        cluster = make_cluster(ps=1, worker=1)
        start_servers(launch, cluster)

        def chief(run_id, steps):
            # --steps far ahead: the periodic save is every steps/10, never reached here
            return launch.start_script(TEMPLATES / "between_graph.py", cluster, "worker", 0, run_id,
                                       [f"--steps={steps}", f"--model_dir={model_dir}", "--log_every=20"])

        first = chief("r1", 1_000_000)
        path, at, took = request_and_wait(launch, [first], first, first)
        assert took < BOUND and at > 0
        assert_on_disk(path)
        wait_for(lambda: max(s for s, _ in progress(first.output())) > at, 30, what="training past the save")
        launch.kill(first)                      # its host goes: no save on the way out
        second = chief("r2", at + 40)
        assert_exit_0(launch, [second], 60)
        assert restored_step(second.output(), model_dir) == at
        assert result(second.output())[0] == at + 40


@pytest.mark.timeout(120)
def test_coordinator_saves_on_the_request_and_trains_on(tmp_path):
    model_dir = tmp_path / "model"
    with HandLaunch(tmp_path, tag="test:handlaunch") as launch:
        cluster = make_cluster(ps=1, worker=1, chief=1)
        start_servers(launch, cluster)
        first = launch.start_script(TEMPLATES / "coordinator.py", cluster, "chief", 0, "r1",
                                    ["--steps=1000000", f"--model_dir={model_dir}", "--log_every=20"])
        path, at, took = request_and_wait(launch, [first], first, first)
        assert took < BOUND and at > 0
        assert_on_disk(path)
        wait_for(lambda: max(s for s, _ in progress(first.output())) > at, 30, what="training past the save")
        launch.kill(first)
        second = launch.start_script(TEMPLATES / "coordinator.py", cluster, "chief", 0, "r2",
                                     [f"--steps={at + 40}", f"--model_dir={model_dir}", "--log_every=20"])
        assert_exit_0(launch, [second], 60)
        assert restored_step(second.output(), model_dir) == at


@pytest.mark.timeout(150)
def test_mirrored_workers_save_together_on_a_request_to_one_of_them(tmp_path):
    """A request to worker 1 alone: the all-reduce carries it, both save the same step
    (saving is collective), the chief's copy is the checkpoint, and both train on."""
    model_dir = tmp_path / "model"
    with HandLaunch(tmp_path, tag="test:handlaunch") as launch:
        cluster = make_cluster(ps=0, worker=2)
        workers = [launch.start_script(TEMPLATES / "mirrored.py", cluster, "worker", i, "r1",
                                       ["--steps=1000000", f"--model_dir={model_dir}", "--log_every=20"])
                   for i in range(2)]
        path, at, took = request_and_wait(launch, workers, workers[1], workers[0])
        assert took < BOUND and at > 0
        assert Path(path).parent == model_dir
        assert_on_disk(path)
        wait_for(lambda: all(max(s for s, _ in progress(w.output())) > at for w in workers), 30,
                 what="both training past the save")
        for w in workers:
            os.kill(w.popen.pid, signal.SIGTERM)
        for w, rc in zip(workers, launch.wait_all(workers, 30)):
            assert rc == 128 + 15, w.output()[-2000:]
