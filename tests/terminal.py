"""tfcluster on a real pseudo-terminal (where its footer draws), and what that terminal then
shows, read back through pyte as a person would read the screen."""
from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import sys
import termios
import time

import pytest

COLS, ROWS = 110, 40


def run_in_pty(args: list[str], cwd, timeout: float = 90) -> tuple[int, bytes]:
    """`tfcluster ARGS` in `cwd` on a COLS x ROWS terminal: (its exit code, all it wrote)."""
    pid, fd = pty.fork()
    if pid == 0:   # the child: tfcluster on the terminal's slave side
        os.chdir(cwd)
        os.environ.update(TERM="xterm", COLUMNS=str(COLS), LINES=str(ROWS))
        os.environ.pop("NO_COLOR", None)
        os.execvp(sys.executable, [sys.executable, "-m", "tfcluster", *args])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
    data, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:      # EIO: the child closed the terminal
                break
            if not chunk:
                break
            data += chunk
    finally:
        if time.monotonic() >= deadline:
            os.kill(pid, 9)
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), data


def screen_lines(data: bytes) -> list[str]:
    """Every line the terminal shows or scrolled off, as a person would read them."""
    pyte = pytest.importorskip("pyte")
    screen = pyte.HistoryScreen(COLS, ROWS, history=5000)
    pyte.ByteStream(screen).feed(data)
    def text(row) -> str:
        return "".join(row[x].data for x in range(COLS)).rstrip()
    return [text(row) for row in screen.history.top] + [line.rstrip() for line in screen.display]
