"""One authenticated SSH connection: dialing through jump hosts, host-key policy.

paramiko is imported inside functions only: `plan` and `--help` never pay for it.
Host keys are checked against known_hosts by our own policy: `reject` or
`accept-new`; a changed key is always refused. Every failure is a one-line
ConnectError naming the host (and the jump host it failed at).
"""
from __future__ import annotations

import errno
import os
import random
import shlex
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tfcluster.errors import ConnectError
from tfcluster.transport.ssh_config import Endpoint, SshOptions, jump_endpoint

if TYPE_CHECKING:
    import paramiko

# Per destination: sshd's MaxStartups (default 10:30:100) randomly drops unauthenticated
# connections beyond 10 at once, so we stay below that and retry the few still dropped.
MAX_HANDSHAKES = 8
HANDSHAKE_RETRIES = 3
KEEPALIVE_S = 15
MAX_JUMPS = 5               # guards against a ProxyJump that loops through ~/.ssh/config

_slots: dict[str, threading.BoundedSemaphore] = {}
_slots_lock = threading.Lock()
_known_hosts_lock = threading.Lock()


def _handshake_slot(dest: str) -> threading.BoundedSemaphore:
    with _slots_lock:
        return _slots.setdefault(dest, threading.BoundedSemaphore(MAX_HANDSHAKES))


