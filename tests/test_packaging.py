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
    # a fresh venv with nothing in it, the wheel installed there by this pip (`--python`): a pip
    # of its own (ensurepip) doubled the test's CPU, the largest of the fast subset's
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--disable-pip-version-check", str(wheel)], check=True, timeout=120,
                   capture_output=True)
    code = ("import importlib.resources as r; "
            "print(sorted(p.name for p in r.files('tfcluster.templates').iterdir() if p.name.endswith('.py')))")
    out = subprocess.run([venv / "bin" / "python", "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "'between_graph.py'" in out.stdout and "'mirrored.py'" in out.stdout
