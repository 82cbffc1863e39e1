"""Fake cloud metadata services that speak each cloud's documented protocol, for the notice
watchers (tfcluster/host/shim_notice.py). One server answers the three clouds' paths, each
as its documentation says, and refuses what the real one refuses:

- AWS, "Use IMDSv2" and "Spot Instance interruption notices" (docs.aws.amazon.com/AWSEC2/
  latest/UserGuide/configuring-instance-metadata-service.html and spot-instance-termination-
  notices.html): PUT /latest/api/token needs X-aws-ec2-metadata-token-ttl-seconds; every GET
  needs X-aws-ec2-metadata-token (401 without: IMDSv2 required); spot/instance-action is 404
  until an interruption is set, then {"action", "time": "YYYY-MM-DDTHH:MM:SSZ"}.
- GCE, "Detect if a VM was preempted" and "Querying metadata: wait for change" (cloud.google.com/
  compute/docs/instances/spot and compute/docs/metadata/querying-metadata): every request needs
  `Metadata-Flavor: Google` (403 without) and every answer carries it; `?wait_for_change=true`
  hangs until the value's ETag differs from last_etag (or timeout_sec passes).
- Azure, "Scheduled Events for Linux VMs" (learn.microsoft.com/azure/virtual-machines/linux/
  scheduled-events): `Metadata: true` required (400 without); GET /metadata/scheduledevents
  answers {"DocumentIncarnation", "Events": [...]}, each event with EventId, EventType,
  ResourceType, Resources, EventStatus, NotBefore (RFC 1123), Description, EventSource,
  DurationInSeconds; a POST of {"StartRequests": [{"EventId"}]} starts an event; a cancelled
  event leaves the document (its incarnation goes up).

The test drives it through /_fake/... (set a notice, withdraw an event, read what was asked).
Run as a program (`python tests/metadata_fakes.py PORT`, prints `ready` once it listens) so a
test can start it inside a bed host's network namespace.
"""
from __future__ import annotations

import email.utils
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


class State:
    def __init__(self, first_call_delay: float = 0.0) -> None:
        self.cond = threading.Condition()
        self.tokens: set[str] = set()
        self.aws_action: dict | None = None
        self.aws_rebalance: dict | None = None
        self.gce = {"preempted": "FALSE", "maintenance-event": "NONE"}
        self.gce_etag = {"preempted": 1, "maintenance-event": 1}
        self.azure_events: dict[str, dict] = {}
        self.azure_incarnation = 1
        self.azure_first_call_delay = first_call_delay
        self.azure_called = False
        self.acks: list[str] = []
        self.asked: list[tuple[str, str]] = []


