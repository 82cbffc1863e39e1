"""A host's notices that it is about to go: the clouds' metadata services, and a SIGTERM.

The `notice` stream (shim.py notice): one per watched host for a `train` run. It finds out
which cloud the host is on (`auto`) or is told, then watches that cloud's metadata service
and says each notice as one JSON line on stdout until its stdin ends:

    {"watching": "aws", "how": "aws spot"}              or {"watching": null, "why": "..."}
    {"notice": {"source": "aws", "kind": "terminate", "id": "...", "deadline": 1.7e9, ...}}
    {"withdrawn": {"source": "azure", "id": "..."}}    an event the cloud took back
    {"acked": "..."}                                    after {"ack": "..."} on stdin (Azure)
    {"warning": "..."}                                  the metadata service failed (once per outage)

What each cloud documents, and what is read here:
- AWS, "Spot Instance interruption notices" and "Use IMDSv2" (EC2 user guide): a session
  token from `PUT /latest/api/token` (header X-aws-ec2-metadata-token-ttl-seconds), then
  `GET /latest/meta-data/spot/instance-action` with X-aws-ec2-metadata-token: 404 while none,
  200 `{"action": "terminate"|"stop"|"hibernate", "time": "...Z"}` two minutes ahead; checked
  every few seconds (AWS recommends 5). `/latest/meta-data/events/recommendations/rebalance`
  (200 `{"noticeTime": ...}`) is an earlier hint with no deadline.
- GCE, "Detect if a VM was preempted" and "Wait for change" (Compute Engine metadata docs):
  `GET /computeMetadata/v1/instance/preempted?wait_for_change=true` with `Metadata-Flavor:
  Google` hangs until the value changes to TRUE; a spot or preemptible VM then gets about 30 s
  (ACPI soft off). `instance/maintenance-event` turns to TERMINATE_ON_HOST_MAINTENANCE ahead
  of a host maintenance that stops the VM.
- Azure, "Scheduled Events for Linux VMs": `GET /metadata/scheduledevents?api-version=
  2020-07-01` with `Metadata: true` answers `{"DocumentIncarnation": n, "Events": [{"EventId",
  "EventType": "Preempt"|"Terminate"|"Reboot"|"Redeploy"|"Freeze", "EventStatus":
  "Scheduled"|"Started", "NotBefore": RFC 1123 date, ...}]}`; an event that vanishes while
  still Scheduled was cancelled; POST `{"StartRequests": [{"EventId": id}]}` approves one (we
  do once the host is drained, so that the cloud need not wait out NotBefore). Its first
  call can take up to two minutes (the service starts on it), which is why the stream starts
  with the run and asks with a long timeout.

Every address is the base URL the request names (the spec's `metadata_url`, for tests and
odd clouds), else 169.254.169.254 for all three (GCE answers there too, which spares a DNS
lookup of metadata.google.internal on a host that is no cloud VM).

Standard library only (http.client), Python >= 3.8; runs under `python -S`.
"""
from __future__ import annotations

import calendar
import email.utils
import http.client
import json
import signal
import sys
import threading
import time
import urllib.parse

if __package__:
    from . import shim_protocol as proto
    from .shim_procs import write_all
else:  # shipped: the shim's directory is first on sys.path
    import shim_protocol as proto
    from shim_procs import write_all

DEFAULT_URL = "http://169.254.169.254"
CLOUDS = ("aws", "gce", "azure")
# `auto` asks the three at once, each with this bound on connect and answer: a host that is
# no cloud VM (no route to 169.254.169.254, or a router that drops it) costs at most this,
# in a stream of its own beside the run's start (a probe is two requests: 1 s in all).
PROBE_TIMEOUT = 0.4
AWS_EVERY = 2.0          # seconds between looks (AWS recommends 5; the notice is 2 min ahead)
AZURE_EVERY = 1.0
AZURE_FIRST_CALL = 130.0  # the service may take two minutes to answer its first call
GCE_HANG = 60            # seconds a wait_for_change request hangs before asking again
GCE_PREEMPT_NOTICE = 30.0     # a preempted spot VM gets ~30 s (ACPI soft off)
GCE_MAINTENANCE_NOTICE = 60.0  # maintenance-event is set 60 s ahead of the host's maintenance
SHUTDOWN_NOTICE = 10.0   # a SIGTERM from outside: what a shutdown leaves, at best
HTTP_TIMEOUT = 5.0
AWS_TOKEN_TTL = 21600
AZURE_API = "2020-07-01"
# Azure events that take the VM away; Freeze pauses it for seconds and loses nothing
AZURE_GOING = ("Preempt", "Terminate", "Reboot", "Redeploy")


