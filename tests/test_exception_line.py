"""The exception line of a failed task, and the failures named by it: the line Python prints
after the frames of the task's last traceback is always in the summary's excerpt, however
many lines of help its message ends with; TensorFlow's parameter server custom loop under
Keras 3 (a TF function on a Keras input) and tf.estimator on TF 2.16+ are named with their
fix; the tf_keras and TensorFlow refusals print the spec's own path. Real runs of
tests/scripts on the local host; docs/design/diagnoses.md, "Failure signatures"."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import fake_venv, known_spec, tagged_processes, tfcluster, venv_spec, wait_for
from tfcluster.diagnose import signatures
from tfcluster.diagnose.signatures import exception_line, failure_excerpt

pytestmark = [pytest.mark.timeout(120)]

FRAMES = ['  File "train.py", line 9, in <module>', "    main()", '  File "train.py", line 5, in main',
          "    raise ValueError(msg)"]


def traceback(*last: str) -> bytes:
    return "\n".join(["step=1 loss=0.5", "Traceback (most recent call last):", *FRAMES, *last, ""]).encode()


@pytest.mark.parametrize("tail, line", [
    (traceback("ValueError: bad value", "", "help paragraph", "```", "x = Input()"), "ValueError: bad value"),
    (traceback("tensorflow.python.framework.errors_impl.UnavailableError: {{function_node}} gone"),
     "tensorflow.python.framework.errors_impl.UnavailableError: {{function_node}} gone"),
    (traceback("KeyboardInterrupt"), "KeyboardInterrupt"),
    # another thread's unindented line before the exception line: a named class is preferred
    (traceback("E0000 00:00:1.2 123 grpc.cc:1] socket closed", "RuntimeError: the step failed"),
     "RuntimeError: the step failed"),
    (traceback("Oops: a class of the script's own"), "Oops: a class of the script's own"),
    # chained: the last traceback is the one the task ended with
    (traceback("KeyError: 'a'") + b"\nDuring handling of the above exception, another exception occurred:\n\n"
     + traceback("ImportError: second"), "ImportError: second"),
    (b"no traceback at all\nexit 3\n", None),
    (b"Traceback (most recent call last):\n  File \"x.py\", line 1", None),     # cut before its end
])
def test_the_exception_line_is_the_one_after_the_last_tracebacks_frames(tail, line):
    assert exception_line(tail) == line


def test_the_excerpt_shows_the_exception_line_and_how_many_lines_it_leaves_out():
    shown = ["Traceback (most recent call last):", *FRAMES, "ValueError: bad value"] + [f"help {i}" for i in range(20)]
    tail = ("\n".join(shown) + "\n").encode()
    excerpt = failure_excerpt(shown, tail)
    assert len(excerpt) == signatures.EXCERPT_LINES
    assert excerpt[:2] == ["ValueError: bad value", "… 7 lines …"]     # help 0..6
    assert excerpt[2:] == [f"help {i}" for i in range(7, 20)]
    near = shown[:-15]                              # the exception line among the last lines: as it was
    assert failure_excerpt(near, ("\n".join(near) + "\n").encode()) == near[-15:]
    assert failure_excerpt(["a", "b"], b"a\nb\n") == ["a", "b"]


def test_a_failure_that_ends_in_help_text_shows_its_exception_line(tmp_path, home):
    spec = known_spec(tmp_path, "long_failure.py", "mirrored", {"worker": 1}, [])
    r = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=100)
    assert r.returncode == 5, r.stderr[-2000:]
    excerpt = r.stderr[r.stderr.index("last lines of worker:0:\n"):r.stderr.index("tfcluster: error:")].splitlines()
    assert excerpt[1:3] == ["ValueError: the deep call failed", "… 7 lines …"], excerpt
    assert "help line 13" in excerpt and len(excerpt) <= 1 + signatures.EXCERPT_LINES   # the last lines too
    wait_for(lambda: not tagged_processes(), 15, what="nothing of the run left")


def failed_with(r, name: str, mode: str) -> str:
    sig = next(s for s in signatures.SIGNATURES if s.name == name)
    found = re.search(rf"^(\S+): {re.escape(sig.what)}\n  (.+)\n  its whole log: (\S+)\n", r.stderr, re.MULTILINE)
    assert found, r.stderr[-3000:]
    assert f"\nhint: {sig.fix_for(mode)}\n" in r.stderr, r.stderr[-2000:]
    return found.group(2)


@pytest.mark.tf
@pytest.mark.timeout(180)
def test_the_parameter_server_custom_loop_under_keras_3_is_named_with_its_fix(tmp_path, home, monkeypatch):
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    spec = known_spec(tmp_path, "ps_loop_keras3.py", "coordinator", {"chief": 1, "ps": 1, "worker": 1}, [])
    r = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=160)
    assert r.returncode == 5, r.stdout[-2000:] + r.stderr[-2000:]
    # before the run: the line that will fail, though the script has no .fit(
    assert re.search(r"tfcluster: warning: Keras 3\.\d+ on a: the script uses what only Keras 2 has: "
                     r"ps_loop_keras3\.py:10: tf\.reduce_mean on a Keras input", r.stderr), r.stderr[-3000:]
    line = failed_with(r, "keras3-tf-op-on-input", "coordinator")
    assert line.startswith("ValueError: A KerasTensor cannot be used as input to a TensorFlow function")
    assert "keras.ops.mean" in r.stderr and "last lines of" not in r.stderr
    wait_for(lambda: not tagged_processes(), 15, what="nothing of the run left")


@pytest.mark.tf
@pytest.mark.timeout(180)
def test_the_estimator_tutorial_is_named_as_removed_from_tensorflow(tmp_path, home):
    spec = known_spec(tmp_path, "tf_estimator.py", "mirrored", {"worker": 1}, [])
    r = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=160)
    assert r.returncode == 5, r.stderr[-2000:]
    assert failed_with(r, "tf-estimator-removed", "mirrored") == \
        "AttributeError: module 'tensorflow' has no attribute 'estimator'"
    wait_for(lambda: not tagged_processes(), 15, what="nothing of the run left")


def test_the_tf_keras_refusal_names_the_spec_it_was_given(tmp_path, home):
    python = fake_venv(tmp_path / "v", tensorflow="2.21.0", keras="3.15.0")
    spec = venv_spec(tmp_path, python, keras="legacy")
    r = tfcluster("plan", spec.name, "--check", home=home, cwd=tmp_path, timeout=90)
    assert r.returncode == 4, r.stderr
    assert f"hint: install it there: `tfcluster exec {spec.name} --hosts local -- {python} -m pip" in r.stderr
    assert "SPEC" not in r.stderr
    assert Path(tmp_path, spec.name).is_file()
