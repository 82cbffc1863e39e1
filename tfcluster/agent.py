"""HostAgent: everything the launcher does on one host, through the shim (DESIGN.md §5).

The agent ships `shim.py` and `tfserver.py` to `<cluster_dir>/bin/` and then runs
`PYTHON shim.py SUBCOMMAND` through its transport, one JSON request line on stdin,
JSON on stdout. Attached tasks keep their shim (and channel) open: the agent sends
"HB" lines from one background thread and the shim kills the task when they stop.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tfcluster.errors import PreflightError, TaskError, TfclusterError
from tfcluster.transport.base import Proc, Transport

SHIPPED = ("shim.py", "tfserver.py")
MIN_PYTHON = (3, 8)
HANDSHAKE_TIMEOUT = 60.0
INLINE_LIMIT = 512 * 1024     # files up to this much in all travel inside the request

# Runs with `python -c` before the shim is known to be there: says which shipped files
# are stale and, when none is, answers `info` in the same exec (one round trip).
BOOTSTRAP = r"""
import hashlib, json, os, runpy, sys
if sys.version_info < %r:
    print(json.dumps({"error": "python %%d.%%d is too old (tfcluster needs >= 3.8)" %% sys.version_info[:2]}))
    sys.exit(3)
req = json.loads(sys.stdin.buffer.readline())  # the binary reader: the shim reads line 2 from it
bindir = os.path.expanduser(req["bindir"])
stale = []
for name, digest in sorted(req["files"].items()):
    try:
        with open(os.path.join(bindir, name), "rb") as f:
            fresh = hashlib.sha256(f.read()).hexdigest() == digest
    except OSError:
        fresh = False
    if not fresh:
        stale.append(name)
print(json.dumps({"stale": stale, "bindir": bindir}), flush=True)
if not stale:
    # The next stdin line is a `batch` request (info first, then whatever the caller
    # wants to know before acting): one exec answers all of it.
    sys.argv = [os.path.join(bindir, "shim.py"), "batch"]
    runpy.run_path(sys.argv[0], run_name="__main__")
""" % (MIN_PYTHON,)


@dataclass(frozen=True)
class HostInfo:
    home: str
    hostname: str
    python_version: str
    tf_version: str | None
    machine_id: str
    gpus: int


@dataclass(frozen=True)
class TaskLaunch:
    tag: str                      # cluster:run:job:index (a prefix selects a cluster or a run)
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    log: str
    pidfile: str                  # under <cluster_dir>/pids/ (HostAgent.pidfile) or stop/status miss it
    port: int | None = None       # recorded in the pid file only


@dataclass(frozen=True)
class TaskStatus:
    tag: str
    pid: int
    alive: bool
    uptime_s: float | None
    log: str


@dataclass(frozen=True)
class StopReport:
    stopped: tuple[tuple[str, int], ...]
    survivors: tuple[tuple[str, int], ...]


@functools.lru_cache(maxsize=None)
def _shipped() -> dict[str, bytes]:
    here = Path(__file__).parent
    return {name: (here / name).read_bytes() for name in SHIPPED}


def _host_info(info: dict) -> HostInfo:
    return HostInfo(home=info["home"], hostname=info["hostname"],
                    python_version=info["python_version"], tf_version=info["tf_version"],
                    machine_id=info["machine_id"], gpus=int(info["gpus"]))


def _ports(answer: dict) -> dict[int, str | None]:
    return {int(p): holder for p, holder in answer.items()}


def _statuses(answer: list) -> list[TaskStatus]:
    return [TaskStatus(tag=s["tag"], pid=int(s["pid"]), alive=bool(s["alive"]),
                       uptime_s=s.get("uptime_s"), log=s.get("log") or "") for s in answer]


def _last_json(out: bytes):
    lines = [line for line in out.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        return json.loads(lines[-1])
    except ValueError:
        return None


class AttachedTask:
    """A task whose shim stays connected: output, exit code, STOP, heartbeats."""

    def __init__(self, proc: Proc, pid: int, heartbeat_interval: float) -> None:
        self.pid = pid
        self._proc = proc          # keep it: a collected paramiko stdin closes the channel
        self._interval = heartbeat_interval
        self._next_beat = time.monotonic() + heartbeat_interval
        self._lock = threading.Lock()
        self._dropped = False

    def read(self) -> bytes:
        """Next chunk of the task's output; b"" at EOF."""
        return self._proc.read()

    def wait(self, timeout: float | None = None) -> int | None:
        """The task's exit code (128+N when killed by signal N), None if still running."""
        return self._proc.wait(timeout)

    def stop(self) -> None:
        """Ask the shim to stop the task: TERM, grace, KILL, tag sweep."""
        self._send(b"STOP\n")

    def detach_kill(self) -> None:
        """Drop the channel; the shim's stdin-EOF watchdog kills the task."""
        with self._lock:
            self._dropped = True
            self._proc.kill()

    def _send(self, data: bytes) -> bool:
        with self._lock:
            if self._dropped:
                return False
            try:
                self._proc.write(data)
                return True
            except OSError:
                self._dropped = True   # the shim is gone: nothing left to keep alive
                return False

    def _beat(self, now: float) -> bool:
        """Send a heartbeat if one is due; False once the shim is gone."""
        if now < self._next_beat:
            return not self._dropped
        self._next_beat = now + self._interval
        return self._send(b"HB\n")


