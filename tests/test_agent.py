"""HostAgent + shim through the local transport: real processes, real signals."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import (
    CLUSTER_DIR,
    LISTENER,
    PATHS,
    STUBBORN,
    C,
    free_port,
    gone,
    launch,
    q,
    read_all,
    wait_for,
    with_tag,
)
from tfcluster.errors import HostError
from tfcluster.host import shim_facts
from tfcluster.launch.agent.agent import HostAgent, TaskLaunch
from tfcluster.transport.local import LocalTransport

REPO = Path(__file__).resolve().parent.parent


LAUNCHER = textwrap.dedent("""
    import sys, time
    from tfcluster.launch.agent.agent import HostAgent, TaskLaunch
    from tfcluster.plan.names import ClusterPaths
    from tfcluster.transport.local import LocalTransport
    agent = HostAgent("local", LocalTransport(), sys.executable, "~/.tfcluster/lab")
    tag = sys.argv[1]
    task = agent.start_attached(
        TaskLaunch(tag, (sys.executable, "-c", "import time; time.sleep(600)"), {}, "~",
                   "~/.tfcluster/lab/launcher.log", ClusterPaths("~/.tfcluster/lab").pidfile(tag)),
        heartbeat_timeout=3, grace=1)
    print(task.pid, flush=True)
    time.sleep(600)
