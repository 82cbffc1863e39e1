"""A strategy that does not fit the mode: before the run from the script's text (and its
shipped helpers'), and while it runs from what each worker's probe reports. A single-host
strategy (or none) in mirrored mode with two workers trains two unsynchronised copies and
exits 0: the run is stopped, exit 8, with the fix. Real runs: tests/scripts/single_host_strategy.py
on two local workers. docs/design/diagnoses.md, "Strategy check"."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import SCRIPTS, free_ports, known_spec, local_spec, tagged_processes, tfcluster, wait_for
from tfcluster.diagnose import strategy as st
from tfcluster.diagnose.keras import fit_warning, keras2_warning
from tfcluster.launch.agent.records import HostInfo
from tfcluster.plan import build_plan
from tfcluster.spec import load_spec
from tfcluster.spec.shipped import scan_scripts

pytestmark = [pytest.mark.timeout(120)]
PROBE = Path(__file__).resolve().parent.parent / "tfcluster" / "host" / "probe"

MWMS = "import tensorflow as tf\nstrategy = tf.distribute.MultiWorkerMirroredStrategy()\n"
MIRRORED = "import tensorflow as tf\n\n# one host, every GPU\nstrategy = tf.distribute.MirroredStrategy()\n"


def plan_of(tmp_path: Path, script: str, *, mode: str = "mirrored", workers: int = 2, ps: int = 0,
            chief: int = 0, files: dict[str, str] | None = None, extra: str = ""):
    (tmp_path / "train.py").write_text(script)
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text)
    if files:
        extra = f"  files: [{', '.join(files)}]\n" + extra
    spec = load_spec(str(local_spec(tmp_path, mode=mode, script="train.py", ps=ps, workers=workers,
                                    chief=chief, extra=extra)))
    scan = scan_scripts(spec)
    return build_plan(spec, script_fits=scan.fits if scan else None, script_scan=scan)


# -- before the run: the text -----------------------------------------------------------------

def test_a_single_host_strategy_in_mirrored_mode_is_named_with_its_line_and_the_fix(tmp_path):
    assert st.static_warning(plan_of(tmp_path, MIRRORED)) == (
        "train.py:4: mirrored mode: the script builds MirroredStrategy, which trains on its own host "
        "only: each of the 2 workers trains its own copy of the model, never synchronised; build "
        "tf.distribute.MultiWorkerMirroredStrategy() instead (it reads TF_CONFIG, which tfcluster sets)")
    one = "import tensorflow as tf\ns = tf.distribute.OneDeviceStrategy('/cpu:0')\n"
    assert st.static_warning(plan_of(tmp_path, one)).startswith(
        "train.py:2: mirrored mode: the script builds OneDeviceStrategy, which trains on its own host only")


@pytest.mark.parametrize("case", ["multi-worker-named", "one-worker", "between-graph", "comment-only"])
def test_no_warning_where_the_strategy_fits(tmp_path, case):
    plan = plan_of(tmp_path, **{
        "multi-worker-named": {"script": MIRRORED + "multi = tf.distribute.MultiWorkerMirroredStrategy()\n"},
        "one-worker": {"script": MIRRORED, "workers": 1},
        "between-graph": {"script": MIRRORED, "mode": "between-graph", "ps": 1},
        "comment-only": {"script": MWMS + "# not tf.distribute.MirroredStrategy()\n"},
    }[case])
    assert st.static_warning(plan) is None


def test_coordinator_mode_wants_parameter_server_strategy_and_a_helper_file_counts(tmp_path):
    plan = plan_of(tmp_path, "import model_setup\n", mode="coordinator", ps=1, chief=1, workers=1,
                   files={"model_setup.py": "import tensorflow as tf\n\nstrategy = tf.distribute.MirroredStrategy()\n"})
    assert st.static_warning(plan) == (
        "model_setup.py:3: coordinator mode: the script builds MirroredStrategy: the ps and worker "
        "servers wait for a ParameterServerStrategy coordinator, and the chief trains alone; build "
        "tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.TFConfigClusterResolver()) instead")


def test_model_fit_in_a_shipped_helper_file_gets_the_keras_warning_naming_it(tmp_path):
    helper = "def train(model, data):\n    model.fit(data, epochs=3)\n"
    plan = plan_of(tmp_path, MWMS + "import mnist_setup\n", files={"mnist_setup.py": helper})
    assert plan.script_fits is True and plan.script_scan.fit_at == "mnist_setup.py:2"
    keras3 = HostInfo(python_version="3.11.7", tf_version="2.21.0", machine_id="", gpus=0, keras_version="3.15.0")
    assert fit_warning(plan, {"local": keras3}) == (
        "mirrored mode: Keras 3.15 on local cannot run model.fit (mnist_setup.py:2) under "
        "MultiWorkerMirroredStrategy (keras-team/keras#20585): set train.keras: legacy "
        "(needs tf_keras, which local lacks)")


PS_LOOP = '''import tensorflow as tf

strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.TFConfigClusterResolver())
with strategy.scope():
    model_input = tf.keras.layers.Input(shape=(3,), dtype=tf.int64)
    emb = tf.keras.layers.Embedding(input_dim=10, output_dim=4)
    pooled = tf.reduce_mean(emb(model_input), axis=1)
    model = tf.keras.Model(model_input, tf.keras.layers.Dense(1)(pooled))
    optimizer = tf.keras.optimizers.legacy.RMSprop(learning_rate=0.1)


class Mean(tf.keras.layers.Layer):
    def call(self, model_input):          # a layer's own input: a tensor, never a KerasTensor
        return tf.reduce_mean(model_input, axis=1)
'''


def test_a_custom_loop_without_fit_is_warned_of_what_only_keras_2_has(tmp_path):
    plan = plan_of(tmp_path, PS_LOOP, mode="coordinator", ps=1, chief=1, workers=1)
    assert not plan.script_fits
    keras3 = HostInfo(python_version="3.11.7", tf_version="2.21.0", machine_id="", gpus=0,
                      keras_version="3.15.0", tf_keras_version="2.21.0")
    assert keras2_warning(plan, {"local": keras3}) == (
        "Keras 3.15 on local: the script uses what only Keras 2 has: train.py:7: tf.reduce_mean on a "
        "Keras input (Keras 3: \"A KerasTensor cannot be used as input to a TensorFlow function\"); "
        "train.py:9: tf.keras.optimizers.legacy (Keras 3 has none): set train.keras: legacy "
        "(tf_keras is installed), or port those lines to Keras 3")
    legacy = plan_of(tmp_path, PS_LOOP, mode="coordinator", ps=1, chief=1, workers=1, extra="  keras: legacy\n")
    assert keras2_warning(legacy, {"local": keras3}) is None
    keras2 = HostInfo(python_version="3.11.7", tf_version="2.15.0", machine_id="", gpus=0, keras_version="2.15.0")
    assert keras2_warning(plan, {"local": keras2}) is None


# -- while it runs: the probe's reports ---------------------------------------------------------

def test_a_tf2_strategy_in_a_tf1_mode_is_warned_with_the_mode_it_needs(tmp_path):
    plan = plan_of(tmp_path, MWMS, mode="between-graph", ps=1)
    assert st.tf1_mode_warning(plan) == (
        "train.py:2: between-graph mode: the script builds MultiWorkerMirroredStrategy, which starts each "
        "worker's server itself from TF_CONFIG; set train.mode: mirrored (workers only, no ps job)")
    pss = plan_of(tmp_path, "import tensorflow as tf\ns = tf.distribute.ParameterServerStrategy(r)\n", mode="classic",
                  ps=1)
    assert "set train.mode: coordinator (chief, ps and worker jobs)" in st.tf1_mode_warning(pss)
    assert st.tf1_mode_warning(plan_of(tmp_path, MWMS)) is None          # mirrored: fits


@pytest.mark.tf
@pytest.mark.timeout(180)
def test_the_multi_worker_tutorial_in_between_graph_mode_fails_with_the_mode_it_needs(tmp_path, home):
    """Its MultiWorkerMirroredStrategy starts the worker's server on the port tfcluster's own
    server holds: the failure's fix is the mode, not the old-style trainer's `classic`."""
    (tmp_path / "train.py").write_text(MWMS + "print('built', flush=True)\n")
    spec = local_spec(tmp_path, mode="between-graph", script="train.py", ps=1, workers=1)
    r = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=160)
    assert r.returncode == 5, r.stdout[-2000:] + r.stderr[-3000:]
    said = ("train.py:2: between-graph mode: the script builds MultiWorkerMirroredStrategy, which starts each "
            "worker's server itself from TF_CONFIG; set train.mode: mirrored (workers only, no ps job)")
    assert f"tfcluster: warning: {said}" in r.stderr and f"hint: {said}" in r.stderr, r.stderr[-3000:]
    wait_for(lambda: not tagged_processes(), 15, what="nothing of the run left")


TUTORIAL_CELL = ("import json, os\nos.environ['TF_CONFIG'] = json.dumps({'cluster': {'worker': ['localhost:12345', "
                 "'localhost:23456']}, 'task': {'type': 'worker', 'index': 0}})\n")


@pytest.mark.parametrize("line, said", [
    ("os.environ['TF_CONFIG'] = text\n", True),
    ("os.environ.update({'TF_CONFIG': text})\n", True),
    ("os.putenv('TF_CONFIG', text)\n", True),
    ("os.environ.setdefault('TF_CONFIG', text)\n", False),      # tfcluster's stays
    ("if os.environ['TF_CONFIG'] == text: pass\n", False),
    ("# os.environ['TF_CONFIG'] = text\n", False),
])
def test_a_script_that_sets_tf_config_itself_is_warned(tmp_path, line, said):
    plan = plan_of(tmp_path, "import os\ntext = '{}'\n" + line + MWMS)
    warned = st.tf_config_warning(plan)
    assert (warned is not None) == said, warned
    if said:
        assert warned.startswith("train.py:3: the script sets TF_CONFIG itself, over the one tfcluster gives each task")


@pytest.mark.tf
@pytest.mark.timeout(180)
def test_the_tutorials_own_tf_config_is_named_before_the_run_and_as_the_failures_fix(tmp_path, home):
    """The multi-worker tutorial's notebook cell pasted into the script: every task takes its
    localhost ports and task 0; one cannot bind, and the fix is to delete that line, not a port."""
    (tmp_path / "train.py").write_text(TUTORIAL_CELL + MWMS + "print('built', flush=True)\n")
    spec = local_spec(tmp_path, mode="mirrored", script="train.py", workers=2, ps=0)
    r = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=160)
    assert r.returncode == 5, r.stdout[-2000:] + r.stderr[-3000:]
    said = "train.py:2: the script sets TF_CONFIG itself, over the one tfcluster gives each task"
    assert f"tfcluster: warning: {said}" in r.stderr, r.stderr[-3000:]
    assert f"hint: {said}" in r.stderr, r.stderr[-3000:]
    wait_for(lambda: not tagged_processes(), 15, what="nothing of the run left")


def test_reports_are_judged_per_mode_and_only_for_the_judged_tasks():
    check = st.StrategyCheck("mirrored", ["worker:0", "worker:1"], 2)
    assert check.add(st.parse(b'tfcluster-strategy: {"task":"evaluator:0","class":"MirroredStrategy","replicas":1}')) is None
    assert check.add(st.Report("worker:0", "CollectiveAllReduceStrategy", 2)) is None
    message, hint = check.add(st.Report("worker:1", "MirroredStrategyV1", 1))
    assert message.startswith("strategy mismatch: worker:1 built MirroredStrategy, which trains on its own host only")
    assert message.endswith("(1 replica in sync)") and "MultiWorkerMirroredStrategy()" in hint
    assert st.parse(b"tfcluster-strategy: {not json") is None
    pss = st.StrategyCheck("coordinator", ["chief:0"], 1)
    assert pss.add(st.Report("chief:0", "ParameterServerStrategyV2", 1)) is None
    assert pss.summary() == "ParameterServerStrategy, 1 replica(s) in sync on chief:0"


@pytest.mark.tf
@pytest.mark.timeout(180)
@pytest.mark.parametrize("args, built", [([], "MirroredStrategy"), (["none"], "no strategy (TensorFlow's default)")],
                         ids=["mirrored-strategy", "no-strategy"])
def test_two_workers_that_each_train_alone_are_stopped_with_the_fix(tmp_path, home, monkeypatch, args, built):
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    spec = known_spec(tmp_path, "single_host_strategy.py", "mirrored", {"worker": 2}, args)
    r = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=160)
    assert r.returncode == 8, r.stdout[-2000:] + r.stderr[-3000:]
    if not args:       # said before the run, from the text: the line that builds it
        assert ("tfcluster: warning: single_host_strategy.py:8: mirrored mode: the script builds "
                "MirroredStrategy, which trains on its own host only") in r.stderr, r.stderr[-3000:]
    error = next(line for line in r.stderr.splitlines() if line.startswith("tfcluster: error: "))
    assert error.startswith("tfcluster: error: strategy mismatch: worker:") and f" built {built}, " in error
    assert "each of the 2 workers trains its own copy of the model, never synchronised (1 replica in sync)" in error
    assert ("hint: build tf.distribute.MultiWorkerMirroredStrategy() instead (it reads TF_CONFIG, which "
            "tfcluster sets); switch the check off with train.checks.placement: false") in r.stderr
    assert "Number of devices: 1" in r.stdout and "tfcluster-strategy" not in r.stdout   # probe lines stay in the logs
    logs = "".join(p.read_text() for p in Path(tmp_path, "runs").glob("*/worker-*.log"))
    assert "tfcluster-strategy: " in logs
    wait_for(lambda: not tagged_processes(), 15, what="nothing of the run left")


@pytest.mark.tf
@pytest.mark.timeout(120)
@pytest.mark.parametrize("legacy", [False, True], ids=["keras-3", "tf_keras"])
def test_the_probe_reports_a_fit_outside_the_strategys_scope(tmp_path, legacy):
    """One worker of its own cluster, the probe on as a TF2 mode's script has it."""
    port, = free_ports(1)
    env = {**os.environ, "PYTHONPATH": str(PROBE), "TFCLUSTER_JOB": "worker", "TFCLUSTER_TASK_INDEX": "0",
           "TF_CONFIG": json.dumps({"cluster": {"worker": [f"127.0.0.1:{port}"]}, "task": {"type": "worker", "index": 0}})}
    env.pop("TF_USE_LEGACY_KERAS", None)
    if legacy:
        env["TF_USE_LEGACY_KERAS"] = "1"
    done = subprocess.run([sys.executable, str(SCRIPTS / "fit_outside_scope.py")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr[-3000:]
    reports = [st.parse(line.encode()) for line in done.stderr.splitlines() if line.startswith("tfcluster-strategy: ")]
    # MultiWorkerMirroredStrategy said as its constructor begins (0 replicas: not known yet), then built
    assert [(r.task, r.cls, r.replicas) for r in reports] == [
        ("worker:0", "CollectiveAllReduceStrategy", 0), ("worker:0", "CollectiveAllReduceStrategy", 1),
        ("worker:0", "fit-default", 1)]


@pytest.mark.tf
@pytest.mark.timeout(180)
def test_multi_worker_mirrored_in_coordinator_mode_is_stopped_though_its_constructor_never_returns(tmp_path, home):
    """TensorFlow's multi-worker Keras tutorial given to coordinator mode: its chief's
    MultiWorkerMirroredStrategy() waits for every task of the cluster to join it, and the ps
    and workers are tfcluster's servers, which never do. Said as the constructor begins, the
    mismatch stops the run (exit 8) instead of a silence the hang watchdog can only guess at."""
    (tmp_path / "train.py").write_text(MWMS + "print('built', flush=True)\n")
    spec = local_spec(tmp_path, mode="coordinator", script="train.py", ps=1, workers=1, chief=1)
    r = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=160)
    assert r.returncode == 8, r.stdout[-2000:] + r.stderr[-3000:]
    error = next(line for line in r.stderr.splitlines() if line.startswith("tfcluster: error: "))
    assert error == ("tfcluster: error: strategy mismatch: chief:0 builds MultiWorkerMirroredStrategy: the ps and "
                     "worker servers wait for a ParameterServerStrategy coordinator, and the chief trains alone"), error
    assert "built" not in r.stdout
    wait_for(lambda: not tagged_processes(), 15, what="nothing of the run left")


@pytest.mark.tf
@pytest.mark.timeout(180)
def test_a_model_built_outside_the_strategys_scope_is_stopped_with_the_fix(tmp_path, home):
    """A fit of 100,000 epochs: only the check ends it."""
    spec = known_spec(tmp_path, "fit_outside_scope.py", "mirrored", {"worker": 2}, ["--epochs", "100000"])
    spec.write_text(spec.read_text() + "  keras: legacy\n")      # TensorFlow's tutorial runs on tf_keras
    r = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=160)
    assert r.returncode == 8, r.stdout[-2000:] + r.stderr[-3000:]
    error = next(line for line in r.stderr.splitlines() if line.startswith("tfcluster: error: "))
    assert re.fullmatch(r"tfcluster: error: strategy mismatch: worker:[01] ran model\.fit outside strategy\.scope\(\) "
                        r"\(the model was built or compiled outside it, so Keras fits under TensorFlow's default "
                        r"strategy\): each of the 2 workers trains its own copy of the model, never synchronised", error), error
    assert "hint: build and compile the model inside `with strategy.scope():`" in r.stderr, r.stderr[-3000:]
    assert "trained" not in r.stdout
    wait_for(lambda: not tagged_processes(), 15, what="nothing of the run left")


