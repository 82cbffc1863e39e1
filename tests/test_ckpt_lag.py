"""The newest checkpoint kept here against the run's step (launch/run/ckptlag.py): the rule,
the words, and a real run whose script saves once and then steps on, told once while it
runs."""
from __future__ import annotations

import json
import subprocess
import sys

from tfcluster.launch.run import ckptlag
from tests.helpers import cli_env, local_spec


def test_the_threshold_is_a_thousand_steps_or_five_minutes_of_training():
    assert ckptlag.allowed(None) == 1000 and ckptlag.allowed(2.0) == 1000     # 600 steps in 5 min
    assert ckptlag.allowed(11.0) == 3300                                       # a TF1 trainer's pace
    assert not ckptlag.lagging(ckptlag.Lag("model.ckpt-0", 0, 1000, None))
    assert ckptlag.lagging(ckptlag.Lag("model.ckpt-0", 0, 1001, None))
    assert not ckptlag.lagging(ckptlag.Lag("model.ckpt-0", 0, 3300, 11.0))
    assert ckptlag.lagging(ckptlag.Lag("model.ckpt-0", 0, 3400, 11.0))
    assert not ckptlag.lagging(ckptlag.Lag("model.ckpt-9000", 9000, 8000, 11.0))   # restored: behind it


def test_the_warning_names_both_steps_the_cost_and_the_fix():
    text = ckptlag.warning(ckptlag.Lag("model.ckpt-0", 0, 6800, 11.0), 120.0)
    assert text.startswith("checkpoints lag: newest checkpoint kept here: model.ckpt-0 (step 0), current step 6,800: "
                           "6,800 steps, about ")
    assert "MonitoredTrainingSession saves every 600 s" in text and "save_checkpoint_secs" in text
    assert "train.checkpoint.sync copies it every 2m00s" in text
    assert "no checkpoint kept here yet" in ckptlag.warning(ckptlag.Lag(None, 0, 5000, None), None)


def test_a_move_says_what_its_restore_costs():
    assert ckptlag.restore_cost("model.ckpt-0", 6800) == (
        "restoring from model.ckpt-0 (step 0): the run was at step 6,800, 6,800 step(s) will be done again")
    assert ckptlag.restore_cost(None, 500) == (
        "restoring from step 0 (no checkpoint kept here): the run was at step 500, 500 step(s) will be done again")
    assert ckptlag.restore_cost("ckpt-7", None) is None
    # saved as the tasks stopped, after the last step a script printed: nothing is lost
    assert ckptlag.restore_cost("model.ckpt-34", 4) == "restoring from model.ckpt-34 (step 34): the newest step, none will be done again"
    assert ckptlag.restore_cost("best", 40) == "restoring best (its step unknown); the run was at step 40"


# a script that saves a (TF-shaped) checkpoint at step 0 and then only steps, as TF's trainer
# on MonitoredTrainingSession's defaults does for its first 10 minutes
SAVES_ONCE = """\
import os, sys, time
ckpt = sys.argv[sys.argv.index("--ckpt") + 1]
os.makedirs(ckpt, exist_ok=True)
for name, data in (("model.ckpt-0.data-00000-of-00001", b"w" * 64), ("model.ckpt-0.index", b"i" * 16)):
    with open(os.path.join(ckpt, name), "wb") as f:
        f.write(data)
with open(os.path.join(ckpt, "checkpoint"), "w") as f:
    f.write('model_checkpoint_path: "model.ckpt-0"\\n')
start, step = time.time(), 0
while time.time() - start < 5:
    step += 1
    print(f"step={step} loss=0.5", flush=True)
    time.sleep(0.005)
"""


def test_a_run_whose_checkpoint_stays_at_step_0_is_told_once_while_it_runs(tmp_path, home):
    (tmp_path / "saves_once.py").write_text(SAVES_ONCE)
    ckpt = tmp_path / "ckpt"           # absolute: the script's own directory, as a hard-coded one is
    spec = local_spec(tmp_path, mode="mirrored", script="saves_once.py", ps=0, workers=1, name="lag",
                      args=["--ckpt", str(ckpt)], extra=f"  checkpoint: {{dir: '{ckpt}', sync: 1s}}\n")
    # the thresholds scaled down: 5 minutes of steps would take this test 5 minutes
    code = ("import sys; from tfcluster.launch.run import ckptlag; ckptlag.LAG_STEPS = 50; "
            "ckptlag.LAG_SECONDS = 0.5; from tfcluster.cli import main; "
            f"sys.exit(main(['train', {str(spec)!r}]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                            env=cli_env(home), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "checkpoints lag:" in line]
    assert len(said) == 1, result.stderr[-3000:]
    assert "newest checkpoint kept here: model.ckpt-0 (step 0), current step " in said[0]
    current = int(said[0].split("current step ")[1].split(":")[0].replace(",", ""))
    final = json.loads((next((tmp_path / "runs").iterdir()) / "manifest.json").read_text())
    assert 50 < current < final["progress"]["worker:0"]["step"]     # said while it ran, not at the end
