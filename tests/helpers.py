"""Shared helpers for the end-to-end tests: write specs on free ports, run the CLI."""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.tf_launch import free_ports
from tfcluster.errors import ConnectError
from tfcluster.host import shim_cgroup, shim_procs
from tfcluster.launch.agent.agent import HostAgent
from tfcluster.launch.agent.records import TaskLaunch
from tfcluster.plan.names import ClusterPaths
from tfcluster.transport.ssh import SshTransport

ROOT = Path(__file__).resolve().parent.parent
RESULT = re.compile(r"tfcluster-result: global_step=(\d+) loss=([0-9.eE+-]+|nan|inf)")
LOSS = re.compile(r"loss=([0-9.eE+-]+)")


def cannot_run(message: str) -> None:
    """What a test needs is missing here: it fails under CI=true (CI installs everything the
    suite needs), and skips elsewhere."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def need_tensorflow() -> None:
    """Skip the calling test module where TensorFlow is not installed, without importing it
    (pytest.importorskip would: 4 s of CPU in every process that collects the module, the fast
    subset's included)."""
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow is not installed: pip install -e '.[test]'", allow_module_level=True)


def extras_python(module: str, extra: str) -> str:
    """A Python with `module`, which the suite's venv leaves out: scripts/test.sh layers the jax
    and plot extras over it and names that Python in TFCLUSTER_TEST_EXTRAS_PYTHON (the rest of
    the suite runs TensorFlow without them, since TensorFlow and Keras import both whenever they
    can: docs/development.md); else this Python, if it has `module`. With neither: skipped,
    failed under CI=true."""
    named = os.environ.get("TFCLUSTER_TEST_EXTRAS_PYTHON")
    if named:
        return named
    if importlib.util.find_spec(module) is not None:
        return sys.executable
    cannot_run(f"no Python with {module}: run scripts/test.sh, or pip install -e '.[{extra}]'")


def jax_python() -> str:
    """The Python mode keras-jax's tests run."""
    return extras_python("jax", "jax")


def plot_python() -> str:
    """The Python `plot -o`'s tests run the CLI with."""
    return extras_python("matplotlib", "plot")


# Processes of this test session: tfcluster tags every process it starts (TFCLUSTER_JOB_ID,
# docs/ARCHITECTURE.md); conftest's leak check and many tests find them by it.
TAG = "TFCLUSTER_JOB_ID="
# Every process this test session starts inherits this marker (the test sshd passes it on
# with SetEnv), so the leak check judges only our own processes, never another session's.
SESSION_VAR = "TFCLUSTER_TEST_SESSION"
os.environ.setdefault(SESSION_VAR, uuid.uuid4().hex)
# Under pytest-xdist each worker is a session of its own: the controller set the marker before
# it started them, so a worker makes its own, or its leak check would judge its peer's processes.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER and not os.environ[SESSION_VAR].endswith("-" + _WORKER):
    os.environ[SESSION_VAR] = f"{uuid.uuid4().hex}-{_WORKER}"
SESSION_MARK = f"{SESSION_VAR}={os.environ[SESSION_VAR]}".encode()


def tagged_processes() -> dict[int, str]:
    """pid -> tag value of every live process of this test session carrying the tfcluster tag.
    Read straight from /proc (a zombie's environ reads empty): the leak check and many waits call
    this every tenth of a second, and psutil's walk costs seven times as much."""
    found = {}
    tag = TAG.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if SESSION_MARK not in environ:
            continue
        items = environ.split(b"\0")
        if SESSION_MARK not in items:
            continue
        for item in items:
            if item.startswith(tag):
                found[int(name)] = item[len(tag):].decode(errors="replace")
    return found


NFT = shutil.which("nft") or next((p for p in ("/usr/sbin/nft", "/sbin/nft") if os.access(p, os.X_OK)), None)


def cluster_tables(name: str) -> list[str]:
    """The nftables tables of clusters named `name` in this network namespace; none where
    tables cannot be read (not root, no nft): the fence is then not made either."""
    if NFT is None or os.geteuid() != 0:
        return []
    out = subprocess.run([NFT, "list", "tables"], capture_output=True, text=True, timeout=10).stdout
    return [line.split()[-1] for line in out.splitlines()
            if line.startswith("table inet ") and line.split()[-1].startswith(f"tfcluster_{name}_")]


def cgroup_fence_or_skip() -> str:
    """The cgroup v2 mount, where root can make tables with nft that name a cluster's cgroup;
    else the test skips, with the reason."""
    if os.geteuid() != 0:
        pytest.skip("closing ports needs root (CI runs as root)")
    if NFT is None or subprocess.run([NFT, "list", "tables"], capture_output=True, timeout=10).returncode:
        pytest.skip("nftables is not installed or not usable here (scripts/test.sh installs it)")
    mount = shim_cgroup.mount_point()
    if mount is None or shim_cgroup.nft_name(os.path.join(mount, "x"), mount) is None:
        pytest.skip(f"no cgroup v2 that nft can name here (mounted at {mount}): the uid is matched, "
                    "which closes the task ports only (docs/security.md)")
    return mount


DIAL = ("import socket, sys\n"
        "for a in sys.argv[1:]:\n"
        "    h, _, p = a.rpartition(':')\n"
        "    try:\n"
        "        socket.create_connection((h.strip('[]'), int(p)), 3).close(); print(a, 'connected')\n"
        "    except OSError as e:\n"
        "        print(a, type(e).__name__)\n")


def dial(*targets: str, user=None) -> dict[str, str]:
    """From this machine, a plain TCP connect to each 'address:port' (`[::1]:port`) by `user`
    (tests.users.User; None: this test's own process, root, outside every cluster's cgroup):
    target -> 'connected' or the error's name. The bed's hosts: tests.netns.dial_from."""
    argv = ["-S", "-c", DIAL, *targets]
    done = (subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=30) if user is None
            else user.run(["/usr/bin/python3", *argv], timeout=30))
    assert done.returncode == 0, done.stderr
    return dict(line.rsplit(" ", 1) for line in done.stdout.splitlines())


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def local_spec(tmp: Path, *, mode: str = "between-graph", script: str = "template:between_graph",
               args: list[str] | None = None, ps: int = 1, workers: int = 2, chief: int = 0,
               restart: str | None = None, name: str = "t", extra: str = "") -> Path:
    """A spec for 127.0.0.1 tasks on free ports (local transport, no SSH)."""
    ports = iter(free_ports(ps + workers + chief))
    jobs = []
    for job, n in (("chief", chief), ("ps", ps), ("worker", workers)):
        if n:
            tasks = ", ".join(f'"local:{next(ports)}"' for _ in range(n))
            jobs.append(f"  {job}: {{tasks: [{tasks}]}}")
    text = (f"name: {name}\nhosts:\n  - {{name: local, address: 127.0.0.1}}\njobs:\n" + "\n".join(jobs)
            + f"\ntrain:\n  mode: {mode}\n  script: {script}\n  args: {json.dumps(args or [])}\n")
    if restart:
        text += f"  restart: {{policy: {restart}, max_restarts: 3}}\n"
    text += extra
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


