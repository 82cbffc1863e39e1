"""Warm standbys: scripts' interpreters with TensorFlow imported, waiting on their hosts for a
task, so that a move skips Python's and TensorFlow's start (most of a cold move).

Three kinds, one mechanism (agent/standby.py, host/shim_warm.py):
- a **warm spare** (`spare: warm`) keeps standbys from the run's start, with the run's files
  shipped: as many as the most scripts a host it could take holds, each started with the
  environment of the task it would most likely take (the first host it can take, moved there),
  TF_CONFIG aside, which TensorFlow reads only when a strategy or resolver is made;
- **a restart's own** (a run with a warm spare): once the run has stepped, every host running
  scripts keeps a standby per script, started with its task's environment: a move restarts
  every task, so the scripts that stay where they are start again on them, not cold (without
  them the survivors' import, begun at the decision, was the longest part of a warm move);
- **make before break** (a run with a warm spare): the moment a move is decided (for a host
  whose connection dropped, already while the grace decides whether it is lost: suspect()),
  every script of the new plan that no standby waits for gets one on its host, started with
  its exact environment, while the old tasks stop and save; the restart then hands each
  script its standby.

A standby's tag is its own (`<run>:standby:<n>:script`): the old attempts' stops, which sweep
their own tags, never touch it, and it takes its task's tag as it becomes the task. A take the
standby cannot honour (it died, an environment variable read at start-up differs) starts the
task cold on the same channel, and the run says why. docs/hostloss.md, "Warm spares".

Make before break covers the TF servers too, and each host holds a twin of every server it
runs once the run has stepped: heldservers.py.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tfcluster.errors import HostError
from tfcluster.host.shim_protocol import RESTART_VAR
from tfcluster.launch.agent import fence
from tfcluster.launch.agent.standby import Standby
from tfcluster.launch.cluster.hostloss import REOPEN_GRACE
from tfcluster.launch.cluster.session import Background
from tfcluster.launch.run.heldservers import HeldServers
from tfcluster.launch.run.recovery import lost_tasks, step_now
from tfcluster.plan import names, policy

if TYPE_CHECKING:
    from tfcluster.launch.agent.records import TaskLaunch
    from tfcluster.launch.cluster.servers import Watch
    from tfcluster.launch.run.runstate import Run, Supervised
    from tfcluster.plan import Plan, TaskPlan

TF_MODES = ("between-graph", "classic", "coordinator", "mirrored")   # the standby imports TensorFlow


@dataclass
class Prepared:
    """What suspect() readied for a host's move while the grace decides whether it is lost."""
    after: Plan                 # the plan the move would adopt
    fenced: Background          # _prefence: every other host's table, closing both clusters' ports
    watch: Watch | None = None  # the held servers' readiness, asked (servers.watch_ready)


