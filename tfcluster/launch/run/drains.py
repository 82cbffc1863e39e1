"""`tfcluster drain SPEC HOST`: a host given up on purpose while `train` runs.

The two processes talk through the cluster's private state directory (cluster/state.py), which only
its owner can write: `drain` leaves one request file per host (`drain-<host>`, created
exclusively), the running `train` finds it on its next tick, moves the host's tasks off it
as it would a lost host's (recovery.py: at the next checkpoint, the scripts saving as they
stop), and writes how each drain went to `drains.json`, which `drain` waits on and `status`
shows. Nothing here trusts a file someone else could write: the directory is refused unless
private.
"""
from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

from tfcluster.errors import ExitCode, LockedError, TfclusterError
from tfcluster.launch.cluster import state
from tfcluster.localfs import NOFOLLOW, write_private

if TYPE_CHECKING:
    from tfcluster.launch.run.runstate import Run

REQUEST = "drain-"
ANSWERS = "drains.json"
POLL_EVERY = 1.0        # seconds between the supervisor's looks
ASKED, DRAINING, MOVED, FAILED = "asked", "draining", "moved", "failed"
SAVED = "saved"         # --deadline too short to move: the checkpoint copied, the tasks left
SOURCE = "drain"        # a notice's source when `drain --deadline` asked (run/notices.py)
ANSWER_POLL = 0.5       # seconds between `drain`'s looks at the answers
RUNNING_POLL = 2.0      # and at whether the train still runs (a look takes the lock a moment when free)


def request(plan, host: str, wait: float, ui, deadline: float | None = None) -> ExitCode:
    """`tfcluster drain`: ask the running train to move `host`'s tasks, then wait (at most
    `wait` s; 0: ask and return) for its answer, saying each new line of it. OK once moved
    (or, with a `deadline` in seconds too short to move, once saved), ERROR when the run
    could not move them, TIMEOUT when no answer came in time; no `train` of the cluster
    holding its lock raises (exit 1), asking nothing. A deadline makes the drain a notice
    of the run (run/notices.py): recorded, and moved or saved as its time allows."""
    if running(plan) != "train":
        raise TfclusterError(f"no `tfcluster train` of cluster {plan.name!r} is running: nothing to drain",
                             hint="drain moves a running train's tasks; to run without the host, "
                                  "edit the spec")
    by = None if deadline is None else time.time() + deadline
    ask(plan, host, by)
    ui.info(f"asked the running train to drain {host}"
            + ("" if by is None else f" by {time.strftime('%H:%M:%S', time.localtime(by))} ({deadline:g}s)"))
    deadline = time.monotonic() + wait
    said, look = None, time.monotonic() + RUNNING_POLL
    while time.monotonic() < deadline:
        answer = answers(plan).get(host, {})
        if answer.get("line") and answer.get("line") != said:
            said = answer["line"]
            ui.info(f"{host}: {answer.get('state')}: {said}")
        if answer.get("state") in (MOVED, SAVED):
            return ExitCode.OK
        if answer.get("state") == FAILED:
            return ExitCode.ERROR
        if time.monotonic() >= look:
            look = time.monotonic() + RUNNING_POLL
            if running(plan) != "train":     # it ended (done, Ctrl-C, failed) before the move
                if answers(plan).get(host, {}).get("state") in (MOVED, SAVED):
                    continue                 # its answer came as it ended: said above
                ui.warn(f"{host}: the train ended before it moved {host}'s tasks; nothing of it runs now")
                return ExitCode.ERROR
        time.sleep(ANSWER_POLL)
    if wait:
        ui.warn(f"{host}: not moved after {wait:g}s; the run goes on with the drain asked")
        return ExitCode.TIMEOUT
    return ExitCode.OK


def running(plan) -> str | None:
    """The command (`train`, `up`, ...) of the tfcluster holding the cluster's lock, None when
    none does (or its lock file does not say)."""
    try:
        with state.lock(plan, "drain"):
            return None
    except LockedError as exc:
        return exc.holder_command