""")


def start_detached(agent: HostAgent, t: TaskLaunch, port: int = 0, timeout: float = 0.2) -> int:
    """Start one detached task through `launch` (start + readiness in one round trip)."""
    events = list(agent.launch([("k", port, t)], timeout))
    return next(pid for _key, state, pid in events if state == "started")


@pytest.mark.tf
@pytest.mark.timeout(120)
def test_tfservers_start_become_ready_and_stop_leaving_ports_free(home, capsys):
    ports = {"ps": free_port(), "worker": free_port()}
    cluster = {job: [f"localhost:{port}"] for job, port in ports.items()}
    t0 = time.monotonic()
    agent = HostAgent("local", LocalTransport(), sys.executable, CLUSTER_DIR)
    try:
        agent.prepare()
        launches = []
        for job in ports:
            tf_config = json.dumps({"cluster": cluster, "task": {"type": job, "index": 0}})
            launches.append((job, ports[job], launch(agent, f"{C}:r1:{job}:0", agent.server_argv(),
                                                     {"TF_CONFIG": tf_config, "TF_CPP_MIN_LOG_LEVEL": "2"})))
        events = list(agent.launch(launches, 60))
        pids = {key: pid for key, state, pid in events if state == "started"}
        outcomes = {key: state for key, state, _ in events if state != "started"}
        waited = agent.wait_ready([(job, ports[job], pids[job]) for job in ports], 60)
        assert {key: state for key, state, _holder in waited} == outcomes
        with capsys.disabled():
            print(f"\n[prepare + start + ready of 2 tfservers: {time.monotonic() - t0:.1f}s]")
        assert outcomes == {"ps": "ready", "worker": "ready"}
        assert {(s.tag, s.pid, s.alive) for s in agent.status(f"{C}:")} == {
            (q(f"{C}:r1:ps:0"), pids["ps"], True), (q(f"{C}:r1:worker:0"), pids["worker"], True)}
        assert "tfcluster: server ps:0 listening on localhost:" in agent.tail(
            f"{CLUSTER_DIR}/logs/{C}_r1_ps_0.log", 50)

        report = agent.stop(f"{C}:", grace=5)

        assert sorted(report.stopped) == sorted((q(f"{C}:r1:{j}:0"), p) for j, p in pids.items())
        assert report.survivors == ()
        assert with_tag(f"{C}:") == {}
        assert agent.status(f"{C}:") == []
        # A KILLed multi-threaded server shows as a zombie a moment before its last thread
        # releases the socket: the port must come free within a short bound, as `down` allows.
        wait_for(lambda: agent.check_ports(list(ports.values())) == {p: None for p in ports.values()},
                 timeout=5, what="ports free again")
    finally:
        agent.stop(f"{C}:", grace=1)
        agent.close()


# listens on argv[1] once a line comes on stdin (a held server's GO), says so, and stays
BIND_AT_GO = ("import socket, sys\nsys.stdin.readline()\ns = socket.socket()\n"
              "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
              "s.bind(('127.0.0.1', int(sys.argv[1])))\ns.listen()\nprint('up', flush=True)\nsys.stdin.readline()\n")


@pytest.mark.timeout(60)
def test_readiness_asked_while_the_old_server_still_listens_is_ready_once_the_new_one_binds(agent):
    """A move asks whether each held server listens before its GO, while the server it
    replaces still holds the port: within `settle` that port is not "taken"; the old server
    ends, the held one binds at its GO, and the answer is "ready". Asked without `settle`,
    the old server is named the holder at once."""
    port = free_port()
    old = subprocess.Popen([sys.executable, "-c", LISTENER, str(port)])
    held = subprocess.Popen([sys.executable, "-c", BIND_AT_GO, str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: agent.check_ports([port])[port] is not None, 10, what="the old server listening")
        assert [state for _, state, _ in agent.wait_ready([("ps:0", port, held.pid)], 30)] == ["taken"]
        answers: list = []
        asked = threading.Thread(target=lambda: answers.extend(agent.wait_ready([("ps:0", port, held.pid)], 30,
                                                                                 settle=20)))
        asked.start()
        old.kill()
        old.wait(10)
        held.stdin.write("GO\n")
        held.stdin.flush()
        assert held.stdout.readline() == "up\n"
        asked.join(30)
        assert [(key, state) for key, state, _ in answers] == [("ps:0", "ready")]
    finally:
        for p in (old, held):
            p.kill()
            p.wait(10)


@pytest.mark.timeout(30)
def test_stop_kills_a_term_ignoring_task_and_its_setsid_grandchild(agent):
    pid = start_detached(agent, launch(agent, f"{C}:r2:worker:0", [sys.executable, "-c", STUBBORN]))
    procs = wait_for(lambda: len(with_tag(f"{C}:r2:")) == 2 and with_tag(f"{C}:r2:"), 10,
                     what="task and grandchild")
    grandchild = next(p for p in procs if p != pid)
    assert os.getsid(grandchild) != os.getsid(pid)

    report = agent.stop(f"{C}:", grace=0.5)

    assert sorted(report.stopped) == sorted((q(f"{C}:r2:worker:0"), p) for p in procs)
    assert report.survivors == ()
    assert with_tag(f"{C}:") == {}
    assert gone(pid) and gone(grandchild)


# Holds 2 GB (touched: bytearray zero-fills it) and ignores TERM: after its KILL the kernel
# frees that memory for ~0.1 s, with the process still running and its environment (so its
# tag) already unreadable.
BIG = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
       "b = bytearray(2 * 1024 ** 3); print('ready', flush=True); time.sleep(600)")


@pytest.mark.timeout(60)
def test_stop_returns_once_a_killed_task_is_dead_not_while_it_frees_its_memory(agent, home):
    t = launch(agent, f"{C}:big:worker:0", [sys.executable, "-c", BIG])
    pid = start_detached(agent, t)
    log = Path(home) / CLUSTER_DIR.removeprefix("~/") / "logs" / f"{C}_big_worker_0.log"
    wait_for(lambda: log.exists() and "ready" in log.read_text(), 30, what="2 GB held")

    report = agent.stop(f"{C}:big:", grace=0.1)

    assert [p for _, p in report.stopped] == [pid] and report.survivors == ()
    assert gone(pid), psutil.Process(pid).status()     # a zombie or reaped, not still exiting


@pytest.mark.timeout(30)
def test_attached_stop_kills_a_term_ignoring_task_and_its_setsid_grandchild(agent):
    task = agent.start_attached(launch(agent, f"{C}:r3:worker:0", [sys.executable, "-c", STUBBORN]),
                                grace=0.5)
    wait_for(lambda: len(with_tag(f"{C}:r3:")) == 2, 10, what="task and grandchild")

    task.stop()

    assert task.wait(15) == 128 + signal.SIGKILL  # TERM ignored, so KILL after the grace
    assert with_tag(f"{C}:") == {}
    assert agent.status(f"{C}:") == []


@pytest.mark.timeout(30)
def test_attached_task_output_arrives_in_order_with_its_exit_code(agent):
    script = "import sys\nfor i in range(5000): print('line', i)\nsys.exit(3)"
    task = agent.start_attached(launch(agent, f"{C}:r4:worker:0", [sys.executable, "-c", script]))

    out = read_all(task)

    assert out == b"".join(b"line %d\n" % i for i in range(5000))
    assert task.wait(10) == 3


@pytest.mark.timeout(30)
def test_the_checkpoint_request_reaches_the_script_which_inherited_it_ignored(agent, tmp_path):
    """request_save is SIGUSR1 to the task through its shim (what a notice too short to move
    asks of the chief); a task starts with it ignored, so a script without a handler is not
    killed by it, and one with a handler gets it."""
    ready = tmp_path / "ready"
    script = ("import signal, sys\n"
              "print('inherited', 'ignored' if signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN else 'default')\n"
              "got = []\n"
              "signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))\n"
              f"open({str(ready)!r}, 'w').close()\n"
              "while not got:\n    signal.pause()\n"
              "print('checkpoint request')\n")
    task = agent.start_attached(launch(agent, f"{C}:r12:worker:0", [sys.executable, "-c", script]))
    wait_for(ready.exists, 15, what="the script's handler")
    assert task.request_save()
    assert read_all(task) == b"inherited ignored\ncheckpoint request\n"
    assert task.wait(10) == 0


def test_a_login_shell_talking_on_stderr_before_the_shim_does_not_break_the_start(home, tmp_path):
    """A .bashrc's warnings (here: pyenv's rehash race when shells start together) come
    before the shim's first line on the same stderr; the start took the first line for the
    shim's answer and failed ("shim said: rm: cannot remove ...")."""
    noisy = tmp_path / "noisy-python"
    noisy.write_text("#!/bin/sh\necho \"rm: cannot remove '/root/.pyenv/shims/tmp.x'\" >&2\n"
                     "echo 'pyenv: cannot rehash: /root/.pyenv/shims isn'\\''t writable' >&2\n"
                     f"exec {sys.executable} \"$@\"\n")
    noisy.chmod(0o755)
    a = HostAgent("local", LocalTransport(), str(noisy), CLUSTER_DIR)
    try:
        a.prepare()
        task = a.start_attached(launch(a, f"{C}:r41:worker:0", [sys.executable, "-c", "print('ok')"]))
        assert read_all(task) == b"ok\n"
        assert task.wait(10) == 0
    finally:
        a.close()


