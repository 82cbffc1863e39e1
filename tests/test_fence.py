"""TensorFlow's ports closed to everyone but the cluster's owner and hosts (host/shim_fence.py,
launch/agent/fence.py; docs/security.md, "TensorFlow's ports").

The real parts: nftables on this machine (root; `apt-get install nftables`), a real second Unix
user (tests/users.py) whose connections must be refused, TF servers started by `up` and
`train`, and the loopback sshd. Every test that can make a table names its own cluster and
deletes that cluster's tables in a finalizer; no other table is ever touched.
"""
from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (
    CLUSTER_DIR,
    NFT,
    SESSION_VAR,
    cluster_tables,
    dial,
    gone_after_ctrl_c,
    kill_group,
    launch,
    local_spec,
    read_until,
    ssh_spec,
    start_tfcluster,
    tagged_processes,
    tfcluster,
    wait_for,
)
from tests.tf_launch import free_ports
from tfcluster.errors import PreflightError
from tfcluster.host import shim_cgroup, shim_fence, shim_procs, shim_rules
from tfcluster.host import shim_protocol as proto
from tfcluster.launch.agent import fence
from tfcluster.plan import build_plan
from tfcluster.spec import load_spec
from tfcluster.ui import UI



def tables() -> list[str]:
    out = subprocess.run([NFT, "list", "tables"], capture_output=True, text=True, timeout=10).stdout
    return [line.split()[-1] for line in out.splitlines() if line.startswith("table inet ")]


@pytest.fixture
def nft():
    """Root with nftables, or skip with the reason."""
    if os.geteuid() != 0:
        pytest.skip("closing ports needs root (CI runs as root)")
    if NFT is None or subprocess.run([NFT, "list", "tables"], capture_output=True, timeout=10).returncode:
        pytest.skip("nftables is not installed or not usable here (scripts/test.sh installs it)")
    return NFT


@pytest.fixture
def drop_tables(nft):
    """Clusters' names whose tables are deleted at the end, whatever the test did (10 s at most)."""
    names: list[str] = []
    yield names
    deadline = time.monotonic() + 10
    for name in names:
        for table in cluster_tables(name):
            subprocess.run([nft, "delete", "table", "inet", table], capture_output=True,
                           timeout=max(1.0, deadline - time.monotonic()))


def refused_everywhere(user, targets: list[str]) -> None:
    answers = dial(*targets, user=user)
    assert answers == {t: "ConnectionRefusedError" for t in targets}, answers


def ui_into(err: io.StringIO) -> UI:
    return UI(io.StringIO(), err, color=False)


# ---------------------------------------------------------------- pure

def test_a_table_is_named_for_its_cluster_and_directory_and_never_needs_quoting():
    a = shim_fence.table_name("/w/one/lab", "lab:")
    assert a == f"tfcluster_lab_{shim_procs.instance_id('/w/one/lab')}"
    assert shim_fence.table_name("/w/one/lab", f"lab@{shim_procs.instance_id('/w/one/lab')}:run:ps:0:server") == a
    assert shim_fence.table_name("/w/two/lab", "lab:") != a            # another workdir: another cluster
    odd = shim_fence.table_name("/w/x", "my-lab.v2:")
    assert odd.startswith("tfcluster_my_lab_v2_") and odd.replace("_", "").isalnum()


