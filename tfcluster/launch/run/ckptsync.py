"""Checkpoints that outlive their host: the chief's newest complete checkpoint copied to
`<run dir>/checkpoints/` here every `train.checkpoint.sync` seconds, and put on a fresh
host before a chief restarts there (docs/design/checkpoint-sync.md).

A failed sync never ends a run: it is one warning naming the host and what failed, and the
copies already kept stay. Each copy is written under a temporary name and renamed whole,
so a directory under checkpoints/ is always a complete checkpoint.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass

from tfcluster.errors import TfclusterError
from tfcluster.host import shim_protocol as proto
from tfcluster.launch.agent.lines import json_object, tail_text
from tfcluster.localfs import NOFOLLOW, is_hole, private_dir
from tfcluster.ui.units import size as _size
from tfcluster.watch.runs import CHECKPOINTS_DIR, kept_checkpoints, step_of

STATE_FILE = "checkpoint"          # TensorFlow's state file, named as TF names it
HEADER_CAP = 1 << 20               # bytes read looking for the header (a login shell's words first)
STOP_JOIN = 10.0                   # seconds stop() waits for a pull in flight
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW


@dataclass(frozen=True)
class PulledCheckpoint:
    name: str               # the prefix's basename, e.g. ckpt-30
    step: int | None        # N when the name ends in -N
    bytes: int
    path: str               # <run dir>/checkpoints/<name>: a directory TF restores from
    time: float             # when it was pulled (unix time)


class SyncFailed(Exception):
    """One pull or push that did not happen; its text is the warning's reason."""


class NotHere(SyncFailed):
    """The copy cannot be kept on this machine (the run directory refused)."""


class OverBound(SyncFailed):
    """The newest checkpoint is larger than a pull may copy: named, not copied."""


def state_text(name: str) -> bytes:
    """A `checkpoint` state file naming `name` (relative: it resolves in any directory)."""
    quoted = name.replace("\\", "\\\\").replace('"', '\\"')
    return f'model_checkpoint_path: "{quoted}"\nall_model_checkpoint_paths: "{quoted}"\n'.encode()


def safe_name(name) -> bool:
    """A prefix the host named that may be a directory name here: one plain path component."""
    return (isinstance(name, str) and bool(name) and "/" not in name and "\0" not in name
            and not name.startswith(".") and len(name) <= 255)


