"""`tfcluster train`: run the training script on the cluster and supervise it.

The supervisor brings up the servers the mode needs (attached, so they die with
it) or reuses a cluster that is `up`, ships the script, starts one attached
script per task, streams every output into the LogMux, applies the restart
policy, and stops everything in order on success, failure, timeout or Ctrl-C.
All waiting happens on one event queue fed by one reader thread per process.
"""
from __future__ import annotations

import os
import queue
import re
import signal
import threading
import time
from dataclasses import dataclass, field

from tfcluster import launcher, runlog, state
from tfcluster.errors import ExitCode, TaskError, Terminated, TfclusterError, UsageError
from tfcluster.launcher import Session, launch_for
from tfcluster.plan import Plan, TaskPlan
from tfcluster.spec import Spec

LOSS_LINE = re.compile(r"loss\s*[=:]")
PEER_GRACE = 60.0          # how long other workers may take to finish after the chief succeeded
RETRYABLE = range(128, 256)  # exit-code policy: killed by a signal / infrastructure failures


@dataclass
class Options:
    show: tuple[str, ...] = ()
    quiet: bool = False
    runs_dir: str = "runs"
    grace: float = 10.0
    heartbeat: float = 30.0
    verbose: bool = False           # show TF's start-up chatter too


@dataclass
class Proc:
    """One supervised process: a script, or a server this run owns."""

    task: TaskPlan
    role: str                       # "script" | "server"
    key: str                        # LogMux key
    handle: object = None           # AttachedTask
    launch: object = None           # TaskLaunch of the current attempt
    started: float = 0.0
    ended: float | None = None
    exit_code: int | None = None
    restarts: int = 0
    attempt: int = 0
    stopping: bool = False


@dataclass
class Run:
    spec: Spec
    plan: Plan
    ui: object
    options: Options
    run_id: str
    session: Session
    mux: object
    events: "queue.Queue[tuple[Proc, int, int]]" = field(default_factory=queue.Queue)
    procs: list[Proc] = field(default_factory=list)
    owns_servers: bool = False
    interrupted: int = 0


def train(spec: Spec, plan: Plan, ui, options: Options) -> int:
    if not plan.script:
        raise UsageError(f"{spec.path}: no training script: set train.script or pass --script",
                         hint="`tfcluster init` writes a template script to start from")
    _check_task_filter(plan, options.show)
    run_id = f"{plan.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(2).hex()}"
    with state.ClusterLock(plan.name, "train"), Session(spec, plan, ui) as session:
        ui.info(f"run {run_id}: connecting to {len(plan.hosts)} host(s)…")
        session.open(survey=launcher.server_tasks(plan))
        mux = _make_mux(plan, ui, options, run_id)
        run = Run(spec, plan, ui, options, run_id, session, mux)
        manifest = runlog.Manifest(plan, run_id, os.path.join(options.runs_dir, run_id))
        outcome: tuple[int, str] = (int(ExitCode.ERROR), "did not start")
        try:
            outcome = _run(run)
            return outcome[0]
        except (KeyboardInterrupt, Terminated) as exc:
            outcome = (int(ExitCode.TERMINATED if isinstance(exc, Terminated) else ExitCode.INTERRUPTED),
                       "terminated" if isinstance(exc, Terminated) else "interrupted")
            raise
        except TfclusterError as exc:
            outcome = (int(exc.exit_code), exc.message)
            raise
        finally:
            _shutdown(run)
            mux.close()
            manifest.finish(run.procs, outcome)
            _summary(run, outcome)


def _check_task_filter(plan: Plan, show: tuple[str, ...]) -> None:
    keys = {t.key for t in plan.tasks}
    for key in show:
        if key not in keys:
            raise UsageError(f"--task {key}: no such task (tasks: {', '.join(sorted(keys))})")


