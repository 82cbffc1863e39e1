"""Reachability: before anything trains, every host that runs tasks opens a TCP connection
to every task address of the cluster, exactly as its tasks will dial them.

One `reach` shim per host (shim_net.py): each listens on the ports of its tasks that no
live server of this cluster serves yet (a short rehearsal of the servers and scripts that
will bind them), then all connect to all. A failing pair is a PreflightError (exit 4)
naming the host, the task and the address, with a hint by cause; nothing is left running
(the shims close their listeners and exit before this returns). See docs/design/remote-execs.md,
"Checks before a run".
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from tfcluster.errors import HostError, PreflightError
from tfcluster.host import shim_protocol as proto
from tfcluster.host.shim_net import CONNECT_TIMEOUT, probe_all_bound
from tfcluster.launch.agent.lines import Deadline, Lines, close_input
from tfcluster.launch.cluster.session import raise_first
from tfcluster.plan import Plan, TaskPlan
from tfcluster.transport.base import Proc

START_TIMEOUT = 60.0     # a shim's start over SSH (a login shell and an interpreter), listeners up
EXIT_WAIT = 5.0          # a shim closes its listeners and exits once its stdin ends
ANSWER_SLACK = 30.0      # a loaded host's (or connection's) delay on top of the shim's own bounds


@dataclass(frozen=True)
class Failure:
    host: str          # where the connection was opened from
    task: str          # the task whose address it was
    target: str        # address:port
    reason: str        # "name does not resolve", "connection refused", "timed out after 5s", ...

    def line(self) -> str:
        return f"host {self.host} cannot reach {self.task} at {self.target}: {self.reason}"


def cluster_tasks(plan: Plan) -> list[TaskPlan]:
    """The tasks whose addresses are in the cluster (every TF task may dial each of them)."""
    members = {address for _job, addresses in plan.cluster for address in addresses}
    return [t for t in plan.tasks if t.target in members]


def check_reachability(session, tasks: list[TaskPlan] | None = None, served=frozenset(),
                       timeout: float = CONNECT_TIMEOUT, execs: dict | None = None) -> float:
    """Every host that runs tasks connects to every task of `tasks` (default: the cluster).
    `served`: keys of tasks whose live server answers already (no listener there). `execs`:
    host -> an open conversation that speaks these lines too (`up`'s, agent/upexec.py; a held
    script start, agent/held.py): no exec of its own there.
    Raises PreflightError for a failing pair; returns the seconds it took."""
    plan, ui = session.plan, session.ui
    tasks = cluster_tasks(plan) if tasks is None else list(tasks)
    if not tasks:
        return 0.0
    sources = list(plan.hosts)          # every task's host is one of them
    listen = {h: [t.port for t in tasks if t.host == h and t.key not in served] for h in sources}
    targets = [[t.address, t.port] for t in tasks]
    t0 = time.monotonic()
    ui.info(f"Checking that {len(sources)} host(s) reach {len(tasks)} task address(es)…")
    answers = _exchange(session, sources, listen, targets, timeout, execs or {})
    _raise_busy(answers, tasks)
    by_pair = {(t.address, t.port): t for t in tasks}
    # the shim's answers are keyed `address:port` as written, an IPv6 address unbracketed
    failures = [Failure(h, by_pair[(a, p)].key, by_pair[(a, p)].target, reason)
                for h in sources for a, p in targets
                if (reason := answers[h]["results"].get(f"{a}:{p}")) is not None]
    if failures:
        raise _error(failures, plan)
    seconds = time.monotonic() - t0
    ui.info(f"reachability: {len(sources)} host(s) reach every task address ({seconds:.1f}s)")
    return seconds


def can_connect(session, from_host: str, targets, timeout: float = CONNECT_TIMEOUT) -> dict:
    """Connect only (no listeners) from `from_host` to [(address, port), ...]:
    {"address:port": None | reason}. For a watchdog asking why a task waits."""
    agent = session.agents[from_host]
    request = {"targets": [[a, int(p)] for a, p in targets], "timeout": timeout,
               "cluster_dir": session.plan.cluster_dir}    # the shim joins the cluster's cgroup: the fence lets it in
    proc = agent.spawn_shim(proto.REACH)
    with Deadline(START_TIMEOUT + probe_all_bound(len(request["targets"]), timeout), [proc]) as deadline:
        proc.write(proto.json_line(request))
        proc.close_stdin()
        return Lines(proc, f"host {agent.name}: reach").answer("results", deadline=deadline)["results"]


# ------------------------------------------------------------------------- the exchange

def _exchange(session, hosts: list[str], listen: dict, targets: list, timeout: float,
              execs: dict) -> dict:
    """Every host: listeners up (all of them before anyone connects), then connect, then
    close. A conversation of `execs` (upexec.UpExec, held.HeldStart) lends its lines and
    ends its part itself (end_reach); elsewhere a `reach` shim of its own runs.
    host -> {"listening", "busy", "results"}."""
    procs: dict[str, Proc] = {}
    lines: dict[str, Lines] = {}
    connecting = probe_all_bound(len(targets), timeout) + ANSWER_SLACK
    lifetime = START_TIMEOUT + connecting + ANSWER_SLACK   # the shims' own bound
    deadline = Deadline(START_TIMEOUT)

    def where(host: str) -> str:
        return f"host {host}: reach"

    def open_host(host: str) -> dict:
        session.agents[host].check_cancelled()
        if host in execs:
            lines[host] = execs[host].lines
            deadline.add(lines[host].proc, borrowed=True)
        else:
            proc = procs[host] = session.agents[host].spawn_shim(proto.REACH)
            deadline.add(proc)
            lines[host] = Lines(proc, where(host))
        lines[host].proc.write(proto.json_line({"listen": listen[host], "lifetime": lifetime,
                                                "cluster_dir": session.plan.cluster_dir}))
        return lines[host].answer("listening", where(host), deadline)

    def go(host: str) -> dict:
        lines[host].proc.write(proto.json_line({"targets": targets, "timeout": timeout}))
        return lines[host].answer("results", where(host), deadline)

    with deadline:
        opened = session.parallel(open_host, hosts)
        raise_first(opened, "host")
        deadline.restart(connecting)
        results = session.parallel(go, hosts)
        raise_first(results, "host")
        _close(procs)
        raise_first(session.parallel(lambda h: execs[h].end_reach(deadline), [h for h in hosts if h in execs]),
                    "host")
    return {h: {**opened[h], **results[h]} for h in hosts}


def _close(procs: dict[str, Proc]) -> None:
    """End every shim's stdin and wait until it exited: its listeners must be gone before
    a server binds the same port."""
    for proc in procs.values():
        close_input(proc)
    deadline = time.monotonic() + EXIT_WAIT
    for host, proc in procs.items():
        if proc.wait(max(0.0, deadline - time.monotonic())) is None:
            raise HostError(f"host {host}: reach did not exit {EXIT_WAIT:g}s after its stdin ended")


# ------------------------------------------------------------------------- diagnosis

def _raise_busy(answers: dict, tasks: list[TaskPlan]) -> None:
    for task in tasks:
        holder = answers[task.host]["busy"].get(str(task.port))
        if holder:
            raise PreflightError(
                f"host {task.host}: port {task.port} of {task.key} is already in use ({holder})",
                hint="stop whatever holds it (`tfcluster down` if it is an old cluster), "
                     "or change the port in the spec")


def _error(failures: list[Failure], plan: Plan) -> PreflightError:
    first = failures[0]
    details = None
    if len(failures) > 1:
        details = f"{len(failures)} failing pairs:\n" + "\n".join(f"  {f.line()}" for f in failures)
    return PreflightError(first.line(), hint=_hint(first, plan), details=details)


def _hint(f: Failure, plan: Plan) -> str:
    owner, address = plan.task(f.task).host, plan.task(f.task).address
    off = "or set train.checks.reachability: false to skip this check"
    if f.reason.startswith("name does not resolve"):
        return (f"{address} must resolve on every host, as the tasks dial it (an ~/.ssh/config "
                f"alias only works for ssh): give host {owner} an address every host resolves "
                f"(DNS, /etc/hosts) or its IP; {off}")
    if f.reason.startswith("connection refused"):
        fenced = (f"tfcluster's own rules on {owner} (tf_ports) let in only the spec's host addresses: "
                  f"{f.host} may connect from another one; " if plan.tf_ports != "open" and f.host != owner else "")
        return (f"nothing listens at {f.target} as seen from {f.host}: a firewall rejects the "
                f"port, or {address} names another machine than host {owner}; {fenced}{off}")
    if f.reason.startswith("timed out"):
        return (f"a firewall drops the packets from {f.host} to {f.target} (or the address is "
                f"not routable from there): open the port between the hosts; {off}")
    return f"check the routes and firewalls between {f.host} and {owner}; {off}"