class CheckpointSync:
    """The launcher's copies of the chief's checkpoints (module docstring). Thread-safe:
    one pull or push at a time."""

    def __init__(self, session, plan, run_dir: str, ui) -> None:
        self.session = session
        self.config = plan.checkpoint            # plan.CheckpointPlan | None
        self.root = os.path.join(run_dir, CHECKPOINTS_DIR)
        self.run_dir = run_dir
        self.ui = ui
        self._lock = threading.Lock()
        self._records: list[dict] = []
        self._records_lock = threading.Lock()    # records() never waits for a pull
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc = None                        # the pull in flight, for stop()
        self._stamps: dict[str, str] = {}        # name -> which save of it was copied (shim_ckpt.stamp)
        self._said: str | None = None             # the last failure's words, until a pull works
        self.looked: tuple[float, PulledCheckpoint | None] | None = None   # the last pull that worked, and the newest then (ckptlag.py)

    # ------------------------------------------------------------------ what is kept

    def kept(self) -> list[PulledCheckpoint]:
        """The copies under checkpoints/, oldest pull first."""
        return [PulledCheckpoint(c["name"], c["step"], c["bytes"], c["path"], c["at"])
                for c in kept_checkpoints(self.run_dir)]

    def records(self) -> list[dict]:
        """What this run pulled, in order, for the manifest: {name, step, bytes, at}."""
        with self._records_lock:
            return [dict(r) for r in self._records]

    # ------------------------------------------------------------------ pull

    def pull(self, host: str, *, again: bool = True) -> PulledCheckpoint | None:
        """Copy the newest complete checkpoint of the checkpoint dir on `host` here; None
        when there is none yet, or on failure (one warning; `again=False`: none when the
        last pull failed with the same words, as the thread's every interval would)."""
        if self.config is None:
            return None
        with self._lock:
            try:
                pulled = self._pull(host)
            except Exception as e:  # noqa: BLE001 - a failed sync never ends a run
                if not self._stop.is_set():          # stop() dropped it: nothing to say
                    self._warn(f"pull of {self.config.dir}", host, e, again)
                return None
            self._said = None
            self.looked = (time.time(), pulled)
            return pulled

    def _pull(self, host: str) -> PulledCheckpoint | None:
        try:
            private_dir(self.root, "checkpoints", top=self.run_dir)
        except TfclusterError as e:
            raise NotHere(str(e)) from None
        kept = {c.name: c for c in self.kept()}
        agent = self.session.agent(host)
        agent.prepare()
        proc = agent.spawn_shim(proto.CKPT)
        self._proc = proc
        try:
            have = {n: s for n, s in self._stamps.items() if n in kept}
            limit, bound = self._bound()
            try:
                proc.write(proto.json_line({"dir": self.config.dir, "have": have, "limit": limit}))
                proc.close_stdin()
            except BrokenPipeError:      # it ended unread (no such python): its exit says why
                pass
            stream = _Stream(proc)
            header = stream.header()
            name = header.get("name")
            if name is None:
                stream.finish()
                return None                      # nothing saved there yet
            if not safe_name(name):
                raise SyncFailed(f"the host named a checkpoint {name!r}, which is no plain file name")
            if header.get("have"):
                stream.finish()
                return kept.get(name)
            if header.get("over") is True or _total(header) > limit:
                stream.proc.kill()               # nothing more is read (the shim sent nothing)
                raise OverBound(f"checkpoint {name} is {_size(_total(header))}, over {bound}: not copied")
            return self._receive(stream, name, header, limit)
        finally:
            self._proc = None
            proc.kill()

    def _bound(self) -> tuple[int, str]:
        """(bytes a pull copies at most, the bound in words): train.checkpoint.max_bytes, and
        never more than this machine's disk has free where the copy goes."""
        limit, said = self.config.max_bytes, f"the {_size(self.config.max_bytes)} of train.checkpoint.max_bytes"
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return limit, said
        if free < limit:
            return free, f"the {_size(free)} free on this machine's disk ({self.root})"
        return limit, said

    def _receive(self, stream: _Stream, name: str, header: dict, limit: int) -> PulledCheckpoint:
        files = _files_of(header, name, limit)
        tmp = tempfile.mkdtemp(prefix=".pull-", dir=self.root)      # 0700
        try:
            for f, size in files:
                fd = os.open(os.path.join(tmp, f), _CREATE, 0o600)
                with os.fdopen(fd, "wb") as out:
                    stream.copy(out, size)
            stream.finish()
            with os.fdopen(os.open(os.path.join(tmp, STATE_FILE), _CREATE, 0o600), "wb") as out:
                out.write(state_text(name))
            now = time.time()
            os.utime(tmp, (now, now))
            final = os.path.join(self.root, name)
            if os.path.lexists(final):           # an older copy of the same name (a restarted count)
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if isinstance(header.get("stamp"), str):
            self._stamps[name] = header["stamp"]
        pulled = PulledCheckpoint(name, step_of(name), sum(s for _, s in files), final, now)
        with self._records_lock:
            self._records.append({"name": name, "step": pulled.step, "bytes": pulled.bytes, "at": round(now, 3)})
        self._prune()
        return pulled

    def _prune(self) -> None:
        """Only the newest `keep` copies stay."""
        for old in self.kept()[:-max(1, self.config.keep)]:
            shutil.rmtree(old.path, ignore_errors=True)

    # ------------------------------------------------------------------ push

    def push(self, host: str) -> str | None:
        """Put the newest copy into the checkpoint dir on `host` with a state file naming
        it (TF's latest_checkpoint, CheckpointManager and MonitoredTrainingSession then
        restore it). The prefix pushed, or None: none kept, or it failed (one warning)."""
        if self.config is None:
            return None
        with self._lock:
            kept = self.kept()
            if not kept:
                return None
            newest = kept[-1]
            try:
                self._push(host, newest)
            except Exception as e:  # noqa: BLE001 - a failed sync never ends a run
                self._warn(f"push of {newest.name} to {self.config.dir}", host, e)
                return None
            return newest.name

    def _push(self, host: str, copy: PulledCheckpoint) -> None:
        """One put_many of open files, each streamed in chunks with its holes kept (the
        transport's put judges the directory there as it judges the cluster tree)."""
        agent = self.session.agent(host)
        agent.prepare()
        directory = self.config.dir.rstrip("/")
        files = sorted((f for f in os.listdir(copy.path) if f != STATE_FILE), key=lambda f: f.endswith(".index"))
        opened = []
        try:
            for f in files:               # shards, then the index, then the state file: TF's order
                opened.append(open(os.open(os.path.join(copy.path, f), os.O_RDONLY | NOFOLLOW), "rb"))
            items = [(src, f"{directory}/{f}", 0o600) for src, f in zip(opened, files)]
            agent.transport.put_many([*items, (state_text(copy.name), f"{directory}/{STATE_FILE}", 0o600)])
        finally:
            for src in opened:
                src.close()

    # ------------------------------------------------------------------ the thread

    def start(self, host_fn) -> None:
        """Pull from host_fn() (the chief's host now; None: skip) every sync seconds, on a
        daemon thread; nothing without a checkpoint or with `sync: off`."""
        if self.config is None or self.config.sync is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, args=(host_fn,), daemon=True,
                                        name="tfcluster-ckptsync")
        self._thread.start()

    def _loop(self, host_fn) -> None:
        while not self._stop.wait(self.config.sync):
            try:
                host = host_fn()
                if host is not None and self.session.pool.usable(host):
                    self.pull(host, again=False)     # a lost host was said once, by the run
            except Exception as e:  # noqa: BLE001 - a failed sync never ends a run
                self.ui.warn(f"checkpoint sync: {e}")

    def stop(self) -> None:
        """End the thread: a pull in flight is dropped (its temporary copy removed)."""
        self._stop.set()
        proc = self._proc
        if proc is not None:
            proc.kill()
        if self._thread is not None:
            self._thread.join(STOP_JOIN)

    def _warn(self, what: str, host: str, e: BaseException, again: bool = True) -> None:
        """One line: what failed where, why, and what is kept here (a person can copy it by hand)."""
        why = str(e) if isinstance(e, (SyncFailed, TfclusterError, OSError)) else f"{type(e).__name__}: {e}"
        if isinstance(e, OSError) and e.strerror:           # this machine: a full disk
            why = f"on this machine: {e.filename or self.root}: {e.strerror}"
        elif isinstance(e, NotHere):
            why = f"on this machine: {why}"
        elif not why.startswith(f"host {host}"):
            why = f"host {host}: {why}"
        kept = self.kept()
        have = (f"the newest copy here is {kept[-1].name} ({_size(kept[-1].bytes)}, {kept[-1].path})"
                if kept else "no copy is kept here yet")
        line = f"checkpoint sync: {what} failed: {why}"
        if again or line != self._said:
            self.ui.warn(f"{line}; {have}")
        self._said = line


