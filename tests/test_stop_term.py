"""A script that outlives SIGTERM: the run's stop waits the grace (train.stop_grace), KILLs it, and says so,
naming the tasks (and, in mirrored mode, TensorFlow's SIGTERM handler as the likely cause).
Real processes on the local host; the script is plain Python that ignores SIGTERM."""
from __future__ import annotations

import pytest

from tests.helpers import tagged_processes, tfcluster
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