@dataclass
class Standbys:
    held: dict[str, list[Standby]] = field(default_factory=dict)   # host -> standbys not taken yet
    made: int = 0                       # standbys started (their numbers)
    said: list[str] = field(default_factory=list)   # one line per take, for the summary
    tried: set[str] = field(default_factory=set)    # warm spares keep() has been through
    lock: threading.Lock = field(default_factory=threading.Lock)   # keep()'s thread and a move
    shipped: set[str] = field(default_factory=set)    # warm spares the run's files went to (a move skips them)
    suspected: set[str] = field(default_factory=set)   # hosts whose loss is prepared for (suspect())
    numbering: threading.Lock = field(default_factory=threading.Lock)   # `made` and `suspected`, from several threads
    servers: HeldServers = field(default_factory=HeldServers)   # servers held for a move, and twins
    restarting: set[str] = field(default_factory=set)   # hosts keep() gave their restart's standbys (until a restart)
    prepared: dict[str, Prepared] = field(default_factory=dict)   # suspected host -> what its move has ready

    # -- starting them

    def tick(self, run: Run) -> None:
        """The supervisor's tick: the warm spares get their standbys on a thread of their own,
        at the run's start and once a move's tasks have stepped again, and the hosts running
        scripts theirs once the run has stepped (a standby's import then takes no CPU from a
        start or a restart)."""
        plan = run.plan
        if not plan.warm_spares or any(m.resumed is None and m.done_at is not None for m in run.recovery.moves):
            return
        spares = [s for s in plan.warm_spares if s not in self.tried and not plan.tasks_on(s)]
        hosts = [h for h in self._restart_hosts(run) if h not in self.restarting] \
            if plan.mode in TF_MODES and step_now(run) is not None else []
        if (spares or hosts) and self.lock.acquire(blocking=False):
            self.tried.update(spares)
            self.restarting.update(hosts)

            def keep() -> None:
                try:
                    self.keep(run)
                finally:
                    self.lock.release()
            threading.Thread(target=keep, daemon=True, name="tfcluster-standbys").start()

    def keep(self, run: Run) -> None:
        """Every warm spare still free holds its standbys, its files shipped (after the
        scripts' start, and after each move)."""
        plan, pool = run.plan, run.session.pool
        if plan.mode not in TF_MODES:
            return
        for spare in plan.warm_spares:
            if plan.tasks_on(spare) or spare in pool.unusable() or self.held.get(spare):
                continue
            # the host whose move would put the most scripts there (a ps host's move starts
            # none: the first host it could take may hold servers only)
            could = [h for h in plan.hosts if h != spare and plan.tasks_on(h) and plan.spare_problem(spare, h) is None]
            lost = max(could, key=lambda h: sum(t.runs_script for t in plan.tasks_on(h)), default=None)
            if lost is None or not any(t.runs_script for t in plan.tasks_on(lost)):
                continue
            moved = plan.moved(lost, spare)
            tasks = [t for t in moved.tasks_on(spare) if t.runs_script]
            try:
                self._prepare_host(run, spare, moved, tasks)
                self.ship(run, spare, tasks)
            except Exception as exc:  # noqa: BLE001 - a standby is an optimisation: the move goes cold
                run.ui.warn(f"warm spare {spare}: no standby ({_said(exc)}); a move there starts cold")
        if step_now(run) is None:
            return
        for host in self._restart_hosts(run):      # a restart's own: one per script, for its own task,
            tasks = [t for t in plan.tasks_on(host) if t.runs_script]    # and one per server
            waiting = [s for s in self.held.get(host, []) if s.alive()]
            try:
                self._prepare_host(run, host, plan, tasks[len(waiting):])
                self.servers.hold(run, host, plan, self._open, early=True)
            except Exception as exc:  # noqa: BLE001 - that host's tasks restart cold
                run.ui.warn(f"{host}: no standby for a restart ({_said(exc)}); its tasks restart cold")

    @staticmethod
    def _restart_hosts(run: Run) -> list[str]:
        """The usable hosts running tasks of a run that a move would restart (none where its
        servers are `tfcluster up`'s, which a run does not move: recovery.give_up)."""
        if not run.owns_servers and any(t.runs_server for t in run.plan.tasks):
            return []
        unusable = run.session.pool.unusable()
        return [h for h in run.plan.hosts if h not in unusable and run.plan.tasks_on(h)]

    def before_break(self, run: Run, after: Plan) -> None:
        """Make before break: a standby for every script of `after` (the plan a move is about to
        adopt) that none waits for yet, on its host, now."""
        if after.mode not in TF_MODES or not after.warm_spares:
            return          # a cold spare's own start is the restart's path: docs/design/host-loss.md
        with self.lock:             # a warm spare's standbys being made: counted, not made twice
            self._before_break(run, after)

    def suspect(self, run: Run, host: str) -> None:
        """`host`'s connection ended: while the grace decides whether it is lost (hostloss.py),
        the restart its loss would make is prepared on a thread (make before break, a few
        seconds sooner: a survivor's standby imports TensorFlow then, not after the verdict).
        If the host is back, clear() drops what was made for it."""
        plan = run.plan
        if plan.mode not in TF_MODES or not plan.warm_spares:
            return
        spare = run.session.pool.spare_for(plan, host)
        action = policy.on_host_loss(plan.mode, plan.on_host_loss, lost_tasks(run, host), True)[0]
        if spare is None or action != policy.RESTART:
            return
        with self.numbering:        # each of the host's pumps finds the drop
            if host in self.suspected:
                return
            self.suspected.add(host)
        run.ui.info(f"{host}: its connection dropped; its move to {spare} is being prepared (standbys, servers held) "
                    f"while the run waits to see whether it is lost")
        after = plan.moved(host, spare)
        self.prepared[host] = Prepared(after, Background(self._prefence, run, host, plan, after))
        threading.Thread(target=self._prepare_for, args=(run, host, after),
                         name=f"tfcluster-suspect-{host}", daemon=True).start()

    @staticmethod
    def _prefence(run: Run, host: str, before: Plan, after: Plan) -> bool:
        """suspect()'s fence: every other host's table closes the ports of the cluster as it is
        and as the move would make it, so that the move, once decided, binds under tables
        already in place (recovery._restart_all). True when every host of `after` but `host`
        answered closed. If `host` comes back, the tables stay: they close more, never less."""
        session = run.session
        hosts = [h for h in session.agents if h != host and session.pool.usable(h) and h in session.infos]
        asks = {h: fence.request(before, h, fence.INSTALL, also=after) for h in hosts}
        if not asks or None in asks.values() or any(h not in asks for h in after.hosts if after.tasks_on(h)):
            return False
        answers = session.parallel(lambda h: session.agents[h].fence(asks[h]), list(asks))
        return all(isinstance(a, dict) and a.get("closed") for a in answers.values())

    def _for_move(self, host: str, after: Plan) -> Prepared | None:
        """What suspect() readied for `host`'s move, where the move prepared is the move made."""
        prepared = self.prepared.get(host)
        return prepared if prepared is not None and prepared.after == after else None

    def prefenced(self, host: str, after: Plan) -> bool:
        """Whether `host`'s move to the plan `after` finds every table in place (_prefence;
        waits for it)."""
        prepared = self._for_move(host, after)
        try:
            return prepared is not None and bool(prepared.fenced.result())
        except Exception:  # noqa: BLE001 - the restart's own refresh then closes them
            return False

    def readiness(self, run: Run, host: str, after: Plan) -> Watch | None:
        """Whether each server held for `host`'s move to the plan `after` listens: asked while
        the grace decided, else now (once make before break is done), before their GO."""
        prepared = self._for_move(host, after)
        if prepared is not None and prepared.watch is not None:
            return prepared.watch
        return self.servers.watch(run, after, run.options.grace + 5)     # the old servers' stop

    def clear(self, run: Run, host: str) -> None:
        """`host` is back: the standbys and servers made for its loss go (a warm spare's own stay)."""
        if host not in self.suspected:
            return
        self.suspected.discard(host)
        self.prepared.pop(host, None)       # its held servers go: their answers end its watch
        run.ui.info(f"{host} is back: what was prepared for its move is dropped")
        with self.lock:
            self._trim(run)
            self.servers.drop_made_for_moves()

    def _prepare_for(self, run: Run, host: str, after: Plan) -> None:
        """suspect()'s thread: make before break, unless `host` was found back meanwhile."""
        with self.lock:
            if host not in self.suspected:
                return
            try:
                self._before_break(run, after)
                prepared = self.prepared.get(host)      # gone: the host is back
                if prepared is not None:    # asked now, answered as each binds on its GO: after the
                    # verdict and the old servers' stop
                    prepared.watch = self.servers.watch(run, after, REOPEN_GRACE + run.options.grace + 5)
            except Exception:  # noqa: BLE001 - an early start is an optimisation: the restart makes what is missing
                pass

    def _before_break(self, run: Run, after: Plan) -> None:
        lost = run.session.pool.unusable() - set(after.spares)
        hosts = [h for h in after.hosts if h not in lost]

        def prepare(host: str) -> None:
            tasks = [t for t in after.tasks_on(host) if t.runs_script]
            waiting = [s for s in self.held.get(host, []) if s.alive()]
            try:
                self._prepare_host(run, host, after, tasks[len(waiting):])
                self.servers.hold(run, host, after, self._open)
            except Exception as exc:  # noqa: BLE001 - the restart starts that host's tasks cold
                run.ui.warn(f"{host}: no standby for the restart ({_said(exc)})")

        run.session.parallel(prepare, hosts)

    def take_servers(self, run: Run, procs: list[Supervised]) -> list[Supervised]:
        """GO to each server of `procs` held for it (heldservers.py); returns the ones left to
        start cold."""
        cold, said = self.servers.take(run, procs)
        if said:
            run.ui.info(said)
            self.said.append(said)
        return cold

    def _prepare_host(self, run: Run, host: str, plan: Plan, tasks: list[TaskPlan]) -> None:
        if not tasks:
            return
        agent = self._open(run, host)
        for t in tasks:
            with self.numbering:        # hosts are prepared in parallel
                self.made += 1
                n = self.made
            launch = self._launch(run, plan, t, n)
            self.held.setdefault(host, []).append(Standby(agent, launch, run.options.heartbeat, run.options.grace))

    @staticmethod
    def _open(run: Run, host: str):
        """`host`'s agent, opened and its table in place: what a standby or a held server is
        born under."""
        session = run.session
        if host not in session.infos:           # a spare not prepared when the run began
            session.infos[host] = session.agent(host).prepare(None, None)
        agent = session.agents[host]
        ask = fence.request(run.plan, host, fence.INSTALL)
        if agent.fence_request is None and ask is not None:
            # the standby is born in the cluster's cgroup under the host's table, as a task is:
            # a spare opened only now has none yet (the move's refence comes later)
            answer = agent.fence(ask)
            if run.plan.tf_ports == "closed" and not answer.get("closed"):
                raise HostError(f"host {host}: cannot close TensorFlow's ports ({answer.get('why') or 'unknown'})")
        return agent

    def _launch(self, run: Run, plan: Plan, task: TaskPlan, n: int) -> TaskLaunch:
        """The standby's launch: the task's interpreter and environment, its own tag, log and
        pid file."""
        session = run.session
        like = session.launch_for(task, run.run_id, "script", plan.command(task), {RESTART_VAR: "0"})
        tag = names.Tag(plan.name, run.run_id, "standby", n, "script")
        return dataclasses.replace(like, tag=str(tag), log=session.paths.log(run.run_id, f"standby:{n}"),
                                   pidfile=session.paths.pidfile(tag))

    def ship(self, run: Run, host: str, tasks: list[TaskPlan]) -> None:
        """The run's files on `host` before any move needs them there."""
        from tfcluster.launch.cluster.shipping import ship

        if tasks and run.files:
            ship(run.session, tasks, run.run_id, run.files)
            self.shipped.add(host)

    # -- taking them

    def take_all(self, run: Run, procs: list[Supervised]) -> list[Supervised]:
        """Hand every script of `procs` that has a standby on its host its standby, in
        parallel; returns the ones left to start cold."""
        from tfcluster.launch.cluster.session import raise_first

        pairs: list[tuple[Supervised, Standby]] = []
        for p in procs:
            waiting = self.held.get(p.task.host) or []
            while waiting and not waiting[0].alive():
                gone = waiting.pop(0)
                self._cold(run, p, f"its standby's shim on {p.task.host} is gone")
                gone.drop()
            if p.role == "script" and waiting:
                pairs.append((p, waiting.pop(0)))
        results = run.session.parallel(lambda i: self._take(run, *pairs[i]), range(len(pairs)))
        raise_first({pairs[i][0].key: r for i, r in results.items()}, "task")
        taken = {id(p) for p, _ in pairs}
        self._trim(run)
        self.restarting.clear()         # each host's restart standbys anew, once the run steps again
        return [p for p in procs if id(p) not in taken]

    def _trim(self, run: Run) -> None:
        """After a restart (or a suspected host back), a free warm spare keeps its standbys and
        any other host at most one per script of its own (its restart's): one made before a
        break that nothing took (its task went elsewhere, or started cold) costs memory for
        nothing."""
        restarts = set(self._restart_hosts(run))
        for host in list(self.held):
            if host in run.plan.warm_spares and not run.plan.tasks_on(host):
                continue
            scripts = sum(t.runs_script for t in run.plan.tasks_on(host)) if host in restarts else 0
            held = self.held.pop(host)
            keep = [s for s in held if s.alive()][:scripts]
            for s in held:
                if s not in keep:
                    s.drop()
            if keep:
                self.held[host] = keep

    def _take(self, run: Run, proc: Supervised, standby: Standby) -> None:
        from tfcluster.launch.run import attempts
        from tfcluster.launch.run.runstate import StartSlot

        launch = attempts.launch_of(run.session, run.run_id, proc)
        slot = StartSlot()
        run.starts.append(slot)
        began = time.monotonic()
        task, said = standby.take(launch, attempts.in_place(run.plan, proc))
        proc.handle = slot.handle = task
        # its output from now, as a cold start's (attempts.start): a take that waits for a
        # standby still importing elsewhere must not hold back this task's lines
        attempts.attach(run, proc)
        host = proc.task.host
        if said.get("warm"):
            line = (f"warm standby on {host} took {proc.key} (pid {task.pid}, TensorFlow imported in "
                    f"{float(said.get('ready_s') or 0):.1f}s; handed over in {time.monotonic() - began:.1f}s)")
            run.ui.info(line)
        else:
            line = f"{proc.key} on {host}: cold start: {said.get('why') or 'its standby could not take it'}"
            run.ui.warn(line)
        self.said.append(line)

    def _cold(self, run: Run, proc: Supervised, why: str) -> None:
        line = f"{proc.key} on {proc.task.host}: cold start: {why}"
        run.ui.warn(line)
        self.said.append(line)

    def close(self) -> None:
        """Those never taken: each shim reads EOF and stops its standby (a held server: STOP)."""
        self.servers.drop()
        for waiting in self.held.values():
            for s in waiting:
                s.drop()
        self.held.clear()


def _said(exc: BaseException) -> str:
    return getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