def _make_mux(plan: Plan, ui, options: Options, run_id: str):
    from tfcluster.logs import LogMux
    import sys

    keys = [t.key for t in plan.tasks if t.runs_script or t.runs_server]
    keys += [f"{t.key}.server" for t in plan.tasks if t.runs_script and t.runs_server]

    def show(key: str) -> bool:
        if options.quiet or key.endswith(".server"):
            return False
        return not options.show or key in options.show

    save_dir = os.path.join(options.runs_dir, run_id)
    os.makedirs(save_dir, mode=0o700, exist_ok=True)
    return LogMux(sys.stdout.buffer, keys, color=ui.color, show=show, save_dir=save_dir,
                  hide_noise=not options.verbose)


# -- the run ---------------------------------------------------------------------------------

def _run(run: Run) -> tuple[int, str]:
    plan, ui = run.plan, run.ui
    script_tasks = [t for t in plan.tasks if t.runs_script]
    _prepare_servers(run)
    # In classic mode the scripts build their own servers: their ports must be free too.
    launcher.preflight(run.session, script_tasks, ports=plan.mode == "classic")
    _ship(run, script_tasks)
    ui.info(f"Starting the script on {len(script_tasks)} task(s): "
            f"{', '.join(t.key for t in script_tasks)}")
    _start_all(run, [Proc(task, "script", task.key) for task in script_tasks])
    return _supervise(run)


def _prepare_servers(run: Run) -> None:
    servers = launcher.server_tasks(run.plan)
    if not servers:
        return
    live, busy = launcher.survey(run.session, servers)
    if live and len(live) == len(servers):
        run.ui.info(f"Using the running cluster ({len(live)} servers from `tfcluster up`)")
        return
    if live:
        raise TfclusterError(
            f"cluster {run.plan.name!r} is partly up ({len(live)} of {len(servers)} servers running)",
            hint="run `tfcluster up SPEC` to start the missing servers, or `tfcluster down SPEC`")
    launcher.preflight(run.session, servers, busy=busy)
    run.ui.info(f"Starting {len(servers)} server(s)…")
    run.owns_servers = True
    procs = [Proc(t, "server", f"{t.key}.server" if t.runs_script else t.key) for t in servers]
    _start_all(run, procs)
    started = [launcher.Started(p.task, p.launch.tag, p.handle.pid, p.launch.log) for p in procs]
    launcher.wait_ready(run.session, started, launcher.READY_TIMEOUT)


def _ship(run: Run, tasks: list[TaskPlan]) -> None:
    """Copy the script and train.files into this run's directory on each host that runs it."""
    files = runlog.collect_files(run.spec, run.plan)
    rundir = f"{run.plan.cluster_dir}/runs/{run.run_id}"

    hosts = list(dict.fromkeys(t.host for t in tasks))
    results = launcher.parallel(lambda h: run.session.agents[h].sync_files(files, rundir), hosts)
    launcher.raise_first(results, "host")
    sent = sum(results.values())
    total = sum(len(data) for _, data, _ in files) * len(hosts)
    run.ui.info(f"Shipped {len(files)} file(s) to {len(hosts)} host(s): {_size(sent)} new, "
                f"{_size(total - sent)} already there")


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def _start_all(run: Run, procs: list[Proc]) -> None:
    """Start processes in parallel: each start is a round trip (a handshake with its shim),
    and 32 workers one after another would take seconds before the last one runs."""
    run.procs.extend(p for p in procs if p not in run.procs)  # summary order = plan order
    results = launcher.parallel(lambda i: _start(run, procs[i]), range(len(procs)))
    launcher.raise_first({procs[i].key: r for i, r in results.items()}, "task")


def _start(run: Run, proc: Proc) -> None:
    agent = run.session.agents[proc.task.host]
    argv = agent.server_argv() if proc.role == "server" else proc.task.argv
    if argv and argv[0] == run.plan.python:
        argv = (agent.python, *argv[1:])  # a local host may run tfcluster's own interpreter
    extra = {"TFCLUSTER_RESTART": str(proc.restarts)}
    launch = proc.launch = launch_for(run.plan, proc.task, run.run_id, proc.role, argv, extra)
    proc.handle = agent.start_attached(launch, heartbeat_timeout=run.options.heartbeat,
                                       grace=run.options.grace)
    proc.started = time.time()
    proc.ended = proc.exit_code = None
    proc.attempt += 1
    if proc not in run.procs:
        run.procs.append(proc)
    threading.Thread(target=_pump, args=(run, proc, proc.handle, proc.attempt),
                     name=f"pump-{proc.key}", daemon=True).start()


