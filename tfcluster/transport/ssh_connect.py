"""One authenticated SSH connection: dialing through jump hosts or a ProxyCommand,
host-key policy, which keys are offered.

paramiko is imported inside functions only: `plan` and `--help` never pay for it.
Host keys are checked against the user's and the global known_hosts by our own policy
(known_hosts.py): `reject` or `accept-new`; a changed or revoked key is always refused.
Every failure is a one-line ConnectError naming the host (and the jump host it failed at),
its `cause` told here, where the socket's or paramiko's exception is caught.
"""
from __future__ import annotations

import errno
import functools
import os
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tfcluster.errors import Cause, ConnectError
from tfcluster.transport.known_hosts import HostKeyPolicy, KnownHosts
from tfcluster.transport.ssh_config import Endpoint, SshOptions, jump_endpoint

if TYPE_CHECKING:
    from tfcluster.transport._paramiko import paramiko
    from tfcluster.transport.ssh_proxy import ProxyProcess

# Per destination: sshd's MaxStartups (default 10:30:100) randomly drops unauthenticated
# connections beyond 10 at once, so we stay below that and retry the few still dropped.
MAX_HANDSHAKES = 8
HANDSHAKE_RETRIES = 3       # at least; more while the connect timeout lasts
KEEPALIVE_S = 15
MAX_JUMPS = 5               # guards against a ProxyJump that loops through ~/.ssh/config

_slots: dict[str, threading.BoundedSemaphore] = {}
_slots_lock = threading.Lock()


def _handshake_slot(dest: str) -> threading.BoundedSemaphore:
    with _slots_lock:
        return _slots.setdefault(dest, threading.BoundedSemaphore(MAX_HANDSHAKES))


def _is_dropped(e: BaseException) -> bool:
    """sshd's MaxStartups drops surplus handshakes: no banner, or a reset."""
    from tfcluster.transport._paramiko import paramiko
    if isinstance(e, (EOFError, ConnectionResetError, BrokenPipeError)):
        return True
    return isinstance(e, paramiko.SSHException) and (
        "protocol banner" in str(e) or "Connection reset" in str(e))


# A machine that is off or gone: its address times out (nothing answers the SYN) or has no
# route (the last router's, or our own ARP's, verdict; EHOSTDOWN where the stack says so).
UNREACHABLE_ERRNOS = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN)


def _tcp(ep: Endpoint) -> socket.socket:
    try:
        return socket.create_connection((ep.address, ep.port), timeout=ep.timeout)
    except socket.gaierror:
        raise ep.error(f"cannot resolve address {ep.address!r}", cause=Cause.RESOLVE) from None
    except ConnectionRefusedError:
        raise ep.error("connection refused (is sshd running on that port?)", cause=Cause.REFUSED) from None
    except (socket.timeout, TimeoutError):
        raise ep.error(f"unreachable: connect timed out after {round(ep.timeout, 1):g}s", cause=Cause.TIMEOUT) from None
    except OSError as e:
        if e.errno in UNREACHABLE_ERRNOS:
            raise ep.error(f"unreachable: {os.strerror(e.errno).lower()}", cause=Cause.UNREACHABLE) from None
        raise ep.error(f"cannot connect: {e.strerror or e}") from None


@dataclass
class Connection:
    """One authenticated SSH connection; channels are opened on `transport`."""

    client: paramiko.SSHClient
    jumps: list[Connection]         # each jump hop's connection, kept open as long as this one
    proxy: ProxyProcess | None = field(default=None)    # the ProxyCommand carrying it

    @property
    def transport(self) -> paramiko.Transport | None:
        return self.client.get_transport()

    def active(self) -> bool:
        t = self.transport
        return t is not None and t.is_active()

    def ending(self) -> bool:
        """Its transport thread stopped on an EOF or a socket error: the connection is going,
        though paramiko may not have marked it inactive yet."""
        t = self.transport
        return t is not None and isinstance(t.saved_exception, (EOFError, OSError))

    def close(self) -> None:
        self.client.close()
        if self.proxy:
            self.proxy.close()
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
        try:
            jump = dial(jump_endpoint(ep, options, config), options, config, depth + 1)
        except ConnectError as e:
            raise ep.error(f"via {e.message}", e.hint, e.cause) from None
    try:
        client, proxy = _handshake_retrying(ep, jump)
        return Connection(client, [jump] if jump else [], proxy)
    except BaseException:
        if jump:
            jump.close()
        raise


class _Dropped(Exception):
    """sshd dropped the handshake (MaxStartups): worth another try after a pause."""


