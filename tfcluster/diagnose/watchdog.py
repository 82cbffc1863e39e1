"""The hang watchdog: notice waiting that will not end by itself, and say why.

Fed the lines that match `MARKERS` (TensorFlow's own waiting messages, which the tasks
print with TF_CPP_MIN_LOG_LEVEL=0, and the start-up probe's not-ready line) and asked
every supervisor tick which waits deserve a diagnosis. It never stops anything: a run
that waits forever ends at train.timeout. Deciding *what* to say needs facts about
the awaited task (alive? its port open from the waiter's host? its last line?), which
the supervisor gathers; `explain` turns them into the one line. Pure: the clock is an
argument.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

from tfcluster.plan.names import task_key

SESSION_WAIT = b"CreateSession still waiting for response from worker"
NOT_READY = b"tfcluster-not-ready: "
UNAVAILABLE = (b"failed to connect to all addresses", b"Failed to connect to remote host")
# A session's master (in between-graph mode the task's server) whose step failed while a task
# of it has not answered: TF says so once, 120 s into the step, then names each such task.
RUNSTEP_BLOCKED = b"RunStep still blocked after "
RUNSTEP_MARK = b"Failed with error status: "   # watched: its ':' is a byte scanned for already
NO_RESPONSE = b"No response from RunGraph call to worker: "
RUNGRAPH_TWICE = b"RunGraph request was received twice"
MARKERS = (SESSION_WAIT, NOT_READY, *UNAVAILABLE, RUNSTEP_MARK, NO_RESPONSE, RUNGRAPH_TWICE)
# How often TF repeats each message: a wait is still going while messages keep coming.
# A blocked RunStep is said once and lasts until its waiter writes again (`silent`).
_REPEATS = {"session": 10.0, "not-ready": 30.0, "unavailable": 30.0, "runstep": float("inf"),
            "twice": 60.0}
# How long the wait had lasted when TF first said so ("twice" is an event: due at once).
_BEFORE = {"session": 10.0, "runstep": 120.0}
_TF_TASK = re.compile(rb"/job:([A-Za-z0-9_-]+)(?:/replica:\d+)?/task:(\d+)")
_STATUS = re.compile(rb"Failed with error status: (.*)$")
_FROM = re.compile(rb"(\w+): From /job:([A-Za-z0-9_-]+)(?:/replica:\d+)?/task:(\d+):?\Z")
_ADDRESS = re.compile(rb"(?:ipv4:|ipv6:)?\[?([A-Za-z0-9_.:-]+?)\]?:(\d+): Failed to connect")
_MISSING = re.compile(rb"Variables not initialized: (.*)$")

# keras-jax mode: where a JAX process is, read off XLA's INFO lines (TF_CPP_MIN_LOG_LEVEL=0,
# tfcluster's default). Connecting, JAX retries for jax.distributed.initialize's
# initialization_timeout (300 s by default) and says nothing; once connected, a dead peer is
# declared after the heartbeat timeout (heartbeat_timeout_seconds, 100 s) and every process
# aborts by itself; exiting, a process waits in the shutdown barrier for the others, up to
# shutdown_timeout_seconds (300 s). Silence within those is JAX waiting as designed, not a hang.
JAX_CONNECTED = b"Connected to distributed JAX controller"
JAX_SHUTDOWN = b"Distributed task shutdown initiated"
JAX_MARKERS = (JAX_CONNECTED, JAX_SHUTDOWN)
JAX_INIT_TIMEOUT = 300.0
JAX_HEARTBEAT_TIMEOUT = 100.0
JAX_SHUTDOWN_TIMEOUT = 300.0
# past JAX's own timeout, the time its abort and exit take before the watchdog speaks
_JAX_GRACE = 30.0


@dataclass
class Wait:
    waiter: str                 # task key of the task that waits
    kind: str                   # "session" | "not-ready" | "unavailable" | "silent"
    target: str | None          # the awaited task key, when known
    detail: str                 # what is missing / the address that fails
    start: float                # monotonic estimate of when the wait began
    last: float                 # monotonic of the latest sign that it goes on
    said: float | None = None   # when a diagnosis was last printed


@dataclass
class Watchdog:
    """`saw` from any thread; `due` from the supervisor's loop."""

    hang_after: float
    targets: dict[str, str] = field(default_factory=dict)   # "address:port" -> task key
    chief: str | None = None
    repeat: float = 0.0
    coordinator: str | None = None     # keras-jax mode: process 0's task key (None: not JAX)
    _jax: dict[str, tuple[str, float]] = field(default_factory=dict)   # key -> (phase, when seen)
    _waits: dict[tuple[str, str], Wait] = field(default_factory=dict)
    # key -> the longest silence it has broken itself: a script that prints once a long epoch
    # is silent that long by habit, and only twice that is news
    _gaps: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.repeat = self.repeat or max(60.0, 3 * self.hang_after)

    def saw(self, key: str, line: bytes, now: float) -> None:
        """A line of `key`'s output (a script's or its server's) that matched MARKERS."""
        waiter = key.split(".", 1)[0]          # "worker:0.server" waits as worker:0
        if self.coordinator is not None and (JAX_CONNECTED in line or JAX_SHUTDOWN in line):
            with self._lock:
                self._jax[waiter] = ("run" if JAX_CONNECTED in line else "shutdown", now)
            return
        found = self._classify(line)
        if found is None:
            return
        kind, target, detail = found
        with self._lock:
            wait = self._waits.get((waiter, kind))
            if kind == "runstep" and NO_RESPONSE in line:     # names the task of a blocked step
                if wait is not None:
                    wait.last = now
                    wait.target = wait.target or target
                return
            if wait is None or now - wait.last > _REPEATS[kind] * 1.5 or wait.target != target:
                start = now - _BEFORE.get(kind, self.hang_after if kind == "twice" else 0.0)
                self._waits[(waiter, kind)] = Wait(waiter, kind, target, detail, start, now)
            else:
                wait.last, wait.detail = now, detail

    def silent(self, key: str, since: float, now: float, started: float | None = None) -> None:
        """`key` (alive) has printed nothing since `since`; its attempt began at `started`
        (monotonic, when known: a JAX phase seen before it belongs to an earlier attempt)."""
        with self._lock:
            blocked = self._waits.get((key, "runstep"))
            if blocked is not None and since > blocked.last:
                del self._waits[(key, "runstep")]      # it wrote since: the step went on
            wait = self._waits.get((key, "silent"))
            phase, target = self._jax_phase(key, started)
            # it printed (a new attempt's start is no print): a silence it broke itself
            if wait is not None and since > wait.start and (started is None or since > started):
                self._gaps[key] = max(self._gaps.get(key, 0.0), since - wait.start)
            if wait is None or wait.start != since or wait.detail != phase:
                self._waits[(key, "silent")] = Wait(key, "silent", target, phase, since, now)
            else:
                wait.last = now

    def _jax_phase(self, key: str, started: float | None) -> tuple[str, str | None]:
        """("", None) outside keras-jax mode, else the process's phase and whom it waits for:
        connecting, it waits for process 0's coordinator."""
        if self.coordinator is None:
            return "", None
        phase, seen = self._jax.get(key, ("init", 0.0))
        if started is not None and seen < started:
            phase = "init"                     # a new attempt connects again
        if phase == "init":
            return "jax-init", (self.coordinator if key != self.coordinator else None)
        return f"jax-{phase}", None

    def _threshold(self, wait: Wait) -> float:
        if wait.kind != "silent":
            return self.hang_after
        jax = {"jax-init": JAX_INIT_TIMEOUT + _JAX_GRACE, "jax-run": JAX_HEARTBEAT_TIMEOUT + _JAX_GRACE,
               "jax-shutdown": JAX_SHUTDOWN_TIMEOUT + _JAX_GRACE}.get(wait.detail, 0.0)
        return max(self.repeat, jax, 2 * self._gaps.get(wait.waiter, 0.0))

    def due(self, now: float, running: set[str]) -> list[Wait]:
        """Waits of running tasks that have lasted hang_after and are still going, not
        said within `repeat` seconds. Marks them said."""
        out = []
        with self._lock:
            busy = {w.waiter for w in self._waits.values() if w.kind != "silent"}
            for k, wait in list(self._waits.items()):
                if wait.kind == "silent" and wait.waiter in busy:
                    continue          # a known wait explains the silence better
                repeats = _REPEATS.get(wait.kind, self.repeat)
                if wait.waiter not in running or (wait.kind != "silent" and now - wait.last > repeats * 1.5):
                    del self._waits[k]
                    continue
                if now - wait.start < self._threshold(wait):
                    continue
                if wait.said is not None and now - wait.said < self.repeat:
                    continue
                wait.said = now
                out.append(wait)
        # JAX processes advance together, so their silence is one: said once, for the first
        jax = [w for w in out if w.detail.startswith("jax-")]
        return [w for w in out if not w.detail.startswith("jax-")] + sorted(jax, key=lambda w: w.waiter)[:1]

    def _classify(self, line: bytes) -> tuple[str, str | None, str] | None:
        if RUNSTEP_BLOCKED in line:
            m = _STATUS.search(line)
            return "runstep", None, m.group(1).decode("utf-8", "replace").strip() if m else ""
        if NO_RESPONSE in line or RUNGRAPH_TWICE in line:
            m = _TF_TASK.search(line)
            target = task_key(m.group(1).decode(), int(m.group(2))) if m else None
            return ("runstep" if NO_RESPONSE in line else "twice"), target, ""
        if SESSION_WAIT in line:
            m = _TF_TASK.search(line, line.find(SESSION_WAIT))
            target = task_key(m.group(1).decode(), int(m.group(2))) if m else None
            return "session", target, ""
        if NOT_READY in line:
            m = _MISSING.search(line)
            missing = m.group(1).decode("utf-8", "replace").strip() if m else ""
            return "not-ready", self.chief, missing
        m = _ADDRESS.search(line)
        if m:
            address = f"{m.group(1).decode()}:{m.group(2).decode()}"
            return "unavailable", self.targets.get(address), address
        return None