class Handler(BaseHTTPRequestHandler):
    state: State
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body: bytes | str = b"", headers: dict | None = None) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    # -- the clouds

    def do_PUT(self) -> None:
        path = urlsplit(self.path).path
        self.state.asked.append(("PUT", path))
        self._body()
        if path == "/latest/api/token":
            ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            if not ttl or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return self._send(400)
            token = uuid.uuid4().hex
            self.state.tokens.add(token)
            return self._send(200, token, {"X-aws-ec2-metadata-token-ttl-seconds": ttl})
        self._send(404)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        self.state.asked.append(("GET", url.path))
        if url.path.startswith("/_fake/"):
            return self._control(url.path, {})
        if url.path.startswith("/latest/"):
            return self._aws(url.path)
        if url.path.startswith("/computeMetadata/"):
            return self._gce(url.path, parse_qs(url.query))
        if url.path.startswith("/metadata/"):
            return self._azure_get(url.path, parse_qs(url.query))
        self._send(404)

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        body = self._body()
        self.state.asked.append(("POST", url.path))
        if url.path.startswith("/_fake/"):
            return self._control(url.path, json.loads(body or b"{}"))
        if url.path == "/metadata/scheduledevents":
            if self.headers.get("Metadata") != "true":
                return self._send(400, '{"error": "Bad request. Required metadata header not specified"}')
            with self.state.cond:
                for start in json.loads(body).get("StartRequests", []):
                    event = self.state.azure_events.get(start.get("EventId"))
                    if event is not None:
                        self.state.acks.append(start["EventId"])
                        event["EventStatus"] = "Started"
                        event["NotBefore"] = ""
                        self.state.azure_incarnation += 1
            return self._send(200)
        self._send(404)

    def _aws(self, path: str) -> None:
        if self.headers.get("X-aws-ec2-metadata-token") not in self.state.tokens:
            return self._send(401)
        if path == "/latest/meta-data/instance-life-cycle":
            return self._send(200, "spot")
        for where, doc in (("/latest/meta-data/spot/instance-action", self.state.aws_action),
                           ("/latest/meta-data/events/recommendations/rebalance", self.state.aws_rebalance)):
            if path == where:
                return self._send(404) if doc is None else self._send(200, json.dumps(doc))
        self._send(404)

    def _gce(self, path: str, query: dict) -> None:
        flavor = {"Metadata-Flavor": "Google"}
        if self.headers.get("Metadata-Flavor") != "Google":
            return self._send(403, "Missing Metadata-Flavor:Google header.", flavor)
        key = path[len("/computeMetadata/v1/instance/"):]
        if key == "scheduling/preemptible":
            return self._send(200, "TRUE", flavor)
        if key not in self.state.gce:
            return self._send(404, "", flavor)
        with self.state.cond:
            if query.get("wait_for_change") == ["true"]:
                last = (query.get("last_etag") or ["0"])[0]
                until = time.monotonic() + float((query.get("timeout_sec") or ["300"])[0])
                while str(self.state.gce_etag[key]) == last and time.monotonic() < until:
                    self.state.cond.wait(until - time.monotonic())
            value, etag = self.state.gce[key], str(self.state.gce_etag[key])
        self._send(200, value, {**flavor, "ETag": etag})

    def _azure_get(self, path: str, query: dict) -> None:
        if self.headers.get("Metadata") != "true":
            return self._send(400, '{"error": "Bad request. Required metadata header not specified"}')
        if path == "/metadata/instance/compute":
            return self._send(200, json.dumps({"priority": "Spot", "vmId": "fake"}))
        if path != "/metadata/scheduledevents" or not query.get("api-version"):
            return self._send(400 if path == "/metadata/scheduledevents" else 404)
        if not self.state.azure_called:         # the service starts on its first call
            self.state.azure_called = True
            time.sleep(self.state.azure_first_call_delay)
        with self.state.cond:
            doc = {"DocumentIncarnation": self.state.azure_incarnation,
                   "Events": [dict(e) for e in self.state.azure_events.values()]}
        self._send(200, json.dumps(doc), {"Content-Type": "application/json"})

    # -- the test's side

    def _control(self, path: str, body: dict) -> None:
        s = self.state
        with s.cond:
            if path == "/_fake/aws/action":
                when = time.gmtime(time.time() + float(body["in"]))
                s.aws_action = {"action": body.get("action", "terminate"),
                                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", when)}
            elif path == "/_fake/aws/rebalance":
                s.aws_rebalance = {"noticeTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            elif path == "/_fake/gce/set":
                s.gce[body["key"]] = body["value"]
                s.gce_etag[body["key"]] += 1
            elif path == "/_fake/azure/event":
                eid = body.get("id") or str(uuid.uuid4()).upper()
                s.azure_events[eid] = {
                    "EventId": eid, "EventType": body.get("type", "Preempt"), "ResourceType": "VirtualMachine",
                    "Resources": ["fakevm"], "EventStatus": "Scheduled",
                    "NotBefore": email.utils.formatdate(time.time() + float(body["in"]), usegmt=True),
                    "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}
                s.azure_incarnation += 1
            elif path == "/_fake/azure/withdraw":
                s.azure_events.pop(body["id"], None)
                s.azure_incarnation += 1
            elif path != "/_fake/log":
                return self._send(404)
            s.cond.notify_all()
            log = {"asked": s.asked, "acks": s.acks}
        self._send(200, json.dumps(log))


def serve(host: str, port: int, first_call_delay: float = 0.0) -> ThreadingHTTPServer:
    """A fake listening on (host, port), served by a daemon thread; .shutdown() ends it."""
    handler = type("H", (Handler,), {"state": State(first_call_delay)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


if __name__ == "__main__":
    srv = serve("0.0.0.0", int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
    print("ready", flush=True)
    threading.Event().wait()
