"""Restarts in place (docs/design/restarts.md, "Restarts in place"): the attached shim restarts its own
task when the run's policy says so, on the channel already open, and holds the new
attempt's output back until the launcher confirms. Real shims through the local transport
(HostAgent), the live view at an attempt's end (attempts.pump), then `tfcluster train` end
to end (local, and over the test sshd), no TF."""
from __future__ import annotations

import io
import os
import queue
import re
import signal
import sys
import textwrap
import threading
from types import SimpleNamespace

import psutil
import pytest

from tests.helpers import (
    C,
    gone,
    kill_group,
    launch,
    manifest,
    only_run,
    read_until,
    start_tfcluster,
    tagged_processes,
    tfcluster,
    wait_for,
    with_tag,
)
from tests.tf_launch import free_ports
from tfcluster.launch.run.attempts import pump
from tfcluster.watch.logmux import LogMux

# Says which attempt it is and which process started it. Attempts below GOOD exit with
# RC; GOOD then exits 0, or with "hang" says so and waits to be stopped.
ATTEMPT = textwrap.dedent("""
    import os, sys, time
    n = int(os.environ["TFCLUSTER_RESTART"])
    print("attempt %d pid %d shim %d" % (n, os.getpid(), os.getppid()), flush=True)
    good, rc, hang = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "hang"
    if n < good:
        os._exit(rc)
    if hang:
        print("hanging", flush=True)
        time.sleep(600)
""")
SAID = re.compile(rb"attempt (\d+) pid (\d+) shim (\d+)")


class Launcher:
    """What the supervisor's pump does with one attached task: a thread reads it, and each
    attempt's end is heard with how much output had been read by then."""

    def __init__(self, task) -> None:
        self.task, self.out, self.events = task, b"", queue.Queue()
        self.cuts: list[int] = []            # len(self.out) at each attempt's end
        task.on_restart = self._ended
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _ended(self, rc: int) -> None:
        self.cuts.append(len(self.out))
        self.events.put(rc)

    def _read(self) -> None:
        while chunk := self.task.read():
            self.out += chunk
        self.events.put(None)

    def next_end(self) -> int | None:
        """The exit code of the next attempt the shim restarted in place (every byte of it
        read before), or None when the shim's output ended instead."""
        return self.events.get(timeout=15)

    def read_to_end(self) -> bytes:
        self.reader.join(15)
        assert not self.reader.is_alive()
        return self.out


def start(agent, run: str, good: int, rc: int = 3, hang: bool = False, max_restarts: int = 3,
          zero_ends: bool = True):
    argv = [sys.executable, "-c", ATTEMPT, str(good), str(rc), "hang" if hang else "-"]
    policy = {"policy": "on-failure", "max_restarts": max_restarts, "done": 0, "zero_ends": zero_ends}
    return agent.start_attached(launch(agent, f"{C}:{run}:worker:0:script", argv, env={"TFCLUSTER_RESTART": "0"}),
                                grace=0.5, restart=policy)


def attempts(out: bytes) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in m) for m in SAID.findall(out)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", ["plain", "deflated"])
def test_a_failed_task_restarts_in_place_under_the_same_shim(stream, request):
    # deflated: each end is still heard after that attempt's last byte (docs/design/logs.md)
    agent = request.getfixturevalue("agent" if stream == "plain" else "deflating")
    task = start(agent, "r1", good=2)
    launcher = Launcher(task)

    assert launcher.next_end() == 3
    assert task.restarted() and task.resume()
    assert launcher.next_end() == 3
    assert task.resume()
    out = launcher.read_to_end()

    assert task.wait(10) == 0 and task.swept()
    seen = attempts(out)
    assert [n for n, _, _ in seen] == [0, 1, 2]            # TFCLUSTER_RESTART counts, in order
    assert len({shim for _, _, shim in seen}) == 1          # one shim process: no new remote exec
    assert len({pid for _, pid, _ in seen}) == 3 and task.pid == seen[-1][1]
    # each end was heard after that attempt's last byte and before the next one's first
    assert [out[:cut].count(b"attempt") for cut in launcher.cuts] == [1, 2]
    assert with_tag(f"{C}:r1:") == {}


@pytest.mark.timeout(30)
def test_the_shim_honours_max_restarts(agent):
    task = start(agent, "r2", good=99, max_restarts=2)
    launcher = Launcher(task)
    ends = []
    while (rc := launcher.next_end()) is not None:
        ends.append(rc)
        task.resume()

    assert ends == [3, 3]                                   # two restarts, then the third exit is final
    assert task.wait(10) == 3 and task.swept()
    assert [n for n, _, _ in attempts(launcher.out)] == [0, 1, 2]
    assert with_tag(f"{C}:r2:") == {}


