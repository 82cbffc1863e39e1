"""The shim runs under `python -S` (bootstrap.NO_SITE): `info` must still find TensorFlow
and TensorBoard where `site` would have put them. Real interpreters: this one, and venvs
made here with `python -m venv` (a fake `tensorflow` dist-info tells them apart)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import other_pythons
from tfcluster.host import shim_facts
from tfcluster.launch.agent.bootstrap import NO_SITE

SHIM = str(Path(shim_facts.__file__).with_name("shim.py"))
KEYS = ("tf_version", "tensorboard_version", "cuda_version", "cudnn_version", "python_version",
        "keras_version", "tf_keras_version")

pytestmark = [pytest.mark.timeout(120)]


def info(python: str, *flags: str) -> dict:
    done = subprocess.run([python, *flags, SHIM, "info"], input="{}\n", capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    answer = json.loads(done.stdout.splitlines()[-1])
    return {k: answer[k] for k in KEYS}


def venv(path: Path, system: bool = False, base: str = sys.executable) -> tuple[str, Path]:
    """A venv of `base` (no pip: nothing is downloaded); its python and its site-packages."""
    argv = [base, "-m", "venv", "--without-pip", str(path)]
    subprocess.run(argv + (["--system-site-packages"] if system else []), check=True, timeout=60)
    python = str(path / "bin" / "python")
    site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    return python, Path(site)


def base_python(venv_dir: Path) -> str:
    """The interpreter a venv was made from, as its pyvenv.cfg says (`home`: its directory)."""
    cfg = dict(line.split(" = ", 1) for line in (venv_dir / "pyvenv.cfg").read_text().splitlines() if " = " in line)
    return str(Path(cfg["home"]) / f"python{sys.version_info.major}.{sys.version_info.minor}")


def fake_dist(where: Path, name: str, version: str) -> None:
    info = where / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_info_under_dash_s_answers_as_with_site():
    with_site = info(sys.executable)
    assert with_site["tf_version"]                      # this machine's TensorFlow (the CPU wheel)
    assert info(sys.executable, NO_SITE) == with_site


def another_python() -> str:
    """Another interpreter than this one, the system's own python3 first: Debian's and Ubuntu's
    patch `site`, and their venvs are where most GPU boxes keep TensorFlow. Where the tests run
    on that one (CI makes its venv from it), the case above covers it: then another, such as
    pyenv's."""
    found = [exe for minor, exe in other_pythons() if minor >= 8]
    if not found:
        pytest.skip("no Python (>= 3.8) on this machine but the one the tests run on")
    return found[0]


@pytest.mark.parametrize("base", ["this", "another"])
def test_a_venvs_own_tensorflow_is_found_not_the_base_interpreters(tmp_path, base):
    python, site = venv(tmp_path / "v", base=sys.executable if base == "this" else another_python())
    fake_dist(site, "tensorflow", "9.8.7")
    ran = tmp_path / "pth-ran"      # a .pth line that imports runs: it shows whether `site` ran
    (site / "probe.pth").write_text(f"import os; open({str(ran)!r}, 'w').close()\n")
    assert info(python, NO_SITE)["tf_version"] == "9.8.7"
    assert not ran.exists()         # found without running `site` (the point of -S)
    assert info(python)["tf_version"] == "9.8.7" and ran.exists()


def test_a_venv_with_system_site_packages_sees_the_base_tensorflow(tmp_path):
    python, _ = venv(tmp_path / "v", system=True)
    # a venv's system site-packages are those of the interpreter its pyvenv.cfg names as
    # home: this one, or, when the tests themselves run in a venv, that venv's base
    base = info(base_python(tmp_path / "v"))["tf_version"]
    assert info(python, NO_SITE)["tf_version"] == info(python)["tf_version"] == base


def test_a_venv_without_them_has_no_tensorflow(tmp_path):
    python, _ = venv(tmp_path / "v")
    assert info(python, NO_SITE)["tf_version"] is None and info(python)["tf_version"] is None
    assert info(python, NO_SITE)["keras_version"] is info(python, NO_SITE)["tf_keras_version"] is None


def test_keras_and_tf_keras_are_read_from_their_metadata_never_imported(tmp_path):
    python, site = venv(tmp_path / "v")
    fake_dist(site, "tensorflow", "2.21.0")
    fake_dist(site, "keras", "3.15.0")
    fake_dist(site, "tf_keras", "2.21.0")
    for package in ("keras", "tf_keras"):        # importing either would fail
        (site / package).mkdir()
        (site / package / "__init__.py").write_text("raise ImportError('imported')\n")
    answer = info(python, NO_SITE)
    assert (answer["keras_version"], answer["tf_keras_version"]) == ("3.15.0", "2.21.0")


def test_tensorflow_put_on_the_path_by_a_pth_file_is_found(tmp_path):
    python, site = venv(tmp_path / "v")
    elsewhere = tmp_path / "elsewhere"
    fake_dist(elsewhere, "tensorflow_cpu", "7.6.5")
    (site / "extra.pth").write_text(f"{elsewhere}\n")   # only `site` reads it: full_site()
    assert info(python, NO_SITE)["tf_version"] == info(python)["tf_version"] == "7.6.5"


def test_a_python_wrapper_that_adds_its_own_dash_s_gets_no_site_dirs(tmp_path):
    """`python:` may be a wrapper running every task without `site`: then `info` must not
    report what only `site` would have found (the tasks could not import it)."""
    wrapper = tmp_path / "python-without-site"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    wrapper.chmod(0o755)
    assert info(str(wrapper), NO_SITE)["tensorboard_version"] is None
    assert info(str(wrapper), NO_SITE)["tf_version"] is None
    assert info(sys.executable, NO_SITE)["tensorboard_version"] is not None    # ours alone
