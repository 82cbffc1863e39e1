"""`down` in one remote execution per warm host: the launcher's side of shim_down.py.

The bootstrap's own round trip carries `info` and `down` (stop this cluster's processes,
then wait on the host until its ports of the cluster can be bound again); a host whose
shipped files are stale costs the SFTP and one more exec. docs/ARCHITECTURE.md, "The
round trip of `down`".
"""
from __future__ import annotations

from tfcluster.host import shim_protocol as proto
from tfcluster.launch.records import StopReport
from tfcluster.errors import HostError

SLACK = 60.0     # seconds an exec may take beyond its grace and settle (a loaded host's start)
KILL_SWEEP = 2.0  # shim_procs.kill_tasks: KILL and sweep after the grace


def stop_all(session, prefix: str, grace: float, settle: float) -> tuple[dict, dict]:
    """Open every host of the session and stop what `prefix` names there, in that round trip.

    Returns (host -> HostInfo or the error that kept it closed, host -> StopReport or the
    HostError of its stop) for the hosts opened; a report's `busy` names this host's
    ports of the plan still held `settle` seconds after the stop."""
    if not prefix:
        raise ValueError("stop needs a tag prefix (an empty one would match every cluster)")
    for name in session.host_names:
        session.agent(name)

    def open_and_stop(name: str):
        agent = session.agents[name]
        request = {**agent._status_request(prefix), "grace": grace, "settle": settle,   # noqa: SLF001
                   "ports": [t.port for t in session.plan.tasks_on(name)]}
        return agent.prepare(more={proto.DOWN: request}, timeout=SLACK + grace + KILL_SWEEP + settle)

    opened = session.parallel(open_and_stop, session.host_names)
    reports: dict = {}
    for name, result in opened.items():
        if isinstance(result, BaseException):
            continue
        session.infos[name] = result
        try:
            reports[name] = report_of(name, session.agents[name].more_answers[proto.DOWN])
        except HostError as e:
            reports[name] = e
    return opened, reports


def report_of(host: str, answer) -> StopReport:
    """The shim's `down` answer as a StopReport (its error as `stop`'s would read)."""
    problem = proto.error_of(answer)
    if problem is not None:
        raise HostError(f"host {host}: {proto.STOP}: {problem}")
    return StopReport(stopped=tuple((s["tag"], int(s["pid"])) for s in answer["stopped"]),
                      survivors=tuple((s["tag"], int(s["pid"])) for s in answer["survivors"]),
                      busy=tuple((int(p), holder) for p, holder in answer["ports"].items() if holder))