@pytest.mark.timeout(30)
def test_attached_task_killed_by_sigkill_exits_137(agent):
    script = "import os, signal\nprint('bye', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)"
    task = agent.start_attached(launch(agent, f"{C}:r5:worker:0", [sys.executable, "-c", script]))

    assert read_all(task) == b"bye\n"
    assert task.wait(10) == 137


def start_launcher(tag: str) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, tag], stdout=subprocess.PIPE, env=env)
    return launcher, int(launcher.stdout.readline())


@pytest.mark.timeout(30)
def test_attached_task_dies_when_the_launcher_is_sigkilled(home):
    launcher, pid = start_launcher(f"{C}:r6:worker:0")
    try:
        assert not gone(pid)
        launcher.kill()
        wait_for(lambda: gone(pid), 10, what="task gone after launcher SIGKILL")
        assert with_tag(f"{C}:") == {}
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()


@pytest.mark.timeout(30)
def test_attached_task_dies_when_heartbeats_stop(home):
    launcher, pid = start_launcher(f"{C}:r7:worker:0")
    try:
        launcher.send_signal(signal.SIGSTOP)  # channel stays open, heartbeats stop
        t0 = time.monotonic()
        wait_for(lambda: gone(pid), 10, what="task gone after heartbeats stopped")
        assert time.monotonic() - t0 > 2.0  # the watchdog, not an early EOF, killed it
        assert with_tag(f"{C}:") == {}
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()


@pytest.mark.timeout(30)
def test_stalled_reader_does_not_block_the_task(agent, tmp_path):
    done = tmp_path / "done"
    script = f"import sys\nfor i in range(300000): print('x' * 60, i)\nopen({str(done)!r}, 'w').close()"
    task = agent.start_attached(launch(agent, f"{C}:r8:worker:0", [sys.executable, "-c", script]))

    wait_for(done.exists, 20, what="the task to finish while nobody reads")  # ~18 MB, pipe holds 64 KB
    wait_for(lambda: gone(task.pid), 10, what="task exit")
    task.detach_kill()
    assert task.wait(10) is not None


