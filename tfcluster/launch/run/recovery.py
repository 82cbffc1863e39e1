"""What a run does when a host is lost or drained: go on without its tasks, or stop every
task and start them all again on the new cluster, the host's tasks on a spare, from the
checkpoint (train.on_host_loss; the decision is plan/policy.py's on_host_loss, the TF facts
behind it in docs/design/host-loss.md, the user's view in docs/hostloss.md).

Each move is recorded (moves.py) and judged by the steps that follow it: a move after which
the task it watches never steps is a failed recovery (Recovery.unproven). A move is not a
restart: it does not count against train.restart.max_restarts.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tfcluster.errors import ConnectError, TfclusterError
from tfcluster.launch.agent import fence
from tfcluster.launch.cluster import state
from tfcluster.launch.cluster.servers import Started, Watch, check_ready, wait_ready
from tfcluster.launch.cluster.session import Background
from tfcluster.launch.cluster.shipping import ship
from tfcluster.launch.run import attempts, ckptlag
from tfcluster.launch.run.moves import Move
from tfcluster.plan import policy

if TYPE_CHECKING:
    from tfcluster.launch.cluster.hostloss import LostHost
    from tfcluster.launch.run.runstate import Run, Supervised
    from tfcluster.plan import Plan


def step_now(run: Run) -> int | None:
    """The run's step: the furthest any script said (between-graph: the global step)."""
    if run.progress is None:
        return None
    steps = [t.step for t in run.progress.tracker.tasks.values() if t.step is not None]
    return max(steps, default=None)


def lost_tasks(run: Run, host: str) -> list[policy.LostTask]:
    return [policy.LostTask(t.job, t.is_chief) for t in run.plan.tasks_on(host)]


def after_loss(run: Run, lost: LostHost) -> None:
    """A host was found lost: deal with it under the plan's policy, or raise its error (the
    run ends, exit 3, as it always has with on_host_loss: fail)."""
    give_up(run, lost.host, LOST, lost.error(), detail=lost.how)


LOST, DRAINED = "lost", "drained"       # why a run gives a host up


def give_up(run: Run, host: str, kind: str, error: TfclusterError, detail: str = "") -> Move | None:
    """Move `host`'s tasks off it under the plan's policy; raise `error` when the run cannot
    go on. `kind`: LOST (its line, naming the host, was said already) or DRAINED; `detail`:
    how it was lost. The summary says `lost: <detail>` or `drained`."""
    recovery, pool = run.recovery, run.session.pool
    why = f"{kind}: {detail}" if detail else kind
    pool.give_up(host)
    tasks = tuple(t.key for t in run.plan.tasks_on(host))
    spare = reachable_spare(run, host)
    action, reason = policy.on_host_loss(run.plan.mode, run.plan.on_host_loss, lost_tasks(run, host),
                                         spare is not None)
    if action == policy.RESTART and not run.owns_servers and any(
            t.runs_server for t in run.plan.tasks):
        action, reason = policy.FAIL, "its servers were started by `tfcluster up`, which a run does not move"
    if action == policy.FAIL:
        if run.plan.on_host_loss != policy.FAIL:
            run.ui.warn(f"{host}: cannot recover: {reason}")
        raise error
    move = Move(host, why, action, reason, tasks, time.time(), step_now(run), spare)
    recovery.moves.append(move)
    procs = [p for p in run.procs if p.task.host == host]
    said = host if kind == LOST else f"{host} {why}"     # the lost line was said already
    if action == policy.SHRINK:
        _stop(run, procs)         # a drained host's; a lost one's shims stop their own
        for p in procs:
            p.host_lost = p.host_lost or why
        run.ui.warn(f"{said}: going on without {', '.join(tasks)} ({reason})")
        return move
    run.ui.warn(f"{said}: moving {', '.join(tasks)} to {spare}, every task restarting from the checkpoint "
                f"({reason})")
    try:
        _restart_all(run, move)
    except TfclusterError as exc:
        raise ConnectError(f"could not move {', '.join(tasks)} to {spare}: {exc.message}",
                           hint=exc.hint) from None
    move.done_at = time.time()
    return move


def reachable_spare(run: Run, host: str, taken: set[str] | frozenset[str] = frozenset()) -> str | None:
    """The first spare that can take `host`'s tasks (none lost, set aside or in `taken`) and
    answers now; each that does not is set aside, said once (a spare holds no task whose
    channel would say it went: run/sparewatch.py looks between losses)."""
    pool = run.session.pool
    while (spare := run.plan.spare_for(host, used=pool.unusable() | set(taken))) is not None:
        gone = run.session.unreachable(spare)
        if gone is None:
            return spare
        run.ui.warn(f"spare {spare} not usable: {gone}")
        pool.set_aside(spare, gone)
    return None


def _adopt(run: Run, lost: str, spare: str) -> None:
    """The run's plan becomes the one with `lost`'s tasks on `spare`."""
    plan = run.plan.moved(lost, spare)
    run.plan = plan
    run.session.adopt(plan)
    state.publish_moves(plan)       # `status` and `drain` plan with it while the run goes on
    if run.checks is not None:
        run.checks.adopt(plan)      # the watchdog names and dials where the tasks are now
    for p in run.procs:
        p.task = plan.task(p.task.key)


