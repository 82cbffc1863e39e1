"""`render --to tfjob` (tfcluster/engines/tfjob.py): every sample spec as a TFJob checked by
the training operator's own Python models and its Go rules, the mapping of tfcluster's
policies, what is refused, and the shipped launcher run from the rendered ConfigMap as the
operator would start it (one process per pod, on loopback).
"""
from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import yaml

from tests.helpers import need_tensorflow, tagged_processes
from tests.tf_launch import HandLaunch, free_ports
from tfcluster.engines import render
from tfcluster.engines.bundle import bundle_files, launch_config
from tfcluster.engines.tfjob import CONFIGMAP_LIMIT, MOUNT, check_operator_rules, config_keys, render_tfjob
from tfcluster.errors import UsageError
from tfcluster.plan import build_plan
from tfcluster.spec import load_spec, preview_train_files

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = sorted((ROOT / "sample_clusters").glob("*.yaml"))
IMAGE = "tensorflow/tensorflow:2.15.0"
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def load_plan(path):
    """As the CLI loads a spec for `render`: with the files a run would ship."""
    spec = load_spec(str(path))
    files, problem = preview_train_files(spec)
    return build_plan(spec, files=files, files_problem=problem)


def rendered(plan, image=IMAGE, namespace="default"):
    """(the file's text, [ConfigMap, TFJob, NetworkPolicy]) of the one file a render writes."""
    out = render_tfjob(plan, image=image, namespace=namespace)
    assert len(out.files) == 1
    text = out.files[0][1]
    return text, list(yaml.safe_load_all(text))


def write_spec(tmp_path, *, name="t", mode="between-graph", jobs=None, train=""):
    (tmp_path / "train.py").write_text("print('hi')\n")
    jobs = jobs or ["  ps: {count: 1, hosts: [h], port: 22220}",
                    "  worker: {count: 2, hosts: [h], port: 22230}"]
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nhosts:\n  - {{name: h, address: localhost}}\njobs:\n"
                    + "\n".join(jobs) + f"\ntrain:\n  mode: {mode}\n  script: train.py\n{train}")
    return path


def counts(plan) -> dict[str, int]:
    """The plan's tasks per operator replica type."""
    types = {"chief": "Chief", "ps": "PS", "worker": "Worker", "evaluator": "Evaluator"}
    return dict(Counter(types[t.job] for t in plan.tasks))


def images(tfjob) -> set[str]:
    return {c["image"] for s in tfjob["spec"]["tfReplicaSpecs"].values()
            for c in s["template"]["spec"]["containers"]}


def mounted_files(configmap, replica_spec) -> dict[str, bytes]:
    """Path under the mount -> bytes, as the kubelet projects the ConfigMap volume."""
    (volume,) = replica_spec["template"]["spec"]["volumes"]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    data, binary = configmap.get("data", {}), configmap.get("binaryData", {})
    out = {}
    for item in volume["configMap"]["items"]:
        key = item["key"]
        out[item["path"]] = data[key].encode() if key in data else base64.b64decode(binary[key])
    return out


# -- every sample, through the operator's models and rules -------------------------------------

