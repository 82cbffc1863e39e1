"""A real second Unix user for the shared-host tests.

The fixture creates `tfcother` (useradd, no password, own home) the first time the suite
needs it and leaves it for later runs; it skips with a reason when the tests do not run
as root (only root can create a user). `as_user` runs a command as that user, with its
own HOME and this session's marker, so the leak check still sees its processes.
"""
from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

OTHER = "tfcother"


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str

    def env(self, **extra: str) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TFCLUSTER_TEST_SESSION")}
        return {**keep, "HOME": self.home, "USER": self.name, "LOGNAME": self.name, **extra}

    def run(self, argv, *, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """argv as this user (setuid in the child, no shell, no PAM)."""
        kw.setdefault("env", self.env())
        kw.setdefault("cwd", self.home)
        return subprocess.run(argv, user=self.uid, group=self.gid, extra_groups=[], timeout=timeout,
                              capture_output=True, text=True, **kw)

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
        return subprocess.Popen(argv, user=self.uid, group=self.gid, extra_groups=[], **kw)


def _ensure(name: str) -> User:
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


@pytest.fixture(scope="session")
def other_user() -> User:
    if os.geteuid() != 0:
        pytest.skip("creating a second Unix user needs root (CI runs as root)")
    return _ensure(OTHER)
