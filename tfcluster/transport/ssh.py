"""SSH transport over paramiko (DESIGN.md §5, §6b).

paramiko is imported inside functions only: `plan` and `--help` never pay for it.
Resolution follows ssh(1): explicit spec values, then ~/.ssh/config (looked up by
the host's address, then its name), then defaults. Host keys are checked against
known_hosts by our own policy: `reject` or `accept-new`; a changed key is always
refused. No PTY anywhere.
"""
from __future__ import annotations

import errno
import getpass
import os
import random
import select
import shlex
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import Sequence

from tfcluster.errors import ConnectError, DeadlineError
from tfcluster.spec import Host, SshSettings
from tfcluster.transport.base import Proc, Result, Transport

MAX_HANDSHAKES = 8          # per destination: sshd's MaxStartups drops the excess (§6b)
HANDSHAKE_RETRIES = 3
KEEPALIVE_S = 15
MAX_JUMPS = 5               # guards against a ProxyJump that loops through ~/.ssh/config

_slots: dict[str, threading.BoundedSemaphore] = {}
_slots_lock = threading.Lock()
_known_hosts_lock = threading.Lock()


def _handshake_slot(dest: str) -> threading.BoundedSemaphore:
    with _slots_lock:
        return _slots.setdefault(dest, threading.BoundedSemaphore(MAX_HANDSHAKES))


