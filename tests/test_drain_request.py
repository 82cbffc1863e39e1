"""`drain`'s side of a drain (launch/run/drains.py `request`): who holds the cluster's lock,
read from LockedError's fields rather than the lock file's prose, the request left, and the
answers said and turned into exit codes. A `train` is played by holding its lock here."""
from __future__ import annotations

import fcntl
import os
import threading

import pytest

from tests.helpers import SaidUi
from tfcluster.errors import ExitCode, LockedError, TfclusterError
from tfcluster.launch.cluster import state
from tfcluster.launch.run import drains
from tfcluster.plan import build_plan
from tfcluster.spec import load_spec

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def plan(home, tmp_path):
    spec = tmp_path / "d.yaml"
    spec.write_text("name: dq\nhosts:\n  - {name: a, address: localhost}\n"
                    "jobs:\n  worker: {count: 1, hosts: [a], port: 23999}\ntrain:\n  mode: mirrored\n"
                    "  script: template:mirrored\n")
    return build_plan(load_spec(str(spec)))


def test_a_busy_lock_names_its_holders_pid_and_command(plan):
    with state.lock(plan, "train"):
        with pytest.raises(LockedError) as busy:
            with state.lock(plan, "drain"):
                pass
    assert (busy.value.holder_pid, busy.value.holder_command) == (os.getpid(), "train")
    assert busy.value.message == f"cluster 'dq' (workdir ~/.tfcluster) is busy: pid {os.getpid()} running `tfcluster train`"


def test_a_holder_that_wrote_nothing_yet_has_no_pid_or_command(plan):
    path = os.path.join(state.state_dir(state.key(plan)), "lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(LockedError) as busy:
            with state.lock(plan, "drain"):
                pass
    finally:
        os.close(fd)
    assert (busy.value.holder_pid, busy.value.holder_command) == (None, None)
    assert busy.value.message.endswith("is busy: another tfcluster")
    assert state.holder_of("pid 12 running `tfcluster up`") == (12, "up")
    assert state.holder_of("pid 12 running tfcluster up") == (None, None)


@pytest.mark.parametrize("holder", [None, "up", "down"])
def test_without_a_train_holding_the_lock_nothing_is_asked(plan, holder):
    ui = SaidUi()
    if holder is None:
        with pytest.raises(TfclusterError) as nothing:
            drains.request(plan, "a", 0, ui)
    else:
        with state.lock(plan, holder), pytest.raises(TfclusterError) as nothing:
            drains.request(plan, "a", 0, ui)
    assert nothing.value.exit_code == ExitCode.ERROR
    assert nothing.value.message == "no `tfcluster train` of cluster 'dq' is running: nothing to drain"
    assert not ui.lines
    assert not any(n.startswith(drains.REQUEST) for n in os.listdir(state.state_dir(state.key(plan))))


def answer_later(plan, *answers: tuple[str, str]) -> threading.Thread:
    """The running train's side: each answer for host a, 0.2 s apart."""
    def write() -> None:
        for how, line in answers:
            threading.Event().wait(0.2)
            drains._answer(plan, "a", how, line)
    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("last,code", [(drains.MOVED, ExitCode.OK), (drains.FAILED, ExitCode.ERROR)])
def test_each_new_answer_is_said_once_and_the_last_one_gives_the_exit_code(plan, last, code):
    ui = SaidUi()
    with state.lock(plan, "train"):
        thread = answer_later(plan, (drains.DRAINING, "moving worker:0"), (drains.DRAINING, "moving worker:0"),
                              (last, "it went so"))
        assert drains.request(plan, "a", 30, ui) == code
        thread.join()
        assert os.path.exists(os.path.join(state.state_dir(state.key(plan)), drains.REQUEST + "a"))
    assert ui.lines == ["info asked the running train to drain a", "info a: draining: moving worker:0",
                        f"info a: {last}: it went so"]


def test_no_answer_within_wait_is_a_timeout_and_wait_0_only_asks(plan):
    ui = SaidUi()
    with state.lock(plan, "train"):
        assert drains.request(plan, "a", 0.6, ui) == ExitCode.TIMEOUT
        assert ui.lines == ["info asked the running train to drain a",
                            "warn a: not moved after 0.6s; the run goes on with the drain asked"]
        ui.lines.clear()
        assert drains.request(plan, "a", 0, ui) == ExitCode.OK
        assert ui.lines == ["info asked the running train to drain a"]


def test_a_train_that_ends_before_the_move_ends_the_wait_and_status_says_no_drain(plan, home, tmp_path):
    """The train ended (done, Ctrl-C) with the drain asked and answered only `draining`: the
    wait ends within a look or two at the lock (exit 1, said), not at --wait; and the answers
    file, which outlives the train, is no drain under way for `status`."""
    from tests.helpers import tfcluster
    ui = SaidUi()
    holding = state.lock(plan, "train")
    holding.__enter__()
    drains._answer(plan, "a", drains.DRAINING, "moving worker:0")
    shown = tfcluster("status", plan.spec_path, home=home, cwd=tmp_path, timeout=60)
    assert "a: draining (moving worker:0)" in shown.stderr, shown.stderr     # while the train runs
    ended = threading.Timer(0.5, holding.__exit__, (None, None, None))
    ended.start()
    assert drains.request(plan, "a", 30, ui) == ExitCode.ERROR
    ended.join()
    assert ui.lines[-1] == "warn a: the train ended before it moved a's tasks; nothing of it runs now", ui.lines
    assert drains.running(plan) is None and drains.answers(plan)["a"]["state"] == drains.DRAINING
    shown = tfcluster("status", plan.spec_path, home=home, cwd=tmp_path, timeout=60)
    assert shown.returncode == 0 and "draining" not in shown.stderr, shown.stderr