def _watched(run: Run, moved: list[Supervised]) -> str | None:
    """Whose first step says where the run resumed: the chief's, else a moved script's."""
    chief = run.plan.chief
    if chief is not None:
        return chief.key
    scripts = [p.key for p in moved if p.role == "script"]
    return scripts[0] if scripts else None


def _restart_all(run: Run, move: Move) -> None:
    """Every task stops and starts again on the new cluster, from the checkpoint."""
    after = run.plan.moved(move.host, move.spare)
    _open_spares(run, [move.spare])
    # make before break: the new scripts' standbys and servers start now, while the old tasks stop and save
    early = Background(run.standbys.before_break, run, after) if run.standbys is not None else None
    watching = Background(_watch_held, run, after, move, early) if early is not None else None
    # The fence follows the tasks: every host keeps its table through the stop, and each gets
    # the new one beside the stop (or had it already: _fence_for); a host the move leaves
    # loses it once the new tasks run (_release). Not with another host warned: it may ride
    # along, and the tables wait for the stop, as the riders do.
    fenced, keep = None, frozenset()
    if not set(run.session.pool.warned) - {move.host}:
        keep = frozenset(p.task.host for p in run.procs)
        fenced = Background(_fence_for, run, after, move)
    _stop(run, attempts.in_wave(run, 0), keep)    # the training scripts first: a last save
    sync = run.recovery.checkpoints
    chief = run.plan.chief
    if sync is not None and chief is not None and chief.host not in run.session.pool.lost:
        sync.pull(chief.host)       # the newest, after the scripts' last save (a drain)
    _stop(run, attempts.in_wave(run, 1), keep)
    # hosts warned meanwhile, and others lost with this one, move in this restart too
    riders = run.notices.ride_along(run, move) if run.notices is not None else []
    riders += _lost_along(run, move, riders)
    for m in (move, *riders):
        _adopt(run, m.host, m.spare)
    if not keep or riders:        # while the checkpoint goes to the spare
        first = fenced
        fenced = Background(_refence, run, run.plan, [m.spare for m in (move, *riders)], first)
    ready = watching.result() if watching is not None else None
    if sync is not None:
        chief = run.plan.chief
        for m in riders:        # the chief moved with a rider: its checkpoint goes there too
            if chief is not None and chief.host == m.spare:
                m.checkpoint = sync.push(m.spare)
        move.checkpoint = sync.push(move.spare)
        cost = ckptlag.restore_cost(move.checkpoint, move.step_at)    # said before the steps are redone
        if cost is not None:
            run.ui.warn(cost)
    _start(run, list(run.procs), move, riders, fenced, ready)
    if fenced.result() is True:     # tables closing both clusters: this one's once it trains
        run.recovery.after_resume.append(lambda: _narrow(run))
    _release(run, [h for h in keep if not run.plan.tasks_on(h)])
    for m in (move, *riders):
        m.watch = _watched(run, [p for p in run.procs if p.task.host == m.spare])
    for m in riders:
        m.done_at = time.time()
    if riders and run.notices is not None:
        run.notices.settle(run, riders)


def _lost_along(run: Run, move: Move, riders: list[Move]) -> list[Move]:
    """Each other host lost and not yet dealt with (two at once, or one during the stop): its
    tasks move in this same restart, to a spare of their own, where the policy restarts them;
    else this restart would start them on a host that is gone. One that no spare can take is
    left to its own turn (the restart then fails there, and on_host_loss decides)."""
    pool, along = run.session.pool, []
    for host in sorted(pool.lost, key=lambda h: pool.lost[h].at):
        tasks = tuple(t.key for t in run.plan.tasks_on(host))
        if host == move.host or host in pool.given_up or not tasks:
            continue
        spare = reachable_spare(run, host, {move.spare, *(m.spare for m in (*riders, *along))})
        action, reason = policy.on_host_loss(run.plan.mode, run.plan.on_host_loss, lost_tasks(run, host),
                                             spare is not None)
        if action != policy.RESTART:
            continue
        pool.give_up(host)
        lost = pool.lost[host]
        rider = Move(host, f"{LOST}: {lost.how}" if lost.how else LOST, action, reason, tasks, time.time(),
                     step_now(run), spare)
        run.recovery.moves.append(rider)
        along.append(rider)
        run.ui.warn(f"{host}: moving {', '.join(tasks)} to {spare} in the same restart as {move.host}'s ({reason})")
    return along


def _stop(run: Run, procs: list[Supervised], keep_fence: frozenset[str] = frozenset()) -> None:
    """Stop these attempts and wait for their ends; the ends are this run's own, not failures.
    A lost host's are gone already (its shims stopped them when their channels ended). On the
    hosts in `keep_fence` the fence table stays (the next tasks start there)."""
    attempts.stop_and_wait(run, [p for p in procs if p.task.host not in run.session.pool.lost],
                           keep_fence=keep_fence)