@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_every_sample_is_a_tfjob_the_operator_accepts(path):
    pytest.importorskip("kubeflow.training")
    from kubeflow.training.api_client import ApiClient
    from kubernetes.client import ApiClient as K8sApiClient

    plan = load_plan(path)
    text, docs = rendered(plan)
    assert [d["kind"] for d in docs] == ["ConfigMap", "TFJob", "NetworkPolicy"]
    configmap, tfjob, _ = docs

    # The SDK's models check required fields and types; serialising the models back must
    # give the very same dict, so no field is one they do not know (a typo would vanish).
    api = ApiClient()
    model = api._ApiClient__deserialize(tfjob, "KubeflowOrgV1TFJob")
    assert api.sanitize_for_serialization(model) == tfjob
    k8s = K8sApiClient()
    cm_model = k8s._ApiClient__deserialize(configmap, "V1ConfigMap")
    assert k8s.sanitize_for_serialization(cm_model) == configmap

    # The Go rules, by our checker and independently here.
    assert check_operator_rules(docs) == []
    assert tfjob["apiVersion"] == "kubeflow.org/v1" and tfjob["kind"] == "TFJob"
    name = tfjob["metadata"]["name"]
    assert DNS1035.fullmatch(name) and len(name) <= 63
    specs = tfjob["spec"]["tfReplicaSpecs"]
    assert len([t for t in specs if t in ("Chief", "Master")]) <= 1
    assert all(specs[t]["replicas"] <= 1 for t in specs if t in ("Chief", "Master"))
    for rtype, spec in specs.items():
        (c,) = spec["template"]["spec"]["containers"]
        assert c["name"] == "tensorflow" and c["image"] == IMAGE
        assert c["command"] == ["python3", "/opt/tfcluster/bundle/launch.py", "tfjob"]
        assert c["ports"] == [{"name": "tfjob-port", "containerPort": 2222}]
        assert c["volumeMounts"] == [{"name": "tfcluster-bundle", "mountPath": MOUNT, "readOnly": True}]
        assert "TF_CONFIG" not in [e["name"] for e in c.get("env", [])]
        # every replica sees exactly the bundle train would ship, byte for byte
        assert mounted_files(configmap, spec) == bundle_files(plan, launch_config(plan, "tfjob"))
    assert {t: s["replicas"] for t, s in specs.items()} == counts(plan)
    assert "TF_CONFIG" not in yaml.safe_dump(tfjob)      # the operator writes it
    config = json.loads(configmap["data"]["tfcluster-launch.json"])
    assert "TF_CONFIG" not in config["env"]
    assert configmap["metadata"] == {"name": f"{name}-files", "namespace": "default"}
    assert text == rendered(load_plan(path))[0]        # stable, byte for byte