def test_the_table_refuses_others_sockets_and_strangers_and_lets_the_owner_and_the_hosts_in():
    text = shim_rules.script("tfcluster_t_1", 1234, [2222], [["127.0.0.1", 2222], ["127.0.0.2", 2223]],
                             ["127.0.0.1", "127.0.0.2"])
    lines = [line.strip() for line in text.splitlines()]
    assert lines[:3] == ["table inet tfcluster_t_1", "delete table inet tfcluster_t_1", "table inet tfcluster_t_1 {"]
    out = lines[lines.index("chain output {") + 2:lines.index("chain input {") - 1]
    syn = "tcp flags & (syn | ack) == syn"
    assert out == [
        # 127.0.0.2 is this machine too: its task's port is closed here like this host's own
        f"{syn} meta skuid != 1234 tcp dport {{ 2222, 2223 }} fib daddr type local reject with tcp reset",
        f"{syn} meta skuid != 1234 ip daddr . tcp dport {{ 127.0.0.1 . 2222, 127.0.0.2 . 2223 }} "
        "reject with tcp reset"]
    assert lines[lines.index("chain input {") + 2:-2] == [
        f"{syn} tcp dport {{ 2222, 2223 }} fib saddr type local accept",
        f"{syn} tcp dport {{ 2222, 2223 }} ip saddr {{ 127.0.0.1, 127.0.0.2 }} accept",
        f"{syn} tcp dport {{ 2222, 2223 }} reject with tcp reset"]


def test_with_listeners_the_ports_the_kernel_picked_for_the_clusters_processes_are_closed_too():
    """Mode keras-jax: JAX's collectives listen on ports the kernel picks. The input chain
    finds the listener a new connection from this machine to such a port is for (`socket`): a
    cluster's admits the cluster's own connections (marked on their way out, the mark taken off
    on the way in) and refuses the other users'. Other machines' connections are left as they
    were (NCCL may dial from an interface no spec names). Without a cgroup there is no such
    match: no rule."""
    cg = ("unified/tfcluster/abc", 2)
    args = ("tfcluster_t_1", 1234, [2222], [["127.0.0.1", 2222]], ["127.0.0.1", "10.0.0.2"])
    lines = [line.strip() for line in shim_rules.script(*args, cgroup=cg, listeners=(32768, 60999)).splitlines()]
    syn, ours = "tcp flags & (syn | ack) == syn", 'socket cgroupv2 level 2 "unified/tfcluster/abc"'
    out = lines[lines.index("chain output {") + 2:lines.index("chain input {") - 1]
    assert out[:2] == [f"{syn} {ours} fib daddr type local meta mark set meta mark | 0x20000000 accept",
                       f"{syn} {ours} accept"], out
    inp = lines[lines.index("chain input {") + 2:-2]
    picked = f"{syn} tcp dport 32768-60999 {ours} fib saddr type local"
    assert inp[:2] == [
        f"{picked} meta mark & 0x20000000 == 0x20000000 meta mark set meta mark & 0xdfffffff accept",
        f"{picked} reject with tcp reset"], inp
    assert inp[2:] == [line.strip() for line in shim_rules.script(*args, cgroup=cg).splitlines()][-5:-2]
    assert "mark" not in shim_rules.script(*args, cgroup=cg)
    assert "mark" not in shim_rules.script(*args, listeners=(32768, 60999))    # the uid: no listener is known


def test_the_range_the_kernel_picks_from_is_read_and_linuxs_default_stands_in(tmp_path):
    (tmp_path / "range").write_text("40000\t50000\n")
    assert shim_rules.picked_range(str(tmp_path / "range")) == (40000, 50000)
    (tmp_path / "bad").write_text("40000\n")
    assert shim_rules.picked_range(str(tmp_path / "bad")) == (32768, 60999)
    assert shim_rules.picked_range(str(tmp_path / "none")) == (32768, 60999)


def test_a_tables_made_comment_is_read_back_as_written_and_nothing_else_is_taken_for_it():
    text = shim_rules.script("tfcluster_t_1", 1234, [2222], [["127.0.0.1", 2222]], ["127.0.0.1"], made=1796000000)
    assert shim_rules.made_at(text) == 1796000000.0
    assert shim_rules.made_at(text.replace("tfcluster made", "someone made")) is None
    assert shim_rules.made_at("table inet tfcluster_t_1 {\n}") is None     # an older tfcluster's: no comment


