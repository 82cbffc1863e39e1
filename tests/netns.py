"""The test bed of separate hosts: each host a network namespace of its own, with its own
PID and mount namespaces, its own address, sshd, nftables and listening sockets, joined to
the others and to this machine by a bridge (docs/development.md, "Hosts that fail like
separate machines"). Loaded as a pytest plugin by conftest.

Why: loopback hosts (sshds on 127.0.0.x of one kernel) share every listening socket and
every process list. A TF server binds `*:PORT`, so after a host dies and its task moves, the
dead host's address still reaches the new server; a sweep by tag on one "host" sees the
others' processes; one nftables table covers every "host". On the bed none of that holds:
- a host **dies**: the init of its PID namespace (its sshd) is SIGKILLed, so the kernel
  kills every process of the host at once, and its link goes down: its address answers
  nothing, as a powered-off box's does;
- a host **goes silent**: every packet on its link is dropped inside its namespace, its
  processes left running (a cable out, a hung kernel);
- a spare is just another namespace.

Addresses come from 198.18.0.0/15 (reserved for benchmarks, routed nowhere). A blackhole
route for the whole range is in place before any link exists, so a packet to a downed host
fails at once on this machine instead of leaving it by the default route; each bed's bridge
route is more specific and wins while it exists. The namespaces have no default route.
Everything a bed made (namespaces, links, processes) is removed when its test ends,
whatever happened; the blackhole route when the session ends.
"""
from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.helpers import cannot_run
from tests.sshd import SSHD, Sshd, _keygen, write_config

