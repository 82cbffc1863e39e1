"""SSH transport over paramiko: session channels and SFTP on pooled connections.

paramiko is imported inside functions only: `plan` and `--help` never pay for it.
Where to connect comes from ssh_config.py, connecting from ssh_connect.py. No PTY
anywhere: a PTY would merge stderr into stdout and rewrite binary output.
"""
from __future__ import annotations

import dataclasses
import os
import posixpath
import random
import select
import shlex
import stat
import threading
import time
from typing import BinaryIO, Callable, Sequence

from tfcluster.errors import ConnectError, DeadlineError, PreflightError
from tfcluster.localfs import chunks, is_hole
from tfcluster.transport import liveness
from tfcluster.transport.base import Forward, Proc, Result, Transport, home_relative
from tfcluster.transport.offmain import off_main
from tfcluster.transport.ssh_config import USER_CONFIG, Endpoint, SshOptions, load_ssh_config, resolve
from tfcluster.transport.ssh_connect import Connection, dial

MAX_CHANNEL_DIALS = 3       # fresh connections one channel request may open (MaxSessions)
# Reads of up to 1 MiB: a partial read makes paramiko move the rest of its buffer down
# (`del buf[:n]`); at 64 KiB a 2 MiB backlog (its window) was moved 32 times per 2 MiB read,
# a third of the launcher's streaming CPU, in benchmarks/log_stream.py. Bigger reads only cost memory.
WHOLE = 1 << 20
REOPEN_PAUSE = 0.2          # between two dials while a dropped connection is re-opened
MAX_LINKS = 16              # symbolic links a put's directory may go through (shim_fs.MAX_LINKS)


def _command(argv: Sequence[str]) -> str:
    """The line sshd's login shell runs: every word quoted, except the `~/` of a program
    under the home (`python: ~/venv/bin/python`), which the shell expands."""
    words = [shlex.quote(a) for a in argv]
    if argv and argv[0].startswith("~/") and len(argv[0]) > 2:
        words[0] = "~/" + shlex.quote(argv[0][2:])
    return " ".join(words)


