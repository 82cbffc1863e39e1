"""The known-failure table's matching, pure: which signature a failed task's output ends
with, from the end of its saved log; how a quoted line is cut. Each signature is produced for
real, through `train`, in tests/test_failure_report.py."""
from __future__ import annotations

import io

import pytest

from tfcluster.diagnose import signatures as sg
from tfcluster.watch.logmux import LogMux

PORT = b"tensorflow.python.framework.errors_impl.UnknownError: Could not start gRPC server\n"
ARGS = b"train.py: error: unrecognized arguments: --bogus\n"


def test_every_signature_has_a_unique_name_what_and_fix():
    names = [s.name for s in sg.SIGNATURES]
    assert len(names) == len(set(names))
    for s in sg.SIGNATURES:
        assert s.needles and s.what and s.fix and "\n" not in s.what + s.fix, s.name


def test_the_signature_whose_line_comes_last_wins_whatever_the_tables_order():
    assert sg.diagnose("classic", PORT + b"retrying\n" + ARGS).name == "bad-arguments"
    assert sg.diagnose("classic", ARGS + PORT).name == "port-bound"


def test_a_fix_may_depend_on_the_mode():
    port = next(s for s in sg.SIGNATURES if s.name == "port-bound")
    assert "train.mode: classic" in sg.diagnose("between-graph", PORT).fix
    assert sg.diagnose("classic", PORT).fix == port.fix != port.fix_for("mirrored")


def test_the_parameter_server_tutorials_legacy_optimizer_is_told_to_take_tf_keras_first():
    """Under ParameterServerStrategy the tutorial's model.fit fails on Keras 3 after the optimizer
    too: its hint leads with `train.keras: legacy`, not the optimizer's swap."""
    line = b"ImportError: `keras.optimizers.legacy` is not supported in Keras 3.\n"
    assert sg.diagnose("coordinator", line).fix.startswith("set `train.keras: legacy`")
    assert sg.diagnose("mirrored", line).fix.startswith("use the optimizer of the same name")


def test_a_signature_that_needs_more_of_the_tail_does_not_match_without_it():
    line = b"ValueError: To use this dataset, you need to pass this dataset to ClusterCoordinator.create_per_worker_dataset.\n"
    assert sg.diagnose("coordinator", line).name == "pss-dataset"       # not from Keras 3's fit
    keras = b'  File "/venv/lib/python3.11/site-packages/keras/src/trainers/epoch_iterator.py", line 74\n'
    assert sg.diagnose("coordinator", keras + line).name == "keras3-pss-fit"


def test_a_signature_of_one_job_matches_that_jobs_tasks_only():
    tail = b'  File "parameter_server_strategy_v2.py", line 563, in _connect_to_cluster\n' + PORT
    assert sg.diagnose("coordinator", tail, "evaluator").name == "evaluator-pss"
    assert sg.diagnose("coordinator", tail, "chief").name == "port-bound"


def test_the_matched_line_is_quoted_on_one_line_within_its_limit():
    found = sg.diagnose("mirrored", b"x\nValueError: Attempt to convert a value (PerReplica:{\n" + b"1.0 " * 500 +
                        b"\n}) with an unsupported type (<class 'PerReplica'>) to a Tensor.\n")
    assert (found.name, found.line) == ("keras3-mwms-fit", "ValueError: Attempt to convert a value (PerReplica:{")
    long = sg.clip("word " * 100)
    assert len(long) == sg.LINE_CHARS and long.endswith("… (499 characters)") and long.startswith("word word")


def test_only_the_last_attempt_of_a_restarted_task_is_read(tmp_path):
    with LogMux(io.BytesIO(), ["w"], color=False, save_dir=str(tmp_path)) as mux:   # as attempts notes it
        mux.feed("w", PORT)
        mux.note("w", sg.restart_note(1, "1/3"))
        mux.feed("w", ARGS)
    log = (tmp_path / "w.log").read_bytes()
    assert log == PORT + b"[tfcluster] exited with code 1; restarting (1/3)\n" + ARGS
    assert sg.last_attempt(log) == ARGS
    assert sg.diagnose("classic", sg.last_attempt(PORT + b"[tfcluster] exited with code 1; restarting (1/3)\n"
                                                  b"step=5\n")) is None


@pytest.mark.parametrize("size", [10, sg.TAIL_BYTES + 5000])
def test_the_tail_read_is_bounded_and_starts_on_a_whole_line(tmp_path, size):
    log = tmp_path / "w.log"
    log.write_bytes(b"0123456789abcdef\n" * (size // 17 + 1) + ARGS)
    tail = sg.read_tail(str(log))
    assert tail.endswith(ARGS) and len(tail) <= sg.TAIL_BYTES
    assert tail.startswith(b"0123456789abcdef\n")
    assert sg.read_tail(str(tmp_path / "missing.log")) == b""