def ask(plan, host: str, deadline: float | None = None) -> None:
    """Leave the request for `host` (drain's side), with the time.time() it goes by, if any."""
    path = os.path.join(state.state_dir(state.key(plan)), REQUEST + host)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600)
    except FileExistsError:
        return          # asked already, not yet taken
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"host": host, "asked": time.time(), "pid": os.getpid(), "deadline": deadline}))


def answers(plan) -> dict[str, dict]:
    """host -> {state, line, at} as the running (or last) train wrote it."""
    path = os.path.join(state.state_dir(state.key(plan)), ANSWERS)
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return {}
    return {h: a for h, a in doc.items() if isinstance(h, str) and isinstance(a, dict)} \
        if isinstance(doc, dict) else {}


def answer(plan, host: str, how: str, line: str) -> None:
    """Say how the drain of `host` goes, for `drain` to read (train's side)."""
    _answer(plan, host, how, line)


def _answer(plan, host: str, how: str, line: str) -> None:
    doc = answers(plan)
    doc[host] = {"state": how, "line": line, "at": time.time()}
    write_private(os.path.join(state.state_dir(state.key(plan)), ANSWERS),
                  json.dumps(doc, indent=2, sort_keys=True).encode())


def clear(plan) -> None:
    """A new train starts with no drain asked or answered, and no move (train's side, under its lock)."""
    directory = state.state_dir(state.key(plan))
    for name in os.listdir(directory):
        if name.startswith(REQUEST) or name in (ANSWERS, "notices.json", state.MOVES):   # notices.STATE_FILE
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def poll(run: Run) -> None:
    """The supervisor's tick: take the drains asked since the last look, one at a time."""
    now = time.monotonic()
    if now - run.recovery.looked < POLL_EVERY:
        return
    run.recovery.looked = now
    directory = state.state_dir(state.key(run.plan))
    asked = sorted(n[len(REQUEST):] for n in os.listdir(directory) if n.startswith(REQUEST))
    for host in asked:
        path = os.path.join(directory, REQUEST + host)
        deadline = _deadline_of(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        if deadline is not None and host in {h.name for h in run.plan.all_hosts}:
            _answer(run.plan, host, DRAINING, f"notice taken, deadline {time.strftime('%H:%M:%S', time.localtime(deadline))}")
            run.notices.add(run, host, {"source": SOURCE, "kind": "--deadline", "id": f"drain@{deadline:.0f}",
                                        "deadline": deadline})
            continue
        _drain(run, host)


def _deadline_of(path: str) -> float | None:
    """The deadline a request carries (`drain --deadline`), None without one."""
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return None
    deadline = doc.get("deadline") if isinstance(doc, dict) else None
    return float(deadline) if isinstance(deadline, (int, float)) and not isinstance(deadline, bool) else None


def _drain(run: Run, host: str) -> None:
    from tfcluster.launch.run import recovery

    if host in run.session.pool.given_up or not run.plan.tasks_on(host):
        _answer(run.plan, host, MOVED, f"{host} holds no task of this run")
        return
    run.ui.warn(f"{host}: drain asked; moving its tasks off it at the next checkpoint")
    _answer(run.plan, host, DRAINING, f"moving {', '.join(t.key for t in run.plan.tasks_on(host))}")
    plan = run.plan
    refused = TfclusterError(f"{host} cannot be drained: no spare host can take its tasks",
                             hint="add a host with `spare: true` to the spec, or stop the run")
    try:
        move = recovery.give_up(run, host, recovery.DRAINED, refused)
    except TfclusterError as exc:
        if exc is not refused:      # the move itself failed: the run cannot go on
            _answer(plan, host, FAILED, exc.message)
            raise
        run.session.pool.take_back(host)        # it still runs its tasks: the run goes on
        _answer(plan, host, FAILED, exc.message)
        run.ui.warn(f"{host}: not drained: {exc.message}")
        return
    _answer(run.plan, host, MOVED, move.line() if move is not None else f"{host} drained")
