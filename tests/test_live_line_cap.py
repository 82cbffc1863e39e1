"""The live line reader is bounded like the saved-run readers (watch/logmux.py, LINE_CAP): a line
longer than 64 KiB is held by its end only and shown with how many bytes were cut, `\\r`-only
progress never grows the launcher, and the saved log keeps every byte. Measured for real: a
`tfcluster train` whose task prints one 256 MiB line, the launcher's own peak RSS read from
its VmHWM (not /usr/bin/time, whose figure is the largest waited-for descendant: on a local host
that is the task itself)."""
from __future__ import annotations

import io
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from tests.helpers import cli_env, local_spec
from tfcluster.launch.agent.lines import JSON_LINE_CAP, Lines
from tfcluster.localfs import LINE_CAP
from tfcluster.transport.local import LocalTransport
from tfcluster.watch.logmux import MARK_ROOM, LogMux

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
KEPT = LINE_CAP - MARK_ROOM     # bytes of a cut line's end shown after its mark
# The launcher in-process, its own peak RSS (KiB) said on stderr after the CLI returns: VmHWM,
# the high-water mark of this program's memory (ru_maxrss would count the pytest process it was
# forked from, whose size it had until exec).
LAUNCHER = ("import re, sys\nfrom tfcluster.cli import main\nrc = main(sys.argv[1:])\n"
            "hwm = re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read()).group(1)\n"
            "sys.stderr.write('\\nMAXRSS %s\\n' % hwm)\nsys.exit(rc)\n")


def launch(spec: Path, home: Path, cwd: Path) -> tuple[subprocess.CompletedProcess, int]:
    """`tfcluster train SPEC` with its stdout in a file (never held in this test's memory):
    (the result, the launcher's peak RSS in KiB)."""
    with open(cwd / "live.out", "wb") as out:
        r = subprocess.run([sys.executable, "-c", LAUNCHER, "train", str(spec)], stdout=out,
                           stderr=subprocess.PIPE, timeout=100, cwd=cwd, env=cli_env(home))
    r.stderr = r.stderr.decode(errors="replace")
    peak = int(r.stderr.rsplit("MAXRSS ", 1)[1].split()[0])
    return r, peak


def saved_log(cwd: Path) -> Path:
    logs = list((cwd / "runs").glob("*/worker-0.log"))
    assert len(logs) == 1, logs
    return logs[0]


def test_a_256_mib_line_is_shown_by_its_end_and_saved_whole(tmp_path, home):
    size = 256 * MIB
    (tmp_path / "long.py").write_text(
        "import sys\nout = sys.stdout.buffer\nchunk = b'x' * (1 << 20)\n"
        f"for _ in range({size // MIB - 1}):\n    out.write(chunk)\n"
        "out.write(chunk[:-4] + b'END!\\n')\nout.write(b'the next line\\n')\nout.flush()\nsys.exit(1)\n")
    spec = local_spec(tmp_path, mode="mirrored", script=str(tmp_path / "long.py"), ps=0, workers=1)
    r, peak = launch(spec, home, tmp_path)
    assert r.returncode == 5, r.stderr[-2000:]
    live = (tmp_path / "live.out").read_bytes()
    mark = f"worker:0 │ [{size - KEPT} bytes cut] ".encode()
    assert live.count(mark) == 1, live[:300]
    line = live[live.index(mark) + len(mark):].split(b"\n", 1)[0]
    assert line == b"x" * (KEPT - 4) + b"END!"                # the end of the line, under 64 KiB
    assert b"worker:0 \xe2\x94\x82 the next line\n" in live
    assert len(live) < 1 * MIB, len(live)                     # before: the whole 256 MiB was shown
    log = saved_log(tmp_path)
    assert log.stat().st_size == size + len(b"\nthe next line\n")   # the saved log keeps every byte
    with open(log, "rb") as f:
        f.seek(size - 4)
        assert f.read() == b"END!\nthe next line\n"
    assert peak < 96 * 1024, f"launcher peak RSS {peak} KiB for one 256 MiB line"