@pytest.mark.timeout(30)
def test_a_script_that_succeeds_is_not_restarted(agent):
    task = start(agent, "r3", good=0)
    launcher = Launcher(task)

    assert launcher.next_end() is None
    assert task.wait(10) == 0 and not task.restarted()
    assert [n for n, _, _ in attempts(launcher.out)] == [0]


@pytest.mark.timeout(30)
def test_a_restart_the_launcher_refuses_shows_nothing_and_leaves_nothing(agent):
    task = start(agent, "r4", good=1, hang=True)
    launcher = Launcher(task)
    assert launcher.next_end() == 3
    wait_for(lambda: len(with_tag(f"{C}:r4:")) == 1, 10, what="the attempt restarted in place")

    task.stop()                                             # STOP instead of CONT
    out = launcher.read_to_end()

    assert [n for n, _, _ in attempts(out)] == [0]          # the refused attempt's output never came
    assert task.wait(10) is not None and task.swept()
    assert with_tag(f"{C}:r4:") == {}


@pytest.mark.timeout(30)
def test_a_shim_whose_launcher_left_during_a_restart_leaves_nothing(agent):
    task = start(agent, "r5", good=1, hang=True)
    launcher = Launcher(task)
    assert launcher.next_end() == 3
    restarted = wait_for(lambda: with_tag(f"{C}:r5:"), 10, what="the attempt restarted in place")
    shim = psutil.Process(next(iter(restarted))).ppid()

    task.detach_kill()                                      # the launcher is gone before it confirmed

    wait_for(lambda: with_tag(f"{C}:r5:") == {}, 20, what="the shim's stop of the new attempt")
    wait_for(lambda: gone(shim), 10, what="the shim's exit")
    assert not task.swept()                                 # nobody listened: the run's sweep runs


@pytest.mark.timeout(30)
def test_a_shim_whose_launcher_left_restarts_nothing(agent):
    task = start(agent, "r6", good=1, hang=True)
    launcher = Launcher(task)
    assert launcher.next_end() == 3
    task.resume()
    wait_for(lambda: b"hanging" in launcher.out, 10, what="attempt 1's output")
    wait_for(lambda: len(with_tag(f"{C}:r6:")) == 1, 10, what="attempt 1")
    shim = psutil.Process(next(iter(with_tag(f"{C}:r6:")))).ppid()

    task.detach_kill()          # its task is stopped by signal: never restarted, whatever the policy

    wait_for(lambda: gone(shim), 20, what="the shim's exit")
    assert with_tag(f"{C}:r6:") == {}


