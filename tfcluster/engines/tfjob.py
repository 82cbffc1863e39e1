"""`render --to tfjob`: the plan as a Kubeflow TFJob (training-operator v1.x, kubeflow.org/v1)
and a ConfigMap with what every pod runs (docs/design/engines.md, "Other engines").

Every replica runs the shipped launcher from the ConfigMap, mounted read-only at
/opt/tfcluster/bundle: it reads the TF_CONFIG the operator writes, fills train.args from it
and starts the task's server and script as `train` would. Nothing here connects anywhere.

What the operator is given for what tfcluster does itself: MAPPING (for the README).
"""
from __future__ import annotations

import base64
import math
import re
import string

import yaml

from tfcluster.engines import Rendered
from tfcluster.engines.bundle import LAUNCHER, bundle_files, launch_config, split_env
from tfcluster.errors import UsageError
from tfcluster.plan import SCRIPT_JOBS, Plan
from tfcluster.plan.policy import CHIEF_ENDS_RUN
from tfcluster.safetext import escape, shell_join

API_VERSION = "kubeflow.org/v1"
KIND = "TFJob"
CONTAINER = "tensorflow"          # the container the operator configures (TFJobDefaultContainerName)
PORT_NAME, PORT = "tfjob-port", 2222   # TFJobDefaultPortName, TFJobDefaultPort
JOB_LABEL = "training.kubeflow.org/job-name"   # the operator's label on every pod of a job
MOUNT = "/opt/tfcluster/bundle"
VOLUME = "tfcluster-bundle"
COMMAND = ["python3", f"{MOUNT}/{LAUNCHER}", "tfjob"]
GPU = "nvidia.com/gpu"
# tfcluster's jobs in manifest order -> the operator's replica types
REPLICA_TYPES = {"chief": "Chief", "ps": "PS", "worker": "Worker", "evaluator": "Evaluator"}
KNOWN_TYPES = ("Chief", "Master", "PS", "Worker", "Evaluator")   # what the operator knows

# A pod's end, a node drained or a spot node taken back, is SIGTERM to its launcher, which
# stops the script with SIGTERM (the script saves) and KILLs it train.stop_grace (10 s by
# default) later (engines/launch.py); the pod's grace covers that stop and the server's after
# it, with GRACE_ROOM to spare, and is never under Kubernetes' own default, 30 s. A spot
# node's shutdown may leave less (GKE: 30 s for the whole node), which no grace can lengthen.
TERMINATION_GRACE = 30
GRACE_ROOM = 20


def termination_grace(stop_grace: float) -> int:
    return max(TERMINATION_GRACE, math.ceil(stop_grace) + GRACE_ROOM)

RESTART_POLICIES = {"never": "Never", "on-failure": "OnFailure", "exit-code": "ExitCode"}
CONFIGMAP_LIMIT = 1 << 20         # bytes over data + binaryData values (the API server's rule)
NAME_MAX = 63

MAPPING = (
    ("train.restart.policy never / on-failure / exit-code",
     "restartPolicy Never / OnFailure / ExitCode of every replica type (ExitCode, like "
     "exit-code, retries exits 128-255 only)"),
    ("train.restart.max_restarts", "spec.runPolicy.backoffLimit (the operator counts the "
     "restarts of the whole job, tfcluster those of each task); left out under never"),
    ("train.timeout", "spec.runPolicy.activeDeadlineSeconds, rounded up to whole seconds"),
    ("a host taken back (drain, spot): SIGTERM, the scripts save",
     "terminationGracePeriodSeconds in every pod: train.stop_grace + 20 s, at least 30 s: the "
     "launcher's stop (SIGTERM to the script, KILL train.stop_grace later) fits in it"),
    ("ps (and coordinator workers) serve until the run ends",
     "spec.runPolicy.cleanPodPolicy: Running: the operator deletes the pods still running "
     "when the job ends"),
    ("mirrored / classic without a chief: every worker must succeed",
     "spec.successPolicy: AllWorkers (with a chief the job ends with the chief)"),
    ("a task's GPUs", f"{GPU} limit per replica type, the most any of its tasks has; ps none"),
    ("env", "the container's env; secret names as secretKeyRef to the Secret <name>-secrets"),
    ("train.script, train.files", f"ConfigMap <name>-files, mounted read-only at {MOUNT}"),
)