@pytest.mark.parametrize("value,problem", [
    ("auto", None), ("closed", None), ("open", None),
    ("shut", "7: tf_ports: unknown tf_ports 'shut'; expected one of: auto, closed, open"),
])
def test_tf_ports_is_auto_closed_or_open(tmp_path, value, problem):
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nhosts:\n  - {name: local, address: localhost}\n"
                    f"jobs:\n  worker: {{count: 1, hosts: [local], port: 2222}}\ntrain: {{mode: mirrored}}\n"
                    f"tf_ports: {value}\n")
    if problem is None:
        assert build_plan(load_spec(str(spec))).tf_ports == value
        return
    with pytest.raises(Exception) as caught:
        load_spec(str(spec))
    assert str(caught.value).startswith(f"{spec}:{problem}")


def _plan(tmp_path, tf_ports: str = "auto"):
    spec = tmp_path / "lab.yaml"
    spec.write_text("name: lab\nhosts:\n  - {name: gpu1, address: 10.0.0.1}\n  - {name: gpu2, address: 10.0.0.2}\n"
                    "jobs:\n  ps: {count: 1, hosts: [gpu1], port: 2222}\n"
                    "  worker: {count: 2, hosts: [gpu1, gpu2], port: 2230}\n"
                    f"tf_ports: {tf_ports}\n")
    return build_plan(load_spec(str(spec)))


def test_each_host_is_asked_for_its_own_ports_and_every_task_address(tmp_path):
    plan = _plan(tmp_path)
    assert fence.request(plan, "gpu1", fence.INSTALL) == {
        "mode": "install", "cluster_dir": plan.cluster_dir, "tag_prefix": "lab:", "ports": [2222, 2230],
        "targets": [["10.0.0.1", 2222], ["10.0.0.1", 2230], ["10.0.0.2", 2230]],
        "peers": ["10.0.0.1", "10.0.0.2"], "listeners": False}
    assert fence.request(_plan(tmp_path, "open"), "gpu1", fence.INSTALL) is None


OPEN = {"closed": False, "why": "tfcluster runs as ann there, not root, and `sudo -n nft` is not allowed",
        "others": ["bob", "eve"], "user": "ann"}


def test_a_host_that_cannot_close_its_ports_gets_one_warning_naming_it_who_else_is_there_and_the_fix(tmp_path):
    err = io.StringIO()
    fence.report(_plan(tmp_path), ui_into(err), {"gpu1": {"closed": True}, "gpu2": OPEN}, fence.INSTALL)
    lines = err.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("tfcluster: warning: host gpu2: TensorFlow's ports (2230) stay open: other users "
                               "with processes there (bob, eve) and anyone on its network can connect and run "
                               "any TensorFlow op as you")
    assert "tfcluster cannot close them there: tfcluster runs as ann there, not root" in lines[0]
    assert "`ann ALL=(root) NOPASSWD: /usr/sbin/nft`" in lines[0]
    assert lines[0].endswith("or set `tf_ports: open` in the spec to accept this and silence it")


