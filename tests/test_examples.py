"""examples/ holds gpu_lab.yaml rendered for both engines; it must be what render writes now."""
from __future__ import annotations

import os

import pytest

from tests.helpers import GPU_LAB, ROOT, tfc

EXAMPLES = os.path.join(ROOT, "examples", "gpu_lab")
COMMANDS = {
    "lab-tfjob.yaml": ("--to", "tfjob", "--image", "tensorflow/tensorflow:2.15.0-gpu"),
    "lab.sbatch": ("--to", "slurm"),
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_checked_in_example_is_what_render_writes(name, tmp_path):
    result = tfc("render", GPU_LAB, *COMMANDS[name], "-o", str(tmp_path))
    assert result.returncode == 0, result.stderr
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as f:
        checked_in = f.read()
    assert (tmp_path / name).read_text(encoding="utf-8") == checked_in, (
        f"examples/gpu_lab/{name} is stale: re-run the command in examples/README.md")


def test_every_example_file_has_its_command():
    assert sorted(os.listdir(EXAMPLES)) == sorted(COMMANDS)