def _watch_held(run: Run, after: Plan, move: Move, early: Background) -> Watch | None:
    """Whether each held server listens, asked of its host before its GO and answered as it
    binds: asked while the grace decided (Standbys.suspect), or once make before break is
    done (`early`). The asking (a remote execution) is off the path."""
    early.result()
    return run.standbys.readiness(run, move.host, after)


def _fence_for(run: Run, after: Plan, move: Move) -> bool:
    """The tables for `after` on every host: True where they were in place already, installed
    while the grace decided whether `move.host` was lost (Standbys.suspect: they close this
    cluster's ports and the old one's, and the exact ones can follow once the tasks run)."""
    if run.standbys is not None and run.standbys.prefenced(move.host, after):
        return True
    _refence(run, after, [])
    return False


def _narrow(run: Run) -> None:
    """The run's own tables, where a move bound under tables that closed the old cluster's
    ports too (_fence_for): done once the moved tasks train, so its work takes no CPU from
    their start. Quiet: the tables in place close more than these."""
    try:
        _refence(run, run.plan, [])
    except Exception:  # noqa: BLE001 - see above; the next move or the run's end replaces them
        pass


def _refence(run: Run, plan: Plan, spares: list[str], before: Background | None = None) -> None:
    """`plan`'s fence on every host still in the run, before anything binds, `spares` opened
    first: every table must name the moved tasks' new addresses, and a spare that took tasks
    closes their ports. Each table is replaced whole in one transaction, so its ports are
    never open meanwhile; a given-up host (lost, drained) left the cluster and gets none
    (_release). A spare with no task gets the output chain alone (its users may not
    dial the others' ports). Where it cannot, the run says so as at its start, and
    `tf_ports: closed` ends it (exit 4). `before`: a refresh this one follows (its tables are
    older)."""
    if before is not None:
        before.result()
    _open_spares(run, spares)
    session = run.session
    if plan.tf_ports == "open":
        return
    hosts = [h for h in session.agents if session.pool.usable(h) and h in session.infos]
    results = session.parallel(
        lambda h: session.agents[h].fence(fence.request(plan, h, fence.INSTALL)), hosts)
    answers = {h: r if isinstance(r, dict) else {"closed": False, "can": False, "why": str(r)}
               for h, r in results.items()}
    fence.report(plan, run.ui, answers, fence.INSTALL)


def _release(run: Run, hosts: list[str]) -> None:
    """The hosts the move took the cluster off, whose tasks stopped leaving their tables: each
    table goes now, unless something of the cluster still runs there. Left to a thread: a
    drained host may be going away, and nothing waits for its answer. Until the new tasks ran,
    it had to stay: where hosts share a kernel (one machine's addresses, the test bed) they
    share the cluster's cgroup, which the last table's removal takes with it, and the tables of
    the hosts that keep tasks match it."""
    session = run.session
    asks = {h: fence.request(run.plan, h, fence.RELEASE) for h in hosts
            if h in session.agents and h not in session.pool.lost and not session.pool.gone_by_now(h)}
    asks = {h: ask for h, ask in asks.items() if ask is not None}
    if asks:
        Background(session.parallel, lambda h: session.agents[h].release_fence(asks[h]), list(asks))


def _open_spares(run: Run, spares: list[str]) -> None:
    """The spares a move puts tasks on, opened (their shim and facts) if the run's start did not."""
    session = run.session
    for spare in spares:
        if spare not in session.infos:
            session.infos[spare] = session.agent(spare).prepare(None, None)


def _start(run: Run, procs: list[Supervised], move: Move, riders: list[Move], fenced: Background,
           ready: Watch | None) -> None:
    """Start `procs` afresh on the run's (new) plan, once `fenced` (_refence) is done: servers
    first, ready, then the scripts, shipping the files to the spares first (`move`'s, and those
    of the moves that ride along with it)."""
    for p in procs:
        p.handle, p.stopping, p.host_lost, p.exit_code = None, False, None, None
    session = run.session
    spares = [m.spare for m in (move, *riders)]
    scripts = [p for p in procs if p.role == "script"]
    shipped = run.standbys.shipped if run.standbys is not None else set()   # a warm spare's files went with its standby
    on_spare = [p.task for p in scripts if p.task.host in spares and p.task.host not in shipped]
    if on_spare and run.files:
        run.ui.info(ship(session, on_spare, run.run_id, run.files))
    fenced.result()
    servers = [p for p in procs if p.role == "server"]
    if servers:
        cold = run.standbys.take_servers(run, servers) if run.standbys is not None else servers
        attempts.start_all(run, cold)
        started = [Started(p.task, p.launch.tag, p.handle.pid, p.launch.log) for p in servers]
        if ready is not None:       # the held ones' readiness was asked before their GO
            check_ready(session, ready, started)
        else:
            wait_ready(session, started)
    cold = run.standbys.take_all(run, scripts) if run.standbys is not None else scripts  # the standby is the script
    if cold:
        attempts.start_all(run, cold)
