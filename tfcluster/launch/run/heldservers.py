"""Held TF servers: each started with TensorFlow imported and its port not bound, waiting for
GO, so that a move's servers skip their interpreter's start as its scripts do (standbys.py).

- **Make before break**: the moment a move is decided, each server of the new plan starts held
  on its host (as `train`'s first servers start while the checks run), under its task's own
  tag, which the old attempt's stop leaves alone (a shim sweeps only what it started); once
  the old servers have stopped, each gets GO and binds.
- **Twins**: once the run has stepped, each host holds a twin of every server it runs, with
  the cluster as it is. A server's import does not depend on its cluster, so a move gives the
  twin the new cluster with its GO (`GO {TF_CONFIG}`, host/shim_protocol.py), and holds new
  servers only where tasks arrive.

A held server whose launch differs from its task's otherwise (another program, environment or
proxy exemption) is stopped and its task starts cold; the run says so.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tfcluster.host.shim_protocol import RESTART_VAR
from tfcluster.launch.cluster.servers import Started, watch_ready

if TYPE_CHECKING:
    from collections.abc import Callable

    from tfcluster.launch.agent.agent import HostAgent
    from tfcluster.launch.agent.attached import AttachedTask
    from tfcluster.launch.agent.records import TaskLaunch
    from tfcluster.launch.cluster.servers import Watch
    from tfcluster.launch.run.runstate import Run, Supervised
    from tfcluster.plan import Plan


@dataclass
class HeldServers:
    by_key: dict[str, tuple[str, TaskLaunch, AttachedTask]] = field(default_factory=dict)  # task key -> (host, ...)
    early: set[str] = field(default_factory=set)    # keys held before any move (twins: their cluster comes at GO)

    def hold(self, run: Run, host: str, plan: Plan, opened: Callable[[Run, str], HostAgent],
             early: bool = False) -> None:
        """The servers `plan` puts on `host`, started held, on the agent `opened` gives (its
        table in place). `early`: twins, held before any move is known."""
        from tfcluster.diagnose.proxy import no_proxy_for
        from tfcluster.launch.run import attempts

        session = run.session
        # one held for the task already on this host serves; one held elsewhere (its host
        # being lost, the task moves here) is stopped and replaced
        servers = [t for t in plan.tasks_on(host) if t.runs_server and self.by_key.get(t.key, (None,))[0] != host]
        if not servers:
            return
        for t in servers:
            if t.key in self.by_key:
                self._stop(t.key)
        agent = opened(run, host)
        no_proxy = no_proxy_for(plan)
        if early and no_proxy:          # any spare a move may bring in, too
            no_proxy = tuple(dict.fromkeys(no_proxy + tuple(plan.host(s).address for s in plan.spares)))
        for t in servers:
            proc = next((p for p in run.procs if p.role == "server" and p.task.key == t.key), None)
            if proc is None:
                continue
            launch = session.launch_for(t, run.run_id, "server", agent.server_argv(), {RESTART_VAR: str(proc.restarts)})
            # a pid file of its own while held: the server it replaces, alive until the break
            # (or for good, when its host comes back), keeps the task's
            launch = dataclasses.replace(launch, no_proxy=no_proxy,
                                         pidfile=launch.pidfile.removesuffix(".pid") + ".next.pid")
            task = agent.start_attached(launch, heartbeat_timeout=run.options.heartbeat, grace=run.options.grace,
                                        hold=True, restart=attempts.in_place(plan, proc),
                                        pidfile_on_go=session.paths.pidfile(launch.tag))
            self.by_key[t.key] = (host, launch, task)
            if early:
                self.early.add(t.key)
            else:
                self.early.discard(t.key)

    def started(self, plan: Plan) -> list[Started]:
        """The servers held now for `plan`, as started ones (their readiness can be asked
        before their GO)."""
        return [Started(plan.task(key), launch.tag, task.pid, launch.log)
                for key, (host, launch, task) in self.by_key.items()
                if plan.task(key).host == host and task.pid]

    def watch(self, run: Run, plan: Plan, settle: float) -> Watch | None:
        """Whether each server held for `plan` listens, asked now and answered as each binds
        on its GO (servers.watch_ready); None when none is held."""
        held = self.started(plan)
        return watch_ready(run.session, held, settle) if held else None

    def take(self, run: Run, procs: list[Supervised]) -> tuple[list[Supervised], str]:
        """GO to each server of `procs` held for it, on its host, its launch unchanged but for
        its cluster; returns the ones left to start cold, and a line for the run (empty when
        none was held). Held servers nothing took are stopped."""
        from tfcluster.launch.run import attempts
        from tfcluster.launch.run.runstate import StartSlot

        cold, warm, changed = [], [], []
        for p in procs:
            host, launch, task = self.by_key.pop(p.task.key, (None, None, None))
            early = p.task.key in self.early
            self.early.discard(p.task.key)
            if task is None:
                cold.append(p)
                continue
            now = attempts.launch_of(run.session, run.run_id, p)
            same = host == p.task.host and serves_as(launch, now)
            config = now.env.get("TF_CONFIG")
            if not same or not task.go(config if config != launch.env.get("TF_CONFIG") else None):
                task.stop(keep_fence=bool(run.plan.tasks_on(host)))    # tasks start there
                cold.append(p)
                if not same and not (early and host != p.task.host):   # not its task's host any more
                    changed.append(p.task.key)
                continue
            slot = StartSlot()
            run.starts.append(slot)
            p.handle = slot.handle = task
            attempts.attach(run, p)
            warm.append(p.task.key)
        self.drop()
        said = []
        if warm:
            said.append(f"held before the break: server(s) {', '.join(warm)} "
                        f"(TensorFlow imported while the old tasks stopped)")
        if changed:
            said.append(f"server(s) {', '.join(changed)} started cold (their launch changed since they were held)")
        return cold, "; ".join(said)

    def drop(self, keep: set[str] = frozenset()) -> None:
        """Stop the held servers but those of the task keys in `keep`."""
        for key in [k for k in self.by_key if k not in keep]:
            self._stop(key)

    def drop_made_for_moves(self) -> None:
        """Stop the servers held for a move that will not come; the twins stay."""
        self.drop(keep=self.early)

    def _stop(self, key: str) -> None:
        self.by_key.pop(key)[2].stop()
        self.early.discard(key)


def serves_as(held: TaskLaunch, now: TaskLaunch) -> bool:
    """Whether a server held with launch `held` can serve as `now`: the same program and
    environment but for its cluster (TF_CONFIG, given at GO) and its attempt's number, and
    every address `now` keeps off a proxy kept off by it too."""
    late = ("TF_CONFIG", RESTART_VAR)
    env = {k: v for k, v in held.env.items() if k not in late}
    return (held.argv == now.argv and env == {k: v for k, v in now.env.items() if k not in late}
            and set(now.no_proxy) <= set(held.no_proxy))
