"""`tfcluster train`: run the training script on the cluster and supervise it.

The supervisor brings up the servers the mode needs (attached, so they die with
it) or reuses a cluster that is `up`, ships the script, starts one attached
script per task, streams every output into the LogMux, applies the restart
policy, and stops everything in order on success, failure, timeout or Ctrl-C.
Once the scripts run, the supervisor waits on one event queue fed by one reader
thread per process; the decisions (retry? succeeded? what stops when?) are pure
functions in policy.py.
"""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from typing import TYPE_CHECKING

from tfcluster.diagnose.checks import RunChecks
from tfcluster.errors import DeadlineError, ExitCode, Terminated, TfclusterError, UsageError, did_you_mean
from tfcluster.launch.cluster import deadhosts, state
from tfcluster.launch.cluster.reach import can_connect
from tfcluster.launch.cluster.session import Session, server_tasks
from tfcluster.launch.cluster.shipping import collect_files
from tfcluster.launch.run import attempts, drains, recovery
from tfcluster.launch.run.notices import Notices
from tfcluster.launch.run.runstate import Options, Run, Supervised
from tfcluster.launch.run.sparewatch import SpareWatch
from tfcluster.launch.run.startup import Holder, begin
from tfcluster.launch.run.standbys import Standbys
from tfcluster.localfs import private_dir
from tfcluster.plan import Plan, names, policy
from tfcluster.ui.units import size
from tfcluster.ui.views import print_summary
from tfcluster.watch import footer
from tfcluster.watch.runs import Manifest, ProgressLog

if TYPE_CHECKING:
    from tfcluster.ui import UI
    from tfcluster.watch.logmux import LogMux

SERVER_STOP_GRACE = 2.0     # servers hold no state worth waiting for
AWAIT_DROP = 2.0            # a task's exit 255 waits this long for its host's channels to end
CAUSE_GRACE = 5.0           # a consequence's failure waits this long for its cause's exit (_cause)


def train(plan: Plan, ui: UI, options: Options) -> int:
    check_task_filter(plan, options.show)
    run_id = names.new_run_id(plan.name)
    with state.lock(plan, "train"), Session(plan, ui) as session:
        plan = deadhosts.around_dead_hosts(session, ui)      # a host down already: its spare
        files = collect_files(plan)     # read (and refused if changed) before connecting
        ui.info(f"run {run_id}: connecting to {len(plan.hosts)} host(s)…")
        # the bootstrap's round trip also places the files from each host's cache
        holder = Holder(session, run_id, options)     # the scripts' shims start held, per host
        try:
            session.open(survey=server_tasks(plan), prepare=holder.prepare,
                         ship=(files, session.paths.rundir(run_id), {t.host for t in plan.tasks if t.runs_script}))
        except BaseException:       # the tables its batches put on hosts with no held script go
            session.take_tables(names.run_prefix(plan.name, run_id),
                                _tables_left(plan, session.reached(), False, False, session.serves_already()))
            raise
        events: queue.Queue = queue.Queue()
        checks = RunChecks(plan, ui, os.path.join(options.runs_dir, run_id), lambda: events.put(None),
                           lambda host, targets, timeout: can_connect(session, host, targets, timeout))
        mux, progress = _make_mux(plan, ui, options, run_id, checks, _save_failed(events))
        run = Run(plan, ui, options, run_id, session, mux, events, checks=checks, progress=progress,
                  files=files)
        drains.clear(plan)              # a drain asked of an earlier run is not this one's
        if plan.moves:                  # a host down at the start: its tasks run on a spare
            state.publish_moves(plan)
        run.notices = Notices()
        run.notices.start(run)          # each watched host's notices, from now (Azure answers slowly)
        run.standbys = Standbys()       # warm spares' standbys, made before a break (standbys.py)
        if plan.checkpoint is not None and plan.checkpoint.sync is not None:
            from tfcluster.launch.run.ckptsync import CheckpointSync
            run.recovery.checkpoints = CheckpointSync(session, plan, os.path.join(options.runs_dir, run_id), ui)
        manifest = Manifest(plan, run_id, os.path.join(options.runs_dir, run_id))
        outcome: tuple[int, str] = (int(ExitCode.ERROR), "did not start")
        try:
            outcome = _run(run, holder)
            return outcome[0]
        except (KeyboardInterrupt, Terminated) as exc:
            outcome = (int(ExitCode.TERMINATED if isinstance(exc, Terminated) else ExitCode.INTERRUPTED),
                       "terminated" if isinstance(exc, Terminated) else "interrupted")
            raise
        except TfclusterError as exc:
            outcome = (int(exc.exit_code), exc.message)
            raise
        finally:
            run.notices.close()
            if run.standbys is not None:
                run.standbys.close()
            if run.footer is not None:
                run.footer.close()
                ui.pause = contextlib.nullcontext
            if run.board is not None:
                run.board.close()
            sync = run.recovery.checkpoints
            if sync is not None:
                sync.stop()
            stopped_by = {ExitCode.INTERRUPTED: "Ctrl-C", ExitCode.TERMINATED: "SIGTERM"}.get(outcome[0])
            _shutdown(run, stopped_by=stopped_by)
            if sync is not None and stopped_by is None:
                _pull_last_save(run, sync)
            _unread_errors(run)
            mux.close()
            run.recovery.tick(run)      # a resumed step said just before the stop counts too
            progress.close()
            try:
                manifest.plan = run.plan        # where the tasks ended up, after any move
                run.notices.link(run.recovery.moves)
                manifest.finish(run.procs, outcome, checks.summary(), progress.summary(),
                                {h: lost.record() for h, lost in session.pool.lost.items()},
                                [m.record() for m in run.recovery.moves],
                                checkpoints=sync.records() if sync is not None else None,
                                notices=[n.record() for n in run.notices.records])
            except TfclusterError as exc:     # a full disk: one line, the run's own error follows
                ui.error(exc.message)
            _summary(run, outcome)


