"""Warm standbys: scripts' interpreters with TensorFlow imported, waiting on their hosts for a
task, so that a move skips Python's and TensorFlow's start (most of a cold move).

Two kinds, one mechanism (agent/standby.py, host/shim_warm.py):
- a **warm spare** (`spare: warm`) keeps standbys from the run's start, with the run's files
  shipped: as many as the most scripts a host it could take holds, each started with the
  environment of the task it would most likely take (the first host it can take, moved there),
  TF_CONFIG aside, which TensorFlow reads only when a strategy or resolver is made;
- **make before break** (a run with a warm spare): the moment a move is decided, every script
  of the new plan that no standby waits for gets one on its host, started with its exact environment, while the old
  tasks stop and save; the restart then hands each script its standby.

A standby's tag is its own (`<run>:standby:<n>:script`): the old attempts' stops, which sweep
their own tags, never touch it, and it takes its task's tag as it becomes the task. A take the
standby cannot honour (it died, an environment variable read at start-up differs) starts the
task cold on the same channel, and the run says why. docs/hostloss.md, "Warm spares".
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
from tfcluster.plan import names

if TYPE_CHECKING:
    from tfcluster.launch.agent.records import TaskLaunch
    from tfcluster.launch.run.runstate import Run, Supervised
    from tfcluster.plan import Plan, TaskPlan

TF_MODES = ("between-graph", "classic", "coordinator", "mirrored")   # the standby imports TensorFlow


@dataclass
class Standbys:
    held: dict[str, list[Standby]] = field(default_factory=dict)   # host -> standbys not taken yet
    made: int = 0                       # standbys started (their numbers)
    said: list[str] = field(default_factory=list)   # one line per take, for the summary
    tried: set[str] = field(default_factory=set)    # warm spares keep() has been through
    lock: threading.Lock = field(default_factory=threading.Lock)   # keep()'s thread and a move

    # -- starting them

    def tick(self, run: Run) -> None:
        """The supervisor's tick: the warm spares get their standbys on a thread of their own,
        at the run's start and once a move's tasks have stepped again (a standby's import then
        takes no CPU from a restart)."""
        if not run.plan.warm_spares or any(m.resumed is None and m.done_at is not None for m in run.recovery.moves):
            return
        todo = [s for s in run.plan.warm_spares if s not in self.tried and not run.plan.tasks_on(s)]
        if todo and self.lock.acquire(blocking=False):
            self.tried.update(todo)

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

    def before_break(self, run: Run, after: Plan) -> None:
        """Make before break: a standby for every script of `after` (the plan a move is about to
        adopt) that none waits for yet, on its host, now."""
        if after.mode not in TF_MODES or not after.warm_spares:
            return          # a cold spare's own start is the restart's path: docs/design/host-loss.md
        with self.lock:             # a warm spare's standbys being made: counted, not made twice
            self._before_break(run, after)

    def _before_break(self, run: Run, after: Plan) -> None:
        lost = run.session.pool.unusable() - set(after.spares)
        for host in after.hosts:
            if host in lost:
                continue
            tasks = [t for t in after.tasks_on(host) if t.runs_script]
            waiting = [s for s in self.held.get(host, []) if s.alive()]
            try:
                self._prepare_host(run, host, after, tasks[len(waiting):])
            except Exception as exc:  # noqa: BLE001 - the restart starts that host's scripts cold
                run.ui.warn(f"{host}: no standby for the restart ({_said(exc)})")

    def _prepare_host(self, run: Run, host: str, plan: Plan, tasks: list[TaskPlan]) -> None:
        if not tasks:
            return
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
        for t in tasks:
            self.made += 1
            launch = self._launch(run, plan, t, self.made)
            self.held.setdefault(host, []).append(Standby(agent, launch, run.options.heartbeat, run.options.grace))

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
        return [p for p in procs if id(p) not in taken]

    def _trim(self, run: Run) -> None:
        """After a restart, only the free warm spares keep standbys: one made before a break
        that nothing took (its task went elsewhere, or started cold) costs memory for nothing."""
        for host in list(self.held):
            if host in run.plan.warm_spares and not run.plan.tasks_on(host):
                continue
            for s in self.held.pop(host):
                s.drop()

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
        """Those never taken: each shim reads EOF and stops its standby."""
        for waiting in self.held.values():
            for s in waiting:
                s.drop()
        self.held.clear()


def _said(exc: BaseException) -> str:
    return getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
