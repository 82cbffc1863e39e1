"""Spec -> Plan (model.py's records): the tasks laid out and moved, each task's TF_CONFIG,
environment and command, the placeholders filled. A pure function, as the package says.
"""
from __future__ import annotations

import json
import sys
from dataclasses import fields, replace

from tfcluster.plan.model import (
    ENV_DEFAULTS,
    SCRIPT_JOBS,
    SERVER_JOBS,
    CheckpointPlan,
    HostPlan,
    Plan,
    Source,
    TaskPlan,
    interpreter,
    shim_bindir,
)
from tfcluster.plan.names import task_key
from tfcluster.spec import (
    JAX_CPU_COLLECTIVES_ENV,
    JOB_NAMES,
    KERAS_BACKEND_ENV,
    LEGACY_KERAS_ENV,
    LEGACY_KERAS_VALUES,
    Slot,
    Spec,
    layout_tasks,
)
from tfcluster.spec.addresses import host_port
from tfcluster.spec.model import JAX_PER_TASK_ENV
from tfcluster.spec.shipped import ScriptScan, script_dest
from tfcluster.transport.options import SshOptions


def _host_plan(host, spec: Spec, cluster_dir: str, local_python: str) -> HostPlan:
    python = interpreter(spec.python, host.local, local_python)
    # the spec's SshSettings and the transport's SshOptions carry the same fields; neither
    # layer imports the other, so the plan copies one into the other by name
    ssh = None if host.local else SshOptions(**{f.name: getattr(host.ssh, f.name)
                                                for f in fields(SshOptions)})
    return HostPlan(name=host.name, address=host.address, local=host.local, gpus=host.gpus,
                    python=python, bindir=shim_bindir(host.local, python, cluster_dir, local_python), ssh=ssh,
                    preemptible=host.preemptible, metadata_url=host.metadata_url, gpus_set=host.gpus_set)


def build_plan(spec: Spec, local_python: str | None = None, *,
               files: tuple[tuple[str, str, int], ...] = (), files_problem: str | None = None,
               script_fits: bool | None = None, script_scan: ScriptScan | None = None,
               moves: tuple[tuple[str, str], ...] = ()) -> Plan:
    """`local_python`: the interpreter running tfcluster (default sys.executable). `files`:
    what check_train_files listed (the plan of a command that ships nothing has none).
    `script_fits`: whether the script calls `.fit(` (spec.script_calls_fit; None: not read).
    `moves`: (lost host, spare) pairs, applied in order (Plan.moved)."""
    local_python = local_python or sys.executable
    slots = _move(spec, layout_tasks(spec), moves)
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
        all_hosts=tuple(_host_plan(h, spec, cluster_dir, local_python)
                        for h in sorted(spec.hosts, key=lambda h: h.name)),
        script=spec.train.script,
        files=files,
        files_problem=files_problem,
        secret_env=spec.secret_env,
        public_env=spec.public_env,
        restart=spec.train.restart,
        timeout=spec.train.timeout,
        stop_grace=spec.train.stop_grace,
        checks=spec.train.checks,
        tensorboard=_tensorboard(spec, slots, placeholders),
        args=spec.train.args,
        image=spec.train.image,
        progress=spec.train.progress,
        legacy_keras=spec.train.keras == "legacy" or dict(spec.env).get(LEGACY_KERAS_ENV) in LEGACY_KERAS_VALUES,
        script_fits=script_fits,
        script_scan=script_scan,
        tf_ports=spec.tf_ports,
        spares=tuple(h.name for h in spec.spares),
        warm_spares=tuple(h.name for h in spec.spares if h.warm),
        on_host_loss=spec.train.on_host_loss or ("spare" if spec.spares else "fail"),
        checkpoint=_checkpoint(spec, slots, placeholders),
        moves=tuple(moves),
        source=Source(spec, local_python, build_plan),
    )


def _move(spec: Spec, slots: tuple[Slot, ...], moves: tuple[tuple[str, str], ...]) -> tuple[Slot, ...]:
    """The slots with each move applied in turn: a lost host's tasks on its spare, whose
    GPUs are numbered from 0 in task order (a spare holds no task of its own)."""
    if not moves:
        return slots
    for lost, spare in moves:
        slots = tuple(replace(s, host=spare) if s.host == lost else s for s in slots)
    spares = {h.name: h for h in spec.spares}
    used: dict[str, int] = {}
    out = []
    for slot in slots:
        if slot.host in spares:
            start = used.get(slot.host, 0)
            used[slot.host] = start + len(slot.gpus)
            if used[slot.host] > spares[slot.host].gpus:
                raise ValueError(f"spare {slot.host} has {spares[slot.host].gpus} GPUs, too few for the tasks "
                                 f"moved there")
            slot = replace(slot, gpus=tuple(range(start, start + len(slot.gpus))))
        out.append(slot)
    return tuple(out)


def _tensorboard(spec: Spec, slots, placeholders: dict[str, str]) -> str | None:
    """train.tensorboard with the chief's placeholders filled (TensorBoard runs there)."""
    if not spec.train.tensorboard:
        return None
    return _on_chief(spec.train.tensorboard, slots, placeholders)


