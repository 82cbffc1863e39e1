"""Whose connections the fence admits, and the tables it leaves behind (host/shim_fence.py;
docs/security.md, "TensorFlow's ports").

- The relay: the output chain admits the cluster's own processes (its cgroup v2, which the
  shim puts everything it starts for the cluster into), no longer every socket of the owner's
  uid: any other process of the owner (an unfenced TF server that would proxy a stranger in)
  is refused, while the cluster's servers and the shim's reach exchange get in.
- A stale table (its servers killed without `down`) is swept by a root shim's next fence
  install, and a reach refused by it names it.

Real nftables, real processes, the real shim run as its own process, and a real second Unix
user (tests/users.py). Every test deletes the tables and cgroups it made and stops every
process it started, whatever happened.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import NFT, cgroup_fence_or_skip, dial, wait_for
from tests.tf_launch import free_ports
from tfcluster.host import shim_cgroup, shim_fence, shim_procs, shim_rules
from tfcluster.host import shim_protocol as proto

SHIM = str(Path(shim_fence.__file__).with_name("shim.py"))
LISTEN = ("import socket, sys, time\n"
          "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
          "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(64)\n"
          "print('up', s.getsockname()[1], flush=True)\n"
          "while True:\n"
          "    s.accept()[0].close()\n")


def shim(command: str, request: dict, timeout: float = 60) -> dict:
    """The shim as a process of its own (as on a host), one request; its one JSON answer."""
    done = subprocess.run([sys.executable, "-S", SHIM, command], input=json.dumps(request) + "\n",
                          capture_output=True, text=True, timeout=timeout)
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and answers, (done.returncode, done.stdout, done.stderr)
    return answers[-1]


def tables() -> list[str]:
    out = subprocess.run([NFT, "list", "tables"], capture_output=True, text=True, timeout=10).stdout
    return [line.split()[-1] for line in out.splitlines() if line.startswith("table inet ")]


def connect(port: int, user=None) -> str:
    """'connected' or the error's name, for a plain TCP connect from a process outside every
    cluster's cgroup: the owner's own (root), or `user`'s."""
    return dial(f"127.0.0.1:{port}", user=user)[f"127.0.0.1:{port}"]


@pytest.fixture
def cgroup_fence():
    return cgroup_fence_or_skip()


class Clusters:
    """Cluster directories made by a test; at its end every process they tagged is killed and
    every table and cgroup of theirs deleted (10 s at most)."""

    def __init__(self, root: Path) -> None:
        self.root, self.dirs, self.procs = root, [], []

    def make(self, name: str) -> str:
        path = self.root / "w" / name
        path.mkdir(parents=True, mode=0o700)
        self.dirs.append(str(path))
        return str(path)

    def cleanup(self) -> None:
        deadline = time.monotonic() + 10
        instances = {shim_procs.instance_id(d) for d in self.dirs}
        for proc in self.procs:
            proc.kill()
            proc.wait(10)
        for pid, tag in list(shim_procs.tagged(lambda t: any(f"@{i}:" in t for i in instances)).items()):
            shim_procs.signal_quietly(pid, 9)
        for table in tables():
            if shim_fence._instance(table) in instances:
                subprocess.run([NFT, "delete", "table", "inet", table], capture_output=True,
                               timeout=max(1.0, deadline - time.monotonic()))
        for instance in instances:
            path = os.path.join(shim_cgroup.mount_point(), shim_cgroup.PARENT, instance)
            if os.path.isdir(path):
                wait_for(lambda: not shim_cgroup.populated(path), max(0.1, deadline - time.monotonic()),
                         what=f"{path} to empty")
                os.rmdir(path)
        try:
            os.rmdir(os.path.join(shim_cgroup.mount_point(), shim_cgroup.PARENT))
        except OSError:
            pass        # another cluster's cgroup is there


@pytest.fixture
def clusters(tmp_path, cgroup_fence):
    made = Clusters(tmp_path)
    yield made
    made.cleanup()


def install(cluster_dir: str, name: str, port: int, listeners: bool = False) -> dict:
    """`fence install` in a shim of its own, as the batch that opens `up` sends it."""
    req = {"mode": "install", "cluster_dir": cluster_dir, "tag_prefix": f"{name}:", "ports": [port],
           "targets": [["127.0.0.1", port]], "peers": ["127.0.0.1"], "listeners": listeners}
    return shim(proto.BATCH, {"commands": {proto.FENCE: req}})["answers"][proto.FENCE]


