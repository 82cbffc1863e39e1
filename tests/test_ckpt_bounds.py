"""Checkpoint sync with inputs it does not trust (launch/run/ckptsync.py, host/shim_ckpt.py, the
transports' put): a checkpoint directory another user owns or can write is refused on both
transports, for the pull and for the push, and nothing is written into it; a checkpoint over
train.checkpoint.max_bytes, or over what this machine's disk has free, is named and not copied; a
sparse shard keeps its holes both ways; a sparse state file is read 1 MiB at most; every copy is
streamed. Real sshd on loopback, a real second user (tests/users.py), real sparse files
(os.truncate), a real tmpfs for a small disk; no TensorFlow (the files are named as TF names them,
which is all a sync reads)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from tests.helpers import ssh_spec
from tfcluster.errors import SpecError
from tfcluster.host import shim_ckpt, shim_protocol as proto
from tfcluster.launch.cluster.session import Session
from tfcluster.launch.run.ckptsync import CheckpointSync
from tfcluster.plan import build_plan
from tfcluster.spec.loader import load_spec
from tfcluster.transport.ssh_connect import WINDOW_SIZE
from tfcluster.ui import UI
from tfcluster.ui.units import size

pytestmark = [pytest.mark.timeout(120)]

MIB = 1 << 20
SHIM = Path(shim_ckpt.__file__).with_name("shim.py")
MARK = b"not a hole"
TIME = "/usr/bin/time"


def fake_checkpoint(d: Path, name: str = "big-7", shard: int = 64 * MIB, mark_at: int | None = None,
                    mode: int = 0o700) -> Path:
    """`name`'s index and one shard of `shard` bytes, sparse (no block but MARK at `mark_at`)."""
    d.mkdir(mode=mode, parents=True, exist_ok=True)
    d.chmod(mode)
    (d / f"{name}.index").write_bytes(b"an index\n" * 100)
    path = d / f"{name}.data-00000-of-00001"
    with open(path, "wb") as f:
        f.truncate(shard)
        if mark_at is not None:
            f.seek(mark_at)
            f.write(MARK)
    return path


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


class Harness:
    def __init__(self, spec: Path, run_dir: Path) -> None:
        self.err = io.StringIO()
        self.session = Session(build_plan(load_spec(str(spec))), UI(io.StringIO(), self.err, color=False))
        self.sync = CheckpointSync(self.session, self.session.plan, str(run_dir), self.session.ui)

    def warnings(self) -> list[str]:
        return [line for line in self.err.getvalue().splitlines() if line.strip()]


@pytest.fixture
def harness(tmp_path, home):
    """build(ckpt_dir, transport="ssh"|"local", extra=", max_bytes: 32MiB", run_dir=...): a
    CheckpointSync of a spec whose checkpoint dir is `ckpt_dir`; its host is h2 (SSH) or local."""
    made: list[Harness] = []

    def build(ckpt_dir: Path | str, transport: str = "ssh", extra: str = "", run_dir: Path | None = None,
              sshd=None) -> Harness:
        train = f"train:\n  checkpoint: {{dir: '{ckpt_dir}', sync: off{extra}}}\n"
        if transport == "ssh":
            spec = ssh_spec(tmp_path, sshd, train=train)
        else:
            spec = tmp_path / "loc.yaml"
            spec.write_text(f"name: loc\nworkdir: {tmp_path / 'remote'}\nhosts:\n  - {{name: local, address: 127.0.0.1}}\n"
                            "jobs:\n  ps: {tasks: ['local:2222']}\n  worker: {tasks: ['local:2223']}\n" + train)
        made.append(Harness(spec, run_dir or tmp_path / "runs" / "a-run"))
        return made[-1]

    yield build
    for h in made:
        h.sync.stop()
        h.session.close()


@pytest.fixture
def over_ssh(harness, sshd, ssh_home):
    return lambda *a, **kw: harness(*a, transport="ssh", sshd=sshd, **kw)


