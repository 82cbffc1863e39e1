"""`tfcluster train` over real SSH on three loopback hosts (tests/sshd.py)."""
from __future__ import annotations

import pytest

from tests.helpers import manifest, only_run, result_of, ssh_spec, tagged_processes, tfcluster

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


def test_dropped_ssh_connection_is_survived_under_on_failure(tmp_path, home, ssh_home, sshd):
    """Kill the sshd process carrying h4's connection mid-run: worker:1's server and script
    lose their channels, their shims stop them, and tfcluster restarts both over a new
    connection; the run still ends at the exact step."""
    import os
    import signal

    import psutil

    from tests.helpers import kill_group, read_until, start_tfcluster

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = ssh_spec(tmp_path, sshd, name="drop",
                    train="train:\n  mode: between-graph\n  script: template:between_graph\n"
                          "  args: ['--steps', '600', '--log_every', '20']\n"
                          "  restart: {policy: on-failure, max_restarts: 3}\n")
    proc = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"worker:1 .*step=", timeout=150)
        script = next(p for p, tag in tagged_processes().items() if tag.endswith(":worker:1:script"))
        chain = psutil.Process(script).parents()
        carriers = [p for p in chain if p.name() == "sshd" and p.ppid() != 1 and
                    "-D" not in p.cmdline()]
        assert carriers, [p.cmdline() for p in chain]
        os.kill(carriers[-1].pid, signal.SIGKILL)  # the per-connection sshd: the TCP session dies
        out, _ = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "lost contact with h4" in out
    run = only_run(cwd / "runs")
    assert result_of((run / "worker-0.log").read_text())[0] == 600
    assert not tagged_processes()