def start_server(cluster_dir: str, name: str, port: int, job: str = "ps") -> int:
    """A detached listener started by the shim as `up` starts `job`:0's server (on the port
    the kernel picks for 0); its pid once it listens."""
    tag = f"{name}:up-1:{job}:0:server"
    log = os.path.join(cluster_dir, "runs", "up-1", f"{job}-0.server.log")
    answer = shim(proto.START, {"tag": tag, "cluster_dir": cluster_dir, "argv": [sys.executable, "-S", "-c", LISTEN,
                                                                                 str(port)],
                                "cwd": os.path.dirname(log), "log": log, "port": port,
                                "pidfile": os.path.join(cluster_dir, "pids", tag.replace(":", "_") + ".pid")})
    wait_for(lambda: os.path.exists(log) and "up" in Path(log).read_text(), 30, what="the server to listen")
    return answer["pid"]


@pytest.mark.timeout(120)
def test_the_owners_other_processes_are_refused_and_only_the_clusters_own_get_in(clusters, other_user):
    """The relay: a process of the owner's uid outside the cluster (here root's plain client,
    as an unfenced TF server of root's would be) no longer gets in; the cluster's server and
    its shim's reach exchange do; another user is refused as before. With `meta skuid` (the
    rules before) the owner's process connected."""
    cluster_dir = clusters.make("fencecg")
    port = free_ports(1)[0]
    answer = install(cluster_dir, "fencecg", port)
    assert answer["closed"] is True and answer["match"] == "cgroup", answer
    cgroup = shim_cgroup.path_of(cluster_dir)
    assert os.path.isdir(cgroup)
    listing = subprocess.run([NFT, "list", "table", "inet", answer["table"]], capture_output=True, text=True,
                             timeout=10).stdout
    assert "socket cgroupv2 level 2" in listing and "meta skuid" not in listing, listing
    pid = start_server(cluster_dir, "fencecg", port)
    assert str(pid) in Path(cgroup, "cgroup.procs").read_text().split()     # born in the cluster's cgroup

    assert connect(port) == "ConnectionRefusedError"                 # the owner's process, outside
    assert connect(port, other_user) == "ConnectionRefusedError"     # another user
    reached = shim(proto.REACH, {"targets": [["127.0.0.1", port]], "cluster_dir": cluster_dir, "timeout": 3})
    assert reached == {"results": {f"127.0.0.1:{port}": None}}       # the shim, from the cluster's cgroup
    outside = shim(proto.REACH, {"targets": [["127.0.0.1", port]], "timeout": 3})["results"][f"127.0.0.1:{port}"]
    assert outside.startswith("connection refused; ") and answer["table"] in outside, outside

    stopped = shim(proto.STOP, {"tag_prefix": "fencecg:", "cluster_dir": cluster_dir,
                                "piddir": os.path.join(cluster_dir, "pids")})
    assert [s["pid"] for s in stopped["stopped"]] == [pid] and not stopped["survivors"]
    assert answer["table"] not in tables()                           # the last task's end: table and cgroup go
    assert not os.path.exists(cgroup)