def traced(fn):
    """fn() and the peak of Python memory while it ran (bytes)."""
    tracemalloc.start()
    try:
        return fn(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ------------------------------------------------------------------ sparse files, streaming

def test_a_sparse_shard_is_pulled_and_pushed_with_its_holes_and_memory_stays_bounded(over_ssh, tmp_path):
    shard = fake_checkpoint(tmp_path / "ckpt", shard=128 * MIB, mark_at=77 * MIB)
    assert allocated(shard) < MIB
    h = over_ssh(tmp_path / "ckpt")
    pulled, peak = traced(lambda: h.sync.pull("h2"))
    assert pulled is not None and pulled.name == "big-7" and h.warnings() == []
    copy = Path(pulled.path) / shard.name
    assert copy.stat().st_size == 128 * MIB
    assert allocated(copy) < 2 * MIB, allocated(copy)          # before: 128 MiB of real blocks
    with open(copy, "rb") as f:
        f.seek(77 * MIB)
        assert f.read(len(MARK)) == MARK
    # While this side lags, what the sender may have in flight (the SSH window) sits in
    # paramiko's buffer, a bytearray that holds old and new at once as it grows; plus a read.
    # Measured: 12.8 MiB on an idle machine, 20.1 MiB in a loaded CI run, 24.0 MiB beside six
    # busy loops. A shard read whole would be 128 MiB.
    assert peak < 2 * WINDOW_SIZE + 4 * MIB, peak
    # the push keeps the holes too, and reads no file whole
    fresh = tmp_path / "fresh"
    h.sync.config = type(h.sync.config)(**{**h.sync.config.__dict__, "dir": str(fresh)})
    began = time.monotonic()
    pushed, peak = traced(lambda: h.sync.push("h2"))
    assert pushed == "big-7" and h.warnings() == []
    assert time.monotonic() - began < 10                       # the holes do not cross the network
    there = fresh / shard.name
    assert there.stat().st_size == 128 * MIB and allocated(there) < 2 * MIB
    with open(there, "rb") as f:
        f.seek(77 * MIB)
        assert f.read(len(MARK)) == MARK
    assert (fresh / "checkpoint").read_text() == 'model_checkpoint_path: "big-7"\nall_model_checkpoint_paths: "big-7"\n'
    assert peak < 16 * MIB, peak


@pytest.mark.parametrize("transport", [pytest.param("ssh", marks=pytest.mark.ssh), "local"])
def test_a_push_streams_real_data_whole(request, harness, tmp_path, transport):
    if transport == "ssh":
        request.getfixturevalue("ssh_home")
    src = tmp_path / "src"
    fake_checkpoint(src, name="ckpt-3", shard=0)
    block = os.urandom(MIB)
    with open(src / "ckpt-3.data-00000-of-00001", "wb") as f:
        for _ in range(48):
            f.write(block)
    h = harness(src, transport=transport, sshd=request.getfixturevalue("sshd") if transport == "ssh" else None)
    host = "h2" if transport == "ssh" else "local"
    assert h.sync.pull(host).name == "ckpt-3"
    dest = tmp_path / "dest"
    h.sync.config = type(h.sync.config)(**{**h.sync.config.__dict__, "dir": str(dest)})
    pushed, peak = traced(lambda: h.sync.push(host))
    assert pushed == "ckpt-3" and h.warnings() == []
    assert (dest / "ckpt-3.data-00000-of-00001").read_bytes() == (src / "ckpt-3.data-00000-of-00001").read_bytes()
    assert peak < 16 * MIB, peak                               # before: the 48 MiB file read whole
    assert {p.name for p in dest.iterdir()} == {"ckpt-3.index", "ckpt-3.data-00000-of-00001", "checkpoint"}
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in dest.iterdir())


# ------------------------------------------------------------------ bounds