def _handshake_retrying(ep: Endpoint, jump: Connection | None):
    """A handshake sshd dropped is tried again after a jittered pause (0.2 s doubling, at most
    1 s), for as long as the connect timeout lasts and at least HANDSHAKE_RETRIES times: a
    host whose MaxStartups is below our own cap takes its connections a few at a time, and a
    busy one takes seconds for each."""
    deadline = time.monotonic() + ep.timeout
    attempt = 0
    while True:
        try:
            return _handshake(ep, jump)
        except _Dropped as e:
            # jittered: connections dropped together must not come back together
            pause = min(1.0, 0.2 * 2 ** attempt) + random.uniform(0, 0.2)
            attempt += 1
            if attempt > HANDSHAKE_RETRIES and time.monotonic() + pause > deadline:
                said = None if jump or ep.proxy_command else _not_ssh(ep)
                if said is not None:
                    raise ep.error(f"port {ep.port} answers, but not as an SSH server (it said {said!r})",
                                   "check the host's ssh.port (or Port in ~/.ssh/config)",
                                   Cause.HANDSHAKE) from None
                raise ep.error(f"connection dropped during the SSH handshake ({e})",
                               "the host's sshd may limit concurrent connections (MaxStartups)",
                               Cause.DROPPED) from None
            time.sleep(pause)


def _not_ssh(ep: Endpoint) -> str | None:
    """The first words of a server at the port that is not an sshd (an sshd greets every
    connection with `SSH-2.0-...`; a web server answers a blank line with its error), or None
    when it says nothing or is an sshd after all. Asked only once a handshake has failed."""
    try:
        with socket.create_connection((ep.address, ep.port), timeout=2) as s:
            s.settimeout(2)
            s.sendall(b"\r\n")
            data = s.recv(256)
    except OSError:
        return None
    if not data or b"SSH-" in data:
        return None
    return data.split(b"\n", 1)[0].decode("ascii", "replace").strip()[:60] or None


def _open_sock(ep: Endpoint, jump: Connection | None):
    """The byte stream to the host's sshd, and the ProxyCommand behind it (or None)."""
    if ep.proxy_command:
        from tfcluster.transport.ssh_proxy import ProxyProcess
        proxy = ProxyProcess(ep)
        return proxy.sock, proxy
    if jump is None:
        return _tcp(ep), None
    from tfcluster.transport._paramiko import paramiko
    try:
        return jump.transport.open_channel("direct-tcpip", (ep.address, ep.port),
                                           ("127.0.0.1", 0), timeout=ep.timeout), None
    except paramiko.ChannelException as e:
        raise ep.error(f"jump host cannot reach it: {e.text}", cause=_jump_cause(e)) from None
    except paramiko.SSHException as e:
        # paramiko gave up waiting for the jump host's connect to the target (a SYN unanswered)
        timeout = "Timeout opening channel" in str(e)
        raise ep.error(f"jump host connection failed: {e}",
                       cause=Cause.TIMEOUT if timeout else Cause.OTHER) from None


def _jump_cause(e) -> Cause:
    """What a jump host's failed direct-tcpip open says of the target. OPEN_CONNECT_FAILED: the
    jump host's own TCP connect to it failed (refused, no route or timed out there; paramiko
    keeps the code, not the jump host's words): unreachable from the only place we can reach
    it from. Any other code (forwarding prohibited, no resources) is the jump host's matter."""
    from tfcluster.transport._paramiko import paramiko
    if e.code == paramiko.common.OPEN_FAILED_CONNECT_FAILED:
        return Cause.UNREACHABLE
    return Cause.OTHER


# Task output is bulk data through a pure-Python SSH stack: a large window keeps the
# server sending while we decode, and an AEAD cipher (AES-GCM, OpenSSH >= 6.2) saves
# the separate HMAC pass per packet. Other ciphers stay allowed, in paramiko's order.
WINDOW_SIZE = 16 * 1024 * 1024
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


def _fast_transport(sock, key_types: tuple[str, ...] = (), **kwargs):
    """paramiko's Transport with a large window, AEAD ciphers first, and the host key
    types known_hosts has for this host asked for first (as ssh(1) does)."""
    from tfcluster.transport._paramiko import paramiko
    transport = paramiko.Transport(sock, default_window_size=WINDOW_SIZE, **kwargs)
    options = transport.get_security_options()
    supported = tuple(options.ciphers)
    options.ciphers = tuple(c for c in PREFERRED_CIPHERS if c in supported) + tuple(
        c for c in supported if c not in PREFERRED_CIPHERS)
    offered = tuple(options.key_types)
    first = [t for k in key_types for t in RSA_TYPES.get(k, (k,)) if t in offered]
    options.key_types = tuple(dict.fromkeys(first)) + tuple(t for t in offered if t not in first)
    return transport


