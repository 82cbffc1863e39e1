"""Local state: what `up` started where, plus a per-cluster lock.

State lives in `$XDG_STATE_HOME/tfcluster/<key>/` (default
`~/.local/state/tfcluster`), written atomically and readable only by the owner.
It is a convenience: `down` works without it by asking the hosts' pid files. One part
of it is more: where `up` started a down host's tasks instead (a spare), which every
command plans with until `down` (placed_by_up), and, while a `train` runs, where it moved
tasks since it started (moves.json, placed_by_train), which `status` and `drain` plan with.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tfcluster.errors import LockedError, PreflightError
from tfcluster.localfs import NOFOLLOW, private_dir, write_private  # noqa: F401 - also imported from here
from tfcluster.host.shim_procs import is_alive

if TYPE_CHECKING:
    from tfcluster.plan import Plan


def key(plan) -> str:
    """`<name>@<8 hex>`: the cluster's name and its directory on the hosts as the spec writes
    it (workdir/name). Two specs named alike with other workdirs are other clusters (their
    tags differ, docs/ARCHITECTURE.md "Naming"): neither takes the other's lock or state."""
    return "%s@%s" % (plan.name, hashlib.sha256(plan.cluster_dir.encode()).hexdigest()[:8])


def lock(plan, command: str) -> "ClusterLock":
    """The cluster's lock for `tfcluster <command>`; busy, it names the cluster and its workdir."""
    workdir = plan.cluster_dir.rpartition("/")[0] or "/"
    return ClusterLock(key(plan), command, f"{plan.name!r} (workdir {workdir})")


def state_dir(name: str) -> str:
    """The cluster's state directory: every level created 0700, and refused (exit 4) when
    someone else could change it or a level above it (docs/ARCHITECTURE.md, "Files and
    directories on a host")."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    path = os.path.join(base, "tfcluster", name)
    private_dir(path, "local state")
    return path


def state_file(name: str) -> str:
    return os.path.join(state_dir(name), "state.json")


@dataclass
class UpState:
    """What `up` left, until `down` clears it (state.json). Every field is optional on
    reading: an older state has no `hosts` (they come from its `tasks`) and no `moves`;
    anything malformed is skipped, as the state is a convenience."""

    name: str = ""
    spec_sha256: str = ""
    run_id: str = ""                     # the latest `up` that started servers
    # task key -> {host, port, pid, tag, log, started}: the servers of the latest `up`,
    # and the ones it found running
    tasks: dict[str, dict] = field(default_factory=dict)
    # host -> the tags of the servers every `up` started there, until `down`
    hosts: dict[str, list[str]] = field(default_factory=dict)
    # (host down, spare): where `up` started a down host's tasks instead (deadhosts.py), in
    # order; the servers run there, so every command plans with them until `down`
    moves: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_doc(cls, doc) -> "UpState":
        doc = doc if isinstance(doc, dict) else {}
        tasks = doc.get("tasks") if isinstance(doc.get("tasks"), dict) else {}
        tasks = {k: t for k, t in tasks.items() if isinstance(k, str) and isinstance(t, dict)}
        hosts = doc.get("hosts")
        if not isinstance(hosts, dict):
            hosts = {}
            for task in tasks.values():
                if isinstance(task.get("host"), str):
                    hosts.setdefault(task["host"], []).append(task.get("tag"))
        moves = doc.get("moves") if isinstance(doc.get("moves"), list) else []
        return cls(
            name=_text(doc.get("name")), spec_sha256=_text(doc.get("spec_sha256")),
            run_id=_text(doc.get("run_id")), tasks=tasks,
            hosts={h: [t for t in tags if isinstance(t, str)] for h, tags in hosts.items()
                   if isinstance(h, str) and isinstance(tags, list)},
            moves=tuple((m["lost"], m["to"]) for m in moves
                        if isinstance(m, dict) and isinstance(m.get("lost"), str) and isinstance(m.get("to"), str)))

    def to_doc(self) -> dict:
        return {"name": self.name, "spec_sha256": self.spec_sha256, "run_id": self.run_id,
                "tasks": self.tasks, "hosts": self.hosts,
                "moves": [{"lost": lost, "to": spare} for lost, spare in self.moves]}


def _text(value) -> str:
    return value if isinstance(value, str) else ""


def load(name: str) -> UpState | None:
    """The state `up` left for cluster `name` (key()); None when there is none (or it cannot
    be read)."""
    try:
        fd = os.open(state_file(name), os.O_RDONLY | NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            return UpState.from_doc(json.loads(f.read()))
    except (OSError, ValueError):
        return None


def started_on(state: UpState | None) -> dict[str, list[str]]:
    """Host -> the tags of the servers `up` started there (none without a state)."""
    return state.hosts if state is not None else {}


def save(name: str, state: UpState) -> None:
    write_private(state_file(name),
                  json.dumps(state.to_doc(), indent=2, sort_keys=True).encode())


def placed_by_up(plan: Plan, ui, saved: UpState | None = None) -> Plan:
    """`plan` with the moves `up` saved applied (`saved`, else the cluster's state): a host
    that was down at `up` had its tasks' servers started on a spare, and they run there until
    `down`, whether the host is back or not, so `status`, `train`, `down` and another `up`
    look for them there. Each move applied is said once; a move the spec no longer allows
    (its host or spare gone, or no spare any more) is ignored with a warning."""
    saved = saved if saved is not None else load(key(plan))
    if saved is None or not saved.moves:
        return plan
    for lost, spare in saved.moves:
        why = _move_problem(plan, lost, spare)
        if why is None:
            try:
                moved = plan.moved(lost, spare)
            except ValueError as e:
                why = str(e)
        if why is not None:
            ui.warn(f"`tfcluster up` started {lost}'s tasks on spare {spare} (local state), but {why}: "
                    f"that move is ignored and the spec's placement used; `tfcluster down` with the spec "
                    f"`up` used stops what runs on {spare}")
            continue
        keys = [t.key for t in plan.tasks_on(lost)]
        ui.info(f"{', '.join(keys)} {'runs' if len(keys) == 1 else 'run'} on spare {spare} "
                f"(moved there by `up`: {lost} was down)")
        plan = moved
    return plan


def _move_problem(plan: Plan, lost: str, spare: str) -> str | None:
    """Why the spec no longer allows `up`'s move of `lost`'s tasks to `spare` (None: it does)."""
    listed = {h.name for h in plan.all_hosts}
    if lost not in listed:
        return f"the spec no longer lists {lost}"
    if spare not in listed:
        return f"the spec no longer lists {spare}"
    if spare not in plan.spares:
        return f"{spare} is no longer a spare in the spec"
    if not plan.tasks_on(lost):
        return f"the spec gives {lost} no task any more"
    problem = plan.spare_problem(spare, lost)
    return f"{spare} cannot take them ({problem})" if problem else None


MOVES = "moves.json"     # the running train's moves: its pid and (lost, spare) in order


def publish_moves(plan: Plan) -> None:
    """The train's side, after each move (and at its start, for a host down then): every move
    of its plan, with this process's pid, for the commands that look while it runs."""
    doc = {"pid": os.getpid(), "moves": [[lost, spare] for lost, spare in plan.moves]}
    write_private(os.path.join(state_dir(key(plan)), MOVES), json.dumps(doc).encode())


def train_moves(plan: Plan) -> list[tuple[str, str]] | None:
    """The moves of the `train` of this cluster running now, as it published them; None when
    no train runs (the lock file names no live `train`) or the file is not that train's."""
    directory = state_dir(key(plan))
    try:
        with os.fdopen(os.open(os.path.join(directory, "lock"), os.O_RDONLY | NOFOLLOW), "rb") as f:
            pid, command = holder_of(f.read(200).decode(errors="replace"))
        with os.fdopen(os.open(os.path.join(directory, MOVES), os.O_RDONLY | NOFOLLOW), "rb") as f:
            doc = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    if command != "train" or pid is None or doc.get("pid") != pid or not is_alive(pid):
        return None      # the lock names no train (it ended: its file is emptied), or another one
    moves = doc.get("moves")
    if not isinstance(moves, list):
        return None
    return [(m[0], m[1]) for m in moves if isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m)]