def cli_env(home: Path) -> dict[str, str]:
    return {**os.environ, "HOME": str(home), "NO_COLOR": "1", "COLUMNS": "200"}


def tfcluster(*args: str, home: Path, cwd: Path, timeout: float = 240,
              python: str = sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "tfcluster", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=cli_env(home))


def start_tfcluster(*args: str, home: Path, cwd: Path) -> subprocess.Popen:
    """tfcluster in its own process group, as a shell would run it in the foreground."""
    return subprocess.Popen([sys.executable, "-m", "tfcluster", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=cwd, env=cli_env(home), text=True,
                            start_new_session=True)


def read_until(proc: subprocess.Popen, pattern: str | bytes, timeout: float) -> list:
    """Lines of proc's output up to and including the first matching `pattern` (bytes for a
    process whose output is read as bytes)."""
    deadline = time.monotonic() + timeout
    lines = []
    regex = re.compile(pattern)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if regex.search(line):
            return lines
    got = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x for x in lines[-30:])
    raise AssertionError(f"no line matching {pattern!r} within {timeout}s; got:\n{got}")


def kill_tagged_once_seen(proc: subprocess.Popen, pattern: str, tag_suffix: str, *, wait: float,
                          finish: float) -> str:
    """Read a running tfcluster's output until `pattern`, SIGKILL the one task process whose
    tag ends with `tag_suffix` (`:worker:1:script`, `:ps:0:server`), then return the rest of
    the output once tfcluster exits. tfcluster's group is killed whatever happens."""
    
    try:
        read_until(proc, pattern, timeout=wait)
        victims = [pid for pid, tag in tagged_processes().items() if tag.endswith(tag_suffix)]
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        return proc.communicate(timeout=finish)[0]
    finally:
        kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def gone_after_ctrl_c(name: str) -> None:
    """After a run of cluster `name` ended on Ctrl-C: its table goes, and every task."""
    wait_for(lambda: not cluster_tables(name), 15, what="the table to go after Ctrl-C")
    wait_for(lambda: not tagged_processes(), 15, what="the run's processes to go")