@dataclass(frozen=True)
class Facts:
    """What the supervisor found about the awaited task when a wait became due."""

    host: str = "?"
    address: str = ""                 # "host:port" of the awaited task
    state: str = "unknown"            # "running" | "finished" | "failed" | "not started" | "restarting" | "unknown"
    exit_code: int | None = None
    pid: int | None = None
    port: str | None = "unchecked"    # None: accepts connections from the waiter's host; else why not
    quiet_for: float | None = None    # seconds since its last output
    last_line: str = ""
    proxy: str | None = None          # a proxy variable set in the waiter's environment


def explain(wait: Wait, facts: Facts | None, now: float, waiter_host: str, log_hint: str) -> str:
    """The one-line diagnosis of a due wait."""
    waited = f"{wait.waiter} has waited {now - wait.start:.0f}s"
    if wait.kind in ("runstep", "twice"):
        return _stall(wait, facts, now, waiter_host, log_hint)
    if wait.kind == "silent" and wait.detail.startswith("jax-"):
        return _jax(wait, facts, now, waiter_host, log_hint)
    if wait.kind == "silent":
        return (f"{wait.waiter} on {waiter_host} has printed nothing for {now - wait.start:.0f}s and is "
                f"still running: if it should be making progress, it may be stuck (e.g. waiting for "
                f"another task); its log: {log_hint}")
    if wait.kind == "not-ready":
        what = f"for the chief to initialise its variables ({_clip(wait.detail)})"
        target = f"{wait.target} {_state(facts)}" if wait.target and facts else "the chief"
        return (f"{waited} {what}: {target}. Likely: the chief has not initialised them yet, "
                f"or the workers place variables differently (the placement check names the first "
                f"one); the chief's log: {log_hint}")
    if wait.target is None:
        address = f" at {wait.detail}" if wait.detail else ""
        cause = (f"a proxy is set ({facts.proxy}): gRPC sends cluster traffic through it unless "
                 f"no_proxy names the cluster (train.checks.proxy_guard)") if facts and facts.proxy else \
            "the address is not one of this cluster's tasks (a stale TF_CONFIG, or the script dials another address)"
        return f"{waited}: TensorFlow cannot connect{address}. Likely: {cause}"
    head = f"{waited} for {wait.target}" + (f" ({facts.host}, {facts.address})" if facts else "")
    return f"{head}: {wait.target} {_state(facts)}. {_cause(wait, facts, waiter_host, log_hint)}"


