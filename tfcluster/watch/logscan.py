"""What LogMux looks for in a block of task output, in as few passes as it can: UTF-8
boundaries, TensorFlow's start-up noise and C++ log lines (and the lines that continue one),
absl's echoes of TF's Python log lines, tfcluster's probe lines, the markers of the run's
watchers. Bytes in, bytes out; every scan covers a whole block (up to a megabyte), and lines
are cut out only where a marker is (docs/design/logs.md, "The data path of `train`, one
hop per line").
"""
from __future__ import annotations

import codecs
import re
from typing import Sequence


def utf8_split(data: bytes, final: bool = False) -> tuple[bytes, bytes]:
    """(complete valid UTF-8, incomplete trailing character held back).

    Same rule as `codecs.getincrementaldecoder("utf-8")(errors="replace")`, but
    bytes stay bytes unless something had to be replaced.
    """
    if data.isascii():
        return data, b""
    try:
        _, n = codecs.utf_8_decode(data, "strict", final)
    except UnicodeDecodeError:
        text, n = codecs.utf_8_decode(data, "replace", final)
        return text.encode(), data[n:]
    return (data, b"") if n == len(data) else (data[:n], data[n:])


# TensorFlow's start-up chatter that TF_CPP_MIN_LOG_LEVEL cannot silence (absl prints it
# before logging is initialised). Hidden from the live view with hide_noise=True; always saved.
TF_NOISE = (
    b"All log messages before absl::InitializeLog() is called are written to STDERR",
    b"oneDNN custom operations are on",
    b"cpu_feature_guard.cc",
    b"To enable the following instructions:",
    b"rebuild TensorFlow with the appropriate compiler flags",
    b"Unable to register cuDNN factory",
    b"Unable to register cuBLAS factory",
    b"Unable to register cuFFT factory",
    b"computation placer already registered",
    b"Could not find cuda drivers on your machine",
    # an E line, but on a host without a GPU driver it only says there is no GPU; the colon
    # files it under a byte the other markers are looked for by already (AnyOf)
    b"failed call to cuInit:",
)


# TensorFlow's C++ INFO and WARNING lines (`I1123 04:50:00.123456  1234 master.cc:278] ...`):
# the tasks run with TF_CPP_MIN_LOG_LEVEL=0 so that they reach the saved logs and the hang
# watchdog; the live view hides them with hide_noise=True (errors are always shown). Only a
# C++ source names the line: absl-Python writes the same shape (`I1124 ... train.py:12] `),
# and that is the script's own logging, always shown.
TF_INFO_LINE = re.compile(rb"^[IW]\d{4} \d\d:\d\d:\d+(?:\.\d+)? +\d+ [^ \]]+\.(?:cc|cpp|cxx|c|h|hpp):\d+\] ",
                          re.M)
# TF's Python logger writes `INFO:tensorflow:<message>` through its own handler and, when the
# script logs through absl (absl.app.run), the same record again in absl's format straight
# after it (`I1124 ... mirrored_strategy.py:423] <message>`): that echo is hidden, the first
# copy shown (E and F records are never hidden).
TF_PY_MARK = b":tensorflow:"
_TF_PY_LINE = re.compile(rb"(INFO|WARNING):tensorflow:")
_ABSL_LINE = re.compile(rb"[IW]\d{4} \d\d:\d\d:\d+(?:\.\d+)? +\d+ [^ \]]+:\d+\] ")


def tf_python_echo(line: bytes) -> bytes | None:
    """The level letter and message an absl echo of `line` repeats; None: `line` is no
    INFO or WARNING line of TF's Python logger."""
    m = _TF_PY_LINE.match(line) if TF_PY_MARK in line else None
    return None if m is None else line[:1] + line[m.end():]


def is_echo(echo: bytes, line: bytes) -> bool:
    m = _ABSL_LINE.match(line)
    return m is not None and line[:1] + line[m.end():] == echo


