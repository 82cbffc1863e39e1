"""Hosts already down when `up` or `train` begins: with spares and on_host_loss: spare, a
task host whose sshd refuses or cannot be reached has its tasks start on a spare instead (a
host lost during a run: hostloss.py; what the run does then: run/recovery.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tfcluster.errors import Cause, ConnectError
from tfcluster.launch.cluster import state
from tfcluster.launch.cluster.hostloss import dial_reason
from tfcluster.plan import policy

if TYPE_CHECKING:
    from tfcluster.launch.cluster.session import Session
    from tfcluster.plan import Plan


# What a host that is off or gone gives a connect: a refusal (up, but no sshd), no route, or
# a TCP connect nobody answers (a powered-off machine's address, most often). A host that
# answers but fails the SSH handshake, a login or its host key is no dead host.
DOWN_CAUSES = frozenset({Cause.REFUSED, Cause.UNREACHABLE, Cause.TIMEOUT})


def around_dead_hosts(session: Session, ui) -> Plan:
    """`up` and `train` with a host already down: where the plan has spares and
    on_host_loss: spare, a task host whose sshd refuses or cannot be reached starts its tasks
    on a spare instead, with a warning; the session adopts that plan, which is returned. A host
    that answers but refuses us (a host key, a login) is no dead host: its error stands.

    Tasks an earlier `up` started on a spare this way stay there until `down`, the host back
    or not (state.placed_by_up): their servers run there."""
    plan = state.placed_by_up(session.plan, ui)
    dead: dict[str, str] = {}
    if plan.on_host_loss == policy.SPARE and plan.spares:
        plan, dead = _off_dead_hosts(session, plan, ui)
    for host, why in dead.items():
        session.pool.set_aside(host, f"down at the start ({why})")
    if plan is not session.plan:
        session.drop(dead)
        session.host_names = tuple(h for h in dict.fromkeys((*plan.hosts, *plan.spares)) if h not in dead)
        session.adopt(plan)
    return plan


def _off_dead_hosts(session: Session, plan: Plan, ui) -> tuple[Plan, dict[str, str]]:
    """`plan` with each of its task hosts that is down moved to a spare, and the hosts found
    down (host -> why); `plan` itself, and none, when a down host has no spare left (the
    connection's error says it, as without spares)."""
    hosts = list(dict.fromkeys((*plan.hosts, *plan.spares)))
    results = session.parallel(lambda h: session.agent(h).transport.connect(), hosts)
    dead = {h: r.message for h, r in results.items()
            if isinstance(r, ConnectError) and r.cause in DOWN_CAUSES}
    moved = plan
    for host in plan.hosts:
        if host not in dead:
            continue
        spare = moved.spare_for(host, used=set(dead))
        if spare is None:
            return plan, {}
        ui.warn(f"{host} is down ({dial_reason(dead[host], host)}): {', '.join(t.key for t in moved.tasks_on(host))} "
                f"start on spare {spare} instead")
        moved = moved.moved(host, spare)
    return moved, dead