class SshTransport(Transport):
    """One host over SSH: a connection reused for every channel, more when MaxSessions bites."""

    def __init__(self, name: str, address: str, options: SshOptions) -> None:
        self.name = name
        self.address = address
        self.options = options
        self._endpoint: Endpoint | None = None
        self._conns: list[Connection] = []
        self._lock = threading.Lock()            # one dialer at a time per host
        # paramiko closes a channel once its object is collected: keep every spawned one
        # referenced, so a task lives until kill() or close(), not until the caller's GC.
        self._procs: set[SshProc] = set()
        # a keepalive that wants an answer on every connection (transport/liveness.py)
        self.keepalive_interval = liveness.PROBE_INTERVAL
        self.silent_after = liveness.SILENT_AFTER
        self._watches: list[liveness.Watch] = []
        self._uid: int | None = None             # remote_uid(), once asked

    @property
    def connections(self) -> tuple[Connection, ...]:
        """The connections open now, oldest first (a snapshot: dials and drops go on)."""
        return tuple(self._conns)

    @property
    def label(self) -> str:
        if self._endpoint:
            return self._endpoint.label
        return f"{self.name} ({self.address}:{self.options.port or 22})"

    def _dial(self, timeout: float | None = None) -> Connection:
        """Open a new connection and add it to self._conns; the caller holds self._lock.
        `timeout` bounds this dial's connect and handshake below the host's own."""
        config = load_ssh_config(USER_CONFIG)
        ep = resolve(self.name, self.address, self.options, config)
        self._endpoint = ep
        if timeout is not None:
            ep = dataclasses.replace(ep, timeout=max(0.1, min(ep.timeout, timeout)))
        conn = dial(ep, self.options, config)
        self._conns.append(conn)
        self._watches = [w for w in self._watches if w.transport.is_active()]
        interval, silent = ep.alive or (self.keepalive_interval, self.silent_after)
        self._watches.append(liveness.Watch(conn.transport, conn.close, self._went_silent,
                                            interval, silent, self.name))
        return conn

    def _went_silent(self, reason: str) -> None:
        self.lost = reason

    @off_main
    def reopen(self, within: float) -> str | None:
        """After a dropped connection: None once a connection is open again, else why none
        could be opened in `within` seconds (each dial bounded by what is left of them)."""
        deadline = time.monotonic() + within
        why = "no try"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return why
            try:
                with self._lock:
                    self._prune(ending=True)
                    if self._conns:
                        return None
                    self._dial(timeout=min(left, self.options.connect_timeout))
                return None
            except ConnectError as e:
                why = e.message
            time.sleep(min(REOPEN_PAUSE, max(0.0, deadline - time.monotonic())))

    def connected(self) -> bool:
        return any(c.active() and not c.ending() for c in self._conns)

    def _prune(self, ending: bool = False) -> None:
        """Drop the connections that died, closing what they hold (jump connections, a
        ProxyCommand); the caller holds self._lock. `ending`: also those whose transport
        thread already ended on an EOF or a socket error (paramiko ends their channels
        before it marks them inactive, so a channel's end can be seen first)."""
        alive = []
        for c in self._conns:
            if c.active() and not (ending and c.ending()):
                alive.append(c)
            else:
                c.close()
        self._conns = alive

    @off_main
    def connect(self) -> None:
        with self._lock:
            self._prune()
            if not self._conns:
                self._dial()

    def _channel(self):
        """A fresh session channel, on a new connection if every open one is full.

        At most MAX_CHANNEL_DIALS new connections per call: an sshd that refuses every
        session (MaxSessions 0, a ForceCommand gone wrong) must not get dialled forever."""
        from tfcluster.transport._paramiko import paramiko
        tried: list[Connection] = []             # by identity: ids are reused once collected
        dials = 0
        last: BaseException | None = None
        while True:
            with self._lock:
                self._prune()
                conns = [c for c in self._conns if not any(c is t for t in tried)]
                if not conns:
                    if dials == MAX_CHANNEL_DIALS:
                        break
                    dials += 1
                    conns = [self._dial()]
            for conn in conns:
                tried.append(conn)
                try:
                    return conn.transport.open_session(timeout=self._endpoint.timeout)
                except paramiko.ChannelException as e:
                    last = e                     # MaxSessions: "administratively prohibited"
                except (paramiko.SSHException, EOFError, OSError) as e:
                    last = e                     # that connection died; is_active() drops it
        reason = getattr(last, "text", None) or str(last) or type(last).__name__
        raise ConnectError(f"host {self.label}: no session channel after {MAX_CHANNEL_DIALS} "
                           f"new connections: {reason}",
                           hint="check MaxSessions in the host's sshd_config")

    @off_main
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
            drain = lambda: _recv_stderr(chan, err)  # noqa: E731
            try:
                while chunk := _read_stdout(chan, WHOLE, drain, deadline):
                    out += chunk
            except TimeoutError:
                raise self._deadline(cmd, timeout) from None
            drain()                              # stderr that came in just before EOF
            if not chan.status_event.wait(max(0.0, deadline - time.monotonic())):
                raise self._deadline(cmd, timeout)
            return Result(chan.recv_exit_status(), bytes(out), bytes(err))
        finally:
            chan.close()

    def _deadline(self, cmd: str, timeout: float) -> DeadlineError:
        return DeadlineError(f"host {self.label}: `{cmd[:80]}` did not finish within {timeout:g}s")

    @off_main
    def spawn(self, argv: Sequence[str]) -> Proc:
        chan = self._channel()
        chan.exec_command(_command(argv))
        proc = SshProc(chan, self)
        with self._lock:
            self._procs = {p for p in self._procs if not p.chan.closed}
            self._procs.add(proc)
        return proc

    def put(self, data: bytes, path: str, mode: int = 0o600) -> None:
        self.put_many([(data, path, mode)])

    @off_main
    def put_many(self, items) -> None:
        """Every file in one SFTP session: each session is a subsystem the host starts
        through the login shell (a cold host's dozen shim files cost 3 s one by one). Each
        item's data is bytes or a binary file, streamed in chunks (localfs.chunks); every
        directory written into is judged as shim_fs.private_dir judges it (_Judge)."""
        from tfcluster.transport._paramiko import paramiko
        if not items:
            return
        path = items[0][1]
        chan = self._channel()
        try:
            chan.settimeout(max(60.0, self._endpoint.timeout))
            try:
                chan.invoke_subsystem("sftp")
            except paramiko.SSHException:     # refused: sshd closes the channel
                raise PreflightError(f"host {self.label}: its sshd offers no SFTP, which tfcluster "
                                     f"copies files with", hint=NO_SFTP_HINT) from None
            try:
                sftp = paramiko.SFTPClient(chan)
            except paramiko.SFTPError as e:   # "Garbage packet received": words before the server's
                raise PreflightError(f"host {self.label}: its SFTP session did not start ({e}): the "
                                     f"login shell sshd runs it with prints to stdout",
                                     hint=NOISY_SHELL_HINT) from None
            try:
                judge = _Judge(sftp, self)
                for data, path, mode in items:
                    _sftp_put(sftp, data, judge.absolute(path), mode, judge)
            finally:
                sftp.close()
        except _Unsafe as e:
            raise PreflightError(f"host {self.label}: {e}") from None
        except (OSError, paramiko.SSHException) as e:
            raise ConnectError(f"host {self.label}: cannot write {path}: {e}") from None
        finally:
            chan.close()

    def remote_uid(self) -> int:
        """Which uid this connection runs as on the host (`id -u`, asked once): SFTP cannot
        say, and a directory's owner is judged against it (_Judge)."""
        if self._uid is None:
            result = self.run(["id", "-u"], timeout=max(10.0, self.options.connect_timeout))
            words = result.stdout.decode(errors="replace").split()     # a login shell may talk first
            if result.rc != 0 or not words or not words[-1].isdigit():
                raise _Unsafe(f"cannot tell which user you are there (`id -u` exited {result.rc}: "
                              f"{result.stderr.decode(errors='replace').strip()[:200]})")
            self._uid = int(words[-1])
        return self._uid

    def forward(self, port: int, local_port: int = 0) -> Forward:
        """`ssh -L`: each connection to the local port gets a direct-tcpip channel to
        127.0.0.1:`port` on the host, on this transport's connection (transport/forward.py)."""
        from tfcluster.transport.forward import Forwarder
        return Forwarder(lambda origin: self.tunnel(port, origin), local_port, name=self.name)

    @off_main
    def tunnel(self, port: int, origin: tuple[str, int] = ("127.0.0.1", 0)):
        """A direct-tcpip channel to 127.0.0.1:`port` on the host, on a connection already
        open (never a new one: a forward must not outlive close()); raises what paramiko
        raises (nothing listening there: ChannelException)."""
        with self._lock:
            conns = [c for c in self._conns if c.active()]
        if not conns:
            raise ConnectError(f"host {self.label}: not connected")
        return conns[0].transport.open_channel("direct-tcpip", ("127.0.0.1", port), origin,
                                               timeout=self._endpoint.timeout)

    @off_main
    def close(self) -> None:
        with self._lock:
            for w in self._watches:
                w.stop()
            self._watches.clear()
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


