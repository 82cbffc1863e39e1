"""The notice watchers on a host (tfcluster/host/shim_notice.py), each against a fake of its
cloud's metadata service that follows that cloud's documentation (tests/metadata_fakes.py
names the pages: AWS "Spot Instance interruption notices" and "Use IMDSv2"; GCE "Detect if a
VM was preempted" and "wait for change"; Azure "Scheduled Events for Linux VMs"). The real
shim runs its `notice` stream as a launcher runs it (`python -S shim.py notice`, one request
line), on loopback; no TensorFlow."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests.metadata_fakes import serve
from tfcluster.host import HOST_DIR

pytestmark = pytest.mark.timeout(60)


class NoticeStream:
    """`shim.py notice` with its request; its stdout's JSON lines, read with a deadline."""

    def __init__(self, request: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-S", os.path.join(HOST_DIR, "shim.py"), "notice"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.send(request)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def send(self, obj: dict) -> None:
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def next(self, timeout: float = 10.0, skip=("warning",)) -> dict | None:
        end = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.01, end - time.monotonic()))
            if line is None or not any(k in line for k in skip):
                return line

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.stdin.close()
        try:
            return self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def fake():
    server = serve("127.0.0.1", 0, first_call_delay=1.0)
    server.url = f"http://127.0.0.1:{server.server_address[1]}"

    def control(what: str, **body) -> dict:
        data = json.dumps(body).encode()
        with urllib.request.urlopen(urllib.request.Request(server.url + "/_fake/" + what, data=data), timeout=5) as r:
            return json.loads(r.read())
    server.control = control
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def stream():
    made: list[NoticeStream] = []

    def start(**request) -> NoticeStream:
        made.append(NoticeStream(request))
        return made[-1]
    yield start
    for s in made:
        s.close()


def test_aws_imdsv2_token_then_instance_action_two_minutes_ahead(fake, stream):
    s = stream(watch="auto", url=fake.url, every=0.2)
    assert s.next() == {"watching": "aws", "how": "aws spot"}
    fake.control("aws/action", action="terminate", **{"in": 120})
    notice = s.next()["notice"]
    assert notice["source"] == "aws" and notice["kind"] == "terminate", notice
    assert abs(notice["deadline"] - (time.time() + 120)) < 3, notice
    asked = fake.control("log")["asked"]
    # IMDSv2: a token first, and no GET without it (the fake answers 401 to one)
    assert asked[0] == ["PUT", "/latest/api/token"] or ["PUT", "/latest/api/token"] in asked
    assert ["GET", "/latest/meta-data/spot/instance-action"] in asked
    fake.control("aws/rebalance")
    assert s.next()["notice"]["kind"] == "rebalance"
    s.close()
    assert s.lines.get(timeout=5) is None        # each notice said once, then EOF ends it


def test_gce_preempted_is_said_as_soon_as_the_value_changes(fake, stream):
    s = stream(watch="gce", url=fake.url)
    assert s.next() == {"watching": "gce", "how": "gce spot"}
    asked_at = time.monotonic()
    fake.control("gce/set", key="preempted", value="TRUE")
    notice = s.next(timeout=5)["notice"]
    assert time.monotonic() - asked_at < 2.0        # a hanging GET, not a poll
    assert notice["source"] == "gce" and notice["kind"] == "preempted"
    assert 25 < notice["deadline"] - time.time() <= 30
    fake.control("gce/set", key="maintenance-event", value="TERMINATE_ON_HOST_MAINTENANCE")
    assert s.next(timeout=5)["notice"]["kind"] == "TERMINATE_ON_HOST_MAINTENANCE"


def test_azure_preempt_acknowledged_and_a_withdrawn_event_said(fake, stream):
    s = stream(watch="azure", url=fake.url, every=0.2)
    assert s.next() == {"watching": "azure", "how": "azure spot"}
    fake.control("azure/event", id="E-PREEMPT", type="Preempt", **{"in": 30})
    notice = s.next(timeout=10)["notice"]       # the first call waited a second (the fake's start)
    assert (notice["source"], notice["kind"], notice["id"], notice["status"]) == \
        ("azure", "Preempt", "E-PREEMPT", "Scheduled")
    assert abs(notice["deadline"] - (time.time() + 30)) < 3
    fake.control("azure/event", id="E-GONE", type="Redeploy", **{"in": 600})
    assert s.next()["notice"]["id"] == "E-GONE"
    fake.control("azure/withdraw", id="E-GONE")
    assert s.next() == {"withdrawn": {"source": "azure", "id": "E-GONE"}}
    s.send({"ack": "E-PREEMPT"})
    assert s.next() == {"acked": "E-PREEMPT"}
    assert fake.control("log")["acks"] == ["E-PREEMPT"]
    # once started by our approval it leaves the document: no withdrawal said for it
    fake.control("azure/withdraw", id="E-PREEMPT")
    fake.control("azure/event", id="E-LATER", type="Preempt", **{"in": 60})
    assert s.next()["notice"]["id"] == "E-LATER"