def _total(header: dict) -> int:
    """The header's `bytes` (a number the host said; 0 when it said none)."""
    total = header.get("bytes")
    return total if type(total) is int and total >= 0 else 0


def _files_of(header: dict, name: str, limit: int) -> list[tuple[str, int]]:
    """The header's [file, size] pairs, each a plain file name of checkpoint `name`."""
    files = header.get("files")
    if not isinstance(files, list) or not files:
        raise SyncFailed("the host's answer lists no files")
    out = []
    for entry in files:
        if (not isinstance(entry, list) or len(entry) != 2 or not safe_name(entry[0])
                or not entry[0].startswith(name + ".") or entry[0] == STATE_FILE
                or type(entry[1]) is not int or entry[1] < 0):
            raise SyncFailed(f"the host's answer names a file {entry!r} that is not one of {name}")
        out.append((entry[0], entry[1]))
    if len({f for f, _ in out}) != len(out):
        raise SyncFailed(f"the host's answer names a file of {name} twice")
    if sum(size for _, size in out) > limit:          # what was asked: the shim sends no more itself
        raise OverBound(f"checkpoint {name} is over the {_size(limit)} a sync copies")
    return out


class _Stream:
    """The `ckpt` answer: a header line (after whatever a login shell printed), then bytes."""

    def __init__(self, proc) -> None:
        self.proc = proc
        self.buf = bytearray()

    def _more(self) -> bytes:
        chunk = self.proc.read()
        if not chunk:
            raise SyncFailed(self._why_ended())
        return chunk

    def _why_ended(self) -> str:
        rc = self.proc.wait(5.0)
        err = self.proc.read_stderr()
        for line in reversed(err.splitlines()):
            problem = proto.error_of(json_object(line))
            if problem is not None:
                return problem
        said = tail_text(err)
        if rc is None:
            return "the connection ended mid-copy" + (f": {said}" if said else "")
        return f"the host's shim ended mid-copy (exit status {rc})" + (f": {said}" if said else "")

    def header(self) -> dict:
        while True:
            while (nl := self.buf.find(b"\n")) >= 0:
                line = bytes(self.buf[:nl])
                del self.buf[:nl + 1]
                answer = json_object(line)
                if answer is not None:
                    problem = proto.error_of(answer)
                    if problem is not None:
                        raise SyncFailed(problem)
                    return answer
            if len(self.buf) > HEADER_CAP:
                raise SyncFailed("the host's shim said no header line in its first MiB")
            self.buf += self._more()

    def copy(self, out, size: int) -> None:
        """Exactly `size` bytes to the file `out`, a chunk of zeros as a hole (localfs.is_hole):
        a sparse checkpoint is never made real blocks here."""
        left = size
        while left:
            if not self.buf:
                self.buf += self._more()
            take = min(left, len(self.buf))
            chunk = self.buf[:take]
            if is_hole(chunk):
                out.truncate(out.seek(take, os.SEEK_CUR))     # the length grows as the copy does
            else:
                out.write(chunk)
            del self.buf[:take]
            left -= take
        out.truncate(out.tell())         # a trailing hole still counts

    def finish(self) -> None:
        """The end: nothing more, and the shim's exit status 0."""
        if self.buf or self.proc.read():
            raise SyncFailed("the host's shim sent more than its header announced")
        rc = self.proc.wait(30.0)
        if rc != 0:
            raise SyncFailed(self._why_ended())