def test_in_mode_keras_jax_the_warning_names_what_jaxs_open_port_exposes_not_tensorflow_ops(tmp_path):
    spec = tmp_path / "kj.yaml"
    spec.write_text("name: kj\nhosts:\n  - {name: gpu1, address: 10.0.0.1}\n  - {name: gpu2, address: 10.0.0.2}\n"
                    "  - {name: gpu3, address: 10.0.0.3, spare: true}\n"
                    "jobs:\n  worker: {tasks: ['gpu1:2230', 'gpu2:2230']}\n"
                    "train: {mode: keras-jax, script: train.py}\n")
    (tmp_path / "train.py").write_text("")
    err = io.StringIO()
    fence.report(build_plan(load_spec(str(spec))), ui_into(err), {"gpu1": {"closed": True}, "gpu2": OPEN},
                 fence.INSTALL)
    plan = build_plan(load_spec(str(spec)))
    assert fence.request(plan, "gpu1", fence.INSTALL)["listeners"] is True     # JAX's own ports closed too
    assert fence.status_line(plan, {"gpu1": {"closed": True}, "gpu2": OPEN}, {"gpu1", "gpu2"}) == (
        f"The task ports: closed on gpu1 (nftables); OPEN on gpu2 ({OPEN['why']})")
    assert fence.status_line(_plan(tmp_path), {"gpu1": {"closed": True}}, {"gpu1"}) == (
        "TensorFlow's ports: closed on gpu1 (nftables)")
    # closed by the uid (no cgroup match): JAX's own ports stay open, and the host is named with why
    uid_err = io.StringIO()
    fence.report(plan, ui_into(uid_err), {"gpu1": {"closed": True, "match": "uid", "match_why": "no cgroup v2 here"},
                                          "gpu2": {"closed": True, "match": "cgroup"},
                                          "gpu3": {"closed": True, "match": "uid"}}, fence.INSTALL)   # idle spare
    assert uid_err.getvalue().splitlines() == [
        "tfcluster: warning: host gpu1: the task ports are closed, but the ports JAX's collectives listen on stay "
        "open to other users there: closing them needs the cluster's cgroup v2 matched by nft (no cgroup v2 here; "
        'docs/security.md, "The fallback")'], uid_err.getvalue()
    line, = err.getvalue().splitlines()
    assert line.startswith("tfcluster: warning: host gpu2: the task ports (2230) stay open: other users with "
                           "processes there (bob, eve) and anyone on its network can connect and talk to JAX's "
                           "coordination service on worker 0's, which asks no one who they are"), line
    assert "TensorFlow" not in line, line


def test_tf_ports_open_silences_the_warning_and_closed_refuses_naming_each_host(tmp_path):
    err = io.StringIO()
    fence.report(_plan(tmp_path, "open"), ui_into(err), {"gpu2": OPEN}, fence.INSTALL)
    assert err.getvalue() == ""
    with pytest.raises(PreflightError) as caught:
        fence.report(_plan(tmp_path, "closed"), ui_into(err), {"gpu1": {"closed": True}, "gpu2": OPEN},
                     fence.INSTALL)
    assert caught.value.exit_code == 4 and "\n" not in str(caught.value)
    assert str(caught.value) == ("tf_ports: closed, but tfcluster cannot close TensorFlow's ports on host gpu2 "
                                 f"({OPEN['why']})")
    assert err.getvalue() == ""


# ---------------------------------------------------------------- the shim on this machine, for real

LISTEN = ("import socket, sys, time\n"
          "s = socket.socket(socket.AF_INET6); s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)\n"
          "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('::', int(sys.argv[1]))); s.listen()\n"
          "print('up', flush=True); time.sleep(120)\n")


def test_the_shims_table_refuses_another_users_connect_lets_the_owner_in_and_goes_with_the_last_task(
        tmp_path, nft, drop_tables, other_user):
    drop_tables.append("fenceshim")
    cluster_dir = str(tmp_path / "w" / "fenceshim")
    os.makedirs(cluster_dir, mode=0o700)
    port = free_ports(1)[0]
    foreign = "tfcfence_not_ours"             # a table that is not tfcluster's: never touched
    subprocess.run([nft, "add", "table", "inet", foreign], check=True, timeout=10)
    tag = shim_procs.qualify("fenceshim:up-1:ps:0:server", cluster_dir)
    server = subprocess.Popen([sys.executable, "-c", LISTEN, str(port)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, proto.TAG_VAR: tag})
    try:
        assert server.stdout.readline() == "up\n"
        targets = [f"127.0.0.1:{port}", f"[::1]:{port}"]
        assert dial(*targets, user=other_user) == {t: "connected" for t in targets}   # open before
        answer = shim_fence.cmd_fence({"cluster_dir": cluster_dir, "tag_prefix": "fenceshim:", "ports": [port],
                                       "targets": [["127.0.0.1", port]], "peers": ["127.0.0.1"]})
        assert answer["closed"] is True and answer["why"] is None, answer
        assert cluster_tables("fenceshim") == [answer["table"]]
        refused_everywhere(other_user, targets)
        if answer.get("match") == "cgroup":     # the cluster's own processes get in (tests/test_fence_match.py)
            own = ("import os, socket, sys; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()));"
                   "socket.create_connection(('127.0.0.1', int(sys.argv[2])), 3).close()")
            subprocess.run([sys.executable, "-c", own, shim_cgroup.path_of(cluster_dir), str(port)],
                           check=True, timeout=30)
        else:
            socket.create_connection(("127.0.0.1", port), 3).close()      # the owner still gets in
        assert shim_fence.cmd_fence({"cluster_dir": cluster_dir, "tag_prefix": "fenceshim:",
                                     "mode": "status"})["closed"] is True
        shim_fence.release_if_idle(cluster_dir, "fenceshim:")
        assert cluster_tables("fenceshim") == [answer["table"]]             # its task still runs
    finally:
        server.kill()
        server.wait(10)
    shim_fence.release_if_idle(cluster_dir, "fenceshim:")
    try:
        assert cluster_tables("fenceshim") == []
        assert foreign in tables()
    finally:
        subprocess.run([nft, "delete", "table", "inet", foreign], timeout=10)


