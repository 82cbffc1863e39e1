"""A real second Unix user for the shared-host tests.

The fixture creates `tfcother` (useradd, no password, own home) the first time the suite
needs it and leaves it for later runs; it skips with a reason when the tests do not run
as root (only root can create a user). `as_user` runs a command as that user, with its
own HOME and this session's marker, so the leak check still sees its processes.

Some tests run tfcluster and TensorFlow as that user, from this checkout and this virtual
environment (`other_python`). A checkout is often private: under /root, in `mktemp -d`, in a
0750 home. Nothing here changes a permission: when a directory on the way to the checkout,
the venv's site-packages or the interpreter is closed to the user, each of its commands runs
in its own mount namespace (made by root, then the user is switched to) where that closed
directory is covered by an empty tmpfs holding only what the tests need, bind-mounted
read-only at the same paths. The user sees nothing it could not see before but those paths;
the namespace goes with the command's last process, so there is no mount to undo, ever.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

OTHER = "tfcother"
SYSTEM_PYTHON = "/usr/bin/python3"
CHECKOUT = str(Path(__file__).resolve().parents[1])

# Run by root's Python (-I -S: nothing imported from anywhere but the standard library):
# argv = plan (JSON), uid, gid, the command. A new mount namespace whose mounts do not
# propagate back; the plan's bind sources opened before the tmpfs hides them; then the user.
_ENTER = r"""
import ctypes, json, os, sys
plan, uid, gid, argv = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
libc = ctypes.CDLL(None, use_errno=True)
libc.unshare.argtypes = [ctypes.c_int]
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
RDONLY, NOSUID, NODEV, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
def call(what, result):
    if result != 0:
        sys.exit("tests/users.py: cannot %s as root: %s" % (what, os.strerror(ctypes.get_errno())))
def mount(src, target, fstype, flags, data=None):
    call("mount %s on %s" % (fstype or src, target),
         libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(), flags, data))
call("unshare a mount namespace", libc.unshare(0x00020000))
mount(None, "/", None, REC | PRIVATE)
sources = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in plan["bind"]]
for path in plan["tmpfs"]:
    mount("tmpfs", path, "tmpfs", NOSUID | NODEV, b"mode=755,size=64k")