def _recv_stderr(chan, into: bytearray) -> None:
    while chan.recv_stderr_ready():
        into += chan.recv_stderr(WHOLE)


def _read_stdout(chan, n: int, drain_stderr: Callable[[], None],
                 deadline: float | None = None) -> bytes:
    """Up to `n` bytes of stdout as soon as there are any; b"" at EOF.

    Stderr is drained while waiting: unread, it fills the channel window and the
    server stops sending stdout too. Raises TimeoutError once `deadline` (monotonic)
    passes."""
    fd = chan.fileno()
    while True:
        if chan.recv_ready():
            return chan.recv(n)
        drain_stderr()
        if chan.eof_received or chan.closed:
            return chan.recv(n) if chan.recv_ready() else b""
        # paramiko's pipe fd signals data, EOF and close; polling at least once a second
        # only bounds a wakeup lost to its set/clear race between threads
        wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
        if wait <= 0:
            raise TimeoutError
        select.select([fd], [], [], wait)


NOISY_SHELL_HINT = ("make the host's shell start-up files print nothing for a non-interactive "
                    "session (e.g. `[ -z \"$PS1\" ] && return` at the top of ~/.bashrc), or set "
                    "`Subsystem sftp internal-sftp` in its sshd_config (no shell at all)")
NO_SFTP_HINT = ("add `Subsystem sftp internal-sftp` (or the sftp-server path) to the host's "
                "sshd_config and reload sshd")


def _sftp_put(sftp, data: bytes | BinaryIO, path: str, mode: int, judge: _Judge) -> None:
    """`data` to the absolute `path` under a fresh name, mode set before the first byte, in
    chunks with each run of zeros skipped (a hole, as localfs.write_sparse), then renamed."""
    parent, base = posixpath.split(path)
    parent = judge.private_dir(parent or "/")
    tmp = posixpath.join(parent, f".{base}.{os.getpid()}-{random.getrandbits(32):08x}.tmp")
    try:
        with sftp.file(tmp, "wbx") as f:
            f.chmod(mode)                        # before any byte lands
            f.set_pipelined(True)
            at = 0
            for chunk in chunks(data):
                if is_hole(chunk):
                    f.seek(len(chunk), f.SEEK_CUR)
                else:
                    f.write(chunk)
                at += len(chunk)
            f.truncate(at)                       # a trailing hole still counts
        sftp.posix_rename(tmp, posixpath.join(parent, base))
    except BaseException:
        try:
            sftp.remove(tmp)
        except OSError:
            pass
        raise


