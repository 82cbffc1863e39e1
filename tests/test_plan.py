"""The planner: exact plans for every sample, determinism, placeholders, secrets."""
from __future__ import annotations

import json
import os
import random
import sys

import pytest

from tfcluster.errors import SpecError
from tfcluster.plan import (
    HOST_DIR,
    HostPlan,
    Plan,
    Restart,
    TaskPlan,
    build_plan,
    interpreter,
    plan_to_dict,
    redact_env,
)
from tfcluster.spec import check_train_files, load_spec, templates
from tfcluster.transport.options import SshOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(ROOT, "sample_clusters")
TEMPLATE = templates.template_path("between_graph")   # the repository's templates/, installed


def sample(name: str) -> Plan:
    spec = load_spec(os.path.join(SAMPLES, name))
    return build_plan(spec, files=check_train_files(spec))


def _env(job, index, chief, master, tf_config, cluster="local", workers="2", gpus="", extra=()):
    env = {
        "CUDA_VISIBLE_DEVICES": gpus, "PYTHONUNBUFFERED": "1", "TFCLUSTER_CLUSTER": cluster,
        "TFCLUSTER_IS_CHIEF": chief, "TFCLUSTER_JOB": job, "TFCLUSTER_NUM_WORKERS": workers,
        "TFCLUSTER_TASK_INDEX": str(index), "TF_CONFIG": tf_config, "TF_CPP_MIN_LOG_LEVEL": "0",
        **dict(extra),
    }
    if master:
        env["TFCLUSTER_MASTER"] = master
    return tuple(sorted(env.items()))


def _tf_config(cluster: dict, job: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": job, "index": index}},
                      sort_keys=True, separators=(",", ":"))


def test_local_sample_plan_is_exactly_one_ps_and_two_workers_on_this_machine():
    plan = sample("local.yaml")
    cluster = {"ps": ["localhost:22220"], "worker": ["localhost:22230", "localhost:22231"]}
    argv = ("between_graph.py", "--steps", "300")

    def task(job, index, port, chief, script):
        cfg = _tf_config(cluster, job, index)
        return TaskPlan(job=job, index=index, host="local", address="localhost", port=port, gpus=(),
                        is_chief=chief, runs_server=True, tf_config=cfg,
                        env=_env(job, index, "1" if chief else "0", f"grpc://localhost:{port}", cfg),
                        argv=argv if script else ())

    assert plan == Plan(
        name="local", mode="between-graph", python="python3", cluster_dir="~/.tfcluster/local",
        cluster=(("ps", ("localhost:22220",)), ("worker", ("localhost:22230", "localhost:22231"))),
        tasks=(task("ps", 0, 22220, False, False), task("worker", 0, 22230, True, True),
               task("worker", 1, 22231, False, True)),
        spec_digest=plan.spec_digest,
        all_hosts=(HostPlan(name="local", address="localhost", local=True, gpus=0,
                            python=sys.executable, bindir=HOST_DIR, ssh=None),),
        script=TEMPLATE,
        files=((os.path.realpath(TEMPLATE), "between_graph.py", os.path.getsize(TEMPLATE)),),
        restart=Restart("never", 3), timeout=None, args=("--steps", "300"),
    )
    assert len(plan.spec_digest) == 64
    # what `plan --commands` prints is exactly what runs: tfcluster's own interpreter here
    assert plan.command(plan.task("worker:1")) == (sys.executable, "between_graph.py", "--steps", "300")
    assert plan.command(plan.task("ps:0"), "server") == (sys.executable, f"{HOST_DIR}/tfserver.py")


@pytest.mark.parametrize("spec_python, local, expected", [
    ("python3", True, "/venv/bin/python"),       # the default on a local host: our own
    ("python3", False, "python3"),               # a remote host runs what the spec says
    ("/opt/py/bin/python", True, "/opt/py/bin/python"),  # an explicit choice is kept
])
def test_one_function_decides_the_interpreter(spec_python, local, expected):
    assert interpreter(spec_python, local, "/venv/bin/python") == expected


