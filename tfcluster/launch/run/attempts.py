"""Each supervised process's attempts: start one, stream its output, restart it.

A restart happens in place when the shim can (docs/design/restarts.md, "Restarts in place"): the
attached shim of the attempt that failed has already started the next one, with the
same policy and count as policy.should_restart here, and holds its output back; the
supervisor says and counts the restart exactly as for a fresh start, then confirms it
(AttachedTask.resume). The pump of that shim goes on; its attempts are numbered as the
supervisor's. Any other restart (a lost connection, a shim that did not restart) is a
fresh attached start, as before.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import TYPE_CHECKING

from tfcluster.diagnose import signatures, strategy
from tfcluster.errors import TaskError
from tfcluster.host.shim_protocol import RESTART_VAR
from tfcluster.launch.cluster.session import raise_first
from tfcluster.launch.run.runstate import Run, StartSlot, Supervised
from tfcluster.plan import policy
from tfcluster.plan.names import log_file

if TYPE_CHECKING:
    from tfcluster.launch.agent.attached import AttachedTask
    from tfcluster.launch.agent.records import TaskLaunch
    from tfcluster.launch.cluster.session import Session
    from tfcluster.plan import Plan


def start_all(run: Run, procs: list[Supervised], hold: bool = False) -> None:
    """Start processes in parallel: each start is a round trip (a handshake with its shim),
    and 32 workers one after another would take seconds before the last one runs."""
    run.procs.extend(p for p in procs if p not in run.procs)  # summary order = plan order
    results = run.session.parallel(lambda i: start(run, procs[i], hold), range(len(procs)))
    raise_first({procs[i].key: r for i, r in results.items()}, "task")


def start(run: Run, proc: Supervised, hold: bool = False) -> None:
    if proc.handle is not None and proc.handle.resume():   # its shim restarted it in place
        _begin(run, proc)
        return
    agent = run.session.agents[proc.task.host]
    launch = launch_of(run.session, run.run_id, proc)
    slot = StartSlot()
    run.starts.append(slot)
    proc.handle = slot.handle = agent.start_attached(launch, heartbeat_timeout=run.options.heartbeat,
                                                 grace=run.options.grace, hold=hold,
                                                 restart=in_place(run.plan, proc))
    attach(run, proc)


def attach(run: Run, proc: Supervised) -> None:
    """proc.handle is its new attempt's shim: count the attempt, pump its output."""
    _begin(run, proc)
    threading.Thread(target=pump, args=(run, proc, proc.handle, proc.attempt),
                     name=f"pump-{proc.key}", daemon=True).start()


def launch_of(session: Session, run_id: str, proc: Supervised) -> TaskLaunch:
    """proc's TaskLaunch for its next attempt (kept in proc.launch)."""
    agent = session.agents[proc.task.host]
    argv = agent.server_argv() if proc.role == "server" else session.plan.command(proc.task)
    proc.launch = session.launch_for(proc.task, run_id, proc.role, argv, {RESTART_VAR: str(proc.restarts)})
    return proc.launch


def in_place(plan: Plan, proc: Supervised) -> dict | None:
    """The restart policy an attached shim applies itself (None: it never restarts)."""
    restart = plan.restart
    if restart.policy == policy.NEVER or policy.restarts_together(plan.mode):
        return None     # together: the supervisor restarts every process (restart_together)
    return {"policy": restart.policy, "max_restarts": restart.max_restarts, "done": proc.restarts,
            "zero_ends": proc.role == "script"}     # a script's exit 0 is its success, never restarted


def _begin(run: Run, proc: Supervised) -> None:
    if proc.attempt:
        proc.restarted = time.time()
    else:
        proc.started = time.time()
    proc.ended = proc.exit_code = None
    proc.attempt += 1
    if proc not in run.procs:
        run.procs.append(proc)