def _pump(run: Run, proc: Proc, handle, attempt: int) -> None:
    """Feed one process's output to the mux; report its exit on the event queue."""
    try:
        while chunk := handle.read():
            run.mux.feed(proc.key, chunk)
        rc = handle.wait(30)
    except Exception as exc:  # noqa: BLE001 - a lost channel is an exit like any other
        run.mux.note(proc.key, f"lost contact with {proc.task.host}: {exc}")
        rc = None
    if rc is None or rc < 0:  # the channel closed with no exit status: connection lost
        if not proc.stopping:
            run.mux.note(proc.key, f"lost contact with {proc.task.host} (connection dropped); "
                                   f"its shim stops the task")
        rc = 255
    run.events.put((proc, attempt, rc))


def _supervise(run: Run) -> tuple[int, str]:
    deadline = time.monotonic() + run.plan.timeout if run.plan.timeout else None
    chief_done_at: float | None = None
    while True:
        if _all_needed_done(run):
            return int(ExitCode.OK), "succeeded"
        wait = 0.5
        if deadline is not None and time.monotonic() > deadline:
            raise TfclusterError(f"run {run.run_id} hit its timeout ({run.plan.timeout:.0f}s); "
                                 f"stopped every task", exit_code=ExitCode.TIMEOUT)
        if chief_done_at and time.monotonic() - chief_done_at > PEER_GRACE:
            run.ui.warn(f"workers still running {PEER_GRACE:.0f}s after the chief finished; stopping them")
            return int(ExitCode.OK), "succeeded (stragglers stopped)"
        try:
            proc, attempt, rc = run.events.get(timeout=wait)
        except queue.Empty:
            continue
        if attempt != proc.attempt:
            continue  # an earlier attempt's exit, already handled
        proc.exit_code, proc.ended = rc, time.time()
        if proc.stopping:
            continue
        if rc == 0 and proc.role == "script":
            if proc.task.is_chief and run.plan.mode in ("between-graph", "coordinator"):
                chief_done_at = time.monotonic()
            continue
        if chief_done_at and proc.role == "script":
            run.ui.warn(f"{proc.task.key} exited with code {rc} after the chief had finished")
            continue
        _on_failure(run, proc, rc)


def _all_needed_done(run: Run) -> bool:
    """Success: the chief exited 0 (between-graph/coordinator) and, in mirrored and classic,
    every worker did too; in between-graph, other workers are given PEER_GRACE to finish."""
    scripts = [p for p in run.procs if p.role == "script"]
    if run.plan.mode in ("mirrored", "classic"):
        needed = [p for p in scripts if p.task.job in ("chief", "worker")]
        return all(p.exit_code == 0 for p in needed)
    chief = next(p for p in scripts if p.task.is_chief)
    if chief.exit_code != 0:
        return False
    others = [p for p in scripts if p is not chief and p.task.job in ("worker", "chief")]
    return all(p.exit_code is not None for p in others)


def _on_failure(run: Run, proc: Proc, rc: int) -> None:
    policy = run.plan.restart
    retry = policy.policy == "on-failure" or (policy.policy == "exit-code" and rc in RETRYABLE)
    what = f"{proc.task.key}{' server' if proc.role == 'server' else ''} on {proc.task.host}"
    if retry and proc.restarts < policy.max_restarts:
        proc.restarts += 1
        run.mux.note(proc.key, f"exited with code {rc}; restarting ({proc.restarts}/{policy.max_restarts})")
        run.ui.warn(f"{what} exited with code {rc}; restarting ({proc.restarts}/{policy.max_restarts})")
        if proc.role == "server" and proc.task.job == "ps":
            run.ui.warn(f"{proc.task.key} lost the variables it held; training resumes from the last "
                        f"checkpoint only if the script restores one (the templates do with --model_dir)")
        _start(run, proc)
        return
    tail = "\n".join(run.mux.tail(proc.key, 15))
    hint = _diagnose(run.plan, tail) or _restart_hint(policy, proc, retry)
    raise TaskError(f"{what} failed with exit code {rc}", hint=hint,
                    details=f"last lines of {proc.task.key}:\n{tail}" if tail else None)


