"""LogMux: whole prefixed lines from concurrent feeders, raw saved logs, no markup."""
from __future__ import annotations

import io
import random
import re
import stat
import subprocess
import sys
import threading
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tfcluster.watch.logmux import HISTORY, PROBE_MARKS, LogMux

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["worker:0", "ps:0"]
PREFIX = {"worker:0": "worker:0 │ ", "ps:0": "ps:0     │ "}


def mux(**kw) -> tuple[LogMux, io.BytesIO]:
    out = io.BytesIO()
    kw.setdefault("color", False)
    return LogMux(out, kw.pop("keys", KEYS), **kw), out


def shown(out: io.BytesIO) -> list[str]:
    return out.getvalue().decode("utf-8").splitlines()


def lines_of(out: io.BytesIO, key: str) -> list[str]:
    """The lines shown for `key`, prefix stripped; every line must carry exactly one known prefix."""
    got = []
    for line in out.getvalue().decode("utf-8").split("\n")[:-1]:
        owners = [k for k, p in PREFIX.items() if line.startswith(p)]
        assert len(owners) == 1, line
        if owners[0] == key:
            got.append(line[len(PREFIX[key]):])
    return got


def feed_split(m: LogMux, key: str, data: bytes, cuts: list[int]) -> None:
    start = 0
    for cut in sorted(set(cuts)) + [len(data)]:
        m.feed(key, data[start:cut])
        start = cut


# -- UTF-8 and line ends --------------------------------------------------------

def test_multibyte_character_split_at_every_byte_survives_intact():
    for char in ("€", "😀"):  # 3 and 4 bytes
        data = f"a{char}b\n".encode()
        for cut in range(1, len(data)):
            m, out = mux()
            feed_split(m, "worker:0", data, [cut])
            assert shown(out) == [f"worker:0 │ a{char}b"], (char, cut)


def test_every_byte_fed_alone_still_decodes():
    m, out = mux()
    for byte in "x€😀é\n".encode():
        m.feed("ps:0", bytes([byte]))
    assert lines_of(out, "ps:0") == ["x€😀é"]


def test_invalid_utf8_becomes_replacement_character_and_output_stays_valid():
    m, out = mux()
    m.feed("ps:0", b"bad \xff\xfe end\n")
    m.feed("ps:0", b"cut \xe2\x82")
    m.close_task("ps:0")
    assert lines_of(out, "ps:0") == ["bad \ufffd\ufffd end", "cut \ufffd"]


def test_crlf_is_one_line_end_even_split_between_chunks():
    m, out = mux()
    m.feed("ps:0", b"one\r\ntwo\r")
    m.feed("ps:0", b"\nthree\r\n\r\n")
    assert lines_of(out, "ps:0") == ["one", "two", "three", ""]


def test_progress_updates_in_one_batch_show_only_the_latest():
    m, out = mux()
    m.feed("ps:0", b"\r 10%\r 50%\r100%\ndone\n")
    assert lines_of(out, "ps:0") == ["100%", "done"]


def test_progress_updates_arriving_apart_each_show_once_and_never_splice():
    m, out = mux()
    for pct in (10, 50, 100):
        m.feed("ps:0", f"\r{pct:>3}%".encode())
    m.feed("ps:0", b"\n")
    m.feed("ps:0", b"next\n")
    assert lines_of(out, "ps:0") == [" 10%", " 50%", "100%", "next"]


def test_a_stalled_progress_bar_shows_its_latest_state_at_once():
    m, out = mux()
    m.feed("ps:0", b"step 1/9\rstep 2/9\r")
    assert lines_of(out, "ps:0") == ["step 2/9"]


def test_without_collapse_every_progress_update_gets_a_line():
    m, out = mux(collapse=False)
    m.feed("ps:0", b"\r1%\r2%\r\r3%\n")
    assert lines_of(out, "ps:0") == ["1%", "2%", "3%"]


def test_last_line_without_newline_is_shown_at_close_task_with_one_added():
    m, out = mux()
    m.feed("worker:0", b"first\nno newline")
    assert shown(out) == ["worker:0 │ first"]
    m.close_task("worker:0")
    assert out.getvalue().endswith(b"worker:0 \xe2\x94\x82 no newline\n")
    m.close_task("worker:0")  # nothing left: adds nothing
    assert lines_of(out, "worker:0") == ["first", "no newline"]