def test_ssh_hosts_carry_transport_options_and_ship_to_the_cluster_bin_dir():
    plan = build_plan(load_spec(os.path.join(SAMPLES, "loopback_ssh.yaml")), local_python="/venv/py")
    host = plan.host("h3")
    assert (host.local, host.python, host.bindir) == (False, "python3", "~/.tfcluster/loopback/bin")
    assert isinstance(host.ssh, SshOptions)
    assert plan.command(plan.task("worker:0"), "server") == ("python3", "~/.tfcluster/loopback/bin/tfserver.py")


def test_a_host_whose_gpus_no_task_takes_is_warned_of_by_plan(tmp_path):
    """`gpus: 4` on a host, and a worker there with neither `gpus:` nor `per_gpu`: it runs with an
    empty CUDA_VISIBLE_DEVICES, so on the CPU; plan says so (a ps there is meant for the CPU)."""
    from tests.helpers import tfcluster
    text = ("name: g\nhosts:\n  - {name: c, address: 10.0.0.1}\n  - {name: g0, address: 10.0.0.2, gpus: 4}\n"
            "  - {name: g1, address: 10.0.0.3, gpus: 2}\n"
            "jobs:\n  ps: {count: 1, hosts: [g1], port: 2222}\n  worker: {tasks: ['g0:2300', 'c:2300']JOB}\n"
            "train: {mode: between-graph, script: template:between_graph}\n")
    spec = tmp_path / "g.yaml"
    spec.write_text(text.replace("JOB", ""))
    plan = build_plan(load_spec(str(spec)), files=())
    said = ("host g0 has `gpus: 4` but none of its tasks takes one: worker:0 runs on the CPU "
            "(CUDA_VISIBLE_DEVICES=''); give the job `gpus: K` (K GPUs a task) or `per_gpu: true` (a task per GPU)")
    assert plan.idle_gpus() == [said]       # g1 holds only the ps; c has no GPU
    shown = tfcluster("plan", str(spec), home=tmp_path, cwd=tmp_path, timeout=60)
    assert shown.returncode == 0 and f"tfcluster: warning: {said}" in shown.stderr, shown.stderr
    spec.write_text(text.replace("JOB", ", gpus: 1").replace("address: 10.0.0.1}", "address: 10.0.0.1, gpus: 1}"))
    assert build_plan(load_spec(str(spec)), files=()).idle_gpus() == []


def test_plan_says_which_hosts_are_this_machine_and_how_the_others_are_reached(tmp_path):
    """A host at localhost is run without SSH, any other over SSH: the text says which, with
    the login, port, jump host and host-key policy each group is reached with."""
    from tfcluster.ui.views import reached
    spec = tmp_path / "mixed.yaml"
    spec.write_text(
        "name: mixed\nssh: {user: ubuntu, jump_host: 'jump@bastion:2200'}\n"
        "hosts:\n  - {name: me, address: localhost}\n"
        "  - {name: a, address: 127.0.0.2}\n  - {name: b, address: 127.0.0.3, ssh: {port: 2222, host_key_policy: accept-new}}\n"
        "jobs:\n  ps: {count: 1, hosts: [me], port: 2222}\n  chief: {count: 1, hosts: [a], port: 2300}\n"
        "  worker: {count: 1, hosts: [b], port: 2400}\n"
        "train: {mode: between-graph, script: template:between_graph}\n")
    plan = build_plan(load_spec(str(spec)), files=())

    assert reached(plan) == ("me is this machine (no SSH); "
                             "a over SSH (as ubuntu, through jump@bastion:2200, unknown host keys refused); "
                             "b over SSH (as ubuntu, port 2222, through jump@bastion:2200, unknown host keys: accept-new)")
    assert reached(sample("loopback_ssh.yaml")).endswith(
        "over SSH (as ~/.ssh/config names, else as you, port 2222, unknown host keys refused)")


def test_loopback_sample_gives_each_host_its_own_port():
    plan = sample("loopback_ssh.yaml")
    assert [(t.key, t.host, t.target, t.is_chief, t.runs_server, t.runs_script) for t in plan.tasks] == [
        ("ps:0", "h2", "127.0.0.2:23000", False, True, False),
        ("worker:0", "h3", "127.0.0.3:23001", True, True, True),
        ("worker:1", "h4", "127.0.0.4:23002", False, True, True),
    ]
    assert plan.hosts == ("h2", "h3", "h4")


