"""The shim's `ckpt` command: the newest complete TensorFlow checkpoint in a directory,
sent back to the launcher (docs/design/checkpoint-sync.md).

TensorFlow writes a checkpoint P as data shards P.data-NNNNN-of-MMMMM, then P.index, then
the `checkpoint` state file naming it (model_checkpoint_path, all_model_checkpoint_paths),
each renamed into place. A checkpoint is complete when its .index and every shard its
-of-MMMMM count names are regular files; the newest complete one is the state file's
model_checkpoint_path, else the newest older one it lists that is complete. A directory
without a state file: the complete prefix with the highest trailing number.

The answer is one JSON header line on stdout, {"name", "dir", "files": [[file, size]...],
"bytes"}, then every file's bytes in the header's order and nothing else: a stream, not a
JSON answer, because a checkpoint is tens of megabytes to gigabytes and base64 in one JSON
line would cost a third more on the wire and the whole of it in memory on both sides. Every
file is opened before the header is written, so a checkpoint TensorFlow deletes meanwhile
(max_to_keep) is still sent whole. `{"have": {name: stamp}}`: the header says `"have": true`
and no bytes follow when the newest complete one is that save of one of them (stamp()).
`{"limit": N}`: a checkpoint over N bytes (apparent sizes, holes included) is named in the header
with `"over": true` and not sent. The directory is judged as every directory tfcluster uses
(shim_fs.private_dir: yours or root's, writable by nobody else, from / down) before anything in it
is read. Standard library only.
"""
from __future__ import annotations

import os
import re
import stat

if __package__:
    from . import shim_fs as fs
    from . import shim_procs as procs
    from . import shim_protocol as proto
else:  # shipped: this file's directory is first on sys.path
    import shim_fs as fs
    import shim_procs as procs
    import shim_protocol as proto

STATE_FILE = "checkpoint"
STATE_CAP = 1 << 20            # bytes of a state file read (it lists paths, a few KiB)
CHUNK = 1 << 20
DEFAULT_LIMIT = 16 << 30       # bytes a pull sends at most, unless the request says
# A shard this much newer than its index is a torn save (complete()). A copy made by hand with
# cp without -p stamps each file when it is copied, in any order: within this unless a shard
# took longer to copy than this after the index (cp -p and rsync -a keep the saved times).
TORN_AFTER_NS = 2 * 10**9
_STATE_LINE = re.compile(r'^\s*(model_checkpoint_path|all_model_checkpoint_paths)\s*:\s*"(.*)"\s*$')
_SHARD = re.compile(r"\.data-(\d{5})-of-(\d{5})$")
_NUMBER = re.compile(r"-(\d+)$")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "'": "'", "\\": "\\"}


def unescape(text: str) -> str:
    """A text-format protobuf string's C escapes (TensorFlow writes paths with them)."""
    out, i = bytearray(), 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            octal = re.match(r"[0-7]{1,3}", text[i + 1:])
            if octal:
                out.append(int(octal.group(), 8) & 0xFF)
                i += 1 + len(octal.group())
                continue
            out += _ESCAPES.get(nxt, "\\" + nxt).encode()
            i += 2
            continue
        out += c.encode()
        i += 1
    return out.decode("utf-8", "replace")


def state_paths(text: str) -> list:
    """The state file's checkpoints, newest first: model_checkpoint_path, then the listed
    ones from the last (TensorFlow lists them oldest first)."""
    model, listed = [], []
    for line in text.splitlines():
        m = _STATE_LINE.match(line)
        if m:
            (model if m.group(1) == "model_checkpoint_path" else listed).append(unescape(m.group(2)))
    out = []
    for path in model[-1:] + listed[::-1]:
        if path not in out:
            out.append(path)
    return out


def _in_dir(directory: str, path: str):
    """The prefix's name when `path` (relative, or absolute as tf.compat.v1's Saver writes
    it) names a checkpoint in `directory`; None for one elsewhere."""
    if "/" not in path:
        return path or None
    if os.path.isabs(path) and os.path.realpath(os.path.dirname(path)) == os.path.realpath(directory):
        return os.path.basename(path) or None
    return None


def _regular(directory: str, name: str):
    """The size of a regular file in `directory` (a link is not one), else None."""
    st = _regular_stat(directory, name)
    return None if st is None else st.st_size


