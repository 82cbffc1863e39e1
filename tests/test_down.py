"""`down` in one remote execution per warm host (HostAgent.down + shim.cmd_down), counted on a
real OpenSSH sshd's own log, and a port that a surviving process holds still reported.

The tasks are a stand-in for tfserver.py (no TensorFlow: this is about down's round trips):
the spec's `python:` is a wrapper that runs STANDIN for tfserver.py and the real
interpreter for everything else, as benchmarks/scale_up.py does."""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import STANDIN, bindable, state_path, tagged_processes, tfcluster, wait_for
from tests.tf_launch import free_ports

pytestmark = [pytest.mark.timeout(180)]

ADDRESSES = ("127.0.0.8", "127.0.0.9")


PYWRAP = '''#!/bin/sh
case "$1" in */tfserver.py) shift; exec {python} {standin} "$@";; esac
exec {python} "$@"
'''


@pytest.fixture(scope="module")
def verbose_sshd(sshd_factory):
    """Its own sshd, LogLevel VERBOSE: one line per connection and one per session."""
    return sshd_factory(ADDRESSES, LogLevel="VERBOSE")


@pytest.fixture
def cwd(tmp_path):
    d = tmp_path / "cwd"
    d.mkdir()
    return d


def spec_on(tmp: Path, sshd, name: str, env: str = "") -> tuple[Path, list[int]]:
    """Two hosts, 1 ps + 3 workers (two tasks each), stand-in servers."""
    standin = tmp / "standin.py"
    standin.write_text(STANDIN)
    wrapper = tmp / "pywrap"
    wrapper.write_text(PYWRAP.format(python=sys.executable, standin=standin))
    wrapper.chmod(0o755)
    p = free_ports(4)
    h8, h9 = (f"h{a.rsplit('.', 1)[1]}" for a in ADDRESSES)
    path = tmp / f"{name}.yaml"
    path.write_text(
        f"name: {name}\npython: {wrapper}\nworkdir: {tmp / 'remote'}\n{env}"
        f"ssh:\n  port: {sshd.port}\n  connect_timeout: 5\n"
        f"hosts:\n  - {{name: {h8}, address: {ADDRESSES[0]}}}\n  - {{name: {h9}, address: {ADDRESSES[1]}}}\n"
        f"jobs:\n  ps: {{tasks: ['{h8}:{p[0]}']}}\n"
        f"  worker: {{tasks: ['{h8}:{p[1]}', '{h9}:{p[2]}', '{h9}:{p[3]}']}}\n")
    return path, p


def sessions_per_host(log: str, since: int) -> dict[str, list[str]]:
    """listen address -> the kinds of sessions (`command`, `subsystem 'sftp'`) opened on it
    after byte `since` of an sshd's VERBOSE log."""
    text = Path(log).read_bytes()[since:].decode(errors="replace")
    on = dict(re.findall(r"Connection from \S+ port (\d+) on (\S+) port \d+", text))
    found: dict[str, list[str]] = {}
    for kind, client_port in re.findall(r"Starting session: (command|subsystem '\w+'|shell) .*? port (\d+)", text):
        found.setdefault(on.get(client_port, "?"), []).append(kind)
    return found


def log_size(sshd) -> int:
    return os.path.getsize(sshd.log)


def run_down(spec: Path, home: Path, cwd: Path, sshd):
    since = log_size(sshd)
    down = tfcluster("down", str(spec), home=home, cwd=cwd)
    return down, sessions_per_host(sshd.log, since)


def test_down_is_one_exec_per_warm_host(tmp_path, home, ssh_home, verbose_sshd, cwd):
    verbose_sshd.write_known_hosts(ssh_home / "known_hosts", mode="a")
    spec, ports = spec_on(tmp_path, verbose_sshd, "onex")
    up = tfcluster("up", str(spec), home=home, cwd=cwd)
    assert up.returncode == 0, up.stderr
    assert len(tagged_processes()) == 4 and not any(bindable(p) for p in ports)

    down, sessions = run_down(spec, home, cwd, verbose_sshd)

    assert down.returncode == 0, down.stderr
    assert sessions == {a: ["command"] for a in ADDRESSES}, sessions   # no SFTP, no second exec
    # the two "hosts" are one machine: each process is counted once, whichever stop saw it
    counts = [int(n) for n in re.findall(r"stopped (\d+) process", down.stderr)]
    assert sum(counts) == 4, down.stderr
    assert "is down" in down.stderr
    assert not tagged_processes() and all(bindable(p) for p in ports)

    again, sessions = run_down(spec, home, cwd, verbose_sshd)
    assert again.returncode == 0 and again.stderr.count("nothing running") == 2, again.stderr
    assert sessions == {a: ["command"] for a in ADDRESSES}, sessions