_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?\Z")
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_KEY = re.compile(r"[-._a-zA-Z0-9]+\Z")
_NOT_KEY = re.compile(r"[^-._a-zA-Z0-9]")
_NAME_RULE = ("a DNS-1035 label: lower-case letters, digits and '-', starting with a letter, "
              f"ending with a letter or digit, at most {NAME_MAX} characters")


def render_tfjob(plan: Plan, *, image: str | None, namespace: str) -> Rendered:
    """One YAML file: the ConfigMap, then the TFJob. UsageError for what cannot be expressed."""
    image = image or plan.image
    if not image or not image.strip() or any(c.isspace() or not c.isprintable() for c in image):
        raise UsageError(f"{plan.name}: a TFJob needs a container image with TensorFlow"
                         + (f", got {escape(repr(image))}" if image else ""),
                         hint="pass --image IMG or set train.image in the spec, e.g. "
                              "tensorflow/tensorflow:2.15.0")
    if not _DNS1123_LABEL.fullmatch(namespace) or len(namespace) > NAME_MAX:
        raise UsageError(f"namespace {escape(repr(namespace))} is not a Kubernetes namespace name "
                         f"(lower-case letters, digits and '-', at most {NAME_MAX} characters)")
    name = job_name(plan)
    files = bundle_files(plan, launch_config(plan, "tfjob"))
    _check_size(files)
    public, secret = split_env(plan)
    docs = [_configmap(name, namespace, files), _tfjob(plan, name, namespace, image, files,
                                                       public, secret)]
    if plan.tf_ports != "open":
        docs.append(network_policy(name, namespace))
    problems = check_operator_rules(docs)
    if problems:
        raise UsageError(f"{plan.name}: the rendered TFJob breaks the operator's rules: "
                         + "; ".join(problems))
    out = f"{name}-tfjob.yaml"
    text = _header(plan, name, namespace) + _escaped(yaml.dump_all(
        docs, Dumper=_Dumper, sort_keys=False, explicit_start=True, allow_unicode=True, width=100))
    # server-side: a client-side apply copies the object into an annotation (256 KiB at most)
    apply = f"kubectl apply --server-side -f {out}"
    if secret:
        apply = f"{_secret_command(name, namespace, secret)} && {apply}"
    return Rendered(files=((out, text),), apply=apply, notes=_notes(plan, name, namespace, secret))


def job_name(plan: Plan) -> str:
    """The spec's name as a TFJob name: lower-cased, '_' and '.' as '-'; UsageError if that
    is no DNS-1035 label, or makes a pod's name (<name>-<type>-<index>) longer than 63."""
    name = plan.name.lower().replace("_", "-").replace(".", "-")
    if not _DNS1035.fullmatch(name) or len(name) > NAME_MAX:
        shown = f" ({name!r})" if name != plan.name else ""
        raise UsageError(f"spec name {plan.name!r}{shown} cannot name a TFJob: it must be "
                         + _NAME_RULE, hint="change name: in the spec")
    longest = sorted([name, *(_pod(name, t.job, t.index) for t in plan.tasks)], key=len)[-1]
    if len(longest) > NAME_MAX:
        raise UsageError(f"spec name {plan.name!r} is too long for a TFJob: the operator names a "
                         f"pod and its Service {longest!r} ({len(longest)} characters, at most "
                         f"{NAME_MAX})", hint="shorten name: in the spec")
    return name


def _pod(name: str, job: str, index: int) -> str:
    """The operator's name for a replica's pod and Service (GenGeneralName)."""
    return f"{name}-{job.lower()}-{index}"


def address(name: str, namespace: str, job: str, index: int) -> str:
    """A task's address in the TF_CONFIG the operator writes (without CUSTOM_CLUSTER_DOMAIN)."""
    return f"{_pod(name, job, index)}.{namespace}.svc:{PORT}"


# -- the ConfigMap --------------------------------------------------------------------------

def config_keys(paths) -> dict[str, str]:
    """Relative path -> ConfigMap key: the path itself where it is a valid key, else a
    flattened one ('/' as '--', other characters as '_'), made unique."""
    paths = list(paths)
    taken = {p for p in paths if _is_key(p)}
    keys = {}
    for path in paths:
        if _is_key(path):
            keys[path] = path
            continue
        base = _NOT_KEY.sub("_", path.replace("/", "--"))[-240:].lstrip(".") or "_"
        key, n = base, 2
        while key in taken:
            key, n = f"{base}.{n}", n + 1
        taken.add(key)
        keys[path] = key
    return keys