def cut_echo(echo: bytes, block: bytes) -> bytes | None:
    """`block` less its first line if that is the echo (None: the block was only that)."""
    end = block.find(b"\n")
    if not is_echo(echo, block if end < 0 else block[:end]):
        return block
    return None if end < 0 else block[end + 1:]


# A terminal's control sequence (ESC [ ... final byte): Keras 3's bars colour their text with
# them even into a pipe. Taken out where the text is read or shown as text, not a terminal's.
CSI = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]")


# Lines tfcluster's start-up probe writes for tfcluster itself: saved, never shown live.
KERAS_CALL_MARK = b"tfcluster-keras: "      # `evaluate` or `predict` begins (`... done`: ends)
PROBE_MARKS = (b"tfcluster-placement: ", b"tfcluster-not-ready: ", b"tfcluster-strategy: ", KERAS_CALL_MARK)


# Bytes by how often they occur in log text, most often first: a marker is looked for only
# where its least frequent byte occurs at all.
_FREQUENT = b" e0t1a2o3i4n5s6r7h8l9dcumfpgwybvkxjqz\nETAOINSRHLDCUMFPGWYBVKXJQZ_.,-"


class AnyOf:
    """`any(m in block for m in markers)` in fewer passes: each distinct rarest byte of the
    markers is looked for once (a single byte is a memchr), and only the markers holding a
    byte the block has are searched for. An empty marker matches every block."""

    def __init__(self, markers: Sequence[bytes]) -> None:
        self.always = any(not m for m in markers)
        groups: dict[bytes, list[bytes]] = {}
        for m in markers:
            if m:
                rare = max(m, key=lambda c: _FREQUENT.find(bytes([c])) % (len(_FREQUENT) + 1))
                groups.setdefault(bytes([rare]), []).append(m)
        self.groups = [(b, tuple(ms)) for b, ms in groups.items()]

    def __call__(self, block: bytes) -> bool:
        if self.always:
            return True
        for byte, markers in self.groups:
            if byte in block and any(m in block for m in markers):
                return True
        return False

    def lines(self, block: bytes) -> list[bytes]:
        """The lines of `block` holding a marker, in order (only those lines are cut out)."""
        if self.always:
            return block.split(b"\n")
        starts = set()
        for _, markers in self.groups:
            for m in markers:
                at = block.find(m)
                while at >= 0:
                    start = block.rfind(b"\n", 0, at) + 1
                    starts.add(start)
                    end = block.find(b"\n", at)
                    at = block.find(m, end) if end >= 0 else -1
        found = []
        for start in sorted(starts):
            end = block.find(b"\n", start)
            found.append(block[start:] if end < 0 else block[start:end])
        return found


# The rest of one multi-line TF message, hidden with its first line: it continues only in
# the shape its first line announces (docs/design/logs.md, "The data path of `train`, one
# hop per line").
NAMES = -1        # after a line ending in ":": TF task names, one a line
_END = -2         # the line ends the message (the empty line after a DebugString)
TYPES = -3        # after TF's "Type inference failed": full types, up to the node's name
_TYPES_OPEN = b"Type inference failed"
_TYPES_END = b"\twhile inferring type of node '"
# The body of a type inference message: a FullTypeDef's lines (`type_id: TFT_…`, `args {`, `}`,
# any indent), the sentence between the two types, empty lines, its context lines (a tab first).
_TYPES_LINE = re.compile(rb"(?: *(?:type_id: \w+|args \{|\})| is neither a subtype nor a supertype of the "
                         rb"combined inputs preceding it:|\twhile .*|)\Z")
