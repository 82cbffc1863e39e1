"""The live footer of `train`, in a real pseudo-terminal rendered by a terminal emulator
(pyte): it appears, updates, shows a restart, never tears a line or a warning, and is gone
at the end with the summary intact. No footer where stdout is not a terminal or --quiet.
Its progress line's rate and ETA, from explicit times: over the last 10 s, never from a
burst, and a stall in their place once no step came in that window."""
from __future__ import annotations

import io
import re
import subprocess
import sys
import threading
from collections import deque
from dataclasses import replace

import pytest

from tests.terminal import run_in_pty, screen_lines
from tfcluster.watch import metrics
from tfcluster.watch.footer import RateHistory, progress_line
from tfcluster.watch.logmux import LogMux

# under pytest-xdist, one worker runs them all: they share one cluster name, workdir and port
pytestmark = pytest.mark.xdist_group("footer")

# Worker 1's first attempt dies as if OOM-killed (137) after a few steps; the restart runs on.
SCRIPT = """\
import os, sys, time
index, attempt = int(os.environ["TFCLUSTER_TASK_INDEX"]), int(os.environ.get("TFCLUSTER_RESTART", "0"))
steps = int(sys.argv[2])
for s in range(1, steps + 1):
    print(f"step={s} loss={1.0 / s:.4f}", flush=True)
    if index == 1 and attempt == 0 and s == 5:
        os._exit(137)
    time.sleep(0.12)
print(f"tfcluster-result: global_step={steps} loss={1.0 / steps:.4f}", flush=True)
"""
SPEC = """\
name: foot
hosts: [{name: local, address: localhost}]
jobs:
  worker: {count: 2, hosts: [local], port: 22840}
train:
  mode: mirrored
  script: slow.py
  args: ["--steps", "30"]
  restart: {policy: on-failure, max_restarts: 3}
"""


def write_spec(tmp_path, name: str = "foot", port: int = 22840) -> str:
    (tmp_path / "slow.py").write_text(SCRIPT)
    (tmp_path / "spec.yaml").write_text(SPEC.replace("name: foot", f"name: {name}").replace("22840", str(port)))
    return str(tmp_path / "spec.yaml")


def test_footer_appears_updates_shows_the_restart_and_leaves_the_summary(tmp_path):
    rc, data = run_in_pty(["train", write_spec(tmp_path)], tmp_path)
    assert rc == 0, data.decode(errors="replace")[-3000:]
    footers = re.findall(rb"step (\d+)/30 \(\d+%\)[^\r\n]*elapsed", data)
    assert len(set(footers)) >= 3, footers          # drawn, and updated as steps go
    assert re.search(rb"restart(ing)? 1/3", data)   # the restart is in the footer
    lines = screen_lines(data)
    # nothing of the footer is left on the screen, and every task line is whole
    assert not [l for l in lines if l.startswith(("step ", "elapsed ", "running ", "restarting "))]
    task_lines = [l for l in lines if "│ step=" in l]
    torn = [l for l in task_lines if not re.fullmatch(r"worker:[01] │ step=\d+ loss=[\d.]+", l)]
    assert not torn and len(task_lines) >= 30 + 30 + 5
    warning = [l for l in lines if "exited with code 137; restarting (1/3)" in l]
    assert warning and all(l.startswith(("tfcluster: warning:", "worker:1 │ [tfcluster]")) for l in warning)
    assert any("✓ succeeded" in l for l in lines)
    summary = [l for l in lines if re.match(r"│ worker:[01] +│ local", l)]
    assert len(summary) == 2 and all(" 30 " in l for l in summary)


