"""A host that warns before it goes: its notices, and the drain each one becomes.

Each host whose spec entry says `preemptible` gets one `notice` stream for the run
(host/shim_notice.py), opened in a thread of its own as the run starts (Azure's first answer
can take two minutes), which says what it watches and then every notice: the cloud's
(AWS, GCE, Azure), a SIGTERM to the stream from outside (a shutdown), or a person's `tfcluster
drain SPEC HOST --deadline 30s` (drains.py hands it here). The supervisor's tick (poll) turns
each notice with deadline D into what the time allows, through the same path as `drain`
(recovery.give_up):

- D is further than START_LEAD away: wait until then (a cloud may withdraw its event; Azure
  does, and a withdrawn one is a false alarm that moved nothing);
- at least MOVE_BUDGET left: drain the host now (after up to GATHER seconds for the other
  watched hosts' notices: hosts warned together move in one restart), its tasks to a spare
  (or, with no spare, what `train.on_host_loss` says: go on without them, or end the run
  before the kill, every script saving as it stops);
- less: save only (the checkpoint request, SIGUSR1, to the chief's script, and the save it
  makes copied here while the time allows; else its newest save there) and leave the tasks
  where they are: the host's loss at D is then a plain lost host, moved from that copy.

Every notice is a record (Notice): when, from where, its deadline, what was done, the move it
led to and so the steps lost; the summary says one `notice:` line per record, `manifest.json`
keeps them under `notices`, and `runs` lists them. An Azure event is approved (its
StartRequests) once its host holds nothing of the run, so the cloud need not wait out its
NotBefore.
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tfcluster.errors import ConnectError, TfclusterError
from tfcluster.host import shim_protocol as proto
from tfcluster.launch.agent.lines import Lines
from tfcluster.launch.cluster import state
from tfcluster.launch.run.moves import Move
from tfcluster.localfs import NOFOLLOW, write_private
from tfcluster.plan import policy

if TYPE_CHECKING:
    from tfcluster.launch.run.runstate import Run

# A drain needs, before the deadline: the scripts' stop with their last save (a few seconds;
# KILL after train.stop_grace), the chief's newest checkpoint copied back (a 2 s sync's copy is
# small), the servers' stop (2 s); the new tasks then start on the spare whether or not the
# host is still there. That is at most about 10 s; twice that is kept, for a loaded host. On
# the 2-core test machine, loaded, a notice 30 s ahead had the chief stepping again 22.8 s
# after it, restart on the spare included (docs/hostloss.md, "When a host warns").
MOVE_BUDGET = 20.0
# A notice further ahead than this waits until this long before its deadline: moving at once
# would gain nothing, and a withdrawn event then costs nothing.
START_LEAD = 60.0
# A cloud that takes back several VMs at once warns each within seconds of the others, and the
# watchers see them up to a look apart (AWS's every 2 s, shim_notice.AWS_EVERY): a notice waits
# this long for the other watched hosts' (never past its last moment to move, nor when no other
# watched host is left to warn), so hosts warned together move in one restart, not two in a row.
GATHER = 5.0
WARNED = "warned"               # recovery.give_up's kind: the Move's `why` starts with it
# Too little time to move: the chief's script gets the checkpoint request (SIGUSR1), and the
# save it makes after the step under way is looked for every PULL_EVERY seconds, for at most
# SAVE_WAIT, and never later than SAVE_MARGIN before the deadline (the copy needs the host).
# A template's save of a small model is there within a look or two; what a bigger one cannot
# make in time, the newest save already there stands in for.
SAVE_WAIT, SAVE_MARGIN, PULL_EVERY = 15.0, 3.0, 1.0

PENDING, WAITING, MOVED, SHRUNK, SAVED, ENDED, WITHDRAWN, NOTHING, NOTED, FAILED = (
    "pending", "waiting", "moved", "went on without its tasks", "saved only", "ended the run",
    "withdrawn", "nothing to move", "noted", "failed")


STATE_FILE = "notices.json"    # what the running train's streams found, for `status`


def published(plan) -> dict[str, dict]:
    """host -> {stream, notice} as the running (or last) train wrote them."""
    try:
        fd = os.open(os.path.join(state.state_dir(state.key(plan)), STATE_FILE), os.O_RDONLY | NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return {}
    return {h: v for h, v in doc.items() if isinstance(v, dict)} if isinstance(doc, dict) else {}


def clock(t: float | None) -> str:
    return "--:--:--" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


@dataclass
class Notice:
    host: str
    source: str                 # aws | gce | azure | shutdown | drain
    kind: str                   # terminate, preempted, Preempt, SIGTERM, --deadline, rebalance ...
    id: str
    at: float                   # time.time() it reached the run
    deadline: float | None      # time.time() the host goes; None: a hint without one
    action: str = PENDING
    line: str = ""              # what the run said it did
    move: Move | None = None
    acked: bool = False

    def what(self) -> str:
        return f"{self.source} {self.kind}"

    @property
    def steps_lost(self) -> int | None:
        return None if self.move is None else self.move.steps_lost

    def summary(self) -> str:
        ahead = "" if self.deadline is None else f", deadline {clock(self.deadline)} ({self.deadline - self.at:.0f}s ahead)"
        lost = "" if self.steps_lost is None else f"; {self.steps_lost} step(s) lost"
        return f"{clock(self.at)} {self.host} {self.what()}{ahead}: {self.action}" + \
            (f": {self.line}" if self.line else "") + lost

    def record(self) -> dict:
        return {"host": self.host, "source": self.source, "kind": self.kind, "id": self.id, "at": self.at,
                "deadline": self.deadline, "action": self.action, "line": self.line,
                "move": None if self.move is None else {"to": self.move.spare, "action": self.move.action},
                "steps_lost": self.steps_lost}


@dataclass
class Notices:
    """The run's notice streams, their lines as they come, and the record of every notice."""

    records: list[Notice] = field(default_factory=list)
    how: dict[str, str | None] = field(default_factory=dict)   # host -> what its stream watches
    lines: queue.Queue = field(default_factory=queue.Queue)
    procs: dict = field(default_factory=dict)
    closed: threading.Event = field(default_factory=threading.Event)
    found: dict[str, str] = field(default_factory=dict)       # host -> what its stream said it watches

    def publish(self, run: Run) -> None:
        """What each stream watches and each host's latest notice, for `status` to show
        (the cluster's private state directory, beside drain's answers)."""
        doc = {h: {"stream": said} for h, said in self.found.items()}
        for n in self.records:
            doc.setdefault(n.host, {})["notice"] = n.summary()
        try:
            write_private(os.path.join(state.state_dir(state.key(run.plan)), STATE_FILE),
                          json.dumps(doc, indent=2, sort_keys=True).encode())
        except OSError:
            pass            # status then shows the spec's side only

    # -- the streams

    def start(self, run: Run) -> None:
        """One stream per watched host, each opened in a thread: the run's start waits for none."""
        for host in run.plan.all_hosts:
            if host.preemptible != "no" and host.name in run.session.agents:
                request = {"watch": host.preemptible, "url": host.metadata_url}
                threading.Thread(target=self._watch, args=(run, host.name, request), daemon=True,
                                 name=f"notice-{host.name}").start()

    def _watch(self, run: Run, host: str, request: dict) -> None:
        try:
            proc = run.session.agents[host].spawn_shim(proto.NOTICE)
            self.procs[host] = proc
            proc.write(proto.json_line(request))
            lines = Lines(proc, f"host {host}: notice")
            while not self.closed.is_set():
                line = lines.next()
                if line is None:
                    return
                self.lines.put((host, line))
                run.events.put(None)            # wake the supervisor: a notice is acted on at once
        except Exception as e:  # noqa: BLE001 - a watch that fails is said; the run goes on
            if not self.closed.is_set():
                self.lines.put((host, {"warning": f"cannot watch its notices: {e}"}))

    def ack(self, run: Run, notice: Notice) -> None:
        """Approve an Azure event once its host holds nothing of the run."""
        proc = self.procs.get(notice.host)
        if notice.source != "azure" or notice.acked or proc is None:
            return
        try:
            proc.write(proto.json_line({"ack": notice.id}))
            notice.acked = True
        except OSError:
            pass

    def close(self) -> None:
        self.closed.set()
        for proc in list(self.procs.values()):
            proc.kill()

    # -- the supervisor's side

    def add(self, run: Run, host: str, said: dict) -> Notice:
        """A notice reached the run: recorded, said, and acted on when due."""
        deadline = said.get("deadline")
        deadline = float(deadline) if isinstance(deadline, (int, float)) and not isinstance(deadline, bool) else None
        if said.get("source") == "azure" and deadline is None:
            deadline = time.time()          # started already (no NotBefore): it goes now
        notice = Notice(host, str(said.get("source")), str(said.get("kind")), str(said.get("id") or ""),
                        time.time(), deadline)
        self.records.append(notice)
        self.publish(run)
        if deadline is None:
            notice.action = NOTED
            run.ui.warn(f"{host}: {notice.what()} notice, no deadline: nothing moves until one comes")
            return notice
        run.session.pool.warn(host, deadline)
        left = deadline - notice.at
        if left > START_LEAD:
            notice.action = WAITING
            run.ui.warn(f"{host}: {notice.what()} notice: taken back at {clock(deadline)} ({left:.0f}s from now); "
                        f"its tasks move at {clock(deadline - START_LEAD)}, {START_LEAD:g}s before")
        else:
            run.ui.warn(f"{host}: {notice.what()} notice: taken back at {clock(deadline)} ({left:.0f}s from now)")
        return notice

    def link(self, moves: list[Move]) -> None:
        """A notice that saved only is followed by its host's loss: the move that loss made
        is the notice's (its steps lost)."""
        for notice in self.records:
            if notice.action == SAVED and notice.move is None:
                notice.move = next((m for m in moves if m.host == notice.host and m.at >= notice.at), None)

    def poll(self, run: Run) -> None:
        """The supervisor's tick: the lines that came, then every notice that is due."""
        self.link(run.recovery.moves)
        while True:
            try:
                host, line = self.lines.get_nowait()
            except queue.Empty:
                break
            self._line(run, host, line)
        due = self.due(run)
        if not self._gathered(run, due):
            return
        short = _too_few_spares(run, due)
        if short:
            end_before(run, self, due, short)
        for notice in due:
            if notice.action in (PENDING, WAITING):     # a move before may have taken it along
                act(run, self, notice)

    def _gathered(self, run: Run, due: list[Notice]) -> bool:
        """Act on the notices due now (GATHER): one of them waited long enough, or cannot wait
        longer, or no other watched host holding tasks of the run is left to warn."""
        if not due:
            return False
        warned = {n.host for n in self.records if n.action not in (WITHDRAWN, NOTED)}
        others = [h for h in self.procs if h not in warned and h not in run.session.pool.given_up
                  and run.plan.tasks_on(h)]
        now = time.time()
        return not others or any(now >= min(n.at + GATHER, n.deadline - MOVE_BUDGET) for n in due)

    def due(self, run: Run) -> list[Notice]:
        """The notices to act on now, earliest deadline first; of hosts warned together, the
        one whose tasks the run cannot do without (a ps, the chief) first, so it gets a spare."""
        now = time.time()
        due = [n for n in self.records if n.action in (PENDING, WAITING) and now >= n.deadline - START_LEAD]
        return sorted(due, key=lambda n: (round(n.deadline), not _needs_spare(run, n.host), n.at))

    def ride_along(self, run: Run, move: Move) -> list[Move]:
        """Once every task is stopped for `move`'s restart, and before they start again: each
        other host whose notice is due now moves in this same restart, to a spare of its own
        (recovery._restart_all). Two hosts warned at once, or a notice that came while every
        task stopped, then cost one restart, not two in a row, the second of which would start
        with its deadline 15 s or more nearer, too near to move. A host no spare can take is
        left to its own turn (act: on_host_loss decides)."""
        from tfcluster.launch.run import recovery

        while True:                     # the lines that came during the stop
            try:
                host, line = self.lines.get_nowait()
            except queue.Empty:
                break
            self._line(run, host, line)
        pool, riders = run.session.pool, []
        for notice in self.due(run):
            host = notice.host
            tasks = tuple(t.key for t in run.plan.tasks_on(host))
            if host == move.host or host in pool.given_up or not tasks:
                continue
            spare = recovery.reachable_spare(run, host, {move.spare, *(r.spare for r in riders)})
            action, reason = policy.on_host_loss(run.plan.mode, run.plan.on_host_loss,
                                                 recovery.lost_tasks(run, host), spare is not None)
            if action != policy.RESTART:
                continue
            pool.give_up(host)
            detail = f"{notice.what()} notice, deadline {clock(notice.deadline)}"
            rider = Move(host, f"{WARNED}: {detail}", action, reason, tasks, time.time(),
                         recovery.step_now(run), spare)
            run.recovery.moves.append(rider)
            riders.append(rider)
            notice.move, notice.action = rider, MOVED
            notice.line = f"{', '.join(tasks)} moved to {spare}, every task restarted, with {move.host}'s move"
            run.ui.warn(f"{host} {WARNED}: {detail}: moving {', '.join(tasks)} to {spare} in the same restart as "
                        f"{move.host}'s ({reason})")
        return riders

    def settle(self, run: Run, riders: list[Move]) -> None:
        """After a restart that took notices along: each is answered (drain) and acknowledged."""
        from tfcluster.launch.run import drains

        for notice in self.records:
            if notice.move is not None and notice.move in riders:
                _said(run, self, notice, drains.MOVED)

    def _line(self, run: Run, host: str, line: dict) -> None:
        if "watching" in line:
            self.how[host] = line.get("how") if line["watching"] else None
            said = f"watched ({line.get('how')})" if line["watching"] else f"not watched: {line.get('why')}"
            run.ui.info(f"{host}: {said}")
            self.found[host] = said
            self.publish(run)
        elif isinstance(line.get("notice"), dict):
            said = line["notice"]
            if any(n.host == host and n.id == str(said.get("id") or "") and n.source == said.get("source")
                   for n in self.records):
                return          # said again (a stream that restarted its look)
            self.add(run, host, said)
        elif isinstance(line.get("withdrawn"), dict):
            self._withdrawn(run, host, str(line["withdrawn"].get("id")))
        elif "warning" in line or "error" in line:
            run.ui.warn(f"{host}: notices: {line.get('warning') or line.get('error')}")

    def _withdrawn(self, run: Run, host: str, event: str) -> None:
        notice = next((n for n in self.records if n.host == host and n.id == event), None)
        if notice is None:
            return
        if notice.action in (PENDING, WAITING):
            notice.action = WITHDRAWN
            notice.line = "false alarm withdrawn before the move began"
            run.session.pool.unwarn(host)
            run.ui.warn(f"{host}: {notice.what()} {event}: false alarm withdrawn; nothing moved")
        else:
            run.ui.warn(f"{host}: {notice.what()} {event} withdrawn after the run acted on it ({notice.action}); "
                        f"that stands")