RANGE = "198.18.0.0/15"
SSH_PORT = 2222           # every host's sshd, in its own namespace (the port is per host)
IP = shutil.which("ip") or "/usr/sbin/ip"
NFT = shutil.which("nft") or "/usr/sbin/nft"
LOCKS = os.path.join(tempfile.gettempdir(), "tfcluster-bed-locks")


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = [IP, *(("netns", "exec", ns, IP) if ns else ()), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in (IP, NFT, SSHD, shutil.which("unshare"), shutil.which("nsenter")):
        if not tool or not os.path.exists(tool):
            return f"{tool or 'unshare/nsenter'} is not installed"
    probe = f"tfbedprobe{os.getpid()}"
    made = subprocess.run([IP, "netns", "add", probe], capture_output=True, text=True, timeout=20)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run([IP, "netns", "delete", probe], capture_output=True, timeout=20)
    return None


@dataclass
class BedHost:
    name: str                 # the spec's host name
    address: str
    ns: str                   # the network namespace
    link: str                 # this machine's end of its veth pair
    sshd: Sshd
    state: str = "up"         # up | dead | silent

    def spec(self, **extra: str) -> str:
        """The host's entry in a spec's `hosts:` list (flow style, one line)."""
        more = "".join(f", {k}: {v}" for k, v in extra.items())
        return f"{{name: {self.name}, address: {self.address}, ssh: {{port: {SSH_PORT}}}{more}}}"

    def pids(self) -> list[int]:
        """Every live process of this host (its PID namespace, seen from here)."""
        init = self.sshd.proc.pid
        try:
            target = os.readlink(f"/proc/{init}/ns/pid_for_children")
        except OSError:
            return []
        found = []
        for p in psutil.process_iter(["pid"]):
            try:
                if p.pid != init and os.readlink(f"/proc/{p.pid}/ns/pid") == target:
                    found.append(p.pid)
            except OSError:
                continue
        return found

    def run(self, argv: list[str], *, user: int | None = None, timeout: float = 60,
            **kw) -> subprocess.CompletedProcess:
        """`argv` on this host (its network, PID and mount namespaces), as root or as `user`
        (a uid: setpriv drops to it, no PAM)."""
        enter = ["nsenter", "-t", str(self.sshd.proc.pid), "-n", "-p", "-m", "--"]
        if user is not None:
            enter += ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--"]
        return subprocess.run(enter + list(argv), capture_output=True, text=True, timeout=timeout, **kw)


@dataclass
class Bed:
    """Hosts made on demand (`add`), each separate; `kill`, `silence`, `close`."""

    root: Path
    user_key: Path
    known_hosts: Path | None
    index: int                # this bed's /24: 198.18.<index>.0 (198.19 past 254)
    bridge: str
    hosts: dict[str, BedHost] = field(default_factory=dict)
    closed: bool = False
    lock: int | None = None   # the fd whose flock claims `index` (_new_bridge): release() lets it go

    @property
    def prefix(self) -> str:
        return f"198.{18 + self.index // 255}.{self.index % 255}"

    def add(self, name: str) -> BedHost:
        """A new host: its namespaces, its link to the bridge, its address, its sshd."""
        i = len(self.hosts) + 2
        ns, link, peer = f"tfbed{self.index}-{name}", f"tb{self.index}x{i}", f"tb{self.index}y{i}"
        address = f"{self.prefix}.{i}"
        _ip("netns", "add", ns)
        host = None
        try:
            _ip("link", "add", link, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", ns)
            _ip("link", "set", link, "master", self.bridge)
            _ip("link", "set", link, "up")
            _ip("link", "set", peer, "name", "eth0", ns=ns)
            _ip("addr", "add", f"{address}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            host = BedHost(name, address, ns, link, self._sshd(name, ns, address))
        finally:
            if host is None:
                _ip("link", "delete", link, check=False)
                _ip("netns", "delete", ns, check=False)
        self.hosts[name] = host
        if self.known_hosts is not None:
            host.sshd.write_known_hosts(self.known_hosts, [address], mode="a")
        return host

    def _sshd(self, name: str, ns: str, address: str) -> Sshd:
        d = self.root / name
        d.mkdir()
        host_key = d / "host_ed25519"
        pub = _keygen(host_key)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        config = write_config(d, (address,), SSH_PORT, host_key, self.root / "authorized_keys", {})
        log = open(d / "sshd.log", "ab")
        # sshd is the init of the host's PID namespace: killing it kills the whole host. `ip
        # netns exec` mounts a fresh /sys, without the cgroup hierarchy a machine has there:
        # cgroup2 is mounted back (the fence matches the cluster's own cgroup where it can)
        boot = 'mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null; exec "$@"'
        proc = subprocess.Popen([IP, "netns", "exec", ns, "unshare", "--pid", "--mount-proc", "--fork",
                                 "--kill-child", "sh", "-c", boot, "sh", SSHD, "-D", "-e", "-f", str(config)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if _answers(address, SSH_PORT):
                return Sshd(SSH_PORT, (address,), getpass.getuser(), str(self.user_key), pub,
                            str(host_key), str(d / "sshd.log"), _init_of(proc))
            time.sleep(0.05)
        _kill_tree(proc.pid)
        pytest.fail(f"sshd on bed host {name} did not start: {(d / 'sshd.log').read_text()[-2000:]}")

    def kill(self, name: str) -> None:
        """The host dies: every process on it SIGKILLed at once (its PID namespace's init),
        then its link down: from then on its address answers nothing."""
        host = self.hosts[name]
        victims = host.pids()
        with contextlib.suppress(OSError):
            os.kill(host.sshd.proc.pid, signal.SIGKILL)
        _wait_gone([host.sshd.proc.pid, *victims], 10)
        _ip("link", "set", host.link, "down", check=False)
        host.state = "dead"

    def silence(self, name: str) -> None:
        """The host goes silent: every packet in or out of its link dropped, inside its own
        namespace; its processes go on running."""
        host = self.hosts[name]
        rules = ("table inet tfbed_silence {\n"
                 "  chain input { type filter hook input priority -300; policy accept; iifname eth0 drop; }\n"
                 "  chain output { type filter hook output priority -300; policy accept; oifname eth0 drop; }\n"
                 "}\n")
        done = subprocess.run([IP, "netns", "exec", host.ns, NFT, "-f", "-"], input=rules, text=True,
                              capture_output=True, timeout=20)
        assert done.returncode == 0, done.stderr
        host.state = "silent"

    def release(self) -> None:
        """The bed's index free for another bed: only once it is closed for good (the `bed`
        fixture's teardown; a test may close its bed earlier)."""
        self.close()
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None

    def close(self) -> None:
        """Everything of the bed removed; a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        for host in self.hosts.values():
            pids = host.pids()
            with contextlib.suppress(OSError):
                os.kill(host.sshd.proc.pid, signal.SIGKILL)
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            _wait_gone([host.sshd.proc.pid, *pids], 10)
            _ip("link", "delete", host.link, check=False)
            _ip("netns", "delete", host.ns, check=False)
        _ip("link", "delete", self.bridge, check=False)


def _answers(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5) as s:
            return s.recv(4).startswith(b"SSH-")
    except OSError:
        return False


class _Init:
    """The sshd that is pid 1 of a host's PID namespace, as this machine sees it; a Popen's
    shape where tests use one (`pid`, `poll`, `wait`)."""

    def __init__(self, pid: int, launcher: subprocess.Popen) -> None:
        self.pid, self.launcher = pid, launcher

    def poll(self) -> int | None:
        return None if psutil.pid_exists(self.pid) and not _zombie(self.pid) else 0

    def wait(self, timeout: float | None = None) -> int:
        _wait_gone([self.pid], timeout or 10)
        self.launcher.wait(timeout=timeout or 10)
        return 0

    def terminate(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)


def _init_of(launcher: subprocess.Popen) -> _Init:
    """`ip netns exec` execs unshare, which forks sshd as the new PID namespace's init."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        kids = [c for c in psutil.Process(launcher.pid).children() if c.name() == "sshd"]
        if kids:
            return _Init(kids[0].pid, launcher)
        time.sleep(0.02)
    raise RuntimeError("the bed host's sshd was not found under its unshare")


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(not psutil.pid_exists(p) or _zombie(p) for p in pids):
            return
        time.sleep(0.02)
    raise AssertionError(f"bed processes still alive after {timeout}s: {pids}")


def _kill_tree(pid: int) -> None:
    with contextlib.suppress(psutil.Error):
        for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                p.kill()


@pytest.fixture(scope="session")
def _bed_range(tmp_path_factory, sshd_factory):
    """The blackhole route for the bed's range, and the user key every bed host trusts (the
    loopback sshds' own, which the `ssh_home` fixture installs as ~/.ssh/id_ed25519)."""
    why = _unavailable()
    if why:
        cannot_run(f"the separate-host test bed cannot run: {why}")
    with _route_holders() as holders:
        holders.add(os.getpid())
        _ip("route", "add", "blackhole", RANGE, check=False)    # a holder's may be there already
        if "blackhole" not in _ip("route", "show", RANGE).stdout:
            pytest.fail(f"no blackhole route for {RANGE}: a downed host's packets could leave the machine")
    yield tmp_path_factory.mktemp("bed"), sshd_factory.user_key
    with _route_holders() as holders:
        holders.discard(os.getpid())
        if not holders:
            _ip("route", "delete", "blackhole", RANGE, check=False)


@contextlib.contextmanager
def _route_holders():
    """The live test sessions that need the route (pytest-xdist runs several at once): the last
    to leave removes it, never one while another's bed may still send packets for a downed host."""
    path = os.path.join(tempfile.gettempdir(), "tfcluster-bed-route")
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        holders = {int(p) for p in f.read().split() if p.isdigit() and psutil.pid_exists(int(p))}
        yield holders
        f.seek(0)
        f.truncate()
        f.write(" ".join(map(str, sorted(holders))))


def _new_bridge() -> tuple[int, str, int]:
    """A free /24 of the range: its index claimed by a lock held for the bed's whole life (its
    fixture's teardown included, so a second `close` can never remove another bed's bridge),
    then its bridge made. A bridge or namespace found under a free lock is a killed session's."""
    os.makedirs(LOCKS, mode=0o700, exist_ok=True)
    for index in range(1, 2 * 255):
        if index % 255 == 0:
            continue
        fd = os.open(os.path.join(LOCKS, str(index)), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        name = f"tfbed{index}"
        _clear_leftovers(index)
        _ip("link", "delete", name, check=False)
        _ip("link", "add", name, "type", "bridge")
        return index, name, fd
    raise RuntimeError("no free /24 left in the bed's range")


def _clear_leftovers(index: int) -> None:
    """The namespaces and links a session killed before its teardown left with this index: its
    lock was free, so no live bed has them."""
    for line in _ip("netns", "list").stdout.splitlines():
        ns = line.split(" ", 1)[0]
        if ns.startswith(f"tfbed{index}-"):
            _ip("netns", "delete", ns, check=False)
    for line in _ip("-o", "link", "show").stdout.splitlines():
        found = re.match(rf"\d+: (tb{index}x\d+)[@:]", line)
        if found:
            _ip("link", "delete", found.group(1), check=False)


@pytest.fixture
def bed(_bed_range, request) -> Bed:
    """A bed of separate hosts for one test; hosts come with `bed.add(name)`. With the test's
    ~/.ssh (the `ssh_home` fixture) in use, each host's key is trusted there."""
    root, key = _bed_range
    ssh_home = request.getfixturevalue("ssh_home") if "ssh_home" in request.fixturenames else None
    index, bridge, lock = _new_bridge()
    d = root / f"bed{index}-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir()
    shutil.copyfile(key.with_suffix(".pub"), d / "authorized_keys")
    b = Bed(d, key, ssh_home / "known_hosts" if ssh_home else None, index, bridge, lock=lock)
    try:
        prefix = b.prefix
        _ip("addr", "add", f"{prefix}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        yield b
    finally:
        b.release()


# -- dialling from a host, as a user (who is refused where) -------------------------------------

PYTHON = "/usr/bin/python3"   # the system's: the second user can run it

DIAL = ("import json, socket, sys\n"
        "out = {}\n"
        "for a, p in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        socket.create_connection((a, p), 3).close(); out[f'{a}:{p}'] = 'connected'\n"
        "    except OSError as e:\n"
        "        out[f'{a}:{p}'] = type(e).__name__\n"
        "print(json.dumps(out))\n")


def dial_from(host, targets, user=None) -> dict[str, str]:
    """From inside bed `host`, as `user` (uid; None: root), each (address, port) of `targets`
    dialled: 'address:port' -> 'connected' or the error's name."""
    done = host.run([PYTHON, "-c", DIAL, json.dumps(targets)], user=user, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def refused_everywhere(bed, targets, other_user) -> None:
    """From every live host: the second user and the owner's process outside the cluster are
    refused at every target; nothing connects."""
    for host in bed.hosts.values():
        if host.state != "up":
            continue
        for who in (other_user.uid, None):
            got = dial_from(host, targets, who)
            assert set(got.values()) == {"ConnectionRefusedError"}, (host.name, who, got)


class TableWatch:
    """Looks at each host's nftables tables, over and over on a thread, until stop(): which
    hosts were seen without the cluster's table, and when."""

    def __init__(self, hosts, table_prefix: str) -> None:
        self.hosts, self.prefix, self.samples, self.gaps = hosts, table_prefix, 0, []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._look, daemon=True)
        self.thread.start()

    def _look(self) -> None:
        start = time.monotonic()
        while not self.done.is_set():
            for host in self.hosts:
                if self.prefix not in host.run(["nft", "list", "tables"]).stdout:
                    self.gaps.append(f"{host.name} at +{time.monotonic() - start:.2f}s")
            self.samples += 1

    def stop(self) -> list[str]:
        self.done.set()
        self.thread.join(timeout=30)
        return self.gaps