@pytest.mark.timeout(60)
def test_an_in_process_install_that_ends_after_ctrl_c_takes_its_table_back(agent, nft, drop_tables):
    """A local host's shim commands run in the launcher's own process, on its host threads: an
    install still running when Ctrl-C lands would finish after the run's stop had passed that
    host, and nobody would take its table. It takes it back itself, as a remote shim whose
    launcher is gone does (test_fence_match)."""
    assert agent.in_process
    name = f"late{os.getpid()}"
    drop_tables.append(name)
    ask = {"cluster_dir": CLUSTER_DIR, "tag_prefix": f"{name}:", "ports": [free_ports(1)[0]],
           "targets": [], "peers": ["127.0.0.1"]}
    assert agent.fence(dict(ask, mode="install"))["closed"] is True
    assert len(cluster_tables(name)) == 1           # not cancelled: the table stays
    assert agent.release_fence(dict(ask, mode="release"))["closed"] is False
    agent.interrupt()          # Ctrl-C: the install below is the one that was running then
    assert agent.fence(dict(ask, mode="install"))["closed"] is True
    assert cluster_tables(name) == [], "an install that ended after Ctrl-C left its table"


@pytest.mark.timeout(60)
def test_a_moves_stop_leaves_the_table_a_plain_stop_takes_it_and_release_takes_a_left_one(agent, nft, drop_tables):
    """A move's STOP (`STOP keep`) ends a host's last task and leaves its table for the tasks the
    move starts there (the fence never opens between); the stop of a run's end takes it with
    that last task; `release` takes one a move left on a host it gave up, once nothing runs."""
    name = f"keep{os.getpid()}"
    drop_tables.append(name)
    ask = {"cluster_dir": CLUSTER_DIR, "tag_prefix": f"{name}:", "ports": [free_ports(1)[0]],
           "targets": [], "peers": ["127.0.0.1"]}

    def running() -> bool:
        return any(t.startswith(f"{name}@") for t in tagged_processes().values())

    def one_task(keep_fence: bool) -> None:
        task = agent.start_attached(launch(agent, f"{name}:r1:worker:0",
                                           [sys.executable, "-c", "import time; time.sleep(600)"]))
        wait_for(running, 20, what="the task running")
        task.stop(keep_fence=keep_fence)
        assert task.wait(20) == 128 + signal.SIGTERM
        wait_for(lambda: not running(), 20, what="the task and its shim gone")

    assert agent.fence(dict(ask, mode="install"))["closed"] is True
    one_task(keep_fence=True)
    assert len(cluster_tables(name)) == 1, "a move's stop took the table"
    assert agent.release_fence(dict(ask, mode="release"))["closed"] is False
    assert cluster_tables(name) == []

    assert agent.fence(dict(ask, mode="install"))["closed"] is True
    one_task(keep_fence=False)
    wait_for(lambda: cluster_tables(name) == [], 20, what="the last task's shim taking the table")


