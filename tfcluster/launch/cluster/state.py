"""Local state: what `up` started where, plus a per-cluster lock.

State lives in `$XDG_STATE_HOME/tfcluster/<key>/` (default
`~/.local/state/tfcluster`), written atomically and readable only by the owner.
It is a convenience: `down` works without it by asking the hosts' pid files.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import dataclass

from tfcluster.errors import LockedError, PreflightError
from tfcluster.localfs import NOFOLLOW, private_dir, write_private  # noqa: F401 - also imported from here


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


def load(name: str) -> dict | None:
    try:
        fd = os.open(state_file(name), os.O_RDONLY | NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def started_on(state: dict | None) -> dict[str, list[str]]:
    """Host -> the tags of the servers `up` started there, as the state recorded them
    (`hosts`, kept from one `up` to the next until `down` clears the state; an older state
    has only `tasks`). Anything malformed is skipped: the state is a convenience."""
    state = state if isinstance(state, dict) else {}
    hosts = state.get("hosts")
    if not isinstance(hosts, dict):
        tasks = state.get("tasks") if isinstance(state.get("tasks"), dict) else {}
        hosts = {}
        for task in tasks.values():
            if isinstance(task, dict) and isinstance(task.get("host"), str):
                hosts.setdefault(task["host"], []).append(task.get("tag"))
    return {h: [t for t in tags if isinstance(t, str)] for h, tags in hosts.items()
            if isinstance(h, str) and isinstance(tags, list)}


def save(name: str, state: dict) -> None:
    write_private(state_file(name),
                  json.dumps(state, indent=2, sort_keys=True).encode())


def clear(name: str) -> None:
    try:
        os.unlink(state_file(name))
    except FileNotFoundError:
        pass


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
            raise LockedError(
                f"cluster {self.label or repr(self.name)} is busy: {holder}",
                hint="wait for it to finish, or stop it with Ctrl-C / `tfcluster down`",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} running `tfcluster {self.command}`".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing releases the flock
            self._fd = None
