"""Issue 10: safe on shared machines. Directories are yours or refused; a cached file is
used only for its content; the bootstrap runs the bytes it hashed.

A real second Unix user (tests/users.py, `tfcother`, "B" below) makes the directories
another user could have made. The tests run as root in CI, so "the connecting user" is
root: B's directories are not root's, and a world-writable directory is writable by B.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers import cli_env, this_python_renamed
from tests.tf_launch import free_ports
from tfcluster.errors import PreflightError
from tfcluster.host import shim
from tfcluster.host.shim_protocol import ShimError
from tfcluster.launch.agent.agent import HostAgent
from tfcluster.launch.agent.bootstrap import BOOTSTRAP, SHIPPED, shipped
from tfcluster.plan import build_plan
from tfcluster.plan.names import ClusterPaths
from tfcluster.spec import load_spec
from tfcluster.transport.local import LocalTransport

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent
GOOD = b"print('the real script')\n"


def evil(marker: Path) -> bytes:
    return f"open({str(marker)!r}, 'w').write('ran')\nprint('the real script')\n".encode()


# --------------------------------------------------------------------------- helpers

@pytest.fixture
def shared(other_user):
    """/tmp/tfc-shared-XXXX, made by B (0755); removed afterwards, first as B."""
    with other_user.directory("tfc-shared", "755") as path:
        yield path


def as_b(other_user, *commands: str) -> None:
    """Shell commands as B with umask 0: everything B makes is writable by everyone."""
    done = other_user.run(["sh", "-ec", "umask 0\n" + "\n".join(commands)])
    assert done.returncode == 0, done.stderr


def write_spec(tmp: Path, workdir: Path | str, *, python: str | None = None, name: str = "sd",
               address: str = "127.0.0.1", extra: str = "", script: bool = False) -> Path:
    """One worker on `address`, mode mirrored (no ps, no servers)."""
    port = free_ports(1)[0]
    train = "train: {mode: mirrored, script: train.py}\n" if script else "train: {mode: mirrored}\n"
    text = (f"name: {name}\n" + (f"python: {python}\n" if python else "") + f"workdir: {workdir}\n"
            f"{train}{extra}hosts:\n  - {{name: lab, address: {address}}}\n"
            f"jobs:\n  worker: {{tasks: ['lab:{port}']}}\n")
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


def tfc(*args: str, home: Path, cwd: Path, umask: int = 0o022, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfcluster", *args], capture_output=True, text=True,
                          timeout=90, cwd=cwd, env={**cli_env(home), **env}, umask=umask)


def error_line(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("tfcluster: error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def levels(top: Path, leaf: Path) -> list[Path]:
    """`top` and every directory below it down to `leaf`."""
    parts = leaf.relative_to(top).parts
    return [top] + [top.joinpath(*parts[:i + 1]) for i in range(len(parts))]


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# --------------------------------------------------------------------------- refused trees

@pytest.mark.parametrize("route", ["in-process", "bootstrap"])
def test_a_workdir_another_user_made_world_writable_is_refused_and_left_empty(
        route, shared, other_user, home, tmp_path):
    lab = shared / "shared" / "lab"
    as_b(other_user, f"mkdir -p {lab}")
    python = sys.executable if route == "in-process" else this_python_renamed(tmp_path)

    spec = write_spec(tmp_path, lab, python=python)
    result = tfc("plan", "--check", str(spec), home=home, cwd=tmp_path)

    assert result.returncode == 4, result.stderr
    line = error_line(result)
    assert f"host lab: {shared} is owned by tfcother (uid {other_user.uid}), not by you" in line
    assert list(lab.iterdir()) == []
    # status: the host was reached and refused, not unreachable
    status = tfc("status", str(spec), home=home, cwd=tmp_path)
    assert status.returncode == 4 and " refused " in status.stdout and "unreachable" not in status.stdout
    assert f"host lab: {shared} is owned by tfcother" in error_line(status)


def test_a_world_writable_workdir_root_is_refused_even_when_root_owns_it(home, tmp_path):
    workdir = tmp_path / "scratch"
    workdir.mkdir()
    workdir.chmod(0o777)

    result = tfc("plan", "--check", str(write_spec(tmp_path, workdir, python=this_python_renamed(tmp_path))),
                 home=home, cwd=tmp_path)

    assert result.returncode == 4, result.stderr
    assert f"host lab: {workdir} is writable by others (mode 0777)" in error_line(result)
    assert f"chmod go-w {workdir}" in result.stderr
    assert list(workdir.iterdir()) == []


@pytest.mark.parametrize("route", ["in-process", "bootstrap"])
def test_every_level_tfcluster_creates_is_0700_whatever_the_umask(route, home, tmp_path):
    sticky = tmp_path / "sticky"                 # like /tmp: root's, sticky, world-writable
    sticky.mkdir()
    sticky.chmod(0o1777)
    workdir = sticky / "a" / "b"
    python = sys.executable if route == "in-process" else this_python_renamed(tmp_path)

    result = tfc("plan", "--check", str(write_spec(tmp_path, workdir, python=python)),
                 home=home, cwd=tmp_path, umask=0)

    assert result.returncode == 0, result.stderr
    cluster = workdir / "sd"
    created = levels(sticky / "a", cluster) + [cluster / d for d in ("cache", "pids", "runs")]
    if route == "bootstrap":
        created += [cluster / "bin", cluster / "bin" / "probe"]
    assert {str(p): oct(mode(p)) for p in created} == {str(p): "0o700" for p in created}


# --------------------------------------------------------------------------- the cache

def test_a_cache_file_planted_in_another_users_tree_never_runs(shared, other_user, home, tmp_path):
    marker = shared / "ran"
    script = tmp_path / "train.py"
    script.write_bytes(GOOD)
    planted = shared / "w" / "sd" / "cache" / hashlib.sha256(GOOD).hexdigest()
    as_b(other_user, f"mkdir -p {planted.parent}", f"cat > {planted} <<'EOF'\n{evil(marker).decode()}EOF")
    spec = write_spec(tmp_path, shared / "w", python=this_python_renamed(tmp_path), script=True)

    result = tfc("train", str(spec), home=home, cwd=tmp_path)

    assert result.returncode == 4, result.stdout + result.stderr
    assert f"host lab: {shared} is owned by tfcother" in error_line(result)
    assert not marker.exists()
    assert planted.read_bytes() == evil(marker)                 # untouched, and never copied
    assert sorted(p.name for p in (shared / "w" / "sd").iterdir()) == ["cache"]


def test_train_runs_the_real_script_when_the_cache_holds_other_bytes_under_its_name(home, tmp_path):
    (tmp_path / "train.py").write_bytes(GOOD)
    spec = write_spec(tmp_path, tmp_path / "wd", python=this_python_renamed(tmp_path), script=True)
    assert tfc("plan", "--check", str(spec), home=home, cwd=tmp_path).returncode == 0   # makes the tree
    marker = tmp_path / "ran"
    cached = tmp_path / "wd" / "sd" / "cache" / hashlib.sha256(GOOD).hexdigest()
    cached.write_bytes(evil(marker))

    result = tfc("train", str(spec), home=home, cwd=tmp_path)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "worker:0 │ the real script" in result.stdout
    assert not marker.exists() and cached.read_bytes() == GOOD


@pytest.fixture
def local_agent(home, tmp_path):
    agents = []

    def make(in_process: bool) -> HostAgent:
        agents.append(HostAgent("lab", LocalTransport(), sys.executable, str(tmp_path / "wd" / "sd"),
                                in_process=in_process))
        agents[-1].prepare()
        return agents[-1]

    yield make
    for agent in agents:
        agent.close()


@pytest.mark.parametrize("route", ["inline", "upload"])
@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "shim"])
def test_a_cache_file_whose_content_does_not_match_its_name_is_sent_again(
        route, in_process, local_agent, tmp_path, monkeypatch):
    import tfcluster.launch.agent.agent as agent_module

    if route == "upload":
        monkeypatch.setattr(agent_module, "INLINE_LIMIT", 0)
    agent = local_agent(in_process)
    marker = tmp_path / "ran"
    cached = Path(agent.paths.cache) / hashlib.sha256(GOOD).hexdigest()
    cached.write_bytes(evil(marker))

    sent = agent.sync_files([("train.py", GOOD, 0o600)], agent.paths.rundir("r1"))

    placed = Path(agent.paths.rundir("r1")) / "train.py"
    assert sent == len(GOOD)                          # the planted entry counted as absent
    assert placed.read_bytes() == GOOD and cached.read_bytes() == GOOD
    out = subprocess.run([sys.executable, str(placed)], capture_output=True, text=True, timeout=30)
    assert out.stdout == "the real script\n"
    assert not marker.exists()


def test_a_link_in_the_cache_is_not_followed(local_agent, tmp_path):
    agent = local_agent(True)
    elsewhere = tmp_path / "elsewhere.py"
    elsewhere.write_bytes(GOOD)                       # even the right content, through a link
    cached = Path(agent.paths.cache) / hashlib.sha256(GOOD).hexdigest()
    cached.symlink_to(elsewhere)

    assert agent.sync_files([("train.py", GOOD, 0o600)], agent.paths.rundir("r1")) == len(GOOD)

    assert not cached.is_symlink() and cached.read_bytes() == GOOD
    assert elsewhere.read_bytes() == GOOD


def test_every_entry_of_a_files_request_is_checked_before_anything_is_written(tmp_path):
    cache, dest = tmp_path / "cache", tmp_path / "runs" / "r1"
    good = {"path": "train.py", "sha256": hashlib.sha256(GOOD).hexdigest(), "mode": 0o600}
    inline = {good["sha256"]: __import__("base64").b64encode(GOOD).decode()}
    bad_requests = [
        {"files": [good, {**good, "path": "../escape.py"}], "inline": inline},
        {"files": [good, {**good, "sha256": "../../x"}], "inline": inline},
        {"files": [good], "inline": {"0" * 64: inline[good["sha256"]]}},     # wrong digest
    ]
    for request in bad_requests:
        with pytest.raises(ShimError):
            shim.cmd_files({"cache": str(cache), "dest": str(dest), **request})
        assert not cache.exists() and not dest.exists()


# --------------------------------------------------------------------------- the bootstrap

AUDITED = r"""
import json, os, sys
bindir, seen = sys.argv[1], []
def hook(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].startswith(bindir):
        seen.append(args[0][len(bindir) + 1:])