class MetadataError(Exception):
    pass


def request(base: str, method: str, path: str, headers: dict, body: bytes | None = None,
            timeout: float = HTTP_TIMEOUT) -> tuple[int, dict, bytes]:
    """(status, headers lower-cased, body) of one HTTP request to the metadata service."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "169.254.169.254", url.port or 80, timeout=timeout)
    try:
        conn.request(method, (url.path.rstrip("/") + path), body=body, headers=headers)
        answer = conn.getresponse()
        data = answer.read(1 << 20)
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, data
    except (OSError, http.client.HTTPException) as e:
        raise MetadataError("%s %s: %s" % (method, path, e or type(e).__name__)) from None
    finally:
        conn.close()


def iso_time(text: str) -> float | None:
    """AWS's `2017-09-18T08:22:00Z` as seconds since the epoch."""
    for form in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S.%fZ"):
        try:
            return float(calendar.timegm(time.strptime(text, form)))
        except (TypeError, ValueError):
            continue
    return None


def rfc1123_time(text: str) -> float | None:
    """Azure's `Mon, 19 Sep 2016 18:29:47 GMT` as seconds since the epoch; None when empty
    (an event already started has no NotBefore)."""
    parsed = email.utils.parsedate_tz(text) if text else None
    return float(email.utils.mktime_tz(parsed)) if parsed else None


# ---------------------------------------------------------------- the clouds

class Aws:
    name = "aws"

    def __init__(self, base: str) -> None:
        self.base, self._token, self._until = base, None, 0.0

    def token(self, timeout: float = HTTP_TIMEOUT) -> str:
        if self._token and time.monotonic() < self._until:
            return self._token
        status, _, body = request(self.base, "PUT", "/latest/api/token",
                                  {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL)}, timeout=timeout)
        if status != 200 or not body:
            raise MetadataError("PUT /latest/api/token: HTTP %d" % status)
        self._token, self._until = body.decode().strip(), time.monotonic() + AWS_TOKEN_TTL / 2
        return self._token

    def get(self, path: str, timeout: float = HTTP_TIMEOUT) -> tuple[int, bytes]:
        for again in (True, False):
            status, _, body = request(self.base, "GET", path, {"X-aws-ec2-metadata-token": self.token(timeout)},
                                      timeout=timeout)
            if status == 401 and again:      # the token expired (or the service restarted)
                self._token = None
                continue
            return status, body
        return status, body

    def probe(self, timeout: float) -> str:
        self.token(timeout)
        status, body = self.get("/latest/meta-data/instance-life-cycle", timeout)
        life = body.decode(errors="replace").strip() if status == 200 else ""
        return "aws spot" if life == "spot" else "aws"

    def watch(self, say, stopped: threading.Event, every: float) -> None:
        seen = set()
        while not stopped.is_set():
            for path, kind in (("/latest/meta-data/spot/instance-action", None),
                               ("/latest/meta-data/events/recommendations/rebalance", "rebalance")):
                status, body = self.get(path)
                if status == 404:
                    continue
                if status != 200:
                    raise MetadataError("GET %s: HTTP %d" % (path, status))
                try:
                    doc = json.loads(body)
                except ValueError:
                    raise MetadataError("GET %s: not JSON: %r" % (path, body[:80])) from None
                if kind is None:
                    notice = {"source": "aws", "kind": str(doc.get("action")), "deadline": iso_time(doc.get("time")),
                              "id": "%s@%s" % (doc.get("action"), doc.get("time"))}
                else:
                    notice = {"source": "aws", "kind": kind, "deadline": None,
                              "id": "rebalance@%s" % doc.get("noticeTime")}
                if notice["id"] not in seen:
                    seen.add(notice["id"])
                    say({"notice": notice})
            say(None)            # a good look: an outage said before is over
            stopped.wait(every)