def test_gpu_lab_sample_gives_one_gpu_per_worker_and_none_to_ps():
    plan = sample("gpu_lab.yaml")
    rows = [(t.key, t.target, t.gpus, dict(t.env)["CUDA_VISIBLE_DEVICES"]) for t in plan.tasks]
    assert rows == [
        ("ps:0", "10.1.0.10:2222", (), ""),
        ("ps:1", "10.1.0.10:2223", (), ""),
        *[(f"worker:{i}", f"10.1.0.1{1 + i // 4}:{2300 + i % 4}", (i % 4,), str(i % 4)) for i in range(8)],
    ]
    chief = plan.task("worker:0")
    assert plan.command(chief) == ("/opt/venv/bin/python", "between_graph.py", "--steps", "2000",
                                   "--model_dir", "~/.tfcluster/lab/ckpt")
    assert plan.restart == Restart("on-failure", 3)
    # between-graph: the script is a client of its task's server, which alone sees the GPU
    worker3 = plan.task("worker:3")
    assert dict(worker3.env)["CUDA_VISIBLE_DEVICES"] == "3"
    assert worker3.script_env == (("CUDA_VISIBLE_DEVICES", ""),)
    assert plan.task("ps:0").script_env == ()
    assert plan_to_dict(plan)["tasks"][2]["script_env"] == {"CUDA_VISIBLE_DEVICES": ""}


def test_secrets_are_redacted_in_the_json_plan_but_reach_the_task_env():
    plan = sample("gpu_lab.yaml")
    doc = plan_to_dict(plan)
    assert all(t["env"]["WANDB_API_KEY"] == "***" for t in doc["tasks"])
    assert "set-me" not in json.dumps(doc)
    assert dict(plan.task("worker:3").env)["WANDB_API_KEY"] == "set-me"
    assert redact_env({"HF_TOKEN": "x", "DB_PASSWORD": "y", "AWS_SECRET": "z", "PATHX": "ok"}) == {
        "HF_TOKEN": "***", "DB_PASSWORD": "***", "AWS_SECRET": "***", "PATHX": "ok"}


SPEC = """\
name: shuffle
hosts:
{hosts}
jobs:
{jobs}
train:
  mode: {mode}
  script: train.py
  args: ["--job={{job}}", "--task_index={{index}}", "--ps_hosts={{ps_hosts}}", "--worker_hosts={{worker_hosts}}", "--dir={{workdir}}/x", "{{{{literal}}}}"]
"""


def _write(tmp_path, hosts: list[str], jobs: list[str], mode: str = "classic", name: str = "s.yaml"):
    (tmp_path / "train.py").write_text("print('hi')\n")
    path = tmp_path / name
    path.write_text(SPEC.format(hosts="\n".join(hosts), jobs="\n".join(jobs), mode=mode))
    return str(path)


HOSTS = ["  - {name: a, address: 10.0.0.1}", "  - {name: b, address: 10.0.0.2}",
         "  - {name: c, address: 10.0.0.3}"]
JOBS = ["  ps: {count: 2, hosts: [a, b], port: 2222}", "  worker: {count: 3, hosts: [b, c], port: 3000}",
        "  chief: {tasks: ['c:4000']}"]


def _comparable(plan: Plan) -> Plan:
    import dataclasses
    return dataclasses.replace(plan, spec_digest="")


def test_plan_is_identical_whatever_the_order_hosts_and_jobs_are_written_in(tmp_path):
    reference = _comparable(build_plan(load_spec(_write(tmp_path, HOSTS, JOBS, name="ref.yaml"))))
    rng = random.Random(7)
    for i in range(20):
        hosts, jobs = HOSTS[:], JOBS[:]
        rng.shuffle(hosts)
        rng.shuffle(jobs)
        plan = build_plan(load_spec(_write(tmp_path, hosts, jobs, name=f"s{i}.yaml")))
        assert _comparable(plan) == reference


