"""Small filesystem helpers shared by the local state and the local transport."""
from __future__ import annotations

import io
import os
import tempfile

from tfcluster.errors import PreflightError
from tfcluster.host.shim_fs import Refused
from tfcluster.host.shim_fs import private_dir as _private_dir

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def private_dir(path: str, what: str, top: str = "/") -> str:
    """shim_fs.private_dir on this machine: every level created 0700, an existing level
    someone else could change refused (PreflightError, exit 4) naming `what` and the path."""
    try:
        return _private_dir(path, top)
    except Refused as e:
        raise PreflightError(f"{what}: {e}") from None


def write_output(path: str, content, what: str) -> None:
    """A file the user asked for (`render -o`, `plot -o`): its directory judged as the
    state's (created 0700, a level someone else could change refused, exit 4), the file
    written 0600 under a fresh name and renamed over `path`, so a link left there is
    replaced, never written through. `content`: bytes, or a function writing them to a
    binary file (a figure's savefig). docs/security.md, "Files tfcluster reads, writes and
    runs"."""
    private_dir(os.path.dirname(os.path.abspath(path)), what)
    if not isinstance(content, bytes):
        buffer = io.BytesIO()
        content(buffer)
        content = buffer.getvalue()
    try:
        write_private(path, content)
    except OSError as e:
        raise PreflightError(f"{what}: {path}: {e.strerror or e}") from None


def write_private(path: str, data: bytes, mode: int = 0o600) -> None:
    """Atomic write of a private file (tmp in the same dir, fsync, rename).

    The mode is set before any byte is written, so no reader ever sees the data
    under looser permissions, and a crash leaves the old file or the new one.
    mkstemp opens with O_EXCL and O_NOFOLLOW: a link planted under its name is refused."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
