"""The pure layers: run policy, naming and the shim protocol, tested by tables (no TF, no I/O)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tfcluster.host import shim_protocol as proto
from tfcluster.plan import names, policy
from tfcluster.plan.policy import ScriptState
from tfcluster.spec import Restart


@pytest.mark.parametrize("restart, rc, done, expected", [
    (Restart("never", 3), 1, 0, False),
    (Restart("never", 3), 137, 0, False),
    (Restart("on-failure", 3), 1, 0, True),
    (Restart("on-failure", 3), 1, 2, True),
    (Restart("on-failure", 3), 1, 3, False),        # out of restarts
    (Restart("on-failure", 0), 137, 0, False),
    (Restart("exit-code", 3), 1, 0, False),         # the script's own error: no restart fixes it
    (Restart("exit-code", 3), 127, 0, False),
    (Restart("exit-code", 3), 128, 0, True),
    (Restart("exit-code", 3), 137, 0, True),        # SIGKILL (OOM killer, a lost host)
    (Restart("exit-code", 3), 255, 0, True),        # a dropped connection
    (Restart("exit-code", 3), 143, 3, False),
])
def test_should_restart_follows_the_policy_table(restart, rc, done, expected):
    assert policy.should_restart(restart, rc, done) is expected


W = "worker"


@pytest.mark.parametrize("mode, scripts, expected", [
    # between-graph / coordinator: the chief decides, once the others have ended
    ("between-graph", [ScriptState(W, True, 0), ScriptState(W, False, 0)], True),
    ("between-graph", [ScriptState(W, True, 0), ScriptState(W, False, None)], False),
    ("between-graph", [ScriptState(W, True, 0), ScriptState(W, False, 1)], True),
    ("between-graph", [ScriptState(W, True, None), ScriptState(W, False, 0)], False),
    ("between-graph", [ScriptState(W, True, 1), ScriptState(W, False, 0)], False),
    # an evaluator evaluates the chief's last checkpoint after the chief ends (PEER_GRACE bounds it)
    ("coordinator", [ScriptState("chief", True, 0), ScriptState("evaluator", False, None)], False),
    ("coordinator", [ScriptState("chief", True, 0), ScriptState("evaluator", False, 0)], True),
    # mirrored / classic: every chief and worker must succeed; ps and evaluators do not count
    ("mirrored", [ScriptState(W, True, 0), ScriptState(W, False, 0)], True),
    ("mirrored", [ScriptState(W, True, 0), ScriptState(W, False, 2)], False),
    ("classic", [ScriptState("ps", False, None), ScriptState(W, True, 0), ScriptState(W, False, 0)], True),
    ("classic", [ScriptState("ps", False, None), ScriptState(W, True, 0), ScriptState(W, False, None)], False),
])
def test_run_succeeded_table(mode, scripts, expected):
    assert policy.run_succeeded(mode, scripts) is expected


@pytest.mark.parametrize("mode, chief, rc, expected", [
    ("between-graph", True, 0, True), ("coordinator", True, 0, True),
    ("between-graph", False, 0, False), ("between-graph", True, 1, False),
    ("mirrored", True, 0, False), ("classic", True, 0, False),
])
def test_only_a_successful_chief_in_chief_modes_starts_the_peer_grace(mode, chief, rc, expected):
    assert policy.starts_peer_grace(mode, chief, rc) is expected


@pytest.mark.parametrize("stopping,rc,expected", [
    (True, 143, True), (True, 137, True),      # SIGTERM (or the templates' exit after saving), the KILL
    (True, 1, False),                          # failing already when the stop came: its own failure
    (True, 0, False), (True, None, False),     # done; still running
    (False, 143, False),                       # killed by someone else: no stop of the run's
])
def test_an_end_is_the_stops_only_by_a_signal_while_stopping(stopping, rc, expected):
    assert policy.ended_by_stop(stopping, rc) is expected


def test_a_process_failing_when_the_stop_came_shows_its_exit_code_in_the_footer():
    from types import SimpleNamespace

    from tfcluster.watch.footer import task_state
    proc = SimpleNamespace(exit_code=1, ended=1.0, stopping=True, role="script", restarts=0)
    assert task_state(proc, 3, True) == "failed (exit 1)"
    assert task_state(SimpleNamespace(**{**vars(proc), "exit_code": 143}), 3, True) == "stopped"


def test_restart_hints_say_what_to_change():
    assert "policy: on-failure" in policy.restart_hint(Restart("never", 3), 0, 137)
    assert "policy: on-failure" in policy.restart_hint(Restart("never", 3), 0, 255)   # connection lost
    for permanent in (1, 2, 127):    # the script's own failure: a restart cannot fix it
        assert policy.restart_hint(Restart("never", 3), 0, permanent) is None
    assert policy.restart_hint(Restart("on-failure", 3), 3, 1) == \
        "it failed 4 times (train.restart.max_restarts = 3)"
    assert policy.restart_hint(Restart("exit-code", 3), 0, 1) is None


def test_a_runs_stop_takes_the_training_scripts_before_what_serves_their_variables():
    assert policy.stop_wave("script", "worker") == policy.stop_wave("script", "chief") == 0
    # a server, and the ps's own script in classic mode (it is the server), after them
    assert policy.stop_wave("server", "ps") == policy.stop_wave("server", "worker") == 1
    assert policy.stop_wave("script", "ps") == 1
    assert policy.STOP_WAVES == (0, 1)


@pytest.mark.parametrize("tag", [
    names.Tag("lab", "up-20261123-010203-ab12", "worker", 3, "server"),
    names.Tag("my.cluster-1", "my.cluster-1-20261123-010203-00ff", "chief", 0, "script"),
])
def test_tags_round_trip_and_their_prefixes_select_cluster_and_run(tag):
    text = str(tag)
    assert names.Tag.parse(text) == tag
    assert text.startswith(names.cluster_prefix(tag.cluster))
    assert text.startswith(names.run_prefix(tag.cluster, tag.run))
    assert not text.startswith(names.cluster_prefix(tag.cluster + "x"))
    assert tag.key == f"{tag.job}:{tag.index}"


@pytest.mark.parametrize("text", ["", "a:b:c", "a:b:worker:x:server", "a:b:worker:1:bogus",
                                  "a:b:worker:1:server:extra"])
def test_malformed_tags_do_not_parse(text):
    assert names.Tag.parse(text) is None


def test_run_ids_sort_by_time_and_log_names_map_back_to_task_keys():
    early = names.new_run_id("lab", now=1_000_000_000, token="ffff")
    late = names.new_run_id("lab", now=1_000_000_060, token="0000")
    assert early < late and early.startswith("lab-") and early.endswith("-ffff")
    assert names.log_name("worker:12") == "worker-12.log"
    assert names.log_name("worker:12", "server") == "worker-12.server.log"
    assert names.log_file(names.mux_key("ps:0", "server", True)) == "ps-0.server.log"
    assert names.log_file(names.mux_key("ps:0", "server", False)) == "ps-0.log"
    for key in ("worker:12", "chief:0", "evaluator:3"):
        assert names.key_of_log(names.log_name(key)) == key
    assert names.key_of_log("worker-1.server.log") is None
    assert names.key_of_log("manifest.json") is None
    paths = names.ClusterPaths("~/.tfcluster/lab")
    tag = names.Tag("lab", "r", "ps", 0, "server")
    assert paths.pidfile(tag) == "~/.tfcluster/lab/pids/lab_r_ps_0_server.pid"
    assert paths.log("r", "ps:0", "server") == "~/.tfcluster/lab/runs/r/ps-0.server.log"


def test_the_error_envelope_round_trips_and_nothing_else_is_an_error():
    answer = proto.error_answer("no such log: x")
    assert proto.error_of(json.loads(json.dumps(answer))) == "no such log: x"
    for ok in ({"text": "hi"}, [], {"stopped": []}, None, "error"):
        assert proto.error_of(ok) is None
    assert proto.describe_exception(proto.ShimError("plain")) == "plain"
    assert proto.describe_exception(KeyError("ports")) == "KeyError: 'ports'"


def test_in_process_commands_are_only_one_shot_ones():
    # start (attached) ends the process and wait/launch write to fd 1: never in-process
    assert not {proto.START, proto.WAIT, proto.LAUNCH} & set(proto.IN_PROCESS)
    assert set(proto.BATCHABLE) <= set(proto.ONE_SHOT)


def test_batch_answers_are_keyed_by_command_with_an_envelope_for_a_failed_one(tmp_path):
    request = {"commands": {proto.PORTS: {"ports": []},
                            proto.TAIL: {"path": str(tmp_path / "missing.log")}}}
    result = subprocess.run([sys.executable, "-m", "tfcluster.host.shim", proto.BATCH],
                            input=json.dumps(request) + "\n", capture_output=True, text=True, timeout=30)
    answers = json.loads(result.stdout)["answers"]
    assert answers[proto.PORTS] == {}
    assert proto.error_of(answers[proto.TAIL]).startswith("no such log")


def test_the_shim_refuses_to_batch_a_streaming_command():
    request = {"commands": {proto.WAIT: {"items": []}}}
    result = subprocess.run([sys.executable, "-m", "tfcluster.host.shim", proto.BATCH],
                            input=json.dumps(request) + "\n", capture_output=True, text=True, timeout=30)
    assert result.returncode == proto.EXIT_ERROR
    assert proto.error_of(json.loads(result.stdout)) == "not batchable: wait"


# -- a lost host ---------------------------------------------------------------------------

W, CHIEF_W, PS, CHIEF = (policy.LostTask("worker", False), policy.LostTask("worker", True),
                         policy.LostTask("ps", False), policy.LostTask("chief", True))


@pytest.mark.parametrize("mode,choice,lost,spare,action", [
    # a plain worker at a new address: its ps still dials the old one, so every task again
    ("between-graph", "spare", [W], True, policy.RESTART),
    ("classic", "spare", [W], True, policy.RESTART),
    # the strategies fix their cluster at the start: every task again
    ("coordinator", "spare", [W], True, policy.RESTART),
    ("mirrored", "spare", [W], True, policy.RESTART),
    # a ps or a chief: every task again, from the checkpoint
    ("between-graph", "spare", [PS], True, policy.RESTART),
    ("between-graph", "spare", [CHIEF_W], True, policy.RESTART),
    ("coordinator", "spare", [CHIEF], True, policy.RESTART),
    ("between-graph", "spare", [W, PS], True, policy.RESTART),
    # shrink: on without plain workers where the chief ends the run; a spare still takes the rest
    ("between-graph", "shrink", [W], False, policy.SHRINK),
    ("coordinator", "shrink", [W], True, policy.SHRINK),
    ("between-graph", "shrink", [PS], True, policy.RESTART),
    ("between-graph", "shrink", [PS], False, policy.FAIL),
    ("classic", "shrink", [W], False, policy.FAIL),
    ("mirrored", "shrink", [W], False, policy.FAIL),
    ("mirrored", "shrink", [W], True, policy.RESTART),
    # no spare left, or fail asked for
    ("between-graph", "spare", [W], False, policy.FAIL),
    ("between-graph", "fail", [W], True, policy.FAIL),
    # a spare that held nothing
    ("mirrored", "spare", [], False, policy.SHRINK),
])
def test_what_a_lost_host_does(mode, choice, lost, spare, action):
    got, why = policy.on_host_loss(mode, choice, lost, spare)
    assert got == action, why
    assert why


def test_a_lost_host_that_cannot_be_recovered_says_why():
    assert policy.on_host_loss("classic", "shrink", [W], False)[1] == \
        "classic mode needs every worker to finish, so it cannot shrink"
    assert policy.on_host_loss("between-graph", "spare", [PS], False)[1] == "no spare host (or none left) can take a ps task"
    assert policy.on_host_loss("coordinator", "spare", [CHIEF], True)[1] == \
        "the chief is gone"


def test_a_moves_line_says_what_happened_an_interrupted_one_no_restart_it_never_made():
    """The summary's `moved:` line: a move the run ended during (Ctrl-C, a failure) before its
    tasks started on the spare says so, not "every task restarted from ..."."""
    from tfcluster.launch.run.moves import Move

    move = Move("h4", "lost: connection dropped", policy.RESTART, "a ps dials each worker", ("worker:1",),
                at=0.0, step_at=120, spare="h5")
    assert move.line().endswith("h4 lost: connection dropped: moving worker:1 to h5; the run ended before "
                                "they started there")
    move.done_at, move.checkpoint, move.resumed = 1.0, "model.ckpt-100", 100
    assert move.line().endswith("worker:1 moved to h5, every task restarted from model.ckpt-100; resumed at "
                                "step 100, 20 step(s) lost")
