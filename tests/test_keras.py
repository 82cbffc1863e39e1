"""Keras 3 against the strategies, named before anything runs: the pure rule (which mode's
model.fit Keras 3 cannot run, on which hosts), `train.keras: legacy` in the plan's env, the
version table's Keras column, and, for real, `plan --check` and `train` on hosts whose
interpreter is a venv made here: with a TensorFlow and a Keras 3 that its metadata names
(nothing here imports either) and with or without tf_keras. docs/modes.md, "Keras"."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import FIT_SCRIPT, fake_venv, local_spec, tagged_processes, tfcluster, venv_spec
from tfcluster.diagnose.keras import (
    fit_warning,
    is_keras3,
    tf_keras_problem,
    tf_keras_requirement,
)
from tfcluster.errors import PreflightError
from tfcluster.host import shim_facts
from tfcluster.launch.agent.records import HostInfo, host_info
from tfcluster.launch.cluster.preflight import check_tf_keras
from tfcluster.plan import build_plan
from tfcluster.spec import load_spec, script_calls_fit
from tfcluster.ui.views import version_table

pytestmark = [pytest.mark.timeout(120)]


def info(keras: str | None = "3.15.0", tf_keras: str | None = None, tf: str | None = "2.21.0") -> HostInfo:
    return HostInfo(python_version="3.11.7", tf_version=tf, machine_id="", gpus=0,
                    keras_version=keras, tf_keras_version=tf_keras)


def plan_of(tmp_path: Path, *, mode: str = "mirrored", script: str = FIT_SCRIPT, extra: str = "",
            workers: int = 2, ps: int = 0, chief: int = 0):
    (tmp_path / "train.py").write_text(script)
    spec = load_spec(str(local_spec(tmp_path, mode=mode, script="train.py", ps=ps, workers=workers,
                                    chief=chief, extra=extra)))
    return build_plan(spec, script_fits=script_calls_fit(spec))


# -- the rule ------------------------------------------------------------------------------

def test_mirrored_fit_on_keras_3_is_named_with_its_issue_and_the_fix(tmp_path):
    plan = plan_of(tmp_path)
    assert fit_warning(plan, {"local": info()}) == (
        "mirrored mode: Keras 3.15 on local cannot run model.fit under MultiWorkerMirroredStrategy "
        "(keras-team/keras#20585): set train.keras: legacy (needs tf_keras, which local lacks)")
    assert fit_warning(plan, {"local": info(tf_keras="2.21.0")}).endswith(
        "set train.keras: legacy (tf_keras is installed)")


def test_coordinator_fit_names_parameter_server_strategy(tmp_path):
    plan = plan_of(tmp_path, mode="coordinator", ps=1, chief=1)
    assert fit_warning(plan, {"local": info()}).startswith(
        "coordinator mode: Keras 3.15 on local cannot run model.fit under ParameterServerStrategy "
        "(keras-team/keras#18624)")


@pytest.mark.parametrize("case", ["legacy", "legacy-by-env", "custom-loop", "between-graph", "keras-2"])
def test_no_warning_where_model_fit_can_run_or_is_not_called(tmp_path, case):
    plan = plan_of(tmp_path, **{
        "legacy": {"extra": "  keras: legacy\n"},
        "legacy-by-env": {"extra": "env: {TF_USE_LEGACY_KERAS: '1'}\n"},
        "custom-loop": {"script": "strategy.run(step, args=(next(it),))\nmetric.reset_state()\n"},
        "between-graph": {"mode": "between-graph", "ps": 1},
        "keras-2": {},
    }[case])
    assert fit_warning(plan, {"local": info(keras="2.15.0" if case == "keras-2" else "3.15.0")}) is None


def test_hosts_are_grouped_by_keras_minor_and_only_script_hosts_count():
    tasks = [SimpleNamespace(host=h, runs_script=s) for h, s in
             (("a", True), ("b", True), ("c", True), ("ps", False))]
    plan = SimpleNamespace(mode="mirrored", legacy_keras=False, script_fits=True, tasks=tasks)
    infos = {"a": info(tf_keras="2.21.0"), "b": info("3.14.1"), "c": info(), "ps": info()}
    assert fit_warning(plan, infos) == (
        "mirrored mode: Keras 3.15 on a and c, Keras 3.14 on b cannot run model.fit under "
        "MultiWorkerMirroredStrategy (keras-team/keras#20585): set train.keras: legacy "
        "(needs tf_keras, which b and c lack)")


def test_tf_keras_must_match_its_tensorflow_minor():
    assert tf_keras_problem(info(tf_keras="2.21.3")) is None
    assert tf_keras_problem(info(tf_keras=None)) == "tf_keras is not installed"
    assert tf_keras_problem(info(tf_keras="2.20.0")) == (
        "its tf_keras 2.20.0 does not match its TensorFlow 2.21.0")
    assert tf_keras_problem(info(keras="2.15.0", tf="2.15.1")) is None     # tf.keras is Keras 2 there
    assert tf_keras_problem(info(tf=None)) is None          # left to preflight's TF-missing check
    assert tf_keras_requirement("2.21.1") == "tf_keras~=2.21.0"
    assert not is_keras3(info(keras=None)) and is_keras3(info(keras="3.0.0rc1"))


def test_the_script_is_read_for_fit_calls_under_a_multi_worker_strategy_only(tmp_path):
    assert plan_of(tmp_path).script_fits is True
    assert plan_of(tmp_path, script="ParameterServerStrategy\nmodel . fit (x)\n").script_fits is False
    assert plan_of(tmp_path, script="ParameterServerStrategy\nm.fit\t(x)\n").script_fits is True
    assert plan_of(tmp_path, script="m.fit(x)   # no strategy: it trains alone\n").script_fits is False


# -- the plan ------------------------------------------------------------------------------

def test_legacy_sets_tf_use_legacy_keras_for_every_task_servers_included(tmp_path):
    plan = plan_of(tmp_path, mode="coordinator", ps=1, chief=1, extra="  keras: legacy\n")
    assert plan.legacy_keras and {t.key for t in plan.tasks} == {"chief:0", "ps:0", "worker:0", "worker:1"}
    assert all(dict(t.env)["TF_USE_LEGACY_KERAS"] == "1" for t in plan.tasks)
    auto = plan_of(tmp_path, mode="coordinator", ps=1, chief=1)
    assert not auto.legacy_keras and all("TF_USE_LEGACY_KERAS" not in dict(t.env) for t in auto.tasks)


def test_plan_shows_the_env_and_the_setting(tmp_path, home):
    spec = local_spec(tmp_path, mode="mirrored", ps=0, extra="  keras: legacy\n")
    shown = tfcluster("plan", str(spec), "--commands", home=home, cwd=tmp_path, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count("  TF_USE_LEGACY_KERAS=1\n") == 2      # worker:0 and worker:1
    as_json = json.loads(tfcluster("plan", str(spec), "--json", home=home, cwd=tmp_path, timeout=60).stdout)
    assert as_json["keras"] == "legacy"


# -- the version table ---------------------------------------------------------------------

def test_the_version_table_shows_keras_and_tf_keras():
    infos = {"a": info(), "b": info(tf_keras="2.21.0"), "c": info(keras=None)}
    _title, columns, rows = version_table(infos, {})
    cells = {row[0]: row[columns.index("keras")] for row in rows}
    assert cells == {"a": "3.15.0", "b": "3.15.0 + tf_keras 2.21.0", "c": "-"}


def test_host_info_takes_both_versions_from_the_shims_answer():
    answer = {"python_version": "3.11.7", "machine_id": "m", "tf_version": "2.21.0",
              "keras_version": "3.15.0", "tf_keras_version": "2.21.0"}
    assert (host_info(answer).keras_version, host_info(answer).tf_keras_version) == ("3.15.0", "2.21.0")
    light = host_info({"python_version": "3.11.7", "machine_id": "m"})    # down, status
    assert (light.keras_version, light.tf_keras_version) == (None, None)


# -- preflight -----------------------------------------------------------------------------

def test_legacy_on_several_hosts_names_each_with_its_own_install_command():
    hosts = {h: SimpleNamespace(python=f"/opt/{h}/bin/python") for h in ("a", "b", "c")}
    infos = {"a": info(tf_keras="2.21.0"), "b": info(tf="2.20.1"), "c": info(tf_keras="2.19.0")}
    session = SimpleNamespace(infos=infos, plan=SimpleNamespace(host=hosts.__getitem__, spec_path="lab.yaml"))
    with pytest.raises(PreflightError) as refused:
        check_tf_keras(session, ["a", "b", "c"])
    assert refused.value.message == ("legacy Keras (TF_USE_LEGACY_KERAS=1, train.keras: legacy) needs "
                                     "tf_keras matching TensorFlow on every host, and b and c lack it")
    assert refused.value.details.splitlines() == [
        ("host b: legacy Keras (TF_USE_LEGACY_KERAS=1, train.keras: legacy) needs tf_keras for "
         "/opt/b/bin/python, but tf_keras is not installed; install it: `tfcluster exec lab.yaml --hosts b -- "
         "/opt/b/bin/python -m pip install --no-deps 'tf_keras~=2.20.0'`"),
        ("host c: legacy Keras (TF_USE_LEGACY_KERAS=1, train.keras: legacy) needs tf_keras for "
         "/opt/c/bin/python, but its tf_keras 2.19.0 does not match its TensorFlow 2.21.0; install it: "
         "`tfcluster exec lab.yaml --hosts c -- /opt/c/bin/python -m pip install --no-deps 'tf_keras~=2.21.0'`")]


# -- for real: a second interpreter, a venv whose metadata names TF and Keras ---------------


def test_plan_check_refuses_legacy_on_a_host_without_tf_keras_with_the_install_command(tmp_path, home):
    python = fake_venv(tmp_path / "v", tensorflow="2.21.0", keras="3.15.0")
    spec = venv_spec(tmp_path, python, keras="legacy")
    checked = tfcluster("plan", str(spec), "--check", home=home, cwd=tmp_path, timeout=90)
    assert checked.returncode == 4, checked.stderr
    errors = [line for line in checked.stderr.splitlines() if line.startswith("tfcluster: error: ")]
    assert errors == [(f"tfcluster: error: host local: legacy Keras (TF_USE_LEGACY_KERAS=1, train.keras: "
                       f"legacy) needs tf_keras for {python}, but tf_keras is not installed")]
    assert (f"hint: install it there: `tfcluster exec {spec} --hosts local -- {python} -m pip install --no-deps "
            f"'tf_keras~=2.21.0'`") in checked.stderr
    assert "preflight passed" not in checked.stderr and "Traceback" not in checked.stderr


def test_plan_check_refuses_a_tf_keras_of_another_minor(tmp_path, home):
    python = fake_venv(tmp_path / "v", tensorflow="2.21.0", keras="3.15.0", tf_keras="2.20.0")
    checked = tfcluster("plan", str(venv_spec(tmp_path, python, keras="legacy")), "--check",
                        home=home, cwd=tmp_path, timeout=90)
    assert checked.returncode == 4, checked.stderr
    assert "its tf_keras 2.20.0 does not match its TensorFlow 2.21.0" in checked.stderr


def test_plan_check_shows_keras_and_warns_of_model_fit_in_mirrored_mode(tmp_path, home):
    python = fake_venv(tmp_path / "v", tensorflow="2.21.0", keras="3.15.0", tf_keras="2.21.0")
    checked = tfcluster("plan", str(venv_spec(tmp_path, python)), "--check", home=home, cwd=tmp_path,
                        timeout=90)
    assert checked.returncode == 0, checked.stderr
    row = next(line for line in checked.stderr.splitlines() if line.startswith("local  "))
    assert "3.15.0 + tf_keras 2.21.0" in row
    warnings = [line for line in checked.stderr.splitlines() if "model.fit" in line]
    assert warnings == [("tfcluster: warning: mirrored mode: Keras 3.15 on local cannot run model.fit (train.py:2) under "
                         "MultiWorkerMirroredStrategy (keras-team/keras#20585): set train.keras: legacy "
                         "(tf_keras is installed)")]
    assert "preflight passed" in checked.stderr

    legacy = tfcluster("plan", str(venv_spec(tmp_path, python, keras="legacy")), "--check", home=home,
                       cwd=tmp_path, timeout=90)
    assert legacy.returncode == 0, legacy.stderr
    assert "model.fit" not in legacy.stderr and "preflight passed" in legacy.stderr


def test_train_warns_before_the_scripts_start_and_legacy_reaches_them(tmp_path, home):
    """The script imports no TensorFlow: `.fit(` in it is text, which is all the warning reads."""
    python = fake_venv(tmp_path / "v", tensorflow="2.21.0", keras="3.15.0", tf_keras="2.21.0")
    script = "import os\nprint('legacy keras:', os.environ.get('TF_USE_LEGACY_KERAS'))  # MultiWorkerMirroredStrategy model.fit(\n"
    ran = tfcluster("train", str(venv_spec(tmp_path, python, script=script)), home=home, cwd=tmp_path,
                    timeout=90)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    warning = ran.stderr.index("tfcluster: warning: mirrored mode: Keras 3.15 on local cannot run model.fit")
    assert warning < ran.stderr.index("Starting the script on 2 task(s)")
    assert all(f"worker:{i} │ legacy keras: None" in ran.stdout for i in range(2))

    legacy = tfcluster("train", str(venv_spec(tmp_path, python, keras="legacy", script=script)), home=home,
                       cwd=tmp_path, timeout=90)
    assert legacy.returncode == 0, legacy.stdout[-2000:] + legacy.stderr[-2000:]
    assert "model.fit" not in legacy.stderr
    assert all(f"worker:{i} │ legacy keras: 1" in legacy.stdout for i in range(2))
    assert not tagged_processes()


LOCAL_KERAS = shim_facts.installed_version(shim_facts.KERAS_DISTRIBUTIONS)


@pytest.mark.tf
@pytest.mark.timeout(240)
@pytest.mark.skipif(not is_keras3(SimpleNamespace(keras_version=LOCAL_KERAS)), reason="no Keras 3 here")
def test_up_warns_of_model_fit_in_coordinator_mode_and_starts_the_servers(tmp_path, home):
    """`up` starts only servers, but the script it is for calls model.fit: said before they start."""
    (tmp_path / "train.py").write_text(FIT_SCRIPT)
    spec = local_spec(tmp_path, mode="coordinator", script="train.py", chief=1)
    try:
        up = tfcluster("up", str(spec), home=home, cwd=tmp_path, timeout=180)
        assert up.returncode == 0, up.stderr
        minor = ".".join(LOCAL_KERAS.split(".")[:2])
        warning = up.stderr.index(f"tfcluster: warning: coordinator mode: Keras {minor} on local cannot run "
                                  "model.fit (train.py:2) under ParameterServerStrategy (keras-team/keras#18624)")
        assert warning < up.stderr.index("Starting 3 server(s)")
    finally:
        down = tfcluster("down", str(spec), home=home, cwd=tmp_path, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not tagged_processes()
