"""ProxyCommand: the SSH connection's bytes go through a command's stdin and stdout.

As ssh(1) does, the command runs as `$SHELL -c "exec COMMAND"`. Its stdin and stdout are
one end of a socket pair, so paramiko gets a real socket (timeouts, EOF and select behave
as on TCP). It runs in a session of its own: no terminal to prompt on, and a Ctrl-C meant
for tfcluster does not cut the connections its cleanup still needs (docs/design/ssh.md).
"""
from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import threading
from typing import TYPE_CHECKING

from tfcluster.errors import Cause, ConnectError

if TYPE_CHECKING:
    from tfcluster.transport.ssh_config import Endpoint

STDERR_LINES = 20
EXIT_GRACE_S = 2.0


class ProxyProcess:
    """One running ProxyCommand; `sock` is our end of its stdin/stdout."""

    def __init__(self, ep: Endpoint) -> None:
        assert ep.proxy_command, "ProxyProcess needs an endpoint with a proxy command"
        self.ep = ep
        self._stderr: collections.deque[bytes] = collections.deque(maxlen=STDERR_LINES)
        ours, theirs = socket.socketpair()
        shell = os.environ.get("SHELL") or "/bin/sh"
        try:
            self.proc = subprocess.Popen([shell, "-c", f"exec {ep.proxy_command}"],
                                         stdin=theirs, stdout=theirs, stderr=subprocess.PIPE,
                                         start_new_session=True, close_fds=True)
        except OSError as e:
            ours.close()
            raise self._error(f"cannot run it with {shell}: {e.strerror or e}") from None
        finally:
            theirs.close()
        self.sock = ours
        self._reader = threading.Thread(target=self._read_stderr, daemon=True,
                                        name=f"proxy-stderr {ep.address}")
        self._reader.start()

    def _read_stderr(self) -> None:
        while line := self.proc.stderr.readline(4096):  # EOF once every holder has exited
            if line.strip():
                self._stderr.append(line.strip())
        self.proc.stderr.close()

    def _error(self, problem: str) -> ConnectError:
        return self.ep.error(f"ProxyCommand `{self.ep.proxy_command}` {problem}",
                             hint="check ProxyCommand for this host in ~/.ssh/config", cause=Cause.PROXY)

    def exited(self, timeout: float | None = None) -> ConnectError | None:
        """The error to report when the command has exited (within `timeout`, by default
        EXIT_GRACE_S), else None."""
        try:
            rc = self.proc.wait(EXIT_GRACE_S if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(EXIT_GRACE_S)
        last = self._stderr[-1].decode(errors="replace") if self._stderr else ""
        status = f"exited with status {rc}" if rc >= 0 else f"was killed by signal {-rc}"
        return self._error(f"{status} before the SSH handshake" + (f": {last}" if last else ""))

    def close(self) -> None:
        """Close our end, stop the command (its process group) and reap it."""
        self.sock.close()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)   # its own session: pgid == pid
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(EXIT_GRACE_S)
