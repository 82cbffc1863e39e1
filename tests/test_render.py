"""`render --to slurm` and `plan --to slurm` without a Slurm cluster: what the script
says, what it carries, what it must never carry. test_slurm.py submits it for real."""
from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import tarfile

import pytest

from tests.helpers import GPU_LAB, LOCAL, tfc


def bundle_of(script: str) -> dict[str, bytes]:
    data = re.search(r"<<'TFCLUSTER_BUNDLE'\n(.*?)\nTFCLUSTER_BUNDLE", script, re.S).group(1)
    with tarfile.open(fileobj=io.BytesIO(base64.decodebytes(data.encode())), mode="r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def sbatch_options(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([a-z-]+)=(.*)$", script, re.M))


def test_gpu_lab_renders_one_node_per_host_with_the_largest_shape_and_no_secret(tmp_path):
    result = tfc("render", GPU_LAB, "--to", "slurm", "-o", str(tmp_path))
    assert result.returncode == 0, result.stderr
    script = (tmp_path / "lab.sbatch").read_text()
    assert sbatch_options(script) == {"job-name": "lab", "nodes": "3", "ntasks-per-node": "4",
                                      "distribution": "block", "output": "lab-%j.out", "signal": "USR1@90",
                                      "gres": "gpu:4"}
    assert "set-me" not in script + result.stdout + result.stderr       # WANDB_API_KEY's value
    assert '${WANDB_API_KEY:?' in script                                  # required at submit time
    assert "export TF_CPP_MIN_LOG_LEVEL=2" in script                      # the spec's public env
    assert "sbatch lab.sbatch" in result.stderr
    assert "differ in shape" in result.stderr and "train.restart (on-failure)" in result.stderr
    # the fence does not come with it: said, as for the other settings Slurm does not carry over
    assert "tf_ports: auto does not carry over: Slurm closes no port" in result.stderr, result.stderr
    assert subprocess.run(["bash", "-n", str(tmp_path / "lab.sbatch")]).returncode == 0

    files = bundle_of(script)
    assert set(files) == {"launch.py", "tfserver.py", "tfcluster-launch.json", "between_graph.py"}
    config = json.loads(files["tfcluster-launch.json"])
    assert config["hosts"] == [[["ps", 0, []], ["ps", 1, []]],
                               [["worker", i, [i]] for i in range(4)],
                               [["worker", 4 + i, [i]] for i in range(4)]]
    assert config["args"] == ["--steps", "2000", "--model_dir", "{workdir}/ckpt"]  # filled on the node
    assert config["secret_env"] == ["WANDB_API_KEY"] and "WANDB_API_KEY" not in config["env"]


def test_plan_to_slurm_shows_which_rank_plays_which_task():
    result = tfc("plan", GPU_LAB, "--to", "slurm")
    assert result.returncode == 0, result.stderr
    rows = {cells[0]: cells[1:] for cells in
            (re.split(r"\s{2,}", line.strip()) for line in result.stdout.splitlines())   # plain columns: piped
            if cells and cells[0].isdigit()}
    assert rows["0"] == ["0", "0", "ps:0", "cpu0", "-"]
    assert rows["2"] == ["0", "2", "-", "cpu0", "-"]                      # cpu0's idle slots
    assert rows["4"] == ["1", "0", "worker:0", "gpu0", "0"]
    assert rows["11"] == ["2", "3", "worker:7", "gpu1", "3"]
    assert "3 node(s) x 4 task(s)" in result.stdout


def test_timeout_becomes_the_time_limit_rounded_up_to_minutes(tmp_path):
    spec = tmp_path / "t.yaml"
    spec.write_text(open(LOCAL).read().replace('args: ["--steps", "300"]',
                                              'args: ["--steps", "300"]\n  timeout: 5401'))
    result = tfc("render", str(spec), "--to", "slurm")
    assert result.returncode == 0, result.stderr
    assert sbatch_options(result.stdout)["time"] == "0-01:31:00"
    assert "gres" not in sbatch_options(result.stdout)