class _HostKeyPolicy:
    """paramiko MissingHostKeyPolicy (duck-typed, so this module imports without paramiko)."""

    def __init__(self, ep: Endpoint) -> None:
        self.ep = ep

    def missing_host_key(self, client, hostname: str, key) -> None:
        ep = self.ep
        if ep.policy != "accept-new":
            scan = (shlex.join(["ssh-keyscan", "-p", str(ep.port), ep.address]) + " >> "
                    + shlex.quote(os.path.expanduser(ep.known_hosts[0])))
            raise ep.error(f"unknown host key ({key.get_name()} {key.fingerprint})",
                           hint=f"run `{scan}` after checking the fingerprint, "
                                "or set ssh.host_key_policy: accept-new")
        _append_known_host(os.path.expanduser(ep.known_hosts[0]),
                           f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


def _append_known_host(path: str, line: str) -> None:
    parent = os.path.dirname(path)
    with _known_hosts_lock:
        if parent and not os.path.isdir(parent):
            os.makedirs(parent, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            with open(fd, "rb", closefd=False) as f:
                existing = f.read()
            if line.encode() in existing.splitlines(keepends=True):
                return                           # a concurrent connect recorded it already
            os.write(fd, (b"\n" if existing and not existing.endswith(b"\n") else b"")
                     + line.encode())
        finally:
            os.close(fd)


def _load_host_keys(ep: Endpoint, keys) -> None:
    for path in ep.known_hosts:
        path = os.path.expanduser(path)
        if os.path.isfile(path):
            try:
                keys.load(path)
            except OSError as e:
                raise ep.error(f"cannot read known_hosts {path}: {e.strerror}") from None


def _is_dropped(e: BaseException) -> bool:
    """sshd's MaxStartups drops surplus handshakes: no banner, or a reset."""
    import paramiko
    if isinstance(e, (EOFError, ConnectionResetError, BrokenPipeError)):
        return True
    return isinstance(e, paramiko.SSHException) and (
        "protocol banner" in str(e) or "Connection reset" in str(e))


def _tcp(ep: Endpoint) -> socket.socket:
    try:
        return socket.create_connection((ep.address, ep.port), timeout=ep.timeout)
    except socket.gaierror:
        raise ep.error(f"cannot resolve address {ep.address!r}") from None
    except ConnectionRefusedError:
        raise ep.error("connection refused (is sshd running on that port?)") from None
    except (socket.timeout, TimeoutError):
        raise ep.error(f"unreachable: connect timed out after {ep.timeout:g}s") from None
    except OSError as e:
        if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            raise ep.error(f"unreachable: {os.strerror(e.errno).lower()}") from None
        raise ep.error(f"cannot connect: {e.strerror or e}") from None


@dataclass
class Connection:
    """One authenticated SSH connection; channels are opened on `transport`."""

    client: paramiko.SSHClient
    jumps: list[Connection]         # each jump hop's connection, kept open as long as this one

    @property
    def transport(self) -> paramiko.Transport | None:
        return self.client.get_transport()

    def active(self) -> bool:
        t = self.transport
        return t is not None and t.is_active()

    def close(self) -> None:
        self.client.close()
        for j in self.jumps:
            j.close()


def dial(ep: Endpoint, options: SshOptions, config: paramiko.SSHConfig,
         depth: int = 0) -> Connection:
    """Open and authenticate one connection (through its jump hosts), with retries.

    `options` are the target host's: every hop shares its known_hosts, policy, timeout
    and (as a fallback) its identity file."""
    jump = None
    if ep.jump:
        if depth >= MAX_JUMPS:
            raise ep.error(f"more than {MAX_JUMPS} ProxyJump hops (a loop in ~/.ssh/config?)")
        jep = jump_endpoint(ep, options, config)
        try:
            jump = dial(jep, options, config, depth + 1)
        except ConnectError as e:
            raise ep.error(f"via {e.message}", e.hint) from None
    try:
        return Connection(_handshake_retrying(ep, jump), [jump] if jump else [])
    except BaseException:
        if jump:
            jump.close()
        raise


class _Dropped(Exception):
    """sshd dropped the handshake (MaxStartups): worth another try after a pause."""


def _handshake_retrying(ep: Endpoint, jump: Connection | None):
    for attempt in range(HANDSHAKE_RETRIES):
        try:
            return _handshake(ep, jump)
        except _Dropped:
            # jittered backoff: connections dropped together must not come back together
            time.sleep(0.2 * 2 ** attempt + random.uniform(0, 0.2))
    try:
        return _handshake(ep, jump)
    except _Dropped as e:
        raise ep.error(f"connection dropped during the SSH handshake ({e})",
                       "the host's sshd may limit concurrent connections (MaxStartups)") from None


def _open_sock(ep: Endpoint, jump: Connection | None):
    if jump is None:
        return _tcp(ep)
    import paramiko
    try:
        return jump.transport.open_channel("direct-tcpip", (ep.address, ep.port),
                                           ("127.0.0.1", 0), timeout=ep.timeout)
    except paramiko.ChannelException as e:
        raise ep.error(f"jump host cannot reach it: {e.text}") from None
    except paramiko.SSHException as e:
        raise ep.error(f"jump host connection failed: {e}") from None


# Task output is bulk data through a pure-Python SSH stack: a large window keeps the
# server sending while we decode, and an AEAD cipher (AES-GCM, OpenSSH >= 6.2) saves
# the separate HMAC pass per packet. Other ciphers stay allowed, in paramiko's order.
WINDOW_SIZE = 16 * 1024 * 1024
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


def _fast_transport(sock, **kwargs):
    import paramiko
    transport = paramiko.Transport(sock, default_window_size=WINDOW_SIZE, **kwargs)
    options = transport.get_security_options()
    supported = tuple(options.ciphers)
    options.ciphers = tuple(c for c in PREFERRED_CIPHERS if c in supported) + tuple(
        c for c in supported if c not in PREFERRED_CIPHERS)
    return transport


def _handshake(ep: Endpoint, jump: Connection | None):
    import paramiko
    with _handshake_slot(f"{ep.address}:{ep.port}"):
        sock = _open_sock(ep, jump)
        client = paramiko.SSHClient()
        _load_host_keys(ep, client.get_host_keys())
        client.set_missing_host_key_policy(_HostKeyPolicy(ep))
        started = time.monotonic()
        try:
            client.connect(ep.address, port=ep.port, username=ep.user,
                           key_filename=list(ep.key_files) or None,
                           look_for_keys=ep.look_for_keys, allow_agent=True, sock=sock,
                           timeout=ep.timeout, banner_timeout=ep.timeout,
                           auth_timeout=ep.timeout, transport_factory=_fast_transport)
        except BaseException as e:
            client.close()
            sock.close()
            raise _map_handshake_error(ep, e, time.monotonic() - started) from None
    client.get_transport().set_keepalive(KEEPALIVE_S)
    return client


def _map_handshake_error(ep: Endpoint, e: BaseException, elapsed: float) -> BaseException:
    import paramiko
    if isinstance(e, ConnectError):
        return e
    if isinstance(e, paramiko.BadHostKeyException):
        return ep.error(f"host key CHANGED ({e.key.get_name()} {e.key.fingerprint}, "
                        f"known_hosts has {e.expected_key.fingerprint}): "
                        "possible man-in-the-middle",
                        hint="if the host was reinstalled, check the new fingerprint, then "
                             "`" + shlex.join(["ssh-keygen", "-R", ep.key_name, "-f",
                                               os.path.expanduser(ep.known_hosts[0])]) + "`")
    if isinstance(e, paramiko.AuthenticationException) or (
            isinstance(e, paramiko.SSHException) and "authentication methods" in str(e)):
        keys = ", ".join(ep.key_files) or "the agent and ~/.ssh/id_*"
        return ep.error(f"authentication failed as user {ep.user} (tried {keys})",
                        hint="set ssh.identity_file (or IdentityFile in ~/.ssh/config) to a key "
                             f"authorised for {ep.user}, or ssh.user")
    if _is_dropped(e) and elapsed < ep.timeout * 0.9:
        return _Dropped(str(e) or type(e).__name__)
    if isinstance(e, (socket.timeout, TimeoutError)) or "banner" in str(e):
        return ep.error(f"no SSH handshake within {ep.timeout:g}s")
    if isinstance(e, (paramiko.SSHException, OSError, EOFError)):
        return ep.error(f"SSH handshake failed: {e or type(e).__name__}")
    return e