def check_task_filter(plan: Plan, show: tuple[str, ...]) -> None:
    """`--task KEY`s name tasks of the plan (also for `--dry-run`, which runs nothing)."""
    keys = sorted(t.key for t in plan.tasks)
    for key in show:
        if key not in keys:
            raise UsageError(f"--task {key}: no such task (tasks: {', '.join(keys)})" + did_you_mean(key, keys))


def _save_failed(events: queue.Queue):
    """What a saved file that cannot be written (a full disk) does: it ends the run at once,
    exit 1, naming the file (the supervisor raises the error it is sent; docs/running.md,
    "Saved runs")."""
    said: list[str] = []

    def failed(path: str, error: OSError) -> None:
        if not said:
            said.append(path)
            events.put(TfclusterError(f"cannot save the run: {path}: {error.strerror or error}; "
                                      f"stopped every task (what was saved before is kept)",
                                      hint="free space there, or give --runs-dir a directory on another disk"))
    return failed


def _make_mux(plan: Plan, ui: UI, options: Options, run_id: str,
              checks: RunChecks, save_failed=None) -> tuple[LogMux, ProgressLog]:
    from tfcluster.watch.logmux import LogMux

    keys = [t.key for t in plan.tasks if t.runs_script or t.runs_server]
    keys += [names.mux_key(t.key, "server", True) for t in plan.tasks if t.runs_script and t.runs_server]

    def show(key: str) -> bool:
        if options.quiet or key.endswith(".server"):
            return False
        return not options.show or key in options.show

    save_dir = os.path.join(options.runs_dir, run_id)
    # runs/ and this run's dir are judged; the levels above are the user's choice
    private_dir(save_dir, "runs", top=options.runs_dir)
    progress = ProgressLog(plan, save_dir, save_failed)
    return LogMux(ui.byte_stdout, keys, color=ui.color, show=show, save_dir=save_dir,
                  hide_noise=not options.verbose, save_failed=save_failed, fold=not options.verbose,
                  watch=progress.watch((checks.markers, checks.on_line) if checks.markers else None)), progress


# -- the run ---------------------------------------------------------------------------------