for path, fd in sources:
    os.makedirs(path, exist_ok=True)
    mount("/proc/self/fd/%d" % fd, path, None, BIND | REC)
    mount(None, path, None, REMOUNT | BIND | RDONLY)
    os.close(fd)
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
os.execvp(argv[0], argv)
"""


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    # {"tmpfs": [...], "bind": [...]}: what each command of this user runs behind (see above); None: nothing
    exposed: dict | None = None

    def env(self, **extra: str) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TFCLUSTER_TEST_SESSION")}
        return {**keep, "HOME": self.home, "USER": self.name, "LOGNAME": self.name, **extra}

    def _as_user(self, argv, kw: dict):
        """(argv, kw) for subprocess: the kernel switches the user in the child (setuid, no
        shell, no PAM), or, with paths to expose, root's helper does after its mounts."""
        if not self.exposed:
            return list(argv), {**kw, "user": self.uid, "group": self.gid, "extra_groups": []}
        return [sys.executable, "-I", "-S", "-c", _ENTER, json.dumps(self.exposed), str(self.uid), str(self.gid),
                *argv], kw

    def run(self, argv, *, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """argv as this user."""
        kw.setdefault("env", self.env())
        kw.setdefault("cwd", self.home)
        argv, kw = self._as_user(argv, kw)
        return subprocess.run(argv, timeout=timeout, capture_output=True, text=True, **kw)

    @contextlib.contextmanager
    def directory(self, prefix: str, mode: str):
        """/tmp/<prefix>-XXXX made by this user with `mode`; removed afterwards, first as this
        user, then whatever it could not remove."""
        path = Path("/tmp") / f"{prefix}-{uuid.uuid4().hex[:8]}"
        made = self.run(["mkdir", "-m", mode, str(path)])
        assert made.returncode == 0, made.stderr
        try:
            yield path
        finally:
            self.run(["rm", "-rf", str(path)])
            shutil.rmtree(path, ignore_errors=True)

    def popen(self, argv, **kw) -> subprocess.Popen:
        kw.setdefault("env", self.env())
        kw.setdefault("cwd", self.home)
        argv, kw = self._as_user(argv, kw)
        return subprocess.Popen(argv, **kw)


@dataclass(frozen=True)
class OtherPython:
    """The other user (`user`, through the mounts it needs), an interpreter it can run, and
    this checkout's and this venv's packages for its PYTHONPATH."""
    user: User
    python: str
    checkout: str
    site: str

    @property
    def pythonpath(self) -> str:
        return f"{self.checkout}{os.pathsep}{self.site}"


def _ensure(name: str) -> User:
    # one session at a time (pytest-xdist workers each ask): useradd refuses a name being made
    with open(os.path.join(tempfile.gettempdir(), f"tfcluster-test-{name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", name], check=True,
                           capture_output=True, timeout=30)
            entry = pwd.getpwnam(name)
        # Unlock the account (no password works: "*"), so sshd lets it log in with a key.
        subprocess.run(["usermod", "-p", "*", name], check=True, capture_output=True, timeout=30)
    os.makedirs(entry.pw_dir, mode=0o700, exist_ok=True)
    os.chown(entry.pw_dir, entry.pw_uid, entry.pw_gid)
    return User(name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def _site() -> str:
    return sysconfig.get_path("purelib")


def _python() -> tuple[str, list[str]]:
    """The interpreter the other user runs, and what must be exposed for it: the system's
    Python when it is this venv's minor version (the same ABI: the venv's packages load),
    else this venv's own base interpreter, with its prefix."""
    want = "%d.%d" % sys.version_info[:2]
    if os.access(SYSTEM_PYTHON, os.X_OK):
        got = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        if got == want:
            return SYSTEM_PYTHON, []
    base = os.path.realpath(sys.base_prefix)
    return os.path.join(base, "bin", f"python{want}"), [base]


def _closed(path: str, user: User) -> bool:
    """Whether `user` cannot search the directory `path` (owner, group, other bits)."""
    st = os.stat(path)
    if st.st_uid == user.uid:
        return not st.st_mode & stat.S_IXUSR
    if st.st_gid == user.gid:
        return not st.st_mode & stat.S_IXGRP
    return not st.st_mode & stat.S_IXOTH


def _inside(path: str, top: str) -> bool:
    return path.startswith(top.rstrip("/") + "/")


def exposure(paths: list[str], user: User) -> dict | None:
    """The mounts that let `user` reach `paths`: a tmpfs over the highest directory closed to
    it on the way to each, and each path bound back at its place. None: all are reachable.
    A path inside another is exposed with it."""
    paths = sorted({os.path.realpath(p) for p in paths})
    tops = [p for p in paths if not any(_inside(p, q) for q in paths)]
    tmpfs, bind = set(), []
    for path in tops:
        above = [str(a) for a in reversed(Path(path).parents)]
        closed = next((a for a in above if _closed(a, user)), None)
        if closed:
            tmpfs.add(closed)
            bind.append(path)
    if not bind:
        return None
    return {"tmpfs": sorted(a for a in tmpfs if not any(_inside(a, b) for b in tmpfs)), "bind": bind}


@pytest.fixture(scope="session")
def other_user() -> User:
    if os.geteuid() != 0:
        pytest.skip("creating a second Unix user needs root (CI runs as root)")
    return _ensure(OTHER)


_PROBE = ("import importlib.util, sys\n"
          "for name in sys.argv[1:]:\n"
          "    spec = importlib.util.find_spec(name)\n"
          "    print(name, spec and spec.origin)\n")


@pytest.fixture(scope="session")
def other_python(other_user) -> OtherPython:
    """The other user, able to run this checkout's tfcluster and this venv's TensorFlow with
    `.python` and PYTHONPATH=`.pythonpath`: checked once, as that user, that both are found
    there. Fails under CI=true when they cannot be, skips elsewhere, with the reason."""
    python, prefixes = _python()
    checkout, site = CHECKOUT, os.path.realpath(_site())
    exposed = exposure([checkout, site, *prefixes], other_user)
    user = User(other_user.name, other_user.uid, other_user.gid, other_user.home, exposed)
    found = OtherPython(user, python, checkout, site)
    probe = user.run([python, "-c", _PROBE, "tfcluster", "tensorflow"], timeout=60,
                     env=user.env(PYTHONPATH=found.pythonpath))
    origins = dict(line.split(" ", 1) for line in probe.stdout.splitlines() if " " in line)
    if (probe.returncode == 0 and origins.get("tfcluster") == os.path.join(checkout, "tfcluster", "__init__.py")
            and origins.get("tensorflow") == os.path.join(site, "tensorflow", "__init__.py")):
        return found
    why = (f"{user.name} cannot reach this checkout's tfcluster and this venv's TensorFlow with {python} "
           f"and PYTHONPATH={found.pythonpath}"
           + (f", in a mount namespace exposing {', '.join(exposed['bind'])}" if exposed else "")
           + f": exit {probe.returncode}, found {origins or 'nothing'}; {probe.stderr.strip()[-1000:]}")
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why)
    pytest.skip(why)
