"""Spec -> Plan: a pure function (no I/O, no clock, no environment reads).

The plan says, for every task, where it runs, which GPUs it sees, its TF_CONFIG,
its environment and its exact command. Everything later (up, down, train) only
carries a plan out, so tests compare whole plans.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from tfcluster.spec import JOB_NAMES, Restart, Spec, layout_tasks

SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL")
REDACTED = "***"

# Which jobs get a tfcluster-started server, and which run the user's script, per mode.
SERVER_JOBS = {
    "between-graph": ("chief", "ps", "worker"),
    "classic": (),
    "coordinator": ("ps", "worker"),
    "mirrored": (),
}
SCRIPT_JOBS = {
    "between-graph": ("chief", "worker", "evaluator"),
    "classic": ("chief", "ps", "worker", "evaluator"),
    "coordinator": ("chief", "evaluator"),
    "mirrored": ("chief", "worker", "evaluator"),
}
# Env defaults the spec may override; everything tfcluster-specific it may not.
ENV_DEFAULTS = {"PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


@dataclass(frozen=True)
class TaskPlan:
    job: str
    index: int
    host: str
    address: str
    port: int
    gpus: tuple[int, ...]
    is_chief: bool
    runs_server: bool
    tf_config: str                       # JSON, sorted keys
    env: tuple[tuple[str, str], ...]     # sorted by name; run-independent
    argv: tuple[str, ...] = ()           # the script's command; () when no script runs here

    @property
    def key(self) -> str:
        return f"{self.job}:{self.index}"

    @property
    def target(self) -> str:
        return f"{self.address}:{self.port}"

    @property
    def runs_script(self) -> bool:
        return bool(self.argv)


@dataclass(frozen=True)
class Plan:
    name: str
    mode: str
    python: str
    cluster_dir: str                     # workdir/name, possibly starting with "~/"
    cluster: tuple[tuple[str, tuple[str, ...]], ...]
    tasks: tuple[TaskPlan, ...]
    spec_digest: str
    script: str | None = None            # local path of the training script
    files: tuple[str, ...] = ()          # local paths shipped beside it
    restart: Restart = field(default_factory=Restart)
    timeout: float | None = None

    def task(self, key: str) -> TaskPlan:
        for t in self.tasks:
            if t.key == key:
                return t
        raise KeyError(key)

    @property
    def hosts(self) -> tuple[str, ...]:
        """Host names that run at least one task, in first-use order."""
        return tuple(dict.fromkeys(t.host for t in self.tasks))

    def tasks_on(self, host: str) -> tuple[TaskPlan, ...]:
        return tuple(t for t in self.tasks if t.host == host)


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def redact_env(env: tuple[tuple[str, str], ...] | dict[str, str]) -> dict[str, str]:
    items = env.items() if isinstance(env, dict) else env
    return {k: (REDACTED if is_secret(k) else v) for k, v in items}


def build_plan(spec: Spec) -> Plan:
    slots = layout_tasks(spec)
    addresses = {h.name: h.address for h in spec.hosts}
    cluster_dir = _join(spec.workdir, spec.name)
    cluster = _cluster_dict(spec.train.mode, slots, addresses)
    chief = "chief:0" if any(s.job == "chief" for s in slots) else "worker:0"
    placeholders = {
        "workdir": cluster_dir,
        "num_workers": str(sum(1 for s in slots if s.job == "worker")),
        **{f"{job}_hosts": ",".join(cluster.get(job, ())) for job in ("chief", "ps", "worker")},
    }
    # Every TF_CONFIG embeds the whole cluster: serialise it once, not once per task
    # (1,000 tasks would otherwise cost 1,000 dumps of a 1,000-entry cluster).
    cluster_json = json.dumps(cluster, sort_keys=True, separators=(",", ":"))
    tasks = tuple(
        _task_plan(spec, slot, addresses[slot.host], cluster_json, chief, placeholders)
        for slot in slots
    )
    return Plan(
        name=spec.name,
        mode=spec.train.mode,
        python=spec.python,
        cluster_dir=cluster_dir,
        cluster=tuple((job, tuple(cluster[job])) for job in JOB_NAMES if job in cluster),
        tasks=tasks,
        spec_digest=spec.digest,
        script=spec.train.script,
        files=tuple(os.path.join(spec.base_dir, f) for f in spec.train.files),
        restart=spec.train.restart,
        timeout=spec.train.timeout,
    )


def _join(workdir: str, name: str) -> str:
    return workdir.rstrip("/") + "/" + name


def _cluster_dict(mode: str, slots, addresses: dict[str, str]) -> dict[str, list[str]]:
    """The TF cluster: job -> ["address:port", ...]. The evaluator is never part of it."""
    jobs = ("chief", "worker") if mode == "mirrored" else ("chief", "ps", "worker")
    cluster: dict[str, list[str]] = {}
    for slot in slots:
        if slot.job in jobs:
            cluster.setdefault(slot.job, []).append(f"{addresses[slot.host]}:{slot.port}")
    return cluster


def tf_config_json(cluster_json: str, job: str, index: int) -> str:
    """Exactly json.dumps({"cluster": ..., "task": {...}}, sort_keys=True, compact)."""
    return f'{{"cluster":{cluster_json},"task":{{"index":{index},"type":{json.dumps(job)}}}}}'


def _task_plan(spec: Spec, slot, address: str, cluster_json: str, chief: str, placeholders) -> TaskPlan:
    mode = spec.train.mode
    key = f"{slot.job}:{slot.index}"
    runs_server = slot.job in SERVER_JOBS[mode]
    tf_config = tf_config_json(cluster_json, slot.job, slot.index)
    env = dict(ENV_DEFAULTS)
    env.update(spec.env)
    env.update({
        "TF_CONFIG": tf_config,
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in slot.gpus),
        "TFCLUSTER_CLUSTER": spec.name,
        "TFCLUSTER_JOB": slot.job,
        "TFCLUSTER_TASK_INDEX": str(slot.index),
        "TFCLUSTER_IS_CHIEF": "1" if key == chief else "0",
        "TFCLUSTER_NUM_WORKERS": placeholders["num_workers"],
    })
    if runs_server:
        env["TFCLUSTER_MASTER"] = f"grpc://{address}:{slot.port}"
    argv: tuple[str, ...] = ()
    if slot.job in SCRIPT_JOBS[mode] and spec.train.script:
        values = {**placeholders, "job": slot.job, "index": str(slot.index)}
        args = tuple(a.format(**values) for a in spec.train.args)
        argv = (spec.python, os.path.basename(spec.train.script), *args)
    return TaskPlan(
        job=slot.job, index=slot.index, host=slot.host, address=address, port=slot.port,
        gpus=tuple(slot.gpus), is_chief=key == chief, runs_server=runs_server,
        tf_config=tf_config, env=tuple(sorted(env.items())), argv=argv,
    )


def plan_to_dict(plan: Plan, *, redact: bool = True) -> dict:
    """A JSON-ready view of the plan (secrets redacted unless asked otherwise).

    The cluster appears once; each task's TF_CONFIG is {"cluster": <cluster>, "task":
    <tf_config_task>} (repeating the cluster per task would grow with tasks squared)."""
    def task(t: TaskPlan) -> dict:
        env = redact_env(t.env) if redact else dict(t.env)
        del env["TF_CONFIG"]
        return {
            "task": t.key, "job": t.job, "index": t.index, "host": t.host,
            "address": t.address, "port": t.port, "gpus": list(t.gpus),
            "chief": t.is_chief, "server": t.runs_server, "script": list(t.argv),
            "tf_config_task": {"type": t.job, "index": t.index}, "env": env,
        }
    return {
        "name": plan.name, "mode": plan.mode, "python": plan.python,
        "cluster_dir": plan.cluster_dir, "spec_sha256": plan.spec_digest,
        "cluster": {job: list(addrs) for job, addrs in plan.cluster},
        "tasks": [task(t) for t in plan.tasks],
    }