def test_gpu_lab_maps_gpus_restarts_cleanup_and_keeps_the_secret_out():
    plan = load_plan(ROOT / "sample_clusters" / "gpu_lab.yaml")
    out = render_tfjob(plan, image=IMAGE, namespace="ml")
    text = out.files[0][1]
    configmap, tfjob, _ = yaml.safe_load_all(text)
    specs = tfjob["spec"]["tfReplicaSpecs"]
    assert {t: s["replicas"] for t, s in specs.items()} == {"PS": 2, "Worker": 8}
    worker = specs["Worker"]["template"]["spec"]["containers"][0]
    ps = specs["PS"]["template"]["spec"]["containers"][0]
    assert worker["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert "resources" not in ps
    assert {s["restartPolicy"] for s in specs.values()} == {"OnFailure"}
    assert tfjob["spec"]["runPolicy"] == {"cleanPodPolicy": "Running", "backoffLimit": 3}
    assert "successPolicy" not in tfjob["spec"]      # between-graph: worker 0 ends the job
    assert tfjob["metadata"] == {"name": "lab", "namespace": "ml"}
    for c in (worker, ps):
        env = {e["name"]: e for e in c["env"]}
        assert env["WANDB_API_KEY"] == {"name": "WANDB_API_KEY", "valueFrom": {
            "secretKeyRef": {"name": "lab-secrets", "key": "WANDB_API_KEY"}}}
        assert env["TF_CPP_MIN_LOG_LEVEL"] == {"name": "TF_CPP_MIN_LOG_LEVEL", "value": "2"}
    everything = text + out.apply + "\n".join(out.notes)
    assert "set-me" not in everything
    assert out.apply == ("kubectl -n ml create secret generic lab-secrets --from-literal=WANDB_API_KEY=..."
                         " && kubectl apply --server-side -f lab-tfjob.yaml")
    assert out.files[0][0] == "lab-tfjob.yaml"
    assert any("lab-secrets" in n for n in out.notes)
    # the header shows the args as the launcher fills them from the operator's TF_CONFIG
    assert "#   Worker: python3 between_graph.py --steps 2000 --model_dir '~/.tfcluster/lab/ckpt'" in text
    assert "#   worker: lab-worker-{0..7}.ml.svc:2222" in text


@pytest.mark.parametrize("policy,expected", [("never", "Never"), ("on-failure", "OnFailure"),
                                             ("exit-code", "ExitCode")])
def test_restart_policy_max_restarts_and_timeout(tmp_path, policy, expected):
    path = write_spec(tmp_path, train=f"  restart: {{policy: {policy}, max_restarts: 5}}\n"
                                      "  timeout: 90.5s\n")
    _, (_, tfjob, _) = rendered(load_plan(path))
    assert {s["restartPolicy"] for s in tfjob["spec"]["tfReplicaSpecs"].values()} == {expected}
    run = tfjob["spec"]["runPolicy"]
    assert run["activeDeadlineSeconds"] == 91 and run["cleanPodPolicy"] == "Running"
    assert run.get("backoffLimit") == (None if policy == "never" else 5)


def test_every_pod_has_a_termination_grace_the_launchers_stop_fits_in(tmp_path):
    """A pod's end is SIGTERM: the launcher stops the script (it saves) and KILLs it 10 s
    later; the pod's grace must outlast that stop."""
    from tfcluster.engines import launch, tfjob as rendering

    _, (_, tfjob, _) = rendered(load_plan(write_spec(tmp_path)))
    graces = {s["template"]["spec"]["terminationGracePeriodSeconds"] for s in tfjob["spec"]["tfReplicaSpecs"].values()}
    assert graces == {rendering.TERMINATION_GRACE} and rendering.TERMINATION_GRACE > launch.STOP_GRACE + 5


def test_a_longer_stop_grace_lengthens_every_pods_grace_and_reaches_the_launcher(tmp_path):
    """train.stop_grace: the launcher waits that long between SIGTERM and KILL, and the pod's
    grace outlasts it."""
    from tfcluster.engines import launch

    plan = load_plan(write_spec(tmp_path, train="  stop_grace: 60s\n"))
    _, (_, tfjob, _) = rendered(plan)
    graces = {s["template"]["spec"]["terminationGracePeriodSeconds"] for s in tfjob["spec"]["tfReplicaSpecs"].values()}
    assert graces == {80}
    assert launch_config(plan, "tfjob")["stop_grace"] == 60.0 != launch.STOP_GRACE


def test_no_timeout_means_no_deadline(tmp_path):
    _, (_, tfjob, _) = rendered(load_plan(write_spec(tmp_path)))
    assert "activeDeadlineSeconds" not in tfjob["spec"]["runPolicy"]


def test_image_comes_from_the_argument_then_train_image_else_it_is_refused(tmp_path):
    plan = load_plan(write_spec(tmp_path))
    with pytest.raises(UsageError) as exc:
        render(plan, "tfjob", image=None)
    assert "image" in exc.value.message and "--image IMG or set train.image" in exc.value.hint
    assert exc.value.exit_code == 2
    with pytest.raises(UsageError):
        render_tfjob(plan, image="two words", namespace="default")
    plan = load_plan(write_spec(tmp_path, train="  image: registry.example/tf:1\n"))
    for image, expected in ((None, "registry.example/tf:1"), ("mine:2", "mine:2")):
        _, (_, tfjob, _) = rendered(plan, image=image)
        assert images(tfjob) == {expected}


def test_a_name_is_made_dns_1035_where_it_can_be_and_refused_where_not(tmp_path):
    _, (configmap, tfjob, _) = rendered(load_plan(write_spec(tmp_path, name="My_Lab.v2")))
    assert tfjob["metadata"]["name"] == "my-lab-v2"
    assert configmap["metadata"]["name"] == "my-lab-v2-files"
    with pytest.raises(UsageError) as exc:
        rendered(load_plan(write_spec(tmp_path, name="9lab")))
    assert "'9lab'" in exc.value.message and "DNS-1035" in exc.value.message
    long = "a" * 58                     # valid alone; a-…-worker-1 is 67 characters
    with pytest.raises(UsageError) as exc:
        rendered(load_plan(write_spec(tmp_path, name=long)))
    assert f"{long}-worker-1" in exc.value.message and "63" in exc.value.message
    with pytest.raises(UsageError):
        rendered(load_plan(write_spec(tmp_path)), namespace="Bad_NS")


def test_files_over_the_configmap_limit_are_refused_naming_the_limit_and_the_biggest(tmp_path):
    (tmp_path / "big.bin").write_bytes(os.urandom(CONFIGMAP_LIMIT))
    plan = load_plan(write_spec(tmp_path, train="  files: [big.bin]\n"))
    with pytest.raises(UsageError) as exc:
        render_tfjob(plan, image=IMAGE, namespace="default")
    assert "1048576" in exc.value.message and "1 MiB" in exc.value.message
    assert "big.bin (1048576 bytes)" in exc.value.message


def test_subdirectories_and_binary_files_are_flattened_keys_with_items(tmp_path):
    pytest.importorskip("kubernetes")
    from kubernetes.client import ApiClient as K8sApiClient

    blob = bytes(range(256))
    (tmp_path / "data" / "deep").mkdir(parents=True)
    (tmp_path / "data" / "deep" / "w.bin").write_bytes(blob)
    (tmp_path / "data" / "notes.txt").write_text("ünïcode\n  indented\ttab\n")
    (tmp_path / "data_notes.txt").write_text("top\n")   # what data/notes.txt would flatten to
    plan = load_plan(write_spec(tmp_path, train="  files: [data/, data_notes.txt]\n"))
    text, (configmap, tfjob, _) = rendered(plan)
    assert check_operator_rules([configmap, tfjob]) == []
    keys = config_keys(bundle_files(plan, launch_config(plan, "tfjob")))
    assert keys["data_notes.txt"] == "data_notes.txt" and keys["train.py"] == "train.py"
    assert re.fullmatch(r"[-._a-zA-Z0-9]+", keys["data/notes.txt"])
    assert len(set(keys.values())) == len(keys)
    assert base64.b64decode(configmap["binaryData"][keys["data/deep/w.bin"]]) == blob
    assert configmap["data"][keys["data/notes.txt"]] == "ünïcode\n  indented\ttab\n"
    files = mounted_files(configmap, tfjob["spec"]["tfReplicaSpecs"]["Worker"])
    assert files["data/deep/w.bin"] == blob and files["data_notes.txt"] == b"top\n"
    k8s = K8sApiClient()
    model = k8s._ApiClient__deserialize(configmap, "V1ConfigMap")
    assert k8s.sanitize_for_serialization(model) == configmap


def test_check_operator_rules_finds_what_the_webhook_refuses(tmp_path):
    _, docs = rendered(load_plan(write_spec(tmp_path)))

    def problems(change) -> str:
        copy = json.loads(json.dumps(docs))
        change(*copy[:2])
        return "\n".join(check_operator_rules(copy))

    def worker(tfjob):
        return tfjob["spec"]["tfReplicaSpecs"]["Worker"]

    def container(tfjob):
        return worker(tfjob)["template"]["spec"]["containers"][0]

    assert "no container named 'tensorflow'" in problems(lambda cm, j: container(j).update(name="tf"))
    assert "image: required" in problems(lambda cm, j: container(j).update(image=""))
    assert "metadata.name 'Bad_Name'" in problems(lambda cm, j: j["metadata"].update(name="Bad_Name"))
    assert "Chief.replicas: at most 1" in problems(
        lambda cm, j: j["spec"]["tfReplicaSpecs"].update(Chief={**worker(j), "replicas": 2}))
    assert "at most one Chief or Master" in problems(
        lambda cm, j: j["spec"]["tfReplicaSpecs"].update(Chief=worker(j), Master=worker(j)))
    assert "unknown replica type" in problems(
        lambda cm, j: j["spec"]["tfReplicaSpecs"].update(Workers=worker(j)))
    assert "must match" in problems(lambda cm, j: cm["data"].update({"a/b": "x"}))
    assert f"at most {CONFIGMAP_LIMIT}" in problems(
        lambda cm, j: cm["data"].update(big="x" * CONFIGMAP_LIMIT))


CHIEF, PS = "  chief: {count: 1, hosts: [h], port: 22210}", "  ps: {count: 2, hosts: [h], port: 22220}"
WORKERS = "  worker: {count: 2, hosts: [h], port: 22230}"


@pytest.mark.parametrize("mode,jobs,previewed,success,note", [
    ("coordinator", [CHIEF, PS, WORKERS], ["Chief"], None, "the script runs on the chief only"),
    ("mirrored", [WORKERS], ["Worker"], "AllWorkers", None),
    ("mirrored", [CHIEF, WORKERS], ["Chief", "Worker"], None, "ends the job when the chief succeeds"),
    ("classic", [PS, WORKERS, "  evaluator: {count: 1, hosts: [h], port: 22240}"],
     ["PS", "Worker", "Evaluator"], "AllWorkers", "evaluator: the operator lists it"),
])
def test_each_mode_renders_its_replicas_success_policy_script_preview_and_notes(tmp_path, mode, jobs, previewed,
                                                                                  success, note):
    train = '  args: ["--ps={ps_hosts}", "--me={job}:{index}", "--n={num_workers}"]\n'
    plan = load_plan(write_spec(tmp_path, mode=mode, jobs=jobs, train=train))
    out = render_tfjob(plan, image=IMAGE, namespace="ns")
    text = out.files[0][1]
    _, tfjob, _ = yaml.safe_load_all(text)
    types = counts(plan)
    assert {t: s["replicas"] for t, s in tfjob["spec"]["tfReplicaSpecs"].items()} == types
    assert ("PS" in types) == (mode != "mirrored")
    assert tfjob["spec"].get("successPolicy") == success
    shown = re.findall(r"^#   (\w+): python3 train\.py (.*)$", text, re.M)
    ps = ",".join(f"t-ps-{i}.ns.svc:2222" for i in range(types.get("PS", 0)))
    assert shown == [(t, f"--ps={ps} '--me={t.lower()}:{{index}}' --n=2") for t in previewed]
    mode_notes = [n for n in out.notes if n.startswith((mode, "evaluator"))]
    if note:
        assert any(note in n for n in mode_notes), mode_notes
    else:
        assert mode_notes == [], mode_notes


def test_rendering_connects_nowhere_and_the_package_never_imports_the_sdks():
    # gpu_lab's hosts sit behind a jump host that does not exist: any connection, name
    # look-up or process start during render would show in the audit events.
    code = (
        "import sys\n"
        "seen = []\n"
        "sys.addaudithook(lambda e, a: seen.append(e) if e.startswith(('socket.', 'subprocess.',"
        " 'os.exec', 'os.posix_spawn', 'os.fork')) else None)\n"
        "from tfcluster.engines import render\n"
        "from tfcluster.plan import build_plan\n"
        "from tfcluster.spec import load_spec, preview_train_files\n"
        f"spec = load_spec({str(ROOT / 'sample_clusters' / 'gpu_lab.yaml')!r})\n"
        "files, problem = preview_train_files(spec)\n"
        "out = render(build_plan(spec, files=files, files_problem=problem), 'tfjob', image='i:1')\n"
        "assert out.files and not seen, seen\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('kubeflow', 'kubernetes')]\n"
        "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr


# -- the launcher, from the rendered ConfigMap, as the operator starts it -------------------------

@pytest.mark.tf
def test_the_rendered_bundle_trains_when_started_as_the_operator_would(tmp_path):
    need_tensorflow()
    plan = load_plan(ROOT / "sample_clusters" / "local.yaml")
    _, (configmap, tfjob, _) = rendered(plan)
    specs = tfjob["spec"]["tfReplicaSpecs"]
    mount = tmp_path / "bundle"     # the ConfigMap volume: read-only (checked unchanged at the end)
    for path, data in mounted_files(configmap, specs["Worker"]).items():
        (mount / path).parent.mkdir(parents=True, exist_ok=True)
        (mount / path).write_bytes(data)
        (mount / path).chmod(0o444)
    mount.chmod(0o555)
    before = tree(mount)
    # The operator's TF_CONFIG, with loopback addresses: its Service names do not resolve here.
    ports = iter(free_ports(sum(s["replicas"] for s in specs.values())))
    cluster = {t.lower(): [f"127.0.0.1:{next(ports)}" for _ in range(s["replicas"])]
               for t, s in specs.items()}
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    tag = f"test:tfjob:{os.getpid()}"
    seen: set[int] = set()
    launch = HandLaunch(tmp_path / "logs", tag=tag)
    try:
        procs = {}
        for rtype, spec in specs.items():
            (c,) = spec["template"]["spec"]["containers"]
            assert c["command"][0] == "python3" and c["command"][1].startswith(MOUNT + "/")
            argv = [sys.executable, str(mount) + c["command"][1][len(MOUNT):], *c["command"][2:]]
            for i in range(spec["replicas"]):
                job = rtype.lower()
                env = {**os.environ, **{e["name"]: e["value"] for e in c.get("env", [])},
                       "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": job, "index": i},
                                                "environment": "cloud"}),
                       "TMPDIR": str(scratch), "TFCLUSTER_JOB_ID": f"{tag}:{job}:{i}"}
                procs[f"{job}:{i}"] = launch.start(f"{job}-{i}", argv, env)
        workers = [p for k, p in procs.items() if k.startswith("worker:")]
        deadline = time.monotonic() + 120
        while any(p.returncode is None for p in workers) and time.monotonic() < deadline:
            seen |= descendants(procs.values())
            time.sleep(0.5)
        outputs = {k: p.output() for k, p in procs.items()}
        assert [p.returncode for p in workers] == [0, 0], outputs
        out = outputs["worker:0"]
        assert re.search(r"^worker:0 │ tfcluster-result: global_step=300 loss=", out, re.M), out
        assert re.search(r"^worker:1 │ step=\d+ loss=", outputs["worker:1"], re.M)
        assert "worker:0 │ tfcluster: exited with code 0" in out
        ps = procs["ps:0"]
        assert ps.returncode is None, outputs["ps:0"]     # a ps serves until deleted
        seen |= descendants([ps])
        assert psutil.Process(ps.popen.pid).children(), "the ps launcher runs no TF server"
        ps.popen.terminate()                                # what deleting its pod does
        assert ps.popen.wait(30) == 143
        assert "tfcluster: server ps:0 listening on" in ps.output()
    finally:
        launch.kill_all()
        mount.chmod(0o755)
    left = [pid for pid in seen if alive(pid)]
    assert not left, f"processes left: {left}"
    assert not [t for t in tagged_processes().values() if t.startswith(tag)]
    assert list(scratch.iterdir()) == []            # each launcher removed its private copy
    assert tree(mount) == before


