"""`tfcluster train` over real SSH on three loopback hosts (tests/sshd.py)."""
from __future__ import annotations

import pytest

from tests.conftest import tagged_processes
from tests.train_helpers import manifest, only_run, result_of, ssh_spec, tfcluster

pytestmark = [pytest.mark.tf, pytest.mark.ssh, pytest.mark.timeout(300)]


@pytest.mark.parametrize("mode,args,steps", [
    ("between-graph", '["--steps", "150"]', 150),
    ("classic", '["--job_name={job}", "--task_index={index}", "--ps_hosts={ps_hosts}", '
                '"--worker_hosts={worker_hosts}", "--steps", "120"]', 120),
])
def test_train_over_ssh_on_three_hosts_reaches_exact_step(tmp_path, home, ssh_home, sshd, mode, args, steps):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    template = mode.replace("-", "_")
    spec = ssh_spec(tmp_path, sshd, name=f"ssh{template[:4]}",
                    train=f"train:\n  mode: {mode}\n  script: template:{template}\n  args: {args}\n")
    result = tfcluster("train", str(spec), home=home, cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = only_run(cwd / "runs")
    assert result_of((run / "worker-0.log").read_text())[0] == steps
    tasks = manifest(run)["tasks"]
    assert tasks["worker:1"]["host"] == "h4" and tasks["worker:1"]["script"]["exit_code"] == 0
    if mode == "classic":
        assert tasks["ps:0"]["host"] == "h2"  # the ps ran the script too, and was stopped at the end
    assert not tagged_processes()
