"""The proxy guard, the package's side: which addresses the tasks keep off a proxy, and
what `plan --check` says about each host's proxy variables.

A TF task dials the other tasks over gRPC, and gRPC sends a connection through the proxy
that `grpc_proxy`/`https_proxy`/`http_proxy` name unless `no_grpc_proxy`/`no_proxy` lists
the target's host: a cluster whose hosts set a proxy hangs at the first session. The
shim applies the guard where the task's environment is finally known (host environment
+ the spec's env; `shim_net.guard_env`); this side only sends the addresses.
"""
from __future__ import annotations

from tfcluster.host import shim_net
from tfcluster.plan import Plan


def cluster_addresses(plan: Plan) -> tuple[str, ...]:
    """Every address a task may dial: the hosts of the plan's tasks, in plan order."""
    return tuple(dict.fromkeys(t.address for t in plan.tasks))


def no_proxy_for(plan: Plan) -> tuple[str, ...]:
    """What every start request carries (nothing when train.checks.proxy_guard is off)."""
    return cluster_addresses(plan) if plan.checks.proxy_guard else ()


def task_environment(session, host: str) -> dict[str, str]:
    """The proxy variables a task on `host` sees: the host's (from `info`), then the spec's."""
    env = dict(session.infos[host].proxy)
    tasks = session.plan.tasks_on(host)
    if tasks:
        env.update(shim_net.proxy_report(dict(tasks[0].env)))
    return env


def report(session, ui) -> None:
    """`plan --check`: one line per host whose tasks would see a proxy variable."""
    plan = session.plan
    for host in plan.hosts:
        env = task_environment(session, host)
        names = shim_net.proxies_set(env)
        if not names:
            continue
        if plan.checks.proxy_guard:
            changes = shim_net.guard_env(env, cluster_addresses(plan))
            ui.ok(f"{host}: {', '.join(names)} set for its tasks; proxy guard gives them "
                  + " ".join(f"{k}={v}" for k, v in changes.items()))
        else:
            ui.warn(f"{host}: {', '.join(names)} set for its tasks and train.checks.proxy_guard "
                    f"is off: gRPC between the tasks goes through that proxy unless no_proxy "
                    f"names {','.join(cluster_addresses(plan))}")
