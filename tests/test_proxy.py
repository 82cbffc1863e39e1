"""The proxy guard: gRPC between TF tasks through a dead proxy hangs, for
real; the guard's no_proxy ends it; `plan --check` shows what the tasks get."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import cli_env, local_spec, only_run, tagged_processes
from tests.tf_launch import TEMPLATES, HandLaunch, make_cluster, port_of, wait_port
from tfcluster.host import shim_net, shim_tasks

pytestmark = [pytest.mark.timeout(240)]

# A TF1 client of one server: an op on the server, bounded by operation_timeout_in_ms.
CLIENT = (
    "import os, tensorflow as tf\n"
    "tf.compat.v1.disable_eager_execution()\n"
    "with tf.device('/job:worker/task:0'):\n"
    "    x = tf.constant(3) + 1\n"
    "config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=4000)\n"
    "with tf.compat.v1.Session(os.environ['MASTER'], config=config) as sess:\n"
    "    try:\n"
    "        print('result', sess.run(x), flush=True)\n"
    "    except tf.errors.OpError as e:\n"
    "        print('error', type(e).__name__, flush=True)\n"
)


@pytest.fixture
def dead_proxy():
    """http://127.0.0.1:PORT where nothing listens (the port stays bound, never listening)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


def run_cli(*args, home, cwd, env_extra: dict, timeout: float = 200):
    env = {k: v for k, v in cli_env(home).items() if k.lower() not in shim_net.PROXY_VARS
           and k.lower() not in ("no_proxy", "no_grpc_proxy")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "tfcluster", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


# ------------------------------------------------------------------ the rule itself

def test_guard_extends_no_proxy_only_when_a_proxy_is_set():
    hosts = ["gpu-a", "10.0.0.2", "gpu-a"]
    assert shim_net.guard_env({"PATH": "/bin"}, hosts) == {}
    assert shim_net.guard_env({"https_proxy": " "}, hosts) == {}        # empty: no proxy
    assert shim_net.guard_env({"HTTPS_PROXY": "http://p:3128"}, []) == {}
    assert shim_net.guard_env({"HTTPS_PROXY": "http://p:3128", "no_proxy": ".corp, GPU-A"}, hosts) == {
        "no_proxy": ".corp,GPU-A,10.0.0.2", "NO_PROXY": "gpu-a,10.0.0.2"}
    # gRPC reads no_grpc_proxy instead of no_proxy when it is set: it is extended too.
    assert shim_net.guard_env({"grpc_proxy": "http://p:1", "no_grpc_proxy": ""}, ["h"]) == {
        "no_proxy": "h", "NO_PROXY": "h", "no_grpc_proxy": "h"}
    assert shim_net.proxies_set({"ALL_PROXY": "socks5://p", "http_proxy": "x", "no_proxy": "y"}) == [
        "ALL_PROXY", "http_proxy"]


def test_info_reports_proxy_variables_with_credentials_masked():
    assert shim_net.proxy_report({"https_proxy": "http://bob:s3cret@proxy:3128", "no_proxy": "a,b",
                                  "PATH": "/bin", "HTTP_PROXY": "http://proxy:80"}) == {
        "https_proxy": "http://***@proxy:3128", "no_proxy": "a,b", "HTTP_PROXY": "http://proxy:80"}


def test_shim_spawn_gives_the_task_the_extended_no_proxy(tmp_path, monkeypatch):
    """The effective environment is the host's plus the request's: the spec's env may set the
    proxy itself, and the host's no_proxy entries are kept."""
    monkeypatch.setenv("no_proxy", "internal.example")
    monkeypatch.delenv("NO_PROXY", raising=False)
    log = tmp_path / "task.log"
    req = {"tag": "proxytest:r:worker:0:script", "log": str(log), "pidfile": str(tmp_path / "t.pid"),
           "cwd": str(tmp_path), "env": {"HTTPS_PROXY": "http://127.0.0.1:9"},
           "argv": [sys.executable, "-c", "import os; print(os.environ['no_proxy'], os.environ['NO_PROXY'])"],
           "no_proxy": ["gpu-a", "10.0.0.2"]}
    proc, _, _ = shim_tasks.spawn(req)
    assert proc.wait(30) == 0
    assert log.read_text().split() == ["internal.example,gpu-a,10.0.0.2", "gpu-a,10.0.0.2"]
    req.update(env={}, tag="proxytest:r:worker:1:script")     # no proxy anywhere: untouched
    req["argv"][-1] = "import os; print(os.environ.get('NO_PROXY'))"
    proc, _, _ = shim_tasks.spawn(req)
    assert proc.wait(30) == 0
    assert log.read_text().split()[-1] == "None"


# ------------------------------------------------------------------ the hang, for real

@pytest.mark.tf
def test_grpc_to_a_tf_server_through_a_dead_proxy_fails_and_no_proxy_fixes_it(tmp_path, dead_proxy):
    """No tfcluster: a TF server on loopback and two clients, one with https_proxy pointing at
    a closed port (its session never reaches the server: the op hits its deadline, without a
    deadline it would wait forever), one with the guard's no_proxy as well."""
    cluster = make_cluster(ps=0, worker=1)
    with HandLaunch(tmp_path / "logs", tag="proxytest:hang") as launch:
        server = launch.start_server(cluster, "worker", 0)
        wait_port(port_of(cluster["worker"][0]), 120, proc=server)
        base = {**os.environ, "MASTER": f"grpc://{cluster['worker'][0]}", "TF_CPP_MIN_LOG_LEVEL": "2",
                "https_proxy": dead_proxy}
        for name in ("no_proxy", "NO_PROXY", "no_grpc_proxy"):
            base.pop(name, None)
        guarded = {**base, **shim_net.guard_env(base, ["127.0.0.1"])}
        assert guarded["no_proxy"] == "127.0.0.1"
        proxied = launch.start("client-proxied", [sys.executable, "-c", CLIENT], base)
        fixed = launch.start("client-guarded", [sys.executable, "-c", CLIENT], guarded)
        assert launch.wait_all([proxied, fixed], timeout=150) == [0, 0]
        assert "error DeadlineExceededError" in proxied.output(), proxied.output()[-2000:]
        assert "result 4" in fixed.output(), fixed.output()[-2000:]


def wrapper(tmp_path) -> str:
    """The between-graph template, after printing the proxy variables it was given."""
    path = tmp_path / "wrapped.py"
    template = TEMPLATES / "between_graph.py"
    path.write_text(
        "import json, os, runpy, sys\n"
        "print('proxy-env', json.dumps({k: os.environ.get(k) for k in "
        "('https_proxy', 'no_proxy', 'NO_PROXY')}), flush=True)\n"
        f"sys.argv[0] = {str(template)!r}\n"
        f"runpy.run_path({str(template)!r}, run_name='__main__')\n")
    return str(path)


@pytest.mark.tf
def test_train_with_a_dead_proxy_in_the_environment_succeeds_with_the_guard(tmp_path, home, dead_proxy):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = local_spec(tmp_path, script=wrapper(tmp_path), args=["--steps", "30", "--log_every", "10"],
                      name="proxied")
    check = run_cli("plan", str(spec), "--check", home=home, cwd=cwd, env_extra={"https_proxy": dead_proxy})
    assert check.returncode == 0, check.stderr[-2000:]
    assert "✓ local: https_proxy set for its tasks; proxy guard gives them no_proxy=127.0.0.1 " \
           "NO_PROXY=127.0.0.1" in check.stderr
    result = run_cli("train", str(spec), home=home, cwd=cwd, env_extra={"https_proxy": dead_proxy})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = (only_run(cwd / "runs") / "worker-1.log").read_text()
    seen = json.loads(log.split("proxy-env ", 1)[1].splitlines()[0])
    assert seen == {"https_proxy": dead_proxy, "no_proxy": "127.0.0.1", "NO_PROXY": "127.0.0.1"}
    assert "tfcluster-result: global_step=30" in log
    assert not tagged_processes()


@pytest.mark.tf
def test_without_the_guard_the_same_run_hangs_until_its_timeout(tmp_path, home, dead_proxy):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = local_spec(tmp_path, script=wrapper(tmp_path), args=["--steps", "30", "--log_every", "10"],
                      name="unguarded", extra="  checks: {proxy_guard: false}\n  timeout: 30\n")
    check = run_cli("plan", str(spec), "--check", home=home, cwd=cwd, env_extra={"https_proxy": dead_proxy})
    assert "local: https_proxy set for its tasks and train.checks.proxy_guard is off" in check.stderr
    result = run_cli("train", str(spec), home=home, cwd=cwd, env_extra={"https_proxy": dead_proxy})
    assert result.returncode == 6, result.stdout[-3000:] + result.stderr[-3000:]
    assert "hit its timeout (30s)" in result.stderr
    log = (only_run(cwd / "runs") / "worker-1.log").read_text()
    assert json.loads(log.split("proxy-env ", 1)[1].splitlines()[0])["no_proxy"] is None
    assert "step=" not in log and "tfcluster-result" not in log   # not one step went through
    assert not tagged_processes()
