"""Version skew across hosts: the pure comparison, the shim's `info`
(TF's CUDA/cuDNN build read without importing TF, the driver from nvidia-smi), and the
CLI failing for real on three SSH hosts where host b's interpreter sees another
TensorFlow (a fake one first on its path) or is another Python minor version."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import jax_python, other_pythons, state_path, tagged_processes, tfcluster
from tests.tf_launch import free_ports
from tfcluster.diagnose.versions import find_skew, find_skews, message, odd_fields
from tfcluster.host.shim_facts import _build_info, tf_version
from tfcluster.launch.agent.agent import HostInfo
from tfcluster.launch.cluster.preflight import jax_cuda_extra

SHIM = Path(__file__).resolve().parent.parent / "tfcluster" / "host" / "shim.py"
FAKE_TF = "2.12.0"
FAKE_SMI = """#!/bin/sh
[ "$*" = "--query-gpu=driver_version --format=csv,noheader" ] || exit 1
echo 535.104.05
echo 535.104.05
"""
# The spec's one `python:` for every host; on host b (the sshd's 127.0.0.3) it is another
# interpreter, or sees a fake TensorFlow first on its path, and a fake nvidia-smi.
WRAPPER = """#!/bin/sh
case " $SSH_CONNECTION " in
  *" 127.0.0.3 "*) export PATH="{fakes}/bin:$PATH" {pythonpath}; exec {odd} "$@" ;;