def _is_key(key: str) -> bool:
    return bool(_KEY.fullmatch(key)) and len(key) <= 253 and not key.startswith("..") and key != "."


def _check_size(files: dict[str, bytes]) -> None:
    total = sum(len(b) for b in files.values())
    if total > CONFIGMAP_LIMIT:
        biggest = sorted(files.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:3]
        shown = ", ".join(f"{escape(p)} ({len(b)} bytes)" for p, b in biggest)
        raise UsageError(f"the files a TFJob ships make {total} bytes; a ConfigMap holds at most "
                         f"{CONFIGMAP_LIMIT} (1 MiB). Biggest: {shown}",
                         hint="put large files into the image or a volume, not train.files")


def _configmap(name: str, namespace: str, files: dict[str, bytes]) -> dict:
    keys = config_keys(files)
    data, binary = {}, {}
    for path in sorted(files, key=keys.get):
        try:
            data[keys[path]] = files[path].decode("utf-8")
        except UnicodeDecodeError:
            binary[keys[path]] = base64.b64encode(files[path]).decode("ascii")
    doc = {"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": f"{name}-files", "namespace": namespace}}
    if data:
        doc["data"] = data
    if binary:
        doc["binaryData"] = binary
    return doc


# -- the TFJob ------------------------------------------------------------------------------

def _tfjob(plan: Plan, name: str, namespace: str, image: str, files: dict[str, bytes],
           public: dict[str, str], secret: tuple[str, ...]) -> dict:
    keys = config_keys(files)
    env = [{"name": k, "value": v} for k, v in public.items()]
    env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": f"{name}-secrets", "key": k}}}
            for k in secret]
    replicas = {}
    for job, rtype in REPLICA_TYPES.items():
        tasks = [t for t in plan.tasks if t.job == job]
        if not tasks:
            continue
        container = {"name": CONTAINER, "image": image, "command": list(COMMAND),
                     "ports": [{"name": PORT_NAME, "containerPort": PORT}]}
        if env:
            container["env"] = [dict(e) for e in env]
        gpus = 0 if job == "ps" else max(len(t.gpus) for t in tasks)
        if gpus:
            container["resources"] = {"limits": {GPU: str(gpus)}}
        container["volumeMounts"] = [{"name": VOLUME, "mountPath": MOUNT, "readOnly": True}]
        volume = {"name": VOLUME, "configMap": {
            "name": f"{name}-files",
            "items": [{"key": keys[p], "path": p} for p in sorted(files, key=keys.get)]}}
        replicas[rtype] = {
            "replicas": len(tasks),
            "restartPolicy": RESTART_POLICIES[plan.restart.policy],
            "template": {"spec": {"terminationGracePeriodSeconds": termination_grace(plan.stop_grace),
                                  "containers": [container], "volumes": [volume]}},
        }
    run_policy: dict = {"cleanPodPolicy": "Running"}
    if plan.restart.policy != "never":
        run_policy["backoffLimit"] = plan.restart.max_restarts
    if plan.timeout is not None:
        run_policy["activeDeadlineSeconds"] = max(1, math.ceil(plan.timeout))
    spec: dict = {"runPolicy": run_policy}
    if plan.mode not in CHIEF_ENDS_RUN and "Chief" not in replicas:
        spec["successPolicy"] = "AllWorkers"
    spec["tfReplicaSpecs"] = replicas
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def network_policy(name: str, namespace: str) -> dict:
    """TF's ports closed to every pod but the job's own, as tfcluster's nftables table closes
    them on its hosts (docs/security.md, "TensorFlow's ports"): only the job's pods may
    connect to its pods, on the TF port. Enforced where the cluster's network plugin
    enforces NetworkPolicies."""
    pods = {"matchLabels": {JOB_LABEL: name}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{name}-tf-ports", "namespace": namespace},
            "spec": {"podSelector": pods, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": pods}],
                                  "ports": [{"protocol": "TCP", "port": PORT}]}]}}


# -- the operator's own rules -----------------------------------------------------------------