def _run(run: Run, holder: Holder) -> tuple[int, str]:
    plan, ui = run.plan, run.ui
    begin(run, holder)          # checks, servers, files, scripts (startup.py)
    if footer.wanted(ui.stdout, run.options.quiet):
        run.footer = footer.LiveFooter(run.mux, run.progress, plan.restart.max_restarts)
        ui.pause = run.mux.pause_footer
    if run.recovery.checkpoints is not None:     # the chief's, wherever it runs now
        run.recovery.checkpoints.start(lambda: run.plan.chief.host if run.plan.chief else None)
    if plan.tensorboard:
        from tfcluster.watch import board
        run.board = board.start(run.session, plan, run.run_id, ui,
                                os.path.join(run.options.runs_dir, run.run_id), run.options.heartbeat)
    return _supervise(run)


def _supervise(run: Run) -> tuple[int, str]:
    deadline = time.monotonic() + run.plan.timeout if run.plan.timeout else None
    chief_done_at: float | None = None
    spares = SpareWatch()
    while True:
        if policy.run_succeeded(run.plan.mode, _script_states(run)):
            return _judged(run, "succeeded")
        if deadline is not None and time.monotonic() > deadline:
            raise DeadlineError(f"run {run.run_id} hit its timeout ({run.plan.timeout:.0f}s); "
                                f"stopped every task")
        if chief_done_at and time.monotonic() - chief_done_at > policy.PEER_GRACE:
            running = [p.key for p in run.procs if p.role == "script" and p.exit_code is None]
            run.ui.warn(f"{', '.join(running) or 'scripts'} still running {policy.PEER_GRACE:.0f}s after the "
                        f"chief finished; stopping {'it' if len(running) == 1 else 'them'}"
                        + (" (an evaluator that ends after the last checkpoint ends the run sooner: "
                           "tf.keras.utils.SidecarEvaluator(max_evaluations=N) or its own loop's end)"
                           if any(k.startswith("evaluator:") for k in running) else ""))
            return _judged(run, "succeeded (stragglers stopped)")
        run.checks.tick(run.procs, run.mux)
        run.recovery.tick(run)
        drains.poll(run)
        run.notices.poll(run)       # a host about to go: drained before its deadline (notices.py)
        run.standbys.tick(run)      # warm spares' standbys, off the loop (standbys.py)
        spares.tick(run)            # an idle spare that died: said now, not at the next loss
        if run.footer is not None:
            run.footer.refresh(run.procs)
        try:
            event = run.events.get(timeout=0.5)
        except queue.Empty:
            continue
        if event is None:
            continue        # a check woke us
        if isinstance(event, TfclusterError):
            raise event     # a saved file cannot be written (_save_failed)
        proc, attempt, rc = event
        if attempt != proc.attempt:
            continue  # an earlier attempt's exit, already handled
        proc.exit_code, proc.ended = rc, time.time()
        if proc.stopping or proc.task.host in run.session.pool.given_up and proc.host_lost:
            continue            # stopped by the run, or its host given up (recovery.py)
        if rc == 0 and proc.role == "script":
            if policy.starts_peer_grace(run.plan.mode, proc.task.is_chief, rc):
                chief_done_at = time.monotonic()
            continue
        if chief_done_at and proc.role == "script":
            attempts.refuse(proc)
            run.ui.warn(f"{proc.task.key} exited with code {rc} after the chief had finished")
            continue
        if rc == 255:   # also what a task says when its host goes: let the pumps notice first
            run.session.pool.losses.awaited(proc.task.host, AWAIT_DROP)
        run.session.pool.losses.settled(run.session.pool.losses.grace + 5)
        lost = run.session.pool.pending()
        if lost is not None:    # the lost host is dealt with, not a peer that missed it
            attempts.refuse(proc)
            recovery.after_loss(run, lost)      # raises when the run cannot go on
            continue
        proc, rc = _cause(run, proc, rc)
        attempts.on_failure(run, proc, rc)