def _stall(wait: Wait, facts: Facts | None, now: float, waiter_host: str, log_hint: str) -> str:
    """TF's own stall messages, said with what they mean."""
    where = f" ({facts.host}, {facts.address})" if facts and wait.target and facts.address else ""
    proxy = (f"; a proxy is set ({facts.proxy}): gRPC may send the cluster's traffic through it"
             if facts and facts.proxy else "")
    if wait.kind == "twice":
        sender = f" ({wait.target} said so)" if wait.target else ""
        return (f"{wait.waiter} on {waiter_host}: TensorFlow aborted a step because a task got its "
                f"RunGraph call twice{sender} ('The same RunGraph request was received twice'): the "
                f"call was sent again after its connection failed, though the first copy had "
                f"arrived. Check the network between the tasks (drops, timeouts{proxy}) and that no "
                f"other process serves these ports; a MonitoredTrainingSession recreates its session "
                f"and it happens again while the cause lasts")
    status = f" (the step failed: {_failed(wait.detail)})" if wait.detail else ""
    head = (f"{wait.waiter}'s training step is stuck: TensorFlow's RunStep has been blocked for "
            f"{now - wait.start:.0f}s{status}, still waiting for ")
    if wait.target is None:
        return (head + f"a task it does not name. Likely: a task of the step failed or was lost and "
                f"another cannot answer; {wait.waiter}'s log: {log_hint}")
    if wait.target == wait.waiter:
        return (head + f"its own part of the step: an op of {wait.waiter} does not return and cannot "
                f"be cancelled (a py_func, a blocking read or queue, a call into another library); "
                f"its log: {log_hint}. The run ends at train.timeout")
    return (head + f"{wait.target}{where}: {wait.target} {_state(facts)}. Likely: {wait.target} is "
            f"stopped, hung or unreachable, so the failed step cannot be cancelled there: check its "
            f"process and the network from {waiter_host}{proxy}; its log: {log_hint}. The run ends at "
            f"train.timeout")