# Each attempt leaves a TERM-ignoring grandchild in a session of its own and says its pid;
# attempt 0 then exits 3, attempt 1 waits to be stopped.
LEAVES = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen(["setsid", sys.executable, "-c",
                              "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                              "print('ready', flush=True); time.sleep(600)"], stdout=subprocess.PIPE)
    child.stdout.readline()
    print("attempt %s child %d" % (os.environ["TFCLUSTER_RESTART"], child.pid), flush=True)
    if os.environ["TFCLUSTER_RESTART"] == "0":
        os._exit(3)
    time.sleep(600)
""")


@pytest.mark.timeout(30)
def test_a_restart_sweeps_what_the_attempt_left_and_spares_the_new_one(agent):
    policy = {"policy": "on-failure", "max_restarts": 3, "done": 0, "zero_ends": True}
    task = agent.start_attached(launch(agent, f"{C}:r7:worker:0:script", [sys.executable, "-c", LEAVES],
                                       env={"TFCLUSTER_RESTART": "0"}), grace=0.5, restart=policy)
    launcher = Launcher(task)
    assert launcher.next_end() == 3
    task.resume()
    children = wait_for(lambda: [int(x) for x in re.findall(rb"child (\d+)", launcher.out)][1:] and
                        [int(x) for x in re.findall(rb"child (\d+)", launcher.out)], 10, what="attempt 1")

    wait_for(lambda: gone(children[0]), 10, what="attempt 0's grandchild swept")
    assert not gone(children[1]) and not gone(task.pid)      # the new attempt and its own: spared

    task.stop()
    launcher.read_to_end()
    assert task.wait(10) is not None and task.swept()
    assert with_tag(f"{C}:r7:") == {}


# -- tfcluster train, end to end ---------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import os, sys, time
    n, index = int(os.environ["TFCLUSTER_RESTART"]), int(os.environ["TFCLUSTER_TASK_INDEX"])
    print("attempt %d pid %d shim %d" % (n, os.getpid(), os.getppid()), flush=True)
    if index == 1:
        if sys.argv[1] == "always":
            sys.exit(3)
        if n == 0:
            os.kill(os.getpid(), 9)          # as the OOM killer would: 137
        if sys.argv[1] == "hang":
            print("hanging", flush=True)
            time.sleep(600)
    for s in range(1, 11):
        print("step=%d" % s, flush=True)
        time.sleep(0.02)
""")


def cli_spec(tmp_path, behaviour: str, max_restarts: int = 3, hosts: str | None = None) -> str:
    (tmp_path / "attempts.py").write_text(SCRIPT)
    a, b = free_ports(2)
    hosts = hosts or "hosts: [{name: local, address: 127.0.0.1}]\n"
    place = "local" if "local" in hosts else "h3"
    (tmp_path / "spec.yaml").write_text(
        f"name: rip{behaviour}\n{hosts}jobs:\n  worker: {{tasks: ['{place}:{a}', '{place}:{b}']}}\n"
        f"train:\n  mode: mirrored\n  script: attempts.py\n  args: [{behaviour}]\n"
        f"  restart: {{policy: on-failure, max_restarts: {max_restarts}}}\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return str(tmp_path / "spec.yaml")


def saved_attempts(run) -> list[tuple[int, int, int]]:
    return attempts((run / "worker-1.log").read_bytes())


@pytest.mark.timeout(120)
def test_train_restarts_a_killed_worker_in_place_and_says_what_it_always_said(tmp_path, home):
    result = tfcluster("train", cli_spec(tmp_path, "once"), home=home, cwd=tmp_path / "cwd")

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tfcluster: warning: worker:1 on local exited with code 137; restarting (1/3)" in result.stderr
    assert "worker:1 │ [tfcluster] exited with code 137; restarting (1/3)" in result.stdout
    run = only_run(tmp_path / "cwd" / "runs")
    log = (run / "worker-1.log").read_text()
    assert re.search(r"^attempt 0 .*\n\[tfcluster\] exited with code 137; restarting \(1/3\)\n"
                     r"attempt 1 .*\n(step=\d+\n){10}$", log), log
    seen = saved_attempts(run)
    assert [n for n, _, _ in seen] == [0, 1] and seen[0][2] == seen[1][2]   # one shim: no new exec
    task = manifest(run)["tasks"]["worker:1"]["script"]
    assert task["restarts"] == 1 and task["exit_code"] == 0
    assert re.search(r"^worker:1 +local +0 +1 ", result.stdout + result.stderr, re.M)   # the summary row


@pytest.mark.timeout(120)
def test_train_honours_max_restarts_and_gives_the_same_hint(tmp_path, home):
    result = tfcluster("train", cli_spec(tmp_path, "always", max_restarts=2), home=home, cwd=tmp_path / "cwd")

    assert result.returncode == 5, result.stdout[-3000:] + result.stderr[-3000:]
    warnings = [l for l in result.stderr.splitlines() if l.startswith("tfcluster: warning:")]
    assert warnings == [f"tfcluster: warning: worker:1 on local exited with code 3; restarting ({n}/2)"
                        for n in (1, 2)]
    assert "worker:1 on local failed with exit code 3" in result.stderr
    assert "it failed 3 times (train.restart.max_restarts = 2)" in result.stderr
    run = only_run(tmp_path / "cwd" / "runs")
    seen = saved_attempts(run)
    assert [n for n, _, _ in seen] == [0, 1, 2] and len({shim for _, _, shim in seen}) == 1
    assert manifest(run)["tasks"]["worker:1"]["script"]["restarts"] == 2


@pytest.mark.timeout(120)
def test_ctrl_c_during_a_restart_leaves_nothing_running(tmp_path, home):
    proc = start_tfcluster("train", cli_spec(tmp_path, "hang"), home=home, cwd=tmp_path / "cwd")
    try:
        lines = read_until(proc, r"worker:1 │ hanging", timeout=90)     # the replacement runs
        shim = int(SAID.search("".join(lines[-3:]).encode()).group(3))
        assert psutil.Process(shim).is_running()
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    assert proc.returncode == 130, out[-3000:]
    assert "restarting (1/3)" in "".join(lines)
    wait_for(lambda: not tagged_processes(), 20, what="every task gone")
    wait_for(lambda: gone(shim), 20, what="the shim gone")


@pytest.mark.ssh
@pytest.mark.timeout(120)
def test_over_ssh_the_restart_uses_the_open_channel(tmp_path, home, ssh_home, sshd):
    hosts = (f"python: {sys.executable}\nworkdir: {tmp_path / 'remote'}\n"
             f"ssh:\n  port: {sshd.port}\n  connect_timeout: 5\n"
             "hosts: [{name: h3, address: 127.0.0.3}]\n")
    result = tfcluster("train", cli_spec(tmp_path, "once", hosts=hosts), home=home, cwd=tmp_path / "cwd")

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tfcluster: warning: worker:1 on h3 exited with code 137; restarting (1/3)" in result.stderr
    run = only_run(tmp_path / "cwd" / "runs")
    seen = saved_attempts(run)
    assert [n for n, _, _ in seen] == [0, 1] and seen[0][2] == seen[1][2]   # one shim, one exec
    assert manifest(run)["tasks"]["worker:1"]["script"]["restarts"] == 1


# -- the live view at an attempt's end -----------------------------------------------------

class Stream:
    """An AttachedTask's reads for attempts.pump: chunks, and at an int the attempt ends with
    that code (every byte of it read); the supervisor then notes it, as before resume()."""

    def __init__(self, mux, *script) -> None:
        self.mux, self.script, self.on_restart = mux, list(script), None

    def read(self) -> bytes:
        while self.script:
            item = self.script.pop(0)
            if isinstance(item, bytes):
                return item
            self.on_restart(item)
            self.mux.note("w", f"exited with code {item}; restarting")
        return b""

    def wait(self, timeout: float) -> int:
        return 0


def test_an_attempts_unterminated_last_line_is_shown_before_the_note_and_the_next_starts_afresh():
    out = io.BytesIO()
    mux = LogMux(out, ["w"], color=False, hide_noise=True)
    run = SimpleNamespace(mux=mux, events=queue.Queue())
    proc = SimpleNamespace(key="w", task=SimpleNamespace(host="h"), stopping=False)
    pump(run, proc, Stream(mux, b"a0 line\na0 part", b"ial", 3, b"a1 line\na1 last"), 1)

    assert out.getvalue().decode().split("\n") == [
        "w │ a0 line", "w │ a0 partial", "w │ [tfcluster] exited with code 3; restarting",
        "w │ a1 line", "w │ a1 last", ""]     # the stream's end shows its last line too
    assert [run.events.get_nowait()[1:] for _ in range(2)] == [(1, 3), (2, 0)]


PARTIAL = textwrap.dedent("""
    import os, sys
    n, index = int(os.environ["TFCLUSTER_RESTART"]), int(os.environ["TFCLUSTER_TASK_INDEX"])
    if index == 1 and n < 2:
        print("t1 a%d line" % n, flush=True)
        sys.stdout.write("t1 a%d partial-no-newline" % n)
        sys.exit(3)
    print("t%d a%d line 00000" % (index, n), flush=True)
""")


@pytest.mark.timeout(120)
def test_train_shows_a_failed_attempts_partial_line_on_its_own_before_the_restart_note(tmp_path, home):
    (tmp_path / "partial.py").write_text(PARTIAL)
    a, b = free_ports(2)
    (tmp_path / "spec.yaml").write_text(
        f"name: ripartial\nhosts: [{{name: local, address: 127.0.0.1}}]\n"
        f"jobs:\n  worker: {{tasks: ['local:{a}', 'local:{b}']}}\n"
        f"train:\n  mode: mirrored\n  script: partial.py\n"
        f"  restart: {{policy: on-failure, max_restarts: 2}}\n")
    (tmp_path / "cwd").mkdir()
    result = tfcluster("train", str(tmp_path / "spec.yaml"), home=home, cwd=tmp_path / "cwd")

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    live = [line for line in result.stdout.splitlines() if line.startswith("worker:1 │ ")]
    assert [line.removeprefix("worker:1 │ ") for line in live] == [
        "t1 a0 line", "t1 a0 partial-no-newline", "[tfcluster] exited with code 3; restarting (1/2)",
        "t1 a1 line", "t1 a1 partial-no-newline", "[tfcluster] exited with code 3; restarting (2/2)",
        "t1 a2 line 00000"]
    saved = (only_run(tmp_path / "cwd" / "runs") / "worker-1.log").read_text()
    assert "t1 a0 partial-no-newline\n[tfcluster] exited with code 3; restarting (1/2)\nt1 a1 line\n" in saved
