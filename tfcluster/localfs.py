"""Small filesystem helpers shared by the local state and the local transport."""
from __future__ import annotations

import errno
import io
import os
import stat
import tempfile
from collections.abc import Iterator
from typing import BinaryIO

from tfcluster.errors import PreflightError
from tfcluster.host.shim_fs import Refused
from tfcluster.host.shim_fs import private_dir as _private_dir

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
LINE_CAP = 1 << 16          # bytes of one line a reader of saved files keeps (its end)
COPY_CHUNK = 1 << 20        # bytes a copy holds at a time (a checkpoint is streamed, never read whole)
_CHUNK = 1 << 16
_ZEROS = bytes(COPY_CHUNK)
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device",
          stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket"}


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


def chunks(data: bytes | BinaryIO) -> Iterator[bytes]:
    """`data` (bytes, or a binary file read from where it stands) in pieces of at most
    COPY_CHUNK bytes: what a copy holds in memory at a time."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        for at in range(0, len(view), COPY_CHUNK):
            yield bytes(view[at:at + COPY_CHUNK])
        return
    while chunk := data.read(COPY_CHUNK):
        yield chunk


def is_hole(chunk: bytes) -> bool:
    """Whether `chunk` is all zero bytes: a copy skips it (seek) instead of writing it, so a
    sparse file stays sparse and zeros never become real blocks (docs/design/checkpoint-sync.md)."""
    return chunk == _ZEROS[:len(chunk)] if len(chunk) <= COPY_CHUNK else not chunk.strip(b"\0")


def write_sparse(fd: int, data: bytes | BinaryIO) -> int:
    """Write `data` (chunks()) to `fd` from its current offset, a run of zero bytes as a hole;
    the bytes written (the file's length is set, so a trailing hole counts)."""
    total = 0
    for chunk in chunks(data):
        if is_hole(chunk):
            os.lseek(fd, len(chunk), os.SEEK_CUR)
        else:
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
        total += len(chunk)
    os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR))
    return total


def write_private(path: str, data: bytes | BinaryIO, mode: int = 0o600) -> None:
    """Atomic write of a private file (tmp in the same dir, fsync, rename).

    The mode is set before any byte is written, so no reader ever sees the data
    under looser permissions, and a crash leaves the old file or the new one.
    mkstemp opens with O_EXCL and O_NOFOLLOW: a link planted under its name is refused.
    `data` may be a binary file, copied in chunks with its zero runs as holes (write_sparse)."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        os.fchmod(fd, mode)
        if isinstance(data, (bytes, bytearray)):
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            try:
                write_sparse(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def open_saved(path: str) -> BinaryIO:
    """A saved file (a run's log, manifest, progress) opened to read, only if it is a
    regular file: a symbolic link is not followed and a FIFO or a device is refused
    (OSError, its strerror saying which) without blocking or reading it.
    docs/security.md, "Files tfcluster reads, writes and runs"."""
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(e.errno, "a symbolic link, not followed", path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _KINDS.get(stat.S_IFMT(mode), "not a file")
            raise OSError(errno.EINVAL, f"not a regular file ({kind})", path)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_saved(path: str, limit: int) -> bytes:
    """The whole of a saved regular file (open_saved); OSError when it holds more than
    `limit` bytes, read no further."""
    with open_saved(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit >> 20} MiB", path)
    return data


def saved_tail(path: str, limit: int) -> bytes:
    """The last `limit` bytes of a saved regular file (open_saved), from its first whole
    line when it holds more."""
    with open_saved(path) as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - limit))
        data = f.read(limit)
    return data[data.find(b"\n") + 1:] if size > limit else data


def saved_lines(f: BinaryIO, cap: int = LINE_CAP) -> Iterator[bytes]:
    """The lines of a saved file, read in chunks, each at most `cap` bytes: a longer one
    keeps its end (a progress bar's `\\r` updates: the latest is last), so memory stays
    bounded whatever the file holds."""
    partial = b""
    while chunk := f.read(_CHUNK):
        *lines, rest = (partial + chunk if partial else chunk).split(b"\n")
        for line in lines:
            yield line[-cap:] if len(line) > cap else line
        partial = rest[-cap:]
    if partial:
        yield partial
