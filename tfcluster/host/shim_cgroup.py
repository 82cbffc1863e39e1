"""The cluster's cgroup v2 on a host, which the fence (shim_fence.py) matches instead of the
owner's uid: every process a shim starts for the cluster is born in
`<cgroup2 mount>/tfcluster/<instance>`, so only the cluster's own sockets pass its table, not
another TF server of the same user (docs/security.md, "TensorFlow's ports"). Made with the
table, left and removed with it. Shipped beside shim.py: standard library only, Python >= 3.8.
"""
from __future__ import annotations

import errno
import os
import re
import time

if __package__:
    from . import shim_procs as procs
else:  # shipped: the shim's directory is first on sys.path
    import shim_procs as procs

NFT_ROOT = "/sys/fs/cgroup"    # nft names a cgroup by its path under here (at load time)
PARENT = "tfcluster"           # <cgroup2 mount>/tfcluster/<instance>: a cluster's processes
OWN_PROCESS = False            # shim.run() sets it: this process is a shim of its own, which
                               # may join a cluster's cgroup (never the launcher's process)
_LEFT: list = []               # the cgroup this process was in before it joined one


def joined() -> bool:
    """Whether this process moved into a cluster's cgroup (and has not left it)."""
    return bool(_LEFT)


def mount_point() -> str | None:
    """Where cgroup v2 is mounted here (/sys/fs/cgroup, or /sys/fs/cgroup/unified on a
    hybrid host), from /proc/self/mountinfo; None without one."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                fields = line.split()
                if b"-" in fields:
                    dash = fields.index(b"-")
                    if fields[dash + 1:dash + 2] == [b"cgroup2"] and fields[3] == b"/":
                        return fields[4].decode().replace("\\040", " ")
    except (OSError, ValueError, IndexError):
        pass
    return None


def path_of(cluster_dir: str, mount: str | None = None) -> str | None:
    """The cluster's cgroup on this host: `<cgroup2 mount>/tfcluster/<instance>`."""
    mount = mount or mount_point()
    return os.path.join(mount, PARENT, procs.instance_id(cluster_dir)) if mount else None


def nft_name(path: str, mount: str) -> tuple[str, int] | None:
    """(the path nft resolves, under /sys/fs/cgroup; the cgroup's level below the cgroup2
    root), or None where nft cannot name it (a cgroup2 mounted elsewhere)."""
    rel = os.path.relpath(path, NFT_ROOT)
    if rel.startswith(".."):
        return None
    return rel, len(os.path.relpath(path, mount).split(os.sep))


def make(cluster_dir: str) -> tuple[tuple | None, str | None]:
    """((nft's path, level), None) with the cluster's cgroup made, or (None, why not)."""
    mount = mount_point()
    if mount is None:
        return None, "no cgroup v2 is mounted"
    path = path_of(cluster_dir, mount)
    name = nft_name(path, mount)
    if name is None:
        return None, "cgroup v2 is mounted at %s, where nft does not look for cgroups" % mount
    for _ in range(3):          # another cluster's shim may remove the empty parent between
        try:
            os.mkdir(os.path.dirname(path), 0o755)
        except FileExistsError:
            pass
        except OSError as e:
            return None, "cannot make a cgroup in %s: %s" % (mount, e.strerror or e)
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass
        except FileNotFoundError:
            continue
        except OSError as e:
            return None, "cannot make a cgroup in %s: %s" % (mount, e.strerror or e)
        return name, None
    return None, "cannot make a cgroup in %s" % mount


def _move(pid: int, path: str) -> bool:
    try:
        fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY)
        try:
            os.write(fd, b"%d" % pid)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False


def _own_cgroup(mount: str) -> str | None:
    """This process's cgroup v2 directory, from /proc/self/cgroup's `0::` line."""
    try:
        with open("/proc/self/cgroup", "rb") as f:
            for line in f:
                if line.startswith(b"0::"):
                    return os.path.join(mount, line[3:].strip().decode().lstrip("/"))
    except (OSError, ValueError):
        pass
    return None


def join(cluster_dir: str) -> bool:
    """Put this shim into the cluster's cgroup, where the fence made one: what it spawns from
    now on, and the connections it opens, are the cluster's own. Only a shim that is a process
    of its own (OWN_PROCESS) ever moves; True when it is in the cluster's cgroup."""
    if not OWN_PROCESS or not cluster_dir:
        return False
    mount = mount_point()
    path = path_of(cluster_dir, mount) if mount else None
    if path is None or not os.path.isdir(path):
        return False
    here = _own_cgroup(mount)
    if here == path:
        return True
    if not _move(0, path):
        return False
    if here and not _LEFT:
        _LEFT.append(here)
    return True


def leave() -> None:
    """Back to the cgroup this shim was in before join() (its cluster's can then go)."""
    while _LEFT:
        back = _LEFT.pop()
        mount = mount_point()
        if not _move(0, back) and mount:
            _move(0, mount)


def populated(path: str) -> bool:
    """Whether a cgroup holds a process (itself or below); False where it is gone."""
    try:
        with open(os.path.join(path, "cgroup.events"), "rb") as f:
            return any(line.split() == [b"populated", b"1"] for line in f)
    except OSError:
        return False


def drop(cluster_dir: str, instance: str | None = None) -> None:
    """Remove the cluster's cgroup once it holds no process (this shim leaves it first), and
    the shared parent once no cluster has one. Quiet: a busy cgroup stays."""
    mount = mount_point()
    if mount is None:
        return
    path = (os.path.join(mount, PARENT, instance) if instance
            else path_of(cluster_dir, mount))
    if not os.path.isdir(path):
        return
    if _own_cgroup(mount) == path:
        leave()
    deadline = time.monotonic() + 1.0
    while True:        # a task just killed leaves its cgroup as the kernel reaps it
        try:
            os.rmdir(path)
            break
        except FileNotFoundError:
            break
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                return
            time.sleep(0.01)
    try:
        os.rmdir(os.path.dirname(path))
    except OSError:
        pass        # another cluster's cgroup is there


def sweep_empty(kept: set, grace: float) -> None:
    """Remove the empty cgroups of clusters that have no table here (its table was deleted
    by hand, or their last shim was killed), once older than `grace` (an install makes
    the cgroup just before its table)."""
    mount = mount_point()
    parent = os.path.join(mount, PARENT) if mount else None
    if parent is None or not os.path.isdir(parent):
        return
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if (name in kept or not re.fullmatch(r"[0-9a-f]{12}", name) or not os.path.isdir(path)
                or populated(path) or time.time() - os.stat(path).st_mtime < grace):
            continue
        drop("", name)
