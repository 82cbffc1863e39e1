"""Saved runs read safely (docs/security.md, "Files tfcluster reads, writes and runs"):
`runs`, `plot` and `logs` read only regular files, with caps, from a runs/ only we can
change; a full disk under runs/ ends a run at once; huge lines stay bounded in memory.

Every fault here is produced for real: a link to /dev/zero and a FIFO planted in a run, a
runs/ another user owns, a 100 MB line, a tmpfs that fills. The CLI runs under an
address-space limit, so an unbounded read fails the test instead of the machine."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import cli_env, kill_group, local_spec, tagged_processes, wait_for
from tfcluster.watch.logmux import LogMux
from tfcluster.watch.plotting import rates, run_series

pytestmark = pytest.mark.timeout(240)

RUN = "w-20991231-235959-ffff"
PLAN = {"tasks": [{"task": "worker:0", "chief": True, "script": ["python3", "s.py"]},
                  {"task": "worker:1", "script": ["python3", "s.py"]}]}
MEMORY_LIMIT = 1 << 30          # the CLI's address space: an unbounded read hits it in seconds
MEASURE = textwrap.dedent("""\
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv.pop(1)),) * 2)
    from tfcluster.cli import main
    try:
        code = main(sys.argv[1:])
    finally:      # this process's own peak (ru_maxrss would count the forking parent's)
        with open("/proc/self/status") as f:
            peak = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
        print(f"peak_kb={peak}", file=sys.stderr)
    sys.exit(code)