def _restart_hint(policy, proc: Proc, retried: bool) -> str | None:
    if retried:
        return f"it failed {proc.restarts + 1} times (train.restart.max_restarts = {policy.max_restarts})"
    if policy.policy == "never":
        return "set train.restart: {policy: on-failure} in the spec to restart failed tasks"
    return None


# Known failure signatures in a task's last lines, and what to do about them.
DIAGNOSES = (
    (("Could not start gRPC server", "Address already in use"),
     "between-graph", "in between-graph mode tfcluster already runs this task's TF server; a script that "
     "builds its own tf.train.Server (old --job_name/--task_index style) needs `train.mode: classic`"),
    (("No module named 'tensorflow'",), None,
     "tensorflow is not importable by this interpreter on the host: set `python:` in the spec"),
    (("error: unrecognized arguments", "error: the following arguments are required"), None,
     "the script rejected its arguments: check train.args (or the arguments after `--`)"),
)


def _diagnose(plan: Plan, tail: str) -> str | None:
    for needles, mode, hint in DIAGNOSES:
        if (mode is None or plan.mode == mode) and any(n in tail for n in needles):
            return hint
    return None


# -- shutdown --------------------------------------------------------------------------------

def _shutdown(run: Run) -> None:
    """Scripts first (TERM, grace for a last checkpoint), then servers; a second Ctrl-C
    drops everything at once."""
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in signals}
    fast = threading.Event()

    def second_ctrl_c(signum, frame) -> None:
        fast.set()
        run.ui.warn("second Ctrl-C: stopping everything now")

    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        for sig in signals:
            signal.signal(sig, second_ctrl_c)
    try:
        for role in ("script", "server"):
            _stop_role(run, role, fast)
        if run.owns_servers or run.procs:
            prefix = f"{run.plan.name}:{run.run_id}:"
            launcher.stop_run(run.session, prefix, grace=0 if fast.is_set() else 2.0)
    finally:
        if main_thread:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _stop_role(run: Run, role: str, fast: threading.Event) -> None:
    live = [p for p in run.procs if p.role == role and p.exit_code is None and p.handle is not None]
    for proc in live:
        proc.stopping = True
        try:
            proc.handle.detach_kill() if fast.is_set() else proc.handle.stop()
        except Exception:  # noqa: BLE001 - the sweep below catches what this misses
            pass
    deadline = time.monotonic() + run.options.grace + 5
    while any(p.exit_code is None for p in live) and time.monotonic() < deadline and not fast.is_set():
        try:
            proc, _attempt, rc = run.events.get(timeout=0.2)
            if proc.exit_code is None:
                proc.exit_code, proc.ended = rc, time.time()
        except queue.Empty:
            pass


def _summary(run: Run, outcome: tuple[int, str]) -> None:
    rows = []
    for p in run.procs:
        if p.role != "script":
            continue
        duration = (p.ended or time.time()) - p.started if p.started else 0
        last = (run.mux.last_line_matching(p.key, LOSS_LINE) or "").replace("tfcluster-result: ", "")
        rows.append((p.task.key, p.task.host, "-" if p.exit_code is None else str(p.exit_code),
                     str(p.restarts), f"{duration:.1f}s", last[-60:]))
    if rows:
        run.ui.table(f"run {run.run_id}", ["task", "host", "exit", "restarts", "duration", "last loss line"],
                     rows, stderr=True)
    code, text = outcome
    saved = os.path.join(run.options.runs_dir, run.run_id)
    (run.ui.ok if code == 0 else run.ui.info)(f"{text} — logs in {saved}/")
