"""The plan as `plan` prints it and a run's manifest keeps it: JSON-ready, every secret value
redacted (the rule is spec's is_secret, with the spec's own lists) and a URL's credentials
masked.
"""
from __future__ import annotations

from tfcluster.plan.model import Plan, TaskPlan
from tfcluster.spec import is_secret, mask_userinfo

REDACTED = "***"                         # for env names is_secret picks (the rule lives in spec)


def redact_env(env: tuple[tuple[str, str], ...] | dict[str, str], marked=(), public=()) -> dict[str, str]:
    """`env` as shown: every secret value (is_secret, with the spec's secret_env and
    public_env) as ***, and a URL's userinfo in any other as *** (mask_userinfo)."""
    items = env.items() if isinstance(env, dict) else env
    return {k: (REDACTED if is_secret(k, marked, public) else mask_userinfo(v)) for k, v in items}


def env_redactor(marked=(), public=()):
    """redact_env for many envs that share their names (every task of a plan): each name is
    judged once."""
    secret: dict[str, bool] = {}

    def redact(env) -> dict[str, str]:
        out = {}
        for k, v in (env.items() if isinstance(env, dict) else env):
            s = secret.get(k)
            if s is None:
                s = secret[k] = is_secret(k, marked, public)
            out[k] = REDACTED if s else mask_userinfo(v)
        return out
    return redact


def plan_to_dict(plan: Plan, *, redact: bool = True) -> dict:
    """A JSON-ready view of the plan (secrets redacted unless asked otherwise).

    The cluster appears once; each task's TF_CONFIG is {"cluster": <cluster>, "task":
    <tf_config_task>} (repeating the cluster per task would grow with tasks squared)."""
    hosts = {h.name: h for h in plan.all_hosts}
    redactor = env_redactor(plan.secret_env, plan.public_env)

    def task(t: TaskPlan) -> dict:
        env = redactor(t.env) if redact else dict(t.env)
        del env["TF_CONFIG"]
        host = hosts[t.host]
        return {
            "task": t.key, "job": t.job, "index": t.index, "host": t.host,
            "address": t.address, "port": t.port, "gpus": list(t.gpus),
            "chief": t.is_chief, "server": t.runs_server,
            "server_command": [host.python, f"{host.bindir}/tfserver.py"] if t.runs_server else [],
            "script": [host.python, *(map(mask_userinfo, t.argv) if redact else t.argv)] if t.runs_script else [],
            "script_env": dict(t.script_env),
            "tf_config_task": {"type": t.job, "index": t.index}, "env": env,
        }
    restart = plan.restart
    return {
        "name": plan.name, "mode": plan.mode, "python": plan.python,
        "cluster_dir": plan.cluster_dir, "spec_sha256": plan.spec_digest,
        "restart": {"policy": restart.policy, "max_restarts": restart.max_restarts},
        "timeout": plan.timeout,
        "stop_grace": plan.stop_grace,
        "checks": {"placement": plan.checks.placement, "reachability": plan.checks.reachability,
                   "proxy_guard": plan.checks.proxy_guard, "hang_after": plan.checks.hang_after},
        "tensorboard": plan.tensorboard,
        "keras": "legacy" if plan.legacy_keras else "auto",
        "progress": {"step": plan.progress.step, "loss": plan.progress.loss,
                     "target": plan.progress.target},
        "files": [{"path": path, "to": dest, "bytes": size} for path, dest, size in plan.files],
        "files_problem": plan.files_problem,
        "hosts": [{"name": h.name, "address": h.address, "local": h.local, "gpus": h.gpus,
                   "python": h.python, "preemptible": h.preemptible, "metadata_url": h.metadata_url}
                  for h in plan.all_hosts],
        "on_host_loss": plan.on_host_loss,
        "spares": [spare_to_dict(plan, name) for name in plan.spares],
        "moves": [{"lost": lost, "to": spare} for lost, spare in plan.moves],
        "checkpoint": None if plan.checkpoint is None else {
            "dir": plan.checkpoint.dir, "keep": plan.checkpoint.keep, "sync": plan.checkpoint.sync,
            "max_bytes": plan.checkpoint.max_bytes},
        "cluster": {job: list(addrs) for job, addrs in plan.cluster},
        "tasks": [task(t) for t in plan.tasks],
    }


def spare_to_dict(plan: Plan, name: str) -> dict:
    """A spare as `plan` shows it: for each host with tasks, whether the spare could take
    them all (`takes`), or why not."""
    host = plan.host(name)
    fits = {h: plan.spare_problem(name, h) for h in plan.hosts if h != name}
    return {"name": name, "address": host.address, "gpus": host.gpus, "warm": name in plan.warm_spares,
            "holds": [t.key for t in plan.tasks_on(name)],
            "takes": [h for h, problem in fits.items() if problem is None],
            "cannot_take": {h: problem for h, problem in fits.items() if problem is not None}}
