"""Deflated logs (docs/design/logs.md, "Deflated logs"): over SSH an attached shim
deflates its task's log and the launcher inflates it. Every byte must arrive exactly, in
order, whatever the data, across restarts in place, and after a login shell's words on
stdout; the channel must carry fewer bytes than the task wrote. Real shims: the local
transport told to deflate, and the test sshd."""
from __future__ import annotations

import sys
import textwrap

import pytest

from tests.helpers import CLUSTER_DIR, C, launch, noisy_python, read_all
from tests.sshd import make_target
from tfcluster.launch.agent.agent import HostAgent
from tfcluster.launch.agent.records import TaskLaunch
from tfcluster.plan.names import ClusterPaths
from tfcluster.transport.local import LocalTransport
from tfcluster.transport.ssh import SshTransport

pytestmark = pytest.mark.timeout(60)

# 4 MB: log lines (compressible), random bytes in hex (barely), and a long line without a
# newline that ends the output; seeded, so the expected bytes are computed here too.
WRITER = textwrap.dedent("""
    import random, sys
    r = random.Random(7)
    out = sys.stdout.buffer
    for i in range(40000):
        out.write(b"step %d loss %.6f\\n" % (i, r.random()))
        if i % 1000 == 0:
            out.write(r.randbytes(30000).hex().encode() + b"\\n")
    out.write(b"z" * 100000)
""")


def expected_output() -> bytes:
    import random
    r = random.Random(7)
    parts = []
    for i in range(40000):
        parts.append(b"step %d loss %.6f\n" % (i, r.random()))
        if i % 1000 == 0:
            parts.append(r.randbytes(30000).hex().encode() + b"\n")
    parts.append(b"z" * 100000)
    return b"".join(parts)


class Counting:
    """The shim's process, with the bytes its stdout carried counted (nothing changed)."""

    def __init__(self, proc) -> None:
        self._proc, self.raw = proc, 0

    def read(self, *a):
        chunk = self._proc.read(*a)
        self.raw += len(chunk)
        return chunk

    def __getattr__(self, name):
        return getattr(self._proc, name)


def counted(task) -> Counting:
    task._proc = Counting(task._proc)   # noqa: SLF001 - only counts what passes
    return task._proc                   # noqa: SLF001


def test_a_deflated_log_arrives_byte_for_byte_and_the_channel_carries_less(deflating):
    task = deflating.start_attached(launch(deflating, f"{C}:z1:worker:0", [sys.executable, "-c", WRITER]))
    channel = counted(task)

    out = read_all(task)

    assert out == expected_output()
    assert task.wait(10) == 0
    assert 0 < channel.raw < len(out) / 2, (channel.raw, len(out))


def test_without_deflate_the_channel_carries_the_log_as_it_is(home):
    a = HostAgent("local", LocalTransport(), sys.executable, CLUSTER_DIR)
    try:
        a.prepare()
        task = a.start_attached(launch(a, f"{C}:z2:worker:0", [sys.executable, "-c", WRITER]))
        channel = counted(task)
        assert read_all(task) == expected_output()
        assert channel.raw == len(expected_output())
    finally:
        a.close()


def test_a_login_shell_talking_on_stdout_does_not_corrupt_a_deflated_stream(home, tmp_path):
    transport = LocalTransport()
    transport.deflate_logs = True
    a = HostAgent("local", transport, str(noisy_python(tmp_path)), CLUSTER_DIR)
    try:
        a.prepare()
        task = a.start_attached(launch(a, f"{C}:z4:worker:0", [sys.executable, "-c", "print('ok')"]))
        assert read_all(task) == b"ok\n"
        assert task.wait(10) == 0
    finally:
        a.close()


@pytest.mark.ssh
def test_over_ssh_the_shim_deflates_and_every_byte_arrives(ssh_home, sshd, tmp_path):
    transport = SshTransport(*make_target("h2", "127.0.0.2", sshd))
    paths = ClusterPaths(str(tmp_path / "remote" / "z"))      # the test sshd's HOME is /root
    a = HostAgent("h2", transport, sys.executable, paths)
    tag = f"{C}:z5:worker:0"
    log = f"{paths.root}/logs/z5.log"
    try:
        a.prepare()
        task = a.start_attached(TaskLaunch(tag=tag, argv=(sys.executable, "-c", WRITER), env={},
                                           cwd=str(tmp_path), log=log, pidfile=paths.pidfile(tag)))
        channel = counted(task)
        out = read_all(task)
        assert out == expected_output()
        assert 0 < channel.raw < len(out) / 2, (channel.raw, len(out))
        assert task.wait(10) == 0
        with open(log, "rb") as f:
            assert f.read() == out          # the host's file stays the raw bytes
    finally:
        a.close()
        transport.close()
