"""A script that outlives SIGTERM: the run's stop waits the grace (train.stop_grace), KILLs it, and says so,
naming the tasks (and, in mirrored mode, TensorFlow's SIGTERM handler as the likely cause).
Real processes on the local host; the script is plain Python that ignores SIGTERM."""
from __future__ import annotations

import os
import re
import signal

import pytest

from tests.helpers import read_until, start_tfcluster, tagged_processes, tfcluster, wait_for
from tests.tf_launch import free_ports

pytestmark = pytest.mark.timeout(90)

# The handler writes with os.write: a print there, landing while the loop's print holds
# stdout's buffer, raises RuntimeError (reentrant call) in the loop, and the script dies of it.
STUBBORN = """import os, signal, time
signal.signal(signal.SIGTERM, lambda *a: os.write(1, b"TERM ignored\\n"))
i = 0
while True:
    i += 1
    print(f"step={i} loss=0.5", flush=True)
    time.sleep(0.1)
"""


def test_scripts_that_outlive_sigterm_are_killed_and_named(tmp_path, home):
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    p = free_ports(2)
    spec = tmp_path / "stub.yaml"
    spec.write_text("name: stub\nhosts:\n  - {name: a, address: 127.0.0.1}\n"
                    f"jobs:\n  worker: {{tasks: ['a:{p[0]}', 'a:{p[1]}']}}\n"
                    "train:\n  mode: mirrored\n  script: stubborn.py\n  timeout: 2s\n  stop_grace: 2s\n")
    result = tfcluster("train", str(spec), home=home, cwd=tmp_path)
    assert result.returncode == 6, result.stderr
    assert ("warning: worker:0, worker:1 still ran 2s after SIGTERM, so they were killed; TensorFlow's "
            "MultiWorkerMirroredStrategy takes SIGTERM as a preemption notice") in result.stderr, result.stderr
    assert "TERM ignored" in result.stdout
    assert not tagged_processes()


def test_a_second_command_refused_by_a_running_train_is_told_a_stop_that_works(tmp_path, home):
    """`down` while `train` holds the cluster's lock: refused (exit 7), and its hint names the
    holder's pid; the `kill PID` it suggests stops that train as a Ctrl-C would (exit 143,
    nothing of it left). The hint once said `tfcluster down`, which the lock refuses the same way."""
    (tmp_path / "steady.py").write_text("import time\nprint('step=1 loss=0.5', flush=True)\ntime.sleep(600)\n")
    p = free_ports(1)
    spec = tmp_path / "busy.yaml"
    spec.write_text("name: busy\nhosts:\n  - {name: a, address: 127.0.0.1}\n"
                    f"jobs:\n  worker: {{tasks: ['a:{p[0]}']}}\ntrain:\n  mode: mirrored\n  script: steady.py\n")
    proc = start_tfcluster("train", str(spec), home=home, cwd=tmp_path)
    try:
        read_until(proc, r"worker:0 .*step=1", timeout=60)
        refused = tfcluster("down", str(spec), home=home, cwd=tmp_path)
        assert refused.returncode == 7, refused.stderr
        hint = refused.stderr.strip().splitlines()[-1]
        assert hint == (f"hint: wait for it to finish, or stop it: Ctrl-C in its terminal, or `kill {proc.pid}` "
                        "(SIGTERM: it stops everything it started, as on Ctrl-C)"), refused.stderr
        os.kill(int(re.search(r"`kill (\d+)`", hint).group(1)), signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143
    wait_for(lambda: not tagged_processes(), timeout=20, what="nothing of the train left")
