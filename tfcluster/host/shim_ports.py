"""The host's side of ports: who holds one, and whether a started server is listening.

Shipped beside shim.py (standard library only, Python >= 3.8). Sockets are read from
/proc/net/tcp{,6} (which names the owning uid of each) and matched to processes through
/proc/PID/fd. A server is ready only when the listening socket on its port belongs to
the process the shim started (or one of its descendants); see docs/ARCHITECTURE.md,
"The remote process model".
"""
from __future__ import annotations

import os
import socket
import struct
import time

if __package__:
    from . import shim_procs as procs
else:  # shipped: the shim's directory is first on sys.path
    import shim_procs as procs

LISTEN = "0A"      # the TCP state column of a listening socket in /proc/net/tcp


def port_free(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def sockets() -> list[tuple[int, str, int, str]]:
    """(local port, state, owner uid, inode) of every TCP socket in this network namespace."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[9] != "0":
                found.append((int(cols[1].rsplit(":", 1)[1], 16), cols[3], int(cols[7]), cols[9]))
    return found


def listeners() -> dict[int, dict[str, int]]:
    """port -> {inode: owner uid} of the listening sockets.

    Asked of the kernel over sock_diag netlink for listening sockets only: reading
    /proc/net/tcp walks the whole connection hash table, sized by memory (9 ms a scan on a
    24 GiB machine with 25 sockets), which a wait polling every 50 ms per host turned into
    a tenth of a core beside the servers' TensorFlow imports. /proc is the fallback where
    netlink is refused (docs/ARCHITECTURE.md, "The remote process model")."""
    try:
        return _diag_listeners()
    except (OSError, AttributeError, ValueError, struct.error):
        pass
    found: dict[int, dict[str, int]] = {}
    for port, state, uid, inode in sockets():
        if state == LISTEN:
            found.setdefault(port, {})[inode] = uid
    return found


# sock_diag (linux/sock_diag.h, linux/inet_diag.h): a dump request for TCP sockets in the
# LISTEN state skips the established-connection table entirely.
NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY = 4, 20
NLM_F_REQUEST, NLM_F_DUMP, NLMSG_ERROR, NLMSG_DONE = 0x1, 0x300, 2, 3
TCP_LISTEN = 10
NLMSG_HDR = struct.Struct("=IHHII")             # len, type, flags, seq, pid
DIAG_REQ = struct.Struct("=BBBBI48x")           # family, protocol, ext, pad, states, sockid
SPORT_AT, UID_INODE_AT = 4, 64                  # offsets in inet_diag_msg
UID_INODE = struct.Struct("=II")


def _diag_listeners() -> dict[int, dict[str, int]]:
    found: dict[int, dict[str, int]] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as s:
        s.settimeout(2.0)
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), 1):
            req = DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN)
            s.sendall(NLMSG_HDR.pack(NLMSG_HDR.size + len(req), SOCK_DIAG_BY_FAMILY,
                                     NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + req)
            done = False
            while not done:
                data = s.recv(1 << 16)
                if not data:
                    raise OSError("sock_diag: no answer")
                at = 0
                while at + NLMSG_HDR.size <= len(data):
                    length, kind, _flags, got_seq, _pid = NLMSG_HDR.unpack_from(data, at)
                    if length < NLMSG_HDR.size:
                        raise OSError("sock_diag: bad message")
                    body = at + NLMSG_HDR.size
                    if kind == NLMSG_ERROR:
                        raise OSError("sock_diag refused")
                    if kind == NLMSG_DONE:
                        done = True
                        break
                    if got_seq == seq and length >= NLMSG_HDR.size + UID_INODE_AT + UID_INODE.size:
                        port = int.from_bytes(data[body + SPORT_AT:body + SPORT_AT + 2], "big")
                        uid, inode = UID_INODE.unpack_from(data, body + UID_INODE_AT)
                        found.setdefault(port, {})[str(inode)] = uid
                    at += (length + 3) & ~3
    return found


def holding(pid: int, inodes) -> bool:
    """Whether `pid` has one of these sockets open (False when its fds are not ours to read)."""
    wanted = {"socket:[%s]" % inode for inode in inodes}
    try:
        fds = os.listdir("/proc/%d/fd" % pid)
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink("/proc/%d/fd/%s" % (pid, fd)) in wanted:
                return True
        except OSError:
            continue
    return False


def descendants(pid: int) -> list[int]:
    """Every live descendant of pid, from /proc/*/stat's parent field."""
    children: dict[int, list[int]] = {}
    for p in procs.all_pids():
        parent = procs.parent_of(p)
        if parent is not None:
            children.setdefault(parent, []).append(p)
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def readiness(pid: int, port: int, table: dict[int, dict[str, int]]) -> tuple[str | None, str | None]:
    """("ready", None) when pid or a descendant listens on port; ("taken", holder) when
    only someone else does; (None, None) while nobody listens. `table`: listeners()."""
    inodes = table.get(port)
    if not inodes:
        return None, None
    if holding(pid, inodes) or any(holding(p, inodes) for p in descendants(pid)):
        return "ready", None
    return "taken", describe_holder(inodes)


def user_name(uid: int) -> str:
    try:
        import pwd
        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return "uid %d" % uid


HOLDER_TEXT = 240     # characters of a holder's command line shown


def describe(pid: int) -> str:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        argv = []
    words = [os.path.basename(a) if i == 0 else a for i, a in enumerate(argv)]
    # another user chose these bytes: no newline or escape sequence reaches a terminal; long
    # enough for a server's `<workdir>/<name>/bin/tfserver.py` (names.server_workdir)
    text = " ".join("".join(c if c.isprintable() else " " for c in " ".join(words)).split())
    said = "pid %d (%s)" % (pid, text[:HOLDER_TEXT]) if text else "pid %d" % pid
    return said + _of_cluster(pid)


def _of_cluster(pid: int) -> str:
    """`, task ps:0 of tfcluster cluster 'lab'` for a process of ours a tfcluster started (its
    tag: cluster[@instance]:run:job:index:role), "" for any other. Another user's environment
    is not readable, so it is never named this way."""
    parts = (procs.tag_of(pid) or "").split(":")
    if len(parts) != 5 or not parts[3].isdigit():
        return ""
    cluster = "".join(c for c in parts[0].partition("@")[0] if c.isprintable())[:64]
    job = "".join(c for c in parts[2] if c.isprintable())[:32]
    return ", task %s:%s of tfcluster cluster %r" % (job, parts[3], cluster)


def describe_holder(inodes: dict[str, int]) -> str:
    """Who holds these sockets: `pid N (argv)`, with `, user U` when that user is not us;
    only the user when the process cannot be seen (another user's fds are unreadable
    unless we are root)."""
    uids = set(inodes.values())
    foreign = sorted(u for u in uids if u != os.geteuid())
    user = user_name((foreign or sorted(uids))[0]) if uids else None
    suffix = ", user %s" % user if foreign else ""
    for pid in procs.all_pids():
        if holding(pid, inodes):
            return describe(pid) + suffix
    return "a process of user %s" % user if foreign else "in use"


def port_holder(port: int) -> str:
    """Who holds a port that cannot be bound (any socket state); the user is named when
    it is not ours."""
    inodes = {inode: uid for p, _state, uid, inode in sockets() if p == port}
    return describe_holder(inodes) if inodes else "in use"


BINDABLE_POLL = 0.05     # between two tries of a port a killed server held


def wait_bindable(wanted: list, settle: float) -> dict:
    """port -> None once it binds, else its holder after `settle` seconds of trying."""
    deadline, nap = time.monotonic() + max(0.0, settle), BINDABLE_POLL / 10
    while True:
        busy = [p for p in wanted if not port_free(p)]
        if not busy or time.monotonic() >= deadline:
            return {str(p): (port_holder(p) if p in busy else None) for p in wanted}
        time.sleep(nap)            # a killed server's socket goes within ms: soon, then less often
        nap = min(BINDABLE_POLL, nap * 2)