def only_run(runs: Path) -> Path:
    dirs = [d for d in runs.iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def result_of(log: str) -> tuple[int, float]:
    found = RESULT.findall(log)
    assert found, f"no result line in:\n{log[-2000:]}"
    step, loss = found[-1]
    return int(step), float(loss)


def losses(log: str) -> list[float]:
    return [float(x) for x in LOSS.findall(log)]


def ssh_spec(tmp: Path, sshd, *, name: str = "sshc", ssh_extra: str = "", env: str = "",
             train: str = "", ports: list[int] | None = None) -> Path:
    """Three SSH hosts on loopback, 1 ps + 2 workers, each task on its own port."""
    p = ports or free_ports(3)
    workdir = tmp / "remote"
    text = (
        f"name: {name}\npython: {sys.executable}\nworkdir: {workdir}\n{env}"
        f"ssh:\n  port: {sshd.port}\n  connect_timeout: 5\n{ssh_extra}"
        "hosts:\n  - {name: h2, address: 127.0.0.2}\n  - {name: h3, address: 127.0.0.3}\n"
        "  - {name: h4, address: 127.0.0.4}\n"
        f"jobs:\n  ps: {{tasks: ['h2:{p[0]}']}}\n  worker: {{tasks: ['h3:{p[1]}', 'h4:{p[2]}']}}\n{train}"
    )
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


@functools.cache
def other_pythons() -> tuple[tuple[int, str], ...]:
    """The interpreters on this machine other than the one the tests run on, as (minor version,
    real path): the system's (/usr/bin, /bin), those on PATH (a venv's bin skipped: its python is
    this one), and those installed beside any of them (pyenv and the like: <root>/<version>/bin).
    CI may make its venv from the system's python3 while PATH's is another (pyenv's)."""
    mine = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    dirs = ["/usr/bin", "/bin"] + [d for d in os.environ.get("PATH", "").split(os.pathsep)
                                   if d and not (Path(d).parent / "pyvenv.cfg").exists()]
    named = [os.path.join(d, f"python3{suffix}") for d in dict.fromkeys(dirs)
             for suffix in ["", *(f".{m}" for m in range(8, 20))]]
    probe = "import os, sys; print(sys.version_info[1], os.path.realpath(sys.executable))"
    found: dict[str, int] = {}

    def add(exe: str) -> None:
        if not os.access(exe, os.X_OK):
            return
        done = subprocess.run([exe, "-c", probe], capture_output=True, text=True, timeout=30)
        minor, _, real = done.stdout.strip().partition(" ")
        if done.returncode == 0 and minor.isdigit() and real != mine and real not in found:
            found[real] = int(minor)

    for exe in named:
        add(exe)
    for real in list(found) + [mine]:
        for exe in sorted(Path(real).parents[2].glob("*/bin/python3.*")):
            if re.fullmatch(r"python3\.\d+", exe.name):
                add(str(exe))
    return tuple((minor, real) for real, minor in found.items())


def this_python_renamed(directory: Path, name: str = "python-other") -> str:
    """This interpreter under another path, as a user's wrapper script would give it: the
    local host then runs the shim as a process of its own (its own interpreter runs it
    in-process). A wrapper, not a symlink: a symlink to a venv's python outside the venv
    no longer finds the venv's packages."""
    wrapper = Path(directory) / name
    if not wrapper.exists():
        wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        wrapper.chmod(0o755)
    return str(wrapper)


def keygen(path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
                   check=True, capture_output=True)
    return str(path)


def fingerprint(pubkey_path: str) -> str:
    out = subprocess.run(["ssh-keygen", "-lf", pubkey_path], check=True,
                         capture_output=True, text=True).stdout
    return out.split()[1]


def connect_error(transport: SshTransport) -> ConnectError:
    with pytest.raises(ConnectError) as info:
        transport.connect()
    assert "\n" not in info.value.message
    return info.value


def where(t: SshTransport) -> str:
    """The server address and port the session landed on, from sshd's SSH_CONNECTION."""
    out = t.run(["sh", "-c", 'printf %s "$SSH_CONNECTION"']).stdout.decode().split()
    return f"{out[2]}:{out[3]}"


def assert_went_through_jump(t: SshTransport, jump_sshd) -> None:
    import paramiko
    conn = t.connections[0]
    assert isinstance(conn.transport.sock, paramiko.Channel)
    assert conn.jumps[0].transport.getpeername() == ("127.0.0.5", jump_sshd.port)


LISTENER = ("import socket, sys, time\ns = socket.socket()\n"
            "s.bind(('0.0.0.0', int(sys.argv[1])))\ns.listen()\ntime.sleep(300)\n")


def noisy_python(tmp_path):
    noisy = tmp_path / "noisy-python"
    noisy.write_text("#!/bin/sh\necho 'Welcome to the lab. Quota: 93% used.'\necho\n"
                     f"exec {sys.executable} \"$@\"\n")
    noisy.chmod(0o755)
    return noisy


def state_path(home: Path, spec: Path) -> Path:
    """Where `up` keeps the local state of the spec's cluster."""
    from tfcluster.launch.cluster.state import key
    from tfcluster.plan import build_plan
    from tfcluster.spec import load_spec

    return home / ".local" / "state" / "tfcluster" / key(build_plan(load_spec(str(spec)))) / "state.json"


def bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


# tfserver.py's hold protocol, then a listener on the task's port. The task whose port is
# ESCAPE_PORT first forks a child that leaves its session and its tag behind (its
# environment without TFCLUSTER_JOB_ID) and keeps the listening socket: nothing of the
# cluster by tag, ours by uid, a survivor down must not stop and must report.
STANDIN = '''
import json, os, signal, socket, sys, time
c = json.loads(os.environ["TF_CONFIG"])
port = int(c["cluster"][c["task"]["type"]][c["task"]["index"]].rsplit(":", 1)[1])
if os.environ.pop("TFCLUSTER_HOLD", None) == "1" and sys.stdin.readline() != "GO\\n":
    raise SystemExit(0)
if os.environ.get("LINGER"):   # a server slow to stop: TERM, then LINGER seconds before it exits
    def linger(*_):
        time.sleep(float(os.environ["LINGER"]))
        os._exit(0)
    signal.signal(signal.SIGTERM, linger)
s = socket.create_server(("", port))
if str(port) == os.environ.get("ESCAPE_PORT"):
    s.set_inheritable(True)
    pid = os.fork()
    if pid == 0:
        os.setsid()
        env = {k: v for k, v in os.environ.items() if k != "TFCLUSTER_JOB_ID"}
        os.execve(sys.executable, [sys.executable, "-c", "import signal; signal.pause()", "escapee"], env)
    with open(os.environ["ESCAPE_PIDFILE"] + ".tmp", "w") as f:
        f.write(str(pid))
    os.rename(os.environ["ESCAPE_PIDFILE"] + ".tmp", os.environ["ESCAPE_PIDFILE"])
while True:
    signal.pause()
'''


LOCAL = os.path.join(ROOT, "sample_clusters", "local.yaml")


GPU_LAB = os.path.join(ROOT, "sample_clusters", "gpu_lab.yaml")


def tfc(*args: str, cwd: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfcluster", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "NO_COLOR": "1"})


CLUSTER_DIR = "~/.tfcluster/lab"
PATHS = ClusterPaths(CLUSTER_DIR)


# Stop sweeps the whole machine by tag prefix: a cluster name of our own keeps concurrent
# test sessions on this machine out of each other's way.
C = f"agent{uuid.uuid4().hex[:8]}"


# Ignores SIGTERM and leaves a grandchild in a session of its own, which ignores it too.
STUBBORN = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen(["setsid", sys.executable, "-c",
                      "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    time.sleep(600)
""")


def launch(agent: HostAgent, tag: str, argv, env=None, cwd: str = "~") -> TaskLaunch:
    stem = tag.replace(":", "_")
    return TaskLaunch(tag=tag, argv=tuple(argv), env=dict(env or {}), cwd=cwd,
                      log=f"{CLUSTER_DIR}/logs/{stem}.log", pidfile=PATHS.pidfile(tag))


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def with_tag(prefix: str) -> dict[int, str]:
    return {p: t for p, t in tagged_processes().items() if t.startswith(q(prefix))}


def read_all(task) -> bytes:
    out = b""
    while chunk := task.read():
        out += chunk
    return out


def q(text: str) -> str:
    """A tag or prefix as the host writes it: with the identity of CLUSTER_DIR (under this HOME)."""
    return shim_procs.qualify(text, CLUSTER_DIR)


class SaidUi:
    """A UI that keeps what it was told to say, as `info …` / `warn …` lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, text: str) -> None:
        self.lines.append(f"info {text}")

    def warn(self, text: str) -> None:
        self.lines.append(f"warn {text}")


# Scripts with a known way to fail (tests/scripts/), each run in the mode it fails in.
SCRIPTS = Path(__file__).parent / "scripts"


def known_spec(tmp: Path, script: str, mode: str, jobs: dict[str, int], args: list[str]) -> Path:
    """A local spec running tests/scripts/`script` in `mode` on `jobs` (job -> count)."""
    ports = iter(free_ports(sum(jobs.values())))
    lines = [f"  {job}: {{tasks: [{', '.join(f'a:{next(ports)}' for _ in range(n))}]}}" for job, n in jobs.items()]
    spec = tmp / "known.yaml"
    spec.write_text("name: known\nhosts:\n  - {name: a, address: 127.0.0.1}\njobs:\n" + "\n".join(lines) +
                    f"\ntrain:\n  mode: {mode}\n  script: {SCRIPTS / script}\n  args: {json.dumps(args)}\n"
                    f"  allow_outside: [{SCRIPTS}]\n")
    return spec


# A script mode mirrored takes for Keras' model.fit under MultiWorkerMirroredStrategy.
FIT_SCRIPT = "strategy = tf.distribute.MultiWorkerMirroredStrategy()\nmodel.fit(dataset, epochs=3)\n"


def fake_venv(root: Path, **dists: str) -> str:
    """A venv (no pip: nothing is downloaded) whose site-packages hold only the metadata of
    `dists` (name -> version): `info` reads versions, never imports, so none is needed."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=60)
    python = str(root / "bin" / "python")
    site = Path(subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                               capture_output=True, text=True, check=True, timeout=30).stdout.strip())
    for name, version in dists.items():
        dist = site / f"{name}-{version}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return python


def venv_spec(tmp_path: Path, python: str, *, keras: str = "auto", script: str = FIT_SCRIPT) -> Path:
    """Two mirrored workers on this machine run by `python` (a process of its own: the shim
    is shipped to the workdir and the script's lines come back as they would from a host)."""
    (tmp_path / "train.py").write_text(script)
    spec = local_spec(tmp_path, mode="mirrored", script="train.py", ps=0,
                      extra=f"  keras: {keras}\n  checks: {{reachability: false}}\n")
    spec.write_text(spec.read_text().replace("hosts:", f"python: {python}\nworkdir: {tmp_path / 'wd'}\nhosts:", 1))
    return spec
