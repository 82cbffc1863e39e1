"""What a one-node Slurm really does with the batch scripts `render --to slurm` writes (tests/slurm.py):
4 tasks on one node with two srun steps in sequence, per-task environment, exit codes of
failed tasks, where output lands. Each test leaves no job or job process behind.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]

HEADER = """#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --nodes=1 --ntasks-per-node=4
#SBATCH --output=%x-%j.out
"""
# One line per task; run with `python3 -c '...'` (no single quote inside).
WHO = ('import os, socket; e = os.environ; '
       'print("rank=%s node=%s local=%s host=%s" % (e["SLURM_PROCID"], e["SLURM_NODEID"], '
       'e["SLURM_LOCALID"], socket.gethostname()))')
ECHO_BACK = ('import json, os; e = os.environ; '
             'print("step2 " + json.dumps({k: e.get(k) for k in ("STEP1_OUT", "SLURM_PROCID", '
             '"SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_ID")}, sort_keys=True))')
DUMP_ENV = ('import json, os; e = os.environ; '
            'open("env-%s.json" % e["SLURM_PROCID"], "w").write(json.dumps(dict(e)))')


@pytest.fixture
def cluster(slurm_cluster):
    """The session's cluster; after the test, no job is left and no job process survives."""
    yield slurm_cluster
    left = slurm_cluster.jobs_not_over()
    slurm_cluster.cancel_all()
    slurm_cluster.wait_no_job_processes()
    assert not left, f"jobs still queued or running after the test: {left}"


def batch(tmp_path: Path, name: str, body: str) -> Path:
    script = tmp_path / f"{name}.sh"
    script.write_text(HEADER.format(name=name) + body)
    return script


def run_job(cluster, tmp_path, name, body, timeout=60):
    started = time.monotonic()
    job_id = cluster.submit(batch(tmp_path, name, body), tmp_path)
    result = cluster.wait(job_id, timeout)
    result["id"], result["seconds"] = job_id, round(time.monotonic() - started, 2)
    result["output"] = cluster.output_of(job_id)
    print(f"job {name} ({job_id}): {result['state']} {result['exit_code']} in {result['seconds']}s\n"
          f"{result['output']}")
    return result


def test_four_tasks_two_steps_and_the_env_passed_between_them(cluster, tmp_path):
    body = f"""set -euo pipefail
echo "hostnames=$(scontrol show hostnames "$SLURM_JOB_NODELIST")"
echo "batch: procid=$SLURM_PROCID ntasks=$SLURM_NTASKS cpus_on_node=$SLURM_CPUS_ON_NODE"
STEP1=$(srun python3 -c '{WHO}')
printf '%s\\n' "$STEP1" | sed 's/^/step1 /'
export STEP1_OUT="$(printf '%s\\n' "$STEP1" | sort | paste -sd ';')"
srun python3 -c '{ECHO_BACK}'
"""
    result = run_job(cluster, tmp_path, "twosteps", body)
    assert (result["state"], result["exit_code"]) == ("COMPLETED", "0:0")
    out = result["output"]
    # stdout and stderr of the batch script and of every step land in one file, named by
    # --output relative to the directory sbatch ran in
    assert result["job"]["StdOut"] == result["job"]["StdErr"] == str(tmp_path / f"twosteps-{result['id']}.out")
    lines = out.splitlines()
    assert f"hostnames={cluster.node}" in lines
    assert "batch: procid=0 ntasks=4 cpus_on_node=4" in lines

    step1 = sorted(line[len("step1 "):] for line in lines if line.startswith("step1 "))
    expected = [f"rank={r} node=0 local={r} host={cluster.node}" for r in range(4)]
    assert step1 == expected        # no "0: " prefixes: srun --label is off by default

    step2 = sorted((json.loads(line[len("step2 "):]) for line in lines if line.startswith("step2 ")),
                   key=lambda t: int(t["SLURM_PROCID"]))
    assert [t["SLURM_PROCID"] for t in step2] == ["0", "1", "2", "3"]
    assert [t["SLURM_LOCALID"] for t in step2] == ["0", "1", "2", "3"]
    assert {t["SLURM_NODEID"] for t in step2} == {"0"}
    assert {t["SLURM_STEP_ID"] for t in step2} == {"1"}     # the second srun is step 1
    assert {t["STEP1_OUT"] for t in step2} == {";".join(expected)}