def pump(run: Run, proc: Supervised, handle: AttachedTask, attempt: int) -> None:
    """Feed one shim's output to the mux; report each attempt's exit on the event queue."""
    ended = attempt            # the attempt whose end is reported next

    def restarted(rc: int) -> None:   # an attempt the shim restarted in place; its output all fed
        nonlocal ended
        run.mux.close_task(proc.key)  # its last line shows before the note; the next starts afresh
        run.events.put((proc, ended, rc))
        ended += 1

    handle.on_restart = restarted
    lost = misread = None
    try:
        while chunk := handle.read():
            try:
                run.mux.feed(proc.key, chunk)
            except Exception as exc:  # noqa: BLE001 - our reading of the output failed, not the channel
                if misread is None:
                    misread = exc
                    run.ui.warn(f"{proc.key}: could not read its output ({type(exc).__name__}: "
                                f"{str(exc)[:200]}); the task goes on")
        rc = handle.wait(30)
    except Exception as exc:  # noqa: BLE001 - a lost channel is an exit like any other
        lost, rc = exc, None
    ended_at = time.monotonic()
    try:
        run.mux.close_task(proc.key)
        if lost is not None and not proc.stopping:
            run.mux.note(proc.key, f"lost contact with {proc.task.host}: {lost}")
        if rc is None or rc < 0:  # the channel closed with no exit status: connection lost
            agent = run.session.agents.get(proc.task.host)
            if not proc.stopping and agent is not None:
                how = agent.transport.lost or "connection dropped"
                run.mux.note(proc.key, f"lost contact with {proc.task.host} ({how}); its shim stops the task")
                after_drop(run, proc, ended_at)   # a drop that cannot be re-opened is a lost host
            rc = 255
    except Exception:  # noqa: BLE001 - the run ended under it (Ctrl-C, its session closed): no traceback
        rc = 255 if rc is None or rc < 0 else rc
    finally:       # the exit is always reported: a pump that died silently would leave the run waiting
        run.events.put((proc, ended, 255 if rc is None or rc < 0 else rc))


def tasks_on(run: Run, host: str) -> tuple[str, ...]:
    return tuple(t.key for t in run.plan.tasks if t.host == host)


def after_drop(run: Run, proc: Supervised, noticed: float) -> None:
    """proc's channel ended with no exit status: is its host lost? Said at once, by the pump
    that found out first; every process the host held carries the verdict."""
    host = proc.task.host
    if run.standbys is not None:        # the restart a loss would make, prepared during the verdict
        run.standbys.suspect(run, host)
    verdict, first = run.session.pool.losses.judge(host, run.session.agents[host].transport,
                                              tasks_on(run, host), noticed)
    if verdict is None:
        if run.standbys is not None:
            run.standbys.clear(run, host)
        return
    for p in run.procs:
        if p.task.host == host:
            p.host_lost = verdict.how
    if first:
        run.ui.warn(verdict.line)


def refuse(proc: Supervised) -> None:
    """The shim restarted a task the supervisor does not restart: stop that attempt."""
    if proc.handle is not None and proc.handle.restarted():
        proc.handle.stop()


def stop_and_wait(run: Run, procs: list[Supervised], fast: threading.Event | None = None,
                  keep_fence: frozenset[str] = frozenset()) -> None:
    """Stop these processes' attempts (TERM, the shim's grace, KILL; at once once `fast` is
    set) and wait for their ends, grace + 5 s at most, then drop what is left (its shim's
    sweep, or the run's, gets it). Their ends are the run's own doing: only a process still
    running is marked stopping, so one that failed before keeps its exit code. On the hosts
    in `keep_fence` (a move's next tasks start there) the fence table stays.

    Besides the supervisor's loop, the one reader of the run's events: an exit of an earlier
    attempt is dropped as the loop drops it, and anything else (a check's wake-up, an error
    to raise) is put back for the loop, never lost."""
    live = [p for p in procs if p.handle is not None and p.exit_code is None]
    for p in procs:
        if p not in live:
            refuse(p)           # its shim's restart in place of an attempt that ended
    for p in live:
        p.stopping = True
        try:
            p.handle.detach_kill() if fast is not None and fast.is_set() else \
                p.handle.stop(keep_fence=p.task.host in keep_fence)
        except Exception:  # noqa: BLE001 - its shim stops it when the channel goes; the sweep after
            pass
    kept = []
    deadline = time.monotonic() + run.options.grace + 5
    while any(p.exit_code is None for p in live) and time.monotonic() < deadline:
        if fast is not None and fast.is_set():
            break
        try:
            event = run.events.get(timeout=0.2)
        except queue.Empty:
            continue
        if isinstance(event, tuple):
            proc, attempt, rc = event
            if attempt == proc.attempt and proc.exit_code is None:
                proc.exit_code, proc.ended = rc, time.time()
        elif event is not None:
            kept.append(event)
    for event in kept:
        run.events.put(event)
    for p in live:
        if p.exit_code is None:
            try:
                p.handle.detach_kill()
            except Exception:  # noqa: BLE001 - the sweep gets what this misses
                pass


def in_wave(run: Run, wave: int) -> list[Supervised]:
    """The run's tasks that stop in `wave` (policy.stop_wave)."""
    return [p for p in run.procs if policy.stop_wave(p.role, p.task.job) == wave]


