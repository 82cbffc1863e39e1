"""The one interface both transports implement.

The launcher and supervisor never know whether a host is local or remote: they
talk to a `HostAgent` (tfcluster/launch/agent/agent.py), which drives the remote shim through
a `Transport`. A transport only knows how to run an argv, spawn a long-lived
process with pipes, and put a file.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Result:
    rc: int
    stdout: bytes
    stderr: bytes


class Proc(abc.ABC):
    """A spawned process (local subprocess or SSH channel) with three pipes."""

    #: Called with no argument, from whichever thread notices, once stderr data has
    #: arrived (while stdout is being read: a reader blocked in read() still hears it);
    #: the callee collects it with read_stderr(). None: nobody needs to know at once.
    on_stderr = None

    @abc.abstractmethod
    def write(self, data: bytes) -> None:
        """Write to stdin; raises BrokenPipeError/OSError once the other side is gone."""

    @abc.abstractmethod
    def close_stdin(self) -> None: ...

    @abc.abstractmethod
    def read(self, n: int = 65536) -> bytes:
        """Block until stdout has data; b"" at EOF."""

    @abc.abstractmethod
    def read_stderr(self) -> bytes:
        """Everything on stderr so far (non-blocking after EOF of stdout)."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> int | None:
        """Exit status, or None if still running after `timeout` seconds."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Drop it: close the channel / kill the local process. Idempotent."""


def home_relative(path: str) -> str | None:
    """`path` relative to the login user's home if it is "~" or starts with "~/", else None.

    Both transports expand exactly these forms, so a path means the same on every host;
    "~user/..." and "$HOME/..." stay literal: no shell ever sees a `put` path."""
    if path == "~":
        return "."
    if path.startswith("~/"):
        return path[2:].lstrip("/") or "."
    return None


class Forward:
    """A port on a host made reachable here: connect to 127.0.0.1:`local_port`.

    For a local host that is the port itself and there is nothing to close."""

    def __init__(self, local_port: int) -> None:
        self.local_port = local_port

    def close(self) -> None:
        """Stop forwarding (nothing to do when nothing is forwarded). Idempotent."""


class Transport(abc.ABC):
    """One per host. `connect()` is idempotent; every method is thread-safe."""

    #: True for the local transport (no SSH involved)
    is_local: bool = False
    #: attached shims deflate a task's log on its way here (docs/design/logs.md, "Deflated logs")
    deflate_logs: bool = True
    #: why the host was given up on by the transport itself (SSH: "silent for 20s, no answer
    #: to keepalives"); None while nothing says so (docs/design/host-loss.md)
    lost: str | None = None

    def reopen(self, within: float) -> str | None:
        """After a dropped connection: None once the host can be talked to again, else why
        it could not be within `within` seconds. Nothing to re-open for a local host."""
        return None

    def connected(self) -> bool:
        """A connection is open and not ending now (no dial: what the transport knows). A
        local host has nothing to drop."""
        return True

    @abc.abstractmethod
    def connect(self) -> None:
        """Open (and authenticate) the connection; raises ConnectError naming the host."""

    @abc.abstractmethod
    def run(self, argv: Sequence[str], input: bytes = b"", timeout: float = 60.0) -> Result:
        """Run argv to completion (each word quoted with shlex.quote for SSH)."""

    @abc.abstractmethod
    def spawn(self, argv: Sequence[str]) -> Proc:
        """Start argv with pipes and return at once."""

    @abc.abstractmethod
    def put(self, data: bytes, path: str, mode: int = 0o600) -> None:
        """Write `data` to `path` on the host (parents created, 0700 dirs), atomically.

        `path` may be "~" or start with "~/" (the login user's home; see `home_relative`)."""

    def put_many(self, items: Sequence[tuple[bytes, str, int]]) -> None:
        """put() of each (data, path, mode), in order (over SSH: one SFTP session for all,
        each session costing the host a login shell)."""
        for data, path, mode in items:
            self.put(data, path, mode)

    @abc.abstractmethod
    def tunnel(self, port: int):
        """A byte stream (settimeout, sendall, recv, close) to 127.0.0.1:`port` on the host:
        a socket for a local host, a direct-tcpip channel over SSH. Raises when nothing
        listens there."""

    @abc.abstractmethod
    def forward(self, port: int, local_port: int = 0) -> Forward:
        """Make 127.0.0.1:`port` on the host reachable at 127.0.0.1:`local_port` here (another
        free port when that one is taken); the result names the port to connect to."""

    @abc.abstractmethod
    def close(self) -> None: ...
