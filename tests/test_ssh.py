"""SshTransport against real OpenSSH sshds on loopback (tests/sshd.py)."""
from __future__ import annotations

import os
import random
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import traceback
import uuid

import pytest

from tests.helpers import assert_went_through_jump, connect_error, fingerprint, keygen, wait_for, where
from tests.sshd import Target, make_target
from tfcluster.errors import Cause, ConnectError, DeadlineError
from tfcluster.transport import make_transport
from tfcluster.transport.base import home_relative
from tfcluster.transport.options import SshOptions
from tfcluster.transport.ssh import MAX_CHANNEL_DIALS, SshTransport

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gpu0(ssh_home, sshd, transports) -> SshTransport:
    return transports(make_target("gpu0", "127.0.0.2", sshd))


def free_port(addr: str = "127.0.0.2") -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


# --- run / spawn / put --------------------------------------------------------------

def test_run_returns_stdout_stderr_and_exit_code_exactly(gpu0):
    r = gpu0.run(["sh", "-c", "printf 'out\\r\\n'; printf 'err' >&2; exit 3"])
    assert (r.rc, r.stdout, r.stderr) == (3, b"out\r\n", b"err")


def test_run_reads_5mb_on_both_pipes_without_deadlock(gpu0):
    five = 5 * 1024 * 1024
    r = gpu0.run(["sh", "-c", f"head -c {five} /dev/zero >&2; head -c {five} /dev/zero"])
    assert (r.rc, len(r.stdout), len(r.stderr)) == (0, five, five)
    data = os.urandom(five)
    assert gpu0.run(["cat"], input=data).stdout == data


def test_run_passes_hostile_arguments_byte_for_byte(gpu0, tmp_path):
    canary = tmp_path / "canary"
    args = ["a b", "it's", '"dq"', f"$(touch {canary})", f"`touch {canary}`",
            f"; touch {canary}", "*", "\n", "ünï\t", "", "-n"]
    r = gpu0.run(["printf", "%s\\0", *args])
    assert r.rc == 0
    assert r.stdout.split(b"\0")[:-1] == [a.encode() for a in args]
    assert not canary.exists()


def test_run_past_its_timeout_raises_naming_the_host(gpu0):
    with pytest.raises(DeadlineError, match=r"^host gpu0 \(127\.0\.0\.2:\d+\): .* within 0.5s"):
        gpu0.run(["sh", "-c", "while sleep 0.1; do echo tick; done"], timeout=0.5)


def test_spawn_streams_stdin_stdout_and_returns_exit_code(gpu0):
    proc = gpu0.spawn(["sh", "-c", "echo one; read x; echo got $x; echo oops >&2; exit 7"])
    assert proc.read() == b"one\n"
    assert proc.wait(0.1) is None
    proc.write(b"hello\n")
    proc.close_stdin()
    out = b""
    while chunk := proc.read():
        out += chunk
    assert out == b"got hello\n"
    assert proc.wait(10) == 7
    assert proc.read_stderr() == b"oops\n"
    proc.kill()
    proc.kill()                                   # idempotent


def test_spawn_kill_closes_the_channel(gpu0):
    proc = gpu0.spawn(["cat"])
    proc.kill()
    assert proc.wait(5) == -1                     # closed, no exit status
    assert proc.read() == b""
    with pytest.raises(BrokenPipeError):
        proc.write(b"x")


