"""Suite-wide fixtures: a private HOME for every test, a leak check after every test, and the speed classes.

Every process tfcluster starts carries TFCLUSTER_JOB_ID in its environment
(see docs/ARCHITECTURE.md). After each test, no such process that was not there before the
test may remain (a leaked TF server fails the suite).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import psutil
import pytest

from tests.helpers import CLUSTER_DIR, tagged_processes
from tfcluster.launch.agent.agent import HostAgent
from tfcluster.transport.local import LocalTransport

pytest_plugins = ["tests.sshd", "tests.netns", "tests.users", "tests.slurm"]

# Started in the background of a script (`pytest ... &`), this process has SIGINT ignored, and
# an ignored signal stays ignored across exec: every tfcluster the tests start would then shrug
# off the Ctrl-C they send it. Python's own handler here is reset to the default at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The speed classes (pyproject's markers) come from what a test starts, not from memory: a
# test that uses a fixture starting an sshd or Slurm gets that mark here, and a test of the
# fast subset that starts TensorFlow, an sshd or Slurm all the same fails (fast_subset_only_fast).
# `-m "not tf and not ssh and not slurm"` is then the fast subset.
FIXTURE_MARKS = {"sshd_factory": "ssh", "slurm_cluster": "slurm"}
SLOW_MARKS = ("tf", "ssh", "slurm")
SLOW_PROGRAMS = {"sshd": "ssh", "slurmctld": "slurm", "slurmd": "slurm", "munged": "slurm"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, mark in FIXTURE_MARKS.items():
            if fixture in item.fixturenames and item.get_closest_marker(mark) is None:
                item.add_marker(mark)
        if "slurm_cluster" in item.fixturenames:
            # under pytest-xdist (`--dist loadgroup`), one worker runs them all: one Slurm cluster started
            item.add_marker(pytest.mark.xdist_group("slurm"))
        if item.get_closest_marker("alone") is not None and item.get_closest_marker("xdist_group") is None:
            # scripts/test.sh runs the alone tests in two lanes, each one test at a time: the
            # notices' (a module's own group: minutes of waiting out a deadline on the bed) beside
            # this one, the rest
            item.add_marker(pytest.mark.xdist_group("alone"))
    if hasattr(config, "workerinput"):    # a pytest-xdist worker (where `dist` reads "no")
        items[:] = _queue(items)


def pytest_collection_finish(session):
    """Under `--dist loadgroup`, a group's tests share one worker only if pytest-xdist could tag
    them: a pytest release where it cannot (pytest-xdist#1386) fails the run here, not later as
    two Slurm or TensorBoard tests colliding on two workers."""
    config = session.config
    if hasattr(config, "workerinput") and config.getvalue("loadgroup"):
        loose = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if loose:
            raise pytest.UsageError(f"pytest-xdist did not group {len(loose)} test(s) marked xdist_group "
                                    f"(e.g. {loose[0]}): pytest {pytest.__version__} with this pytest-xdist "
                                    "cannot; see the pytest bound in pyproject.toml")


def _queue(items: list) -> list:
    """The order workers take tests in (the same on every worker): the long ones first, the
    quick ones (no TensorFlow, sshd or Slurm) last, where they fill the end of every worker's
    queue instead of one long test running on its own at the end. Among the long ones, a test on
    the bed of hosts takes turns with one on this machine's TensorFlow, spread over the first
    three quarters: a bed test spends much of its time waiting (a deadline, a host's silence,
    steps at a set pace), two side by side left a core idle (minutes at 60-75 % busy), and a
    TensorFlow test beside it fills that."""
    bed, slow, quick = [], [], []
    for item in items:
        # an sshd or Slurm test most often runs TensorFlow too (a tutorial's trainer over SSH)
        (bed if "bed" in item.fixturenames
         else slow if any(item.get_closest_marker(m) is not None for m in SLOW_MARKS) else quick).append(item)
    head = len(slow) * 3 // 4
    mixed, taken = [], 0
    for n, test in enumerate(bed):
        upto = head * (n + 1) // len(bed)
        mixed += [test, *slow[taken:upto]]
        taken = upto
    return mixed + slow[taken:] + quick


def _slow_processes(root: psutil.Process, old: set[int]) -> list[str]:
    """The descendants of `root` not in `old` that belong to a slow class: an sshd, Slurm's
    daemons, or any process with TensorFlow's library mapped; each as `mark: pid command`. A
    fork of `root` that has not yet exec'd maps what root does (TensorFlow, once a test of
    this session imported it) and is left out."""
    found = []
    me = root.cmdline()
    for child in root.children(recursive=True):
        if child.pid in old:
            continue
        try:
            if child.cmdline() == me:   # this process forked, before its exec: its maps are ours
                continue
            mark = SLOW_PROGRAMS.get(child.name())
            if mark is None:
                with open(f"/proc/{child.pid}/maps", "rb") as f:
                    mark = "tf" if b"tensorflow" in f.read() else None
            if mark:
                found.append(f"{mark}: {child.pid} {' '.join(child.cmdline())[:120]}")
        except (OSError, psutil.Error):
            continue
    return found


@pytest.fixture(autouse=True)
def fast_subset_only_fast(request):
    """A test of the fast subset (no tf, ssh or slurm mark) must start no TensorFlow (seconds
    to import), sshd or Slurm: its descendants are looked at while it runs, every 0.2 s (a
    process that ends sooner can slip by; TensorFlow's import alone takes longer). Those that
    were running before it began (a session's sshd started by an earlier test) are not its own."""
    if any(request.node.get_closest_marker(m) is not None for m in SLOW_MARKS):
        yield
        return
    me, seen, done = psutil.Process(), [], threading.Event()
    old = {p.pid for p in me.children(recursive=True)}

    def watch() -> None:
        while not seen and not done.wait(0.2):
            seen.extend(_slow_processes(me, old))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    yield
    done.set()
    watcher.join()
    if seen:
        pytest.fail(f"started without its mark ({seen[0].split(':')[0]}): {seen[0]}")


@pytest.fixture(autouse=True)
def no_leaked_processes():
    before = set(tagged_processes())
    yield
    deadline = time.monotonic() + 15
    leaked = {}
    while time.monotonic() < deadline:
        leaked = {p: t for p, t in tagged_processes().items() if p not in before}
        if not leaked:
            return
        time.sleep(0.1)
    for pid in leaked:  # clean up so one leak does not cascade into every later test
        try:
            os.killpg(os.getpgid(pid), 9)
        except OSError:
            pass
    pytest.fail(f"processes left running after the test: {leaked}")


@pytest.fixture(autouse=True)
def private_home(tmp_path_factory, monkeypatch):
    """Every test runs with a HOME of its own, `home` or not: what it starts never reads or
    writes the real ~/.tfcluster or ~/.ssh (a test's `local` cluster would otherwise share the
    state, lock and ports of the user's own `tfcluster up sample_clusters/local.yaml`)."""
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An isolated HOME the test can name (its tmp_path's `home`)."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    return h


@pytest.fixture
def deflating(home):
    transport = LocalTransport()
    transport.deflate_logs = True
    a = HostAgent("local", transport, sys.executable, CLUSTER_DIR)
    a.prepare()
    yield a
    a.close()


@pytest.fixture
def agent(home):
    a = HostAgent("local", LocalTransport(), sys.executable, CLUSTER_DIR)
    a.prepare()
    yield a
    a.close()
