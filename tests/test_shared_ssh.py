"""Issue 10 over SSH as the second user: tfcluster (run by root here) logs in to the loopback
sshd as `tfcother`, whose interpreter is the system Python (the shim needs nothing else), and
meets what another user left on the host."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import SESSION_VAR, tfcluster, wait_for
from tfcluster.host import shim_procs

SYSTEM_PYTHON = "/usr/bin/python3"
ADDRESS = "127.0.0.9"

# tfcother's ~/.ssh/authorized_keys is one file for every xdist worker, and each worker's sshd
# fixture has a key of its own: the module's tests share one worker, or one worker's fixture
# replaces the key another's tests log in with.
pytestmark = [pytest.mark.ssh, pytest.mark.timeout(120), pytest.mark.xdist_group("tfcother_keys")]


@pytest.fixture(scope="module")
def other_sshd(sshd_factory, other_user):
    """An sshd that reads each user's own ~/.ssh/authorized_keys; tfcother's holds the test key."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"{SYSTEM_PYTHON} is needed as tfcother's interpreter")
    ssh_dir = Path(other_user.home) / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    keys = ssh_dir / "authorized_keys"
    keys.write_text(Path(sshd_factory.user_key).with_suffix(".pub").read_text())
    for path in (ssh_dir, keys):
        os.chown(path, other_user.uid, other_user.gid)
    keys.chmod(0o600)
    return sshd_factory((ADDRESS,), AuthorizedKeysFile="%h/.ssh/authorized_keys")


def spec_as_other(tmp_path: Path, sshd, home: Path, workdir: str, name: str = "lab") -> Path:
    key = home / "id_other"
    shutil.copyfile(sshd.user_key, key)
    key.chmod(0o600)
    sshd.write_known_hosts(home / "kh", (ADDRESS,))
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(
        f"name: {name}\npython: {SYSTEM_PYTHON}\nworkdir: {workdir}\n"
        f"ssh: {{user: tfcother, port: {sshd.port}, identity_file: {key}, known_hosts: {home / 'kh'},"
        f" connect_timeout: 5}}\n"
        f"hosts: [{{name: shared, address: {ADDRESS}}}]\n"
        f"jobs: {{ps: {{tasks: ['shared:22400']}}, worker: {{tasks: ['shared:22401']}}}}\n")
    return spec


def test_a_world_writable_workdir_made_by_another_user_is_refused_over_ssh(tmp_path, home, other_sshd,
                                                                           other_user):
    shared = Path(f"/tmp/tfc-shared-{os.getpid()}-{time.monotonic_ns()}")
    shared.mkdir()
    try:
        shared.chmod(0o777)                           # root's, open to all, not sticky
        spec = spec_as_other(tmp_path, other_sshd, home, str(shared))
        result = tfcluster("plan", "--check", str(spec), home=home, cwd=tmp_path, timeout=90)
        assert result.returncode == 4, result.stdout + result.stderr
        error = [line for line in result.stderr.splitlines() if line.startswith("tfcluster: error:")]
        assert error and "shared" in error[0] and str(shared) in error[0], result.stderr
        assert f"writable by others (mode 0777): refusing to use it (chmod go-w {shared}" in error[0]
        assert list(shared.iterdir()) == []           # nothing was written into it
        down = tfcluster("down", str(spec), home=home, cwd=tmp_path, timeout=90)
        assert down.returncode == 4 and error[0] in down.stderr, down.stderr   # the same refusal
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_as_the_other_user_exec_and_down_work_and_leave_roots_identically_tagged_process(
        tmp_path, home, other_sshd, other_user):
    workdir = f"{other_user.home}/.tfcluster-test-{os.getpid()}"
    spec = spec_as_other(tmp_path, other_sshd, home, workdir)
    who = tfcluster("exec", str(spec), "--", "id", "-un", home=home, cwd=tmp_path, timeout=90)
    assert who.returncode == 0 and "tfcother" in who.stdout, who.stdout + who.stderr
    # A root process carrying exactly the tag tfcother's cluster `lab` would give its server.
    tag = shim_procs.qualify("lab:up-x:ps:0:server", os.path.realpath(f"{workdir}/lab"))
    env = {**os.environ, "TFCLUSTER_JOB_ID": tag, SESSION_VAR: os.environ[SESSION_VAR]}
    root_task = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env,
                                 start_new_session=True)
    try:
        wait_for(lambda: f"TFCLUSTER_JOB_ID={tag}".encode() in
                 open(f"/proc/{root_task.pid}/environ", "rb").read(), 10, what="the tagged process")
        down = tfcluster("down", str(spec), home=home, cwd=tmp_path, timeout=90)
        assert down.returncode == 0, down.stdout + down.stderr
        assert root_task.poll() is None and psutil.pid_exists(root_task.pid)   # not tfcother's to stop
    finally:
        root_task.kill()
        root_task.wait(10)
        subprocess.run(["rm", "-rf", workdir], check=False, timeout=30)