@pytest.mark.timeout(30)
def test_env_values_arrive_byte_for_byte_and_run_nothing(agent, tmp_path):
    values = {
        "V_SUBST": f"$(touch {tmp_path}/canary1)",
        "V_BACKTICK": f"`touch {tmp_path}/canary2`",
        "V_QUOTES": "it's \"quoted\"; touch canary3 && echo $HOME \\",
        "V_NEWLINES": "line one\nline two\n\n; rm -rf /nonexistent\n",
        "V_UNICODE": "héllo ✓ \t tab",
    }
    out = tmp_path / "env.json"
    script = f"import json, os\njson.dump({{k: os.environ[k] for k in {sorted(values)!r}}}, open({str(out)!r}, 'w'))"
    task = agent.start_attached(launch(agent, f"{C}:r9:worker:0", [sys.executable, "-c", script],
                                       env=values, cwd=str(tmp_path)))

    assert task.wait(15) == 0
    assert json.loads(out.read_text()) == values
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.json", "home"]


@pytest.mark.timeout(30)
def test_stop_spares_an_unrelated_process_named_by_a_stale_pidfile(agent, home):
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        with open(f"/proc/{bystander.pid}/stat") as f:
            start_time = int(f.read().rsplit(")", 1)[1].split()[19])
        tag = q(f"{C}:r10:ps:0")  # a task that died long ago; its pid now belongs to `sleep`
        record = {"pid": bystander.pid, "pgid": bystander.pid, "start_time": start_time, "tag": tag,
                  "argv": ["old"], "log": "x.log", "started_at": time.time()}
        agent.transport.put(json.dumps(record).encode(), PATHS.pidfile(f"{C}:r10:ps:0"))
        assert [(s.tag, s.alive) for s in agent.status(f"{C}:")] == [(tag, False)]

        report = agent.stop(f"{C}:", grace=0.5)

        assert report.stopped == () and report.survivors == ()
        assert bystander.poll() is None
        assert agent.status(f"{C}:") == []  # the stale pid file is gone
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.timeout(30)
def test_check_ports_names_the_holder_of_a_busy_port_and_passes_a_free_one(agent):
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        busy, free = held.getsockname()[1], free_port()

        result = agent.check_ports([busy, free])

    assert result[free] is None
    assert result[busy].startswith(f"pid {os.getpid()} (")


@pytest.mark.timeout(30)
def test_prepare_ships_files_only_when_they_changed(home):
    shim = home / ".tfcluster/lab/bin/shim.py"
    # in_process=False: ship to the cluster dir as for any host (a local host running
    # tfcluster's own interpreter would otherwise use the package's files directly).
    HostAgent("a", LocalTransport(), sys.executable, CLUSTER_DIR, in_process=False).prepare()
    shipped_at = shim.stat().st_mtime_ns
    HostAgent("b", LocalTransport(), sys.executable, CLUSTER_DIR, in_process=False).prepare()
    assert shim.stat().st_mtime_ns == shipped_at
    shim.write_text("# tampered\n")

    info = HostAgent("c", LocalTransport(), sys.executable, CLUSTER_DIR, in_process=False).prepare()

    assert shim.read_bytes() == (REPO / "tfcluster/host/shim.py").read_bytes()
    for name in ("shim_ports.py", "shim_procs.py", "shim_protocol.py", "shim_tasks.py", "tfserver.py"):
        assert (shim.parent / name).read_bytes() == (REPO / "tfcluster" / "host" / name).read_bytes()
    assert info.tf_version and info.python_version.count(".") == 2
    assert oct(shim.stat().st_mode & 0o777) == "0o700"


def test_prepare_names_the_host_when_python_is_missing(home):
    from tfcluster.errors import PreflightError

    with pytest.raises(PreflightError, match="host gpu0: /no/python3 not found"):
        HostAgent("gpu0", LocalTransport(), "/no/python3", CLUSTER_DIR).prepare()