def test_the_highest_task_exit_code_fails_the_job(cluster, tmp_path):
    exits = ('import os, sys; r = int(os.environ["SLURM_PROCID"]); print("rank", r, flush=True); '
             'sys.exit({1: 3}.get(r, 0))')
    result = run_job(cluster, tmp_path, "exit3", f"srun python3 -c '{exits}'\n")
    # the batch script ends with srun, whose status is the highest of its tasks'
    assert (result["state"], result["exit_code"]) == ("FAILED", "3:0")
    assert "srun: error: {}: task 1: Exited with exit code 3".format(cluster.node) in result["output"]
    # the other tasks ran to their end (no --kill-on-bad-exit)
    assert sorted(l for l in result["output"].splitlines() if l.startswith("rank ")) == \
        ["rank 0", "rank 1", "rank 2", "rank 3"]

    two = 'import os, sys; sys.exit({1: 5, 2: 3}.get(int(os.environ["SLURM_PROCID"]), 0))'
    result = run_job(cluster, tmp_path, "exit53", f"srun python3 -c '{two}'\n")
    assert (result["state"], result["exit_code"]) == ("FAILED", "5:0")   # max, not first

    # a failed step whose status the script drops: the job COMPLETED
    result = run_job(cluster, tmp_path, "dropped", f"srun python3 -c '{exits}'\necho after=$?\n")
    assert (result["state"], result["exit_code"]) == ("COMPLETED", "0:0")
    assert "after=3" in result["output"].splitlines()


def test_a_task_killed_by_a_signal_and_kill_on_bad_exit(cluster, tmp_path):
    kill = ('import os, signal, time; r = int(os.environ["SLURM_PROCID"]); '
            'r == 1 and os.kill(os.getpid(), signal.SIGKILL); time.sleep(2 if r else 0); '
            'print("done", r, flush=True)')
    result = run_job(cluster, tmp_path, "killed", f"srun python3 -c '{kill}'\n")
    # the other tasks run to their end; srun then exits 128+9, and the script with it
    assert (result["state"], result["exit_code"]) == ("FAILED", "137:0")
    assert f"srun: error: {cluster.node}: task 1: Killed" in result["output"]
    assert sorted(l for l in result["output"].splitlines() if l.startswith("done ")) == \
        ["done 0", "done 2", "done 3"]

    # --kill-on-bad-exit=1: the first failing task ends the step at once; the others are
    # TERMinated, and srun's status is then theirs (143), not the failing task's 3
    bad = ('import os, sys, time; r = int(os.environ["SLURM_PROCID"]); '
           'r == 1 and sys.exit(3); time.sleep(60 if r else 0); print("done", r, flush=True)')
    result = run_job(cluster, tmp_path, "badexit", f"srun --kill-on-bad-exit=1 python3 -c '{bad}'\n")
    assert (result["state"], result["exit_code"]) == ("FAILED", "143:0")
    assert result["seconds"] < 30
    out = result["output"]
    assert f"srun: error: {cluster.node}: task 1: Exited with exit code 3" in out
    assert f"srun: error: {cluster.node}: tasks 2-3: Terminated" in out
    assert "done 2" not in out and "done 3" not in out

    # the batch shell itself killed by a signal: ExitCode is 0:<signal>
    result = run_job(cluster, tmp_path, "killedbatch", "kill -9 $$\n")
    assert (result["state"], result["exit_code"]) == ("FAILED", "0:9")