sys.addaudithook(hook)
leave = os._exit                 # the shim leaves with os._exit, past atexit
def report_and_leave(code):
    sys.stderr.write("OPENED " + json.dumps(seen) + "\n")
    sys.stderr.flush()
    leave(code)
os._exit = report_and_leave
exec(compile(sys.argv[2], "<bootstrap>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


def test_the_bootstrap_runs_the_shim_from_the_bytes_it_hashed(local_agent, tmp_path):
    agent = local_agent(False)                        # ships bin/
    bindir = agent.paths.bindir
    request = {"bindir": bindir, "dirs": [], "files": {n: hashlib.sha256(d).hexdigest()
                                                       for n, d in shipped().items()}}
    then = {"commands": {"info": {}, "status": {"piddir": agent.paths.piddir, "tag_prefix": "sd:",
                                                "cluster_dir": agent.paths.root}}}

    done = subprocess.run([sys.executable, "-c", AUDITED, bindir, BOOTSTRAP], capture_output=True,
                          input=(json.dumps(request) + "\n" + json.dumps(then) + "\n").encode(),
                          timeout=60, cwd=tmp_path)

    lines = [json.loads(x) for x in done.stdout.splitlines()]
    assert done.returncode == 0 and lines[0] == {"stale": [], "bindir": bindir}, done.stderr
    assert lines[1]["answers"]["status"] == [] and lines[1]["answers"]["info"]["python_version"]
    opened = json.loads(done.stderr.decode().split("OPENED ", 1)[1])
    # each shipped file read once, for its hash: the shim and its siblings ran from those bytes
    assert sorted(opened) == sorted(SHIPPED)


# --------------------------------------------------------------------------- B connects

def python_for(user) -> str:
    """An interpreter the other user may run (the shim needs only the standard library)."""
    for candidate in (sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3",
                      shutil.which("python3") or ""):
        try:
            if candidate and user.run([candidate, "-c", "pass"]).returncode == 0:
                return candidate
        except OSError:                               # e.g. under /root, which B may not enter
            continue
    pytest.skip(f"no Python that {user.name} may run")


class AsUser(LocalTransport):
    """This machine, with every command run as another user: a host B connects to."""

    def __init__(self, user) -> None:
        super().__init__("lab")
        self.user = user

    def run(self, argv, input: bytes = b"", timeout: float = 60.0):
        from tfcluster.transport.base import Result

        done = subprocess.run(list(argv), input=input, capture_output=True, timeout=timeout,
                              user=self.user.uid, group=self.user.gid, extra_groups=[],
                              env=self.user.env(), cwd=self.user.home)
        return Result(done.returncode, done.stdout, done.stderr)


def as_other_user(user, cluster: str) -> HostAgent:
    """A host agent whose every command runs as `user`: never in this process (which
    tfcluster does for a local host on its own interpreter, where that interpreter is one
    the other user may run too), but through the bootstrap, as on a host they log in to."""
    return HostAgent("lab", AsUser(user), python_for(user), cluster, in_process=False)


@pytest.fixture
def root_made():
    """A directory of /tmp made by root; its mode is the test's to set."""
    path = Path("/tmp") / f"tfc-rootmade-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    shutil.rmtree(path)


def test_a_world_writable_workdir_is_refused_for_another_user_too(other_user, root_made):
    root_made.chmod(0o777)
    agent = as_other_user(other_user, f"{root_made}/lab")

    with pytest.raises(PreflightError) as refused:
        agent.prepare()

    assert refused.value.exit_code == 4
    assert str(refused.value) == (f"host lab: {root_made} is writable by others (mode 0777): refusing "
                                  f"to use it (chmod go-w {root_made}, or use a directory of your own)")
    assert list(root_made.iterdir()) == []


def test_a_directory_another_user_may_not_enter_is_refused_in_one_line(other_user, root_made):
    (root_made / "private").mkdir(mode=0o700)            # root's, under a 0755 directory
    agent = as_other_user(other_user, f"{root_made}/private/lab")

    with pytest.raises(PreflightError) as refused:       # was a PermissionError traceback
        agent.prepare()

    assert refused.value.exit_code == 4
    assert str(refused.value) == (f"host lab: {root_made}/private/lab: permission denied (a directory "
                                  f"above it is not yours to enter): use a directory of your own")


def test_a_sticky_root_directory_like_tmp_is_fine_and_the_tree_is_the_users_alone(other_user, root_made):
    root_made.chmod(0o1777)
    paths = ClusterPaths(f"{root_made}/w/lab")
    dirs = [paths.root, paths.bindir, paths.cache, paths.piddir, paths.runs]
    request = {"bindir": paths.bindir, "dirs": dirs, "files": {"shim.py": "0" * 64}}

    done = other_user.run([python_for(other_user), "-c", BOOTSTRAP], input=json.dumps(request) + "\n")

    assert json.loads(done.stdout.splitlines()[0]) == {"stale": ["shim.py"], "bindir": paths.bindir}
    for path in levels(root_made / "w", Path(paths.root)) + [Path(d) for d in dirs[1:]]:
        st = os.lstat(path)
        assert (st.st_uid, oct(stat.S_IMODE(st.st_mode))) == (other_user.uid, "0o700"), path


# --------------------------------------------------------------------------- this machine

def test_local_state_another_user_could_change_is_refused(shared, other_user, home, tmp_path):
    as_b(other_user, f"mkdir -p {shared}/state")
    spec = write_spec(tmp_path, tmp_path / "wd")

    result = tfc("down", str(spec), home=home, cwd=tmp_path, XDG_STATE_HOME=f"{shared}/state")

    assert result.returncode == 4, result.stderr
    assert f"local state: {shared} is owned by tfcother" in error_line(result)
    assert list((shared / "state").iterdir()) == []


def test_local_state_levels_are_0700_and_the_lock_is_never_a_link(home, tmp_path, monkeypatch):
    from tfcluster.launch.cluster import state
    spec = write_spec(tmp_path, tmp_path / "wd")
    xdg = tmp_path / "xdg" / "st"
    result = tfc("down", str(spec), home=home, cwd=tmp_path, umask=0, XDG_STATE_HOME=str(xdg))
    assert result.returncode == 0, result.stderr
    cluster = xdg / "tfcluster" / state.key(build_plan(load_spec(str(spec))))
    made = levels(tmp_path / "xdg", cluster)
    assert {str(p): oct(mode(p)) for p in made} == {str(p): "0o700" for p in made}

    monkeypatch.setenv("XDG_STATE_HOME", str(xdg))
    target = tmp_path / "not-a-lock"
    target.write_text("keep me")
    lock = cluster / "lock"
    lock.unlink()                                     # the one `down` left
    lock.symlink_to(target)
    with pytest.raises(PreflightError, match="local state: cannot open .*/lock"):
        state.ClusterLock(cluster.name, "up").__enter__()
    assert target.read_text() == "keep me"


def test_saved_runs_are_private_and_never_written_through_a_link(shared, other_user, tmp_path):
    from tfcluster.watch.logmux import LogMux

    old = os.umask(0)
    try:
        LogMux(open(os.devnull, "wb"), ["worker:0"], color=False, save_dir=str(tmp_path / "a" / "runs" / "r1")).close()
    finally:
        os.umask(old)
    made = levels(tmp_path / "a", tmp_path / "a" / "runs" / "r1")
    assert {str(p): oct(mode(p)) for p in made} == {str(p): "0o700" for p in made}

    target = tmp_path / "elsewhere.log"
    target.write_text("keep me")
    (tmp_path / "a" / "runs" / "r2").mkdir(mode=0o700)
    (tmp_path / "a" / "runs" / "r2" / "worker-0.log").symlink_to(target)
    with pytest.raises(OSError):
        LogMux(open(os.devnull, "wb"), ["worker:0"], color=False, save_dir=str(tmp_path / "a" / "runs" / "r2"))
    assert target.read_text() == "keep me"

    as_b(other_user, f"mkdir -p {shared}/runs")       # --runs-dir somebody else made
    with pytest.raises(PreflightError, match=f"runs: {shared}/runs is owned by tfcother"):
        LogMux(open(os.devnull, "wb"), ["worker:0"], color=False, save_dir=f"{shared}/runs/r1")
    assert list((shared / "runs").iterdir()) == []


def test_init_never_writes_through_a_dangling_link_and_names_a_missing_directory(home, tmp_path):
    link = tmp_path / "dl.py"
    link.symlink_to(tmp_path / "created_via_link.py")

    through_link = tfc("init", "classic", str(link), home=home, cwd=tmp_path)
    no_parent = tfc("init", "classic", str(tmp_path / "missing" / "t.py"), home=home, cwd=tmp_path)

    assert through_link.returncode == 2 and "already exists" in error_line(through_link)
    assert not (tmp_path / "created_via_link.py").exists()
    assert no_parent.returncode == 2
    assert f"no directory {tmp_path / 'missing'}" in error_line(no_parent)


# --------------------------------------------------------------------------- over SSH

def test_over_ssh_a_shared_workdir_is_refused_naming_the_host(shared, other_user, ssh_home, sshd,
                                                               home, tmp_path):
    workdir = shared / "w"
    as_b(other_user, f"mkdir -p {workdir}")
    spec = write_spec(tmp_path, workdir, python=sys.executable, address="127.0.0.2",
                      extra=f"ssh:\n  port: {sshd.port}\n  connect_timeout: 5\n")

    result = tfc("plan", "--check", str(spec), home=home, cwd=tmp_path)

    assert result.returncode == 4, result.stderr
    assert f"host lab: {shared} is owned by tfcother" in error_line(result)
    assert list(workdir.iterdir()) == []


def test_over_ssh_the_tree_is_0700_and_a_wrong_cache_file_is_uploaded_again(ssh_home, sshd, tmp_path,
                                                                             monkeypatch):
    import tfcluster.launch.agent.agent as agent_module
    from tests.sshd import make_target
    from tfcluster.transport.ssh import SshTransport

    monkeypatch.setattr(agent_module, "INLINE_LIMIT", 0)      # the SFTP upload path
    paths = ClusterPaths(str(tmp_path / "remote" / "sd"))
    agent = HostAgent("h2", SshTransport(*make_target("h2", "127.0.0.2", sshd)), sys.executable, paths)
    try:
        agent.prepare()
        made = levels(tmp_path / "remote", Path(paths.root)) + [
            Path(d) for d in (paths.bindir, f"{paths.bindir}/probe", paths.cache, paths.piddir, paths.runs)]
        assert {str(p): oct(mode(p)) for p in made} == {str(p): "0o700" for p in made}
        marker = tmp_path / "ran"
        cached = Path(paths.cache) / hashlib.sha256(GOOD).hexdigest()
        cached.write_bytes(evil(marker))

        assert agent.sync_files([("train.py", GOOD, 0o600)], paths.rundir("r1")) == len(GOOD)

        assert (Path(paths.rundir("r1")) / "train.py").read_bytes() == GOOD
        assert cached.read_bytes() == GOOD and not marker.exists()
    finally:
        agent.close()