_PROTO_MARK = re.compile(rb"goo\.gle/debug[a-z]*[ \t]*\Z")     # protobuf's DebugString marker
_PROTO_INLINE = re.compile(rb": [A-Za-z_]\w* \{\Z")            # a DebugString without it
_PROTO_LINE = re.compile(rb"(?:[A-Za-z_]\w*|\[[\w./]+\])(: .*| \{)\Z")
_TASK_NAME = re.compile(rb"/job:\w+(?:/replica:\d+)?(?:/task:\d+)?(?:/device:\w+:\d+)?\Z")
# An absl Status written whole into a line that names none of it (XLA's, JAX 0.11 on: every
# JAX process's shutdown says two, `... CANCELLED: Preemption notifier is being deleted.`
# and `WatchTasksAsync failed ... Connection refused`): after any hidden line, a trace or
# gRPC's details may follow, then the lines of the status's message, to an empty line.
STATUS = -4
MAYBE_STATUS = -5
_STATUS_OPENS = (b"=== Source Location Trace: ===", b"Additional GRPC error information from remote target ")
_STATUS_LINE = re.compile(rb"(?:%s|%s.*:|[\w.+/-]+\.(?:cc|h|cpp|c|hpp):\d+|\. .*|:[A-Z_]+:.*)\s*\Z"
                          % tuple(re.escape(opener) for opener in _STATUS_OPENS))


def tf_message_opens(line: bytes) -> int | None:
    """How the message whose first line (a hidden TF line) is `line` continues: TYPES after
    TF's type inference failure, a proto's depth (0 after protobuf's marker, 1 after
    `: name {`), NAMES after a colon, else perhaps with a status's trace (MAYBE_STATUS)."""
    if _TYPES_OPEN in line:
        return TYPES
    if _PROTO_MARK.search(line):
        return 0
    if _PROTO_INLINE.search(line):
        return 1
    return NAMES if line.rstrip().endswith(b":") else MAYBE_STATUS


def tf_message_continues(state: int, line: bytes) -> tuple[bool, int | None]:
    """(whether `line` is part of the hidden message, the state after it; None: ended)."""
    if state == MAYBE_STATUS:
        return (True, STATUS) if line.startswith(_STATUS_OPENS) else (False, None)
    if state == STATUS:
        if not line.strip():
            return True, None
        return (True, STATUS) if _STATUS_LINE.match(line) else (False, None)
    if state == NAMES:
        return (True, NAMES) if _TASK_NAME.match(line) else (False, None)
    if state == TYPES:
        if not _TYPES_LINE.match(line):
            return False, None
        return True, (None if line.startswith(_TYPES_END) else TYPES)
    after = _proto_line(state, line)
    if after is None:
        return False, None
    return True, (None if after == _END else after)


def _proto_line(depth: int, line: bytes) -> int | None:
    """The depth after `line` in a DebugString body at `depth`: exact two-space indents,
    `name {`, `name: value`, `}`; _END for the empty line that follows the body."""
    if not line:
        return _END if depth == 0 else None
    body = line.lstrip(b" ")
    indent = len(line) - len(body)
    if body == b"}":
        return depth - 1 if depth > 0 and indent == 2 * (depth - 1) else None
    m = _PROTO_LINE.match(body) if indent == 2 * depth else None
    if m is None:
        return None
    return depth + 1 if m.group(1) == b" {" else depth


PROBE_OR_NOISE = AnyOf(PROBE_MARKS + TF_NOISE + (TF_PY_MARK,))
PROBE = AnyOf(PROBE_MARKS)


def last_lines(block: bytes, n: int) -> list[bytes]:
    """block.split(b"\n")[-n:], splitting only the end of the block: a tail long enough to
    hold n newlines (an rsplit's first item is a copy of all the rest; n rfinds cost more
    than one count over a few kilobytes)."""
    span = n * 128
    while span < len(block):
        tail = block[-span:]
        if tail.count(b"\n") >= n:
            return tail.split(b"\n")[-n:]
        span *= 8
    return block.split(b"\n")[-n:]


