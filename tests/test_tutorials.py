"""TensorFlow's distributed tutorials, as users bring them, over real sshd.

tests/tutorials/ holds our own small scripts on the same APIs as TensorFlow's tutorials
(multi-worker Keras `model.fit`, a multi-worker custom loop, ParameterServerStrategy with
`model.fit` and with a ClusterCoordinator loop, a TF1 `replica_device_setter` trainer), with
random data and fewer steps. Each runs in the mode it needs on loopback hosts over SSH. Where
TensorFlow 2.21's Keras 3 cannot run one as written, the test asserts tfcluster's one-line
diagnosis and then the documented fix (`train.keras: legacy`) running it to the end
(docs/own-scripts.md).
"""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers import free_ports, manifest, only_run, tagged_processes, tfcluster

pytestmark = [pytest.mark.tf, pytest.mark.ssh, pytest.mark.timeout(420)]

TUTORIALS = Path(__file__).parent / "tutorials"
HOSTS = {"ps": ["h2"], "chief": ["h2"], "worker": ["h3", "h4"]}


def tutorial_spec(tmp: Path, sshd, *, name: str, mode: str, script: str, jobs: tuple[str, ...],
                  files: tuple[str, ...] = (), args: str = "[]", keras: str | None = None) -> Path:
    """A spec beside a copy of tests/tutorials: 127.0.0.2-4 over SSH, one task per host and job
    (a chief shares h2 with a ps)."""
    spec_dir = tmp / "spec"
    shutil.copytree(TUTORIALS, spec_dir)
    ports = iter(free_ports(sum(len(HOSTS[j]) for j in jobs)))
    lines = [f"  {job}: {{tasks: [{', '.join(f'{h}:{next(ports)}' for h in HOSTS[job])}]}}" for job in jobs]
    text = (f"name: {name}\npython: {sys.executable}\nworkdir: {tmp / 'remote'}\n"
            f"ssh:\n  port: {sshd.port}\n  connect_timeout: 5\n"
            "hosts:\n  - {name: h2, address: 127.0.0.2}\n  - {name: h3, address: 127.0.0.3}\n"
            "  - {name: h4, address: 127.0.0.4}\n"
            "jobs:\n" + "\n".join(lines) + "\n"
            f"train:\n  mode: {mode}\n  script: {script}\n  args: {args}\n  timeout: 300\n")
    if files:
        text += f"  files: [{', '.join(files)}]\n"
    if keras:
        text += f"  keras: {keras}\n"
    path = spec_dir / f"{name}.yaml"
    path.write_text(text)
    return path


def train(spec: Path, tmp: Path, home: Path, name: str):
    cwd = tmp / f"cwd-{name}"
    cwd.mkdir()
    result = tfcluster("train", str(spec), home=home, cwd=cwd, timeout=360)
    return result, result.stdout + result.stderr, cwd


def assert_keras3_diagnosed(result, out: str) -> None:
    """The run failed with one line naming Keras 3 and the fix, and no tensor in the summary."""
    assert result.returncode != 0, out[-3000:]
    summary = out[out.find("failed with exit code"):] if "failed with exit code" in out else out
    assert "Keras 3" in summary and "train.keras: legacy" in summary, out[-3000:]
    assert "dtype=float32" not in summary and len(summary.splitlines()) < 10, summary[-3000:]


@pytest.mark.parametrize("script,files,name", [
    ("mw_keras_main.py", ("mnist_setup.py",), "mwfit"),
    ("mw_custom_loop.py", (), "mwloop"),
])
def test_multi_worker_mirrored_tutorials_are_diagnosed_then_train_with_legacy_keras(
        tmp_path, home, ssh_home, sshd, script, files, name):
    spec = tutorial_spec(tmp_path, sshd, name=name, mode="mirrored", script=script,
                         jobs=("worker",), files=files)
    result, out, _ = train(spec, tmp_path, home, name)
    assert_keras3_diagnosed(result, out)
    assert not tagged_processes()

    spec = tutorial_spec(tmp_path / "fixed", sshd, name=name, mode="mirrored", script=script,
                         jobs=("worker",), files=files, keras="legacy")
    result, out, cwd = train(spec, tmp_path, home, name + "-legacy")
    assert result.returncode == 0, out[-4000:]
    tasks = manifest(only_run(cwd / "runs"))["tasks"]
    assert {k: t["script"]["exit_code"] for k, t in tasks.items()} == {"worker:0": 0, "worker:1": 0}
    assert not tagged_processes()


@pytest.mark.parametrize("script,name", [("ps_keras_fit.py", "psfit"), ("ps_coordinator_loop.py", "psloop")])
def test_parameter_server_tutorials_are_diagnosed_then_train_with_legacy_keras(
        tmp_path, home, ssh_home, sshd, script, name):
    jobs = ("chief", "ps", "worker")
    spec = tutorial_spec(tmp_path, sshd, name=name, mode="coordinator", script=script, jobs=jobs)
    result, out, _ = train(spec, tmp_path, home, name)
    assert_keras3_diagnosed(result, out)
    assert not tagged_processes()

    spec = tutorial_spec(tmp_path / "fixed", sshd, name=name, mode="coordinator", script=script,
                         jobs=jobs, keras="legacy")
    result, out, cwd = train(spec, tmp_path, home, name + "-legacy")
    assert result.returncode == 0, out[-4000:]
    assert manifest(only_run(cwd / "runs"))["tasks"]["chief:0"]["script"]["exit_code"] == 0
    assert not tagged_processes()


@pytest.mark.parametrize("quiet", [False, True])
def test_a_tf1_replica_trainer_runs_in_classic_mode_and_its_step_is_never_the_probes(
        tmp_path, home, ssh_home, sshd, quiet):
    """The TF1 trainer builds its own servers from the --*_hosts flags (classic mode). Printing
    `global step: N` it shows its last step; printing nothing (the skeleton trainer), no step
    at all: never the `global_step:0` of tfcluster's placement probe line."""
    args = ('["--job_name={job}", "--task_index={index}", "--ps_hosts={ps_hosts}", '
            '"--worker_hosts={worker_hosts}", "--train_steps", "150"' + (', "--quiet"]' if quiet else "]"))
    spec = tutorial_spec(tmp_path, sshd, name="tf1q" if quiet else "tf1", mode="classic",
                         script="tf1_replica.py", jobs=("ps", "worker"), args=args)
    result, out, cwd = train(spec, tmp_path, home, "tf1")
    assert result.returncode == 0, out[-4000:]
    run = only_run(cwd / "runs")
    listed = json.loads(tfcluster("runs", str(spec), "--json", home=home, cwd=cwd).stdout)
    log = (run / "worker-0.log").read_text()
    if quiet:
        assert "global step" not in log and "global_step:0" in log   # the probe's line is there
        assert listed["runs"][0]["step"] is None, listed          # and is no step
    else:
        steps = [int(s) for s in re.findall(r"global step: (\d+)", log)]
        # Asynchronous SGD: the other worker may take the last steps, and the step fetched with
        # train_op may be read before or after its own increment: near the end is all that holds.
        others = re.findall(r"global step: (\d+)", (run / "worker-1.log").read_text())
        assert steps and max(steps + [int(s) for s in others]) >= 140
        assert listed["runs"][0]["step"] in (max(steps), max(steps) + 1), listed
    assert not tagged_processes()
