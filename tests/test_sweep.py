"""An attached shim's last word: it says on stderr that its own sweep left nothing of its
task's tag, which lets `train` skip the run's stop sweep (docs/ARCHITECTURE.md, "The remote
process model"). Through the local transport: real shims, real processes."""
from __future__ import annotations

import json
import os
import signal
import sys
import textwrap

import pytest

from tests.helpers import PATHS, STUBBORN, C, gone, launch, read_all, wait_for, with_tag
from tfcluster.host.shim_protocol import RESTART_VAR

# Leaves a TERM-ignoring grandchild in a session of its own, then exits 0.
LEAVES_A_CHILD = textwrap.dedent("""
    import subprocess, sys
    child = subprocess.Popen(["setsid", sys.executable, "-c",
                              "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                              "print('ready', flush=True); time.sleep(600)"], stdout=subprocess.PIPE)
    child.stdout.readline()
    print('child', child.pid, flush=True)
""")


def start_stubborn(agent, run: str):
    """A TERM-ignoring task with a grandchild, both running under run `run`'s tag."""
    task = agent.start_attached(launch(agent, f"{C}:{run}:worker:0", [sys.executable, "-c", STUBBORN]),
                                grace=0.5)
    wait_for(lambda: len(with_tag(f"{C}:{run}:")) == 2, 10, what="task and grandchild")
    return task


@pytest.mark.timeout(30)
def test_a_task_that_exits_is_swept_by_its_shim_which_says_so(agent):
    task = agent.start_attached(launch(agent, f"{C}:s1:worker:0", [sys.executable, "-c", LEAVES_A_CHILD]))

    out = read_all(task)

    assert task.wait(10) == 0
    child = int(out.split()[-1])
    assert gone(child)                      # the shim's own sweep, not a later one
    assert with_tag(f"{C}:s1:") == {}
    assert task.swept()


@pytest.mark.timeout(30)
def test_a_stopped_task_is_swept_by_its_shim_which_says_so(agent):
    task = start_stubborn(agent, "s2")
    assert not task.swept()                 # still running

    task.stop()
    read_all(task)

    assert task.wait(15) == 128 + signal.SIGKILL
    assert with_tag(f"{C}:s2:") == {}
    assert task.swept()


@pytest.mark.timeout(30)
def test_a_shim_whose_launcher_left_says_nothing(agent):
    task = start_stubborn(agent, "s3")

    task.detach_kill()                      # as a dropped connection: the shim stops its task

    wait_for(lambda: with_tag(f"{C}:s3:") == {}, 20, what="the shim's sweep")
    wait_for(lambda: task.wait(0) is not None, 10, what="the shim's exit")
    assert not task.swept()                 # nobody listened: the run's stop sweep runs


@pytest.mark.timeout(40)
def test_an_old_shims_stop_spares_the_attempt_a_new_shim_started_under_the_same_tag(agent):
    """A restart over a new connection (the old one dropped) runs under the task's tag while
    the old connection's shim is still stopping its attempt: that stop takes what it started
    and nothing of the new attempt, and leaves the new attempt's pid file in place."""
    tag = f"{C}:s4:worker:0"
    old = start_stubborn(agent, "s4")       # ignores TERM: its shim waits the grace, then KILLs by tag
    old_pids = set(with_tag(f"{C}:s4:"))
    new = agent.start_attached(launch(agent, tag, [sys.executable, "-c", "import time; time.sleep(600)"],
                                      env={RESTART_VAR: "1"}))
    wait_for(lambda: len(with_tag(f"{C}:s4:")) == 3, 10, what="the new attempt")
    new_pids = set(with_tag(f"{C}:s4:")) - old_pids

    old.detach_kill()                       # as a dropped connection: its shim stops its task
    wait_for(lambda: old.wait(0) is not None, 20, what="the old shim's exit")

    assert all(gone(pid) for pid in old_pids)
    assert not any(gone(pid) for pid in new_pids)
    with open(os.path.expanduser(PATHS.pidfile(tag))) as f:
        assert json.load(f)["pid"] in new_pids
    new.stop()
    read_all(new)
    assert new.wait(15) is not None
    assert with_tag(f"{C}:s4:") == {}