class HostAgent:
    def __init__(self, name: str, transport: Transport, python: str, cluster_dir: str,
                 *, in_process: bool | None = None) -> None:
        self.name = name
        self.in_process = in_process      # None: decide by transport and interpreter
        self._surveyed = None             # a survey answered by prepare(), used once
        self.transport = transport
        self.python = python
        self.cluster_dir = cluster_dir.rstrip("/")
        self._bindir: str | None = None       # absolute, once prepared
        self._info: HostInfo | None = None
        self._prepare_lock = threading.Lock()
        self._attached: list[AttachedTask] = []
        self._attached_lock = threading.Lock()
        self._heartbeat_thread: threading.Thread | None = None
        self._closing = threading.Event()

    # ------------------------------------------------------------ setup

    def prepare(self, survey: tuple[str, list[int]] | None = None) -> HostInfo:
        """Connect, ship the shim and server when their hashes changed, describe the host.

        `survey` = (tag prefix, ports): also answer survey() for them in the same round
        trip; survey() with the same arguments then returns that answer without asking."""
        with self._prepare_lock:
            if self._info is None:
                self._info = self._prepare(survey)
            return self._info

    @property
    def _in_process(self) -> bool:
        """A local host running tfcluster's own interpreter: one-shot shim commands run in
        this process (no interpreter start per action), and the shipped programs are used
        straight from the package. Attached tasks still get a shim process of their own."""
        if self.in_process is not None:
            return self.in_process
        return self.transport.is_local and self.python == sys.executable

    def _prepare(self, survey: tuple[str, list[int]] | None) -> HostInfo:
        if self._in_process:
            self._bindir = str(Path(__file__).parent)
            return _host_info(self._shim("info", {}))
        self.transport.connect()
        files = _shipped()
        request = {"bindir": f"{self.cluster_dir}/bin",
                   "files": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}}
        commands = [("info", {})]
        if survey is not None:
            commands += self._survey_commands(*survey)
        then = {"commands": [{"cmd": c, "req": r} for c, r in commands]}
        result = self.transport.run([self.python, "-c", BOOTSTRAP], _line(request) + _line(then))
        if result.rc == 127 or (result.rc != 0 and b"not found" in result.stderr):
            raise PreflightError(f"host {self.name}: {self.python} not found",
                                 hint="set `python:` in the spec to an interpreter that has tensorflow")
        lines = [json.loads(x) for x in result.stdout.splitlines() if x.strip().startswith(b"{")]
        if result.rc != 0 or not lines or "error" in lines[0]:
            why = lines[0].get("error") if lines else _tail(result.stderr) or f"exit status {result.rc}"
            raise PreflightError(f"host {self.name}: {self.python}: {why}")
        boot = lines[0]
        self._bindir = boot["bindir"]
        if not boot["stale"] and len(lines) > 1 and "answers" in lines[1]:
            answers = lines[1]["answers"]
        else:
            for name in boot["stale"]:
                self.transport.put(files[name], f"{self._bindir}/{name}", 0o700)
            answers = self._shim("batch", then)["answers"]
        if survey is not None and not any("error" in a for a in answers[1:] if isinstance(a, dict)):
            self._surveyed = (survey[0], tuple(survey[1]), answers[1], answers[2])
        return _host_info(answers[0])

    def _shim_argv(self, command: str) -> list[str]:
        if self._bindir is None:
            self.prepare()
        return [self.python, f"{self._bindir}/shim.py", command]

    def _shim(self, command: str, request: dict, timeout: float = 60.0):
        if self._in_process:
            return self._shim_here(command, request)
        result = self.transport.run(self._shim_argv(command), _line(request), timeout=timeout)
        answer = _last_json(result.stdout)
        if isinstance(answer, dict) and "error" in answer:
            raise TaskError(f"host {self.name}: {command}: {answer['error']}")
        if result.rc != 0 or answer is None:
            why = _tail(result.stderr) or f"exit status {result.rc}"
            raise TfclusterError(f"host {self.name}: shim {command} failed: {why}")
        return answer

    def _shim_here(self, command: str, request: dict):
        from tfcluster import shim

        try:
            return shim.COMMANDS[command](json.loads(json.dumps(request)))
        except shim.ShimError as e:
            raise TaskError(f"host {self.name}: {command}: {e}") from None
        except (OSError, KeyError, ValueError) as e:
            raise TaskError(f"host {self.name}: {command}: {type(e).__name__}: {e}") from None

    # ------------------------------------------------------------ queries

    def server_argv(self) -> tuple[str, ...]:
        if self._bindir is None:
            self.prepare()
        return (self.python, f"{self._bindir}/tfserver.py")

    def pidfile(self, tag: str) -> str:
        """Where stop/status look for a task's pid file."""
        return f"{self.cluster_dir}/pids/{tag.replace(':', '_')}.pid"

    def check_ports(self, ports: list[int]) -> dict[int, str | None]:
        """port -> None when free, else who holds it ("pid 123 (python3 ...)" or "in use")."""
        return _ports(self._shim("ports", {"ports": list(ports)}))

    def status(self, tag_prefix: str) -> list[TaskStatus]:
        return _statuses(self._shim("status", self._status_request(tag_prefix)))

    def survey(self, tag_prefix: str, ports: list[int]) -> tuple[list[TaskStatus], dict[int, str | None]]:
        """status() and check_ports() in one round trip (or none, when prepare() asked)."""
        cached, self._surveyed = self._surveyed, None
        if cached is not None and cached[:2] == (tag_prefix, tuple(ports)):
            status, held = cached[2], cached[3]
        else:
            status, held = self._batch(self._survey_commands(tag_prefix, ports))
        return _statuses(status), _ports(held)

    def _survey_commands(self, tag_prefix: str, ports: list[int]) -> list[tuple[str, dict]]:
        return [("status", self._status_request(tag_prefix)), ("ports", {"ports": list(ports)})]

    def _status_request(self, tag_prefix: str) -> dict:
        return {"piddir": f"{self.cluster_dir}/pids", "tag_prefix": tag_prefix}

    def _batch(self, commands: list[tuple[str, dict]]) -> list:
        if not commands:
            return []
        request = {"commands": [{"cmd": c, "req": r} for c, r in commands]}
        answers = self._shim("batch", request)["answers"]
        for (command, _), answer in zip(commands, answers):
            if isinstance(answer, dict) and "error" in answer:
                raise TaskError(f"host {self.name}: {command}: {answer['error']}")
        return answers

    def tail(self, path: str, lines: int = 20) -> str:
        return self._shim("tail", {"path": path, "lines": lines})["text"]

    def put_file(self, data: bytes, path: str, mode: int = 0o600) -> None:
        self.transport.put(data, path, mode)

    def sync_files(self, files: list[tuple[str, bytes, int]], dest: str) -> int:
        """Place (relative path, content, mode) files under `dest`, uploading only content
        the host's cache lacks (by sha256). Returns the number of bytes uploaded."""
        entries, by_digest = [], {}
        for rel, data, mode in files:
            digest = hashlib.sha256(data).hexdigest()
            by_digest[digest] = data
            entries.append({"path": rel, "sha256": digest, "mode": mode})
        request = {"cache": f"{self.cluster_dir}/cache", "dest": dest, "files": entries}
        if sum(len(d) for d in by_digest.values()) <= INLINE_LIMIT:
            # Resending a small script costs less than the two round trips that avoid it.
            request["inline"] = {d: base64.b64encode(data).decode() for d, data in by_digest.items()}
            answer = self._shim("files", request)
            return sum(len(by_digest[d]) for d in answer["added"])
        missing = self._shim("files", request)["missing"]
        for digest in missing:
            self.put_file(by_digest[digest], f"{self.cluster_dir}/cache/{digest}")
        if missing and self._shim("files", request)["missing"]:
            raise TfclusterError(f"host {self.name}: uploaded files did not appear in {dest}")
        return sum(len(by_digest[d]) for d in missing)

    # ------------------------------------------------------------ tasks

    def start_detached(self, t: TaskLaunch) -> int:
        """Start a task that outlives this process (servers); returns its pid."""
        return int(self._shim("start", _start_request(t, attached=False))["pid"])

    def start_attached(self, t: TaskLaunch, heartbeat_timeout: float = 30.0,
                       grace: float = 5.0) -> AttachedTask:
        """Start a task that dies with this agent (scripts): its shim stays connected."""
        request = _start_request(t, attached=True, heartbeat_timeout=heartbeat_timeout, grace=grace)
        try:
            proc = self.transport.spawn(self._shim_argv("start"))
        except OSError as e:
            raise PreflightError(f"host {self.name}: cannot run {self.python}: {e}") from None
        try:
            proc.write(_line(request))
            control = self._handshake(proc, t.tag)
        except BaseException:
            proc.kill()
            raise
        task = AttachedTask(proc, int(control["pid"]), heartbeat_timeout / 3.0)
        with self._attached_lock:
            self._attached.append(task)
        self._ensure_heartbeats()
        return task

    def _handshake(self, proc: Proc, tag: str) -> dict:
        """The shim's first stderr line: {"pid": N} or {"error": ...}."""
        buf = b""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        while b"\n" not in buf:
            buf += proc.read_stderr()
            if b"\n" in buf:
                break
            if proc.wait(0.02) is not None:
                buf += proc.read_stderr()
                if b"\n" not in buf:
                    raise TaskError(f"host {self.name}: {tag}: shim exited: {_tail(buf) or 'no output'}")
            if time.monotonic() > deadline:
                raise TaskError(f"host {self.name}: {tag}: shim did not start the task "
                                f"within {HANDSHAKE_TIMEOUT:g}s")
        control = json.loads(buf.split(b"\n", 1)[0])
        if "error" in control:
            raise TaskError(f"host {self.name}: {tag}: {control['error']}")
        return control

    def _ensure_heartbeats(self) -> None:
        if self._heartbeat_thread is None or not self._heartbeat_thread.is_alive():
            self._heartbeat_thread = threading.Thread(
                target=self._heartbeats, name=f"tfcluster-hb-{self.name}", daemon=True)
            self._heartbeat_thread.start()

    def _heartbeats(self) -> None:
        while not self._closing.wait(0.25):
            now = time.monotonic()
            with self._attached_lock:
                tasks = list(self._attached)
            gone = [task for task in tasks if not task._beat(now)]
            if gone:
                with self._attached_lock:
                    self._attached = [t for t in self._attached if t not in gone]

    def wait_ready(self, items: list[tuple[str, int, int]],
                   timeout: float) -> Iterator[tuple[str, str]]:
        """(key, port, pid) -> yields (key, "ready" | "exited" | "timeout") as each is decided."""
        request = {"items": [{"key": k, "port": p, "pid": pid} for k, p, pid in items],
                   "timeout": timeout}
        for answer in self._stream("wait", request, {key for key, _, _ in items}):
            yield answer["key"], answer["state"]

    def launch(self, servers: list[tuple[str, int, TaskLaunch]],
               timeout: float) -> Iterator[tuple[str, str, int | None]]:
        """Start detached servers (key, port, launch) and wait for them, in one round trip:
        yields (key, "started", pid) for each, then (key, "ready"|"exited"|"timeout", None)."""
        request = {"starts": [{"key": k, "port": p, "req": _start_request(t, attached=False)}
                              for k, p, t in servers], "timeout": timeout}
        for answer in self._stream("launch", request, {key for key, _, _ in servers}):
            if "pid" in answer:
                yield answer["key"], "started", int(answer["pid"])
            else:
                yield answer["key"], answer["state"], None

    def _stream(self, command: str, request: dict, keys: set[str]) -> Iterator[dict]:
        """A shim command answering one JSON line per event, until every key has a state."""
        if not keys:
            return
        proc = self.transport.spawn(self._shim_argv(command))
        pending = set(keys)
        try:
            proc.write(_line(request))
            proc.close_stdin()
            buf = b""
            while pending:
                chunk = proc.read()
                if not chunk:
                    raise TfclusterError(f"host {self.name}: {command} ended early: "
                                         f"{_tail(proc.read_stderr()) or 'no output'}")
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in filter(None, lines):
                    answer = json.loads(line)
                    if "error" in answer:
                        raise TaskError(f"host {self.name}: {command}: {answer['error']}")
                    if "state" in answer:
                        pending.discard(answer["key"])
                    yield answer
        finally:
            proc.kill()
            proc.wait(1.0)

    def stop(self, tag_prefix: str, grace: float = 5.0) -> StopReport:
        """Kill every task whose tag starts with tag_prefix (pid files + tag sweep)."""
        if not tag_prefix:
            raise ValueError("stop needs a tag prefix (an empty one would match every cluster)")
        answer = self._shim("stop", {"piddir": f"{self.cluster_dir}/pids", "tag_prefix": tag_prefix,
                                     "grace": grace}, timeout=grace + 60.0)
        return StopReport(stopped=tuple((s["tag"], int(s["pid"])) for s in answer["stopped"]),
                          survivors=tuple((s["tag"], int(s["pid"])) for s in answer["survivors"]))

    def close(self) -> None:
        """Drop every attached task's channel (their shims then kill them) and disconnect."""
        self._closing.set()
        with self._attached_lock:
            tasks, self._attached = self._attached, []
        for task in tasks:
            task.detach_kill()
        self.transport.close()


def _line(obj) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def _tail(data: bytes, limit: int = 300) -> str:
    text = data.decode(errors="replace").strip()
    return text[-limit:].replace("\n", " | ")


def _start_request(t: TaskLaunch, attached: bool, **extra) -> dict:
    request = {"tag": t.tag, "argv": list(t.argv), "env": dict(t.env), "cwd": t.cwd, "log": t.log,
               "pidfile": t.pidfile, "attached": attached, **extra}
    if t.port is not None:
        request["port"] = t.port
    return request
