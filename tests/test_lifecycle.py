"""`up` / `status` / `down` / `exec` against real hosts: local processes and a real OpenSSH
sshd on 127.0.0.2-4 (tests/sshd.py), with real TF servers."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
from pathlib import Path

import psutil
import pytest

from tests.helpers import (
    bindable,
    kill_group,
    local_spec,
    read_until,
    ssh_spec,
    start_tfcluster,
    state_path,
    tagged_processes,
    tfcluster,
    wait_for,
)
from tests.tf_launch import free_ports

pytestmark = [pytest.mark.timeout(240)]


def ports_of(spec: Path) -> list[int]:
    from tfcluster.plan import build_plan
    from tfcluster.spec import load_spec

    return [t.port for t in build_plan(load_spec(str(spec))).tasks]


@pytest.fixture
def cwd(tmp_path):
    d = tmp_path / "cwd"
    d.mkdir()
    return d


def _up_status_down(spec: Path, home: Path, cwd: Path) -> None:
    up = tfcluster("up", str(spec), home=home, cwd=cwd)
    assert up.returncode == 0, up.stderr
    assert "is up" in up.stderr
    assert "1/3; waiting for " in up.stderr and ", 3/3)" in up.stderr  # names, not only counts
    status = tfcluster("status", str(spec), "--json", home=home, cwd=cwd)
    rows = json.loads(status.stdout)["tasks"]
    assert [(r["task"], r["status"], r["port_open"]) for r in rows] == [
        ("ps:0", "running", True), ("worker:0", "running", True), ("worker:1", "running", True)]
    again = tfcluster("up", str(spec), home=home, cwd=cwd)
    assert again.returncode == 0 and "already up" in again.stderr
    down = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert down.returncode == 0, down.stderr
    assert all(bindable(p) for p in ports_of(spec))
    assert not tagged_processes()
    twice = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert twice.returncode == 0 and "nothing running" in twice.stderr


@pytest.mark.tf
def test_up_status_down_over_ssh_on_three_loopback_hosts(tmp_path, home, ssh_home, sshd, cwd):
    _up_status_down(ssh_spec(tmp_path, sshd), home, cwd)


@pytest.mark.tf
def test_up_status_down_with_local_processes(tmp_path, home, cwd):
    _up_status_down(local_spec(tmp_path), home, cwd)


@pytest.mark.tf
def test_down_works_after_local_state_is_deleted(tmp_path, home, ssh_home, sshd, cwd):
    spec = ssh_spec(tmp_path, sshd)
    assert tfcluster("up", str(spec), home=home, cwd=cwd).returncode == 0
    state = state_path(home, spec)
    assert state.exists() and oct(state.stat().st_mode & 0o777) == "0o600"
    state.unlink()
    down = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert down.returncode == 0, down.stderr
    # 127.0.0.x "hosts" are one machine: whichever host's stop runs first sweeps all three.
    stopped = [int(w) for w in down.stderr.split() if w.isdigit()]
    assert sum(stopped) == 3, down.stderr
    assert not tagged_processes()


@pytest.mark.tf
def test_status_finds_running_tasks_whose_host_directory_was_removed(tmp_path, home, cwd):
    """The pid files live in the cluster's directory on the host; with it gone, `status`
    finds the tasks by their tag (as `down` does), says they run without pid files, and
    `down` stops them."""
    import shutil

    from tfcluster.plan import build_plan
    from tfcluster.spec import load_spec

    spec = local_spec(tmp_path, name="gone")
    assert tfcluster("up", str(spec), home=home, cwd=cwd).returncode == 0
    cluster_dir = build_plan(load_spec(str(spec))).cluster_dir.replace("~", str(home), 1)
    assert list(Path(cluster_dir).rglob("*.pid")), cluster_dir
    shutil.rmtree(cluster_dir)
    try:
        status = tfcluster("status", str(spec), "--json", home=home, cwd=cwd)
        assert status.returncode == 0, status.stderr
        rows = json.loads(status.stdout)["tasks"]
        pids = set(tagged_processes())
        assert [(r["task"], r["status"], r["pid_file"]) for r in rows] == [
            ("ps:0", "running", False), ("worker:0", "running", False), ("worker:1", "running", False)]
        assert {r["pid"] for r in rows} <= pids and len({r["pid"] for r in rows}) == 3
        text = tfcluster("status", str(spec), home=home, cwd=cwd)
        assert "3/3 tasks running" in text.stderr, text.stderr
        assert "local: ps:0, worker:0, worker:1 of cluster 'gone' run with no pid file" in text.stderr
    finally:
        down = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert down.returncode == 0, down.stderr
    assert not tagged_processes()
    after = json.loads(tfcluster("status", str(spec), "--json", home=home, cwd=cwd).stdout)["tasks"]
    assert [(r["status"], r["pid_file"]) for r in after] == [("stopped", None)] * 3


@pytest.mark.tf
def test_status_during_a_train_without_up_shows_each_servers_own_pid_and_uptime(tmp_path, home, cwd):
    """A worker runs a TF server and a script, both tagged as the task: its row's port is the
    server's, so its pid and uptime are the server's too, not the script's."""
    flag = tmp_path / "flag"
    script = tmp_path / "wait.py"
    script.write_text("import os, time\nd = time.monotonic() + 200\n"
                      f"while not os.path.exists({str(flag)!r}) and time.monotonic() < d:\n    time.sleep(0.05)\n"
                      "print('waited', flush=True)\n")
    spec = local_spec(tmp_path, name="during", script=str(script), workers=1)
    train = start_tfcluster("train", str(spec), home=home, cwd=cwd)
    try:
        assert wait_for(lambda: any(t.endswith(":worker:0:script") for t in tagged_processes().values()),
                        timeout=120), "the worker's script never started"
        status = tfcluster("status", str(spec), "--json", home=home, cwd=cwd)
        assert status.returncode == 0, status.stderr
        rows = {r["task"]: r for r in json.loads(status.stdout)["tasks"]}
        tags = tagged_processes()
        for key, job in (("ps:0", "ps"), ("worker:0", "worker")):
            row = rows[key]
            assert row["status"] == "running" and row["port_open"], row
            assert tags[row["pid"]].endswith(f":{job}:0:server"), (row, tags)
        flag.touch()
        out, _ = train.communicate(timeout=120)
        assert train.returncode == 0, out[-2000:]
    finally:
        flag.touch()
        kill_group(train)
    assert wait_for(lambda: not tagged_processes(), timeout=30)