class Gce:
    name = "gce"
    HEADERS = {"Metadata-Flavor": "Google"}

    def __init__(self, base: str) -> None:
        self.base = base

    def get(self, path: str, timeout: float = HTTP_TIMEOUT) -> tuple[int, dict, str]:
        status, headers, body = request(self.base, "GET", "/computeMetadata/v1/instance/" + path,
                                        self.HEADERS, timeout=timeout)
        return status, headers, body.decode(errors="replace").strip()

    def probe(self, timeout: float) -> str:
        status, headers, _ = self.get("preempted", timeout)
        if status != 200 or headers.get("metadata-flavor") != "Google":
            raise MetadataError("not a GCE metadata server (HTTP %d)" % status)
        status, _, value = self.get("scheduling/preemptible", timeout)
        return "gce spot" if status == 200 and value == "TRUE" else "gce"

    def watch(self, say, stopped: threading.Event, every: float) -> None:
        """Both values hang in a thread each (wait_for_change), so either says at once."""
        errors: list[BaseException] = []
        threads = [threading.Thread(target=self._hang, args=(key, say, stopped, errors), daemon=True)
                   for key in ("preempted", "maintenance-event")]
        for t in threads:
            t.start()
        while not stopped.is_set() and not errors:
            stopped.wait(0.5)
        if errors:
            raise errors[0]

    def _hang(self, key: str, say, stopped: threading.Event, errors: list) -> None:
        etag = "0"
        said = False
        try:
            while not stopped.is_set():
                path = "%s?wait_for_change=true&timeout_sec=%d&last_etag=%s" % (key, GCE_HANG, etag)
                status, headers, value = self.get(path, timeout=GCE_HANG + HTTP_TIMEOUT)
                if status != 200:
                    raise MetadataError("GET %s: HTTP %d" % (key, status))
                etag = headers.get("etag", etag)
                going = value == "TRUE" if key == "preempted" else value.startswith("TERMINATE")
                if going and not said:
                    said = True
                    ahead = GCE_PREEMPT_NOTICE if key == "preempted" else GCE_MAINTENANCE_NOTICE
                    say({"notice": {"source": "gce", "kind": "preempted" if key == "preempted" else value,
                                    "deadline": time.time() + ahead, "id": "%s@%s" % (key, etag)}})
                say(None)
        except BaseException as e:  # noqa: BLE001 - handed to watch(), which says it
            errors.append(e)


class Azure:
    name = "azure"
    HEADERS = {"Metadata": "true"}

    def __init__(self, base: str) -> None:
        self.base = base
        self.lock = threading.Lock()
        self.acked: set = set()

    def events(self, timeout: float = HTTP_TIMEOUT) -> dict:
        status, _, body = request(self.base, "GET", "/metadata/scheduledevents?api-version=" + AZURE_API,
                                  self.HEADERS, timeout=timeout)
        if status != 200:
            raise MetadataError("GET /metadata/scheduledevents: HTTP %d" % status)
        try:
            doc = json.loads(body)
        except ValueError:
            raise MetadataError("GET /metadata/scheduledevents: not JSON: %r" % body[:80]) from None
        return doc if isinstance(doc, dict) else {}

    def probe(self, timeout: float) -> str:
        status, _, body = request(self.base, "GET", "/metadata/instance/compute?api-version=2021-02-01",
                                  self.HEADERS, timeout=timeout)
        if status != 200:
            raise MetadataError("not an Azure metadata service (HTTP %d)" % status)
        try:
            priority = json.loads(body).get("priority")
        except (ValueError, AttributeError):
            priority = None
        return "azure spot" if priority == "Spot" else "azure"

    def ack(self, event_id: str) -> None:
        body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
        status, _, _ = request(self.base, "POST", "/metadata/scheduledevents?api-version=" + AZURE_API,
                               dict(self.HEADERS, **{"Content-Type": "application/json"}), body=body)
        if status not in (200, 202, 204):
            raise MetadataError("POST StartRequests for %s: HTTP %d" % (event_id, status))
        with self.lock:
            self.acked.add(event_id)

    def watch(self, say, stopped: threading.Event, every: float) -> None:
        incarnation, said = None, {}       # EventId -> status last seen
        timeout = AZURE_FIRST_CALL
        while not stopped.is_set():
            doc = self.events(timeout)
            timeout = HTTP_TIMEOUT
            if doc.get("DocumentIncarnation") != incarnation:
                incarnation = doc.get("DocumentIncarnation")
                now = {}
                for event in doc.get("Events") or []:
                    if not isinstance(event, dict) or event.get("EventType") not in AZURE_GOING:
                        continue
                    eid = str(event.get("EventId"))
                    now[eid] = str(event.get("EventStatus"))
                    if eid not in said:
                        say({"notice": {"source": "azure", "kind": str(event.get("EventType")), "id": eid,
                                        "deadline": rfc1123_time(str(event.get("NotBefore") or "")),
                                        "status": now[eid], "incarnation": incarnation}})
                for eid, status in said.items():
                    with self.lock:
                        ours = eid in self.acked
                    if eid not in now and status == "Scheduled" and not ours:
                        say({"withdrawn": {"source": "azure", "id": eid}})
                said = now
            say(None)
            stopped.wait(every)


WATCHERS = {"aws": Aws, "gce": Gce, "azure": Azure}
EVERY = {"aws": AWS_EVERY, "gce": 0.0, "azure": AZURE_EVERY}