def placed_by_train(plan: Plan, ui, say: bool = True) -> Plan | None:
    """`plan` (the spec's) with the running train's moves applied, each said once (`say`); None
    when no train of the cluster runs, or it has moved nothing (placed_by_up then says where
    things are)."""
    moves = train_moves(plan)
    if not moves:
        return None
    for lost, spare in moves:
        try:
            moved = plan.moved(lost, spare)
        except ValueError:
            continue            # the spec changed under the running train: its placement stands
        keys = [t.key for t in plan.tasks_on(lost)]
        if say:
            ui.info(f"{', '.join(keys)} {'runs' if len(keys) == 1 else 'run'} on spare {spare} "
                    f"(moved there by the running train: {lost} was lost or drained)")
        plan = moved
    return plan


def clear(name: str) -> None:
    try:
        os.unlink(state_file(name))
    except FileNotFoundError:
        pass


HOLDER = "pid {pid} running `tfcluster {command}`"       # what the lock file says of its holder
_HOLDER = re.compile(r"pid (\d+) running `tfcluster ([^`]*)`")


def holder_of(text: str) -> tuple[int | None, str | None]:
    """(pid, command) from a lock file's HOLDER line; (None, None) for anything else (the
    holder has not written it yet, or wrote it before the line had this form)."""
    found = _HOLDER.fullmatch(text.strip())
    return (int(found.group(1)), found.group(2)) if found else (None, None)


@dataclass
class ClusterLock:
    """An exclusive, non-blocking lock per cluster (`name`: key()), released when the process
    dies; `label` names the cluster in the busy error."""

    name: str
    command: str = ""
    label: str = ""
    _fd: int | None = None

    def __enter__(self) -> "ClusterLock":
        path = os.path.join(state_dir(self.name), "lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)
        except OSError as e:
            raise PreflightError(f"local state: cannot open {path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another tfcluster"
            os.close(fd)
            pid, command = holder_of(holder)
            raise LockedError(
                f"cluster {self.label or repr(self.name)} is busy: {holder}",
                # not `tfcluster down`: it takes this lock too, and would be refused the same way
                hint="wait for it to finish, or stop it: Ctrl-C in its terminal"
                     + (f", or `kill {pid}` (SIGTERM: it stops everything it started, as on Ctrl-C)" if pid else ""),
                holder_pid=pid, holder_command=command,
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, HOLDER.format(pid=os.getpid(), command=self.command).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing releases the flock
            self._fd = None
