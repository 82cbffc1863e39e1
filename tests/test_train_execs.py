"""How many remote executions `train` costs per host, counted over real SSH
(tests/sshd.py): the spec's `python:` is a wrapper that notes each interpreter start with
the address it was reached at, then execs the real interpreter. No mocks."""
from __future__ import annotations

import os
import stat
import sys
from collections import Counter

import pytest

from tests.helpers import ssh_spec, tagged_processes, tfcluster
from tests.sshd import SFTP_SERVER

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(240)]

WRAPPER = """#!/bin/sh
case "$1" in -S) first="$2" second="$3" ;; *) first="$1" second="$2" ;; esac
case "$first" in
  -c) what=bootstrap ;;
  */shim.py) what="shim $second" ;;
  *) what="task $(basename "$first")" ;;
esac
echo "$(echo "$SSH_CONNECTION" | cut -d' ' -f3) $what" >> %(log)s
exec %(python)s "$@"
"""


def _execs(log) -> dict[str, Counter]:
    """server address -> Counter of what started there (bootstrap, shim CMD, task NAME)."""
    seen: dict[str, Counter] = {}
    for line in log.read_text().splitlines():
        address, _, what = line.partition(" ")
        seen.setdefault(address, Counter())[what] += 1
    log.write_text("")
    return seen


def test_a_warm_host_runs_the_script_in_one_exec_and_a_changed_script_still_ships(
        tmp_path, home, ssh_home, sshd):
    log = tmp_path / "execs.log"
    wrapper = tmp_path / "py"
    wrapper.write_text(WRAPPER % {"log": log, "python": sys.executable})
    wrapper.chmod(stat.S_IRWXU)
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello-v1', os.environ['TFCLUSTER_TASK_INDEX'])\n")
    spec = ssh_spec(tmp_path, sshd, name="execs", train=f"train:\n  mode: mirrored\n  script: {script}\n")
    text = spec.read_text().replace(f"python: {sys.executable}", f"python: {wrapper}")
    spec.write_text(text.replace("  ps: {tasks: ['h2:", "  # ps: {tasks: ['h2:"))   # workers on h3, h4
    cwd = tmp_path / "cwd"
    cwd.mkdir()

    def train(version: str) -> dict[str, Counter]:
        result = tfcluster("train", str(spec), home=home, cwd=cwd, timeout=120)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        for index in ("0", "1"):
            assert f"worker:{index} │ hello-{version} {index}" in result.stdout, result.stdout[-3000:]
        return _execs(log)

    train("v1")                         # a cold host: the shim and the script are shipped
    warm = train("v1")
    # The script's host: one exec, the bootstrap, which placed the script from the cache, ran
    # the held start and held the host's side of reachability; then the task itself.
    for address in ("127.0.0.3", "127.0.0.4"):
        assert warm[address] == Counter({"bootstrap": 1, "task hello.py": 1}), warm
    assert sorted(warm) == ["127.0.0.3", "127.0.0.4"], warm     # h2 runs no task: not a host of the plan

    script.write_text("import os\nprint('hello-v2', os.environ['TFCLUSTER_TASK_INDEX'])\n")
    stale = train("v2")                 # the new content crosses the network and is the one run
    for address in ("127.0.0.3", "127.0.0.4"):
        assert stale[address] == Counter({"bootstrap": 1, "shim files": 1, "task hello.py": 1}), stale
        assert sum(stale[address].values()) == sum(warm[address].values()) + 1
    assert not tagged_processes()
    assert not [p for p in os.listdir(tmp_path / "remote" / "execs" / "pids")]


def test_a_cold_host_gets_its_shim_files_in_one_sftp_session(tmp_path, home, ssh_home, sshd_factory):
    """Every SFTP session is a subsystem the host starts through the login shell: a cold
    host's stale shim files go in one session, not one each (the sshd's sftp-server is a
    wrapper that notes each start)."""
    log = tmp_path / "sftp.log"
    wrapper = tmp_path / "sftp-server"
    wrapper.write_text(f"#!/bin/sh\necho \"$(echo \"$SSH_CONNECTION\" | cut -d' ' -f3)\" >> {log}\n"
                       f"exec {SFTP_SERVER} \"$@\"\n")
    wrapper.chmod(stat.S_IRWXU)
    server = sshd_factory(Subsystem=f"sftp {wrapper}")
    server.write_known_hosts(ssh_home / "known_hosts", mode="a")
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    spec = ssh_spec(tmp_path, server, name="coldsftp", train=f"train:\n  mode: mirrored\n  script: {script}\n")
    spec.write_text(spec.read_text().replace("  ps: {tasks: ['h2:", "  # ps: {tasks: ['h2:"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = tfcluster("train", str(spec), home=home, cwd=cwd, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sessions = Counter(log.read_text().split())
    # one session per cold host, never one per file. h3 and h4 are one machine with one workdir:
    # a host whose bootstrap runs after the other's upload finds nothing stale and opens none.
    assert sessions and set(sessions) <= {"127.0.0.3", "127.0.0.4"}, sessions
    assert set(sessions.values()) == {1}, sessions
    assert (tmp_path / "remote" / "coldsftp" / "bin" / "shim.py").exists()
    assert not tagged_processes()
