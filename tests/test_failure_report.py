"""What `train` says of a task that failed: the heading of the log tail names the log it
shows (a server's is `worker:1.server`, not the script's `worker:1`); a failure with a known
signature is summed up as what happened and its fix, never its last lines. Real processes on
the local host: the servers of the first test are a stand-in (no TensorFlow) that prints a
line and listens; each known failure is produced by a script of tests/scripts."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.helpers import (
    STANDIN,
    kill_tagged_once_seen,
    known_spec,
    start_tfcluster,
    tagged_processes,
    tfcluster,
    wait_for,
)
from tests.tf_launch import free_ports
from tfcluster.diagnose import signatures
from tfcluster.plan.names import log_file

pytestmark = pytest.mark.timeout(90)

TALKING = STANDIN.replace("s = socket.create_server", 'print("standin serving", port, flush=True)\n'
                                                     "s = socket.create_server", 1)
PYWRAP = '''#!/bin/sh
case "$1" in */tfserver.py) exec {python} {standin} "$@";; esac
exec {python} "$@"
'''
SCRIPT = 'import time\nprint("script up", flush=True)\ntime.sleep(60)\n'


def test_a_failed_servers_log_tail_is_headed_with_its_own_name(tmp_path, home):
    assert "standin serving" in TALKING
    (tmp_path / "standin.py").write_text(TALKING)
    wrapper = tmp_path / "pywrap"
    wrapper.write_text(PYWRAP.format(python=sys.executable, standin=tmp_path / "standin.py"))
    wrapper.chmod(0o755)
    (tmp_path / "wait.py").write_text(SCRIPT)
    p = free_ports(3)
    spec = tmp_path / "fail.yaml"
    spec.write_text(f"name: fail\npython: {wrapper}\nhosts:\n  - {{name: a, address: 127.0.0.1}}\n"
                    f"jobs:\n  ps: {{tasks: ['a:{p[0]}']}}\n  worker: {{tasks: ['a:{p[1]}', 'a:{p[2]}']}}\n"
                    "train:\n  mode: between-graph\n  script: wait.py\n")
    proc = start_tfcluster("train", str(spec), home=home, cwd=tmp_path)
    out = kill_tagged_once_seen(proc, r"worker:1 .*script up", ":worker:1:server", wait=60, finish=60)
    assert proc.returncode == 5, out[-3000:]
    assert "worker:1 server on a failed with exit code 137" in out, out[-3000:]
    heading = out.index("last lines of worker:1.server:")
    assert "standin serving" in out[heading:], out[-3000:]
    wait_for(lambda: not tagged_processes(), 15, what="nothing of the run left")


# -- known failures, each produced for real by a script of tests/scripts ---------------------


def known(name: str, script: str, mode: str, jobs: dict[str, int], args: tuple[str, ...] = (), *,
          tf: bool = True, id: str | None = None):
    return pytest.param(script, mode, jobs, list(args), name, id=id or name,
                        marks=[pytest.mark.tf] if tf else [])


KNOWN = [  # the signature each script ends with
    known("keras3-mwms-fit", "keras3_mwms_fit.py", "mirrored", {"worker": 2}),
    known("keras3-pss-fit", "keras3_pss_fit.py", "coordinator", {"chief": 1, "ps": 1, "worker": 1}),
    known("pss-dataset", "pss_dataset_loop.py", "coordinator", {"chief": 1, "ps": 1, "worker": 1}),
    known("keras3-reset-states", "keras3_reset_states.py", "mirrored", {"worker": 1}),
    known("keras3-legacy-optimizer", "legacy_optimizer.py", "mirrored", {"worker": 1}),
    known("keras3-missing-api", "keras3_missing_api.py", "mirrored", {"worker": 1}),
    known("collectives-late", "strategy_late.py", "mirrored", {"worker": 1}),
    known("evaluator-strategy", "evaluator_strategy.py", "mirrored", {"worker": 1, "evaluator": 1}),
    known("evaluator-pss", "evaluator_pss.py", "coordinator", {"chief": 1, "ps": 1, "worker": 1, "evaluator": 1}),
    known("port-bound", "own_server.py", "between-graph", {"ps": 1, "worker": 1}),
    known("port-bound", "own_server.py", "mirrored", {"worker": 1}, ("--strategy",), id="port-bound-mirrored"),
    known("no-tensorflow", "launcher.py", "mirrored", {"worker": 1}, tf=False),
    known("bad-arguments", "strict_args.py", "mirrored", {"worker": 1}, ("--bogus",), tf=False),
]
TENSOR_ROW = re.compile(r"\d\.\d+e[-+]\d\d,")      # a row of a printed tensor


@pytest.mark.timeout(180)          # 5-40 s each here, with other TF runs on the same 2 cores
@pytest.mark.parametrize("script, mode, jobs, args, name", KNOWN)
def test_a_known_failure_is_summed_up_with_what_happened_and_its_fix(tmp_path, home, monkeypatch,
                                                                    script, mode, jobs, args, name):
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)     # tf.keras is Keras 3
    spec = known_spec(tmp_path, script, mode, jobs, args)
    r = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=160)
    assert r.returncode == 5, r.stdout[-2000:] + r.stderr[-2000:]
    sig = next(s for s in signatures.SIGNATURES if s.name == name)
    found = re.search(rf"^(\S+): {re.escape(sig.what)}\n  (.+)\n  its whole log: (\S+)\n", r.stderr, re.MULTILINE)
    assert found, r.stderr[-3000:]
    key, line, log = found.groups()
    assert any(n.decode() in line for n in sig.needles) and len(line) <= signatures.LINE_CHARS, line
    assert f"\nhint: {sig.fix_for(mode)}\n" in r.stderr, r.stderr[-2000:]
    assert Path(tmp_path, log).name == log_file(key)
    assert any(n in Path(tmp_path, log).read_bytes() for n in sig.needles)   # the whole log is kept
    # tfcluster's own lines, the summary's included, are on stderr; the task's live output on stdout
    assert "last lines of" not in r.stderr and not TENSOR_ROW.search(r.stderr), r.stderr[-3000:]
    wait_for(lambda: not tagged_processes(), 15, what="nothing of the run left")


def test_an_unknown_failure_shows_its_last_lines_with_an_endless_line_cut(tmp_path, home):
    (tmp_path / "long.py").write_text('print("x" * 5000)\nprint("the last words", flush=True)\nraise SystemExit(3)\n')
    spec = known_spec(tmp_path, str(tmp_path / "long.py"), "mirrored", {"worker": 1}, [])
    r = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=60)
    assert r.returncode == 5, r.stderr[-2000:]
    tail = r.stderr[r.stderr.index("last lines of worker:0:\n"):r.stderr.index("tfcluster: error:")]
    # the live view's history keeps 4 KiB of a line (watch/logmux.py RING_LINE): the count is a floor
    assert "the last words" in tail and "… (over 4096 characters)" in tail
    assert max(len(line) for line in tail.splitlines()) == signatures.TAIL_LINE_CHARS


def test_a_restarted_task_is_diagnosed_by_its_last_attempt_only(tmp_path, home):
    (tmp_path / "twice.py").write_text(
        "import os, sys\n"
        "if os.environ['TFCLUSTER_RESTART'] == '0':\n"
        "    sys.exit('UnknownError: Could not start gRPC server')\n"
        "sys.exit('the second attempt failed its own way')\n")
    spec = known_spec(tmp_path, str(tmp_path / "twice.py"), "mirrored", {"worker": 1}, [])
    spec.write_text(spec.read_text() + "  restart: {policy: on-failure, max_restarts: 1}\n")
    r = tfcluster("train", str(spec), home=home, cwd=tmp_path, timeout=60)
    assert r.returncode == 5 and "restarting (1/1)" in r.stderr, r.stderr[-2000:]
    assert "could not bind" not in r.stderr, r.stderr[-2000:]
    assert "\nthe second attempt failed its own way\ntfcluster: error: " in r.stderr, r.stderr[-2000:]