def test_carriage_return_only_progress_keeps_the_launcher_small(tmp_path, home):
    updates = 400_000           # ~ 24 MiB of `\r` updates, never a newline until the end
    (tmp_path / "bar.py").write_text(
        "import sys\nout = sys.stdout.buffer\n"
        f"for i in range({updates}):\n    out.write(b'\\rstep %08d loss 0.%06d ' % (i, i) + b'=' * 30)\n"
        "out.write(b'\\rdone\\n')\nout.flush()\n")
    spec = local_spec(tmp_path, mode="mirrored", script=str(tmp_path / "bar.py"), ps=0, workers=1)
    r, peak = launch(spec, home, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    live = (tmp_path / "live.out").read_bytes()
    assert b"worker:0 \xe2\x94\x82 done\n" in live
    assert b"bytes cut" not in live            # no update is over the cap: none is cut
    log = saved_log(tmp_path)
    assert log.stat().st_size == updates * (len(b"\rstep 00000000 loss 0.000000 ") + 30) + len(b"\rdone\n")
    assert peak < 96 * 1024, f"launcher peak RSS {peak} KiB for {updates} progress updates"


def _fed(m: LogMux, key: str, chunks) -> int:
    """Feed `chunks` as a pump would; the peak of Python memory while doing it (bytes)."""
    tracemalloc.start()
    try:
        for chunk in chunks:
            m.feed(key, chunk)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_mux_holds_at_most_the_cap_of_an_endless_line_and_saves_it_all(tmp_path):
    out = io.BytesIO()
    save = tmp_path / "runs" / "r1"
    m = LogMux(out, ["worker:0"], color=False, save_dir=str(save))
    chunk = b"y" * (256 << 10)
    peak = _fed(m, "worker:0", [chunk] * 128)                  # 32 MiB, no line end yet
    assert out.getvalue() == b""                               # nothing shown before the line ends
    assert peak < 4 * MIB, peak                                # a few chunks, never the line
    m.feed("worker:0", b"\xc3\xa9tail\n")                         # ends with a 2-byte character
    m.close()
    shown = out.getvalue().decode("utf-8")
    cut = 32 * MIB + len("étail".encode()) - KEPT
    assert shown == f"worker:0 │ [{cut} bytes cut] " + "y" * (KEPT - 6) + "étail\n"
    assert (save / "worker-0.log").stat().st_size == 32 * MIB + 7


def test_a_long_update_is_cut_and_a_later_update_replaces_it(tmp_path):
    out = io.BytesIO()
    m = LogMux(out, ["worker:0"], color=False)
    m.feed("worker:0", b"z" * (LINE_CAP + 100))
    m.feed("worker:0", b"\r")                      # the long update ends: shown, cut
    m.feed("worker:0", b"short\rshorter\n")
    text = out.getvalue().decode()
    assert text.startswith("worker:0 │ [140 bytes cut] " + "z" * KEPT + "\n"), text[:80]
    assert text.split("\n")[1:] == ["worker:0 │ shorter", ""]


def test_every_shown_line_over_the_cap_is_cut_even_inside_one_chunk():
    out = io.BytesIO()
    m = LogMux(out, ["worker:0"], color=False)
    wide = "é".encode() * LINE_CAP + b"b"          # the cut falls inside a 2-byte character
    m.feed("worker:0", b"short\n" + wide + b"\nmiddle\n" + b"w" * (LINE_CAP + 1) + b"\nlast\n")   # one chunk
    lines = [line.split(" │ ", 1)[1] for line in out.getvalue().decode().splitlines()]
    assert lines == ["short", f"[{LINE_CAP + MARK_ROOM} bytes cut] " + "é" * (KEPT // 2) + "b",
                     "middle", f"[{MARK_ROOM + 1} bytes cut] " + "w" * KEPT, "last"], [x[:40] for x in lines]
    assert all(len(line.encode()) <= LINE_CAP for line in lines)


def test_a_shims_line_reader_skips_endless_words_with_bounded_memory(home):
    # a login shell that talks without end before the shim's answer (a real process, its pipe)
    noise = "import sys\nw = sys.stdout.buffer\nfor _ in range(64):\n    w.write(b'blah ' * 52429)\n" \
            "w.write(b'{\"error\": \"a forged tail\"}\\n{\"ok\": 1}\\n')\n"
    proc = LocalTransport().spawn([sys.executable, "-c", noise])
    try:
        lines = Lines(proc, "host local: test", timeout=60)
        tracemalloc.start()
        try:
            answer = lines.next()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert answer == {"ok": 1}          # the end of the endless words is never taken for an answer
        assert peak < JSON_LINE_CAP + 4 * MIB, peak
        assert lines.noise.endswith(b'{"error": "a forged tail"}\n')
        assert proc.wait(30) == 0
    finally:
        proc.kill()