def _jax(wait: Wait, facts: Facts | None, now: float, waiter_host: str, log_hint: str) -> str:
    """A keras-jax process silent past the JAX timeout of the phase it is in."""
    head = (f"no process of the run has printed anything for {now - wait.start:.0f}s "
            f"(JAX processes advance together); {wait.waiter} on {waiter_host}")
    if wait.detail == "jax-init":
        if wait.target is None:
            whom = "for every other process to register with its coordinator"
            log_hint = f"its log: {log_hint}"
        else:
            where = f" ({facts.host}, {facts.address})" if facts and facts.address else ""
            whom = f"for process 0's coordinator, {wait.target}{where}: {wait.target} {_state(facts)}"
            log_hint = f"process 0's log: {log_hint}"
        return (f"{head} and has not connected to JAX's coordinator: it waits {whom}. "
                f"jax.distributed.initialize gives up after its initialization_timeout "
                f"({JAX_INIT_TIMEOUT:.0f}s by default) and this is past it: the program may set a longer "
                f"one, or it is stuck before the call (a data load, an import); {log_hint}")
    if wait.detail == "jax-shutdown":
        return (f"{head} has begun JAX's shutdown: it waits in the shutdown barrier for the other "
                f"processes, which JAX bounds by shutdown_timeout_seconds ({JAX_SHUTDOWN_TIMEOUT:.0f}s by "
                f"default) and a dead peer by heartbeat_timeout_seconds ({JAX_HEARTBEAT_TIMEOUT:.0f}s); "
                f"past both, a process that has not reached its end may be stuck; its log: {log_hint}")
    return (f"{head} is still running, past JAX's heartbeat timeout (heartbeat_timeout_seconds, "
            f"{JAX_HEARTBEAT_TIMEOUT:.0f}s by default), after which a dead process would have ended "
            f"every process: every process is alive, so it may be stuck in its own code (a data "
            f"load, a step that does not return) or a collective that another process never "
            f"joins (a different number of steps per process); its log: {log_hint}")


def _failed(status: str) -> str:
    """TF's step status, its task named as tfcluster names it: `INVALID_ARGUMENT from ps:0`."""
    m = _FROM.match(status.encode())
    if m is None:
        return _clip(status)
    return f"{m.group(1).decode()} from {task_key(m.group(2).decode(), int(m.group(3)))}"


def _state(f: Facts | None) -> str:
    if f is None:
        return "is in an unknown state"
    quiet = (f", last output {f.quiet_for:.0f}s ago" if f.quiet_for is not None else ", no output yet") + \
        (f": {_clip(f.last_line)!r}" if f.last_line else "")
    if f.state == "running":
        return f"is running (pid {f.pid}{quiet})" if f.pid else f"is running{quiet}"
    if f.state in ("finished", "failed"):
        return f"exited with code {f.exit_code}{quiet}"
    return {"not started": "has not been started", "restarting": "is restarting"}.get(f.state, "is in an unknown state")


def _cause(wait: Wait, f: Facts | None, waiter_host: str, log_hint: str) -> str:
    if f is None:
        return f"Check its log: {log_hint}"
    if f.state == "finished":
        return (f"Likely: it finished and {wait.waiter}'s session still waits for every task of the cluster; "
                f"give the session config device_filters=['/job:ps', '/job:{wait.waiter.replace(':', '/task:')}'] "
                f"so a worker depends only on the ps and itself")
    if f.state == "failed":
        return f"Likely: it crashed; its log: {log_hint}"
    if f.state in ("not started", "restarting"):
        return "It will be waited for until it (re)starts; if it never does, check the restart policy"
    if f.port is None:
        proxy = f" A proxy is set ({f.proxy}): gRPC may be sending the cluster's traffic through it." if f.proxy else ""
        return (f"Its port accepts connections from {waiter_host}, yet TensorFlow gets no answer: "
                f"another process may hold the port, or the session targets the wrong address.{proxy}")
    if f.port == "unchecked":
        return f"Check its log: {log_hint}"
    return (f"Its port does not accept connections from {waiter_host} ({f.port}). Likely: it has not "
            f"started its TF server yet (a late start), or a firewall or a wrong hosts[].address keeps "
            f"{waiter_host} out; its log: {log_hint}")


def _clip(text: str, n: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"