def act(run: Run, notices: Notices, notice: Notice) -> None:
    """Do what the time left allows (the module's docstring); raises when the run must end
    before the host goes (no spare, and on_host_loss says fail)."""
    from tfcluster.launch.run import drains, recovery

    host, pool = notice.host, run.session.pool
    tasks = [t.key for t in run.plan.tasks_on(host)]
    if host in pool.given_up or not tasks:
        notice.action = NOTHING
        if host in run.plan.spares:
            pool.set_aside(host, f"taken back by its cloud at {clock(notice.deadline)}")
            notice.line = "a spare taken back takes no task"
        _said(run, notices, notice, drains.MOVED)
        return
    left = notice.deadline - time.time()
    if left < MOVE_BUDGET:
        notice.action = SAVED
        notice.line = (f"{left:.0f}s left, under the {MOVE_BUDGET:g}s a move takes: {_save_now(run, notice.deadline)}; "
                       f"{', '.join(tasks)} move when {host} goes")
        run.ui.warn(f"{host}: {notice.line}")
        _said(run, notices, notice, drains.SAVED)
        return
    error = ConnectError(f"{host} is taken back at {clock(notice.deadline)} ({notice.what()} notice) and no spare "
                         f"can take {', '.join(tasks)}: the run ends before it, every script saving as it stops",
                         hint="add a host with spare: true to the spec, or set train.on_host_loss: shrink")
    detail = f"{notice.what()} notice, deadline {clock(notice.deadline)}"
    try:
        move = recovery.give_up(run, host, WARNED, error, detail=detail)
    except TfclusterError as exc:
        if exc is error:
            notice.action = ENDED
            saved = _save(run)
            notice.line = f"no spare; {'copied ' + saved if saved else 'no checkpoint copied'}"
        else:
            notice.action, notice.line = FAILED, exc.message
        _said(run, notices, notice, drains.FAILED)
        raise
    notice.move = move
    if move is not None:
        notice.action = SHRUNK if move.spare is None else MOVED
        notice.line = (f"{', '.join(move.tasks)} moved to {move.spare}"
                       + (", every task restarted" if move.action == "restart" else "")
                       if move.spare else f"went on without {', '.join(tasks)}")
    _said(run, notices, notice, drains.MOVED)