def test_the_test_script_is_where_the_spec_says(tmp_path):
    assert (SCRIPTS / "single_host_strategy.py").read_text().splitlines()[7].startswith(
        "strategy = tf.distribute.MirroredStrategy()")


def test_keras_jax_processes_are_judged_by_whether_they_joined_and_fit_with_a_distribution(tmp_path):
    check = st.StrategyCheck("keras-jax", ["worker:0", "worker:1"], 2)
    assert check.add(st.parse(b'tfcluster-strategy: {"task":"worker:0","class":"jax-joined","replicas":2}')) is None
    assert check.add(st.Report("worker:1", "jax-joined", 2)) is None
    assert check.summary() == "jax.distributed, 2 processes joined on worker:0, worker:1"
    message, hint = check.add(st.Report("worker:1", "keras-no-distribution", 1))
    assert message.startswith("strategy mismatch: worker:1 ran model.fit with no keras.distribution set")
    assert "keras.distribution.set_distribution(" in hint
    assert check.summary() == ("jax.distributed, 2 processes joined on worker:0; "
                               "no keras.distribution on worker:1")
    # the probe is asked for where two or more processes run and the check is on
    assert plan_of(tmp_path, "print(1)\n", mode="keras-jax").probes() == "jax"
    assert plan_of(tmp_path, "print(1)\n", mode="keras-jax", workers=1).probes() == ""
    off = plan_of(tmp_path, "print(1)\n", mode="keras-jax", extra="  checks: {placement: false}\n")
    assert off.probes() == "" and st.judged_tasks(off) == ["worker:0", "worker:1"]


@pytest.mark.parametrize("script, warned", [
    ("import keras\nmodel.fit(x, y)\n", True),
    ("import keras\n# keras.distribution.initialize()\nmodel.fit(x, y)\n", True),
    ("import keras\nkeras.distribution.initialize()\n", False),
    ("import jax\njax.distributed.initialize(num_processes=2, process_id=0)\n", False),
    ("from keras.distribution import initialize\ninitialize()\n", False),
], ids=["none", "commented-out", "keras", "jax", "imported-by-name"])
def test_a_keras_jax_script_that_never_joins_is_warned_before_the_run(tmp_path, script, warned):
    warning = st.static_warning(plan_of(tmp_path, script, mode="keras-jax"))
    assert warning == ("train.py: keras-jax mode: the script calls neither keras.distribution.initialize() "
                       "nor jax.distributed.initialize(): each of the 2 processes would train its own copy of "
                       "the model, never synchronised; call keras.distribution.initialize() first, before "
                       "anything runs on JAX" if warned else None)
    assert st.static_warning(plan_of(tmp_path, script, mode="keras-jax", workers=1)) is None