RSA_TYPES = {"ssh-rsa": ("rsa-sha2-512", "rsa-sha2-256", "ssh-rsa")}


def _agent_keys(ep: Endpoint):
    """The agent's keys among ep.key_files (by their .pub), for IdentitiesOnly: a key
    file with a passphrase still works when the agent holds it. (agent, [keys])."""
    from tfcluster.transport._paramiko import paramiko
    wanted = set()
    for path in ep.key_files:
        try:
            with open(path + ".pub") as f:
                wanted.add(f.read().split()[1])
        except (OSError, IndexError):
            continue
    if not wanted or not os.environ.get("SSH_AUTH_SOCK"):
        return None, []
    try:
        agent = paramiko.Agent()
    except (paramiko.SSHException, OSError):
        return None, []                          # ssh(1) goes on without the agent too
    return agent, [k for k in agent.get_keys() if k.get_base64() in wanted]


def _handshake(ep: Endpoint, jump: Connection | None):
    with _handshake_slot(f"{ep.address}:{ep.port}"):
        known = KnownHosts(ep)
        agent, agent_keys = (None, []) if ep.allow_agent else _agent_keys(ep)
        try:
            client, proxy = _authenticate(ep, jump, known, agent_keys[0] if agent_keys else None)
        finally:
            if agent:
                agent.close()                    # its keys have signed what they had to
    client.get_transport().set_keepalive(KEEPALIVE_S)
    return client, proxy


def _authenticate(ep: Endpoint, jump: Connection | None, known: KnownHosts, pkey):
    from tfcluster.transport._paramiko import paramiko
    sock, proxy = _open_sock(ep, jump)
    client = paramiko.SSHClient()                # no host keys of its own: the policy decides
    client.set_missing_host_key_policy(HostKeyPolicy(ep, known))
    started = time.monotonic()
    try:
        client.connect(ep.address, port=ep.port, username=ep.user, pkey=pkey,
                       key_filename=list(ep.key_files) or None,
                       look_for_keys=ep.look_for_keys, allow_agent=ep.allow_agent,
                       sock=sock, timeout=ep.timeout, banner_timeout=ep.timeout,
                       auth_timeout=ep.timeout, transport_factory=functools.partial(
                           _fast_transport, key_types=tuple(known.key_types())))
    except BaseException as e:
        client.close()
        sock.close()
        error = _map_handshake_error(ep, e, time.monotonic() - started)
        if proxy:
            error = _proxy_exit(proxy, e) or error
            proxy.close()
        raise error from None
    return client, proxy


def _proxy_exit(proxy: ProxyProcess, e: BaseException) -> ConnectError | None:
    """The ProxyCommand's exit, when that is why the handshake failed: the byte stream
    ended or broke (never after a refusal of ours, a failed login or a Ctrl-C)."""
    from tfcluster.transport._paramiko import paramiko
    if not isinstance(e, Exception) or isinstance(e, (ConnectError,
                                                      paramiko.AuthenticationException)):
        return None
    return proxy.exited(0 if isinstance(e, (socket.timeout, TimeoutError)) else None)


def _map_handshake_error(ep: Endpoint, e: BaseException, elapsed: float) -> BaseException:
    from tfcluster.transport._paramiko import paramiko
    if isinstance(e, ConnectError):
        return e
    if isinstance(e, paramiko.AuthenticationException) or (
            isinstance(e, paramiko.SSHException) and "authentication methods" in str(e)):
        keys = ", ".join(ep.key_files + ("the agent",) * ep.allow_agent
                         + ("~/.ssh/id_*",) * ep.look_for_keys) or "no key"
        return ep.error(f"authentication failed as user {ep.user} (tried {keys})",
                        hint="set ssh.identity_file (or IdentityFile in ~/.ssh/config) to a key "
                             f"authorised for {ep.user}, or ssh.user", cause=Cause.AUTH)
    if _is_dropped(e) and elapsed < ep.timeout * 0.9:
        return _Dropped(str(e) or type(e).__name__)
    if isinstance(e, (socket.timeout, TimeoutError)) or "banner" in str(e) or str(e) == "No existing session":
        via = f" through ProxyCommand `{ep.proxy_command}`" if ep.proxy_command else ""
        return ep.error(f"no SSH handshake within {ep.timeout:g}s{via}", cause=Cause.HANDSHAKE)
    if isinstance(e, (paramiko.SSHException, OSError, EOFError)):
        return ep.error(f"SSH handshake failed: {e or type(e).__name__}", cause=Cause.HANDSHAKE)
    return e


