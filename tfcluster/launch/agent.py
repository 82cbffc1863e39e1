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
from typing import Iterator

from tfcluster.host import shim_fs
from tfcluster.host import shim_protocol as proto
from tfcluster.host import HOST_DIR
from tfcluster.launch.bootstrap import NO_SITE, bootstrap_argv, cluster_tree, shipped
from tfcluster.launch.attached import AttachedTask, Heartbeats, handshake, json_object, tail_text
from tfcluster.errors import HostError, PreflightError
from tfcluster.launch.records import (HostInfo, StopReport, Survey, TaskLaunch, TaskStatus, host_info,
                                   last_json, ports_of, start_request, statuses_of)
from tfcluster.plan.names import ClusterPaths
from tfcluster.transport.base import Proc, Transport

INLINE_LIMIT = 512 * 1024     # files up to this much in all travel inside the request


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
        self.sweep_status = False   # surveys also find the cluster's tasks no pid file names
        self.more_answers: dict = {}          # prepare()'s `more` commands, answered
        self.info_request: dict = {}          # {"light": True}: machine id and Python only (Session)
        self._placed: tuple | None = None     # (files request, what the cache lacked) from prepare()
        self._prepare_lock = threading.Lock()
        self._heartbeats = Heartbeats(name)
        self.cancelled = threading.Event()    # set on Ctrl-C: start nothing new
        self._inflight: set[Proc] = set()
        self._inflight_lock = threading.Lock()

    # ------------------------------------------------------------ setup

    @property
    def in_process(self) -> bool:
        """A local host on tfcluster's own interpreter: one-shot commands need no process."""
        return self._in_process

    def prepare(self, survey: tuple[str, list[int]] | None = None, files: dict | None = None,
                more: dict | None = None, timeout: float = 60.0) -> HostInfo:
        """Connect, ship the shim when its hashes changed, describe the host.

        `survey` = (tag prefix, ports): answered in the same round trip; survey() with
        the same arguments then returns that answer without asking again. `files`: a
        files_request() placed from the host's cache in the same round trip; sync_files()
        with the same files then sends only what the cache lacked. `more`: other
        batchable commands (name -> request) for that round trip, run after info; their
        answers, error envelopes included, land in `more_answers` (`down`). `timeout`:
        seconds the round trip may take."""
        with self._prepare_lock:
            if self._info is None:
                self._info = self._prepare(survey, files, more or {}, timeout)
            elif more:
                self.more_answers = self._batch(more, unchecked=more, timeout=timeout)
            return self._info

    def prepare_commands(self, survey: tuple[str, list[int]] | None, files: dict | None,
                         more: dict | None = None) -> dict:
        """The batch prepare() asks: info, and the survey, files and `more` when given."""
        commands = {proto.INFO: dict(self.info_request)}
        if survey is not None:
            commands.update(self._survey_commands(*survey))
        if files is not None:
            commands[proto.FILES] = files
        commands.update(more or {})
        return commands

    def _prepare(self, survey: tuple[str, list[int]] | None, files: dict | None, more: dict,
                 timeout: float) -> HostInfo:
        commands = self.prepare_commands(survey, files, more)
        if self._in_process:
            self._bindir = HOST_DIR
            try:
                shim_fs.private_tree(cluster_tree(self.paths, self._wanted_bindir))
            except (shim_fs.Refused, OSError) as e:
                raise PreflightError(f"host {self.name}: {proto.describe_exception(e)}") from None
            answers = self._batch(commands, unchecked=more)
        else:
            answers = self._bootstrap(commands, more, timeout)
        self.more_answers = {name: answers[name] for name in more}
        return self.adopt(answers, survey, files)

    def adopt(self, answers: dict, survey: tuple[str, list[int]] | None = None,
              files: dict | None = None) -> HostInfo:
        """Take a batch's answers (info, and the survey and files asked with it) as prepare() would."""
        if survey is not None:
            self._surveyed = (survey[0], tuple(survey[1]), answers)
        if files is not None:
            self._placed = (files, tuple(answers[proto.FILES]["missing"]))
        self._info = host_info(answers[proto.INFO])
        return self._info

    def _bootstrap(self, commands: dict, unchecked=(), timeout: float = 60.0) -> dict:
        request, files = self.bootstrap_request()
        then = {"commands": commands}
        result = self.transport.run(bootstrap_argv(self.python), proto.json_line(request) + proto.json_line(then),
                                    timeout=timeout)
        lines = [x for x in map(json_object, result.stdout.splitlines()) if x is not None]
        boot = self.check_boot(result.rc, lines[:1], result.stderr)
        if not boot["stale"] and len(lines) > 1 and "answers" in lines[1]:
            return self._checked_answers(lines[1]["answers"], unchecked)
        self.ship_stale(boot["stale"], files)
        return self._batch(commands, unchecked, timeout)

    def bootstrap_request(self, command: str = proto.BATCH) -> tuple[dict, dict[str, bytes]]:
        """Connect; the bootstrap's request line (it then runs the shim's `command`), and
        the shipped files by name."""
        self._check_cancelled()
        self.transport.connect()
        files = shipped()
        return {"bindir": self._wanted_bindir, "dirs": cluster_tree(self.paths, self._wanted_bindir),
                "files": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()},
                "command": command}, files

    def boot_verdict(self, first: dict | None, proc: Proc) -> dict:
        """check_boot on a running bootstrap's first line; none: why, from its exit and stderr."""
        if first is None:
            self.check_boot(1 if (rc := proc.wait(10.0)) is None else rc, [], proc.read_stderr())
        return self.check_boot(None, [first], b"")

    def check_boot(self, rc: int | None, lines: list[dict], stderr: bytes) -> dict:
        """The bootstrap's first answer (bindir and stale files), or the PreflightError
        that says why there is none. `rc`: None while the bootstrap still runs."""
        if rc == 127 or (rc and b"not found" in stderr):
            raise PreflightError(f"host {self.name}: {self.python} not found",
                                 hint="set `python:` in the spec to an interpreter that has tensorflow")
        if lines and proto.error_of(lines[0]) is not None:   # too old, or the tree is not private
            raise PreflightError(f"host {self.name}: {proto.error_of(lines[0])}")
        if rc or not lines:
            raise PreflightError(f"host {self.name}: {self.python}: "
                                 f"{tail_text(stderr) or f'exit status {rc}'}")
        self._bindir = lines[0]["bindir"]
        return lines[0]

    def ship_stale(self, stale: list[str], files: dict[str, bytes]) -> None:
        self.transport.put_many([(files[name], f"{self._bindir}/{name}", 0o700) for name in stale])

    def _shim_argv(self, command: str) -> list[str]:
        if self._bindir is None:
            self.prepare()
        return [self.python, NO_SITE, f"{self._bindir}/shim.py", command]

    # ------------------------------------------------------------ the one call path

    def _call(self, command: str, request: dict, timeout: float = 60.0):
        """One one-shot shim command; its error envelope becomes a HostError (exit 1)."""
        if self._in_process and command in proto.IN_PROCESS:
            answer = _call_here(command, request)
        else:
            result = self.transport.run(self._shim_argv(command), proto.json_line(request), timeout=timeout)
            answer = last_json(result.stdout)
            if answer is None or (result.rc != 0 and proto.error_of(answer) is None):
                why = tail_text(result.stderr) or f"exit status {result.rc}"
                raise HostError(f"host {self.name}: shim {command} failed: {why}")
        problem = proto.error_of(answer)
        if problem is not None:
            raise HostError(f"host {self.name}: {command}: {problem}")
        return answer

    def _batch(self, commands: dict[str, dict], unchecked=(), timeout: float = 60.0) -> dict:
        """Several one-shot commands in one round trip; answers keyed by command. An error
        answer of a command in `unchecked` is left to the caller."""
        answers = self._call(proto.BATCH, {"commands": commands}, timeout)["answers"]
        return self._checked_answers(answers, unchecked)

    def _checked_answers(self, answers: dict, unchecked=()) -> dict:
        for command, answer in answers.items():
            problem = proto.error_of(answer)
            if problem is not None and command not in unchecked:
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
        return ports_of(self._call(proto.PORTS, {"ports": list(ports)}))

    def status(self, tag_prefix: str) -> list[TaskStatus]:
        return statuses_of(self._call(proto.STATUS, self._status_request(tag_prefix)))

    def survey(self, tag_prefix: str, ports: list[int]) -> Survey:
        """status() and check_ports() in one round trip (or none, when prepare() asked)."""
        cached, self._surveyed = self._surveyed, None
        if cached is not None and cached[:2] == (tag_prefix, tuple(ports)):
            answers = cached[2]
        else:
            answers = self._batch(self._survey_commands(tag_prefix, ports))
        return Survey(tuple(statuses_of(answers[proto.STATUS])), ports_of(answers[proto.PORTS]))

    def _survey_commands(self, tag_prefix: str, ports: list[int]) -> dict[str, dict]:
        status = dict(self._status_request(tag_prefix), **({"sweep": True} if self.sweep_status else {}))
        return {proto.STATUS: status, proto.PORTS: {"ports": list(ports)}}

    def _status_request(self, tag_prefix: str) -> dict:
        return {"piddir": self.paths.piddir, "tag_prefix": tag_prefix, "cluster_dir": self.paths.root}

    def tail(self, path: str, lines: int = 20) -> str:
        return self._call(proto.TAIL, {"path": path, "lines": lines})["text"]

    def files_request(self, files: list[tuple[str, bytes, int]], dest: str) -> dict:
        """The `files` request placing (relative path, content, mode) files under `dest`
        from the host's cache, by sha256 (no content in it)."""
        entries = [{"path": rel, "sha256": hashlib.sha256(data).hexdigest(), "mode": mode}
                   for rel, data, mode in files]
        return {"cache": self.paths.cache, "dest": dest, "files": entries}

    def sync_files(self, files: list[tuple[str, bytes, int]], dest: str) -> int:
        """Place (relative path, content, mode) files under `dest`, uploading only content
        the host's cache lacks (by sha256). Returns the number of bytes uploaded. When
        prepare() already placed these files from the cache, nothing is asked again."""
        self._check_cancelled()
        request = self.files_request(files, dest)
        placed, self._placed = self._placed, None
        if placed is not None and placed[0] == request and not placed[1]:
            return 0            # the bootstrap's round trip placed every one of them
        by_digest = {e["sha256"]: data for e, (_, data, _) in zip(request["files"], files)}
        if sum(len(d) for d in by_digest.values()) <= INLINE_LIMIT:
            # Resending a small script costs less than the two round trips that avoid it.
            request["inline"] = {d: base64.b64encode(data).decode() for d, data in by_digest.items()}
            return sum(len(by_digest[d]) for d in self._call(proto.FILES, request)["added"])
        known = placed is not None and placed[0] == request    # the bootstrap named what lacks
        missing = list(placed[1]) if known else self._call(proto.FILES, request)["missing"]
        self.transport.put_many([(by_digest[d], f"{self.paths.cache}/{d}", 0o600) for d in missing])
        if missing and self._call(proto.FILES, request)["missing"]:
            raise HostError(f"host {self.name}: uploaded files did not appear in {dest}")
        return sum(len(by_digest[d]) for d in missing)

    # ------------------------------------------------------------ tasks

    def start_attached(self, t: TaskLaunch, heartbeat_timeout: float = proto.DEFAULT_HEARTBEAT_TIMEOUT,
                       grace: float = proto.DEFAULT_GRACE, hold: bool = False,
                       restart: dict | None = None) -> AttachedTask:
        """Start a task that dies with this agent (scripts): its shim stays connected.
        `hold`: a warm server, which binds its port only after AttachedTask.go().
        `restart`: {"policy", "max_restarts", "done", "zero_ends"}: the shim restarts the
        task in place (shim_protocol.py)."""
        self._check_cancelled()
        request = {**start_request(t, self.paths.root), "attached": True, "hold": hold,
                   "heartbeat_timeout": heartbeat_timeout, "grace": grace, "deflate": self.transport.deflate_logs}
        if restart:
            request["restart"] = restart
        try:
            proc = self.transport.spawn(self._shim_argv(proto.START))
        except OSError as e:
            raise PreflightError(f"host {self.name}: cannot run {self.python}: {e}") from None
        with self._tracked(proc):
            try:
                proc.write(proto.json_line(request))
                said, err = handshake(proc, f"host {self.name}: {t.tag}")
            except BaseException:
                proc.kill()
                raise
        task = AttachedTask(proc, heartbeat_timeout / proto.HEARTBEATS_PER_TIMEOUT, said, err)
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
        request = {"starts": [{"key": k, "port": p, "req": start_request(t, self.paths.root, p)}
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
                    for answer in filter(None, map(json_object, lines)):   # not a login shell's words
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
        self.track(proc)
        try:
            yield
        finally:
            self.untrack(proc)

    def track(self, proc: Proc) -> None:
        with self._inflight_lock:
            self._inflight.add(proc)

    def untrack(self, proc: Proc) -> None:
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
    from tfcluster.host import shim
    try:
        return shim.COMMANDS[command](json.loads(json.dumps(request)))
    except (proto.ShimError, OSError, KeyError, ValueError) as e:
        return proto.error_answer(proto.describe_exception(e))