def restart_together(run: Run, proc: Supervised, rc: int) -> None:
    """`proc` failed in a mode whose processes only start together (policy.TOGETHER): stop
    every other script, then start them all afresh, each with the same restart count, so
    that they resume from the same checkpoint. The others' ends are the run's own doing
    (stop_and_wait marks them stopping) and counted as one restart of the run."""
    restart = run.plan.restart
    scripts = [p for p in run.procs if p.role == "script"]
    stop_and_wait(run, [p for p in scripts if p is not proc])
    done = max(p.restarts for p in scripts) + 1
    count = f"{done}/{restart.max_restarts}"
    run.mux.note(proc.key, signatures.restart_note(rc, count))
    run.ui.warn(f"{proc.task.key} on {proc.task.host} exited with code {rc}; restarting every process "
                f"from the checkpoint ({count}): {run.plan.mode} mode starts its processes together")
    for p in scripts:
        p.restarts = done
        p.handle, p.stopping, p.exit_code = None, False, None
    start_all(run, scripts)


def on_failure(run: Run, proc: Supervised, rc: int) -> None:
    """A failure that is the task's own (a lost host's are recovery.py's): restart it under
    the policy, or end the run naming it."""
    restart = run.plan.restart
    what = f"{proc.task.key}{' server' if proc.role == 'server' else ''} on {proc.task.host}"
    if proc.role == "script" and policy.restarts_together(run.plan.mode) and \
            policy.should_restart(restart, rc, proc.restarts):
        restart_together(run, proc, rc)
        return
    if policy.should_restart(restart, rc, proc.restarts):
        proc.restarts += 1
        count = f"{proc.restarts}/{restart.max_restarts}"
        run.mux.note(proc.key, signatures.restart_note(rc, count))
        run.ui.warn(f"{what} exited with code {rc}; restarting ({count})")
        if proc.role == "server" and proc.task.job == "ps":
            run.ui.warn(f"{proc.task.key} lost the variables it held; training resumes from the last "
                        f"checkpoint only if the script restores one (the templates do with --model_dir)")
        start(run, proc)
        return
    refuse(proc)
    pending = run.checks.pending()      # a strategy mismatch in its grace: said with the failure
    if pending is not None:
        run.ui.warn(f"{pending[0]} ({pending[1]})")
    failed = f"{what} failed with exit code {rc}"
    log, ended = _last_attempt(run, proc)
    found = signatures.diagnose(run.plan.mode, ended, proc.task.job)
    if found is not None:     # what happened and the fix, not the lines before (a tensor dump)
        raise TaskError(failed, hint=_port_fix(run.plan, found) or found.fix,
                        details=f"{proc.key}: {found.what}\n  {found.line}\n  its whole log: {log}")
    # the last lines, with the exception line however far up its message's help text put it
    tail = "\n".join(signatures.failure_excerpt(run.mux.tail(proc.key, 100), ended))
    raise TaskError(failed, hint=_unshipped_hint(run.plan, ended) or policy.restart_hint(restart, proc.restarts, rc),
                    details=f"last lines of {proc.key}:\n{tail}" if tail else None)


def _last_attempt(run: Run, proc: Supervised) -> tuple[str, bytes]:
    """(`proc`'s saved log, the end of its last attempt there)."""
    log = os.path.join(run.options.runs_dir, run.run_id, log_file(proc.key))
    return log, signatures.last_attempt(signatures.read_tail(log))


def diagnosis(run: Run, proc: Supervised) -> signatures.Diagnosis | None:
    """What `proc`'s last attempt ended with, from its saved log, if it is a known failure."""
    return signatures.diagnose(run.plan.mode, _last_attempt(run, proc)[1], proc.task.job)


def a_consequence(run: Run, proc: Supervised) -> bool:
    """`proc` failed because another task did first (a JAX peer's connection closed under its
    collective): the other's failure is the one to name."""
    found = diagnosis(run, proc)
    return found is not None and found.consequence


def _port_fix(plan, found: signatures.Diagnosis) -> str | None:
    """A server that could not bind because of what the script's text does (its own TF_CONFIG,
    a strategy of another mode that starts its own server): that, not the mode's usual fix."""
    if found.name != "port-bound":
        return None
    own_server = plan.script_scan is not None and plan.script_scan.own_server   # the mode's fix says it
    return strategy.tf_config_warning(plan) or (None if own_server else strategy.tf1_mode_warning(plan))


def _unshipped_hint(plan, ended: bytes) -> str | None:
    """The fix for a script that failed importing a module that sits beside it here but was
    not shipped (spec.shipped.ScriptScan.unshipped)."""
    for module, path, _where in plan.script_scan.unshipped if plan.script_scan else ():
        if f"No module named '{module}'".encode() in ended:
            return (f"{os.path.basename(path)} is here ({path}) but was not shipped: "
                    f"add it to train.files (files: [{plan.script_scan.entry(path)}])")
    return None