@pytest.mark.timeout(120)
def test_with_listeners_a_port_the_kernel_picked_for_the_cluster_refuses_all_but_the_clusters_own(
        clusters, other_user):
    """Mode keras-jax's table: JAX's collectives (gloo) listen on ports the kernel picks, which
    no task port names, and any user could connect to them (seen: a second user connected to
    both processes' gloo ports of a 2-process run). With `listeners`, a listener of the
    cluster's on such a port refuses another user and the owner's processes outside the
    cluster, and lets the cluster's own connections from this machine in (the shim's reach,
    made from the cluster's cgroup: the output chain marks it, the input chain admits the mark).
    A port someone chose (TensorBoard's) is left as it was. The same table without `listeners`
    leaves the kernel's port open: the rules are what closes it."""
    cluster_dir = clusters.make("fencelst")
    port, chosen = free_ports(2)                                     # both below the kernel's range
    answer = install(cluster_dir, "fencelst", port, listeners=True)
    assert answer["closed"] is True and answer["match"] == "cgroup", answer
    start_server(cluster_dir, "fencelst", 0)              # no task port: one the kernel picked
    picked = int(Path(cluster_dir, "runs", "up-1", "ps-0.server.log").read_text().split()[-1])
    low, high = shim_rules.picked_range()
    assert low <= picked <= high
    start_server(cluster_dir, "fencelst", chosen, job="worker")      # a port chosen, as TensorBoard's

    assert connect(picked, other_user) == "ConnectionRefusedError"   # another user
    assert connect(picked) == "ConnectionRefusedError"               # the owner's process, outside
    reached = shim(proto.REACH, {"targets": [["127.0.0.1", picked]], "cluster_dir": cluster_dir, "timeout": 3})
    assert reached == {"results": {f"127.0.0.1:{picked}": None}}     # the cluster's own
    assert connect(chosen, other_user) == "connected"
    listing = subprocess.run([NFT, "list", "table", "inet", answer["table"]], capture_output=True, text=True,
                             timeout=10).stdout
    assert f"tcp dport {low}-{high} socket cgroupv2" in listing, listing
    # a refusal where none of the cluster's processes listens is none of its table's doing:
    # another run's check that finds nothing at such a port is not told this table holds it
    # (seen: every refused port of the kernel's range blamed on a keras-jax run beside it)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        unused = probe.getsockname()[1]
    assert low <= unused <= high
    refused = shim(proto.REACH, {"targets": [["127.0.0.1", unused]], "timeout": 3})
    assert refused == {"results": {f"127.0.0.1:{unused}": "connection refused"}}, refused
    assert shim_fence.holders(unused) == [] and shim_fence.holders(port) == [answer["table"]]

    assert install(cluster_dir, "fencelst", port)["closed"] is True   # the same table, no `listeners`
    assert connect(picked, other_user) == "connected"
    shim(proto.STOP, {"tag_prefix": "fencelst:", "cluster_dir": cluster_dir,
                      "piddir": os.path.join(cluster_dir, "pids")})
    assert answer["table"] not in tables() and not os.path.exists(shim_cgroup.path_of(cluster_dir))


@pytest.mark.timeout(60)
def test_a_launcher_gone_before_the_batch_answer_leaves_no_table(clusters):
    """Ctrl-C while a host's first exec (a held script start whose batch installs the fence)
    still runs: the launcher's end of the pipe is gone when the shim writes the batch's
    answer. The table that batch made goes with the shim, which starts nothing."""
    cluster_dir = clusters.make("fencegone")
    port = free_ports(1)[0]
    tag = "fencegone:run-1:worker:0:script"
    log = os.path.join(cluster_dir, "runs", "run-1", "worker-0.log")
    fence_req = {"mode": "install", "cluster_dir": cluster_dir, "tag_prefix": "fencegone:", "ports": [port],
                 "targets": [["127.0.0.1", port]], "peers": ["127.0.0.1"]}
    request = {"tag": tag, "cluster_dir": cluster_dir, "argv": [sys.executable, "-S", "-c", "print('ran')"],
               "cwd": cluster_dir, "log": log, "attached": True, "defer": True, "heartbeat_timeout": 30,
               "grace": 1, "pidfile": os.path.join(cluster_dir, "pids", tag.replace(":", "_") + ".pid"),
               "batch": {"commands": {proto.FENCE: fence_req}}}
    proc = subprocess.Popen([sys.executable, "-S", SHIM, proto.START], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                     # the launcher gone: the answer's write fails (EPIPE)
    proc.stdin.write(json.dumps(request).encode() + b"\n")
    proc.stdin.close()
    try:
        proc.wait(30)
    finally:
        proc.kill()
    assert not os.path.exists(log)          # nothing started
    assert shim_fence.table_name(cluster_dir, "fencegone:") not in tables()
    assert not os.path.exists(shim_cgroup.path_of(cluster_dir))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [proto.BATCH, proto.FENCE])
