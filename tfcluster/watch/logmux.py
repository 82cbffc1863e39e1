"""Live, prefixed task output: many reader threads in, one output stream out.

Every task's reader thread feeds raw chunks (any boundaries) into one `LogMux`.
The mux assembles whole lines per task and writes each batch of complete lines
with a single `out.write` under one lock, so two tasks' text never share an
output line. It works in bytes: UTF-8 is only validated (an incomplete trailing
character is held back exactly as the incremental decoder would, invalid bytes
become U+FFFD), never decoded line by line. Rich is not used on this path: its
markup eats `[worker:0]`-style text and it manages ~19k lines/s.

Line ends: `\\n`, `\\r\\n`, and a bare `\\r` (a progress-bar update). Within one
batch only the latest update of a progress line is shown (a terminal would have
overwritten the others); the latest state is always shown, never spliced. A line (or one
`\\r` update) longer than LINE_CAP is held by its end only and shown with how many bytes were
cut, as the saved-run readers cut it (localfs.saved_lines). Keras'
progress bars are folded further: a bar's updates are shown at most once per
FOLD_EVERY seconds, and the update that ends the line (the epoch's last) always, so
an epoch is one line per task (docs/running.md, "The live view"); the
watchers still get every update shown or folded, and the saved log every byte. With `fold`,
a long run of traceback frames or of a tensor's printed values is shown as its first and last
lines, with one line saying how many are left out (logscan.Fold).
"""
from __future__ import annotations

import collections
import os
import re
import threading
import time
from typing import BinaryIO, Callable, Sequence

from tfcluster.localfs import LINE_CAP, NOFOLLOW, private_dir
from tfcluster.plan.names import log_file
from tfcluster.safetext import escape
from tfcluster.watch.logscan import (
    CSI,
    PROBE,
    PROBE_MARKS,
    PROBE_OR_NOISE,
    TF_INFO_LINE,
    TF_NOISE,
    AnyOf,
    Fold,
    cut_echo,
    has_tf_log_line,
    is_echo,
    last_lines,
    tf_message_continues,
    tf_message_opens,
    tf_python_echo,
    utf8_split,
)
from tfcluster.watch.kerasbar import keras_bar, keras_line

NOTE_MARK = "[tfcluster] "
HISTORY = 100                 # recent display lines kept per task (tail, summary)
RING_LINE = 4096              # bytes of one such line kept (a longer one is cut, "…" added)
MAX_PARTIAL = LINE_CAP        # bytes of a line held and shown: its end (a longer one is cut)
MARK_ROOM = 40                # of those, room for the mark that says how many bytes were cut
JOIN_BELOW = 1 << 16          # a batch smaller than this is one write with its prefix
FOLD_EVERY = 30.0             # seconds: at most one folded Keras bar update shown per task
_PALETTE = (36, 33, 32, 35, 34, 96, 93, 92, 95, 94)
_DIM, _RESET = b"\x1b[2m", b"\x1b[0m"


class _Task:
    __slots__ = ("key", "prefix", "sep", "show", "lock", "carry", "partial",
                 "shown", "ring", "fd", "saved_midline", "last_output", "inside", "echo",
                 "folded", "bar_since", "cut", "fold")

    def __init__(self, key: str, prefix: bytes, show: bool, fd: int | None) -> None:
        self.key, self.prefix, self.show, self.fd = key, prefix, show, fd
        self.sep = b"\n" + prefix
        self.lock = threading.Lock()
        self.carry = b""          # incomplete UTF-8 character at the end of the last chunk
        self.partial = b""        # unterminated segment of the current line
        self.shown = False        # a `\r` update of the current line is already on screen
        self.ring: collections.deque[bytes] = collections.deque(maxlen=HISTORY)
        self.saved_midline = False
        self.last_output: float | None = None   # time.monotonic() of the last chunk
        self.inside: int | None = None  # in a hidden multi-line TF message (logscan.tf_message_opens)
        self.echo: bytes | None = None  # the next line may be an absl echo (logscan.tf_python_echo)
        self.folded: bytes | None = None    # the latest Keras bar update folded, for the watchers
        self.bar_since: float | None = None  # when the current Keras bar was last shown (or began)
        self.cut = 0              # bytes cut from the start of t.partial (MAX_PARTIAL)
        self.fold: Fold | None = None   # long tracebacks and tensor dumps (logscan.Fold)