def test_a_host_that_is_no_cloud_vm_costs_at_most_a_second(stream):
    """Refused at once, or a listener that never answers (a router dropping 169.254/16):
    `auto` gives up within its bound either way, and says why."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        for url in (f"http://127.0.0.1:{port}", f"http://127.0.0.1:{silent.getsockname()[1]}"):
            began = time.monotonic()
            s = stream(watch="auto", url=url)
            answer = s.next(timeout=5)
            assert answer["watching"] is None and url in answer["why"], answer
            assert time.monotonic() - began < 4       # an interpreter start, then at most ~1 s (slack for a loaded machine)
            assert s.proc.wait(5) == 0
    finally:
        silent.close()


def test_a_sigterm_from_outside_is_said_as_a_notice_before_the_stream_goes(fake, stream):
    s = stream(watch="aws", url=fake.url, every=0.2)
    assert s.next()["watching"] == "aws"
    s.proc.send_signal(signal.SIGTERM)
    notice = s.next()["notice"]
    assert (notice["source"], notice["kind"]) == ("shutdown", "SIGTERM")
    assert 0 < notice["deadline"] - time.time() <= 10
    assert s.proc.wait(5) == 128 + signal.SIGTERM


def test_an_outage_of_the_metadata_service_is_a_warning_said_once(stream):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    s = stream(watch="aws", url=f"http://127.0.0.1:{port}", every=0.1)
    said = s.next()
    assert said["watching"] == "aws" and said["how"].startswith("aws, no answer yet: PUT /latest/api/token"), said
    warning = s.next(skip=())
    assert "aws metadata: PUT /latest/api/token" in warning["warning"], warning
    with pytest.raises(queue.Empty):
        s.next(timeout=2.5, skip=())             # the same outage is not said again


SPEC = """name: nw
hosts:
  - {name: a, address: 10.9.0.1}
  - {name: b, address: 10.9.0.2, %s}
jobs:
  worker: {tasks: ["a:2222", "b:2222"]}
train:
  mode: mirrored
  script: template:mirrored
"""


@pytest.mark.parametrize("field,problem", [
    ("preemptible: spot", "hosts[1].preemptible: unknown preemptible 'spot'"),
    ("metadata_url: 'ftp://x'", "hosts[1].metadata_url: must be http://HOST[:PORT], got 'ftp://x'"),
    ("metadata_url: 'http://h:99999'", "hosts[1].metadata_url: must be http://HOST[:PORT]"),
])
def test_a_bad_preemptible_or_metadata_url_is_one_line_naming_file_line_and_field(tmp_path, field, problem):
    from tfcluster.errors import SpecError
    from tfcluster.spec import load_spec

    path = tmp_path / "nw.yaml"
    path.write_text(SPEC % field)
    with pytest.raises(SpecError) as bad:
        load_spec(str(path))
    assert bad.value.message.startswith(f"{path}:4: {problem}"), bad.value.message
    assert "\n" not in bad.value.message


def test_plan_says_which_hosts_are_watched_and_how(tmp_path):
    from tfcluster.plan import build_plan, plan_to_dict
    from tfcluster.spec import load_spec

    path = tmp_path / "nw.yaml"
    path.write_text(SPEC % "preemptible: auto, metadata_url: 'http://127.0.0.1:8080'")
    plan = build_plan(load_spec(str(path)))
    assert [h.watched for h in plan.all_hosts] == [
        "not watched (preemptible: no)",
        "watched (whichever cloud's metadata service answers (auto), at http://127.0.0.1:8080)"]
    assert plan_to_dict(plan)["hosts"][1]["preemptible"] == "auto"


def test_status_shows_what_each_host_is_watched_for_and_what_the_trains_stream_found(tmp_path, home):
    """`status` says the spec's word for every host and, once a train's stream said it (the
    cluster's state directory, written by the train as notices.publish does), what it found
    and the host's latest notice; `--json` the same under `watched`."""
    from types import SimpleNamespace

    from tests.helpers import tfcluster
    from tfcluster.launch.run.notices import Notice, Notices
    from tfcluster.plan import build_plan
    from tfcluster.spec import load_spec

    path = tmp_path / "nw.yaml"
    path.write_text("name: nwstatus\nhosts:\n  - {name: local, address: 127.0.0.1, preemptible: aws, "
                    "metadata_url: 'http://127.0.0.1:9'}\njobs:\n  worker: {tasks: ['local:2222']}\n"
                    "train:\n  mode: mirrored\n  script: template:mirrored\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    before = tfcluster("status", str(path), home=home, cwd=cwd)
    assert "  local: watched (aws notices, at http://127.0.0.1:9)\n" in before.stdout, before.stdout + before.stderr
    assert "the train's stream" not in before.stdout
    notices = Notices(found={"local": "watched (aws spot)"})      # HOME is `home` (the fixture)
    notices.records.append(Notice("local", "aws", "terminate", "x", time.time(), time.time() + 30))
    notices.publish(SimpleNamespace(plan=build_plan(load_spec(str(path)))))
    after = tfcluster("status", str(path), home=home, cwd=cwd)
    assert re.search(r"  local: watched \(aws notices, at http://127\.0\.0\.1:9\); the train's stream: watched "
                     r"\(aws spot\); last notice: \d\d:\d\d:\d\d local aws terminate, deadline \S+ \(30s ahead\): "
                     r"pending", after.stdout), after.stdout
    doc = json.loads(tfcluster("status", str(path), "--json", home=home, cwd=cwd).stdout)
    assert doc["watched"]["local"]["stream"] == "watched (aws spot)" and doc["watched"]["local"]["preemptible"] == "aws"