def test_what_a_task_sees(cluster, tmp_path):
    body = f"""cd "$SLURM_SUBMIT_DIR"
srun python3 -c '{DUMP_ENV}'
srun --label hostname
"""
    marker = "submit-env-" + os.urandom(4).hex()
    cluster.env["TFC_SUBMIT_MARK"] = marker        # sbatch's default --export=ALL
    try:
        result = run_job(cluster, tmp_path, "taskenv", body)
    finally:
        del cluster.env["TFC_SUBMIT_MARK"]
    assert (result["state"], result["exit_code"]) == ("COMPLETED", "0:0")
    assert sorted(l for l in result["output"].splitlines() if l[:1].isdigit()) == \
        [f"{r}: {cluster.node}" for r in range(4)]         # --label prefixes "<rank>: "
    envs = [json.loads((tmp_path / f"env-{r}.json").read_text()) for r in range(4)]
    for rank, env in enumerate(envs):
        assert env["TFC_SUBMIT_MARK"] == marker
        assert env["SLURM_PROCID"] == env["SLURM_LOCALID"] == str(rank)
        assert (env["SLURM_NODEID"], env["SLURM_STEP_ID"], env["SLURM_STEPID"]) == ("0", "0", "0")
        assert (env["SLURM_NTASKS"], env["SLURM_STEP_NUM_TASKS"]) == ("4", "4")
        assert env["SLURM_NTASKS_PER_NODE"] == env["SLURM_STEP_TASKS_PER_NODE"] == "4"
        assert env["SLURM_GTIDS"] == "0,1,2,3"
        assert env["SLURM_CPUS_ON_NODE"] == env["SLURM_JOB_CPUS_PER_NODE"] == "4"
        assert env["SLURM_JOB_NODELIST"] == env["SLURM_STEP_NODELIST"] == cluster.node
        assert env["SLURMD_NODENAME"] == cluster.node
        assert env["SLURM_CONF"] == str(cluster.conf)
        # no GRES configured: nothing names a GPU, and no CPUs-per-task without -c
        assert not {k for k in env if "GPU" in k or k.startswith("CUDA")}, env
        assert "SLURM_CPUS_PER_TASK" not in env
    print("task 0 environment (SLURM_*):",
          json.dumps({k: v for k, v in sorted(envs[0].items()) if k.startswith("SLURM")}, indent=1))


def test_export_none_leaves_srun_tasks_without_path(cluster, tmp_path):
    # sbatch --export=NONE sets SLURM_EXPORT_ENV=NONE in the job, which srun inherits:
    # its tasks start with an empty environment, so a bare command name is not found
    body = 'echo "batch PATH set: ${PATH:+yes}"\nsrun printenv PATH\necho rc=$?\nsrun --export=ALL true\necho rc_all=$?\n'
    script = batch(tmp_path, "exportnone", body)
    job_id = cluster.submit(script, tmp_path, ["--export=NONE"])
    result = cluster.wait(job_id, 60)
    out = cluster.output_of(job_id)
    print(out)
    assert result["state"] == "COMPLETED"
    lines = out.splitlines()
    assert "batch PATH set: yes" in lines
    assert "rc=2" in lines and "execve(): printenv: No such file or directory" in out
    assert "rc_all=0" in lines


@pytest.mark.skipif(os.environ.get("TFCLUSTER_SLURM_SLOW") != "1",
                    reason="--time is whole minutes (--time=0:03 becomes 00:01:00) and slurmctld "
                           "enforces it on a periodic sweep: TIMEOUT comes 60-90 s after the "
                           "start; TFCLUSTER_SLURM_SLOW=1 runs it")
def test_time_limit_gives_timeout(cluster, tmp_path):
    script = batch(tmp_path, "timeout", "srun sleep 300\n")
    job_id = cluster.submit(script, tmp_path, ["--time=0:03"])
    result = cluster.wait(job_id, 150)
    print(cluster.output_of(job_id))
    assert result["job"]["TimeLimit"] == "00:01:00"
    assert (result["state"], result["exit_code"]) == ("TIMEOUT", "0:15")
    assert "DUE TO TIME LIMIT" in cluster.output_of(job_id)