def _checkpoint(spec: Spec, slots, placeholders: dict[str, str]) -> CheckpointPlan | None:
    """train.checkpoint with its directory's placeholders filled as the chief's."""
    ckpt = spec.train.checkpoint
    if ckpt is None:
        return None
    return CheckpointPlan(dir=_on_chief(ckpt.dir, slots, placeholders), keep=ckpt.keep, sync=ckpt.sync,
                          max_bytes=ckpt.max_bytes)


def _on_chief(text: str, slots, placeholders: dict[str, str]) -> str:
    chief = next((s for s in slots if s.job == "chief"), None) or next(
        (s for s in slots if s.job == "worker"), None)
    values = {**placeholders, "job": chief.job if chief else "", "index": str(chief.index) if chief else "0"}
    return text.format(**values)


def _join(workdir: str, name: str) -> str:
    return workdir.rstrip("/") + "/" + name


def _cluster_dict(mode: str, slots, addresses: dict[str, str]) -> dict[str, list[str]]:
    """The TF cluster: job -> ["address:port", ...]. The evaluator is never part of it."""
    jobs = ("chief", "worker") if mode == "mirrored" else ("chief", "ps", "worker")
    cluster: dict[str, list[str]] = {}
    for slot in slots:
        if slot.job in jobs:
            cluster.setdefault(slot.job, []).append(host_port(addresses[slot.host], slot.port))
    return cluster


def tf_config_json(cluster_json: str, job: str, index: int) -> str:
    """Exactly json.dumps({"cluster": ..., "task": {...}}, sort_keys=True, compact)."""
    return f'{{"cluster":{cluster_json},"task":{{"index":{index},"type":{json.dumps(job)}}}}}'


def _task_plan(spec: Spec, slot, address: str, cluster_json: str, chief: str, placeholders) -> TaskPlan:
    mode = spec.train.mode
    key = task_key(slot.job, slot.index)
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
    if spec.train.keras == "legacy":     # every task, servers too: one Keras across the cluster
        env[LEGACY_KERAS_ENV] = "1"
    if mode == "keras-jax":
        env.update(jax_env(placeholders["worker_hosts"].split(",")[0], placeholders["num_workers"],
                           slot.index, bool(slot.gpus), spec.env))
    if runs_server:
        env["TFCLUSTER_MASTER"] = f"grpc://{host_port(address, slot.port)}"
    argv: tuple[str, ...] = ()
    if slot.job in SCRIPT_JOBS[mode] and spec.train.script:
        values = {**placeholders, "job": slot.job, "index": str(slot.index)}
        args = tuple(a.format(**values) for a in spec.train.args)
        argv = (script_dest(spec), *args)
    # A between-graph script is only a client of its task's server, which owns the GPU:
    # a client that touched the GPU would take nearly all of its memory by default.
    client_only = mode == "between-graph" and runs_server and argv and slot.gpus
    return TaskPlan(
        job=slot.job, index=slot.index, host=slot.host, address=address, port=slot.port,
        gpus=tuple(slot.gpus), is_chief=key == chief, runs_server=runs_server,
        tf_config=tf_config, env=tuple(sorted(env.items())), argv=argv,
        script_env=(("CUDA_VISIBLE_DEVICES", ""),) if client_only else (),
    )


# The two variables that hold the coordinator's address: an engine that chooses the addresses
# itself (render --to slurm) fills them in where the processes run.
JAX_COORDINATOR_ENV = ("KERAS_DISTRIBUTION_JOB_ADDRESSES", "JAX_COORDINATOR_ADDRESS")
# Every variable jax_env may set: per process, never the spec's env for all.
JAX_ENV = (*JAX_PER_TASK_ENV, KERAS_BACKEND_ENV, JAX_CPU_COLLECTIVES_ENV)


def jax_env(coordinator: str, processes: str, index: int, gpus: bool,
            spec_env: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """What a process of mode keras-jax gets besides every task's variables (docs/modes.md, "Mode
    jax"): the backend, and the coordinator (worker 0's address and port), the process count
    and its id, once in the names `keras.distribution.initialize()` reads and once in the
    names a JAX program passes to `jax.distributed.initialize` (which reads only
    JAX_COORDINATOR_ADDRESS itself). A host without GPUs gets gloo, the CPU collectives that
    run across processes, unless env: names another."""
    env = {KERAS_BACKEND_ENV: "jax", **dict.fromkeys(JAX_COORDINATOR_ENV, coordinator),
           "KERAS_DISTRIBUTION_NUM_PROCESSES": processes, "KERAS_DISTRIBUTION_PROCESS_ID": str(index),
           "JAX_NUM_PROCESSES": processes, "JAX_PROCESS_ID": str(index)}
    if not gpus and JAX_CPU_COLLECTIVES_ENV not in dict(spec_env):
        env[JAX_CPU_COLLECTIVES_ENV] = "gloo"
    return env