def test_a_checkpoint_over_max_bytes_is_named_and_not_copied(over_ssh, tmp_path):
    fake_checkpoint(tmp_path / "ckpt", shard=64 * MIB)
    h = over_ssh(tmp_path / "ckpt", extra=", max_bytes: 32MiB")
    began = time.monotonic()
    assert h.sync.pull("h2") is None
    assert time.monotonic() - began < 10
    total = 64 * MIB + len(b"an index\n" * 100)
    [warning] = h.warnings()
    assert warning == (f"tfcluster: warning: checkpoint sync: pull of {tmp_path / 'ckpt'} failed: host h2: "
                       f"checkpoint big-7 is {size(total)}, over the {size(32 * MIB)} of "
                       "train.checkpoint.max_bytes: not copied; no copy is kept here yet")
    assert h.sync.kept() == [] and not [p for p in (tmp_path / "runs" / "a-run" / "checkpoints").iterdir()]
    assert h.sync.pull("h2") is None and len(h.warnings()) == 2       # an explicit pull says it again


def test_a_checkpoint_over_the_free_disk_here_is_named_and_not_copied(harness, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=700", "tmpfs", str(small)], check=True)
    try:
        fake_checkpoint(tmp_path / "ckpt", shard=16 * MIB)         # sparse there: 16 MiB here unless holes
        h = harness(tmp_path / "ckpt", transport="local", run_dir=small / "a-run")
        assert h.sync.pull("local") is None
        [warning] = h.warnings()
        free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
        assert f": checkpoint big-7 is {size(16 * MIB + 900)}, over the {size(free)} free on this " \
               f"machine's disk ({small / 'a-run' / 'checkpoints'}): not copied;" in warning, warning
        assert os.listdir(small / "a-run" / "checkpoints") == []
    finally:
        subprocess.run(["umount", str(small)], check=True)


@pytest.mark.skipif(not os.path.exists(TIME), reason="GNU time(1) measures the shim's own peak RSS")
def test_a_sparse_state_file_is_read_a_mib_at_most(tmp_path):
    d = tmp_path / "ckpt"
    fake_checkpoint(d, shard=MIB)
    with open(d / "checkpoint", "wb") as f:
        f.write(b'model_checkpoint_path: "big-7"\n')
        f.truncate(1 << 30)                                      # 1 GiB, no block
    # time(1) forks the shim from its own small process, so %M is the shim's peak RSS alone (a
    # child forked from this test's process would start its count at this process's size)
    r = subprocess.run([TIME, "-f", "MAXRSS %M", sys.executable, "-S", str(SHIM), proto.CKPT],
                       input=proto.json_line({"dir": str(d)}), capture_output=True, cwd=tmp_path, timeout=60)
    answer = json.loads(r.stdout.decode().splitlines()[-1])
    assert r.returncode == proto.EXIT_ERROR, r.stderr
    assert answer == {"error": f"the state file {d / 'checkpoint'} is over 1024 KiB, which no TensorFlow "
                               f"state file is: not read"}
    peak = int(r.stderr.decode().rsplit("MAXRSS ", 1)[1].split()[0])
    assert peak < 64 * 1024, peak                                  # KiB; before: 1,065,536


# ------------------------------------------------------------------ another user's directory

@pytest.mark.parametrize("transport", [pytest.param("ssh", marks=pytest.mark.ssh), "local"])
def test_a_push_into_a_directory_another_user_owns_is_refused_and_writes_nothing(
        request, harness, tmp_path, other_user, transport):
    src = tmp_path / "src"
    fake_checkpoint(src, name="model.ckpt-44", shard=MIB, mark_at=0)
    sshd = request.getfixturevalue("sshd") if transport == "ssh" else None
    if sshd is not None:
        request.getfixturevalue("ssh_home")
    h = harness(src, transport=transport, sshd=sshd)
    host = "h2" if transport == "ssh" else "local"
    assert h.sync.pull(host).name == "model.ckpt-44"
    with other_user.directory("theirs", "0755") as theirs:
        h.sync.config = type(h.sync.config)(**{**h.sync.config.__dict__, "dir": str(theirs)})
        assert h.sync.push(host) is None
        assert os.listdir(theirs) == []                          # not a byte, not a temporary file
    [warning] = h.warnings()
    assert warning.startswith(f"tfcluster: warning: checkpoint sync: push of model.ckpt-44 to {theirs} failed: "
                              f"host {host}")
    owner = f"{other_user.name} (uid {other_user.uid})" if transport == "local" else f"uid {other_user.uid}"
    assert f"{theirs} is owned by {owner}, not by you: refusing to " in warning, warning


@pytest.mark.parametrize("transport", [pytest.param("ssh", marks=pytest.mark.ssh), "local"])
def test_a_pull_from_a_directory_another_user_owns_or_others_can_write_is_refused(
        request, harness, tmp_path, other_user, transport):
    sshd = request.getfixturevalue("sshd") if transport == "ssh" else None
    if sshd is not None:
        request.getfixturevalue("ssh_home")
    host = "h2" if transport == "ssh" else "local"
    with other_user.directory("theirs", "0755") as theirs:
        fake_checkpoint(theirs, shard=MIB, mode=0o755)
        h = harness(theirs, transport=transport, sshd=sshd)
        assert h.sync.pull(host) is None and h.sync.kept() == []
    ours = tmp_path / "open"
    fake_checkpoint(ours, shard=MIB, mode=0o775)                   # a umask-002 directory: group-writable
    h2 = harness(ours, transport=transport, sshd=sshd)
    assert h2.sync.pull(host) is None and h2.sync.kept() == []
    [theirs_said] = h.warnings()
    [open_said] = h2.warnings()
    assert f"{theirs} is owned by {other_user.name} (uid {other_user.uid}), not by you: refusing to use it" \
        in theirs_said, theirs_said
    assert f"{ours} is writable by others (mode 0775): refusing to use it (chmod go-w {ours}" in open_said, open_said


def test_a_push_into_a_group_writable_directory_over_ssh_is_refused(over_ssh, tmp_path):
    src = tmp_path / "src"
    fake_checkpoint(src, shard=MIB)
    h = over_ssh(src)
    assert h.sync.pull("h2").name == "big-7"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    h.sync.config = type(h.sync.config)(**{**h.sync.config.__dict__, "dir": str(shared / "ckpt")})
    assert h.sync.push("h2") is None
    assert os.listdir(shared) == []
    [warning] = h.warnings()
    assert f"{shared} is writable by others (mode 0775): refusing to write into it (chmod go-w {shared}" \
        in warning, warning


# ------------------------------------------------------------------ the field

@pytest.mark.parametrize("value, expected", [
    ("500MB", 500_000_000), ("1.5GiB", 3 << 29), ("17179869184", 16 << 30), (None, 16 << 30),
    ("12", "must be from 1 MiB to 1 PiB, got 12"), ("2PiB", "must be a size in bytes"),
    ("10x", "must be a size in bytes (17179869184, 16GiB, 500MB), got '10x'"), ("[1]", "got a list"),
    ("1.5", "must be a size in bytes"),
])
def test_max_bytes_is_a_size_with_a_default_and_a_bad_one_is_one_line(tmp_path, value, expected):
    field = "" if value is None else f", max_bytes: {value}"
    spec = tmp_path / "m.yaml"
    spec.write_text("name: m\nhosts:\n  - {name: local, address: 127.0.0.1}\njobs:\n"
                    "  worker: {tasks: ['local:2223']}\ntrain:\n  mode: mirrored\n"
                    f"  checkpoint: {{dir: /c{field}}}\n")
    if isinstance(expected, int):
        assert build_plan(load_spec(str(spec))).checkpoint.max_bytes == expected
        return
    with pytest.raises(SpecError) as info:
        load_spec(str(spec))
    assert str(info.value).startswith(f"{spec}:8: train.checkpoint.max_bytes: ")
    assert expected in str(info.value) and "\n" not in str(info.value)