def check_operator_rules(docs: list[dict]) -> list[str]:
    """What the training operator's admission webhook (and the API server, for the objects
    it creates) would refuse that no CRD schema says: one line per problem."""
    problems = []
    for doc in docs:
        if not isinstance(doc, dict):
            problems.append(f"not a Kubernetes object: {type(doc).__name__}")
        elif doc.get("kind") == KIND:
            problems += _tfjob_problems(doc)
        elif doc.get("kind") == "ConfigMap":
            problems += _configmap_problems(doc)
    return problems


def _tfjob_problems(doc: dict) -> list[str]:
    out = []
    name = (doc.get("metadata") or {}).get("name") or ""
    if doc.get("apiVersion") != API_VERSION:
        out.append(f"apiVersion must be {API_VERSION}, got {doc.get('apiVersion')!r}")
    if not _DNS1035.fullmatch(name) or len(name) > NAME_MAX:
        out.append(f"metadata.name {name!r} must be {_NAME_RULE}")
    specs = (doc.get("spec") or {}).get("tfReplicaSpecs") or {}
    if not specs:
        out.append("spec.tfReplicaSpecs is required")
    chiefs = [t for t in specs if t in ("Chief", "Master")]
    if len(chiefs) > 1:
        out.append("spec.tfReplicaSpecs: at most one Chief or Master replica type")
    for rtype, rspec in specs.items():
        where = f"spec.tfReplicaSpecs.{rtype}"
        if rtype not in KNOWN_TYPES:
            out.append(f"{where}: unknown replica type (the operator knows {', '.join(KNOWN_TYPES)})")
        rspec = rspec or {}
        if rtype in ("Chief", "Master") and rspec.get("replicas", 1) > 1:
            out.append(f"{where}.replicas: at most 1 (TensorFlow has one chief)")
        containers = (((rspec.get("template") or {}).get("spec") or {}).get("containers")) or []
        if not containers:
            out.append(f"{where}.template.spec.containers: must be specified")
        for i, c in enumerate(containers):
            if not str(c.get("image") or "").strip():
                out.append(f"{where}.template.spec.containers[{i}].image: required")
        if containers and not any(c.get("name") == CONTAINER for c in containers):
            out.append(f"{where}: no container named {CONTAINER!r}")
        longest = f"{name}-{rtype.lower()}-{max(0, rspec.get('replicas', 1) - 1)}"
        if len(longest) > NAME_MAX:
            out.append(f"{where}: the operator's Service {longest!r} would be longer than {NAME_MAX}")
    return out


def _configmap_problems(doc: dict) -> list[str]:
    data, binary = doc.get("data") or {}, doc.get("binaryData") or {}
    out = [f"ConfigMap key {k!r} must match [-._a-zA-Z0-9]+ (at most 253, not '.' or '..*')"
           for k in [*data, *binary] if not _is_key(k)]
    out += [f"ConfigMap key {k!r} is in both data and binaryData" for k in data if k in binary]
    size = sum(len(v.encode("utf-8")) for v in data.values())
    size += sum(len(base64.b64decode(v)) for v in binary.values())
    if size > CONFIGMAP_LIMIT:
        out.append(f"ConfigMap holds {size} bytes; at most {CONFIGMAP_LIMIT}")
    return out


# -- text around it -------------------------------------------------------------------------

def preview_args(plan: Plan, name: str, namespace: str) -> dict[str, str]:
    """Replica type -> the script's command line as the launcher will fill it from the
    operator's TF_CONFIG ({index} left as is: it differs per replica)."""
    counts = {job: sum(1 for t in plan.tasks if t.job == job) for job in REPLICA_TYPES}
    hosts = {f"{job}_hosts": ",".join(address(name, namespace, job, i) for i in range(counts[job]))
             for job in ("chief", "ps", "worker")}
    script = plan.files[0][1] if plan.files else ""
    out = {}
    for job, rtype in REPLICA_TYPES.items():
        if counts[job] and job in SCRIPT_JOBS[plan.mode]:
            values = {"job": job, "index": "{index}", "workdir": plan.cluster_dir,
                      "num_workers": str(counts["worker"]), **hosts}
            args = [string.Formatter().vformat(a, (), values) for a in plan.args]
            out[rtype] = shell_join(["python3", script, *args])
    return out


