"""SSH as the user's ssh(1) would: ProxyCommand, the global known_hosts,
@revoked, HashKnownHosts and IdentitiesOnly, against the real loopback sshds
(tests/sshd.py), a real `ssh -W` proxy and a real ssh-agent."""
from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess

import psutil
import pytest

from tests.helpers import (
    assert_went_through_jump,
    connect_error,
    fingerprint,
    free_port,
    keygen,
    wait_for,
    where,
)
from tests.sshd import Target, make_target
from tfcluster.errors import ExitCode
from tfcluster.transport.ssh_config import GLOBAL_KNOWN_HOSTS, SYSTEM_CONFIG_VAR, SshOptions, load_ssh_config, resolve

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def reaped(sshd_factory):
    """Every process a test here starts (proxies, ssh-agent, their children) is gone and
    reaped once it ends; only the session's sshd listeners stay."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield

    def leftover() -> list[str]:
        keep = before | {s.proc.pid for s in sshd_factory.started}
        found = []
        for p in me.children(recursive=True):
            try:
                if p.pid not in keep:
                    found.append(f"{p.pid} {p.status()} {p.cmdline()}")
            except psutil.NoSuchProcess:
                pass
        return found
    wait_for(lambda: not leftover(), 10, what=f"our child processes to end: {leftover()}")


# --- ProxyCommand -------------------------------------------------------------------

def ssh_w(jump_sshd, tmp_path, log) -> str:
    """A ProxyCommand that is a real OpenSSH client: `ssh -W %h:%p` through the jump sshd,
    reading nothing of the real ~/.ssh (OpenSSH finds it by uid, not HOME)."""
    kh = jump_sshd.write_known_hosts(tmp_path / "proxy_known_hosts")
    return " ".join(["ssh", "-F", "/dev/null", "-E", str(log), "-v", "-i", jump_sshd.user_key,
                     "-p", str(jump_sshd.port), "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
                     "-o", f"UserKnownHostsFile={kh}", "-o", "GlobalKnownHostsFile=/dev/null",
                     "-W", "%h:%p", f"{jump_sshd.user}@127.0.0.5"])


def test_proxycommand_connects_through_ssh_w_on_the_jump_host(ssh_home, sshd, jump_sshd,
                                                              transports, tmp_path):
    log = tmp_path / "proxy.log"
    closed = free_port("127.0.0.3")               # the config's Port: the spec's must win in %p
    (ssh_home / "config").write_text(
        f"Host behind\n  HostName 127.0.0.3\n  Port {closed}\n"
        f"  ProxyCommand {ssh_w(jump_sshd, tmp_path, log)}\n")
    t = transports(make_target("gpu0", "behind", sshd))
    assert where(t) == f"127.0.0.3:{sshd.port}"
    conn = t.connections[0]
    assert conn.transport.sock.family == socket.AF_UNIX      # the proxy's stdio, not TCP
    proxy_pid = conn.proxy.proc.pid
    assert psutil.Process(proxy_pid).cmdline()[0] == "ssh"   # `exec` replaced the shell
    assert os.getsid(proxy_pid) == proxy_pid                  # its own session: no terminal
    text = log.read_text()
    assert f"Authenticated to 127.0.0.5 ([127.0.0.5]:{jump_sshd.port})" in text
    assert f"127.0.0.3:{sshd.port}" in text and str(closed) not in text
    t.close()
    assert not psutil.pid_exists(proxy_pid)                   # stopped and reaped


def test_a_proxy_that_dies_is_reaped_and_the_next_command_dials_a_new_one(
        ssh_home, sshd, jump_sshd, transports, tmp_path):
    (ssh_home / "config").write_text(
        f"Host 127.0.0.4\n  ProxyCommand {ssh_w(jump_sshd, tmp_path, tmp_path / 'log')}\n")
    t = transports(make_target("gpu0", "127.0.0.4", sshd))
    t.connect()
    first = t.connections[0]
    first.proxy.proc.kill()
    wait_for(lambda: not first.active(), 10, what="the connection to notice its proxy died")
    assert t.run(["echo", "again"]).stdout == b"again\n"
    assert first.proxy.proc.returncode is not None            # reaped when dropped
    assert t.connections[0] is not first and t.connections[0].proxy.proc.poll() is None


def test_a_proxycommand_that_exits_is_one_line_naming_host_and_command(ssh_home, sshd,
                                                                       transports):
    (ssh_home / "config").write_text(
        "Host 127.0.0.3\n  ProxyCommand sh -c 'echo no route to %h >&2; exit 7'\n"
        "Host 127.0.0.4\n  ProxyCommand /nonexistent/proxy %h %p\n")
    err = connect_error(transports(make_target("gpu0", "127.0.0.3", sshd)))
    assert err.exit_code == ExitCode.CONNECT
    assert err.message == (f"host gpu0 (127.0.0.3:{sshd.port}): ProxyCommand `sh -c 'echo no "
                           "route to 127.0.0.3 >&2; exit 7'` exited with status 7 before the "
                           "SSH handshake: no route to 127.0.0.3")
    assert "~/.ssh/config" in err.hint
    err = connect_error(transports(make_target("gpu1", "127.0.0.4", sshd)))
    assert err.message.startswith(f"host gpu1 (127.0.0.4:{sshd.port}): ProxyCommand "
                                  f"`/nonexistent/proxy 127.0.0.4 {sshd.port}` exited with "
                                  "status 127 before the SSH handshake: ")
    assert "/nonexistent/proxy" in err.message.split("handshake: ", 1)[1]   # the shell's words


def test_proxycommand_none_connects_directly(ssh_home, sshd, transports):
    (ssh_home / "config").write_text("Host 127.0.0.4\n  ProxyCommand none\n"
                                     "Host *\n  ProxyCommand /nonexistent/proxy %h\n")
    t = transports(make_target("gpu0", "127.0.0.4", sshd))
    assert where(t) == f"127.0.0.4:{sshd.port}"
    assert t.connections[0].proxy is None and t.connections[0].transport.sock.family == socket.AF_INET


@pytest.fixture
def bastion(ssh_home, jump_sshd):
    """`bastion` in ~/.ssh/config: the jump sshd, trusted, reached directly."""
    jump_sshd.write_known_hosts(ssh_home / "known_hosts", mode="a")
    return f"Host bastion\n  HostName 127.0.0.5\n  Port {jump_sshd.port}\n  ProxyCommand none\n"


def test_the_first_of_proxyjump_and_proxycommand_wins_as_in_ssh(ssh_home, sshd, jump_sshd,
                                                                bastion, transports):
    (ssh_home / "config").write_text(
        bastion + "Host 127.0.0.4\n  ProxyJump bastion\n"
        "Host 127.0.0.3\n  ProxyCommand /nonexistent/proxy %h\n"
        "Host *\n  ProxyCommand /nonexistent/proxy %h\n  ProxyJump bastion\n")
    t = transports(make_target("gpu0", "127.0.0.4", sshd))   # ProxyJump first: the jump
    assert where(t) == f"127.0.0.4:{sshd.port}"
    assert_went_through_jump(t, jump_sshd)
    err = connect_error(transports(make_target("gpu1", "127.0.0.3", sshd)))
    assert "ProxyCommand `/nonexistent/proxy 127.0.0.3`" in err.message


def test_the_spec_jump_host_beats_a_config_proxycommand_like_ssh_J(ssh_home, sshd, jump_sshd,
                                                                   bastion, transports):
    (ssh_home / "config").write_text(bastion +
                                     "Host 127.0.0.2\n  ProxyCommand /nonexistent/proxy\n")
    t = transports(make_target("gpu0", "127.0.0.2", sshd, jump_host="bastion"))
    assert where(t) == f"127.0.0.2:{sshd.port}"
    assert_went_through_jump(t, jump_sshd)


def test_proxycommand_tokens_and_unknown_tokens(home):
    config = home / "config"
    config.write_text("Host a\n  HostName 10.1.1.1\n  Port 99\n"
                      "  ProxyCommand nc %h %p # %r %n %%h\n"
                      "Host b\n  ProxyCommand nc %h %x\n")
    cfg = load_ssh_config(str(config), system="")
    ep = resolve("gpu", "a", SshOptions(port=2222, user="bob"), cfg)
    assert ep.proxy_command == "nc 10.1.1.1 2222 # bob a %h"
    with pytest.raises(Exception, match=r"^host b \(b:22\): ProxyCommand `nc %h %x`: "
                                        r"unknown token %x$"):
        resolve("b", "b", SshOptions(), cfg)


def test_a_config_others_may_write_is_refused_as_ssh_does(ssh_home, sshd, transports):
    config = ssh_home / "config"
    config.write_text("Host 127.0.0.2\n  ProxyCommand touch /tmp/should-never-run\n")
    config.chmod(0o664)
    err = connect_error(transports(make_target("gpu0", "127.0.0.2", sshd)))
    assert err.message == f"{config}: bad owner or permissions"
    assert err.exit_code == ExitCode.CONNECT and "chmod go-w" in err.hint


def test_bad_ports_in_the_config_are_one_line_errors(ssh_home, sshd, transports):
    (ssh_home / "config").write_text("Host 127.0.0.2\n  Port 99999\n"
                                     "Host 127.0.0.3\n  ProxyJump u@127.0.0.5:x\n")
    err = connect_error(transports(Target("gpu0", "127.0.0.2")))
    assert err.message == "host gpu0: bad port '99999' in ssh config"
    err = connect_error(transports(make_target("gpu1", "127.0.0.3", sshd)))
    assert err.message == (f"host gpu1 (127.0.0.3:{sshd.port}): via jump host "
                           "'u@127.0.0.5:x': bad port 'x'")


# --- known_hosts: global file, @revoked, patterns, HashKnownHosts ----------------------

def test_the_global_known_hosts_file_is_read_but_never_written(ssh_home, sshd, transports,
                                                               tmp_path):
    global_kh = sshd.write_known_hosts(tmp_path / "ssh_known_hosts", ["127.0.0.3"])
    (ssh_home / "config").write_text(f"GlobalKnownHostsFile {global_kh}\n")
    user_kh = tmp_path / "user_known_hosts"
    t = transports(make_target("gpu0", "127.0.0.3", sshd, known_hosts=str(user_kh)))
    assert where(t) == f"127.0.0.3:{sshd.port}"            # policy reject: known globally
    assert not user_kh.exists()
    # without GlobalKnownHostsFile, ssh(1)'s default files
    assert resolve("x", "x", SshOptions(), load_ssh_config("/nonexistent", system="")
                   ).global_known_hosts == tuple(GLOBAL_KNOWN_HOSTS.split())
    assert GLOBAL_KNOWN_HOSTS.split()[0] == "/etc/ssh/ssh_known_hosts"


def test_another_key_in_the_global_file_is_refused_even_under_accept_new(ssh_home, sshd,
                                                                          transports, tmp_path):
    other = keygen(tmp_path / "other_host_key")
    fake = " ".join(open(other + ".pub").read().split()[:2])
    global_kh = tmp_path / "ssh_known_hosts"
    global_kh.write_text(f"[127.0.0.3]:{sshd.port} {fake}\n")
    (ssh_home / "config").write_text(f"GlobalKnownHostsFile {global_kh}\n")
    user_kh = tmp_path / "user_known_hosts"
    err = connect_error(transports(make_target("gpu0", "127.0.0.3", sshd,
                                               known_hosts=str(user_kh),
                                               host_key_policy="accept-new")))
    assert err.message.startswith(f"host gpu0 (127.0.0.3:{sshd.port}): host key CHANGED "
                                  f"(ssh-ed25519 {fingerprint(sshd.host_key + '.pub')}, "
                                  f"known_hosts has {fingerprint(other + '.pub')})")
    assert shlex.quote(str(global_kh)) in err.hint          # where the old key is
    assert not user_kh.exists()


def test_a_key_marked_revoked_is_refused_although_known(ssh_home, sshd, transports, tmp_path):
    global_kh = tmp_path / "ssh_known_hosts"
    global_kh.write_text(f"@revoked * {sshd.host_pubkey_line}\n")
    (ssh_home / "config").write_text(f"GlobalKnownHostsFile {global_kh}\n")
    # ~/.ssh/known_hosts (from ssh_home) lists the very key as the host's
    err = connect_error(transports(make_target("gpu0", "127.0.0.2", sshd,
                                               host_key_policy="accept-new")))
    assert err.message == (f"host gpu0 (127.0.0.2:{sshd.port}): host key REVOKED (ssh-ed25519 "
                           f"{fingerprint(sshd.host_key + '.pub')} is marked @revoked in "
                           f"{global_kh})")


def test_cert_authority_lines_do_not_make_a_host_known(ssh_home, sshd, transports, tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text(f"@cert-authority * {sshd.host_pubkey_line}\n")
    err = connect_error(transports(make_target("gpu0", "127.0.0.2", sshd, known_hosts=str(kh))))
    assert "unknown host key" in err.message


def test_wildcard_and_negated_host_patterns_match_as_in_ssh(ssh_home, sshd, transports,
                                                            tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[127.0.0.?]:{sshd.port},![127.0.0.4]:{sshd.port} {sshd.host_pubkey_line}\n")
    t = transports(make_target("gpu0", "127.0.0.3", sshd, known_hosts=str(kh)))
    assert where(t) == f"127.0.0.3:{sshd.port}"
    err = connect_error(transports(make_target("gpu1", "127.0.0.4", sshd, known_hosts=str(kh))))
    assert "unknown host key" in err.message


@pytest.mark.parametrize("where_set", ["user config", "system config"])
def test_hash_known_hosts_records_a_hashed_name_that_the_next_connect_finds(
        ssh_home, sshd, transports, tmp_path, monkeypatch, where_set):
    if where_set == "user config":
        (ssh_home / "config").write_text("HashKnownHosts yes\n")
    else:                                          # as Debian's /etc/ssh/ssh_config has it
        system = tmp_path / "ssh_config"
        system.write_text("Host *\n    HashKnownHosts yes\n")
        monkeypatch.setenv(SYSTEM_CONFIG_VAR, str(system))
    kh = tmp_path / "known_hosts"
    for policy in ("accept-new", "accept-new", "reject"):
        t = transports(make_target("gpu0", "127.0.0.3", sshd, known_hosts=str(kh),
                                   host_key_policy=policy))
        assert where(t) == f"127.0.0.3:{sshd.port}"
    lines = kh.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("|1|")
    assert lines[0].split(" ", 1)[1] == sshd.host_pubkey_line
    assert "127.0.0.3" not in lines[0]
    keygen_found = subprocess.run(["ssh-keygen", "-F", f"[127.0.0.3]:{sshd.port}", "-f", str(kh)],
                                  capture_output=True, text=True)
    assert keygen_found.returncode == 0                     # OpenSSH finds it too


def test_the_user_config_wins_over_the_system_config(ssh_home, sshd, transports, tmp_path,
                                                     monkeypatch):
    system = tmp_path / "ssh_config"
    system.write_text("HashKnownHosts yes\n")
    monkeypatch.setenv(SYSTEM_CONFIG_VAR, str(system))
    (ssh_home / "config").write_text("HashKnownHosts no\n")
    kh = tmp_path / "known_hosts"
    transports(make_target("gpu0", "127.0.0.3", sshd, known_hosts=str(kh),
                           host_key_policy="accept-new")).connect()
    assert kh.read_text() == sshd.known_hosts_line("127.0.0.3") + "\n"


# --- IdentitiesOnly ------------------------------------------------------------------

@pytest.fixture
def agent(ssh_home, sshd, tmp_path, monkeypatch):
    """A real ssh-agent holding the key the sshd accepts; ~/.ssh/id_ed25519 (the same key)
    is moved away, so only the agent can log in without an identity file."""
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: sock.exists() or proc.poll() is not None, 10, what="ssh-agent socket")
        assert proc.poll() is None, "ssh-agent exited"
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        key = tmp_path / "agent_key"
        shutil.copyfile(sshd.user_key, key)
        key.chmod(0o600)
        subprocess.run(["ssh-add", "-q", str(key)], check=True, capture_output=True, timeout=10)
        os.rename(ssh_home / "id_ed25519", ssh_home / "moved_away")
        yield key
    finally:
        proc.terminate()
        proc.wait(10)


def test_without_an_identity_file_the_agent_key_logs_in(agent, sshd, transports):
    t = transports(make_target("gpu0", "127.0.0.2", sshd))
    assert where(t) == f"127.0.0.2:{sshd.port}"


def test_with_identity_file_set_no_agent_key_is_offered(agent, sshd, transports, tmp_path):
    wrong = keygen(tmp_path / "wrong_key")
    err = connect_error(transports(make_target("gpu0", "127.0.0.2", sshd, identity_file=wrong)))
    assert err.message == (f"host gpu0 (127.0.0.2:{sshd.port}): authentication failed as user "
                           f"{sshd.user} (tried {wrong})")


def test_identitiesonly_in_ssh_config_offers_only_its_identity_files(agent, ssh_home, sshd,
                                                                     transports, tmp_path):
    keygen(ssh_home / "wrong_key")
    (ssh_home / "config").write_text("Host 127.0.0.3\n  IdentityFile ~/.ssh/wrong_key\n"
                                     "  IdentitiesOnly yes\n"
                                     "Host 127.0.0.4\n  IdentityFile ~/.ssh/wrong_key\n")
    err = connect_error(transports(make_target("gpu0", "127.0.0.3", sshd)))
    assert "authentication failed" in err.message and "the agent" not in err.message
    t = transports(make_target("gpu1", "127.0.0.4", sshd))   # no IdentitiesOnly: the agent too
    assert where(t) == f"127.0.0.4:{sshd.port}"


def test_an_identity_file_with_a_passphrase_logs_in_through_the_agent_holding_it(
        agent, sshd, transports):
    subprocess.run(["ssh-keygen", "-q", "-p", "-P", "", "-N", "secret passphrase", "-f",
                    str(agent)], check=True, capture_output=True)
    unlocked = subprocess.run(["ssh-keygen", "-y", "-P", "", "-f", str(agent)],
                              capture_output=True)
    assert unlocked.returncode != 0                         # no key without the passphrase
    shutil.copyfile(sshd.user_key + ".pub", f"{agent}.pub")
    t = transports(make_target("gpu0", "127.0.0.2", sshd, identity_file=str(agent)))
    assert where(t) == f"127.0.0.2:{sshd.port}"
