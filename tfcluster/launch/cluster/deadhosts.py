"""Hosts already down when `up` or `train` begins: with spares and on_host_loss: spare, a
task host whose sshd refuses or cannot be reached has its tasks start on a spare instead (a
host lost during a run: hostloss.py; what the run does then: run/recovery.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tfcluster.errors import ConnectError
from tfcluster.launch.cluster.hostloss import dial_reason
from tfcluster.plan import policy

if TYPE_CHECKING:
    from tfcluster.launch.cluster.session import Session
    from tfcluster.plan import Plan


DOWN_SIGNS = ("connection refused", "unreachable", "no route to host")


def around_dead_hosts(session: Session, ui) -> Plan:
    """`up` and `train` with a host already down: where the plan has spares and
    on_host_loss: spare, a task host whose sshd refuses or cannot be reached starts its tasks
    on a spare instead, with a warning; the session adopts that plan, which is returned. A host
    that answers but refuses us (a host key, a login) is no dead host: its error stands."""
    plan = session.plan
    if plan.on_host_loss != policy.SPARE or not plan.spares:
        return plan
    hosts = list(dict.fromkeys((*plan.hosts, *plan.spares)))
    results = session.parallel(lambda h: session.agent(h).transport.connect(), hosts)
    dead = {h: r.message for h, r in results.items()
            if isinstance(r, ConnectError) and any(sign in r.message for sign in DOWN_SIGNS)}
    for host in plan.hosts:
        if host not in dead:
            continue
        spare = plan.spare_for(host, used=set(dead))
        if spare is None:
            return plan         # the connection's error says it, as without spares
        ui.warn(f"{host} is down ({dial_reason(dead[host], host)}): {', '.join(t.key for t in plan.tasks_on(host))} "
                f"start on spare {spare} instead")
        plan = plan.moved(host, spare)
    if plan is not session.plan:
        session.drop(dead)
        session.host_names = tuple(h for h in dict.fromkeys((*plan.hosts, *plan.spares)) if h not in dead)
        session.adopt(plan)
    return plan