""")
KEEP = 1 << 20          # bytes of each output stream kept: endless output must not fill the test


def spec_in(tmp: Path) -> Path:
    (tmp / "s.py").write_text("print('step=1 loss=1.0')\n")
    return local_spec(tmp, mode="mirrored", script="s.py", ps=0, workers=2, name="w")


def cli(cwd: Path, *args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float, int]:
    """The CLI under an address-space limit: (result, seconds, peak RSS in MB). A hang is a
    failure after `timeout` (its process group killed); only the first MiB of each stream
    is kept."""
    proc = subprocess.Popen([sys.executable, "-c", MEASURE, str(MEMORY_LIMIT), *args], cwd=cwd,
                            env=cli_env(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}

    def drain(stream) -> None:
        while chunk := stream.read1(1 << 16):
            if len(kept[stream]) < KEEP:
                kept[stream] += chunk[:KEEP - len(kept[stream])]
    readers = [threading.Thread(target=drain, args=(s,), daemon=True) for s in kept]
    for reader in readers:
        reader.start()
    start = time.monotonic()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"tfcluster {' '.join(args)} still running after {timeout}s") from None
    finally:
        took = time.monotonic() - start
        kill_group(proc)
        for reader in readers:
            reader.join(10)
    out, err = (kept[s].decode(errors="replace") for s in (proc.stdout, proc.stderr))
    rss = [int(line.split("=")[1]) // 1024 for line in err.splitlines() if line.startswith("peak_kb=")]
    return subprocess.CompletedProcess(args, proc.returncode, out, err), took, rss[-1] if rss else -1


def planted_run(tmp: Path, outcome: str = "succeeded") -> Path:
    runs = tmp / "runs"
    run = runs / RUN
    run.mkdir(parents=True)
    runs.chmod(0o700)
    run.chmod(0o700)
    doc = {"run_id": RUN, "cluster": "w", "mode": "mirrored", "started": 10.0, "plan": PLAN,
           "outcome": outcome, "exit_code": 0, "ended": 20.0, "tasks": {}}
    if outcome == "running":
        doc.update(pid=2 ** 22 + 1, pid_start=1)        # no such process: a died run
    (run / "manifest.json").write_text(json.dumps(doc))
    return run


# -- M4: links, FIFOs, runs/ others control ---------------------------------------------

@pytest.fixture
def poisoned(tmp_path):
    """A run whose chief log links to /dev/zero and whose worker:1 log is a FIFO."""
    spec = spec_in(tmp_path)
    run = planted_run(tmp_path)
    (run / "worker-0.log").symlink_to("/dev/zero")
    os.mkfifo(run / "worker-1.log")
    return tmp_path, spec, run


@pytest.mark.parametrize("args,code", [
    (["runs"], 0), (["runs", "--json"], 0), (["plot"], 1), (["logs"], 1), (["logs", "worker:1"], 1),
    (["logs", "-f"], 1), (["logs", "worker:0"], 1)])
def test_saved_files_that_are_a_link_or_a_fifo_are_refused_in_bounded_time_and_memory(poisoned, args, code):
    tmp, spec, _run = poisoned
    result, took, rss = cli(tmp, args[0], str(spec), *args[1:], timeout=30)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == code, result.stderr[-3000:]
    assert took < 20 and 0 < rss < 300, (took, rss)
    named = [line for line in result.stderr.splitlines() if "worker-0.log" in line or "worker-1.log" in line]
    assert named and all("not a regular file" in line or "symbolic link" in line for line in named), \
        result.stderr
    if args[0] == "runs" and len(args) == 1:
        assert RUN in result.stdout and "succeeded" in result.stdout


@pytest.mark.parametrize("how", ["writable by others", "owned by another user"])
def test_a_runs_dir_someone_else_can_change_is_refused_before_anything_is_read(tmp_path, how):
    spec = spec_in(tmp_path)
    run = planted_run(tmp_path)
    (run / "worker-0.log").write_text("step=3 loss=0.5\n")
    runs = tmp_path / "runs"
    if how == "writable by others":
        runs.chmod(0o777)
    else:
        os.chown(runs, 65534, 65534)
    for args in (["runs"], ["logs"], ["plot"], ["logs", "-f"]):
        result, _took, _rss = cli(tmp_path, args[0], str(spec), *args[1:], timeout=30)
        assert result.returncode == 4, (args, result.stderr)
        assert how.split()[0] in result.stderr and str(runs) in result.stderr, result.stderr
        assert "step=3" not in result.stdout and "Traceback" not in result.stderr


def test_a_died_run_whose_log_is_one_huge_line_is_read_in_bounded_memory(tmp_path):
    """A \\r-only progress bar never writes a newline: 100 MB of one line."""
    spec = spec_in(tmp_path)
    run = planted_run(tmp_path, outcome="running")
    with open(run / "worker-0.log", "wb") as f:
        bar = b"\rstep=1 loss=2.0 " + b"=" * 998
        f.writelines(bar for _ in range(100_000))
        f.write(b"\rstep=7 loss=0.5")
    (run / "worker-1.log").write_text("step=1 loss=1.0\n")
    result, _took, rss = cli(tmp_path, "runs", str(spec), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    row = json.loads(result.stdout)["runs"][0]
    assert (row["outcome"], row["step"], row["loss"]) == ("died", 7, 0.5)
    assert rss < 150, rss
    result, _took, rss = cli(tmp_path, "plot", str(spec))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "worker:0  steps 1–7" in result.stdout
    assert rss < 150, rss


# -- L4: the history ring ---------------------------------------------------------------

def test_the_history_ring_keeps_huge_lines_clipped():
    import io
    mux = LogMux(io.BytesIO(), ["worker:0"], color=False)
    line = "é" * (8 << 20) + "\n"              # 16 MB of two-byte characters
    for _ in range(20):
        mux.feed("worker:0", line.encode())
    mux.note("worker:0", "x" * (1 << 20))
    tail = mux.tail("worker:0", 100)
    assert len(tail) == 21
    assert all(len(t.encode()) <= 4096 + 3 and t.endswith("…") for t in tail), [len(t) for t in tail]
    # the live reader keeps a huge line's end and says how much went before it; cut between characters
    assert re.match(r"\[\d+ bytes cut\] éé", tail[0]) and "\ufffd" not in tail[0], tail[0][:80]
    mux.close()


# -- L5: plot's rates -------------------------------------------------------------------

def test_rates_of_100k_progress_lines_take_well_under_seconds():
    samples = [(i * 0.01, i) for i in range(100_000)]
    start = time.monotonic()
    got = rates(samples)
    took = time.monotonic() - start
    assert took < 2, took
    assert len(got) == 100_000 - 100 and all(abs(r - 100) < 1e-6 for _, r in got)


def test_plot_of_a_run_with_100k_step_lines_is_fast(tmp_path):
    run = planted_run(tmp_path)
    (run / "worker-0.log").write_text("".join(f"step={i} loss={1 / i:.6f}\n" for i in range(1, 100_001)))
    (run / "progress.tsv").write_text("".join(f"{i * 0.01:.3f}\tworker:0\t{i}\t-\n" for i in range(1, 100_001)))
    start = time.monotonic()
    series = run_series(str(run), json.loads((run / "manifest.json").read_text()))
    assert time.monotonic() - start < 10
    assert len(series["worker:0"].loss) == 100_000 and len(series["worker:0"].rate) > 99_000


# -- M3: a full disk under runs/ ---------------------------------------------------------

LOUD = textwrap.dedent("""\
    import os, sys, time
    line = "x" * 1000 + "\\n"
    for i in range(2400):                      # 2.4 MB: more than the disk holds
        sys.stdout.write(f"{i} " + line)
    sys.stdout.flush()
    print("step=1 loss=1.0", flush=True)
    time.sleep(float(sys.argv[1]))
""")


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "small"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_under_runs_ends_the_run_at_once_naming_the_path(tmp_path, small_disk):
    (tmp_path / "loud.py").write_text(LOUD)
    spec = local_spec(tmp_path, mode="mirrored", script="loud.py", args=["120"], ps=0, workers=2, name="df")
    runs = small_disk / "runs"
    start = time.monotonic()
    train = subprocess.Popen([sys.executable, "-m", "tfcluster", "train", str(spec), "--runs-dir", str(runs), "-q"],
                             cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        _out, err = train.communicate(timeout=90)
    finally:
        kill_group(train)
    took = time.monotonic() - start
    assert train.returncode == 1, err[-3000:]
    assert took < 60, took                      # not the script's 120 s
    assert "Traceback" not in err and "Exception in thread" not in err, err[-3000:]
    assert "No space left on device" in err and str(runs) in err, err[-3000:]
    assert len([line for line in err.splitlines() if "manifest.json" in line]) <= 1, err[-3000:]
    logs = list(runs.glob("df-*/worker-*.log"))
    assert len(logs) == 2 and any(p.read_bytes().startswith(b"0 xxx") for p in logs)   # kept
    wait_for(lambda: not any("df-" in tag for tag in tagged_processes().values()),
             timeout=20, what="every task of the run stopped")