def test_every_task_gets_a_checkpoint_request_90s_before_the_time_limit(tmp_path):
    """`--signal=USR1@90` (no `B:`: to the steps' tasks, not the batch shell): the script
    contract's checkpoint request, which the launcher and the TF server ignore."""
    result = tfc("render", LOCAL, "--to", "slurm")
    assert result.returncode == 0, result.stderr
    assert sbatch_options(result.stdout)["signal"] == "USR1@90"
    launcher = bundle_of(result.stdout)["launch.py"].decode()
    assert "signal.signal(signal.SIGUSR1, signal.SIG_IGN)" in launcher


def test_the_same_spec_renders_the_same_bytes():
    first, second = (tfc("render", GPU_LAB, "--to", "slurm").stdout for _ in range(2))
    assert first == second and first.startswith("#!/bin/bash")


@pytest.mark.parametrize("args, message", [
    (("render", LOCAL, "--to", "yarn"), "--to 'yarn': unknown engine; choose one of tfjob, slurm"),
    (("plan", LOCAL, "--to", "tfjob"), "only slurm has a rank mapping"),
])
def test_unknown_engines_are_one_line_usage_errors(args, message):
    result = tfc(*args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_spec_without_a_script_cannot_be_rendered(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(open(LOCAL).read().replace("  script: template:between_graph", "")
                    .replace('  args: ["--steps", "300"]', ""))
    result = tfc("render", str(spec), "--to", "slurm")
    assert result.returncode == 2, result.stderr
    assert "train.script is not set" in result.stderr and not result.stdout


KERAS_JAX = """name: kj
hosts:
  - {name: a, address: 10.1.0.1, gpus: 2}
  - {name: b, address: 10.1.0.2, gpus: 2}
jobs:
  worker: {tasks: ['a:7000', 'b:7000']}
env: {KERAS_HOME: /data/keras}
train: {mode: keras-jax, script: template:keras_jax}
"""


def test_keras_jax_renders_for_slurm_with_each_process_s_variables_and_no_coordinator_of_the_spec(tmp_path):
    spec = tmp_path / "kj.yaml"
    spec.write_text(KERAS_JAX)
    result = tfc("render", str(spec), "--to", "slurm", "-o", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    script = (tmp_path / "out" / "kj.sbatch").read_text()
    assert "export KERAS_HOME=/data/keras" in script
    assert "KERAS_DISTRIBUTION" not in script and "JAX_" not in script and "10.1.0.1" not in script
    config = json.loads(bundle_of(script)["tfcluster-launch.json"])
    assert "KERAS_BACKEND" not in config["env"]
    first, second = config["jax_env"]["worker:0"], config["jax_env"]["worker:1"]
    # where the job runs, worker 0's surveyed address and port replace the placeholder
    assert first["JAX_COORDINATOR_ADDRESS"] == first["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == "{coordinator}"
    assert second["JAX_COORDINATOR_ADDRESS"] == "{coordinator}"
    ids = (first["JAX_PROCESS_ID"], second["KERAS_DISTRIBUTION_PROCESS_ID"], second["JAX_NUM_PROCESSES"])
    assert ids == ("0", "1", "2")
    assert first["KERAS_BACKEND"] == second["KERAS_BACKEND"] == "jax"
    assert "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in first       # GPU hosts: no gloo (test_slurm: CPU)


def test_keras_jax_for_a_tfjob_is_one_line_naming_what_kubernetes_needs(tmp_path):
    spec = tmp_path / "kj.yaml"
    spec.write_text(KERAS_JAX)
    result = tfc("render", str(spec), "--to", "tfjob", "-o", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("tfcluster: error: render --to tfjob: mode keras-jax is not rendered "
                                    "for Kubernetes")
    assert "Indexed Job" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_spec_with_its_ports_open_gets_no_word_of_the_fence_on_slurm(tmp_path):
    spec = tmp_path / "open.yaml"
    spec.write_text(open(LOCAL).read() + "tf_ports: open\n")
    result = tfc("render", str(spec), "--to", "slurm", "-o", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "tf_ports" not in result.stderr, result.stderr