def test_sync_files_uploads_each_content_once_and_places_it_in_every_run_dir(agent, home):
    files = [("train.py", b"print('hi')\n", 0o600), ("data/x.csv", b"1,2\n" * 1000, 0o600)]
    first = agent.sync_files(files, "~/.tfcluster/runs/r1")
    assert first == sum(len(d) for _, d, _ in files)
    second = agent.sync_files(files, "~/.tfcluster/runs/r2")
    assert second == 0
    for run in ("r1", "r2"):
        placed = home / ".tfcluster" / "runs" / run
        assert (placed / "train.py").read_bytes() == b"print('hi')\n"
        assert (placed / "data" / "x.csv").read_bytes() == b"1,2\n" * 1000
        assert oct((placed / "train.py").stat().st_mode & 0o777) == "0o600"
    changed = agent.sync_files([("train.py", b"print('v2')\n", 0o600)], "~/.tfcluster/runs/r3")
    assert changed == len(b"print('v2')\n")


def test_sync_files_refuses_paths_that_escape_the_run_dir(agent):
    with pytest.raises(HostError, match="bad file entry") as raised:
        agent.sync_files([("../evil.py", b"x", 0o600)], "~/.tfcluster/runs/r1")
    assert raised.value.exit_code == 1  # a host-side refusal, never "a training task failed"


def test_sync_files_above_the_inline_limit_uses_the_upload_path(agent, home, monkeypatch):
    import tfcluster.launch.agent.agent as agent_module

    monkeypatch.setattr(agent_module, "INLINE_LIMIT", 10)
    files = [("big.bin", bytes(range(256)) * 40, 0o600)]
    assert agent.sync_files(files, "~/.tfcluster/runs/big1") == 256 * 40
    assert agent.sync_files(files, "~/.tfcluster/runs/big2") == 0
    assert (home / ".tfcluster" / "runs" / "big2" / "big.bin").read_bytes() == bytes(range(256)) * 40


def test_warm_bootstraps_reuse_compiled_code_keyed_by_the_source(home):
    """The bootstrap caches each shipped module's compiled code in the private bindir,
    under the source's sha256: a changed file is compiled again, a corrupt entry is
    recompiled (and replaced), and the answers do not change."""
    bindir = home / ".tfcluster/lab/bin"

    def prepare(name):
        return HostAgent(name, LocalTransport(), sys.executable, CLUSTER_DIR, in_process=False).prepare()

    first = prepare("a")                        # ships, then runs the shim: nothing cached yet
    prepare("b")                                # warm: runs from the hashed bytes, caches code
    cached = sorted(p.name for p in bindir.glob(".*.code"))
    assert {c.split(".")[1] for c in cached} >= {"shim", "shim_fs", "shim_net", "shim_procs"}
    assert all(oct((bindir / c).stat().st_mode & 0o777) == "0o600" for c in cached)
    shim_entry = next(bindir / c for c in cached if c.startswith(".shim.py."))
    shim_entry.write_bytes(b"not marshal data")
    assert prepare("c") == first                # corrupt: compiled again, same answers
    assert shim_entry.read_bytes() != b"not marshal data"
    (bindir / "shim_protocol.py").write_text("# tampered\n")
    assert prepare("d") == first                # stale: shipped again; then cached anew
    prepare("e")
    assert len(list(bindir.glob(".shim_protocol.py.*.code"))) == 1   # same source, same key


def test_installed_version_reads_dist_info_in_path_order_as_importlib_metadata_does(tmp_path):
    from importlib import metadata

    first, second = tmp_path / "first", tmp_path / "second"
    for where, version in ((first, "1.2.3"), (second, "9.9.9")):
        info = where / f"My_Dist-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: My-Dist\nVersion: {version}\n")
    assert shim_facts._dist_infos([str(first), str(second)])["my_dist"] == "1.2.3"

    def by_metadata(dists):
        for dist in dists:
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue

    for dists in (shim_facts.TF_DISTRIBUTIONS, shim_facts.TB_DISTRIBUTIONS, ("tensorflow-cpu", "tensorflow")):
        assert shim_facts.installed_version(dists) == by_metadata(dists) is not None
    assert shim_facts.installed_version(("no-such-dist",)) is None