@pytest.mark.tf
def test_status_says_when_the_spec_changed_since_up(tmp_path, home, cwd):
    """The spec edited while the cluster runs (same name): a server moved to another port
    and a worker removed. `status` matched the old processes to the new tasks by key and
    said nothing; it now names the moved port and the task the spec no longer has."""

    spec = local_spec(tmp_path, name="edited")
    assert tfcluster("up", str(spec), home=home, cwd=cwd).returncode == 0
    try:
        text = spec.read_text()
        ports = re.findall(r'"local:(\d+)"', text)          # ps:0, worker:0, worker:1
        new_port = str(free_ports(1)[0])
        spec.write_text(text.replace(f'"local:{ports[1]}", "local:{ports[2]}"', f'"local:{new_port}"'))
        status = tfcluster("status", str(spec), "--json", home=home, cwd=cwd)
        assert status.returncode == 0, status.stderr
        rows = {r["task"]: r for r in json.loads(status.stdout)["tasks"]}
        assert (rows["worker:0"]["status"], rows["worker:0"]["started_port"]) == ("running", int(ports[1]))
        assert (rows["ps:0"]["started_port"], rows["ps:0"]["in_spec"]) == (None, True)
        assert (rows["worker:1"]["in_spec"], rows["worker:1"]["address"]) == (False, f"127.0.0.1:{ports[2]}")
        shown = tfcluster("status", str(spec), home=home, cwd=cwd)
        assert "2/2 tasks running" in shown.stderr, shown.stderr
        assert (f"local: worker:0 runs on port {ports[1]}, not the spec's 127.0.0.1:{new_port} "
                "(the spec changed since these were started)") in shown.stderr
        assert ("local: worker:1 of cluster 'edited' runs but the spec has no such task there "
                f"(the spec changed since these were started); `tfcluster down {spec}` stops it") in shown.stderr
    finally:
        down = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert down.returncode == 0, down.stderr
    assert not tagged_processes()


@pytest.mark.tf
def test_sigkill_of_tfcluster_during_up_leaves_nothing_once_down_runs(tmp_path, home, ssh_home, sshd, cwd):
    spec = ssh_spec(tmp_path, sshd)
    proc = start_tfcluster("up", str(spec), home=home, cwd=cwd)
    try:
        read_until(proc, r"Starting 3 server", timeout=60)
        wait_for(lambda: len(tagged_processes()) >= 3, timeout=30, what="servers spawned")
    finally:
        kill_group(proc)
    down = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert down.returncode == 0, down.stderr
    assert not tagged_processes()
    assert all(bindable(p) for p in ports_of(spec))