def _cause(run: Run, proc: Supervised, rc: int) -> tuple[Supervised, int]:
    """The failure to act on: `proc`'s, unless its log says another task failed first (a JAX
    process whose peer raised sees the peer's connection close within milliseconds, and its
    exit can be read first). Then the exits of the next CAUSE_GRACE seconds are read, and a
    script failure among them that is no consequence itself is the cause; the events it passes
    over are handled as usual after."""
    if proc.role != "script" or not attempts.a_consequence(run, proc):
        return proc, rc
    passed: list = []
    end = time.monotonic() + CAUSE_GRACE
    try:
        while (left := end - time.monotonic()) > 0:
            try:
                event = run.events.get(timeout=left)
            except queue.Empty:
                break
            if not isinstance(event, tuple):
                passed.append(event)
                continue
            other, attempt, other_rc = event
            if (attempt != other.attempt or other.stopping or other.role != "script" or other_rc == 0
                    or other is proc):
                passed.append(event)
                continue
            if not attempts.a_consequence(run, other):
                other.exit_code, other.ended = other_rc, time.time()
                return other, other_rc
            passed.append(event)        # another consequence: handled as usual after
    finally:
        for event in passed:
            run.events.put(event)
    return proc, rc


def _judged(run: Run, outcome: str) -> tuple[int, str]:
    """The run ended well, unless a move did not: a moved task that never stepped after its
    move is a failed recovery, exit 3 (its host was lost and not recovered)."""
    run.checks.verdict()        # a script that built no strategy says so as it exits
    run.recovery.tick(run)
    move = run.recovery.unproven()
    if move is None:
        return int(ExitCode.OK), outcome
    return (int(ExitCode.CONNECT), f"recovery failed: {move.watch} never stepped after {', '.join(move.tasks)} "
                                   f"moved from {move.host} to {move.spare}")


def _script_states(run: Run) -> list[policy.ScriptState]:
    return [policy.ScriptState(p.task.job, p.task.is_chief, p.exit_code)
            for p in run.procs if p.role == "script"]


# -- shutdown --------------------------------------------------------------------------------

def _shutdown(run: Run, stopped_by: str | None = None) -> None:
    """Scripts first (TERM, grace for a last checkpoint), then servers; a second Ctrl-C or
    SIGTERM drops everything at once (its handler is in place before the user is told so).
    `stopped_by`: the signal that stopped the run ("Ctrl-C", "SIGTERM"), said as it stops."""
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in signals}
    fast = threading.Event()

    def second_ctrl_c(signum, frame) -> None:
        fast.set()
        run.ui.warn(f"second {'SIGTERM' if signum == signal.SIGTERM else 'Ctrl-C'}: stopping everything now")

    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        for sig in signals:
            signal.signal(sig, second_ctrl_c)
    if stopped_by is not None:
        run.ui.info(f"Stopping every task ({stopped_by} again to stop at once)…")
    try:
        for wave in policy.STOP_WAVES:
            _stop_wave(run, wave, fast)
        prefix = names.run_prefix(run.plan.name, run.run_id)
        if (run.owns_servers or run.procs) and not _swept_by_shims(run):
            run.session.stop_run(prefix, grace=0 if fast.is_set() else SERVER_STOP_GRACE)
        else:
            run.session.take_tables(prefix, _tables_left(run.plan, list(run.session.infos),
                                                         run.owns_servers or bool(run.procs),
                                                         run.owns_servers, run.reuses_up))
        if run.board is not None and not fast.is_set():
            run.board.wait_stopped()
    finally:
        if main_thread:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _pull_last_save(run: Run, sync) -> None:
    """The run's last checkpoint, kept with its logs: the chief's final save, or, in a run that
    failed, the one it made as it stopped (TERM, then the grace), newer than the sync's last
    copy; pulled unless its host is lost, drained or out of time. A Ctrl-C is not held up for
    it: the chief's own directory has that save."""
    chief = run.plan.chief
    if chief is not None and run.session.pool.usable(chief.host) and not run.session.pool.gone_by_now(chief.host):
        sync.pull(chief.host)