def _header(plan: Plan, name: str, namespace: str) -> str:
    lines = [f"tfcluster render --to tfjob: {plan.name} ({plan.mode}) for the Kubeflow training "
             f"operator ({API_VERSION})",
             f"Every pod runs {MOUNT}/{LAUNCHER} from ConfigMap {name}-files; it reads the "
             "operator's TF_CONFIG",
             "and runs the script with train.args filled per task, as here:"]
    lines += [f"  {rtype}: {cmd}" for rtype, cmd in preview_args(plan, name, namespace).items()]
    lines.append("The cluster, as the operator names it:")
    for job, rtype in REPLICA_TYPES.items():
        n = sum(1 for t in plan.tasks if t.job == job)
        if n:
            index = "0" if n == 1 else f"{{0..{n - 1}}}"
            lines.append(f"  {job}: {name}-{job}-{index}.{namespace}.svc:{PORT}")
    return "".join(f"# {escape(line)}\n" for line in lines)


def _secret_command(name: str, namespace: str, secret: tuple[str, ...]) -> str:
    literals = " ".join(f"--from-literal={k}=..." for k in secret)
    return f"kubectl -n {namespace} create secret generic {name}-secrets {literals}"


def _notes(plan: Plan, name: str, namespace: str, secret: tuple[str, ...]) -> tuple[str, ...]:
    notes = []
    if secret:
        notes.append(f"secret env {', '.join(secret)}: create the Secret first (values never go "
                     f"into the file): {_secret_command(name, namespace, secret)}")
    notes.append("hosts, addresses, ports, ssh and jump_host do not carry over: the operator "
                 f"places the pods and names them {name}-<type>-<index>, each task on port {PORT}")
    notes.append("python: does not carry over: the pods run python3 from the image")
    if plan.tf_ports == "open":
        notes.append("tf_ports: open: no NetworkPolicy; any pod that reaches the job's pods can "
                     f"run TensorFlow ops on port {PORT}")
    else:
        notes.append(f"TF's ports: NetworkPolicy {name}-tf-ports lets only the job's own pods reach "
                     f"port {PORT} (where the cluster's network plugin enforces NetworkPolicies)")
    notes.append("exec and train.checks (placement, reachability, proxy guard, hang watchdog) "
                 "do not run under the operator")
    if plan.spares or plan.checkpoint is not None:
        notes.append("spare hosts, train.on_host_loss and train.checkpoint do not carry over: the "
                     "operator reschedules a lost pod on another node; keep checkpoints on a volume "
                     "every pod mounts")
    if plan.tensorboard:
        notes.append("train.tensorboard is not started: run TensorBoard on its logdir yourself")
    if plan.mode == "coordinator":
        notes.append("coordinator: the script runs on the chief only; ps and workers serve "
                     "until the job ends (cleanPodPolicy Running deletes them)")
    elif plan.mode == "classic":
        notes.append("classic: the ps run the script too")
    if plan.mode not in CHIEF_ENDS_RUN and any(t.job == "chief" for t in plan.tasks):
        notes.append(f"{plan.mode}: the operator ends the job when the chief succeeds, "
                     "not when every worker has")
    if any(t.job == "evaluator" for t in plan.tasks):
        notes.append("evaluator: the operator lists it in every task's TF_CONFIG cluster; "
                     "train does not")
    return tuple(notes)


class _Dumper(yaml.SafeDumper):
    """Safe YAML with multi-line strings (the shipped files) as literal blocks where YAML
    allows one; PyYAML falls back to a quoted scalar where it does not. No anchors."""

    def ignore_aliases(self, data) -> bool:
        return True


def _shown_as_is(text: str) -> bool:
    """No character a terminal or an editor would hide or reorder (tabs and newlines aside)."""
    return text.isprintable() or text.replace("\n", "").replace("\t", "").isprintable()


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # A string with a bidi, zero-width or other invisible character is double-quoted, where
    # _escaped can write it as an escape (PyYAML, with allow_unicode, writes them raw)
    style = "|" if "\n" in value else None
    if not _shown_as_is(value):
        style = '"'
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


def _escaped(text: str) -> str:
    """The dumped YAML with every invisible character PyYAML left raw as a YAML escape: _str
    put each inside a double-quoted scalar, where `\u202e` reads back as the character."""
    if _shown_as_is(text):
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else _yaml_escape(c) for c in text)


def _yaml_escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


_Dumper.add_representer(str, _str)