def test_second_concurrent_up_refuses_with_exit_7(tmp_path, home, ssh_home, sshd, cwd):
    spec = ssh_spec(tmp_path, sshd)
    first = start_tfcluster("up", str(spec), home=home, cwd=cwd)
    try:
        read_until(first, r"Connecting", timeout=30)
        second = tfcluster("up", str(spec), home=home, cwd=cwd)
        assert second.returncode == 7, second.stderr
        assert "busy" in second.stderr and "tfcluster up" in second.stderr
    finally:
        kill_group(first)
        tfcluster("down", str(spec), home=home, cwd=cwd)


def test_busy_port_is_named_and_nothing_is_started(tmp_path, home, ssh_home, sshd, cwd):
    spec = ssh_spec(tmp_path, sshd)
    holder = socket.socket()
    holder.bind(("0.0.0.0", ports_of(spec)[2]))
    holder.listen()
    try:
        up = tfcluster("up", str(spec), home=home, cwd=cwd)
    finally:
        holder.close()
    assert up.returncode == 4, up.stderr
    line = up.stderr.strip().splitlines()[-2 if "hint:" in up.stderr else -1]
    assert line.startswith(f"tfcluster: error: host h4: port {ports_of(spec)[2]} for worker:1 is already in use")
    assert not tagged_processes()


def test_auth_failure_and_closed_port_give_one_line_naming_the_host(tmp_path, home, ssh_home, sshd, cwd):
    wrong = tmp_path / "wrong_key"
    os.system(f"ssh-keygen -q -t ed25519 -N '' -f {wrong} >/dev/null")
    spec = ssh_spec(tmp_path, sshd, ssh_extra=f"  identity_file: {wrong}\n", name="auth")
    result = tfcluster("up", str(spec), home=home, cwd=cwd)
    assert result.returncode == 3, result.stderr
    assert "tfcluster: error: host h2 (127.0.0.2:" in result.stderr and "authentication failed" in result.stderr
    closed = ssh_spec(tmp_path, sshd, name="closed")
    text = closed.read_text().replace(f"port: {sshd.port}", f"port: {free_ports(1)[0]}")
    closed.write_text(text)
    result = tfcluster("status", str(closed), home=home, cwd=cwd)
    assert "unreachable" in result.stdout
    assert result.returncode == 3, result.stderr   # the table, then the host named, exit 3
    assert "tfcluster: error: host h2 (127.0.0.2:" in result.stderr and "also unreachable: h3, h4" in result.stderr
    result = tfcluster("up", str(closed), home=home, cwd=cwd)
    assert result.returncode == 3 and "connection refused" in result.stderr.lower()
    assert "Traceback" not in result.stderr
    assert not tagged_processes()


def test_unknown_host_key_is_rejected_unless_accept_new(tmp_path, home, ssh_home, sshd, cwd):
    (ssh_home / "known_hosts").unlink()
    spec = ssh_spec(tmp_path, sshd, name="keys")
    result = tfcluster("exec", str(spec), "--", "true", home=home, cwd=cwd)
    assert result.returncode == 3
    assert "unknown host key" in result.stderr and "ssh-keyscan" in result.stderr
    checked = tfcluster("plan", str(spec), "--check", home=home, cwd=cwd)     # every host's key, one line
    assert checked.returncode == 3 and "unknown host key" in checked.stderr, checked.stderr
    assert (f"hint: run `ssh-keyscan -p {sshd.port} 127.0.0.2 127.0.0.3 127.0.0.4 >> ~/.ssh/known_hosts` after "
            "checking the fingerprints (3 hosts)") in checked.stderr, checked.stderr
    spec = ssh_spec(tmp_path, sshd, name="keys2", ssh_extra="  host_key_policy: accept-new\n")
    result = tfcluster("exec", str(spec), "--", "true", home=home, cwd=cwd)
    assert result.returncode == 0, result.stderr
    known = ssh_home / "known_hosts"
    assert known.read_text().count("ssh-ed25519") == 3
    assert oct(known.stat().st_mode & 0o777) == "0o600"


