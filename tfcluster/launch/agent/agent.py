"""HostAgent: everything tfcluster does on one host, through the shim.

The agent ships the shim's files to the host's bin directory and then runs
`PYTHON shim.py COMMAND` through its transport (the protocol is in shim_protocol.py
and docs/ARCHITECTURE.md). Every answer is read through lines.py, which checks the
shim's error envelope and turns it into a host-level error. A local host on
tfcluster's own interpreter answers the in-process-safe commands without a process.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import threading
import weakref
from typing import Callable, Iterator

from tfcluster.errors import HostError, PreflightError
from tfcluster.host import shim_protocol as proto
from tfcluster.launch.agent.attached import AttachedTask, Heartbeats, handshake
from tfcluster.launch.agent.bootstrap import ShimPlace, call_here
from tfcluster.launch.agent.lines import Conversation, Lines, checked, checked_answers, last_json, tail_text
from tfcluster.launch.agent.records import (
    HostInfo,
    StopReport,
    Survey,
    TaskLaunch,
    TaskStatus,
    event_of,
    host_info,
    ports_of,
    start_request,
    statuses_of,
    stop_report,
)
from tfcluster.plan import runs_in_process, shim_bindir
from tfcluster.plan.names import ClusterPaths
from tfcluster.transport.base import Proc, Transport

INLINE_LIMIT = 512 * 1024     # files up to this much in all travel inside the request
DOWN_SLACK = 60.0     # seconds `down`'s exec may take beyond its grace and settle (a loaded host's start)
KILL_SWEEP = 2.0      # shim_procs.kill_tasks: KILL and sweep after the grace


class HostAgent:
    def __init__(self, name: str, transport: Transport, python: str, cluster: ClusterPaths | str,
                 *, bindir: str | None = None, in_process: bool | None = None) -> None:
        """`bindir`: where the shim and the TF server live on the host (HostPlan.bindir); by
        default the plan's choice for this transport and interpreter, or the cluster's own
        bin directory when `in_process` is False. `in_process`: by default whether `bindir`
        is the package's own (the plan's decision, plan.runs_in_process)."""
        self.name = name
        self.transport = transport
        self.python = python
        self.paths = cluster if isinstance(cluster, ClusterPaths) else ClusterPaths(cluster.rstrip("/"))
        if bindir is None:
            bindir = (self.paths.bindir if in_process is False
                      else shim_bindir(transport.is_local, python, self.paths.root))
        self.bindir = bindir                  # as the plan wrote it (`~/` is expanded there)
        self._in_process = runs_in_process(bindir) if in_process is None else in_process
        self._shim = ShimPlace(name, transport, python, self.paths, bindir)
        self._info: HostInfo | None = None
        self._surveyed: tuple | None = None   # a survey prepare() answered, used once
        self.sweep_status = False   # surveys also find the cluster's tasks no pid file names
        self.info_request: dict = {}          # {"light": True}: machine id and Python only (Session)
        self.fence_request: dict | None = None  # asked with the survey: close the ports (launch/agent/fence.py)
        self.fence_answer: dict | None = None
        self._placed: tuple | None = None     # (files request, what the cache lacked) from prepare()
        self._prepare_lock = threading.Lock()
        self._heartbeats = Heartbeats(name)
        self.cancelled = threading.Event()    # set on Ctrl-C: start nothing new
        self._inflight: set[Proc] = set()
        self._talks: weakref.WeakSet = weakref.WeakSet()    # conversations opened, for interrupt()
        self._inflight_lock = threading.Lock()

    # ------------------------------------------------------------ setup

    @property
    def in_process(self) -> bool:
        """A local host on tfcluster's own interpreter: one-shot commands need no process."""
        return self._in_process

    @property
    def info(self) -> HostInfo | None:
        """What prepare() (or a conversation's first answer) said of the host; None before."""
        return self._info

    def prepare(self, survey: tuple[str, list[int]] | None = None, files: dict | None = None,
                timeout: float = 60.0) -> HostInfo:
        """Connect, ship the shim when its hashes changed, describe the host.

        `survey` = (tag prefix, ports): answered in the same round trip; survey() with
        the same arguments then returns that answer without asking again. `files`: a
        files_request() placed from the host's cache in the same round trip; sync_files()
        with the same files then sends only what the cache lacked. `timeout`: seconds the
        round trip may take."""
        return self._prepared(survey, files, {}, timeout)[0]

    def _prepared(self, survey, files, more: dict, timeout: float) -> tuple[HostInfo, dict]:
        """prepare(), with `more` batchable commands (name -> request) run after info in
        the same round trip; returns their answers too, error envelopes included."""
        with self._prepare_lock:
            if self._info is None:
                answers = self._prepare(survey, files, more, timeout)
            else:
                answers = self._batch(more, unchecked=more, timeout=timeout) if more else {}
            return self._info, {name: answers[name] for name in more}

    def _prepare_commands(self, survey: tuple[str, list[int]] | None, files: dict | None,
                          more: dict | None = None) -> dict:
        """The batch prepare() asks: info, and the survey, files and `more` when given."""
        commands = {proto.INFO: dict(self.info_request)}
        if survey is not None:
            commands.update(self._survey_commands(*survey))
            if self.fence_request is not None:     # before anything binds: in the same batch
                commands[proto.FENCE] = self.fence_request
        if files is not None:
            commands[proto.FILES] = files
        commands.update(more or {})
        return commands

    def _prepare(self, survey: tuple[str, list[int]] | None, files: dict | None, more: dict,
                 timeout: float) -> dict:
        commands = self._prepare_commands(survey, files, more)
        if self._in_process:
            self._shim.here()
            answers = self._batch(commands, unchecked=more)
        else:
            answers = self._bootstrap(commands, more, timeout)
        self._adopt(answers, survey, files)
        return answers

    def _adopt(self, answers: dict, survey: tuple[str, list[int]] | None = None,
               files: dict | None = None) -> HostInfo:
        """Take a batch's answers (info, and the survey and files asked with it)."""
        if survey is not None:
            self._surveyed = (survey[0], tuple(survey[1]), answers)
        if files is not None:
            self._placed = (files, tuple(answers[proto.FILES]["missing"]))
        if proto.FENCE in answers:
            self.fence_answer = answers[proto.FENCE]
        self._info = host_info(answers[proto.INFO])
        return self._info

    def _bootstrap(self, commands: dict, unchecked=(), timeout: float = 60.0) -> dict:
        self.check_cancelled()
        answers = self._shim.run(commands, timeout)
        if answers is None:      # stale files, shipped: the shim by path
            return self._batch(commands, unchecked, timeout)
        return checked_answers(answers, f"host {self.name}", unchecked)

    def _shim_argv(self, command: str) -> list[str]:
        if self._shim.bindir is None:
            self.prepare()
        return self._shim.argv(command)

    # ------------------------------------------------------------ conversations

    def open_conversation(self, talk: Conversation, command: str, request: dict, *,
                          batch: Callable[[dict, dict], dict] | None = None,
                          survey: tuple[str, list[int]] | None = None, files: dict | None = None) -> dict | None:
        """Run the shim's `command` on `request` for a conversation that goes on after this.

        `batch(request, commands)`: the request carrying prepare()'s batch (info, and the
        survey and files when given): it is then the host's bootstrap, which ships stale
        files and runs the command again by path (in-process: the shim runs from the
        package); its first answer is checked, adopted as prepare()'s would be, and
        returned. Without, the shim runs by path (the host prepared first)."""
        self._talks.add(talk)
        if batch is None:
            self._spawn_for(talk, self._shim_argv(command), proto.json_line(request))
            return None
        data = proto.json_line(batch(request, self._prepare_commands(survey, files)))
        self.check_cancelled()
        lines = self._shim.open(lambda argv, d: self._spawn_for(talk, argv, d), command, data, self._in_process)
        answer = lines.answer("answers")
        self._adopt(checked_answers(answer["answers"], f"host {self.name}"), survey, files)
        return answer

    def _spawn_for(self, talk: Conversation, argv: list[str], data: bytes) -> Lines:
        self.check_cancelled()
        lines = talk.attach(proc := self._spawn(argv))
        try:
            proc.write(data)
        except BrokenPipeError:     # it ended unread (no such python): its exit says why
            pass
        return lines

    def _spawn(self, argv: list[str]) -> Proc:
        try:
            return self.transport.spawn(argv)
        except OSError as e:
            raise PreflightError(f"host {self.name}: cannot run {self.python}: {e}") from None

    def spawn_shim(self, command: str) -> Proc:
        """A streaming shim command's process (cluster/reach.py speaks its lines)."""
        return self.transport.spawn(self._shim_argv(command))

    def keep_alive(self, task: AttachedTask) -> None:
        """Beat for an attached task until close(): silence stops its shim."""
        self._heartbeats.add(task)

    # ------------------------------------------------------------ the one call path

    def _call(self, command: str, request: dict, timeout: float = 60.0):
        """One one-shot shim command; its error envelope becomes a HostError (exit 1)."""
        if self._in_process and command in proto.IN_PROCESS:
            answer = call_here(command, request, self.cancelled.is_set)
        else:
            result = self.transport.run(self._shim_argv(command), proto.json_line(request), timeout=timeout)
            answer = last_json(result.stdout)
            if answer is None or result.rc != 0:
                checked(answer, f"host {self.name}: {command}")     # its own words, when it said any
                why = tail_text(result.stderr) or f"exit status {result.rc}"
                raise HostError(f"host {self.name}: shim {command} failed: {why}")
        return checked(answer, f"host {self.name}: {command}")

    def _batch(self, commands: dict[str, dict], unchecked=(), timeout: float = 60.0) -> dict:
        """Several one-shot commands in one round trip; answers keyed by command. An error
        answer of a command in `unchecked` is left to the caller."""
        answers = self._call(proto.BATCH, {"commands": commands}, timeout)["answers"]
        return checked_answers(answers, f"host {self.name}", unchecked)

    @property
    def reached(self) -> bool:
        """The bootstrap ran on the host: a batch sent with it may have acted there (its fence
        install among it), whether or not its answer came back before a Ctrl-C."""
        return self._shim.bindir is not None

    def check_cancelled(self) -> None:
        """Ctrl-C was pressed: start nothing new (KeyboardInterrupt)."""
        if self.cancelled.is_set():
            raise KeyboardInterrupt()

    # ------------------------------------------------------------ queries

    def fence(self, request: dict) -> dict:
        """Close the cluster's task ports now, outside the batch that opened the host (a
        restart after a move: run/recovery.py); the answer as that batch's would be."""
        self.fence_request = request
        self.fence_answer = self._call(proto.FENCE, request)
        return self.fence_answer

    def release_fence(self, request: dict) -> dict:
        """The cluster's table here goes if nothing of the cluster runs here any more (a `fence`
        request of mode `release`; unlike fence()'s, not kept as the host's fence_request)."""
        return self._call(proto.FENCE, request)

    @contextlib.contextmanager
    def run_command(self, argv: list[str]) -> Iterator[Proc]:
        """A plain command on the host, no shim (for `exec`); Ctrl-C drops it."""
        self.check_cancelled()
        self.transport.connect()
        proc = self.transport.spawn(argv)
        with self._tracked(proc):
            yield proc

    def server_argv(self) -> tuple[str, ...]:
        if self._shim.bindir is None:
            self.prepare()
        return (self.python, f"{self._shim.bindir}/tfserver.py")

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

    def surveyed(self) -> list[TaskStatus] | None:
        """The statuses the opening batch's survey found, left for survey() (which uses them
        up); None where none was asked or it failed."""
        cached = self._surveyed
        answer = cached[2].get(proto.STATUS) if cached is not None else None
        return None if answer is None or proto.error_of(answer) else statuses_of(answer)

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
        self.check_cancelled()
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
                       restart: dict | None = None, pidfile_on_go: str | None = None) -> AttachedTask:
        """Start a task that dies with this agent (scripts): its shim stays connected.
        `hold`: a warm server, which binds its port only after AttachedTask.go().
        `restart`: {"policy", "max_restarts", "done", "zero_ends"}: the shim restarts the
        task in place (shim_protocol.py). `pidfile_on_go`: where its pid file moves at GO
        (held with one of its own until then)."""
        self.check_cancelled()
        request = {**start_request(t, self.paths.root), "attached": True, "hold": hold,
                   "heartbeat_timeout": heartbeat_timeout, "grace": grace, "deflate": self.transport.deflate_logs}
        if pidfile_on_go:
            request["pidfile_on_go"] = pidfile_on_go
        if restart:
            request["restart"] = restart
        proc = self._spawn(self._shim_argv(proto.START))
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

    def wait_ready(self, items: list[tuple[str, int, int]], timeout: float,
                   settle: float = 0.0) -> Iterator[tuple[str, str, str | None]]:
        """(key, port, pid) -> yields (key, "ready" | "exited" | "timeout", None) as each is
        decided, or (key, "taken", holder) when someone else listens on the port (after
        `settle` seconds: the process it replaces may still be stopping)."""
        request = {"items": [{"key": k, "port": p, "pid": pid} for k, p, pid in items],
                   "timeout": timeout, "settle": settle}
        return map(event_of, self._stream(proto.WAIT, request, {key for key, _, _ in items}))

    def launch(self, servers: list[tuple[str, int, TaskLaunch]],
               timeout: float) -> Iterator[tuple[str, str, int | None]]:
        """Start detached servers (key, port, launch) and wait for them, in one round trip:
        yields (key, "started", pid) for each, then wait_ready's (key, state, holder)."""
        self.check_cancelled()
        request = {"starts": [{"key": k, "port": p, "req": start_request(t, self.paths.root, p)}
                              for k, p, t in servers],
                   "timeout": timeout, "watch_stdin": True}
        return map(event_of, self._stream(proto.LAUNCH, request, {key for key, _, _ in servers}, keep_stdin=True))

    def _stream(self, command: str, request: dict, keys: set[str], keep_stdin: bool = False) -> Iterator[dict]:
        """A shim command answering one JSON line per event, until every key has a state."""
        if not keys:
            return
        proc = self.transport.spawn(self._shim_argv(command))
        pending = set(keys)
        lines = Lines(proc, f"host {self.name}: {command}")
        with self._tracked(proc):
            try:
                proc.write(proto.json_line(request))
                if not keep_stdin:
                    proc.close_stdin()
                while pending:
                    answer = lines.next()
                    if answer is None:
                        self.check_cancelled()
                    lines.check(answer)
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
        shim then stops its task; a launch's shim starts no more servers; a conversation
        drops its process while it is being started)."""
        self.cancelled.set()
        with self._inflight_lock:
            procs, talks = list(self._inflight), list(self._talks)
        for proc in procs:
            proc.kill()
        for talk in talks:
            talk.interrupt()

    def stop(self, tag_prefix: str, grace: float = proto.DEFAULT_GRACE) -> StopReport:
        """Kill every task whose tag starts with tag_prefix (pid files + tag sweep)."""
        answer = self._call(proto.STOP, self._stop_request(tag_prefix, grace), timeout=grace + 60.0)
        return stop_report(answer)

    def down(self, tag_prefix: str, grace: float, settle: float,
             ports: list[int]) -> tuple[HostInfo, StopReport | HostError]:
        """prepare(), and in its round trip stop() then wait until `ports` bind again, up to
        `settle` seconds (shim.cmd_down). Returns the host's info and its StopReport (`busy`:
        ports still held), or the HostError of the stop: the host was reached all the same."""
        request = {**self._stop_request(tag_prefix, grace), "settle": settle, "ports": list(ports)}
        info, more = self._prepared(None, None, {proto.DOWN: request},
                                    timeout=DOWN_SLACK + grace + KILL_SWEEP + settle)
        try:
            return info, stop_report(checked(more[proto.DOWN], f"host {self.name}: {proto.STOP}"))
        except HostError as e:
            return info, e

    def _stop_request(self, tag_prefix: str, grace: float) -> dict:
        if not tag_prefix:
            raise ValueError("stop needs a tag prefix (an empty one would match every cluster)")
        return {**self._status_request(tag_prefix), "grace": grace}

    def close(self) -> None:
        """Drop every attached task's channel (their shims then kill them) and disconnect."""
        self._heartbeats.close()
        self.transport.close()