class _Unsafe(Exception):
    """The directory a put writes into is not private."""


class _Judge:
    """The directories one SFTP session writes into, judged as shim_fs.private_dir judges
    them on a host (docs/ARCHITECTURE.md, "Files and directories on a host"): missing levels
    made 0700; every existing level from / down owned by you or root and writable by nobody
    else (a root-owned sticky directory such as /tmp excepted); a link followed only when you
    or root own it, where it leads judged the same way. The bootstrap has judged the cluster
    tree already; a checkpoint directory (ckptsync's push) is judged here first.

    SFTP cannot say which user it runs as: root and the home's owner are trusted without
    asking (whoever owns your home can change everything you run anyway); a level owned by
    anyone else is compared with `id -u`, asked once per host."""

    def __init__(self, sftp, transport: SshTransport) -> None:
        self.sftp, self.transport = sftp, transport
        self.home = sftp.normalize(".")          # SFTP starts in the home
        self.trusted = {0, sftp.stat(self.home).st_uid}
        self.judged: set[str] = set()

    def absolute(self, path: str) -> str:
        """`path` as every put names it (absolute, or under the home: base.home_relative)."""
        rest = home_relative(path)
        if rest is None:
            return path
        return posixpath.join(self.home, rest) if rest else self.home

    def private_dir(self, path: str, links: int = 0) -> str:
        """Judge (and make) the absolute directory `path`; where it is, links resolved."""
        cur = "/"
        self._level(cur)
        for name in [p for p in path.split("/") if p]:
            cur = posixpath.join(cur, name)
            if cur in self.judged:
                continue
            try:
                st = self.sftp.lstat(cur)
            except FileNotFoundError:
                try:
                    self.sftp.mkdir(cur, 0o700)
                    self.sftp.chmod(cur, 0o700)      # the server's umask applied to mkdir
                    self.judged.add(cur)
                    continue
                except OSError:
                    st = self.sftp.lstat(cur)        # created meanwhile by a concurrent put
            self._judge(cur, st)
            if stat.S_ISLNK(st.st_mode or 0):
                if links >= MAX_LINKS:
                    raise _Unsafe(f"{path}: too many levels of symbolic links")
                cur = self.private_dir(self.sftp.normalize(cur), links + 1)
            elif not stat.S_ISDIR(st.st_mode or 0):
                raise _Unsafe(f"{cur} is not a directory")
            self.judged.add(cur)
        return cur

    def _level(self, path: str) -> None:
        if path not in self.judged:
            self._judge(path, self.sftp.lstat(path))
            self.judged.add(path)

    def _judge(self, path: str, st) -> None:
        owner, mode = st.st_uid, st.st_mode or 0
        if owner not in self.trusted:
            if owner != self.transport.remote_uid():
                raise _Unsafe(f"{path} is owned by uid {owner}, not by you: refusing to write into it "
                              f"(remove it, or use a directory of your own)")
            self.trusted.add(owner)
        if stat.S_ISLNK(mode):
            return
        if mode & 0o022 and not (mode & stat.S_ISVTX and owner == 0):
            raise _Unsafe(f"{path} is writable by others (mode {stat.S_IMODE(mode):04o}): refusing to "
                          f"write into it (chmod go-w {path}, or use a directory of your own)")


class SshProc(Proc):
    """A command on an exec channel without a PTY; kill() closes the channel."""

    def __init__(self, chan, transport: SshTransport) -> None:
        self.chan = chan
        self._transport = transport              # keeps the connection alive with us
        self._err = bytearray()
        self._err_lock = threading.Lock()

    @off_main
    def write(self, data: bytes) -> None:
        if self.chan.closed or self.chan.eof_sent:
            raise BrokenPipeError(f"channel to {self._transport.label} is closed")
        try:
            self.chan.sendall(data)
        except OSError as e:
            raise BrokenPipeError(f"channel to {self._transport.label}: {e}") from None

    @off_main
    def close_stdin(self) -> None:
        if not self.chan.closed:
            self.chan.shutdown_write()

    @off_main
    def read(self, n: int = WHOLE) -> bytes:
        return _read_stdout(self.chan, n, self._drain_and_tell)

    def _drain_stderr(self) -> int:
        with self._err_lock:
            before = len(self._err)
            _recv_stderr(self.chan, self._err)
            return len(self._err) - before

    def _drain_and_tell(self) -> None:
        if self._drain_stderr() and self.on_stderr is not None:
            self.on_stderr()

    @off_main
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

    @off_main
    def kill(self) -> None:
        self.chan.close()