def test_exec_prefixes_output_per_host_and_returns_the_worst_exit_code(tmp_path, home, ssh_home, sshd, cwd):
    spec = ssh_spec(tmp_path, sshd, name="execs")
    result = tfcluster("exec", str(spec), "--", "sh", "-c", "echo out-$((40+2)); echo err >&2",
                       home=home, cwd=cwd)
    assert result.returncode == 0, result.stderr
    for host in ("h2", "h3", "h4"):
        assert f"{host} │ out-42" in result.stdout and f"{host} │ err" in result.stdout
    result = tfcluster("exec", str(spec), "--hosts", "h3,h4", "--", "sh", "-c",
                       'test "$(hostname -I 2>/dev/null; echo)" && exit 3', home=home, cwd=cwd)
    assert result.returncode == 3
    assert "h2" not in result.stdout


def test_exec_interrupted_stops_the_command_on_every_ssh_host(tmp_path, home, ssh_home, sshd, cwd):
    """Ctrl-C while `exec` runs a long command over SSH: exit 130, and on each host the command
    and its child are gone (sshd sends a command without a terminal no signal when its channel
    closes: the wrapper's watcher sees its stdin end and stops the command's group)."""
    marker = f"{tmp_path}/ssh-exec-marker"
    command = ["sh", "-c", "echo started; sleep 1000; :", marker]
    spec = ssh_spec(tmp_path, sshd, name="execint")
    proc = start_tfcluster("exec", str(spec), "--", *command, home=home, cwd=cwd)

    def running() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == command]

    try:
        seen: set[str] = set()
        while len(seen) < 3:      # the hosts answer in any order
            seen.add(read_until(proc, r"(h2|h3|h4) │ started", timeout=60)[-1].split()[0])
        def settled() -> bool:      # three commands, each with its sleep exec'd (a fork has their words)
            try:
                return len(running()) == 3 and all([c.name() for c in p.children()] == ["sleep"] for p in running())
            except psutil.Error:
                return False

        wait_for(settled, timeout=10, what="the command running on the three hosts, their sleeps too")
        started = running()
        started += [child for p in started for child in p.children()]
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=30)
    finally:
        kill_group(proc)
    assert proc.returncode == 130
    assert len(started) == 6, started
    wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in started),
             timeout=10, what="the command and its child stopped on every host")


def test_env_values_arrive_byte_for_byte_and_run_nothing(tmp_path, home, ssh_home, sshd, cwd):
    canary = tmp_path / "canary"
    out = tmp_path / "seen"
    out.mkdir()
    evil = f"$(touch {canary}) `touch {canary}` ' \" ; touch {canary} | & > <"
    script = tmp_path / "dump.py"
    script.write_text("import os, sys\n"
                      f"open(os.path.join({str(out)!r}, os.environ['TFCLUSTER_TASK_INDEX']), 'w')"
                      ".write(os.environ['EVIL'])\n")
    spec = ssh_spec(tmp_path, sshd, name="canary", env=f"env:\n  EVIL: {json.dumps(evil)}\n",
                    train=f"train:\n  mode: mirrored\n  script: {script}\n")
    text = spec.read_text().replace("  ps: {tasks: ['h2:", "  # ps: {tasks: ['h2:")
    spec.write_text(text)
    result = tfcluster("train", str(spec), home=home, cwd=cwd)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert sorted(os.listdir(out)) == ["0", "1"]
    for name in ("0", "1"):
        assert (out / name).read_text() == evil
    assert not canary.exists()
    plan = tfcluster("plan", str(spec), "--commands", home=home, cwd=cwd)
    assert not canary.exists() and plan.returncode == 0


@pytest.mark.tf
def test_down_with_one_host_unreachable_stops_the_rest_names_it_and_exits_nonzero(
        tmp_path, home, ssh_home, sshd, cwd):
    spec = ssh_spec(tmp_path, sshd, name="part")
    assert tfcluster("up", str(spec), home=home, cwd=cwd).returncode == 0
    closed = free_ports(1)[0]
    broken = tmp_path / "part-broken.yaml"
    broken.write_text(spec.read_text().replace(
        "{name: h4, address: 127.0.0.4}", f"{{name: h4, address: 127.0.0.4, ssh: {{port: {closed}}}}}"))
    down = tfcluster("down", str(broken), home=home, cwd=cwd)
    assert down.returncode == 1, down.stderr
    assert f"(unreachable: h4 (127.0.0.4:{closed}): connection refused" in down.stderr   # named once
    assert "host h4" not in down.stderr
    # 127.0.0.x hosts are one machine, so h2's and h3's sweeps already took h4's server too.
    assert not tagged_processes()
    assert tfcluster("down", str(spec), home=home, cwd=cwd).returncode == 0