def test_ctrl_c_on_the_main_thread_never_lands_inside_paramiko_and_leaves_the_connection_whole(gpu0):
    """Real SIGINTs, at random moments, while the main thread spawns, writes to and kills
    channels as a run's start and stop do. Raised inside paramiko, one would leave a lock of
    the connection held and the next call on it waiting forever (transport/offmain.py). Each
    interrupt must land in this test's own code, and the connection must still serve."""
    proc = None
    armed, stop = threading.Event(), threading.Event()
    rnd = random.Random(7)

    def pester() -> None:     # one signal per arming, a little after it: during the calls
        while not stop.is_set():
            if armed.wait(0.1):
                armed.clear()
                time.sleep(rnd.uniform(0, 0.0004))
                os.kill(os.getpid(), signal.SIGINT)

    may_raise = [False]       # once per call: never inside the except clause below

    def raise_it(signum, frame):
        if may_raise[0]:
            may_raise[0] = False
            raise KeyboardInterrupt

    landed: list[str] = []
    calls = 0
    previous = signal.signal(signal.SIGINT, raise_it)
    thread = threading.Thread(target=pester, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15        # about 1 s here; a loaded machine gets longer
    try:
        while True:
            try:
                if len(landed) >= 1000 or time.monotonic() > deadline:
                    break
                calls += 1
                may_raise[0] = True
                armed.set()
                if proc is None or calls % 50 == 0:   # a channel's stop, then a new one
                    ending, proc = proc, None
                    if ending is not None:
                        ending.kill()
                    proc = gpu0.spawn(["cat"])
                proc.write(b"GO\n")
                time.sleep(0.0005)
            except KeyboardInterrupt as exc:
                landed.append(" > ".join(f"{f.filename}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)))
    finally:
        may_raise[0] = False
        stop.set()
        thread.join(5)
        signal.signal(signal.SIGINT, previous)
    inside = [where for where in landed if "/paramiko/" in where]
    # unguarded, about 4 in 5 landed inside paramiko: 200 and none there is no chance
    assert len(landed) >= 200, f"only {len(landed)} interrupts in {calls} calls: the check proves nothing"
    assert not inside, f"{len(inside)} of {len(landed)} interrupts landed inside paramiko, e.g. {inside[0]}"
    if proc is not None:
        proc.kill()
    answer = gpu0.run(["echo", "whole"], timeout=10)   # a lock left held would hang this (the test's timeout)
    assert answer.stdout == b"whole\n"


def test_put_writes_0600_file_atomically_under_an_absolute_path(gpu0, tmp_path):
    target = tmp_path / "a" / "b" / "run.json"
    gpu0.put(b"first", str(target))
    gpu0.put(b"second", str(target))             # replaces (posix_rename)
    assert target.read_bytes() == b"second"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert stat.S_IMODE(target.parent.stat().st_mode) == 0o700
    assert os.listdir(target.parent) == ["run.json"]   # no temp file left
    gpu0.put(b"#!/bin/sh\n", str(tmp_path / "x.sh"), mode=0o755)
    assert stat.S_IMODE((tmp_path / "x.sh").stat().st_mode) == 0o755


def test_a_host_whose_login_shell_prints_is_a_preflight_error_naming_it(sshd_factory, ssh_home, transports,
                                                                        tmp_path):
    """sshd starts sftp-server through the user's shell; a ~/.bashrc that echoes a banner
    puts words before the SFTP stream: paramiko's 'Garbage packet received' was all the
    user saw, exit 1. (The sessions of this sshd get a HOME of their own.)"""
    from tests.helpers import SESSION_VAR
    from tfcluster.errors import PreflightError

    banner_home = tmp_path / "banner-home"
    banner_home.mkdir()
    (banner_home / ".bashrc").write_text("echo 'Welcome to the lab. Quota: 93% used.'\n")
    noisy = sshd_factory(("127.0.0.4",), SetEnv=f"{SESSION_VAR}={os.environ[SESSION_VAR]} HOME={banner_home}")
    noisy.write_known_hosts(ssh_home / "known_hosts", mode="a")
    host = transports(make_target("noisy", "127.0.0.4", noisy))
    with pytest.raises(PreflightError) as info:
        host.put(b"x", str(tmp_path / "f"))
    assert info.value.exit_code == 4 and not (tmp_path / "f").exists()
    assert info.value.message.startswith(f"host noisy (127.0.0.4:{noisy.port}): its SFTP session did not "
                                         "start (")
    assert "login shell sshd runs it with prints to stdout" in info.value.message
    assert "[ -z \"$PS1\" ] && return" in info.value.hint


def test_a_host_without_sftp_is_a_preflight_error_that_says_so(sshd_factory, ssh_home, transports, tmp_path):
    """Its sshd refuses the subsystem by closing the channel ("Channel closed." was all
    the user saw, exit 3)."""
    from tfcluster.errors import PreflightError

    bare = sshd_factory(("127.0.0.4",), Subsystem="not-sftp /bin/false")
    bare.write_known_hosts(ssh_home / "known_hosts", mode="a")
    host = transports(make_target("nosftp", "127.0.0.4", bare))
    with pytest.raises(PreflightError) as info:
        host.put(b"x", str(tmp_path / "f"))
    assert info.value.exit_code == 4 and not (tmp_path / "f").exists()
    assert info.value.message == (f"host nosftp (127.0.0.4:{bare.port}): its sshd offers no SFTP, "
                                  "which tfcluster copies files with")
    assert "Subsystem sftp internal-sftp" in info.value.hint


def test_put_resolves_tilde_against_the_login_home(gpu0):
    remote_home = gpu0.run(["sh", "-c", 'printf %s "$HOME"']).stdout.decode()
    scratch = f".tfcluster-test-{uuid.uuid4().hex}"
    try:
        gpu0.put(b"data", f"~/{scratch}/sub/f.txt")
        path = os.path.join(remote_home, scratch, "sub", "f.txt")
        with open(path, "rb") as f:
            assert f.read() == b"data"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.listdir(os.path.dirname(path)) == ["f.txt"]
    finally:
        gpu0.run(["rm", "-rf", os.path.join(remote_home, scratch)])


# --- host keys --------------------------------------------------------------------

def test_unknown_host_key_is_rejected_with_one_line_and_a_hint(ssh_home, sshd, transports,
                                                                 tmp_path):
    kh = str(tmp_path / "empty_known_hosts")
    err = connect_error(transports(make_target("gpu0", "127.0.0.3", sshd, known_hosts=kh)))
    fp = fingerprint(sshd.host_key + ".pub")
    assert err.message == f"host gpu0 (127.0.0.3:{sshd.port}): unknown host key (ssh-ed25519 {fp})"
    assert err.hint == (f"run `ssh-keyscan -p {sshd.port} 127.0.0.3 >> {kh}` after checking "
                        "the fingerprint, or set ssh.host_key_policy: accept-new")
    assert err.cause is Cause.HOST_KEY
    assert not os.path.exists(kh)


def test_accept_new_records_the_key_in_a_new_0600_file(ssh_home, sshd, transports, tmp_path):
    kh = tmp_path / "fresh" / ".ssh" / "known_hosts"
    transports(make_target("gpu0", "127.0.0.3", sshd, known_hosts=str(kh),
                           host_key_policy="accept-new")).connect()
    assert kh.read_text() == sshd.known_hosts_line("127.0.0.3") + "\n"
    assert stat.S_IMODE(kh.stat().st_mode) == 0o600
    assert stat.S_IMODE(kh.parent.stat().st_mode) == 0o700
    # now known: `reject` connects, and nothing more is written
    transports(make_target("gpu0", "127.0.0.3", sshd, known_hosts=str(kh))).connect()
    assert kh.read_text() == sshd.known_hosts_line("127.0.0.3") + "\n"


def test_changed_host_key_is_refused_even_under_accept_new(ssh_home, sshd, transports, tmp_path):
    other = keygen(tmp_path / "other_host_key")
    with open(other + ".pub") as f:
        fake = " ".join(f.read().split()[:2])
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[127.0.0.3]:{sshd.port} {fake}\n")
    err = connect_error(transports(make_target("gpu0", "127.0.0.3", sshd, known_hosts=str(kh),
                                               host_key_policy="accept-new")))
    assert err.message.startswith(f"host gpu0 (127.0.0.3:{sshd.port}): host key CHANGED "
                                  f"(ssh-ed25519 {fingerprint(sshd.host_key + '.pub')}, "
                                  f"known_hosts has {fingerprint(other + '.pub')})")
    assert "possible man-in-the-middle" in err.message and err.cause is Cause.HOST_KEY
    assert kh.read_text() == f"[127.0.0.3]:{sshd.port} {fake}\n"


# --- failures name the host ----------------------------------------------------------

def test_wrong_key_fails_authentication_naming_host_and_user(ssh_home, sshd, transports,
                                                             tmp_path):
    wrong = keygen(tmp_path / "wrong_key")
    err = connect_error(transports(make_target("gpu0", "127.0.0.2", sshd, identity_file=wrong)))
    assert err.message.startswith(
        f"host gpu0 (127.0.0.2:{sshd.port}): authentication failed as user {sshd.user}")
    assert "identity_file" in err.hint and err.cause is Cause.AUTH


def test_closed_port_is_refused_naming_the_host(ssh_home, transports):
    port = free_port("127.0.0.2")
    err = connect_error(transports(Target("gpu0", "127.0.0.2", SshOptions(port=port))))
    assert err.message == (f"host gpu0 (127.0.0.2:{port}): connection refused "
                           "(is sshd running on that port?)")
    assert err.cause is Cause.REFUSED


def test_missing_identity_file_is_named(ssh_home, sshd, transports):
    err = connect_error(transports(make_target("gpu0", "127.0.0.2", sshd,
                                               identity_file="~/.ssh/nope")))
    assert err.message == f"host gpu0 (127.0.0.2:{sshd.port}): identity file ~/.ssh/nope not found"


# --- ~/.ssh/config and ProxyJump -----------------------------------------------------


def test_ssh_config_alias_gives_hostname_port_and_identity(ssh_home, sshd, transports):
    os.rename(ssh_home / "id_ed25519", ssh_home / "lab_key")   # only IdentityFile can work now
    (ssh_home / "config").write_text(
        f"Host lab3\n  HostName 127.0.0.3\n  Port {sshd.port}\n  IdentityFile ~/.ssh/lab_key\n"
        f"Host gpu4\n  Port {sshd.port}\n  IdentityFile ~/.ssh/lab_key\n")
    alias = transports(Target("gpu0", "lab3"))
    assert where(alias) == f"127.0.0.3:{sshd.port}"
    assert alias.label == f"gpu0 (127.0.0.3:{sshd.port})"
    by_name = transports(Target("gpu4", "127.0.0.4"))             # config found by host name
    assert where(by_name) == f"127.0.0.4:{sshd.port}"


def test_match_exec_in_ssh_config_still_works_though_paramiko_loads_without_invoke(tmp_path):
    """tfcluster imports paramiko without `invoke` (transport/_paramiko.py); a config with
    `Match exec` gets it back, so each block applies exactly when its command succeeds.
    (In a process of its own: invoke reads stdin, which pytest replaces.)"""
    config = tmp_path / "config"
    config.write_text('Match host lab3 exec "false"\n  HostName 127.0.0.9\n'
                      'Match host lab3 exec "test -d /"\n  HostName 127.0.0.3\n')
    config.chmod(0o600)
    code = ("import sys; from tfcluster.transport._paramiko import paramiko; "
            "print('invoke' in sys.modules); "
            "from tfcluster.transport.ssh_config import load_ssh_config; "
            f"print(load_ssh_config({str(config)!r}, system='').lookup('lab3')['hostname'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.stdout.split() == ["False", "127.0.0.3"], done.stdout + done.stderr


def test_explicit_options_win_over_ssh_config(ssh_home, sshd, transports):
    (ssh_home / "config").write_text(f"Host 127.0.0.4\n  Port {free_port('127.0.0.2')}\n  User nobody\n")
    t = transports(Target("gpu0", "127.0.0.4", SshOptions(port=sshd.port, user="root")))
    assert where(t) == f"127.0.0.4:{sshd.port}"


@pytest.fixture
def trust_jump(ssh_home, jump_sshd):
    jump_sshd.write_known_hosts(ssh_home / "known_hosts", mode="a")
    return jump_sshd


def test_spec_jump_host_tunnels_through_the_second_sshd(sshd, trust_jump, transports):
    t = transports(make_target("gpu0", "127.0.0.2", sshd,
                               jump_host=f"root@127.0.0.5:{trust_jump.port}"))
    assert where(t) == f"127.0.0.2:{sshd.port}"
    assert_went_through_jump(t, trust_jump)


def test_a_target_the_jump_host_cannot_connect_to_is_unreachable(sshd, trust_jump, transports):
    """The jump host's sshd answers the direct-tcpip open with OPEN_CONNECT_FAILED (paramiko
    keeps the code, not its words): a host down behind a jump is down too."""
    port = free_port("127.0.0.2")
    err = connect_error(transports(make_target("gpu0", "127.0.0.2", sshd, port=port,
                                               jump_host=f"root@127.0.0.5:{trust_jump.port}")))
    assert err.message == f"host gpu0 (127.0.0.2:{port}): jump host cannot reach it: Connect failed"
    assert err.cause is Cause.UNREACHABLE


def test_ssh_config_proxyjump_tunnels_through_the_second_sshd(ssh_home, sshd, trust_jump,
                                                              transports):
    (ssh_home / "config").write_text(
        "Host 127.0.0.4\n  ProxyJump bastion\n"
        f"Host bastion\n  HostName 127.0.0.5\n  Port {trust_jump.port}\n")
    t = transports(make_target("gpu0", "127.0.0.4", sshd))
    assert where(t) == f"127.0.0.4:{sshd.port}"
    assert_went_through_jump(t, trust_jump)


def test_unreachable_jump_host_is_named(ssh_home, sshd, transports):
    port = free_port("127.0.0.5")
    err = connect_error(transports(make_target("gpu0", "127.0.0.2", sshd,
                                               jump_host=f"127.0.0.5:{port}")))
    assert err.message == (f"host gpu0 (127.0.0.2:{sshd.port}): via jump host 127.0.0.5 "
                           f"(127.0.0.5:{port}): connection refused (is sshd running on that port?)")
    assert err.cause is Cause.REFUSED       # the jump host's, as without a jump


# --- concurrency --------------------------------------------------------------------

def connect_concurrently(ts: list[SshTransport], join_s: float) -> list[BaseException]:
    """connect() every transport at once, each on its own thread; the errors raised."""
    errors: list[BaseException] = []

    def connect(t):
        try:
            t.connect()
        except BaseException as e:   # noqa: BLE001 - reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=connect, args=(t,)) for t in ts]
    for th in threads:
        th.start()
    for th in threads:
        th.join(join_s)
    return errors


def test_twenty_concurrent_connects_to_one_sshd_all_succeed(ssh_home, sshd, transports):
    hosts = [make_target(f"h{i}", sshd.addresses[i % 3], sshd) for i in range(20)]
    ts = [transports(h) for h in hosts]
    started = time.monotonic()
    errors = connect_concurrently(ts, 30)
    elapsed = time.monotonic() - started
    assert errors == []
    assert all(len(t.connections) == 1 and t.connections[0].active() for t in ts)
    print(f"20 concurrent connects: {elapsed:.2f}s")


def test_handshakes_dropped_by_maxstartups_are_retried(ssh_home, sshd_factory, transports):
    strict = sshd_factory(("127.0.0.6",), MaxStartups=5)   # below our cap of 8: drops
    strict.write_known_hosts(ssh_home / "known_hosts", mode="a")
    ts = [transports(make_target(f"h{i}", "127.0.0.6", strict)) for i in range(12)]
    assert connect_concurrently(ts, 60) == []


def test_more_channels_than_maxsessions_open_extra_connections(ssh_home, jump_sshd, transports):
    jump_sshd.write_known_hosts(ssh_home / "known_hosts", mode="a")
    t = transports(make_target("j", "127.0.0.5", jump_sshd))      # MaxSessions 4 there
    procs = [t.spawn(["cat"]) for _ in range(12)]
    for i, p in enumerate(procs):
        p.write(b"%d\n" % i)
    for i, p in enumerate(procs):
        assert p.read() == b"%d\n" % i
        p.close_stdin()
    assert [p.wait(10) for p in procs] == [0] * 12
    assert len(t.connections) >= 3


def test_a_host_refusing_every_session_gives_up_after_a_few_new_connections(
        ssh_home, sshd_factory, transports):
    closed = sshd_factory(("127.0.0.7",), MaxSessions=0)      # authenticates, then no sessions
    closed.write_known_hosts(ssh_home / "known_hosts", mode="a")
    t = transports(make_target("shut", "127.0.0.7", closed))
    t.connect()
    with pytest.raises(ConnectError) as info:
        t.run(["true"], timeout=10)
    assert info.value.message.startswith(
        f"host shut (127.0.0.7:{closed.port}): no session channel after {MAX_CHANNEL_DIALS} "
        "new connections: ")
    assert not info.value.message.endswith(": ")              # sshd's reason ends the line
    assert "MaxSessions" in info.value.hint
    assert len(t.connections) == 1 + MAX_CHANNEL_DIALS             # connect()'s, then the bound


# --- packaging ----------------------------------------------------------------------

def test_importing_the_transport_package_does_not_import_paramiko():
    code = ("import sys, tfcluster.transport, tfcluster.transport.ssh_config, "
            "tfcluster.transport.ssh_connect, tfcluster.transport.ssh; "
            "sys.exit('paramiko' in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_the_transport_package_knows_nothing_of_the_spec():
    code = ("import sys, tfcluster.transport, tfcluster.transport.ssh, tfcluster.transport.local; "
            "sys.exit(sorted(m for m in ('tfcluster.spec', 'tfcluster.plan', 'tfcluster.launch.cluster.state') "
            "if m in sys.modules) or 0)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_make_transport_picks_ssh_or_local(sshd):
    name, address, options = make_target("gpu0", "127.0.0.2", sshd)
    ssh = make_transport(name, address, local=False, ssh=options)
    assert isinstance(ssh, SshTransport) and ssh.options == options
    from tfcluster.transport.local import LocalTransport

    local = make_transport("me", "localhost", local=True)
    assert isinstance(local, LocalTransport) and local.is_local
    assert local.run(["echo", "hi"]).stdout == b"hi\n"
    local.close()


def test_home_relative_paths_are_exactly_tilde_and_tilde_slash():
    assert [home_relative(p) for p in ("~", "~/", "~/a/b", "~//a")] == [".", ".", "a/b", "a"]
    assert [home_relative(p) for p in ("~user/a", "/abs/~/a", "rel", "$HOME/a")] == [None] * 4


def test_local_put_resolves_tilde_against_home_as_ssh_does(home):
    local = make_transport("me", "localhost", local=True)
    local.put(b"data", "~/sub/f.txt")
    assert (home / "sub" / "f.txt").read_bytes() == b"data"
    assert stat.S_IMODE((home / "sub").stat().st_mode) == 0o700


def test_connect_is_idempotent_and_reuses_one_connection(gpu0):
    gpu0.connect()
    gpu0.connect()
    for _ in range(2):
        gpu0.run(["true"])
    assert len(gpu0.connections) == 1
    wait_for(lambda: all(c.active() for c in gpu0.connections), 5, what="connection alive")


@pytest.mark.alone     # ten handshakes against MaxStartups 2 and a 10 s connect timeout: a loaded machine's clock
def test_handshakes_dropped_by_maxstartups_print_no_paramiko_traceback(ssh_home, sshd_factory, tmp_path):
    """sshd drops connections past MaxStartups before its banner; tfcluster retries them. The
    transport threads of paramiko log each drop at ERROR with a traceback, and with no
    handler configured logging's last resort printed them (~10 lines a drop) on the user's
    terminal, even when every retry then succeeded."""
    from tests.helpers import cli_env

    strict = sshd_factory(("127.0.0.12",), MaxStartups=2)
    strict.write_known_hosts(ssh_home / "known_hosts", mode="a")
    hosts = "".join(f"  - {{name: h{i}, address: 127.0.0.12}}\n" for i in range(10))
    workers = ", ".join(f"'h{i}:{port}'" for i, port in enumerate(range(24700, 24710)))
    spec = tmp_path / "many.yaml"
    spec.write_text(f"name: many\npython: {sys.executable}\nworkdir: {tmp_path / 'remote'}\n"
                    f"ssh: {{port: {strict.port}, connect_timeout: 10}}\nhosts:\n{hosts}"
                    f"jobs:\n  worker: {{tasks: [{workers}]}}\ntrain: {{mode: mirrored, script: x.py}}\n")
    result = subprocess.run([sys.executable, "-m", "tfcluster", "status", str(spec)], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path, env=cli_env(ssh_home.parent))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(" stopped ") == 10, result.stdout
    assert "Traceback" not in result.stderr and "Exception (client)" not in result.stderr, result.stderr
