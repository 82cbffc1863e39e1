"""The launcher's side of the fence (host/shim_fence.py): what each host is asked, and what
`up`, `train`, `plan --check` and `status` say of its answer.

The request rides in the batch that opens each host (Session.open), so closing the ports
costs no round trip of its own and happens before anything binds. Where a host cannot close
them, the run goes on with one warning naming the host, who else has processes there, what
they could do and the fix, unless the spec says `tf_ports: closed` (then exit 4, before
anything starts). docs/security.md, "TensorFlow's ports".
"""
from __future__ import annotations

from tfcluster.errors import PreflightError
from tfcluster.plan import Plan, names

INSTALL, PROBE, STATUS, RELEASE = "install", "probe", "status", "release"   # shim_fence.cmd_fence's modes
OTHERS_SHOWN = 8        # shim_fence.MAX_OTHERS: one more than this means "and more"


def request(plan: Plan, host: str, mode: str, also: Plan | None = None) -> dict | None:
    """The host's `fence` request, or None where the spec leaves the ports open. `also`: a
    second plan whose ports and targets the table closes too (a move prepared, not yet
    decided: a table that closes both clusters' ports is right for either)."""
    if plan.tf_ports == "open":
        return None
    plans = (plan,) if also is None else (plan, also)
    # an idle spare is closed too: nothing binds there yet, but its users must not dial the
    # others' task ports (the output chain), and a move finds its table in place
    return {"mode": mode, "cluster_dir": plan.cluster_dir, "tag_prefix": names.cluster_prefix(plan.name),
            "ports": sorted({t.port for p in plans for t in p.tasks_on(host)}),
            "targets": [list(t) for t in sorted({(t.address, t.port) for p in plans for t in p.tasks})],
            # a spare's address from the start: a task moved there must reach the others'
            # ports without closing them anew (docs/spec.md, "Spare hosts")
            "peers": sorted({p.host(h).address for p in plans for h in (*p.hosts, *p.spares)}),
            # JAX's collectives (gloo) listen on ports of their own, picked by the kernel: those
            # of the cluster's processes are closed too, where the cgroup match works
            "listeners": any(p.mode == "keras-jax" for p in plans)}


def idle_spare(plan: Plan, host: str) -> bool:
    """A spare no move gave tasks yet."""
    return host in plan.spares and not plan.tasks_on(host)


def spare_problems(plan: Plan, answers: dict[str, dict | None]) -> dict[str, str]:
    """Idle spares that could not take tasks under `tf_ports: closed`: spare -> why."""
    if plan.tf_ports != "closed":
        return {}
    return {h: f"tf_ports: closed, but tfcluster cannot close TensorFlow's ports there ({a.get('why') or 'unknown'})"
            for h, a in answers.items() if idle_spare(plan, h) and isinstance(a, dict) and not a.get("can")}


def report(plan: Plan, ui, answers: dict[str, dict | None], mode: str) -> None:
    """After the hosts answered: a warning per host whose ports stay open (`auto`), or one
    error naming them all (`closed`). Idle spares are spare_problems' business."""
    if plan.tf_ports == "open":
        return
    if plan.mode == "keras-jax" and mode == INSTALL:
        for host, answer in answers.items():
            if isinstance(answer, dict) and answer.get("closed") and answer.get("match") == "uid" \
                    and not idle_spare(plan, host):
                ui.warn(f"host {host}: the task ports are closed, but the ports JAX's collectives listen on stay "
                        f"open to other users there: closing them needs the cluster's cgroup v2 matched by nft "
                        f"({answer.get('match_why') or 'unknown'}; docs/security.md, \"The fallback\")")
    open_on = {h: a for h, a in answers.items()
               if isinstance(a, dict) and not idle_spare(plan, h) and not _closed(a, mode)}
    if not open_on:
        return
    if plan.tf_ports == "closed":
        where = ", ".join(f"host {h} ({a.get('why') or 'unknown'})" for h, a in open_on.items())
        raise PreflightError(
            f"tf_ports: closed, but tfcluster cannot close {exposed(plan)[0]} on {where}",
            hint=f"{fix(next(iter(open_on.values())))}; or set `tf_ports: auto` to run with a warning")
    for host, answer in open_on.items():
        ui.warn(warning(plan, host, answer))


def _closed(answer: dict, mode: str) -> bool:
    return bool(answer.get("can")) if mode == PROBE else bool(answer.get("closed"))


def warning(plan: Plan, host: str, answer: dict) -> str:
    """One host's open ports, plainly: who, what they could do, why, and the fix."""
    ports = sorted({t.port for t in plan.tasks_on(host)})
    others = list(answer.get("others") or [])
    who = (f"other users with processes there ({', '.join(others[:OTHERS_SHOWN])}"
           f"{' and more' if len(others) > OTHERS_SHOWN else ''})" if others else
           "any other user who logs in there (none has processes there now)")
    what, harm = exposed(plan)
    return (f"host {host}: {what} ({_ranges(ports)}) stay open: {who} and anyone on its "
            f"network can connect and {harm}. "
            f"tfcluster cannot close them there: {answer.get('why') or 'unknown'}. "
            f"Fix: {fix(answer)}; or set `tf_ports: open` in the spec to accept this and silence it")


def exposed(plan: Plan) -> tuple[str, str]:
    """What an open port exposes, in the plan's mode: a TF server runs any op it is sent; JAX's
    coordination service (worker 0's port, mode keras-jax) asks no one who they are either."""
    if plan.mode == "keras-jax":
        return ("the task ports", "talk to JAX's coordination service on worker 0's, which asks no one who "
                                  "they are: read and write its key-value store, or end the run by reporting "
                                  "an error")
    return "TensorFlow's ports", "run any TensorFlow op as you, which reads and writes your files"


def fix(answer: dict) -> str:
    """The one-line fix: nft run by root, or by this user through sudo without a password."""
    user = answer.get("user") or "USER"
    return (f"run tfcluster as root there, or let {user} run nft through sudo without a password "
            f"(the sudoers line `{user} ALL=(root) NOPASSWD: /usr/sbin/nft`), with nftables installed")


def _ranges(ports: list[int]) -> str:
    if not ports:
        return "none"
    spans, start, last = [], ports[0], ports[0]
    for p in ports[1:] + [None]:
        if p is not None and p == last + 1:
            last = p
            continue
        spans.append(str(start) if start == last else f"{start}-{last}")
        if p is not None:
            start = last = p
    return ", ".join(spans)


def status_line(plan: Plan, answers: dict[str, dict | None], running: set[str]) -> str | None:
    """`status`: where the ports are closed and where they are open while tasks run, named as
    the plan's mode has them (exposed())."""
    closed = sorted(h for h, a in answers.items() if isinstance(a, dict) and a.get("closed"))
    left_open = sorted(h for h, a in answers.items()
                       if isinstance(a, dict) and not a.get("closed") and h in running)
    parts = [f"closed on {', '.join(closed)} (nftables)"] if closed else []
    parts += [f"OPEN on {h} ({answers[h].get('why') or 'no table: not started by this tfcluster'})"
              for h in left_open]
    what = exposed(plan)[0]
    return f"{what[0].upper()}{what[1:]}: {'; '.join(parts)}" if parts else None