def _save_now(run: Run, deadline: float) -> str:
    """The checkpoint request (SIGUSR1, the script contract's) to the chief's script, and the
    save it makes copied here while the time allows (SAVE_WAIT, never past SAVE_MARGIN before
    `deadline`: the copy needs the host); else the newest save there already. Says which."""
    chief = run.plan.chief
    before = _save(run)
    newest = f"copied {before} here" if before else "no checkpoint copied"
    script = next((p for p in run.procs if p.role == "script" and chief is not None and p.task.key == chief.key
                   and p.handle is not None and p.ended is None), None)
    if script is None or not script.handle.request_save():
        return newest
    if run.recovery.checkpoints is None:
        return f"checkpoint request to {chief.key} (no train.checkpoint: nothing is copied here)"
    asked = time.time()
    until = min(asked + SAVE_WAIT, deadline - SAVE_MARGIN)
    while time.time() < until:
        time.sleep(PULL_EVERY)
        saved = _save(run, again=False)
        if saved is not None and saved != before:
            return f"checkpoint request to {chief.key}: copied {saved} here, saved since"
    return f"checkpoint request to {chief.key}: no newer save in {time.time() - asked:.0f}s; {newest}"


def _save(run: Run, again: bool = True) -> str | None:
    """The chief's newest complete checkpoint copied here now (train.checkpoint's sync), while
    its host still answers: the save a script makes on its own schedule, kept before the kill."""
    sync, chief = run.recovery.checkpoints, run.plan.chief
    if sync is None or chief is None or chief.host in run.session.pool.lost:
        return None
    pulled = sync.pull(chief.host, again=again)
    return pulled.name if pulled is not None else None