def test_task_can_be_fed_again_after_close_task():
    m, out = mux()
    m.feed("ps:0", b"crashed mid")
    m.close_task("ps:0")
    m.note("ps:0", "restarting (1/3)")
    m.feed("ps:0", b"again\n")
    assert lines_of(out, "ps:0") == ["crashed mid", "[tfcluster] restarting (1/3)", "again"]


def test_close_flushes_every_task():
    m, out = mux()
    m.feed("ps:0", b"p")
    m.feed("worker:0", b"w")
    m.close()
    m.close()
    assert sorted(shown(out)) == ["ps:0     │ p", "worker:0 │ w"]


def test_a_line_longer_than_the_limit_keeps_its_end_and_says_what_was_cut(monkeypatch):
    import tfcluster.watch.logmux as logs
    monkeypatch.setattr(logs, "MAX_PARTIAL", 100)        # of which MARK_ROOM (40) for the mark
    m, out = mux()
    m.feed("ps:0", b"a" * 120 + b"0123456789")
    m.feed("ps:0", b"\nnext\n")
    assert lines_of(out, "ps:0") == ["[70 bytes cut] " + "a" * 50 + "0123456789", "next"]


# -- the shared output stream -----------------------------------------------------

def test_markup_like_text_is_printed_verbatim():
    m, out = mux(color=True)
    text = "[worker:0] [/] [bold]x[/bold] [red]"
    m.feed("worker:0", f"{text}\n".encode())
    assert out.getvalue().endswith(f" │ {text}\n".encode())


def test_a_tasks_terminal_sequences_reach_a_terminal_and_stay_out_of_a_file_and_the_tail():
    """Keras 3 colours its bars even into a pipe: a terminal (colour on) gets them, a file or a
    pipe (colour off) the text alone; the tail the summary and the diagnoses read is text."""
    line = b"\x1b[1m8/8\x1b[0m \x1b[32m\xe2\x94\x81\x1b[0m\x1b[37m\x1b[0m 1s - loss: 0.5\tTAB\x07\n"
    m, out = mux(color=True)
    m.feed("ps:0", line)
    assert out.getvalue().endswith(b" \xe2\x94\x82 " + line)
    m, out = mux(color=False)
    m.feed("ps:0", line)
    assert lines_of(out, "ps:0") == ["8/8 \u2501 1s - loss: 0.5\tTAB\x07"]
    assert m.tail("ps:0") == ["8/8 \u2501 1s - loss: 0.5\tTAB\x07"]


def test_prefixes_are_aligned_to_the_longest_key():
    m, out = mux(keys=["ps:0", "worker:1", "chief:0"])
    for key in ("ps:0", "worker:1", "chief:0"):
        m.feed(key, b"x\n")
    assert shown(out) == ["ps:0     │ x", "worker:1 │ x", "chief:0  │ x"]


def test_color_colours_the_prefix_only_and_is_stable_by_position():
    m, out = mux(color=True, keys=["ps:0", "worker:0", "worker:1"])
    m.feed("worker:1", b"plain\n")
    m.feed("ps:0", b"plain\n")
    first, second = shown(out)
    assert first.startswith("\x1b[0;32mworker:1\x1b[0m │ ") and first.endswith(" │ plain")
    assert second.startswith("\x1b[0;36mps:0    \x1b[0m │ ")


def test_no_ansi_at_all_when_color_is_off():
    m, out = mux(color=False)
    m.feed("ps:0", b"text\n")
    m.note("ps:0", "restarting")
    assert b"\x1b" not in out.getvalue()


def test_note_is_marked_and_dimmed_when_coloured():
    m, out = mux(color=True)
    m.note("worker:0", "restarting (1/3)")
    assert out.getvalue().endswith(b" \xe2\x94\x82 \x1b[2m[tfcluster] restarting (1/3)\x1b[0m\n")


def test_each_batch_is_one_write_of_whole_lines():
    class Recorder(io.BytesIO):
        def __init__(self):
            super().__init__()
            self.writes: list[bytes] = []

        def write(self, b):
            self.writes.append(bytes(b))
            return super().write(b)

    out = Recorder()
    m = LogMux(out, KEYS, color=False)
    m.feed("ps:0", b"a\nb\nc\nhalf")
    m.feed("worker:0", b"x\n")
    assert out.writes == ["ps:0     │ a\nps:0     │ b\nps:0     │ c\n".encode(), "worker:0 │ x\n".encode()]