def test_classic_mode_expands_placeholders_per_task_and_runs_scripts_everywhere(tmp_path):
    plan = build_plan(load_spec(_write(tmp_path, HOSTS, JOBS)))
    assert [t.key for t in plan.tasks] == ["chief:0", "ps:0", "ps:1", "worker:0", "worker:1", "worker:2"]
    assert not any(t.runs_server for t in plan.tasks)
    ps1 = plan.task("ps:1")
    assert ps1.argv == ("train.py", "--job=ps", "--task_index=1",
                            "--ps_hosts=10.0.0.1:2222,10.0.0.2:2222",
                            "--worker_hosts=10.0.0.2:3000,10.0.0.3:3000,10.0.0.2:3001",
                            "--dir=~/.tfcluster/shuffle/x", "{literal}")
    assert plan.task("chief:0").is_chief and not plan.task("worker:0").is_chief
    assert json.loads(plan.task("worker:2").tf_config) == {
        "cluster": {"chief": ["10.0.0.3:4000"], "ps": ["10.0.0.1:2222", "10.0.0.2:2222"],
                    "worker": ["10.0.0.2:3000", "10.0.0.3:3000", "10.0.0.2:3001"]},
        "task": {"type": "worker", "index": 2}}


@pytest.mark.parametrize("mode,servers,scripts", [
    ("between-graph", ["chief:0", "ps:0", "ps:1", "worker:0", "worker:1", "worker:2"],
     ["chief:0", "worker:0", "worker:1", "worker:2"]),
    ("coordinator", ["ps:0", "ps:1", "worker:0", "worker:1", "worker:2"], ["chief:0"]),
])
def test_between_graph_serves_every_job_and_the_coordinator_only_ps_and_workers(tmp_path, mode, servers, scripts):
    plan = build_plan(load_spec(_write(tmp_path, HOSTS, JOBS, mode=mode)))
    assert [t.key for t in plan.tasks if t.runs_server] == servers
    assert [t.key for t in plan.tasks if t.runs_script] == scripts


def test_mirrored_mode_has_no_servers_and_no_ps_in_tf_config(tmp_path):
    jobs = ["  worker: {count: 2, hosts: [a, b], port: 3000}"]
    plan = build_plan(load_spec(_write(tmp_path, HOSTS, jobs, mode="mirrored")))
    assert not any(t.runs_server for t in plan.tasks)
    assert [t.key for t in plan.tasks if t.runs_script] == ["worker:0", "worker:1"]
    assert json.loads(plan.task("worker:1").tf_config)["cluster"] == {
        "worker": ["10.0.0.1:3000", "10.0.0.2:3000"]}
    assert "TFCLUSTER_MASTER" not in dict(plan.task("worker:0").env)


def test_spec_env_overrides_defaults_and_may_not_set_tfcluster_variables(tmp_path):
    (tmp_path / "train.py").write_text("")
    path = tmp_path / "e.yaml"
    rest = ("hosts: [{name: a, address: 10.0.0.1}]\n"
            "jobs: {ps: {count: 1, hosts: [a], port: 1}, worker: {count: 1, hosts: [a], port: 2}}\n")
    path.write_text("name: e\nenv: {TF_CPP_MIN_LOG_LEVEL: '2', TFCLUSTER_STDOUT_FLUSH: '0', FOO: bar,\n"
                    "      TFCLUSTER_SERVER_IMPORT: full}\n" + rest)     # the knobs env: may set
    env = dict(build_plan(load_spec(str(path))).task("worker:0").env)
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "2" and env["FOO"] == "bar" and env["TFCLUSTER_STDOUT_FLUSH"] == "0"
    assert env["TFCLUSTER_SERVER_IMPORT"] == "full"
    assert json.loads(env["TF_CONFIG"])["task"] == {"type": "worker", "index": 0}
    # what tfcluster sets per task was dropped without a word; now the spec says so
    for name, why in (("TF_CONFIG", "tfcluster writes each task's TF_CONFIG from jobs:"),
                      ("CUDA_VISIBLE_DEVICES", "tfcluster gives each task its GPUs"),
                      ("TFCLUSTER_TASK_INDEX", "tfcluster sets TFCLUSTER_TASK_INDEX for each task")):
        path.write_text(f"name: e\nenv:\n  FOO: bar\n  {name}: x\n" + rest)
        with pytest.raises(SpecError) as bad:
            load_spec(str(path))
        assert str(bad.value) == f"{path}:4: env.{name}: {name} is set by tfcluster for each task"
        assert bad.value.hint.startswith(why)