def test_logs_shows_a_saved_run_prefixed_and_filters_by_task(tmp_path, home, cwd):
    script = tmp_path / "hello.py"
    # and a C++ INFO line, as TensorFlow prints them at start-up (TF_CPP_MIN_LOG_LEVEL=0)
    noise = "I0000 00:00:1764000000.000000   12345 cpu_feature_guard.cc:227] This TensorFlow binary is optimized"
    script.write_text("import os, sys\nprint('hello from', os.environ['TFCLUSTER_JOB'], os.environ['TFCLUSTER_TASK_INDEX'])\n"
                      f"print({noise!r}, file=sys.stderr)\n")
    spec = local_spec(tmp_path, mode="mirrored", script=str(script), ps=0, name="logsc")
    assert tfcluster("train", str(spec), home=home, cwd=cwd).returncode == 0
    shown = tfcluster("logs", str(spec), home=home, cwd=cwd)
    assert shown.returncode == 0, shown.stderr
    assert "worker:0 │ hello from worker 0" in shown.stdout and "worker:1 │ hello from worker 1" in shown.stdout
    assert "cpu_feature_guard" not in shown.stdout                    # left out, as the live view does
    everything = tfcluster("logs", str(spec), "-v", home=home, cwd=cwd)
    assert f"worker:1 │ {noise}" in everything.stdout, everything.stdout
    one = tfcluster("logs", str(spec), "worker:1", home=home, cwd=cwd)
    assert "worker:1 │ hello from worker 1" in one.stdout and "worker:0" not in one.stdout
    bad = tfcluster("logs", str(spec), "worker:7", home=home, cwd=cwd)
    assert bad.returncode == 2 and "has no log for worker:7" in bad.stderr
    typo = tfcluster("logs", str(spec), "wroker:1", home=home, cwd=cwd)
    assert typo.returncode == 2 and "did you mean 'worker:1'?" in typo.stderr, typo.stderr


def test_plan_check_runs_live_preflight_and_starts_nothing(tmp_path, home, ssh_home, sshd, cwd):
    spec = ssh_spec(tmp_path, sshd, name="chk")
    ok = tfcluster("plan", str(spec), "--check", home=home, cwd=cwd)
    assert ok.returncode == 0, ok.stderr
    h3 = [re.split(r"\s{2,}", line) for line in ok.stderr.splitlines() if line.startswith("h3 ")]  # the version table
    assert len(h3) == 1 and any(c.startswith("3.") for c in h3[0]) and any(c.startswith("2.") for c in h3[0]), ok.stderr
    assert "preflight passed" in ok.stderr
    holder = socket.socket()
    holder.bind(("0.0.0.0", ports_of(spec)[0]))
    holder.listen()
    try:
        busy = tfcluster("plan", str(spec), "--check", home=home, cwd=cwd)
    finally:
        holder.close()
    assert busy.returncode == 4 and f"port {ports_of(spec)[0]} for ps:0 is already in use" in busy.stderr
    assert not tagged_processes()


@pytest.mark.tf
def test_up_and_down_through_a_jump_host_named_in_the_spec(tmp_path, home, ssh_home, sshd, jump_sshd, cwd):
    jump_sshd.write_known_hosts(ssh_home / "known_hosts", mode="a")
    spec = ssh_spec(tmp_path, sshd, name="viajump", ssh_extra=f"  jump_host: 127.0.0.5:{jump_sshd.port}\n")
    up = tfcluster("up", str(spec), home=home, cwd=cwd)
    assert up.returncode == 0, up.stderr
    down = tfcluster("down", str(spec), home=home, cwd=cwd)
    assert down.returncode == 0, down.stderr
    assert not tagged_processes()
    # the jump host is checked like any host: unknown to known_hosts -> refused, named
    (ssh_home / "known_hosts").write_text("".join(
        line + "\n" for line in (ssh_home / "known_hosts").read_text().splitlines() if "127.0.0.5" not in line))
    refused = tfcluster("exec", str(spec), "--", "true", home=home, cwd=cwd)
    assert refused.returncode == 3 and "jump host" in refused.stderr and "unknown host key" in refused.stderr
