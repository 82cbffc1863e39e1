"""The host's side of process ownership: /proc, pid files, killing by tag.

Shipped beside shim.py (standard library only, Python >= 3.8). A task is recognised by
its owner (our uid), the tag in its environment and its start time, never by its name or
pid alone; see docs/ARCHITECTURE.md, "The remote process model" and "Naming".
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import time

if __package__:
    from .shim_fs import expand, remove_quietly, write_new
    from .shim_protocol import SHIM_VAR, TAG_VAR, ShimError
else:  # shipped: the shim's directory is first on sys.path
    from shim_fs import expand, remove_quietly, write_new
    from shim_protocol import SHIM_VAR, TAG_VAR, ShimError

POLL = 0.05
FIRST_NAP = 0.005       # a stop's first look after its signals; doubled up to POLL
_TAG_KEY = (TAG_VAR + "=").encode()
_SHIM_KEY = (SHIM_VAR + "=").encode()


def write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def as_pid(value) -> int | None:
    """A pid from a record, or None for anything that is not a plain integer > 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if value > 1 else None


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    return data[data.rindex(")") + 2:].split()


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start_time in clock ticks) of a pid, or None if it is gone."""
    fields = _stat_fields(pid)
    return (fields[0], int(fields[19])) if fields else None


def uptime(pid: int) -> float | None:
    """Seconds since the process started, from /proc (None if it is gone)."""
    stat = proc_stat(pid)
    try:
        with open("/proc/uptime") as f:
            booted = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return round(booted - stat[1] / os.sysconf("SC_CLK_TCK"), 3) if stat else None


def parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def owned(pid: int) -> bool:
    """The process's real and effective uid are ours: only our own processes are ever
    stopped or counted, also when the shim runs as root."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("Uid:"):
                    real, effective = (int(x) for x in line.split()[1:3])
                    return real == effective == os.geteuid()
    except (OSError, ValueError):
        pass
    return False


def instance_id(cluster_dir: str) -> str:
    """This cluster's identity on this host: a hash of its directory as the host resolves
    it (docs/ARCHITECTURE.md, "Naming")."""
    path = os.path.realpath(expand(cluster_dir))
    return hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:12]


def qualify(text: str, cluster_dir: str) -> str:
    """A tag or tag prefix from the package (`lab:run:...`) with this cluster's identity
    added to its cluster field (`lab@<id>:run:...`)."""
    cluster, sep, rest = str(text).partition(":")
    if not cluster or not sep or "@" in cluster:
        raise ShimError("bad tag or tag prefix: %r" % (text,))
    return "%s@%s:%s" % (cluster, instance_id(cluster_dir), rest)


