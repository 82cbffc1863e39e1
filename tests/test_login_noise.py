"""A host whose login shell prints on stdout (a banner in ~/.bashrc) before tfcluster's
shim runs: every reader of the shim's JSON lines skips what is not one. `train` failed
there with "JSONDecodeError: Expecting value" (the servers' launch stream), and so did
`plan --check` (reachability). The host here is local, its `python:` a wrapper that
prints the banner first, as such a login shell would."""
from __future__ import annotations

import sys
import textwrap

import pytest

from tests.helpers import (
    CLUSTER_DIR,
    C,
    free_port,
    launch,
    noisy_python,
    tagged_processes,
    tfcluster,
    with_tag,
)
from tfcluster.launch.agent.agent import HostAgent
from tfcluster.transport.local import LocalTransport

pytestmark = pytest.mark.timeout(90)

LISTENER = textwrap.dedent("""
    import socket, sys, time
    s = socket.create_server(("127.0.0.1", int(sys.argv[1])))
    time.sleep(600)
""")


def test_the_launch_stream_skips_a_banner_before_the_shims_lines(home, tmp_path):
    a = HostAgent("local", LocalTransport(), str(noisy_python(tmp_path)), CLUSTER_DIR)
    port = free_port()
    try:
        a.prepare()
        t = launch(a, f"{C}:n1:ps:0:server", [sys.executable, "-c", LISTENER, str(port)])
        states = [state for _key, state, _ in a.launch([("ps:0", port, t)], 20)]
        assert states == ["started", "ready"]
    finally:
        a.stop(f"{C}:n1:", grace=0.5)
        a.close()
    assert with_tag(f"{C}:n1:") == {}


def test_plan_check_passes_on_a_host_whose_login_shell_prints(tmp_path, home):
    ports = [free_port(), free_port()]
    spec = tmp_path / "noisy.yaml"
    spec.write_text(f"name: noisy\npython: {noisy_python(tmp_path)}\nhosts:\n  - {{name: local, "
                    f"address: 127.0.0.1}}\njobs:\n  ps: {{tasks: [\"local:{ports[0]}\"]}}\n"
                    f"  worker: {{tasks: [\"local:{ports[1]}\"]}}\ntrain:\n  mode: between-graph\n"
                    f"  script: template:between_graph\n")
    result = tfcluster("plan", str(spec), "--check", home=home, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "reachability" in result.stderr.lower(), result.stderr
    assert not tagged_processes()
