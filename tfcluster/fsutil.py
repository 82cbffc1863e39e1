"""Small filesystem helpers shared by the local state and the local transport."""
from __future__ import annotations

import os
import tempfile


def write_private(path: str, data: bytes, mode: int = 0o600) -> None:
    """Atomic write of a private file (tmp in the same dir, fsync, rename).

    The mode is set before any byte is written, so no reader ever sees the data
    under looser permissions, and a crash leaves the old file or the new one."""
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
