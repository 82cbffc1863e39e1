"""What LogMux looks for in a block of task output, in as few passes as it can: UTF-8
boundaries, TensorFlow's start-up noise and C++ log lines, tfcluster's probe lines, the
markers of the run's watchers. Bytes in, bytes out; every scan covers a whole block (up to
a megabyte), and lines are cut out only where a marker is (docs/ARCHITECTURE.md, "The data
path of `train`, one hop per line").
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
)


# TensorFlow's C++ INFO and WARNING lines (`I1123 04:50:00.123456  1234 master.cc:278] ...`):
# the tasks run with TF_CPP_MIN_LOG_LEVEL=0 so that they reach the saved logs and the hang
# watchdog; the live view hides them with hide_noise=True (errors are always shown).
TF_INFO_LINE = re.compile(rb"^[IW]\d{4} \d\d:\d\d:\d+(?:\.\d+)? +\d+ [^ \]]+:\d+\] ", re.M)
# Lines tfcluster's start-up probe writes for tfcluster itself: saved, never shown live.
PROBE_MARKS = (b"tfcluster-placement: ", b"tfcluster-not-ready: ")


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


PROBE_OR_NOISE = AnyOf(PROBE_MARKS + TF_NOISE)
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