def _tables_left(plan: Plan, hosts: list[str], started: bool, owns_servers: bool,
                 reuses_up: bool | None) -> list[str]:
    """Of the opened `hosts`, those holding the table this run put there that no shim of the
    run is left to take (the stop of each, with nothing of the run to stop, takes it): a host
    with no task (an idle spare, a drained host), unless the table is `up`'s, whose servers
    the run used (or may use: `reuses_up` None); and when the run ended before anything of it
    `started` (its checks refused it, Ctrl-C), a host with no script too, where no held shim
    of the run sat. A host with `up`'s servers keeps its table: the stop takes a table only
    once nothing of the cluster runs there."""
    up_table = reuses_up is not False and any(t.runs_server for t in plan.tasks)
    left = [h for h in hosts if not plan.tasks_on(h)] if owns_servers or not up_table else []
    if not started:
        left += [h for h in hosts if plan.tasks_on(h) and not any(t.runs_script for t in plan.tasks_on(h))]
    return left


def _swept_by_shims(run: Run) -> bool:
    """Every process this run started was an attached task whose shim said, as it exited,
    that its own sweep left nothing of the task's tag: the run's stop sweep (one remote
    execution per host) would find nothing."""
    return (run.board is None and bool(run.starts)
            and all(slot.handle is not None and slot.handle.swept() for slot in run.starts))


def _stop_wave(run: Run, wave: int, fast: threading.Event) -> None:
    procs = attempts.in_wave(run, wave)
    attempts.stop_and_wait(run, procs, fast)
    killed = [p.key for p in procs if p.role == "script" and p.stopping
              and p.exit_code == 128 + signal.SIGKILL]   # KILL after grace
    if killed and not fast.is_set():
        run.ui.warn(policy.ignored_term(run.plan.mode, killed, run.options.grace))


def _unread_errors(run: Run) -> None:
    """Errors the run sent and nobody raised (a saved file that could not be written while
    the run stopped): said, never dropped."""
    while True:
        try:
            event = run.events.get_nowait()
        except queue.Empty:
            return
        if isinstance(event, TfclusterError):
            run.ui.error(event.message)


def _summary(run: Run, outcome: tuple[int, str]) -> None:
    """One row per script, then one per server that restarted or failed (named by its log's
    key: `ps:0`, `worker:1.server`); a server that only served is left out."""
    rows, steps = [], {}
    # a move the run ended in the middle of: its tasks never started on the spare, so each
    # row names the host they last ran on (the `moved:` line says where they were going)
    left = {key: m.host for m in run.recovery.moves if m.done_at is None and m.action != policy.SHRINK
            for key in m.tasks}
    shown = [p for p in run.procs if p.role == "script"]
    shown += [p for p in run.procs if p.role == "server" and (p.restarts or _failed(p))]
    for p in shown:
        last = ""
        if p.role == "script":
            got = run.progress.tracker.state(p.key) if run.progress else None
            rate = got.steps_per_s if got else None
            steps[p.key] = ("-" if not got or got.step is None else str(got.step),
                            "-" if rate is None else f"{rate:.3g}")
            last = run.progress.last_said(p.key, run.mux) if run.progress else ""
        duration = (p.ended or time.time()) - p.started if p.started else 0     # every attempt
        code = "stopped" if policy.ended_by_stop(p.stopping, p.exit_code) else p.exit_code
        if p.host_lost:
            code = "lost"       # its host went, not the task (launch/cluster/hostloss.py)
        rows.append((p.key, left.get(p.task.key, p.task.host), "-" if code is None else str(code),
                     str(p.restarts), f"{duration:.1f}s", last))
    checks = run.checks.summary() if run.checks and steps else {}    # said only once scripts ran
    for move in run.recovery.moves:
        run.ui.info(f"moved: {move.line()}")
    if run.progress is not None and run.progress.loss_note():
        run.ui.info(run.progress.loss_note())
    for notice in run.notices.records:
        run.ui.info(f"notice: {notice.summary()}")
    for line in run.standbys.said if run.standbys is not None else ():
        run.ui.info(f"standby: {line}")
    kept = run.recovery.checkpoints.kept() if run.recovery.checkpoints is not None else []
    if kept:
        run.ui.info(f"checkpoint kept here: {kept[-1].name} ({size(kept[-1].bytes)}, {kept[-1].path}/)")
    print_summary(run.ui, run.run_id, rows, outcome, os.path.join(run.options.runs_dir, run.run_id), checks,
                  steps)


def _failed(proc: Supervised) -> bool:
    """The process ended on its own, not by the run's stop."""
    return proc.exit_code is not None and not proc.stopping