def test_no_footer_without_a_terminal_or_with_quiet(tmp_path):
    spec = write_spec(tmp_path)
    (tmp_path / "piped").mkdir()
    other = write_spec(tmp_path / "piped", name="footpiped", port=22850)   # a cluster of its own: both at once
    piped = subprocess.Popen([sys.executable, "-m", "tfcluster", "train", other], cwd=tmp_path / "piped",
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        rc, data = run_in_pty(["train", spec, "--quiet"], tmp_path)
        out, err = piped.communicate(timeout=90)
    finally:
        if piped.poll() is None:
            piped.kill()
            piped.wait(10)
    assert rc == 0 and b"steps/s \xc2\xb7" not in data and b"\x1b[J" not in data, data[-2000:]
    assert piped.returncode == 0, err[-2000:]
    assert b"\x1b[J" not in out + err and b"worker:0 \xe2\x94\x82 step=30" in out


# -- the progress line's rate, from explicit times (no sleeps) ---------------------------

def _tracker(target: int, lines: list[tuple[float, int]], key: str = "worker:0") -> metrics.Tracker:
    t = metrics.Tracker(targets={key: target})
    for now, step in lines:
        t.feed(key, f"step={step} loss=0.5".encode(), now)
    return t


def test_after_a_stall_the_footer_shows_the_stall_not_the_last_rate_or_an_eta():
    # 10 steps/s for 20 s, then nothing for 15 s: the last 10 s saw no step
    t = _tracker(400, [(100 + i / 10, i) for i in range(201)])
    s = t.state("worker:0")
    assert s.recent_rate(now=120.0) == pytest.approx(10, rel=0.02)
    assert s.recent_rate(now=135.0) is None
    line = progress_line(t.tasks, elapsed=36, now=135.0)
    assert line == "step 200/400 (50%) · no new step for 0:15 · elapsed 0:36 · loss 0.5"


def test_a_burst_of_steps_is_no_rate_and_then_a_stall():
    # the auditor's run: worker:0 says steps 0-19 within 0.064 s, then the cluster waits 30 s
    t = _tracker(20, [(50 + i * 0.064 / 19, i) for i in range(20)])
    s = t.state("worker:0")
    for now in (50.064, 50.5, 53.0, 60.0):            # within the window: too short a span
        assert s.recent_rate(now=now) is None
        line = progress_line(t.tasks, elapsed=now - 50, now=now)
        assert "steps/s" not in line and "ETA" not in line and "no new step" not in line, line
    line = progress_line(t.tasks, elapsed=23.2, now=73.2)
    assert line == "step 19/20 (95%) · no new step for 0:23 · elapsed 0:23 · loss 0.5"


def test_a_steady_rate_and_its_eta_are_still_shown():
    t = _tracker(400, [(100 + i / 10, i) for i in range(301)])
    assert t.state("worker:0").recent_rate(now=130.0) == pytest.approx(10, rel=1e-6)
    line = progress_line(t.tasks, elapsed=30, now=130.0)
    assert line == "step 300/400 (75%) · 10.0 steps/s · ETA 0:10 · elapsed 0:30 · loss 0.5"
    # a restart from an older step: the rate is the new attempt's, not a negative one
    t = _tracker(400, [(100 + i / 10, i) for i in range(51)] + [(106 + i / 10, 20 + 2 * i) for i in range(41)])
    assert t.state("worker:0").recent_rate(now=110.0) == pytest.approx(20, rel=1e-6)


def test_the_footer_keeps_the_window_of_a_fast_stepper_that_states_give_16_lines_of():
    # 50 step lines a second; each rebuild sees only the last 16 (runs.ProgressLog.states)
    t, history, rate = metrics.Tracker(targets={"worker:0": 10_000}), RateHistory(), None
    for i in range(1, 601):
        t.feed("worker:0", f"step={i}".encode(), 1000 + i / 50)
        if i % 25 == 0:                               # a rebuild every 0.5 s
            states = {k: replace(s, samples=deque(list(s.samples)[-16:], maxlen=16))
                      for k, s in t.tasks.items()}
            rate = history.update(states, 1000 + i / 50)["worker:0"].recent_rate(now=1000 + i / 50)
    assert rate == pytest.approx(50, rel=0.01)


def test_ctrl_c_while_the_footer_is_taken_off_gives_the_output_lock_back():
    """A Ctrl-C landing in the write that takes the footer off (a KeyboardInterrupt from the
    stream stands for it: where a real one lands cannot be chosen) must not leave the output
    lock held: `__exit__` does not run when `__enter__` raises, and every later line would wait."""
    class CutOnce(io.BytesIO):
        cut = False

        def write(self, data):
            if self.cut:
                self.cut = False
                raise KeyboardInterrupt
            return super().write(data)

    out = CutOnce()
    mux = LogMux(out, ["w"], color=False)
    mux.set_footer(["step 1/10"])
    out.cut = True
    with pytest.raises(KeyboardInterrupt):
        with mux.pause_footer():
            pass
    done = threading.Event()
    threading.Thread(target=lambda: (mux.feed("w", b"after\n"), done.set()), daemon=True).start()
    assert done.wait(5), "the output lock was left held: every later line waits"
    mux.close()             # only once the lock is free: it takes it too
    assert b"after" in out.getvalue()