esac
exec {python} "$@"
"""


def info(python: str = "3.11.7", tf: str | None = "2.21.0") -> HostInfo:
    return HostInfo(python_version=python, tf_version=tf, machine_id="", gpus=0)


# -- the comparison ------------------------------------------------------------------------

def test_the_majority_is_the_reference_and_the_odd_host_is_named_with_both_versions():
    skews = find_skews({"c": info(), "b": info(tf="2.12.0"), "a": info()})
    assert message(skews) == "TensorFlow differs across hosts: b has 2.12.0, a and c have 2.21.0"
    assert odd_fields(skews) == {"b": ["tensorflow"]}


def test_on_a_tie_the_first_host_alphabetically_is_the_reference():
    assert find_skew("TensorFlow", {"b": "2.21.0", "a": "2.20.1"}).odd == {"b": "2.21.0"}
    assert find_skew("TensorFlow", {"b": "2.20.1", "a": "2.21.0"}).odd == {"b": "2.20.1"}
    # two against two: the group holding `a` wins, whatever the order given
    skew = find_skew("Python", {"d": "3.12.1", "a": "3.11.7", "c": "3.12.0", "b": "3.11.2"})
    assert skew.odd == {"c": "3.12.0", "d": "3.12.1"} and skew.usual == {"a": "3.11.7", "b": "3.11.2"}


def test_python_only_skew():
    skews = find_skews({"a": info(), "b": info(), "c": info(python="3.12.1")})
    assert message(skews) == "Python differs across hosts: c has 3.12.1, a and b have 3.11.7"
    assert odd_fields(skews) == {"c": ["python"]}


def test_both_fields_differ_on_one_line_tensorflow_first():
    skews = find_skews({"a": info(), "b": info(python="3.12.1", tf="2.12.0"), "c": info()})
    assert message(skews) == ("TensorFlow differs across hosts: b has 2.12.0, a and c have 2.21.0; "
                              "Python differs across hosts: b has 3.12.1, a and c have 3.11.7")
    assert odd_fields(skews) == {"b": ["tensorflow", "python"]}


def test_patch_releases_apart_are_no_skew():
    assert find_skews({"a": info("3.11.2", "2.21.0"), "b": info("3.11.7", "2.21.1rc0")}) == []


def test_a_host_without_tensorflow_is_left_to_the_tf_missing_check():
    assert find_skews({"a": info(), "b": info(tf=None), "c": info()}) == []
    assert find_skew("TensorFlow", {"a": None, "b": "2.12.0", "c": "2.21.0"}).odd == {"c": "2.21.0"}


def test_many_hosts_are_counted_not_all_named():
    versions = {**{f"w{i:02d}": "2.21.0" for i in range(10)}, "odd": "2.20.0"}
    assert find_skew("TensorFlow", versions).describe() == (
        "TensorFlow differs across hosts: odd has 2.20.0, w00, w01, w02, w03 and 6 more have 2.21.0")


# -- the shim's info -----------------------------------------------------------------------

def make_fakes(root: Path) -> Path:
    """`lib/`: a TensorFlow whose metadata says FAKE_TF, built with CUDA 11.8 / cuDNN 8, that
    must never be imported; `bin/`: an nvidia-smi with two GPUs."""
    package = root / "lib" / "tensorflow"
    (package / "python" / "platform").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the fake tensorflow was imported')\n")
    (package / "python" / "platform" / "build_info.py").write_text(
        "import collections\nbuild_info = collections.OrderedDict([('cuda_version', '11.8'), "
        "('cudnn_version', '8'), ('is_cuda_build', True)])\n")
    dist = root / "lib" / f"tensorflow-{FAKE_TF}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tensorflow\nVersion: {FAKE_TF}\n")
    (root / "bin").mkdir()
    (root / "bin" / "nvidia-smi").write_text(FAKE_SMI)
    (root / "bin" / "nvidia-smi").chmod(0o755)
    return root


def test_info_reads_the_build_and_driver_without_importing_tensorflow(tmp_path):
    fakes = make_fakes(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(fakes / "lib"), "PATH": f"{fakes / 'bin'}:{os.environ['PATH']}"}
    out = subprocess.run([sys.executable, str(SHIM), "info"], input=b"{}\n", env=env,
                         capture_output=True, timeout=30)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["python_version"] == "%d.%d.%d" % sys.version_info[:3]
    assert (answer["tf_version"], answer["cuda_version"], answer["cudnn_version"]) == (FAKE_TF, "11.8", "8")
    assert (answer["gpus"], answer["driver_version"]) == (2, "535.104.05")


def test_info_without_nvidia_smi_names_no_driver(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}   # no nvidia-smi on it
    out = subprocess.run([sys.executable, str(SHIM), "info"], input=b"{}\n", env=env,
                         capture_output=True, timeout=30)
    answer = json.loads(out.stdout)
    assert answer["driver_version"] is None and answer["gpus"] == len(_proc_gpus())


def _proc_gpus() -> list[str]:
    try:
        return os.listdir("/proc/driver/nvidia/gpus")
    except OSError:
        return []


@pytest.mark.parametrize("source,expected", [
    # TF 2.x GPU wheels
    ("import collections\nbuild_info = collections.OrderedDict([('cpu_compiler', 'clang'), "
     "('cuda_compute_capabilities', ['sm_60']), ('cuda_version', '12.5.1'), ('cudnn_version', '9')])\n",
     {"cuda_version": "12.5.1", "cudnn_version": "9"}),
    ("build_info = {'cuda_version': '11.2', 'cudnn_version': '8', 'is_cuda_build': True}\n",
     {"cuda_version": "11.2", "cudnn_version": "8"}),
    # a CPU wheel names neither
    ("import collections\nbuild_info = collections.OrderedDict([('is_cuda_build', False)])\n", {}),
])
def test_build_info_is_parsed_never_run(source, expected):
    parsed = _build_info(source.encode())
    assert {k: parsed[k] for k in ("cuda_version", "cudnn_version") if k in parsed} == expected


# -- the CLI, for real, over SSH -----------------------------------------------------------

REAL_TF = tf_version()
needs_tf = pytest.mark.skipif(REAL_TF is None, reason="tensorflow is not installed here")


def other_minor_python() -> str | None:
    """An interpreter (>= 3.8, as the shim needs) of another Python minor version than this one."""
    return next((exe for minor, exe in other_pythons() if 8 <= minor != sys.version_info[1]), None)


def skewed_spec(tmp_path: Path, sshd, *, name: str, odd: str = sys.executable, fake_tf: bool = True,
                mode: str = "between-graph", train: str = "") -> Path:
    """Hosts a, b, c on the test sshd (127.0.0.2-4); b runs `odd`, with the fake TF or not."""
    fakes = make_fakes(tmp_path / "fakes")
    wrapper = tmp_path / "python"
    pythonpath = f"PYTHONPATH={fakes / 'lib'}" if fake_tf else ""
    wrapper.write_text(WRAPPER.format(fakes=fakes, pythonpath=pythonpath, odd=odd, python=sys.executable))
    wrapper.chmod(0o755)
    a, b, c = (f"'{host}:{port}'" for host, port in zip("abc", free_ports(3)))
    jobs = (f"  worker: {{tasks: [{a}, {b}, {c}]}}\n" if mode == "mirrored"
            else f"  ps: {{tasks: [{a}]}}\n  worker: {{tasks: [{b}, {c}]}}\n")
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(
        f"name: {name}\npython: {wrapper}\nworkdir: {tmp_path / 'remote'}\n"
        f"ssh: {{port: {sshd.port}, connect_timeout: 5}}\n"
        "hosts:\n  - {name: a, address: 127.0.0.2}\n  - {name: b, address: 127.0.0.3}\n"
        f"  - {{name: c, address: 127.0.0.4}}\njobs:\n{jobs}"
        f"train:\n  mode: {mode}\n{train}")
    return spec


def table_row(stderr: str, host: str) -> str:
    rows = [line for line in stderr.splitlines() if line.startswith(f"{host}  ")]   # plain columns: piped
    assert len(rows) == 1, stderr
    return rows[0]


@pytest.fixture
def cwd(tmp_path) -> Path:
    d = tmp_path / "cwd"
    d.mkdir()
    return d


@needs_tf
@pytest.mark.ssh
@pytest.mark.timeout(120)
def test_plan_check_fails_on_another_tensorflow_and_allow_skew_goes_on(tmp_path, home, ssh_home, sshd, cwd):
    spec = skewed_spec(tmp_path, sshd, name="skewtf")
    failed = tfcluster("plan", str(spec), "--check", home=home, cwd=cwd, timeout=90)
    assert failed.returncode == 4, failed.stderr
    diagnosis = f"TensorFlow differs across hosts: b has {FAKE_TF}, a and c have {REAL_TF}"
    assert f"tfcluster: error: {diagnosis}\nhint: " in failed.stderr and "--allow-skew" in failed.stderr
    assert "Traceback" not in failed.stderr and "preflight passed" not in failed.stderr
    row = table_row(failed.stderr, "b")
    assert all(cell in row for cell in (FAKE_TF, "11.8 / 8", "535.104.05", "← differs (tensorflow)"))
    assert REAL_TF in table_row(failed.stderr, "a") and "←" not in table_row(failed.stderr, "c")
    assert re.search(r"^b  ", failed.stderr, re.M).start() < failed.stderr.index("tfcluster: error:")  # table first

    allowed = tfcluster("plan", str(spec), "--check", "--allow-skew", home=home, cwd=cwd, timeout=90)
    assert allowed.returncode == 0, allowed.stderr
    assert f"tfcluster: warning: {diagnosis}" in allowed.stderr and "preflight passed" in allowed.stderr
    assert "← differs (tensorflow)" in table_row(allowed.stderr, "b")


@needs_tf
@pytest.mark.ssh
@pytest.mark.timeout(120)
def test_up_with_skew_exits_4_and_starts_nothing(tmp_path, home, ssh_home, sshd, cwd):
    spec = skewed_spec(tmp_path, sshd, name="skewup")
    up = tfcluster("up", str(spec), home=home, cwd=cwd, timeout=90)
    assert up.returncode == 4, up.stderr
    assert f"b has {FAKE_TF}, a and c have {REAL_TF}" in up.stderr
    assert "← differs (tensorflow)" in table_row(up.stderr, "b")
    assert "Starting" not in up.stderr
    assert not tagged_processes()
    assert not state_path(home, spec).exists()


@needs_tf
@pytest.mark.ssh
@pytest.mark.timeout(180)
def test_train_with_skew_exits_4_and_with_allow_skew_runs(tmp_path, home, ssh_home, sshd, cwd):
    """Mirrored mode starts no TF server, and this script imports no TF: it runs on b too."""
    (tmp_path / "hello.py").write_text("import os\nprint('hello from', os.environ['TFCLUSTER_TASK_INDEX'])\n")
    spec = skewed_spec(tmp_path, sshd, name="skewtr", mode="mirrored",
                       train="  script: hello.py\n")
    refused = tfcluster("train", str(spec), home=home, cwd=cwd, timeout=120)
    assert refused.returncode == 4, refused.stderr
    assert f"b has {FAKE_TF}, a and c have {REAL_TF}" in refused.stderr
    assert "hello from" not in refused.stdout and not tagged_processes()
    ran = tfcluster("train", str(spec), "--allow-skew", home=home, cwd=cwd, timeout=120)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "tfcluster: warning: TensorFlow differs across hosts: b has" in ran.stderr
    assert all(f"worker:{i} │ hello from {i}" in ran.stdout for i in range(3))


@pytest.mark.ssh
@pytest.mark.timeout(120)
def test_plan_check_fails_when_one_host_runs_another_python_minor(tmp_path, home, ssh_home, sshd, cwd):
    other = other_minor_python()
    if other is None:
        pytest.skip("no interpreter of another Python minor version on this machine")
    version = subprocess.run([other, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    spec = skewed_spec(tmp_path, sshd, name="skewpy", odd=other, fake_tf=False)
    failed = tfcluster("plan", str(spec), "--check", home=home, cwd=cwd, timeout=90)
    assert failed.returncode == 4, failed.stderr
    mine = "%d.%d.%d" % sys.version_info[:3]
    error = next(line for line in failed.stderr.splitlines() if line.startswith("tfcluster: error: "))
    assert f"Python differs across hosts: b has {version}, a and c have {mine}" in error
    assert "← differs (python)" in table_row(failed.stderr, "b")


@pytest.mark.ssh
@pytest.mark.timeout(120)
def test_keras_jax_refuses_another_jaxlib_on_one_host_to_the_patch(tmp_path, home, ssh_home, sshd, cwd):
    """JAX's processes speak one wire protocol, which only one jax and jaxlib release is sure to
    share: a patch apart is refused here (docs/modes.md), where TensorFlow's minor is enough.
    Host b sees a jaxlib whose metadata says another patch first on its path."""
    python = jax_python()
    real = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('jaxlib'))"],
                          capture_output=True, text=True, timeout=30).stdout.strip()
    major, minor_, patch = (real.split(".") + ["0", "0"])[:3]
    odd = f"{major}.{minor_}.{int(re.match(r'[0-9]+', patch).group()) + 1}"
    dist = tmp_path / "fakes" / "lib" / f"jaxlib-{odd}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: jaxlib\nVersion: {odd}\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(WRAPPER.format(fakes=tmp_path / "fakes", pythonpath=f"PYTHONPATH={dist.parent}",
                                      odd=python, python=python))
    wrapper.chmod(0o755)
    a, b, c = (f"'{host}:{port}'" for host, port in zip("abc", free_ports(3)))
    spec = tmp_path / "skewjax.yaml"
    spec.write_text(
        f"name: skewjax\npython: {wrapper}\nworkdir: {tmp_path / 'remote'}\n"
        f"ssh: {{port: {sshd.port}, connect_timeout: 5}}\n"
        "hosts:\n  - {name: a, address: 127.0.0.2}\n  - {name: b, address: 127.0.0.3}\n"
        f"  - {{name: c, address: 127.0.0.4}}\njobs:\n  worker: {{tasks: [{a}, {b}, {c}]}}\n"
        "train: {mode: keras-jax, script: template:keras_jax}\n")
    failed = tfcluster("plan", str(spec), "--check", home=home, cwd=cwd, timeout=90)
    assert failed.returncode == 4, failed.stderr
    assert f"tfcluster: error: jaxlib differs across hosts: b has {odd}, a and c have {real}\n" in failed.stderr
    assert "the same jax, jaxlib and Keras versions" in failed.stderr and "Traceback" not in failed.stderr
    assert "← differs (jaxlib)" in table_row(failed.stderr, "b") and "←" not in table_row(failed.stderr, "a")
    allowed = tfcluster("plan", str(spec), "--check", "--allow-skew", home=home, cwd=cwd, timeout=90)
    assert allowed.returncode == 0, allowed.stderr
    assert "tfcluster: warning: jaxlib differs across hosts" in allowed.stderr


@pytest.mark.ssh
@pytest.mark.timeout(120)
def test_keras_jax_refuses_a_gpu_host_whose_jax_has_no_cuda_plugin(tmp_path, home, ssh_home, sshd, cwd):
    """jax without its CUDA plugin falls back to the CPU: that host's processes would hold other
    devices than the spec's GPUs (and than the other hosts'). Both hosts have two GPUs (a fake
    nvidia-smi); only b's Python sees a CUDA plugin (its metadata, first on its path)."""
    python = jax_python()
    version = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('jax'))"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    fakes = make_fakes(tmp_path / "fakes")
    plugin = tmp_path / "plugin"
    (plugin / f"jax_cuda12_plugin-{version}.dist-info").mkdir(parents=True)
    (plugin / f"jax_cuda12_plugin-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: jax-cuda12-plugin\nVersion: {version}\n")
    wrapper = tmp_path / "python"
    spec = tmp_path / "jaxgpu.yaml"

    def check(plugin_on_a: bool):
        on_a = f"export PYTHONPATH={plugin}; " if plugin_on_a else ""
        wrapper.write_text(f'#!/bin/sh\nexport PATH="{fakes}/bin:$PATH"\ncase " $SSH_CONNECTION " in\n'
                           f'  *" 127.0.0.3 "*) export PYTHONPATH={plugin} ;;\n  *) {on_a}: ;;\nesac\n'
                           f'exec {python} "$@"\n')
        wrapper.chmod(0o755)
        a, b = free_ports(2)
        spec.write_text(
            f"name: jaxgpu\npython: {wrapper}\nworkdir: {tmp_path / 'remote'}\n"
            f"ssh: {{port: {sshd.port}, connect_timeout: 5}}\n"
            "hosts:\n  - {name: a, address: 127.0.0.2, gpus: 2}\n  - {name: b, address: 127.0.0.3, gpus: 2}\n"
            f"jobs:\n  worker: {{tasks: ['a:{a}', 'b:{b}']}}\n"
            "train: {mode: keras-jax, script: template:keras_jax}\n")
        return tfcluster("plan", str(spec), "--check", home=home, cwd=cwd, timeout=90)

    refused = check(plugin_on_a=False)
    assert refused.returncode == 4, refused.stderr
    assert (f"tfcluster: error: host a: jax {version} has no CUDA plugin for {wrapper}: its processes would "
            "run on the CPU, not on the 2 GPUs the spec gives it\n") in refused.stderr
    assert f"pip install 'jax[cuda12]=={version}'" in refused.stderr and "Traceback" not in refused.stderr
    assert "host b:" not in refused.stderr
    passed = check(plugin_on_a=True)
    assert passed.returncode == 0 and "preflight passed" in passed.stderr, passed.stderr
    assert re.search(rf"^a .* {re.escape(version)} \(cuda\) ", passed.stderr, re.M), passed.stderr


@pytest.mark.parametrize("driver,extra", [("580.159.04", "cuda13"), ("590.1", "cuda13"), ("575.57.08", "cuda12"),
                                          ("535.104.05", "cuda12"), (None, "cuda12"), ("n/a", "cuda12")])
def test_the_jax_plugin_a_hint_names_is_the_one_the_hosts_driver_runs(driver, extra):
    assert jax_cuda_extra(driver) == extra