def test_a_launcher_gone_before_an_install_is_answered_leaves_no_table(clusters, command):
    """Ctrl-C while a host's opening batch (or a move's fence request) installs the table:
    the answer's write fails, and the table it made goes, nothing of the cluster running here."""
    name = f"fencebye{command[:3]}"
    cluster_dir = clusters.make(name)
    port = free_ports(1)[0]
    fence_req = {"mode": "install", "cluster_dir": cluster_dir, "tag_prefix": f"{name}:", "ports": [port],
                 "targets": [["127.0.0.1", port]], "peers": ["127.0.0.1"]}
    request = {"commands": {proto.FENCE: fence_req}} if command == proto.BATCH else fence_req
    proc = subprocess.Popen([sys.executable, "-S", SHIM, command], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                     # the launcher gone: the answer's write fails (EPIPE)
    proc.stdin.write(json.dumps(request).encode() + b"\n")
    proc.stdin.close()
    try:
        assert proc.wait(30) != 0, "the shim said nothing of an answer it could not give"
    finally:
        proc.kill()
    assert shim_fence.table_name(cluster_dir, f"{name}:") not in tables()
    assert not os.path.exists(shim_cgroup.path_of(cluster_dir))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["answer-unread", "eof-before-go", "go"])
def test_an_up_conversation_keeps_a_spares_table_only_on_go(clusters, end):
    """`up`'s conversation with a host where it starts nothing (a spare): the batch installs the
    table before anything binds. The table stays only when GO comes (the `up` succeeded);
    when the launcher went before it read the answer (Ctrl-C as the answer went out, the
    pipe closed), or the conversation ends without GO (a failed check, a launcher killed after
    reading), the shim takes it back: nothing of the cluster runs here."""
    name = f"upkeep{end[:3]}"
    cluster_dir = clusters.make(name)
    port = free_ports(1)[0]
    fence_req = {"mode": "install", "cluster_dir": cluster_dir, "tag_prefix": f"{name}:", "ports": [port],
                 "targets": [["127.0.0.1", port]], "peers": ["127.0.0.1"]}
    request = {"commands": {proto.FENCE: fence_req}, "starts": [], "warm": False, "timeout": 10}
    table = shim_fence.table_name(cluster_dir, f"{name}:")
    proc = subprocess.Popen([sys.executable, "-S", SHIM, proto.UP], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    clusters.procs.append(proc)
    if end == "answer-unread":
        proc.stdout.close()                 # the launcher gone: the answer's write fails (EPIPE)
    proc.stdin.write(json.dumps(request).encode() + b"\n")
    proc.stdin.flush()
    if end != "answer-unread":
        answer = json.loads(proc.stdout.readline())
        assert "error" not in json.dumps(answer["answers"][proto.FENCE]) and table in tables(), answer
    if end == "go":
        proc.stdin.write(json.dumps({"go": []}).encode() + b"\n")
    proc.stdin.close()
    assert proc.wait(30) is not None
    assert (table in tables()) == (end == "go"), (end, tables())
    assert os.path.exists(shim_cgroup.path_of(cluster_dir)) == (end == "go")


# Its stale table is old on purpose, and any root fence install sweeps old tables of clusters
# with nothing left: another test's local cluster starting meanwhile (under -n 4, seen once in
# three runs) swept it first. So it runs alone: the lane beside it runs the notices' tests,
# whose hosts are the bed's namespaces, each with nftables of its own.
@pytest.mark.alone
@pytest.mark.timeout(120)
def test_a_killed_clusters_table_is_swept_by_the_next_install_and_a_refusal_names_it(clusters, other_user):
    """A cluster whose servers were killed without `down` leaves its table, which refuses
    everyone else on its ports. A refused reach names it; a root shim's next fence install
    deletes it (older than the grace, nothing of its cluster left), but never the table of a
    cluster that still has a process (in its cgroup or carrying its tag), and another user who
    copies a dead cluster's tag into a process of theirs does not keep its table."""
    port, other_port, busy_port, pin_port = free_ports(4)
    stale_dir, running_dir, next_dir = (clusters.make(n) for n in ("fencestale", "fencerun", "fencenext"))
    answer = install(stale_dir, "fencestale", port)
    assert answer["closed"] is True and answer["match"] == "cgroup", answer
    stale = answer["table"]
    pid = start_server(stale_dir, "fencestale", port)
    os.kill(pid, 9)                                                   # killed, no `down`
    wait_for(lambda: not shim_procs.is_alive(pid), 10, what="the server to die")
    # made long ago, as a table left since then would be (the sweep spares young tables)
    old = time.time() - 2 * shim_fence.SWEEP_GRACE
    subprocess.run([NFT, "-f", "-"], input=shim_rules.script(
        stale, 0, [port], [["127.0.0.1", port]], ["127.0.0.1"],
        cgroup=shim_cgroup.nft_name(shim_cgroup.path_of(stale_dir), shim_cgroup.mount_point()), made=old),
        text=True, check=True, timeout=10)
    # another cluster's old table whose cluster still runs (a tagged process, outside any cgroup)
    running = shim_fence.table_name(running_dir, "fencerun:")
    subprocess.run([NFT, "-f", "-"], input=shim_rules.script(running, 0, [busy_port], [], [], made=old),
                   text=True, check=True, timeout=10)
    tag = shim_procs.qualify("fencerun:up-1:ps:0:server", running_dir)
    clusters.procs.append(subprocess.Popen([sys.executable, "-S", "-c", LISTEN, str(busy_port)],
                                           stdout=subprocess.PIPE, text=True,
                                           env={**os.environ, proto.TAG_VAR: tag}))
    assert clusters.procs[-1].stdout.readline().startswith("up ")
    # a killed cluster's old table, its tag carried by another user's process (the tag is no secret)
    pin_dir = clusters.make("fencepin")
    pinned = shim_fence.table_name(pin_dir, "fencepin:")
    subprocess.run([NFT, "-f", "-"], input=shim_rules.script(pinned, 0, [pin_port], [], [], made=old),
                   text=True, check=True, timeout=10)
    pin_tag = shim_procs.qualify("fencepin:up-1:ps:0:server", pin_dir)
    clusters.procs.append(other_user.popen(["/usr/bin/python3", "-S", "-c", "print('up and tagged', flush=True)\n"
                                            "import time; time.sleep(110)"], stdout=subprocess.PIPE, text=True,
                                           env=other_user.env(**{proto.TAG_VAR: pin_tag})))
    assert clusters.procs[-1].stdout.readline().startswith("up ")
    # the next cluster on the stale one's port: its reach is refused, naming the table
    listener = subprocess.Popen([sys.executable, "-S", "-c", LISTEN, str(port)], stdout=subprocess.PIPE, text=True)
    clusters.procs.append(listener)
    assert listener.stdout.readline().startswith("up ")
    reason = shim(proto.REACH, {"targets": [["127.0.0.1", port]], "cluster_dir": next_dir,
                                "timeout": 3})["results"][f"127.0.0.1:{port}"]
    assert reason.startswith("connection refused; ") and f"{stale} on this host holds port {port}" in reason, reason

    swept = install(next_dir, "fencenext", other_port)
    assert stale in swept["swept"] and pinned in swept["swept"] and running not in swept["swept"], swept
    assert stale not in tables() and pinned not in tables() and running in tables()
    assert not os.path.exists(shim_cgroup.path_of(stale_dir))       # its empty cgroup went too
    assert connect(port) == "connected"                               # the port is free of it
    shim(proto.STOP, {"tag_prefix": "fencenext:", "cluster_dir": next_dir, "piddir": os.path.join(next_dir, "pids")})
    assert swept["table"] not in tables() and not os.path.exists(shim_cgroup.path_of(next_dir))


def test_the_uid_is_the_match_where_nft_cannot_name_the_clusters_cgroup():
    """The fallback's rules (no cgroup: a cgroup2 mounted elsewhere, not writable, iptables)."""
    text = shim_rules.script("tfcluster_t_1", 1234, [2222], [["127.0.0.1", 2222]], ["127.0.0.1"], made=0)
    assert "meta skuid != 1234" in text and "cgroupv2" not in text
    text = shim_rules.script("tfcluster_t_1", 1234, [2222], [["127.0.0.1", 2222]], ["127.0.0.1"],
                             cgroup=("unified/tfcluster/abc", 2), made=0)
    assert 'tcp flags & (syn | ack) == syn socket cgroupv2 level 2 "unified/tfcluster/abc" accept' in text
    assert "skuid" not in text and 'comment "tfcluster made 0 uid 1234"' in text
    assert shim_cgroup.nft_name("/run/cg2/tfcluster/abc", "/run/cg2") is None
    assert shim_cgroup.nft_name("/sys/fs/cgroup/unified/tfcluster/abc", "/sys/fs/cgroup/unified") == (
        "unified/tfcluster/abc", 2)
    assert shim_cgroup.nft_name("/sys/fs/cgroup/tfcluster/abc", "/sys/fs/cgroup") == ("tfcluster/abc", 2)