def detect(base: str, timeout: float = PROBE_TIMEOUT) -> tuple[object | None, str]:
    """(watcher, how) of the first cloud whose metadata service answers, all asked at once
    and none waited on past `timeout` (plus a little); (None, why not) when none does."""
    found: dict = {}
    why: dict = {}

    def ask(name: str) -> None:
        watcher = WATCHERS[name](base)
        try:
            found[name] = (watcher, watcher.probe(timeout))
        except MetadataError as e:
            why[name] = str(e)
    threads = [threading.Thread(target=ask, args=(n,), daemon=True) for n in CLOUDS]
    for t in threads:
        t.start()
    end = time.monotonic() + 2 * timeout + 0.2      # a probe is at most two requests
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    for name in CLOUDS:
        if name in found:
            return found[name]
    return None, "no cloud metadata service answered at %s within %gs" % (base, timeout)


# ---------------------------------------------------------------- the stream

class Stream:
    """One notice stream: the watcher's thread, stdin's acknowledgements, the SIGTERM."""

    def __init__(self, req: dict) -> None:
        self.base = str(req.get("url") or DEFAULT_URL)
        self.watch = str(req.get("watch") or "auto")
        self.every = req.get("every")
        # reentrant: the SIGTERM handler says its line from the main thread, which may be
        # inside say() itself; each line is one small write, so lines never interleave
        self.lock = threading.RLock()
        self.stopped = threading.Event()
        self.outage = None           # the warning said, until a good look
        self.watcher = None

    def say(self, line) -> None:
        if line is None:
            self.outage = None
            return
        with self.lock:
            write_all(1, proto.json_line(line))

    def warn(self, text: str) -> None:
        if text != self.outage:
            self.outage = text
            self.say({"warning": text})

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_term)
        if self.watch == "auto":
            self.watcher, how = detect(self.base)
            if self.watcher is None:
                self.say({"watching": None, "why": how})
                return 0
        elif self.watch in WATCHERS:        # told which: watched whatever the first look says
            self.watcher = WATCHERS[self.watch](self.base)
            try:
                how = self.watcher.probe(PROBE_TIMEOUT)
            except MetadataError as e:
                how = "%s, no answer yet: %s" % (self.watch, e)
        else:
            raise proto.ShimError("notice: unknown cloud %r (one of %s, auto)" % (self.watch, ", ".join(CLOUDS)))
        self.say({"watching": self.watcher.name, "how": how})
        threading.Thread(target=self.keep_watching, daemon=True).start()
        self.read_stdin()
        self.stopped.set()
        return 0

    def keep_watching(self) -> None:
        every = float(self.every) if self.every is not None else EVERY[self.watcher.name]
        while not self.stopped.is_set():
            try:
                self.watcher.watch(self.say, self.stopped, every)
            except MetadataError as e:
                self.warn("%s metadata: %s" % (self.watcher.name, e))
            except Exception as e:  # noqa: BLE001 - a watcher's bug is said, never ends the stream
                self.warn("%s watcher: %s" % (self.watcher.name, proto.describe_exception(e)))
            self.stopped.wait(max(every, 1.0))

    def read_stdin(self) -> None:
        """Acknowledgements until the launcher goes (EOF: the run ended, or its connection)."""
        stdin = sys.stdin.buffer
        while True:
            try:
                line = stdin.readline()
            except (OSError, ValueError):
                return
            if not line:
                return
            try:
                asked = json.loads(line)
            except ValueError:
                continue
            if isinstance(asked, dict) and asked.get("ack") and hasattr(self.watcher, "ack"):
                try:
                    self.watcher.ack(str(asked["ack"]))
                    self.say({"acked": str(asked["ack"])})
                except MetadataError as e:
                    self.say({"warning": "%s: %s" % (self.watcher.name, e)})

    def on_term(self, signum, frame) -> None:
        """A SIGTERM from outside (a shutdown, which sends it to every process) ends the stream;
        cmd_notice says it as a notice on the way out. No output here: the signal may arrive
        while this thread holds the output's lock, after writing a line and before letting go."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)      # a second one must not cut the notice
        raise _Terminated(128 + signum)

    def say_shutdown(self) -> None:
        try:
            self.say({"notice": {"source": "shutdown", "kind": "SIGTERM", "id": "SIGTERM",
                                 "deadline": time.time() + SHUTDOWN_NOTICE}})
        except OSError:
            pass


class _Terminated(Exception):
    """A SIGTERM ends the stream; the shim's entry point turns the code into the exit status."""


def cmd_notice(req: dict) -> int:
    stream = Stream(req)
    try:
        return stream.run()
    except _Terminated as e:
        stream.say_shutdown()
        return e.args[0]
