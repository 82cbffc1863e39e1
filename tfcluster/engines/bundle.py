"""What every engine ships besides its manifest: the training files, the launcher, the TF
server, and the launcher's config (tfcluster-launch.json). Read from local disk only."""
from __future__ import annotations

import json
import os

from tfcluster.errors import UsageError
from tfcluster.host import HOST_DIR
from tfcluster.plan import JAX_COORDINATOR_ENV, JAX_ENV, SCRIPT_JOBS, SERVER_JOBS, Plan

LAUNCHER = "launch.py"
CONFIG = "tfcluster-launch.json"
SERVER = "tfserver.py"
# Set per task by the launcher where the task runs, never taken from the spec's env.
MANAGED = ("TF_CONFIG", "CUDA_VISIBLE_DEVICES")
COORDINATOR = "{coordinator}"    # in jax_env's values: worker 0's address, known where it runs


def spec_env(plan: Plan) -> dict[str, str]:
    """The spec's env (with tfcluster's defaults), the same for every task: what the
    launcher does not set itself (mode keras-jax's variables are per process: jax_env)."""
    env = dict(plan.tasks[0].env) if plan.tasks else {}
    managed = MANAGED + (JAX_ENV if plan.mode == "keras-jax" else ())
    return {k: v for k, v in sorted(env.items())
            if k not in managed and not k.startswith("TFCLUSTER_")}


def jax_env(plan: Plan) -> dict[str, dict[str, str]]:
    """Mode keras-jax: task key -> the variables its process gets (docs/modes.md, "Mode
    keras-jax"), the coordinator's address left as COORDINATOR: the engine picks the ports."""
    if plan.mode != "keras-jax":
        return {}
    return {t.key: {k: COORDINATOR if k in JAX_COORDINATOR_ENV else v
                    for k, v in sorted(t.env) if k in JAX_ENV}
            for t in plan.tasks}


def split_env(plan: Plan) -> tuple[dict[str, str], tuple[str, ...]]:
    """(public env, secret names): secrets never go into a rendered file, only their names
    (a value with a URL's credentials is one)."""
    env = spec_env(plan)
    secret = tuple(k for k, v in env.items() if plan.keeps_secret(k, v))
    return {k: v for k, v in env.items() if k not in secret}, secret


def chief_key(plan: Plan) -> str:
    return "chief:0" if any(t.job == "chief" for t in plan.tasks) else "worker:0"


def launch_config(plan: Plan, engine: str, **extra) -> dict:
    """What launch.py needs to know on the engine's nodes; secrets are not in it."""
    public, secret = split_env(plan)
    script = plan.files[0][1] if plan.files else None
    return {
        "engine": engine, "name": plan.name, "mode": plan.mode,
        "server_jobs": list(SERVER_JOBS[plan.mode]), "script_jobs": list(SCRIPT_JOBS[plan.mode]),
        "cluster_jobs": ["chief", "worker"] if plan.mode == "mirrored" else ["chief", "ps", "worker"],
        "chief": chief_key(plan), "script": script, "args": list(plan.args),
        "workdir": plan.cluster_dir, "env": public, "secret_env": list(secret),
        "files": [dest for _path, dest, _size in plan.files],
        "jax_env": jax_env(plan), "stop_grace": plan.stop_grace,
        **extra,
    }


def bundle_files(plan: Plan, config: dict) -> dict[str, bytes]:
    """Relative path -> bytes: the launcher, its config, the TF server, then the script
    and train.files as `train` would ship them."""
    if plan.files_problem:
        raise UsageError(plan.files_problem)
    if not plan.files:
        raise UsageError(f"{plan.name}: train.script is not set: there is nothing to run",
                         hint="set train.script in the spec, e.g. template:between_graph")
    out = {
        LAUNCHER: _read(os.path.join(os.path.dirname(os.path.abspath(__file__)), LAUNCHER)),
        SERVER: _read(os.path.join(HOST_DIR, SERVER)),
        CONFIG: (json.dumps(config, indent=1, sort_keys=True) + "\n").encode(),
    }
    for path, dest, _size in plan.files:
        if dest in out:
            raise UsageError(f"{path}: its name {dest!r} is taken by tfcluster's own {dest}",
                             hint="rename the file")
        out[dest] = _read(path)
    return out


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"{path}: cannot read: {e.strerror}") from None