def descendants(procs) -> set[int]:
    """The pids of `procs` and of everything they started, as far as still running."""
    found = set()
    for p in procs:
        try:
            found |= {p.popen.pid, *(c.pid for c in psutil.Process(p.popen.pid).children(True))}
        except psutil.NoSuchProcess:
            pass
    return found


def tree(root: Path) -> list:
    return sorted((str(p.relative_to(root)), p.read_bytes() if p.is_file() else None)
                  for p in root.rglob("*"))


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_tfjob_closes_tf_ports_to_other_pods_with_a_network_policy_unless_tf_ports_is_open(tmp_path):
    """Only the job's own pods (the operator's job-name label) reach its pods, on the TF port."""
    text, docs = rendered(load_plan(write_spec(tmp_path, name="lab")), namespace="ml")
    policy = docs[2]
    pods = {"matchLabels": {"training.kubeflow.org/job-name": "lab"}}
    assert policy == {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                      "metadata": {"name": "lab-tf-ports", "namespace": "ml"},
                      "spec": {"podSelector": pods, "policyTypes": ["Ingress"],
                               "ingress": [{"from": [{"podSelector": pods}],
                                            "ports": [{"protocol": "TCP", "port": 2222}]}]}}
    spec = write_spec(tmp_path, name="lab")
    spec.write_text(spec.read_text() + "tf_ports: open\n")
    out = render_tfjob(load_plan(spec), image=IMAGE, namespace="ml")
    assert [d["kind"] for d in yaml.safe_load_all(out.files[0][1])] == ["ConfigMap", "TFJob"]
    assert any(n.startswith("tf_ports: open: no NetworkPolicy") for n in out.notes)
