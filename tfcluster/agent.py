"""HostAgent: everything tfcluster does on one host, through the shim.

The agent ships the shim's files to the host's bin directory and then runs
`PYTHON shim.py COMMAND` through its transport (the protocol is in shim_protocol.py
and docs/ARCHITECTURE.md). Every one-shot command goes through `_call`, which checks
the error envelope once and turns it into a host-level error. A local host on
tfcluster's own interpreter answers the in-process-safe commands without a process.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import sys
import threading
from dataclasses import dataclass
from typing import Iterator

from tfcluster import shim_fs
from tfcluster import shim_protocol as proto
from tfcluster.bootstrap import BOOTSTRAP, PACKAGE_DIR, cluster_tree, shipped
from tfcluster.attached import AttachedTask, Heartbeats, handshake, tail_text
from tfcluster.errors import HostError, PreflightError
from tfcluster.names import ClusterPaths
from tfcluster.transport.base import Proc, Transport

INLINE_LIMIT = 512 * 1024     # files up to this much in all travel inside the request


@dataclass(frozen=True)
class HostInfo:
    python_version: str
    tf_version: str | None
    machine_id: str
    gpus: int
    cuda_version: str | None = None     # what TF was built with; None for a CPU build
    cudnn_version: str | None = None
    driver_version: str | None = None   # the NVIDIA driver, when nvidia-smi answers
    tensorboard_version: str | None = None
    proxy: tuple[tuple[str, str], ...] = ()   # the proxy variables tasks inherit (shim_net)


@dataclass(frozen=True)
class TaskLaunch:
    """One process to start: every name in it comes from tfcluster.names."""

    tag: str
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    log: str
    pidfile: str
    no_proxy: tuple[str, ...] = ()      # kept off any proxy the host's environment sets


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


@dataclass(frozen=True)
class Survey:
    statuses: tuple[TaskStatus, ...]
    ports: dict[int, str | None]       # port -> None when free, else its holder


class HostAgent:
    def __init__(self, name: str, transport: Transport, python: str, cluster: ClusterPaths | str,
                 *, bindir: str | None = None, in_process: bool | None = None) -> None:
        self.name = name
        self.transport = transport
        self.python = python
        self.paths = cluster if isinstance(cluster, ClusterPaths) else ClusterPaths(cluster.rstrip("/"))
        self._wanted_bindir = bindir or self.paths.bindir
        self._in_process = (in_process if in_process is not None
                            else transport.is_local and python == sys.executable)
        self._bindir: str | None = None       # absolute, once prepared
        self._info: HostInfo | None = None
        self._surveyed: tuple | None = None   # a survey prepare() answered, used once
        self._prepare_lock = threading.Lock()
        self._heartbeats = Heartbeats(name)
        self.cancelled = threading.Event()    # set on Ctrl-C: start nothing new
        self._inflight: set[Proc] = set()
        self._inflight_lock = threading.Lock()

    # ------------------------------------------------------------ setup

    def prepare(self, survey: tuple[str, list[int]] | None = None) -> HostInfo:
        """Connect, ship the shim when its hashes changed, describe the host.

        `survey` = (tag prefix, ports): answered in the same round trip; survey() with
        the same arguments then returns that answer without asking again."""
        with self._prepare_lock:
            if self._info is None:
                self._info = self._prepare(survey)
            return self._info

    def _prepare(self, survey: tuple[str, list[int]] | None) -> HostInfo:
        commands = {proto.INFO: {}}
        if survey is not None:
            commands.update(self._survey_commands(*survey))
        if self._in_process:
            self._bindir = PACKAGE_DIR
            try:
                shim_fs.private_tree(cluster_tree(self.paths, self._wanted_bindir))
            except (shim_fs.Refused, OSError) as e:
                raise PreflightError(f"host {self.name}: {proto.describe_exception(e)}") from None
            answers = self._batch(commands)
        else:
            answers = self._bootstrap(commands)
        if survey is not None:
            self._surveyed = (survey[0], tuple(survey[1]), answers)
        info = answers[proto.INFO]
        return HostInfo(python_version=info["python_version"], tf_version=info["tf_version"],
                        machine_id=info["machine_id"], gpus=int(info["gpus"]),
                        **{k: info.get(k) for k in ("cuda_version", "cudnn_version", "driver_version")},
                        tensorboard_version=info.get("tensorboard_version"),
                        proxy=tuple(sorted((info.get("proxy") or {}).items())))

    def _bootstrap(self, commands: dict) -> dict:
        self._check_cancelled()
        self.transport.connect()
        files = shipped()
        request = {"bindir": self._wanted_bindir, "dirs": cluster_tree(self.paths, self._wanted_bindir),
                   "files": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}}
        then = {"commands": commands}
        result = self.transport.run([self.python, "-c", BOOTSTRAP], proto.json_line(request) + proto.json_line(then))
        if result.rc == 127 or (result.rc != 0 and b"not found" in result.stderr):
            raise PreflightError(f"host {self.name}: {self.python} not found",
                                 hint="set `python:` in the spec to an interpreter that has tensorflow")
        lines = [json.loads(x) for x in result.stdout.splitlines() if x.strip().startswith(b"{")]
        if lines and proto.error_of(lines[0]) is not None:   # too old, or the tree is not private
            raise PreflightError(f"host {self.name}: {proto.error_of(lines[0])}")
        if result.rc != 0 or not lines:
            raise PreflightError(f"host {self.name}: {self.python}: "
                                 f"{tail_text(result.stderr) or f'exit status {result.rc}'}")
        boot = lines[0]
        self._bindir = boot["bindir"]
        if not boot["stale"] and len(lines) > 1 and "answers" in lines[1]:
            return self._checked_answers(lines[1]["answers"])
        for name in boot["stale"]:
            self.transport.put(files[name], f"{self._bindir}/{name}", 0o700)
        return self._batch(commands)

    def _shim_argv(self, command: str) -> list[str]:
        if self._bindir is None:
            self.prepare()
        return [self.python, f"{self._bindir}/shim.py", command]

    # ------------------------------------------------------------ the one call path

    def _call(self, command: str, request: dict, timeout: float = 60.0):
        """One one-shot shim command; its error envelope becomes a HostError (exit 1)."""
        if self._in_process and command in proto.IN_PROCESS:
            answer = _call_here(command, request)
        else:
            result = self.transport.run(self._shim_argv(command), proto.json_line(request), timeout=timeout)
            answer = _last_json(result.stdout)
            if answer is None or (result.rc != 0 and proto.error_of(answer) is None):
                why = tail_text(result.stderr) or f"exit status {result.rc}"
                raise HostError(f"host {self.name}: shim {command} failed: {why}")
        problem = proto.error_of(answer)
        if problem is not None:
            raise HostError(f"host {self.name}: {command}: {problem}")
        return answer

    def _batch(self, commands: dict[str, dict]) -> dict:
        """Several one-shot commands in one round trip; answers keyed by command."""
        return self._checked_answers(self._call(proto.BATCH, {"commands": commands})["answers"])

    def _checked_answers(self, answers: dict) -> dict:
        for command, answer in answers.items():
            problem = proto.error_of(answer)
            if problem is not None:
                raise HostError(f"host {self.name}: {command}: {problem}")
        return answers

    def _check_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise KeyboardInterrupt()

    # ------------------------------------------------------------ queries

    @contextlib.contextmanager
    def run_command(self, argv: list[str]) -> Iterator[Proc]:
        """A plain command on the host, no shim (for `exec`); Ctrl-C drops it."""
        self._check_cancelled()
        self.transport.connect()
        proc = self.transport.spawn(argv)
        with self._tracked(proc):
            yield proc

    def server_argv(self) -> tuple[str, ...]:
        if self._bindir is None:
            self.prepare()
        return (self.python, f"{self._bindir}/tfserver.py")

    def check_ports(self, ports: list[int]) -> dict[int, str | None]:
        """port -> None when free, else who holds it ("pid 123 (python3 ...)" or "in use")."""
        return _ports(self._call(proto.PORTS, {"ports": list(ports)}))

    def status(self, tag_prefix: str) -> list[TaskStatus]:
        return _statuses(self._call(proto.STATUS, self._status_request(tag_prefix)))

    def survey(self, tag_prefix: str, ports: list[int]) -> Survey:
        """status() and check_ports() in one round trip (or none, when prepare() asked)."""
        cached, self._surveyed = self._surveyed, None
        if cached is not None and cached[:2] == (tag_prefix, tuple(ports)):
            answers = cached[2]
        else:
            answers = self._batch(self._survey_commands(tag_prefix, ports))
        return Survey(tuple(_statuses(answers[proto.STATUS])), _ports(answers[proto.PORTS]))

    def _survey_commands(self, tag_prefix: str, ports: list[int]) -> dict[str, dict]:
        return {proto.STATUS: self._status_request(tag_prefix), proto.PORTS: {"ports": list(ports)}}

    def _status_request(self, tag_prefix: str) -> dict:
        return {"piddir": self.paths.piddir, "tag_prefix": tag_prefix, "cluster_dir": self.paths.root}

    def tail(self, path: str, lines: int = 20) -> str:
        return self._call(proto.TAIL, {"path": path, "lines": lines})["text"]

    def sync_files(self, files: list[tuple[str, bytes, int]], dest: str) -> int:
        """Place (relative path, content, mode) files under `dest`, uploading only content
        the host's cache lacks (by sha256). Returns the number of bytes uploaded."""
        self._check_cancelled()
        entries, by_digest = [], {}
        for rel, data, mode in files:
            digest = hashlib.sha256(data).hexdigest()
            by_digest[digest] = data
            entries.append({"path": rel, "sha256": digest, "mode": mode})
        request = {"cache": self.paths.cache, "dest": dest, "files": entries}
        if sum(len(d) for d in by_digest.values()) <= INLINE_LIMIT:
            # Resending a small script costs less than the two round trips that avoid it.
            request["inline"] = {d: base64.b64encode(data).decode() for d, data in by_digest.items()}
            return sum(len(by_digest[d]) for d in self._call(proto.FILES, request)["added"])
        missing = self._call(proto.FILES, request)["missing"]
        for digest in missing:
            self.transport.put(by_digest[digest], f"{self.paths.cache}/{digest}")
        if missing and self._call(proto.FILES, request)["missing"]:
            raise HostError(f"host {self.name}: uploaded files did not appear in {dest}")
        return sum(len(by_digest[d]) for d in missing)

    # ------------------------------------------------------------ tasks

    def start_attached(self, t: TaskLaunch, heartbeat_timeout: float = proto.DEFAULT_HEARTBEAT_TIMEOUT,
                       grace: float = proto.DEFAULT_GRACE) -> AttachedTask:
        """Start a task that dies with this agent (scripts): its shim stays connected."""
        self._check_cancelled()
        request = {**_start_request(t, self.paths.root), "attached": True,
                   "heartbeat_timeout": heartbeat_timeout, "grace": grace}
        try:
            proc = self.transport.spawn(self._shim_argv(proto.START))
        except OSError as e:
            raise PreflightError(f"host {self.name}: cannot run {self.python}: {e}") from None
        with self._tracked(proc):
            try:
                proc.write(proto.json_line(request))
                pid = handshake(proc, f"host {self.name}: {t.tag}")
            except BaseException:
                proc.kill()
                raise
        task = AttachedTask(proc, pid, heartbeat_timeout / proto.HEARTBEATS_PER_TIMEOUT)
        self._heartbeats.add(task)
        return task

    def wait_ready(self, items: list[tuple[str, int, int]],
                   timeout: float) -> Iterator[tuple[str, str, str | None]]:
        """(key, port, pid) -> yields (key, "ready" | "exited" | "timeout", None) as each is
        decided, or (key, "taken", holder) when someone else listens on the port."""
        request = {"items": [{"key": k, "port": p, "pid": pid} for k, p, pid in items],
                   "timeout": timeout}
        for answer in self._stream(proto.WAIT, request, {key for key, _, _ in items}):
            yield answer["key"], answer["state"], answer.get("holder")

    def launch(self, servers: list[tuple[str, int, TaskLaunch]],
               timeout: float) -> Iterator[tuple[str, str, int | None]]:
        """Start detached servers (key, port, launch) and wait for them, in one round trip:
        yields (key, "started", pid) for each, then wait_ready's (key, state, holder)."""
        self._check_cancelled()
        request = {"starts": [{"key": k, "port": p, "req": _start_request(t, self.paths.root)}
                              for k, p, t in servers],
                   "timeout": timeout, "watch_stdin": True}
        for answer in self._stream(proto.LAUNCH, request, {key for key, _, _ in servers}, keep_stdin=True):
            if "pid" in answer:
                yield answer["key"], "started", int(answer["pid"])
            else:
                yield answer["key"], answer["state"], answer.get("holder")

    def _stream(self, command: str, request: dict, keys: set[str], keep_stdin: bool = False) -> Iterator[dict]:
        """A shim command answering one JSON line per event, until every key has a state."""
        if not keys:
            return
        proc = self.transport.spawn(self._shim_argv(command))
        pending = set(keys)
        with self._tracked(proc):
            try:
                proc.write(proto.json_line(request))
                if not keep_stdin:
                    proc.close_stdin()
                buf = b""
                while pending:
                    chunk = proc.read()
                    if not chunk:
                        self._check_cancelled()
                        raise HostError(f"host {self.name}: {command} ended early: "
                                        f"{tail_text(proc.read_stderr()) or 'no output'}")
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    for line in filter(None, lines):
                        answer = json.loads(line)
                        if proto.error_of(answer) is not None:
                            raise HostError(f"host {self.name}: {command}: {proto.error_of(answer)}")
                        if "state" in answer:
                            pending.discard(answer["key"])
                        yield answer
            finally:
                proc.kill()
                proc.wait(1.0)

    @contextlib.contextmanager
    def _tracked(self, proc: Proc) -> Iterator[None]:
        """While a start is in flight, interrupt() can drop it."""
        with self._inflight_lock:
            self._inflight.add(proc)
        try:
            yield
        finally:
            with self._inflight_lock:
                self._inflight.discard(proc)

    def interrupt(self) -> None:
        """Ctrl-C: start nothing new and drop what is being started right now (a start's
        shim then stops its task; a launch's shim starts no more servers)."""
        self.cancelled.set()
        with self._inflight_lock:
            procs = list(self._inflight)
        for proc in procs:
            proc.kill()

    def stop(self, tag_prefix: str, grace: float = proto.DEFAULT_GRACE) -> StopReport:
        """Kill every task whose tag starts with tag_prefix (pid files + tag sweep)."""
        if not tag_prefix:
            raise ValueError("stop needs a tag prefix (an empty one would match every cluster)")
        answer = self._call(proto.STOP, {**self._status_request(tag_prefix), "grace": grace},
                            timeout=grace + 60.0)
        return StopReport(stopped=tuple((s["tag"], int(s["pid"])) for s in answer["stopped"]),
                          survivors=tuple((s["tag"], int(s["pid"])) for s in answer["survivors"]))

    def close(self) -> None:
        """Drop every attached task's channel (their shims then kill them) and disconnect."""
        self._heartbeats.close()
        self.transport.close()


def _call_here(command: str, request: dict):
    from tfcluster import shim

    try:
        return shim.COMMANDS[command](json.loads(json.dumps(request)))
    except (proto.ShimError, OSError, KeyError, ValueError) as e:
        return proto.error_answer(proto.describe_exception(e))


def _ports(answer: dict) -> dict[int, str | None]:
    return {int(p): holder for p, holder in answer.items()}


def _statuses(answer: list) -> list[TaskStatus]:
    return [TaskStatus(tag=s["tag"], pid=int(s["pid"]), alive=bool(s["alive"]),
                       uptime_s=s.get("uptime_s"), log=s.get("log") or "") for s in answer]


def _last_json(out: bytes):
    lines = [line for line in out.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1]) if lines else None
    except ValueError:
        return None



def _start_request(t: TaskLaunch, cluster_dir: str) -> dict:
    """The host adds the identity of `cluster_dir` to the tag (docs/ARCHITECTURE.md, "Naming")."""
    return {"tag": t.tag, "argv": list(t.argv), "env": dict(t.env), "cwd": t.cwd, "log": t.log,
            "pidfile": t.pidfile, "no_proxy": list(t.no_proxy), "cluster_dir": cluster_dir}