def test_concurrent_feeders_never_share_a_line_and_keep_order():
    n = 10_000
    m, out = mux()
    expected = {key: [f"{key} line {i} é€😀 [x]" for i in range(n)] for key in KEYS}

    def feeder(key: str) -> None:
        data = "".join(line + "\n" for line in expected[key]).encode()
        rng = random.Random(key)
        pos = 0
        while pos < len(data):
            step = rng.randint(1, 700)
            m.feed(key, data[pos:pos + step])
            pos += step

    threads = [threading.Thread(target=feeder, args=(key,)) for key in KEYS]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for key in KEYS:
        assert lines_of(out, key) == expected[key]


def test_broken_output_pipe_stops_showing_but_keeps_saving(tmp_path):
    class Gone(io.BytesIO):
        def write(self, b):
            raise BrokenPipeError

    m = LogMux(Gone(), KEYS, color=False, save_dir=str(tmp_path))
    m.feed("ps:0", b"a\n")
    m.feed("ps:0", b"b\n")
    m.close()
    assert (tmp_path / "ps-0.log").read_bytes() == b"a\nb\n"
    assert m.tail("ps:0") == ["a", "b"]


# -- show, saving, history ------------------------------------------------------------

def test_hidden_task_is_not_shown_but_still_saved_and_remembered(tmp_path):
    m, out = mux(show=lambda key: key == "worker:0", save_dir=str(tmp_path))
    m.feed("ps:0", b"secret\n")
    m.note("ps:0", "restarting")
    m.feed("worker:0", b"visible\n")
    m.close()
    assert shown(out) == ["worker:0 │ visible"]
    assert (tmp_path / "ps-0.log").read_bytes() == b"secret\n[tfcluster] restarting\n"
    assert m.tail("ps:0") == ["secret", "[tfcluster] restarting"]


def test_saved_log_is_byte_identical_to_what_was_fed_and_private(tmp_path):
    rng = random.Random(7)
    raw = {key: bytes(rng.randrange(256) for _ in range(50_000)) + b"\r\n\xe2\x82" for key in KEYS}
    (tmp_path / "logs").mkdir()
    stale = tmp_path / "logs" / "ps-0.log"
    stale.write_bytes(b"old run, world-readable")
    stale.chmod(0o644)
    m, _ = mux(save_dir=str(tmp_path / "logs"))
    for key, data in raw.items():
        feed_split(m, key, data, [rng.randrange(len(data)) for _ in range(40)])
    m.close()
    for key, data in raw.items():
        path = tmp_path / "logs" / f"{key.replace(':', '-')}.log"
        assert path.read_bytes() == data
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_note_in_saved_log_starts_on_its_own_line(tmp_path):
    m, _ = mux(save_dir=str(tmp_path))
    m.feed("ps:0", b"killed mid-li")
    m.note("ps:0", "restarting (1/3)")
    m.close()
    assert (tmp_path / "ps-0.log").read_bytes() == b"killed mid-li\n[tfcluster] restarting (1/3)\n"


def test_tail_returns_recent_lines_oldest_first():
    m, _ = mux()
    m.feed("ps:0", "".join(f"line {i}\n" for i in range(HISTORY * 3)).encode())
    assert m.tail("ps:0", 3) == [f"line {i}" for i in range(HISTORY * 3 - 3, HISTORY * 3)]
    assert len(m.tail("ps:0", HISTORY * 5)) == HISTORY
    assert m.tail("worker:0") == []
    assert m.tail("ps:0", 0) == []


def test_last_line_matching_finds_the_latest_match():
    m, _ = mux()
    m.feed("worker:0", b"step 1 loss=0.9\nstep 2 loss=0.5\nsaving checkpoint\n")
    m.feed("worker:0", b"step 3 lo")
    assert m.last_line_matching("worker:0", re.compile(r"loss=")) == "step 2 loss=0.5"
    assert m.last_line_matching("worker:0", re.compile(r"accuracy")) is None
    assert m.last_line_matching("ps:0", re.compile(r"loss=")) is None


def test_duplicate_keys_are_refused():
    import pytest

    with pytest.raises(ValueError):
        LogMux(io.BytesIO(), ["ps:0", "ps:0"], color=False)


# -- property: whatever the bytes and the chunking, nothing is lost or spliced ----------

def model_lines(text: str, collapse: bool) -> list[str]:
    """Lines shown for `text` fed in one chunk then closed."""
    *lines, tail = text.split("\n")
    result = []
    for line in lines:
        segs = [s for s in line.split("\r") if s]
        result += (segs[-1:] if collapse else segs) or [""]
    result += [s for s in tail.split("\r") if s]
    # the start-up probe's lines are tfcluster's own: saved, never shown (hypothesis draws
    # literals from the code under test, so it does produce them)
    # a file or a pipe (colour off) gets no terminal sequences
    return [CSI.sub("", s) for s in result if not any(m.decode() in s for m in PROBE_MARKS)]


CSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


def is_subsequence(small: list[str], big: list[str]) -> bool:
    it = iter(big)
    return all(any(x == y for y in it) for x in small)


chunked = st.binary(max_size=300).flatmap(
    lambda b: st.tuples(st.just(b), st.lists(st.integers(0, len(b)), max_size=12)))
byte_soup = st.lists(st.sampled_from([b"\n", b"\r", b"\r\n", b"a", b"bc", b"\xe2\x82\xac",
                                      b"\xf0\x9f\x98\x80", b"\xe2", b"\x82", b"\xff", b"\x1b[1m",
                                      b"[/]"]), max_size=60).map(b"".join)
soup_chunked = byte_soup.flatmap(
    lambda b: st.tuples(st.just(b), st.lists(st.integers(0, len(b)), max_size=12)))


def feed_interleaved(m: LogMux, inputs: dict[str, tuple[bytes, list[int]]], order: random.Random) -> None:
    pieces = {}
    for key, (data, cuts) in inputs.items():
        bounds = [0] + sorted(set(cuts)) + [len(data)]
        pieces[key] = [data[a:b] for a, b in zip(bounds, bounds[1:])]
    while any(pieces.values()):
        key = order.choice([k for k, p in pieces.items() if p])
        m.feed(key, pieces[key].pop(0))
    m.close()


@settings(max_examples=300, deadline=None)
@given(st.one_of(chunked, soup_chunked), st.one_of(chunked, soup_chunked), st.randoms())
def test_random_bytes_random_chunks_give_exactly_the_decoded_lines(a, b, order):
    inputs = {"worker:0": a, "ps:0": b}
    m, out = mux(collapse=False)
    feed_interleaved(m, inputs, order)
    for key, (data, _) in inputs.items():
        assert lines_of(out, key) == model_lines(data.decode("utf-8", "replace"), collapse=False)


@settings(max_examples=300, deadline=None)
@given(st.one_of(chunked, soup_chunked), st.one_of(chunked, soup_chunked), st.randoms())
def test_collapsing_only_drops_superseded_progress_updates(a, b, order):
    inputs = {"worker:0": a, "ps:0": b}
    m, out = mux()
    feed_interleaved(m, inputs, order)
    for key, (data, _) in inputs.items():
        text = data.decode("utf-8", "replace")
        got = lines_of(out, key)
        assert is_subsequence(got, model_lines(text, collapse=False))
        finals = model_lines(text.rsplit("\n", 1)[0] + "\n", collapse=True) if "\n" in text else []
        assert is_subsequence(finals, got)


# -- packaging and speed ---------------------------------------------------------------------

def test_importing_logmux_does_not_import_rich():
    code = "import sys, tfcluster.watch.logmux; sys.exit('rich' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_marker_search_agrees_with_the_plain_search():
    """logscan.AnyOf (a memchr pass per rarest byte first) finds exactly what
    `any(m in block ...)` and a line-by-line filter find, in the same order."""
    import random

    from tfcluster.watch.logscan import PROBE_MARKS, TF_NOISE, AnyOf
    rng = random.Random(12)
    markers = (b"step=", b"loss=", b"tfcluster-hang: ", *PROBE_MARKS, *TF_NOISE)
    words = [b"x" * 40, b"12345", b"a=b", b"step", b"loss:", b"]", b"I1123", *markers, b"\xc3\xa9"]
    for sets in (markers, markers[:2], (b"=",), (b"",)):
        find = AnyOf(sets)
        for _ in range(300):
            block = b"\n".join(b" ".join(rng.choice(words) for _ in range(rng.randint(0, 4)))
                               for _ in range(rng.randint(1, 8)))
            assert find(block) == any(m in block for m in sets), (sets, block)
            assert find.lines(block) == [line for line in block.split(b"\n")
                                         if any(m in line for m in sets)], (sets, block)


def test_the_history_is_the_last_lines_of_each_batch():
    import random

    from tfcluster.watch.logscan import last_lines
    rng = random.Random(3)
    for _ in range(2000):
        block = b"\n".join(b"x" * rng.choice([0, 1, 5, 60, 300, 5000]) for _ in range(rng.randint(1, 400)))
        n = rng.choice([1, 5, 100])
        assert last_lines(block, n) == block.split(b"\n")[-n:], (len(block), n)
