"""Real OpenSSH sshd fixtures (no mocks: the transport is tested against what it meets),
loaded as a pytest plugin by conftest.

`sshd` listens on 127.0.0.2-4 (three "hosts", one port); `jump_sshd` on 127.0.0.5 only,
with MaxSessions 4. Remote commands run as root through root's login shell (bash), with
HOME=/root: tests write under tmp dirs, never under ~.
"""
from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest

from tests.helpers import SESSION_VAR, cannot_run
from tfcluster.transport.ssh import SshTransport
from tfcluster.transport.ssh_config import SYSTEM_CONFIG_VAR, SshOptions

SSHD = "/usr/sbin/sshd"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
MAIN_ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
JUMP_ADDRESSES = ("127.0.0.5",)


@dataclass
class Sshd:
    port: int
    addresses: tuple[str, ...]
    user: str
    user_key: str                   # private key path (ed25519, no passphrase)
    host_pubkey_line: str           # "ssh-ed25519 AAAA..."
    host_key: str                   # private host key path (tests swap keys with it)
    log: str
    proc: subprocess.Popen = field(repr=False)

    def known_hosts_line(self, addr: str) -> str:
        return f"[{addr}]:{self.port} {self.host_pubkey_line}"

    def write_known_hosts(self, path: str | os.PathLike, addresses=None, mode: str = "w") -> Path:
        path = Path(path)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        lines = "".join(self.known_hosts_line(a) + "\n" for a in (addresses or self.addresses))
        with open(path, mode) as f:
            f.write(lines)
        path.chmod(0o600)
        return path


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tfcluster-test",
                    "-f", str(path)], check=True, capture_output=True)
    return " ".join(path.with_suffix(".pub").read_text().split()[:2])


def _port_free_on_all(addresses) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind((addresses[0], 0))
            port = s.getsockname()[1]
        if all(_can_bind(a, port) for a in addresses):
            return port
    raise RuntimeError(f"no port free on all of {addresses}")


