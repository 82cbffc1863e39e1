"""The wheel carries the templates: a user who `pip install`s tfcluster (no checkout) can
`tfcluster init` and use `script: template:...`."""
from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.timeout(180)


def test_wheel_installed_in_a_fresh_venv_finds_every_template(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, timeout=120,
                   capture_output=True)
    wheel = next((tmp_path / "dist").glob("tfcluster-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for template in ("between_graph", "classic", "coordinator", "mirrored"):
        assert f"tfcluster/templates/{template}.py" in names
    assert "tfcluster/host/shim.py" in names and "tfcluster/host/tfserver.py" in names
    assert "tfcluster/host/probe/sitecustomize.py" in names
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([venv / "bin" / "pip", "install", "-q", "--no-deps", str(wheel)], check=True,
                   timeout=120, capture_output=True)
    code = ("import importlib.resources as r; "
            "print(sorted(p.name for p in r.files('tfcluster.templates').iterdir() if p.name.endswith('.py')))")
    out = subprocess.run([venv / "bin" / "python", "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "'between_graph.py'" in out.stdout and "'mirrored.py'" in out.stdout