def is_alive(pid: int) -> bool:
    """Running and not a zombie (`kill -0` says a zombie is alive; it is not)."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def tag_of(pid: int) -> str | None:
    return _value(_environ(pid), _TAG_KEY)


def _environ(pid: int) -> bytes:
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return f.read()
    except OSError:  # gone, or not ours to read
        return b""


def _value(environ: bytes, key: bytes) -> str | None:
    # the first KEY= entry, found by one C-level scan (splitting the environment into
    # items was most of `down`'s CPU on a machine with many processes)
    if environ.startswith(key):
        start = len(key)
    else:
        start = environ.find(b"\0" + key)
        if start < 0:
            return None
        start += 1 + len(key)
    end = environ.find(b"\0", start)
    return environ[start:end if end >= 0 else len(environ)].decode(errors="replace")


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def tagged(match, owner: str | None = None) -> dict[int, str]:
    """pid -> tag of every live process of ours (not this shim) whose tag satisfies `match`;
    with `owner`, only those a shim of that pid started (SHIM_VAR, inherited by descendants)."""
    me = os.getpid()
    found = {}
    for pid in all_pids():
        if pid == me or pid <= 1:
            continue
        environ = _environ(pid)
        tag = _value(environ, _TAG_KEY)
        if tag is None or not match(tag) or (owner is not None and _value(environ, _SHIM_KEY) != owner):
            continue
        if owned(pid) and is_alive(pid):
            found[pid] = tag
    return found


def group_of(pid, match) -> int | None:
    """The process group to signal for a task, read from the live process, never from a
    record: only for a process of ours with a matching tag that leads its own group
    (every task starts in a session of its own), so never 0, 1 or negative."""
    pid = as_pid(pid)
    tag = tag_of(pid) if pid else None
    if tag is None or not match(tag) or not owned(pid) or not is_alive(pid):
        return None
    try:
        pgid = os.getpgid(pid)
    except OSError:
        return None
    return pgid if pgid == pid else None


def pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def signal_quietly(pid: int, sig: int, group: bool = False) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


# ---------------------------------------------------------------- killing

def kill_tasks(groups: list[int], match, grace: float, found: dict | None = None,
               owner: str | None = None) -> dict[int, str]:
    """TERM the groups (each one the caller verified: group_of, or its own unreaped child)
    and every matching process of ours (`found`: the caller's own tagged(match), just
    read), wait up to `grace` for those, then KILL them and any found by a fresh tag scan
    until each is a zombie or gone (at most 2 s). `owner`: as for tagged, the scans' too.

    Returns the processes still alive and tagged at the end (pid -> tag)."""
    groups = [g for g in groups if as_pid(g)]
    for pgid in groups:
        signal_quietly(pgid, signal.SIGTERM, group=True)
    termed = {}
    for pid in (tagged(match, owner) if found is None else found):
        signal_quietly(pid, signal.SIGTERM)
        stat = proc_stat(pid)
        if stat is not None:
            termed[pid] = stat[1]
    # The grace is waited on the processes TERMed, each by pid and start time: a scan of
    # every process's environment (tagged) costs ~15 us a process, and on a machine that
    # is many hosts of a spec every host's stop scans every process.
    deadline, nap = time.monotonic() + grace, FIRST_NAP
    while time.monotonic() < deadline and any(_same(pid, start) for pid, start in termed.items()):
        time.sleep(nap)            # most tasks go within ms of a TERM: look again soon, then less often
        nap = min(POLL, nap * 2)
    left = tagged(match, owner)
    # A group is KILLed only while a verified member (ours, matching tag) is alive in it:
    # a live member keeps the pgid from being reused, so the KILL reaches the group TERMed.
    members = {pgid_of(pid) for pid in left}
    for pgid in groups:
        if pgid in members:
            signal_quietly(pgid, signal.SIGKILL, group=True)
    # Then KILL until every process signalled is a zombie or gone (by pid and start time),
    # rescanning the tag for late ones. A dying process's environment reads empty (so it is no
    # longer `tagged`) from the moment it lets go of its memory, but it runs on while the
    # kernel frees that memory (0.1 s for 2 GB) and holds its sockets until the end; one that
    # runs on untagged because it replaced its environment is still the process asked to stop.
    deadline, nap = time.monotonic() + 2.0, FIRST_NAP
    while True:
        for pid in left:
            stat = proc_stat(pid)
            if stat is not None:
                termed[pid] = stat[1]        # tagged and ours now, whatever ran as pid before
        running = {pid for pid, start in termed.items() if _same(pid, start)}
        for pid in running:
            signal_quietly(pid, signal.SIGKILL)
        if not running or time.monotonic() > deadline:
            return {pid: tag for pid, tag in left.items() if pid in running}
        time.sleep(nap)
        nap = min(POLL, nap * 2)
        left = tagged(match, owner)


def _same(pid: int, start: int) -> bool:
    """The process TERMed as `pid` still runs (not a zombie, same start time)."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X") and stat[1] == start


# ---------------------------------------------------------------- pid files

def write_pidfile(path: str, record: dict) -> None:
    write_new(path, json.dumps(record).encode())


def remove_own(path: str, pid: int) -> None:
    """Drop the pid file if it still records `pid` (every attempt rewrites it as it starts):
    a later attempt of the task, started by another shim (a restart over a new connection),
    wrote its own there."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return
    if isinstance(record, dict) and record.get("pid") == pid:
        remove_quietly(path)


def read_pidfiles(piddir: str, tag_prefix: str) -> list[tuple[str, dict]]:
    piddir = expand(piddir)
    try:
        names = sorted(os.listdir(piddir))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        if not name.endswith(".pid"):
            continue
        path = os.path.join(piddir, name)
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and str(record.get("tag", "")).startswith(tag_prefix):
            found.append((path, record))
    return found


def verified(record: dict) -> bool:
    """The pid in a pid file is still that task: ours, same tag, same start time."""
    pid = as_pid(record.get("pid"))
    stat = proc_stat(pid) if pid else None
    return (stat is not None and stat[0] not in ("Z", "X") and stat[1] == record.get("start_time")
            and tag_of(pid) == record.get("tag") and owned(pid))
