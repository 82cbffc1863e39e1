"""Start-up progress names the servers still awaited, not only a count."""
from __future__ import annotations

import io
import sys
from types import SimpleNamespace

from tests.helpers import wait_for
from tfcluster.launch.cluster import servers
from tfcluster.plan import build_plan
from tfcluster.spec import load_spec
from tfcluster.ui import UI


def _session(tmp_path, workers: int):
    tasks = ", ".join(f"'local:{30000 + i}'" for i in range(workers))
    spec = tmp_path / "p.yaml"
    spec.write_text("name: p\nhosts:\n  - {name: local, address: 127.0.0.1}\n"
                    f"jobs:\n  ps: {{tasks: ['local:29999']}}\n  worker: {{tasks: [{tasks}]}}\n")
    err = io.StringIO()
    return SimpleNamespace(ui=UI(io.StringIO(), err, color=False),
                           plan=build_plan(load_spec(str(spec)), local_python=sys.executable)), err


def test_each_ready_line_names_the_servers_still_awaited(tmp_path):
    session, err = _session(tmp_path, 6)
    keys = [t.key for t in session.plan.tasks]
    progress = servers._Progress(session, keys)
    try:
        progress.ready("worker:2")
        progress.ready("ps:0")
        for key in keys[1:]:
            progress.ready(key)
    finally:
        progress.close()
    lines = err.getvalue().splitlines()
    assert "1/7; waiting for ps:0, worker:0, worker:1, worker:3 (+2 more))" in lines[0]
    assert "2/7; waiting for worker:0, worker:1, worker:3, worker:4 (+1 more))" in lines[1]
    assert lines[-1].endswith("7/7)") and "waiting" not in lines[-1]
    assert "ready on 127.0.0.1:30002" in lines[0]


def test_a_quiet_start_says_what_it_still_waits_for(tmp_path, monkeypatch):
    monkeypatch.setattr(servers._Progress, "TICK", 0.0)
    session, err = _session(tmp_path, 2)
    progress = servers._Progress(session, ["ps:0", "worker:1"])
    try:
        wait_for(lambda: "still waiting for ps:0, worker:1" in err.getvalue(), timeout=10,
                 what="a still-waiting line")
    finally:
        progress.close()
