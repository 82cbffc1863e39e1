"""Transport for a host that is this machine: plain subprocesses, no SSH.

Tasks still go through the shim, so local and remote hosts behave the same; in
particular `LocalProc.kill()` drops the pipes as a closed SSH channel would, and
the shim's stdin-EOF watchdog does the rest.
"""
from __future__ import annotations

import os
import socket
import subprocess
import threading
from typing import Sequence

from tfcluster.errors import DeadlineError, PreflightError
from tfcluster.host.shim_fs import Refused, expand, private_dir
from tfcluster.localfs import write_private
from tfcluster.transport.base import Forward, Proc, Result, Transport


class LocalProc(Proc):
    def __init__(self, popen: subprocess.Popen) -> None:
        self._popen = popen
        self._stderr = bytearray()
        self._stderr_lock = threading.Lock()
        self._stderr_thread = threading.Thread(target=self._collect_stderr, daemon=True)
        self._stderr_thread.start()

    def _collect_stderr(self) -> None:
        try:
            while chunk := self._popen.stderr.read(65536):
                with self._stderr_lock:
                    self._stderr += chunk
                if self.on_stderr is not None:
                    self.on_stderr()
        except (OSError, ValueError):  # pipe closed by kill()
            pass

    def write(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[self._popen.stdin.write(view):]
        except ValueError as e:  # closed file
            raise BrokenPipeError(str(e)) from None

    def close_stdin(self) -> None:
        try:
            self._popen.stdin.close()
        except OSError:
            pass

    def read(self, n: int = 65536) -> bytes:
        try:
            return self._popen.stdout.read(n) or b""
        except (OSError, ValueError):
            return b""

    def read_stderr(self) -> bytes:
        """Stderr received since the last call (never blocks), as the SSH transport does."""
        with self._stderr_lock:
            data, self._stderr = bytes(self._stderr), bytearray()
        return data

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            rc = self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._stderr_thread.join(timeout=1.0)
        return rc

    def kill(self) -> None:
        # Closing our ends is what an SSH channel close does to the remote side.
        for pipe in (self._popen.stdin, self._popen.stdout):
            try:
                pipe.close()
            except OSError:
                pass


def home() -> str:
    """Where a local host's processes start: the user's home, as sshd starts a session there.
    Never the launcher's directory: it may be someone else's, and `python -c` and `-m` import
    from where they start (docs/security.md, "Files tfcluster reads, writes and runs")."""
    path = expand("~")
    return path if os.path.isdir(path) else "/"


def _program_expanded(argv: Sequence[str]) -> list[str]:
    """`~/venv/bin/python` is under the home, as a login shell over SSH reads it."""
    return [expand(argv[0]), *argv[1:]] if argv else list(argv)


class LocalTransport(Transport):
    is_local = True
    deflate_logs = False      # a pipe on this machine: copying is cheaper than deflating

    def __init__(self, name: str = "localhost") -> None:
        self.name = name

    def connect(self) -> None:
        pass

    def run(self, argv: Sequence[str], input: bytes = b"", timeout: float = 60.0) -> Result:
        argv = _program_expanded(argv)
        try:
            done = subprocess.run(list(argv), input=input, capture_output=True, timeout=timeout,
                                  start_new_session=True, cwd=home())
        except FileNotFoundError as e:
            return Result(127, b"", f"{argv[0]}: not found ({e.strerror})\n".encode())
        except subprocess.TimeoutExpired:
            raise DeadlineError(f"host {self.name}: {argv[0]} did not answer within {timeout:g}s")
        return Result(done.returncode, done.stdout, done.stderr)

    def spawn(self, argv: Sequence[str]) -> Proc:
        # Own session: a Ctrl-C in the launcher's terminal must reach the launcher only,
        # as it would with SSH, so the shim can still clean up in order.
        argv = _program_expanded(argv)
        try:
            popen = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, bufsize=0, start_new_session=True, cwd=home())
        except OSError as e:   # as a shell over SSH says it: 127 "not found", 126 not runnable
            code, why = (127, "not found") if isinstance(e, FileNotFoundError) else (126, e.strerror)
            popen = subprocess.Popen(["sh", "-c", 'echo "$0: $1" >&2; exit "$2"', argv[0], why, str(code)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, bufsize=0, start_new_session=True)
        return LocalProc(popen)

    def put(self, data: bytes, path: str, mode: int = 0o600) -> None:
        path = expand(path)      # a leading "~" / "~/" is the login user's home, as SFTP does
        try:
            private_dir(os.path.dirname(path) or ".")
        except Refused as e:
            raise PreflightError(f"host {self.name}: {e}") from None
        write_private(path, data, mode)

    def tunnel(self, port: int):
        return socket.create_connection(("127.0.0.1", port), timeout=10)

    def forward(self, port: int, local_port: int = 0) -> Forward:
        return Forward(port)          # the host is this machine: nothing to forward

    def close(self) -> None:
        pass