def _can_bind(addr: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((addr, port))
            return True
        except OSError:
            return False


def _accepts(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=0.5) as s:
            return s.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def _require_sshd() -> None:
    if os.path.exists(SSHD) and shutil.which("ssh-keygen"):
        return
    cannot_run(f"OpenSSH server not installed ({SSHD})")


def write_config(d: Path, addresses, port: int, host_key: Path, authorized_keys: Path, options) -> Path:
    """`d/sshd_config` for a test sshd listening on `addresses`:`port` (key-only root logins)."""
    settings = {"Port": port, "HostKey": host_key,
                "AuthorizedKeysFile": authorized_keys,
                "PasswordAuthentication": "no", "KbdInteractiveAuthentication": "no",
                "PubkeyAuthentication": "yes", "PermitRootLogin": "yes",
                "StrictModes": "no", "UsePAM": "no", "MaxStartups": "200:30:300",
                "MaxSessions": 64, "PidFile": d / "sshd.pid", "LogLevel": "ERROR",
                "Subsystem": f"sftp {SFTP_SERVER}", "AllowTcpForwarding": "yes",
                # Sessions carry this test session's marker, so the leak check in
                # conftest.py sees processes started over SSH as ours. SHLVL=1 makes the
                # login bash a nested shell, which sources no ~/.bashrc: the suite does not
                # depend on the machine's dotfiles (root's may run `pyenv init`, which costs
                # CPU per command and rehashes under a lock file that a killed host can
                # leave behind, holding every later login). test_login_noise gives its own
                # sshd a noisy .bashrc on purpose.
                "SetEnv": f"{SESSION_VAR}={os.environ[SESSION_VAR]} SHLVL=1"}
    settings.update(options)
    lines = [f"ListenAddress {a}" for a in addresses]
    lines += [f"{k} {v}" for k, v in settings.items()]
    config = d / "sshd_config"
    config.write_text("\n".join(lines) + "\n")
    return config


class _SshdFactory:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[Sshd] = []
        self.user_key = root / "id_user"
        _keygen(self.user_key)
        (root / "authorized_keys").write_text(self.user_key.with_suffix(".pub").read_text())

    def __call__(self, addresses=MAIN_ADDRESSES, **options) -> Sshd:
        d = self.root / f"sshd{len(self.started)}"
        d.mkdir()
        host_key = d / "host_ed25519"
        pub = _keygen(host_key)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        for _attempt in range(3):          # a port free when probed may be taken by then
            port = _port_free_on_all(addresses)
            server = self._start(d, addresses, port, host_key, options)
            if server:
                self.started.append(Sshd(port, tuple(addresses), getpass.getuser(),
                                         str(self.user_key), pub, str(host_key),
                                         str(d / "sshd.log"), server))
                return self.started[-1]
        pytest.fail(f"sshd did not start: {(d / 'sshd.log').read_text()[-2000:]}")

    def _start(self, d: Path, addresses, port: int, host_key: Path, options) -> subprocess.Popen | None:
        config = write_config(d, addresses, port, host_key, self.root / "authorized_keys", options)
        log = open(d / "sshd.log", "ab")
        proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return None
            if all(_accepts(a, port) for a in addresses):
                return proc
            time.sleep(0.05)
        _stop(proc)
        return None

    def stop_all(self) -> None:
        for server in self.started:
            _stop(server.proc)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.poll() is not None, "sshd survived the test session"


@pytest.fixture(scope="session")
def sshd_factory(tmp_path_factory):
    """Start extra sshds: `sshd_factory(("127.0.0.6",), MaxSessions=2)`; all stop at session end."""
    _require_sshd()
    factory = _SshdFactory(tmp_path_factory.mktemp("ssh"))
    yield factory
    factory.stop_all()


@pytest.fixture(scope="session")
def sshd(sshd_factory) -> Sshd:
    """One sshd on 127.0.0.2, .3 and .4 (three distinct "hosts" to tfcluster)."""
    return sshd_factory(MAIN_ADDRESSES)


@pytest.fixture(scope="session")
def jump_sshd(sshd_factory) -> Sshd:
    """A second sshd on 127.0.0.5 only: the jump host, and MaxSessions 4 to force extra connections."""
    return sshd_factory(JUMP_ADDRESSES, MaxSessions=4)


@pytest.fixture
def ssh_home(home, sshd, monkeypatch) -> Path:
    """~/.ssh of the isolated HOME trusts the test sshd and holds the user key as id_ed25519;
    no system ssh_config is read."""
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)   # never the developer's agent
    monkeypatch.setenv(SYSTEM_CONFIG_VAR, "")            # nor the machine's /etc/ssh/ssh_config
    ssh_dir = home / ".ssh"
    ssh_dir.mkdir(mode=0o700)
    sshd.write_known_hosts(ssh_dir / "known_hosts")
    key = ssh_dir / "id_ed25519"
    shutil.copyfile(sshd.user_key, key)
    key.chmod(0o600)
    return ssh_dir


class Target(NamedTuple):
    """What an SshTransport is built from: `SshTransport(*target)`."""

    name: str
    address: str
    options: SshOptions = SshOptions()


def make_target(name: str, address: str, sshd: Sshd, **ssh_overrides) -> Target:
    """A host on the test sshd: just the address and port, plus any SshOptions override."""
    ssh_overrides.setdefault("port", sshd.port)
    ssh_overrides.setdefault("connect_timeout", 5.0)
    return Target(name, address, SshOptions(**ssh_overrides))


@pytest.fixture
def transports():
    """Build SshTransports that are all closed after the test."""
    made: list[SshTransport] = []

    def build(target: Target) -> SshTransport:
        made.append(SshTransport(*target))
        return made[-1]

    yield build
    for t in made:
        t.close()


# -- a host that dies, and one sshd for one address ---------------------------------------------

def kill_host(server) -> None:
    """The host dies: its sshd, every connection's sshd and everything started through them,
    SIGKILLed together (the listener first, so nothing can reconnect in between)."""
    listener = psutil.Process(server.proc.pid)
    victims = [listener] + listener.children(recursive=True)
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    server.proc.wait(10)


def lone(sshd_factory, ssh_home, address: str):
    """An sshd serving `address` only, trusted by the test's ~/.ssh/known_hosts."""
    server = sshd_factory((address,))
    server.write_known_hosts(ssh_home / "known_hosts", [address], mode="a")
    return server