def _regular_stat(directory: str, name: str):
    try:
        st = os.lstat(os.path.join(directory, name))
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def complete(directory: str, name: str, entries) -> list | None:
    """[(file, size)] of checkpoint `name` (shards, then the index, then a .meta when there
    is one) when complete, else None. Torn is not complete: a save of the same name again (a
    chief saves the step it just restored) renames its shards into place, then writes the
    index; until then, or for good when its host died in between, the shards are that
    save's and the index the one before's, and TensorFlow's restore of it fails with
    DataLossError (checksums). A shard written more than TORN_AFTER after its index is that."""
    shards = {}
    for entry in entries:
        if entry.startswith(name + ".data-"):
            m = _SHARD.search(entry)
            if m and entry == name + m.group(0):
                shards[int(m.group(1))] = (int(m.group(2)), entry)
    counts = {total for total, _ in shards.values()}
    if len(counts) != 1 or sorted(shards) != list(range(counts.pop())):
        return None                   # no shard, shards of two saves, or one missing
    files = [shards[i][1] for i in sorted(shards)] + [name + ".index"]
    stats = [_regular_stat(directory, f) for f in files]
    if any(st is None for st in stats):
        return None
    if max(st.st_mtime_ns for st in stats[:-1]) > stats[-1].st_mtime_ns + TORN_AFTER_NS:
        return None
    sizes = [st.st_size for st in stats]
    meta = _regular(directory, name + ".meta")      # tf.compat.v1's Saver: the graph, when written
    return list(zip(files, sizes)) + ([(name + ".meta", meta)] if meta is not None else [])


def candidates(directory: str, entries) -> list:
    """The checkpoint names to try, newest first."""
    text = fs.read_file(os.path.join(directory, STATE_FILE), STATE_CAP) if STATE_FILE in entries else None
    if text is not None:
        if len(text) > STATE_CAP:        # TensorFlow's lists a few paths: this one is not TF's
            raise proto.ShimError("the state file %s is over %d KiB, which no TensorFlow state file is: "
                                  "not read" % (os.path.join(directory, STATE_FILE), STATE_CAP >> 10))
        names = [_in_dir(directory, p) for p in state_paths(text.decode("utf-8", "replace"))]
        return [n for n in names if n]
    prefixes = [e[:-len(".index")] for e in entries if e.endswith(".index") and len(e) > len(".index")]
    numbered = [(int(m.group(1)), p) for p in prefixes for m in [_NUMBER.search(p)] if m]
    return [p for _, p in sorted(numbered, reverse=True)]


def newest_complete(directory: str):
    """(name, [(file, size)]) of the newest complete checkpoint in `directory`, else None."""
    try:
        entries = set(os.listdir(directory))
    except FileNotFoundError:
        return None
    for name in candidates(directory, entries):
        files = complete(directory, name, entries)
        if files is not None:
            return name, files
    return None


def stamp(directory: str, name: str):
    """Which save of checkpoint `name` this is (its index file's inode and time): a chief that
    restarted its count writes a new ckpt-10 over the old one, which is copied again."""
    try:
        st = os.lstat(os.path.join(directory, name + ".index"))
    except OSError:
        return None
    return f"{st.st_ino}:{st.st_mtime_ns}"


def _open_all(directory: str, files: list) -> list:
    """(fd, file, size) of each file, opened without following a link, checked regular."""
    opened = []
    try:
        for name, _ in files:
            fd = os.open(os.path.join(directory, name), fs.READ | getattr(os, "O_NONBLOCK", 0))
            opened.append(fd)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise proto.ShimError(f"{name} in {directory} is not a regular file")
        return [(fd, name, os.fstat(fd).st_size) for fd, (name, _) in zip(opened, files)]
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise


def _send(fd: int, size: int, name: str) -> None:
    left = size
    while left:
        chunk = os.read(fd, min(CHUNK, left))
        if not chunk:
            raise proto.ShimError(f"{name} shrank while it was sent ({size - left} of {size} bytes)")
        procs.write_all(1, chunk)
        left -= len(chunk)


def cmd_ckpt(req: dict):
    """Send the newest complete checkpoint of req["dir"] (module docstring). An error before
    the header is the envelope; one after it (the stream cut short) goes to stderr with the
    shim's error exit, so the launcher never takes a short stream for a checkpoint."""
    directory = fs.expand(req["dir"])
    if os.path.lexists(directory):       # what others could write there is never taken
        fs.private_dir(directory)
    found = newest_complete(directory)
    if found is None:
        return {"name": None, "dir": directory}
    name, files = found
    have = req.get("have")
    if isinstance(have, dict) and have.get(name) == stamp(directory, name):
        return {"name": name, "dir": directory, "have": True}
    opened = _open_all(directory, files)
    try:
        total = sum(size for _, _, size in opened)
        header = {"name": name, "dir": directory, "bytes": total, "stamp": stamp(directory, name),
                  "files": [[f, size] for _, f, size in opened]}
        if total > int(req.get("limit", DEFAULT_LIMIT)):    # named, not sent: the launcher says so
            procs.write_all(1, proto.json_line(dict(header, over=True)))
            return 0
        procs.write_all(1, proto.json_line(header))
        try:
            for fd, f, size in opened:
                _send(fd, size, f)
        except (proto.ShimError, OSError) as e:
            procs.write_all(2, proto.json_line(proto.error_answer(proto.describe_exception(e))))
            return proto.EXIT_ERROR
    finally:
        for fd, _, _ in opened:
            os.close(fd)
    return 0