def _needs_spare(run: Run, host: str) -> bool:
    """Without a spare for `host`'s tasks the run would end (on_host_loss says fail)."""
    from tfcluster.launch.run import recovery

    tasks = recovery.lost_tasks(run, host)
    return bool(tasks) and policy.on_host_loss(run.plan.mode, run.plan.on_host_loss, tasks, False)[0] == policy.FAIL


def _too_few_spares(run: Run, due: list[Notice]) -> list[Notice]:
    """Of hosts warned together, the ones whose tasks need a spare and would find none once
    the others took theirs (a spare is counted free when nothing rules it out and it holds
    no task): empty when every one can be moved."""
    pool = run.session.pool
    free = [s for s in run.plan.spares if s not in pool.unusable() and not run.plan.tasks_on(s)]
    needing = [n for n in due if n.host not in pool.given_up and _needs_spare(run, n.host)]
    hosts = list(dict.fromkeys(n.host for n in needing))
    short = set(hosts[len(free):])
    return [n for n in needing if n.host in short] if len(hosts) > 1 else []


def end_before(run: Run, notices: Notices, due: list[Notice], short: list[Notice]) -> None:
    """More hosts warned together than spares can take: the run ends now, before the first
    deadline, every script saving as it stops, rather than moving some hosts' tasks in vain
    (the spare-less host's loss would end it a restart later, with less time to save)."""
    hosts = list(dict.fromkeys(n.host for n in due))
    left = list(dict.fromkeys(t.key for n in short for t in run.plan.tasks_on(n.host)))
    spares = len([s for s in run.plan.spares if s not in run.session.pool.unusable()
                  and not run.plan.tasks_on(s)])
    first = min(n.deadline for n in due)
    error = ConnectError(f"{' and '.join(hosts)} are taken back by {clock(first)} ({len(due)} notices at once) "
                         f"and {spares} spare(s) cannot take {', '.join(left)} as well: the run ends before it, "
                         f"every script saving as it stops",
                         hint="add spare hosts to the spec (one per host that may be taken back at once), "
                              "or set train.on_host_loss: shrink")
    from tfcluster.launch.run import drains

    saved = _save(run)
    for notice in due:
        notice.action = ENDED
        notice.line = (f"{len(due)} hosts warned at once, too few spares; "
                       + ("copied " + saved if saved else "no checkpoint copied"))
        _said(run, notices, notice, drains.FAILED)
    raise error


def _said(run: Run, notices: Notices, notice: Notice, state: str) -> None:
    """Acknowledge the cloud's event when the host holds nothing of the run; answer `drain`."""
    from tfcluster.launch.run import drains

    if not run.plan.tasks_on(notice.host):
        notices.ack(run, notice)
    if notice.source == drains.SOURCE:
        drains.answer(run.plan, notice.host, state, notice.summary())