def has_tf_log_line(block: bytes) -> bool:
    """TF_INFO_LINE.search, with the regex run only when a line starts with I or W (and
    the block has the `] ` every such line has: one fast scan for most output)."""
    if b"]" not in block or b"] " not in block:        # a memchr first: most output has no "]"
        return False
    if not (block[:1] in (b"I", b"W") or b"\nI" in block or b"\nW" in block):
        return False
    return TF_INFO_LINE.search(block) is not None


# -- long tracebacks and tensor dumps, folded in the live view ---------------------------------

TRACEBACK = b"Traceback (most recent call last):"
# what opens a tensor's printed values: TF's `<tf.Tensor: ..., numpy=` and `tf.Tensor(`, numpy's
# `array(` (a PerReplica value inside Keras 3's error prints one per replica, ~95 lines each)
_TENSOR_OPENS = (b"numpy=", b"tf.Tensor(", b"array(")
_OPENS = AnyOf((TRACEBACK, *_TENSOR_OPENS))
# a row of printed values: brackets, numbers, `...`, commas, nan/inf, the closing `shape=`
_ROW = re.compile(rb"[ \t]*(?:array\()?[ \t\[\]\d.eE+\-,naif]*\)?(?:, (?:shape|dtype)=[^\n]*)?>?[ \t]*\Z")
# (lines shown at the start, lines shown at the end) of a folded run, by kind
FOLD_KEEP = {"traceback": (4, 8), "tensor": (3, 2)}


class Fold:
    """One task's long runs of traceback frames (the indented lines after `Traceback (most
    recent call last):`) and of tensor rows (after a tensor's opening line), shown as their
    first and last few lines with one line between saying how many are left out. The lines of
    a run's end are held until the run ends (the next line of another kind, or the task's
    end: flush); output with neither costs one scan of the block for the openers."""

    __slots__ = ("kind", "head", "held", "first_hidden", "hidden")

    def __init__(self) -> None:
        self.kind: str | None = None
        self.head = 0                        # lines of this run shown at its start
        self.held: list[bytes] = []          # the run's last lines so far
        self.first_hidden: bytes | None = None
        self.hidden = 0

    def feed(self, block: bytes) -> bytes | None:
        """`block` (whole lines) as shown; None: all of it is held."""
        if self.kind is None and not _OPENS(block):
            return block
        out: list[bytes] = []
        for line in block.split(b"\n"):
            if self.kind is not None:
                if self._continues(line):
                    self._take(line, out)
                    continue
                out += self._end()
            out.append(line)
            if TRACEBACK in line:
                self.kind = "traceback"
            elif any(m in line for m in _TENSOR_OPENS):
                self.kind = "tensor"
        return b"\n".join(out) if out else None

    def flush(self) -> bytes | None:
        """The held end of a run the task's output ended in (None: nothing held)."""
        out = self._end() if self.kind is not None else []
        return b"\n".join(out) if out else None

    def _continues(self, line: bytes) -> bool:
        if self.kind == "traceback":
            return line[:1] in (b" ", b"\t")
        return _ROW.match(line) is not None

    def _take(self, line: bytes, out: list[bytes]) -> None:
        head, tail = FOLD_KEEP[self.kind or "tensor"]
        if self.head < head:
            self.head += 1
            out.append(line)
            return
        self.held.append(line)
        if len(self.held) > tail:
            gone = self.held.pop(0)
            if self.first_hidden is None:
                self.first_hidden = gone
            self.hidden += 1

    def _end(self) -> list[bytes]:
        if self.hidden == 1:            # one line stands for itself, not for a mark
            out = [self.first_hidden or b""]
        elif self.hidden:
            what = "traceback frames" if self.kind == "traceback" else "tensor values"
            out = [f"[tfcluster] … {self.hidden} lines of {what} folded (the saved log has them)".encode()]
        else:
            out = []
        out += self.held
        self.kind, self.head, self.held, self.first_hidden, self.hidden = None, 0, [], None, 0
        return out