def test_without_nft_the_same_rules_go_through_iptables_and_go_again(tmp_path, nft, other_user, monkeypatch):
    """A host with iptables (iptables-nft) but no nft command. nft is installed here, so the
    shim is made not to find it: the one fault this test fakes."""
    ipt = shutil.which("iptables-nft") or shutil.which("iptables")
    if ipt is None:
        pytest.skip("iptables is not installed here")
    real = shim_fence._which
    monkeypatch.setattr(shim_fence, "_which", lambda name: None if name == "nft" else real(name))
    cluster_dir = str(tmp_path / "w" / "fenceipt")
    os.makedirs(cluster_dir, mode=0o700)
    port = free_ports(1)[0]
    table = shim_fence.table_name(cluster_dir, "fenceipt:")
    server = subprocess.Popen([sys.executable, "-c", LISTEN, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline() == "up\n"
        answer = shim_fence.cmd_fence({"cluster_dir": cluster_dir, "tag_prefix": "fenceipt:", "ports": [port],
                                       "targets": [["127.0.0.1", port]], "peers": ["127.0.0.1"]})
        assert answer["closed"] is True, answer
        targets = [f"127.0.0.1:{port}", f"[::1]:{port}"]
        refused_everywhere(other_user, targets)
        socket.create_connection(("127.0.0.1", port), 3).close()
        assert shim_fence.cmd_fence({"cluster_dir": cluster_dir, "tag_prefix": "fenceipt:",
                                     "mode": "status"})["closed"] is True
    finally:
        server.kill()
        server.wait(10)
        shim_fence.release_if_idle(cluster_dir, "fenceipt:")
        left = [c for c in shim_rules.chains(table)
                if subprocess.run([ipt, "-w", "-S", c], capture_output=True, timeout=10).returncode == 0]
        for chain in left:                         # a failed test leaves nothing behind either
            shim_fence._delete({"iptables": [ipt, "-w"], "ip6tables": [ipt.replace("iptables", "ip6tables"), "-w"]},
                               table)
    assert left == []


# ---------------------------------------------------------------- up, train, down, Ctrl-C, SIGKILL

def _task_targets(spec: Path) -> list[str]:
    return [f"127.0.0.1:{t.port}" for t in build_plan(load_spec(str(spec))).tasks]


TF_SESSION = ("import sys, tensorflow as tf\n"
              "tf.compat.v1.disable_eager_execution()\n"
              "with tf.device('/job:ps/task:0'):\n"
              "    secret = tf.io.read_file(sys.argv[2])\n"
              "config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=5000)\n"
              "try:\n"
              "    print('READ', tf.compat.v1.Session(sys.argv[1], config=config).run(secret))\n"
              "except Exception as e:\n"
              "    print('FAILED', type(e).__name__)\n")


@pytest.mark.tf
@pytest.mark.timeout(240)
def test_up_closes_every_task_port_to_another_users_session_while_the_owner_trains_until_down(
        tmp_path, home, nft, drop_tables, other_user, other_python):
    drop_tables.append("fenceup")
    spec = local_spec(tmp_path, name="fenceup", args=["--steps", "30"])
    secret = tmp_path / "secret.txt"
    secret.write_text("root's secret\n")
    secret.chmod(0o600)
    try:
        up = tfcluster("up", str(spec), home=home, cwd=tmp_path)
        assert up.returncode == 0, up.stderr
        assert "stay open" not in up.stderr
        assert len(cluster_tables("fenceup")) == 1
        targets = _task_targets(spec)
        refused_everywhere(other_user, targets)
        # the review's attack, as the other user
        ps = next(t for t in targets if t.endswith(str(build_plan(load_spec(str(spec))).task("ps:0").port)))
        attack = other_python.user.run([other_python.python, "-c", TF_SESSION, f"grpc://{ps}", str(secret)],
                                       env=other_user.env(PYTHONPATH=other_python.site), timeout=120)
        assert "root's secret" not in attack.stdout
        assert "FAILED" in attack.stdout, attack.stdout + attack.stderr[-2000:]
        status = tfcluster("status", str(spec), home=home, cwd=tmp_path)
        assert "TensorFlow's ports: closed on local (nftables)" in status.stderr, status.stderr
        train = tfcluster("train", str(spec), home=home, cwd=tmp_path)      # the owner's run, on the up cluster
        assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
        assert len(cluster_tables("fenceup")) == 1                          # the servers still run
    finally:
        down = tfcluster("down", str(spec), home=home, cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert cluster_tables("fenceup") == []


@pytest.mark.tf
@pytest.mark.timeout(240)
def test_trains_table_lives_while_it_runs_and_goes_on_ctrl_c(tmp_path, home, nft, drop_tables, other_user):
    drop_tables.append("fencetr")
    spec = local_spec(tmp_path, name="fencetr", args=["--steps", "100000", "--min_step_time", "0.05"])
    proc = start_tfcluster("train", str(spec), home=home, cwd=tmp_path)
    try:
        read_until(proc, "│ step=", timeout=120)
        assert len(cluster_tables("fencetr")) == 1
        refused_everywhere(other_user, _task_targets(spec))
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 130
    finally:
        kill_group(proc)
    gone_after_ctrl_c("fencetr")


@pytest.mark.tf
@pytest.mark.timeout(240)
def test_a_sigkilled_launchers_table_goes_with_down(tmp_path, home, nft, drop_tables):
    drop_tables.append("fencekill")
    spec = local_spec(tmp_path, name="fencekill", args=["--steps", "100000", "--min_step_time", "0.05"])
    proc = start_tfcluster("train", str(spec), home=home, cwd=tmp_path)
    try:
        read_until(proc, "│ step=", timeout=120)
        assert len(cluster_tables("fencekill")) == 1
    finally:
        kill_group(proc)                    # SIGKILL: the launcher and the local shims with it
    down = tfcluster("down", str(spec), home=home, cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert cluster_tables("fencekill") == []
    wait_for(lambda: not tagged_processes(), 15, what="the run's processes to go")


# ---------------------------------------------------------------- over SSH

@pytest.mark.tf
@pytest.mark.timeout(240)
def test_up_over_ssh_closes_each_hosts_ports_to_another_user_until_down(
        tmp_path, home, ssh_home, sshd, nft, drop_tables, other_user):
    drop_tables.append("fencessh")
    spec = ssh_spec(tmp_path, sshd, name="fencessh")
    plan = build_plan(load_spec(str(spec)))
    try:
        up = tfcluster("up", str(spec), home=home, cwd=tmp_path)
        assert up.returncode == 0, up.stderr
        # three hosts of the spec, one machine: one table, every task's port closed on every address
        assert len(cluster_tables("fencessh")) == 1
        targets = [t.target for t in plan.tasks] + [f"127.0.0.1:{t.port}" for t in plan.tasks]
        refused_everywhere(other_user, targets)
    finally:
        down = tfcluster("down", str(spec), home=home, cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert cluster_tables("fencessh") == []


@pytest.mark.tf
@pytest.mark.timeout(240)
def test_the_shims_remove_the_table_themselves_when_the_launcher_vanishes_over_ssh(
        tmp_path, home, ssh_home, sshd, nft, drop_tables):
    """SIGKILL of the launcher alone: each host's shims read EOF, stop their tasks, and the
    last one removes the table, with no `down`."""
    drop_tables.append("fencegone")
    spec = ssh_spec(tmp_path, sshd, name="fencegone",
                    train="train:\n  mode: between-graph\n  script: template:between_graph\n"
                          "  args: ['--steps', '100000', '--min_step_time', '0.05']\n")
    proc = start_tfcluster("train", str(spec), home=home, cwd=tmp_path)
    try:
        read_until(proc, "│ step=", timeout=150)
        assert len(cluster_tables("fencegone")) == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: not cluster_tables("fencegone"), 60, what="the shims to remove the table")
        wait_for(lambda: not tagged_processes(), 30, what="the run's processes to go")
    finally:
        kill_group(proc)
        if tagged_processes():
            tfcluster("down", str(spec), home=home, cwd=tmp_path)


# ---------------------------------------------------------------- a user who cannot close them

def _run_as_user_without_root(other, tf_ports: str = "auto", command: tuple = ("train",)):
    """`tfcluster train` (or `command`) of a one-worker mirrored spec (a plain script, no TF
    import) run by the other user with the system Python (`other`: tests/users.py's
    other_python); (the result, the task's port)."""
    user = other.user
    if shutil.which("sudo") and user.run(["sudo", "-n", "true"]).returncode == 0:
        pytest.skip("the other user has passwordless sudo here")
    work = Path(f"/tmp/tfc-fence-{os.getpid()}-{time.monotonic_ns()}")
    work.mkdir(mode=0o700)
    try:
        os.chown(work, user.uid, user.gid)
        port = free_ports(1)[0]
        (work / "hello.py").write_text("print('hello from the script')\n")
        (work / "lab.yaml").write_text(
            f"name: fenceuser\nworkdir: {work}/w\nhosts:\n  - {{name: mybox, address: 127.0.0.1}}\n"
            f"jobs:\n  worker: {{tasks: ['mybox:{port}']}}\ntrain:\n  mode: mirrored\n  script: hello.py\n"
            f"tf_ports: {tf_ports}\n")
        for path in (work / "hello.py", work / "lab.yaml"):
            os.chown(path, user.uid, user.gid)
        env = user.env(PYTHONPATH=other.pythonpath, NO_COLOR="1", **{SESSION_VAR: os.environ[SESSION_VAR]})
        run = user.run([other.python, "-m", "tfcluster", *command, "lab.yaml"], cwd=str(work), env=env,
                       timeout=120)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return run, port


def test_a_user_without_root_or_sudo_runs_with_one_warning_naming_the_host(other_user, other_python):
    run, port = _run_as_user_without_root(other_python)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    warnings = [line for line in run.stderr.splitlines() if "TensorFlow's ports" in line]
    assert len(warnings) == 1, run.stderr
    assert warnings[0].startswith(f"tfcluster: warning: host mybox: TensorFlow's ports ({port}) stay open: ")
    assert f"tfcluster runs as {other_user.name} there, not root" in warnings[0]
    assert "hello from the script" in run.stdout
    check, port = _run_as_user_without_root(other_python, command=("plan", "--check"))
    assert check.returncode == 0, check.stderr
    assert f"tfcluster: warning: host mybox: TensorFlow's ports ({port}) stay open: " in check.stderr
    assert "will be closed" not in check.stderr


def test_tf_ports_closed_refuses_that_run_before_anything_starts_and_open_says_nothing(other_user, other_python):
    run, _ = _run_as_user_without_root(other_python, "closed")
    assert run.returncode == 4, run.stdout[-2000:] + run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("tfcluster: error:")]
    assert errors == [f"tfcluster: error: tf_ports: closed, but tfcluster cannot close TensorFlow's ports on "
                      f"host mybox (tfcluster runs as {other_user.name} there, not root, and `sudo -n nft` is "
                      f"not allowed)"], run.stderr
    assert "hello from the script" not in run.stdout
    run, _ = _run_as_user_without_root(other_python, "open")
    assert run.returncode == 0 and "TensorFlow's ports" not in run.stderr, run.stderr


def test_a_refused_reachability_check_names_the_rules_as_a_cause_unless_tf_ports_is_open(tmp_path):
    from tfcluster.launch.cluster.reach import Failure, _error

    refused = [Failure("gpu2", "ps:0", "10.0.0.1:2222", "connection refused")]
    hint = _error(refused, _plan(tmp_path)).hint
    assert ("tfcluster's own rules on gpu1 (tf_ports) let in only the spec's host addresses: gpu2 may connect "
            "from another one") in hint
    assert "tf_ports" not in _error(refused, _plan(tmp_path, "open")).hint
