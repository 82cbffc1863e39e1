"""Local state: what `up` started where, plus a per-cluster lock.

State lives in `$XDG_STATE_HOME/tfcluster/<name>/` (default
`~/.local/state/tfcluster`), written atomically and readable only by the owner.
It is a convenience: `down` works without it by asking the hosts' pid files.
"""
from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass

from tfcluster.errors import LockedError
from tfcluster.fsutil import write_private  # noqa: F401 - also imported from here


def state_dir(name: str) -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    path = os.path.join(base, "tfcluster", name)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def load(name: str) -> dict | None:
    try:
        with open(os.path.join(state_dir(name), "state.json"), "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def save(name: str, state: dict) -> None:
    write_private(os.path.join(state_dir(name), "state.json"),
                  json.dumps(state, indent=2, sort_keys=True).encode())


def clear(name: str) -> None:
    try:
        os.unlink(os.path.join(state_dir(name), "state.json"))
    except FileNotFoundError:
        pass


@dataclass
class ClusterLock:
    """An exclusive, non-blocking lock per cluster name (released when the process dies)."""

    name: str
    command: str = ""
    _fd: int | None = None

    def __enter__(self) -> "ClusterLock":
        path = os.path.join(state_dir(self.name), "lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another tfcluster"
            os.close(fd)
            raise LockedError(
                f"cluster {self.name!r} is busy: {holder}",
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