class LogMux:
    """Multiplexes task output onto one binary stream, saving each task's raw bytes.

    `show(key)` is asked once per task at construction; a hidden task (and its
    notes) is still saved and still answers `tail` / `last_line_matching`.
    With `collapse=False` every progress update gets its own line (Keras' bars too). `watch` is
    (markers, callback): every complete line containing one of the markers is passed
    to `callback(key, line)` (from the feeding thread) before it is shown or hidden.
    A saved log that cannot be written (a full disk) is closed, the task still shown, and
    `save_failed(path, error)` called (from the feeding thread); nothing raises.
    """

    def __init__(self, out: BinaryIO, keys: Sequence[str], *, color: bool,
                 show: Callable[[str], bool] | None = None,
                 save_dir: str | None = None, collapse: bool = True,
                 hide_noise: bool = False,
                 watch: tuple[Sequence[bytes], Callable[[str, bytes], None]] | None = None,
                 save_failed: Callable[[str, OSError], None] | None = None, fold: bool = False) -> None:
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate task keys: {list(keys)}")
        self._out = out
        self._color = color
        self._collapse = collapse
        self._hide_noise = hide_noise
        self._watch = watch
        self._watching = AnyOf(watch[0]) if watch is not None else None
        self._save_dir = save_dir
        self._save_failed = save_failed
        self._out_lock = threading.Lock()
        self._broken = False      # the reader of `out` went away (e.g. `| head`)
        self._closed = False
        self._footer = b""        # the live footer on screen (docs/design/logs.md, "Live footer")
        self._footer_rows = 0
        shown = {key: show(key) if show is not None else True for key in keys}
        # Align on the tasks actually shown: a hidden long key must not widen every prefix.
        width = max((len(k) for k in keys if shown[k]), default=0)
        if save_dir is not None:
            private_dir(save_dir, "runs", top=os.path.dirname(save_dir))
        self._tasks = {
            key: _Task(key, self._prefix(key, width, i), shown[key],
                       _open_log(save_dir, key) if save_dir is not None else None)
            for i, key in enumerate(keys)}
        for t in self._tasks.values():      # fold: long tracebacks and tensor dumps shown short
            t.fold = Fold() if fold else None

    def _prefix(self, key: str, width: int, position: int) -> bytes:
        name = key.ljust(width)
        if self._color:  # the leading reset stops another task's unclosed colour bleeding in
            name = f"\x1b[0;{_PALETTE[position % len(_PALETTE)]}m{name}\x1b[0m"
        return f"{name} │ ".encode()

    # -- feeding ---------------------------------------------------------------

    def feed(self, key: str, chunk: bytes) -> None:
        """Thread-safe; chunks may split lines and UTF-8 characters anywhere."""
        if not chunk:
            return
        t = self._tasks[key]
        with t.lock:
            t.last_output = time.monotonic()
            self._save(t, chunk)
            body, t.carry = utf8_split(t.carry + chunk if t.carry else chunk)
            if body:
                self._emit(t, self._block(t, body))
                if t.folded is not None:
                    self._watch_folded(t)

    def close_task(self, key: str) -> None:
        """End of one stream of `key`: show a last line that had no newline.

        The task may be fed again afterwards (a restarted process).
        """
        t = self._tasks[key]
        with t.lock:
            body, t.carry = utf8_split(t.carry, final=True)
            if t.partial or body:
                self._emit(t, self._block(t, body + b"\n"))
            if t.fold is not None:          # a run the output ended in: its held end
                self._emit(t, t.fold.flush(), fold=False)
            t.shown, t.cut = False, 0
            t.inside = t.echo = t.bar_since = None    # a restarted process continues nothing of this one

    def note(self, key: str, text: str) -> None:
        """A line from tfcluster itself about `key`: shown marked (dimmed), saved, kept."""
        t = self._tasks[key]
        lines = [f"{NOTE_MARK}{escape(line)}".encode("utf-8", "replace")   # it may quote a host
                 for line in (text.splitlines() or [""])]
        with t.lock:
            if t.fd is not None:
                # keep the note on its own line in the saved log
                self._save(t, (b"\n" if t.saved_midline else b"") + b"\n".join(lines) + b"\n")
            t.ring.extend(_clipped(lines))
            if self._watch is not None:     # the watchers see it as the saved log has it (a restart's
                for line in lines:          # note: the progress of the next attempt counts afresh)
                    if self._watching(line):
                        self._watch[1](t.key, line)
            if t.show:
                if self._color:
                    lines = [_DIM + line + _RESET for line in lines]
                self._write(b"".join([t.prefix + line + b"\n" for line in lines]))

    # -- queries ---------------------------------------------------------------

    def tail(self, key: str, n: int = 20) -> list[str]:
        """The last `n` (at most HISTORY) lines shown for `key`, hidden or not, as text: a
        terminal's colours and cursor moves taken out."""
        if n <= 0:
            return []
        t = self._tasks[key]
        with t.lock:
            recent = list(t.ring)[-n:]
        return [(CSI.sub(b"", line) if b"\x1b" in line else line).decode("utf-8", "replace") for line in recent]

    def last_output(self, key: str) -> float | None:
        """time.monotonic() when `key` last wrote anything (None: never)."""
        return self._tasks[key].last_output

    def last_line_matching(self, key: str, pattern: re.Pattern) -> str | None:
        """The most recent of the last HISTORY lines of `key` that `pattern` finds."""
        for line in reversed(self.tail(key, HISTORY)):
            if pattern.search(line):
                return line
        return None

    # -- the live footer: a few lines pinned under the scrolling output (terminals only) --

    def set_footer(self, lines: Sequence[str]) -> None:
        """Show `lines` (already fitted to the terminal's width) under the output from now on,
        replacing the footer shown; [] removes it. Task lines are written before it in the
        same write, so the footer never splits a line."""
        text = "\n".join(escape(line) for line in lines).encode()
        with self._out_lock:
            self._emit_raw(self._clear_footer() + text)
            self._footer, self._footer_rows = text, len(lines)

    def pause_footer(self):
        """A context manager: the footer is off the screen while it is held, e.g. while a
        message goes to stderr (the same terminal), then drawn again."""
        return _FooterPause(self)

    def _clear_footer(self) -> bytes:
        """The bytes that take the footer off the screen (cursor at its last line's end)."""
        if not self._footer_rows:
            return b""
        up = f"\x1b[{self._footer_rows - 1}A".encode() if self._footer_rows > 1 else b""
        return b"\r" + up + b"\x1b[J"

    def _emit_raw(self, buf: bytes) -> None:
        if self._broken or not buf:
            return
        try:
            self._out.write(buf)
            self._out.flush()
        except BrokenPipeError:
            self._broken = True

    def close(self) -> None:
        """Flush every task's unterminated line and close the saved logs (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for key, t in self._tasks.items():
            self.close_task(key)
            with t.lock:
                if t.fd is not None:
                    os.close(t.fd)
                    t.fd = None

    def __enter__(self) -> LogMux:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------

    def _save(self, t: _Task, chunk: bytes) -> None:
        if t.fd is not None:
            try:
                _write_all(t.fd, chunk)
            except OSError as e:     # a full disk: stop saving this task, say so once
                os.close(t.fd)
                t.fd = None
                if self._save_failed is not None:
                    self._save_failed(os.path.join(self._save_dir or "", log_file(t.key)), e)
                return
            t.saved_midline = not chunk.endswith(b"\n")

    def _block(self, t: _Task, body: bytes) -> bytes | None:
        """Complete display lines of `t` in `body`, joined by `\\n`; None if none.

        Caller holds `t.lock`. The unterminated rest stays in `t.partial`.
        """
        data = t.partial + body if t.partial else body
        if t.cut and (b"\n" in body or b"\r" in body):    # the segment held by its end ends here
            end = min(i for i in (data.find(b"\n"), data.find(b"\r")) if i >= 0)
            data, t.cut = _cut_line(data[:end], t.cut) + data[end:], 0
        if b"\r" in data:
            block = self._block_cr(t, data)
        else:
            block = self._block_lf(t, data)
        if block is not None and len(block) > MAX_PARTIAL:
            block = _cut_long(block)
        if len(t.partial) > MAX_PARTIAL:
            # never hold an endless line: keep its end, which a progress line updates
            keep = _char_start(t.partial, len(t.partial) - MAX_PARTIAL)
            t.cut += keep
            t.partial = t.partial[keep:]
        return block

    def _block_lf(self, t: _Task, data: bytes) -> bytes | None:
        end = data.rfind(b"\n")
        if end < 0:
            t.partial = data
            return None
        block, t.partial = data[:end], data[end + 1:]
        t.bar_since = None
        if t.shown:  # this line's latest update is on screen: its empty end adds nothing
            t.shown = False
            if not block:
                return None
            if block.startswith(b"\n"):
                block = block[1:]
        return block

    def _block_cr(self, t: _Task, data: bytes) -> bytes | None:
        *lines, tail = data.split(b"\n")
        shown: list[bytes] = []
        for line in lines:
            segs = self._updates(line.split(b"\r"))
            shown += segs if segs or t.shown else [b""]
            t.shown = False
        if lines:
            t.bar_since = None      # a line ended: the next bar is another (an epoch's)
        *done, t.partial = tail.split(b"\r")
        segs = self._updates(done)
        if segs and self._collapse and self._folds(t, segs[-1]):
            t.folded, segs = segs[-1], []
        if segs:
            shown += segs
            t.shown = True
        return b"\n".join(shown) if shown else None

    def _folds(self, t: _Task, update: bytes) -> bool:
        """Whether `update`, a line's latest update so far, is a Keras bar update to keep
        off the screen: all but one every FOLD_EVERY seconds of one bar."""
        clean = keras_line(update)
        if clean is None or keras_bar(clean) is None:
            return False
        now = time.monotonic()
        if t.bar_since is None:
            t.bar_since = now
            return True
        if now - t.bar_since < FOLD_EVERY:
            return True
        t.bar_since = now
        return False

    def _watch_folded(self, t: _Task) -> None:
        """The watchers get the folded update as they would have had it shown."""
        folded, t.folded = t.folded, None
        if self._watch is not None and self._watching(folded):
            self._watch[1](t.key, folded)

    def _updates(self, segs: list[bytes]) -> list[bytes]:
        """The non-empty `\\r` updates of one line worth showing."""
        segs = [s for s in segs if s]
        return segs[-1:] if self._collapse else segs

    def _emit(self, t: _Task, block: bytes | None, fold: bool = True) -> None:
        if block is None:
            return
        if self._watch is not None and self._watching(block):
            for line in self._watching.lines(block):
                self._watch[1](t.key, line)
        if t.inside is not None:
            block = self._message_rest(t, block)
        elif t.echo is not None:
            block, t.echo = cut_echo(t.echo, block), None
        if block is None:
            return
        if (PROBE_OR_NOISE(block) or has_tf_log_line(block)) if self._hide_noise else PROBE(block):
            lines = self._shown_lines(t, block.split(b"\n"))
            if not lines:
                return
            block = b"\n".join(lines)
        if fold and t.fold is not None:
            block = t.fold.feed(block)
            if block is None:
                return
        recent = last_lines(block, HISTORY)
        t.ring.extend(_clipped(recent) if len(block) > RING_LINE else recent)
        if t.show:
            if not self._color and b"\x1b" in block:   # a file or a pipe: text, not a terminal's codes
                block = CSI.sub(b"", block)
            body = block.replace(b"\n", t.sep)
            if len(body) < JOIN_BELOW:       # one write: whole lines, never torn by another writer
                self._write(t.prefix + body + b"\n")
            else:                            # not atomic anyway (a pipe's is PIPE_BUF): no copies
                self._write(t.prefix, body, b"\n")

    def _shown_lines(self, t: _Task, lines: list[bytes]) -> list[bytes]:
        """`lines` less probe lines and, with hide_noise, TF noise, the rest of each
        multi-line TF message it starts (t.inside carries one on to the next batch) and the
        absl echo of a TF Python log line (t.echo, likewise)."""
        shown = []
        for line in lines:
            if t.inside is not None:
                hide, t.inside = tf_message_continues(t.inside, line)
                if hide:
                    continue
            if any(m in line for m in PROBE_MARKS):
                continue
            if self._hide_noise:
                echo, t.echo = t.echo, None
                if echo is not None and is_echo(echo, line):
                    continue
                if any(m in line for m in TF_NOISE) or TF_INFO_LINE.match(line):
                    t.inside = tf_message_opens(line)
                    continue
                t.echo = tf_python_echo(line)
            shown.append(line)
        return shown

    def _message_rest(self, t: _Task, block: bytes) -> bytes | None:
        """`block` less its first lines while they continue t's hidden TF message (None:
        all of it does); only those lines are cut out, the fast path stays whole."""
        start = 0
        while t.inside is not None:
            end = block.find(b"\n", start)
            hide, t.inside = tf_message_continues(t.inside, block[start:] if end < 0 else block[start:end])
            if not hide:
                break
            if end < 0:
                return None
            start = end + 1
        return block[start:] if start else block

    def _write(self, *parts: bytes) -> None:
        """Write `parts` in order under the output lock, then flush. The parts are not joined
        (a megabyte block would be copied twice more) except around the footer."""
        with self._out_lock:
            if self._broken:
                return
            if self._footer_rows:    # lines go above the footer, in one write with it
                parts = (self._clear_footer() + b"".join(parts) + self._footer,)
            try:
                for part in parts:
                    self._out.write(part)
                self._out.flush()  # live view: nothing else would flush a quiet task's last lines
            except BrokenPipeError:
                self._broken = True  # keep saving and remembering; stop showing


class _FooterPause:
    def __init__(self, mux: LogMux) -> None:
        self._mux = mux

    def __enter__(self) -> None:
        self._mux._out_lock.acquire()
        try:
            self._mux._emit_raw(self._mux._clear_footer())
        except BaseException:   # Ctrl-C mid-write: __exit__ will not run, and every line would wait
            self._mux._out_lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self._mux._emit_raw(self._mux._footer)
        finally:
            self._mux._out_lock.release()


def _open_log(save_dir: str, key: str) -> int:
    name = log_file(key)
    if name == ".log" or "/" in name or name.startswith("."):
        raise ValueError(f"task key {key!r} cannot name a log file")
    fd = os.open(os.path.join(save_dir, name),
                 os.O_WRONLY | os.O_CREAT | os.O_TRUNC | NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file that already existed
    return fd


def cut_mark(n: int) -> bytes:
    """What stands in for the `n` bytes cut from the start of a long line (its end is shown)."""
    return f"[{n} bytes cut] ".encode()


def _cut_line(line: bytes, already: int = 0) -> bytes:
    """`line` (whose first `already` bytes were cut before) as shown: at most MAX_PARTIAL
    bytes, its end after the mark saying how many bytes are gone."""
    if not already and len(line) <= MAX_PARTIAL:
        return line
    room = min(MARK_ROOM, MAX_PARTIAL // 2)
    start = _char_start(line, max(0, len(line) - (MAX_PARTIAL - room)))
    return cut_mark(already + start) + line[start:]


def _cut_long(block: bytes) -> bytes:
    """`block` with every line longer than MAX_PARTIAL cut (_cut_line). Lines are found by
    probing windows of half the cap for a line end: a window without one lies inside a line
    of at least that length, so a batch of short lines costs a few finds per MiB."""
    width = max(1, MAX_PARTIAL // 2)
    parts: list[bytes] = []
    done = probe = 0                   # block[:done] is in parts; done is a line's start
    while probe + width <= len(block):
        if block.find(b"\n", probe, probe + width) >= 0:
            probe += width
            continue
        start = block.rfind(b"\n", done, probe) + 1 or done
        end = block.find(b"\n", probe + width)
        end = len(block) if end < 0 else end
        if end - start > MAX_PARTIAL:
            parts += [block[done:start], _cut_line(block[start:end])]
            done = end
        probe = end + 1
    if not parts:
        return block
    parts.append(block[done:])
    return b"".join(parts)


def _char_start(data: bytes, at: int) -> int:
    """`at`, or the start of the UTF-8 character it falls inside (never more than 3 back)."""
    back = at
    while back > 0 and at - back < 3 and data[back] & 0xC0 == 0x80:
        back -= 1
    return back


def _clipped(lines: list[bytes]) -> list[bytes]:
    """`lines` each at most RING_LINE bytes and "…", cut between two UTF-8 characters: the
    history (a failure's last lines) stays small whatever a task prints."""
    out = []
    for line in lines:
        if len(line) > RING_LINE:
            end = RING_LINE
            while end and line[end] & 0xC0 == 0x80:     # a continuation byte: back to its start
                end -= 1
            line = line[:end] + "…".encode()
        out.append(line)
    return out


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