def test_a_port_a_surviving_process_holds_is_reported_busy_and_state_kept(
        tmp_path, home, ssh_home, verbose_sshd, cwd):
    verbose_sshd.write_known_hosts(ssh_home / "known_hosts", mode="a")
    escape_pidfile = tmp_path / "escapee.pid"
    spec, ports = spec_on(tmp_path, verbose_sshd, "survivor")
    held = ports[3]                                      # worker:2 on h9
    spec.write_text(spec.read_text().replace(
        "ssh:\n", f"env:\n  ESCAPE_PORT: '{held}'\n  ESCAPE_PIDFILE: {escape_pidfile}\nssh:\n", 1))
    escapee = None
    try:
        up = tfcluster("up", str(spec), home=home, cwd=cwd)
        assert up.returncode == 0, up.stderr
        escapee = int(wait_for(lambda: escape_pidfile.exists() and escape_pidfile.read_text(), timeout=30,
                               what="the escaped child's pid"))
        assert escapee not in tagged_processes() and psutil.pid_exists(escapee)
        state = state_path(home, spec)
        assert state.exists()

        t0 = time.monotonic()
        down, sessions = run_down(spec, home, cwd, verbose_sshd)
        took = time.monotonic() - t0

        assert down.returncode == 1, down.stderr
        assert f"ports still busy: h9:{held} (pid {escapee} " in down.stderr, down.stderr
        assert "down leaves the holders named alone" in down.stderr      # not "once reachable"
        assert "survivors" not in down.stderr and "unreachable" not in down.stderr
        assert sessions == {a: ["command"] for a in ADDRESSES}, sessions   # the wait ran on the host
        assert took < 60, took                                          # bounded by the settle time
        assert not tagged_processes() and psutil.pid_exists(escapee)    # the tagged ones stopped
        assert all(bindable(p) for p in ports if p != held) and not bindable(held)
        assert state.exists()                                           # not fully down: kept
    finally:
        if escapee is not None:
            try:
                os.kill(escapee, signal.SIGKILL)
            except ProcessLookupError:
                pass
            wait_for(lambda: not _alive(escapee), timeout=15, what="the escaped child to go")
    wait_for(lambda: bindable(held), timeout=15, what="the held port to be free")
    final = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert final.returncode == 0, final.stderr
    assert not state.exists() and not tagged_processes()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_cold_host_ships_its_files_then_takes_one_more_exec(tmp_path, home, ssh_home, verbose_sshd, cwd):
    verbose_sshd.write_known_hosts(ssh_home / "known_hosts", mode="a")
    spec, _ports = spec_on(tmp_path, verbose_sshd, "cold")       # a fresh workdir: nothing shipped yet
    down, sessions = run_down(spec, home, cwd, verbose_sshd)
    assert down.returncode == 0 and down.stderr.count("nothing running") == 2, down.stderr
    # The two hosts are one machine with one workdir: whichever bootstrap looks after the
    # other's SFTP wrote the files finds them there (one exec, as warm); at least one ships.
    cold = [a for a in ADDRESSES if sessions[a] != ["command"]]
    assert cold, sessions
    for address in cold:            # the bootstrap, an SFTP session per shipped file, the batch
        kinds = sessions[address]
        assert kinds[0] == kinds[-1] == "command" and kinds.count("command") == 2, sessions
        assert set(kinds[1:-1]) == {"subsystem 'sftp'"}, sessions
    _again, sessions = run_down(spec, home, cwd, verbose_sshd)
    assert sessions == {a: ["command"] for a in ADDRESSES}, sessions


def test_two_hosts_of_one_machine_stopping_the_same_servers_count_each_once(
        tmp_path, home, ssh_home, verbose_sshd, cwd):
    """Servers that take 1.5 s to exit once TERMed: both hosts' stops (run at once) find all
    four alive and both answer them; down counts each process once, under h8."""
    verbose_sshd.write_known_hosts(ssh_home / "known_hosts", mode="a")
    spec, ports = spec_on(tmp_path, verbose_sshd, "slow", env="env: {LINGER: '1.5'}\n")
    up = tfcluster("up", str(spec), home=home, cwd=cwd)
    assert up.returncode == 0, up.stderr

    down, _ = run_down(spec, home, cwd, verbose_sshd)

    assert down.returncode == 0, down.stderr
    assert "h8: stopped 4 process(es)" in down.stderr, down.stderr
    assert "h9: nothing more running (the same machine as h8)" in down.stderr, down.stderr
    assert not tagged_processes() and all(bindable(p) for p in ports)
