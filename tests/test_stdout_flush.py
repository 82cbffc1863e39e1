"""A script's stdout: block-buffered and flushed by a timer (probe/sitecustomize.py).

tfcluster runs scripts with PYTHONUNBUFFERED=1 (their children too) and, through the start-up
probe, swaps the script's own stdout for a buffered one that a thread flushes every
TFCLUSTER_STDOUT_FLUSH seconds: one `write` per 64 KiB instead of per line (the log
streaming's cost). Real interpreters with the probe on PYTHONPATH, stdout to a real file; then the same
through `tfcluster train` on a local host.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import local_spec, only_run, tfcluster, wait_for

PROBE_DIR = Path(__file__).resolve().parent.parent / "tfcluster" / "host" / "probe"

# argv: the file our stdout goes to, and a file whose appearance lets the script end
SHOW = "import sys; print(type(sys.stdout.buffer).__name__, sys.stdout.write_through, file=sys.stderr)\n"
WAITS = textwrap.dedent("""
    import os, sys, time
    def wait(cond, what):
        deadline = time.monotonic() + 20
        while not cond():
            if time.monotonic() > deadline:
                sys.exit("timed out waiting for " + what)
            time.sleep(0.01)
    def shows(text):
        with open(sys.argv[1]) as f:
            return text in f.read()
""")


def run_probed(tmp: Path, code: str, flush: str, *args: str) -> subprocess.Popen:
    out = tmp / "out.txt"
    env = {**os.environ, "PYTHONPATH": str(PROBE_DIR), "PYTHONUNBUFFERED": "1",
           "TFCLUSTER_STDOUT_FLUSH": flush}
    script = tmp / "script.py"
    script.write_text(SHOW + WAITS + textwrap.dedent(code))
    with open(out, "wb") as f:
        return subprocess.Popen([sys.executable, str(script), str(out), *args], env=env, stdout=f,
                                stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(60)
def test_a_line_reaches_the_file_without_a_flush_while_the_script_still_runs(tmp_path):
    go = tmp_path / "go"
    proc = run_probed(tmp_path, """
        print("first line")                          # no flush: the timer's job
        wait(lambda: os.path.exists(sys.argv[2]), "go")
        for i in range(20000):
            print(f"line {i:05d}")
        print("last line")                           # written at exit
    """, "0.01", str(go))
    try:
        wait_for(lambda: (tmp_path / "out.txt").read_text() == "first line\n", 10, what="the first line")
        assert proc.poll() is None                   # it arrived while the script waits
        go.touch()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    assert err.splitlines()[0] == "BufferedWriter False"     # buffered, not one write per line
    lines = (tmp_path / "out.txt").read_text().splitlines()
    assert lines == ["first line"] + [f"line {i:05d}" for i in range(20000)] + ["last line"]


@pytest.mark.timeout(60)
def test_a_forked_child_neither_repeats_pending_output_nor_loses_its_own(tmp_path):
    proc = run_probed(tmp_path, """
        print("before fork")                         # pending in the buffer at the fork
        pid = os.fork()
        if pid == 0:
            print("child")                           # the child's own timer must flush it
            wait(lambda: shows("child"), "the child's line")
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("parent after", status)
    """, "0.01")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (tmp_path / "out.txt").read_text().splitlines() == ["before fork", "child", "parent after 0"]


@pytest.mark.timeout(60)
def test_flush_zero_leaves_stdout_unbuffered_and_starts_no_thread(tmp_path):
    proc = run_probed(tmp_path, """
        import threading
        print([t.name for t in threading.enumerate()])
    """, "0")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert err.splitlines()[0] == "FileIO True"
    assert (tmp_path / "out.txt").read_text() == "['MainThread']\n"


PRINTS = textwrap.dedent("""
    import os, sys
    print(os.environ.get("TFCLUSTER_STDOUT_FLUSH"), type(sys.stdout.buffer).__name__)
    print(sys.argv[1:], "done")
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env, expected", [("", "0.01 BufferedWriter"),
                                           ("env: {TFCLUSTER_STDOUT_FLUSH: '0'}\n", "0 FileIO")])
def test_train_buffers_a_scripts_stdout_unless_the_spec_says_0(tmp_path, home, env, expected):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    script = tmp_path / "prints.py"
    script.write_text(PRINTS)
    spec = local_spec(tmp_path, mode="mirrored", script=str(script), ps=0, workers=2, extra=env)
    result = tfcluster("train", str(spec), home=home, cwd=cwd, timeout=100)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for i in range(2):
        assert f"worker:{i} │ {expected}\n" in result.stdout
        saved = (only_run(cwd / "runs") / f"worker-{i}.log").read_text()
        assert saved.splitlines()[-2:] == [expected, "[] done"]


@pytest.mark.timeout(60)
def test_stderr_lines_and_the_traceback_stay_in_order_with_the_prints_before_them(tmp_path):
    out = tmp_path / "out.txt"
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import logging, sys
        print("one")
        logging.warning("two")
        print("three")
        print("four", file=sys.stderr)
        print("five")
        raise RuntimeError("six")
    """))
    env = {**os.environ, "PYTHONPATH": str(PROBE_DIR), "PYTHONUNBUFFERED": "1", "TFCLUSTER_STDOUT_FLUSH": "5"}
    with open(out, "wb") as f:          # stdout and stderr into one file, as the shim does
        proc = subprocess.run([sys.executable, str(script)], env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=30)
    assert proc.returncode == 1
    lines = out.read_text().splitlines()
    assert lines[:5] == ["one", "WARNING:root:two", "three", "four", "five"]
    assert lines[5].startswith("Traceback") and lines[-1] == "RuntimeError: six"


@pytest.mark.timeout(120)
def test_exit_never_aborts_while_the_flusher_is_writing(tmp_path):
    """A daemon flusher frozen inside the buffer's flush at shutdown held its lock and the
    interpreter's last flush aborted (SIGABRT, "could not acquire lock ... at interpreter
    shutdown"): 9 of 40 such runs did before the atexit hook. A flush every 0.2 ms and a
    pipe make the window wide."""
    script = tmp_path / "burst.py"
    script.write_text("x = 'y' * 200\nfor i in range(100000):\n    print(x)\nprint('end')\n")
    env = {**os.environ, "PYTHONPATH": str(PROBE_DIR), "PYTHONUNBUFFERED": "1", "TFCLUSTER_STDOUT_FLUSH": "0.0002"}
    for _ in range(15):
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=60)
        assert proc.returncode == 0 and not proc.stderr, proc.stderr[-2000:]
        assert proc.stdout.count(b"\n") == 100001 and proc.stdout.endswith(b"end\n")