def _command(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


@dataclass(frozen=True)
class Endpoint:
    """One SSH destination after merging the spec, ~/.ssh/config and defaults."""

    name: str                       # the spec's host name, or the jump host as written
    address: str                    # what we open TCP to (config HostName applied)
    port: int
    user: str
    key_files: tuple[str, ...]
    look_for_keys: bool             # default ~/.ssh/id_* keys, when no identity is given
    known_hosts: tuple[str, ...]    # as written; the first one is where accept-new writes
    policy: str
    timeout: float
    jump: str | None                # "user@host:port[,...]" or a config alias
    role: str = "host"              # "host" or "jump host", for messages

    @property
    def label(self) -> str:
        return f"{self.name} ({self.address}:{self.port})"

    @property
    def key_name(self) -> str:
        """The known_hosts name, as OpenSSH writes it: `[addr]:port` off port 22."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"


def _fail(ep: Endpoint, problem: str, hint: str | None = None) -> ConnectError:
    return ConnectError(f"{ep.role} {ep.label}: {problem}", hint=hint)


def load_ssh_config(path: str):
    import paramiko
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(path)
    except Exception as e:  # noqa: BLE001 - paramiko raises several types here
        raise ConnectError(f"{path}: cannot parse ssh config: {e}") from None


def _config_options(config, name: str, address: str) -> dict:
    """ssh_config options for `address`, missing ones filled from a lookup by `name`.

    HostName only ever comes from the address: the spec's address is explicit."""
    options = {k: v for k, v in config.lookup(name).items() if k != "hostname"} \
        if name != address else {}
    options.update(config.lookup(address))
    return options


def resolve(name: str, address: str, ssh: SshSettings, config,
            extra_keys: tuple[str, ...] = (), role: str = "host") -> Endpoint:
    opts = _config_options(config, name, address)
    exp = os.path.expanduser
    if ssh.identity_file:
        keys, look = (exp(ssh.identity_file),), False
    elif "identityfile" in opts:
        keys, look = tuple(exp(k) for k in opts["identityfile"] if os.path.isfile(exp(k))), False
    else:
        keys, look = (), True
    keys += tuple(k for k in extra_keys if k not in keys and os.path.isfile(k))
    known = (ssh.known_hosts,) if ssh.known_hosts else \
        tuple(opts.get("userknownhostsfile", "~/.ssh/known_hosts").split())
    jump = ssh.jump_host or opts.get("proxyjump")
    ep = Endpoint(name=name, address=opts.get("hostname", address),
                  port=int(ssh.port or opts.get("port", 22)),
                  user=ssh.user or opts.get("user") or getpass.getuser(),
                  key_files=keys, look_for_keys=look, known_hosts=known,
                  policy=ssh.host_key_policy, timeout=float(ssh.connect_timeout),
                  jump=None if (jump or "none").lower() == "none" else jump, role=role)
    if ssh.identity_file and not os.path.isfile(keys[0]):
        raise _fail(ep, f"identity file {ssh.identity_file} not found",
                    "fix ssh.identity_file in the spec")
    return ep


def _jump_endpoint(target: Endpoint, ssh: SshSettings, config) -> Endpoint:
    """The last hop of target.jump; earlier hops (A,B -> B via A) become its own jump."""
    hops = [h.strip() for h in target.jump.split(",") if h.strip()]
    hop = hops[-1].removeprefix("ssh://")
    user, _, hostport = hop.rpartition("@")
    host, port = hostport, None
    if hostport.count(":") == 1 and not hostport.startswith("["):
        host, port = hostport.split(":")
    elif hostport.startswith("[") and "]:" in hostport:
        host, port = hostport[1:].split("]:")
    host = host.strip("[]")
    settings = SshSettings(user=user or None, port=int(port) if port else None,
                           known_hosts=ssh.known_hosts, host_key_policy=ssh.host_key_policy,
                           jump_host=",".join(hops[:-1]) or None,
                           connect_timeout=ssh.connect_timeout)
    # the target's explicit key is a fallback for the jump (usually one key for the whole lab)
    extra = (os.path.expanduser(ssh.identity_file),) if ssh.identity_file else ()
    return resolve(host, host, settings, config, extra, role="jump host")


class _HostKeyPolicy:
    """paramiko MissingHostKeyPolicy (duck-typed, so this module imports without paramiko)."""

    def __init__(self, ep: Endpoint) -> None:
        self.ep = ep

    def missing_host_key(self, client, hostname: str, key) -> None:
        ep = self.ep
        if ep.policy != "accept-new":
            raise _fail(ep, f"unknown host key ({key.get_name()} {key.fingerprint})",
                        f"run `ssh-keyscan -p {ep.port} {ep.address} >> {ep.known_hosts[0]}` "
                        "after checking the fingerprint, or set ssh.host_key_policy: accept-new")
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
                raise _fail(ep, f"cannot read known_hosts {path}: {e.strerror}") from None


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
        raise _fail(ep, f"cannot resolve address {ep.address!r}") from None
    except ConnectionRefusedError:
        raise _fail(ep, "connection refused (is sshd running on that port?)") from None
    except (socket.timeout, TimeoutError):
        raise _fail(ep, f"unreachable: connect timed out after {ep.timeout:g}s") from None
    except OSError as e:
        if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            raise _fail(ep, f"unreachable: {os.strerror(e.errno).lower()}") from None
        raise _fail(ep, f"cannot connect: {e.strerror or e}") from None


@dataclass
class _Conn:
    client: object                  # paramiko.SSHClient
    jumps: list                     # _Conn of each jump hop, kept open as long as this one

    @property
    def transport(self):
        return self.client.get_transport()

    def active(self) -> bool:
        t = self.transport
        return t is not None and t.is_active()

    def close(self) -> None:
        self.client.close()
        for j in self.jumps:
            j.close()


def dial(ep: Endpoint, ssh: SshSettings, config, depth: int = 0) -> _Conn:
    """Open and authenticate one connection (through its jump hosts), with retries."""
    jump = None
    if ep.jump:
        if depth >= MAX_JUMPS:
            raise _fail(ep, f"more than {MAX_JUMPS} ProxyJump hops (a loop in ~/.ssh/config?)")
        jep = _jump_endpoint(ep, ssh, config)
        try:
            jump = dial(jep, replace(ssh, jump_host=jep.jump), config, depth + 1)
        except ConnectError as e:
            raise _fail(ep, f"via {e.message}", e.hint) from None
    try:
        for attempt in range(HANDSHAKE_RETRIES + 1):
            try:
                return _Conn(_handshake(ep, jump), [jump] if jump else [])
            except _Dropped as e:
                if attempt == HANDSHAKE_RETRIES:
                    raise _fail(ep, f"connection dropped during the SSH handshake ({e})",
                                "the host's sshd may limit concurrent connections (MaxStartups)"
                                ) from None
                time.sleep(0.2 * 2 ** attempt + random.uniform(0, 0.2))
    except BaseException:
        if jump:
            jump.close()
        raise
    raise AssertionError("unreachable")


class _Dropped(Exception):
    pass


def _open_sock(ep: Endpoint, jump: _Conn | None):
    if jump is None:
        return _tcp(ep)
    import paramiko
    try:
        return jump.transport.open_channel("direct-tcpip", (ep.address, ep.port),
                                           ("127.0.0.1", 0), timeout=ep.timeout)
    except paramiko.ChannelException as e:
        raise _fail(ep, f"jump host cannot reach it: {e.text}") from None
    except paramiko.SSHException as e:
        raise _fail(ep, f"jump host connection failed: {e}") from None


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


def _handshake(ep: Endpoint, jump: _Conn | None):
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
        return _fail(ep, f"host key CHANGED ({e.key.get_name()} {e.key.fingerprint}, "
                         f"known_hosts has {e.expected_key.fingerprint}): "
                         "possible man-in-the-middle",
                     "if the host was reinstalled, check the new fingerprint, then "
                     f"`ssh-keygen -R '{ep.key_name}' -f {ep.known_hosts[0]}`")
    if isinstance(e, paramiko.AuthenticationException) or (
            isinstance(e, paramiko.SSHException) and "authentication methods" in str(e)):
        keys = ", ".join(ep.key_files) or "the agent and ~/.ssh/id_*"
        return _fail(ep, f"authentication failed as user {ep.user} (tried {keys})",
                     "set ssh.identity_file (or IdentityFile in ~/.ssh/config) to a key "
                     f"authorised for {ep.user}, or ssh.user")
    if _is_dropped(e) and elapsed < ep.timeout * 0.9:
        return _Dropped(str(e) or type(e).__name__)
    if isinstance(e, (socket.timeout, TimeoutError)) or "banner" in str(e):
        return _fail(ep, f"no SSH handshake within {ep.timeout:g}s")
    if isinstance(e, (paramiko.SSHException, OSError, EOFError)):
        return _fail(ep, f"SSH handshake failed: {e or type(e).__name__}")
    return e


class SshTransport(Transport):
    """One host over SSH: a connection reused for every channel, more when MaxSessions bites."""

    def __init__(self, host: Host, *, ssh_config: str | None = None) -> None:
        self.host = host
        self._config_path = ssh_config or "~/.ssh/config"
        self._endpoint: Endpoint | None = None
        self._conns: list[_Conn] = []
        self._lock = threading.Lock()            # one dialer at a time per host
        self._procs: set[SshProc] = set()        # spawned channels die if collected (§6b)

    @property
    def label(self) -> str:
        if self._endpoint:
            return self._endpoint.label
        return f"{self.host.name} ({self.host.address}:{self.host.ssh.port or 22})"

    def _dial(self) -> _Conn:
        config = load_ssh_config(self._config_path)
        ep = resolve(self.host.name, self.host.address, self.host.ssh, config)
        self._endpoint = ep
        return dial(ep, self.host.ssh, config)

    def connect(self) -> None:
        with self._lock:
            self._conns = [c for c in self._conns if c.active()]
            if not self._conns:
                self._conns.append(self._dial())

    def _channel(self):
        """A fresh session channel, on a new connection if every open one is full."""
        import paramiko
        self.connect()
        tried: set[int] = set()
        while True:
            with self._lock:
                conns = [c for c in self._conns if id(c) not in tried and c.active()]
                if not conns:
                    conn = self._dial()
                    self._conns.append(conn)
                    conns = [conn]
            for conn in conns:
                tried.add(id(conn))
                try:
                    return conn.transport.open_session(timeout=self._endpoint.timeout)
                except paramiko.ChannelException:
                    continue                     # MaxSessions: "administratively prohibited"
                except (paramiko.SSHException, EOFError, OSError):
                    continue                     # that connection died; is_active() drops it

    def run(self, argv: Sequence[str], input: bytes = b"", timeout: float = 60.0) -> Result:
        deadline = time.monotonic() + timeout
        cmd = _command(argv)
        chan = self._channel()
        try:
            chan.exec_command(cmd)
            if input:
                threading.Thread(target=_send_and_close, args=(chan, input), daemon=True).start()
            else:
                chan.shutdown_write()
            out, err = bytearray(), bytearray()
            fd = chan.fileno()
            while True:
                _drain(chan, out, err)
                if chan.eof_received or chan.closed:
                    _drain(chan, out, err)
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._deadline(cmd, timeout)
                select.select([fd], [], [], left)
            if not chan.status_event.wait(max(0.0, deadline - time.monotonic())):
                raise self._deadline(cmd, timeout)
            return Result(chan.recv_exit_status(), bytes(out), bytes(err))
        finally:
            chan.close()

    def _deadline(self, cmd: str, timeout: float) -> DeadlineError:
        return DeadlineError(f"host {self.label}: `{cmd[:80]}` did not finish within {timeout:g}s")

    def spawn(self, argv: Sequence[str]) -> Proc:
        chan = self._channel()
        chan.exec_command(_command(argv))
        proc = SshProc(chan, self)
        with self._lock:
            self._procs = {p for p in self._procs if not p.chan.closed}
            self._procs.add(proc)
        return proc

    def put(self, data: bytes, path: str, mode: int = 0o600) -> None:
        import paramiko
        if path.startswith("~/"):
            path = path[2:]                      # SFTP starts in the login user's home
        chan = self._channel()
        try:
            chan.settimeout(max(60.0, self._endpoint.timeout))
            chan.invoke_subsystem("sftp")
            sftp = paramiko.SFTPClient(chan)
            try:
                _sftp_put(sftp, data, path, mode)
            finally:
                sftp.close()
        except (OSError, paramiko.SSHException) as e:
            raise ConnectError(f"host {self.label}: cannot write {path}: {e}") from None
        finally:
            chan.close()

    def close(self) -> None:
        with self._lock:
            for p in self._procs:
                p.kill()
            self._procs.clear()
            for c in self._conns:
                c.close()
            self._conns.clear()


def _send_and_close(chan, data: bytes) -> None:
    try:
        chan.sendall(data)
        chan.shutdown_write()
    except OSError:
        pass                                     # the command exited without reading it all


def _drain(chan, out: bytearray, err: bytearray) -> None:
    while chan.recv_ready():
        out += chan.recv(65536)
    while chan.recv_stderr_ready():
        err += chan.recv_stderr(65536)


def _sftp_put(sftp, data: bytes, path: str, mode: int) -> None:
    parent, base = os.path.split(path)
    _sftp_makedirs(sftp, parent)
    tmp = os.path.join(parent, f".{base}.{os.getpid()}-{random.getrandbits(32):08x}.tmp")
    try:
        with sftp.file(tmp, "wb") as f:
            f.chmod(mode)                        # before any byte lands
            f.set_pipelined(True)
            f.write(data)
        sftp.posix_rename(tmp, path)
    except BaseException:
        try:
            sftp.remove(tmp)
        except OSError:
            pass
        raise


def _sftp_makedirs(sftp, parent: str) -> None:
    if not parent or parent == "/":
        return
    try:
        sftp.stat(parent)
        return
    except FileNotFoundError:
        pass
    _sftp_makedirs(sftp, os.path.dirname(parent))
    try:
        sftp.mkdir(parent, 0o700)
    except OSError:
        sftp.stat(parent)                        # created meanwhile by a concurrent put


class SshProc(Proc):
    """A command on an exec channel without a PTY; kill() closes the channel."""

    def __init__(self, chan, transport: SshTransport) -> None:
        self.chan = chan
        self._transport = transport              # keeps the connection alive with us
        self._err = bytearray()
        self._err_lock = threading.Lock()

    def write(self, data: bytes) -> None:
        if self.chan.closed or self.chan.eof_sent:
            raise BrokenPipeError(f"channel to {self._transport.label} is closed")
        try:
            self.chan.sendall(data)
        except OSError as e:
            raise BrokenPipeError(f"channel to {self._transport.label}: {e}") from None

    def close_stdin(self) -> None:
        if not self.chan.closed:
            self.chan.shutdown_write()

    def read(self, n: int = 65536) -> bytes:
        chan = self.chan
        fd = chan.fileno()
        while True:
            if chan.recv_ready():
                return chan.recv(n)
            self._drain_stderr()                 # unread stderr would stall the window
            if chan.eof_received or chan.closed:
                return chan.recv(n) if chan.recv_ready() else b""
            select.select([fd], [], [], 1.0)

    def _drain_stderr(self) -> None:
        with self._err_lock:
            while self.chan.recv_stderr_ready():
                self._err += self.chan.recv_stderr(65536)

    def read_stderr(self) -> bytes:
        """Stderr received since the last call (never blocks)."""
        self._drain_stderr()
        with self._err_lock:
            data, self._err = bytes(self._err), bytearray()
        return data

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.chan.status_event.wait(timeout):
            return None
        return self.chan.recv_exit_status()

    def kill(self) -> None:
        self.chan.close()
