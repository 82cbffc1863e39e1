"""The host's side of a task's life: spawning it (own session, tag, pid file, log
file) and, for an attached task, copying its log to the launcher while watching the
launcher's heartbeats and STOP line.

Shipped beside shim.py (standard library only, Python >= 3.8).
"""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time

if __package__:
    from . import shim_cgroup as cgroup
    from . import shim_fs as fs
    from . import shim_net as net
    from . import shim_procs as procs
    from . import shim_protocol as proto
    from . import shim_talk as talk
else:  # shipped: the shim's directory is first on sys.path
    import shim_cgroup as cgroup
    import shim_fs as fs
    import shim_net as net
    import shim_procs as procs
    import shim_protocol as proto
    import shim_talk as talk

expand, proc_stat, kill_tasks = fs.expand, procs.proc_stat, procs.kill_tasks
exit_code, write_pidfile = procs.exit_code, procs.write_pidfile
write_all, POLL = procs.write_all, procs.POLL
ShimError, TAG_VAR = proto.ShimError, proto.TAG_VAR
# A fresh attempt's first bytes should not wait a whole POLL: the tailer polls every
# FAST_POLL for the first FAST_WINDOW seconds of each attempt (a Python start is ~50 ms;
# 500 reads of an idle file cost ~5 ms of CPU).
FAST_POLL, FAST_WINDOW = 0.002, 1.0
TAIL_CHUNK = 1 << 20     # at most this much of a log per copy to the channel
DEFLATE_CHUNK = 1 << 18  # ... per deflated copy (docs/design/logs.md, "Deflated logs")
# set: this shim's task was stopped by a move that starts the cluster's next tasks on this
# host (STOP_KEEP_LINE); its end then leaves the host's fence table in place (shim.cmd_start)
FENCE_KEPT = threading.Event()


class _NoSendfile(Exception):
    pass


def _sendfile(f, pos: int, want: int) -> int:
    """Bytes of `f` from `pos` (at most `want`) put on stdout by the kernel; 0 at its end."""
    if not want:
        return 0
    try:
        return os.sendfile(1, f.fileno(), pos, want)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE):
            raise _NoSendfile() from None
        raise


def _read_write(f, pos: int, want: int) -> int:
    f.seek(pos)
    chunk = f.read(min(want, 65536))
    if chunk:
        write_all(1, chunk)
    return len(chunk)


def _deflater():
    """A copy that deflates, flushed per chunk; None where this interpreter has no zlib."""
    try:
        import zlib
    except ImportError:
        return None
    z = zlib.compressobj(1, zlib.DEFLATED, -15)   # raw: no adler32, SSH checks the bytes

    def copy(f, pos: int, want: int) -> int:
        f.seek(pos)
        chunk = f.read(min(want, DEFLATE_CHUNK))
        if chunk:
            write_all(1, z.compress(chunk) + z.flush(zlib.Z_SYNC_FLUSH))
        return len(chunk)
    return copy


def open_private(path: str) -> int:
    """The task's log, appended to; its directory private, a link in its place refused."""
    fs.private_dir(os.path.dirname(path) or ".")
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)


def task_env(req: dict) -> dict:
    """The environment a task of `req` starts with: the shim's, the request's, the proxy
    guard, its tag, the probe (a warm standby compares its own with it: shim_warm.py)."""
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
    env.update(net.guard_env(env, req.get("no_proxy") or ()))  # the cluster's addresses
    env[TAG_VAR] = req["tag"]
    env[proto.SHIM_VAR] = str(os.getpid())
    if req.get("hold"):      # a warm server: imports TF, then waits for GO on its stdin (shim_launch.py)
        env[proto.HOLD_VAR] = "1"
    if env.get(proto.PROBE_VAR) or env.get(proto.FLUSH_VAR, "0") not in ("", "0"):
        _add_probe(env)
    return env


def spawn(req: dict) -> tuple[subprocess.Popen, str, int]:
    """Start the task; returns (popen, log path, log offset before the task wrote)."""
    tag = req["tag"]
    argv = [expand(a) if a.startswith("~/") else a for a in req["argv"]]
    cwd = expand(req.get("cwd") or "~")
    log, pidfile = expand(req["log"]), expand(req["pidfile"])
    fs.private_dir(cwd)
    fs.private_dir(os.path.dirname(pidfile))
    env = task_env(req)
    if req.get("private_tmp"):      # the task's temporary files in its own private directory
        env["TMPDIR"] = os.path.abspath(cwd)
    log_fd = open_private(log)
    offset = os.fstat(log_fd).st_size
    cgroup.join(req.get("cluster_dir"))   # the task is born in its cluster's cgroup (the fence's match)
    try:
        stdin = subprocess.PIPE if req.get("hold") else subprocess.DEVNULL
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=stdin, stdout=log_fd,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    except OSError as e:
        raise ShimError("cannot start %s: %s" % (argv[0], e))
    finally:
        os.close(log_fd)
    stat = proc_stat(proc.pid)
    record = {"pid": proc.pid, "start_time": stat[1] if stat else None,
              "started_at": time.time(), "tag": tag, "argv": argv, "log": log}
    if req.get("port") is not None:
        record["port"] = req["port"]
    if req.get("hold"):
        record["warm"] = True     # not a server yet: status says so, `up` does not count it
    write_pidfile(pidfile, record)
    return proc, log, offset


def release(proc: subprocess.Popen, pidfile: str, then: str | None = None, go: bytes = proto.GO_LINE) -> str:
    """GO to a task started with `hold` (a warm server). Its pid file loses the mark first:
    a released server binds within milliseconds, and a status read then must not call it warm.
    `then`: the task's own pid file, where the record moves now (a server held before a break
    kept one of its own until GO: the old server it replaces had the task's). `go`: the line,
    GO or GO with the server's TF_CONFIG. Returns the path the record is at."""
    if proc.stdin is None:
        return pidfile
    _unmark_warm(expand(pidfile))
    if then:
        try:
            os.replace(expand(pidfile), expand(then))
            pidfile = then
        except OSError:
            pass
    try:
        proc.stdin.write(go)
        proc.stdin.close()
    except OSError:
        pass                        # it died warm: its exit says so
    return pidfile


def _unmark_warm(path: str) -> None:
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read())
    except (OSError, ValueError):
        return
    record.pop("warm", None)
    write_pidfile(path, record)


def _add_probe(env: dict) -> None:
    """Put the start-up probe (probe/sitecustomize.py beside this file) first on the
    task's PYTHONPATH; the probe takes itself off again for the task's children."""
    probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe")
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = probe + (os.pathsep + rest if rest else "")


def is_stop(line: bytes) -> bool:
    """Whether a control line is STOP (either kind; STOP_KEEP_LINE sets FENCE_KEPT)."""
    word = line.strip()
    if word == proto.STOP_KEEP_LINE.strip():
        FENCE_KEPT.set()
        return True
    return word == proto.STOP_LINE.strip()


def held(req: dict):
    """A deferred attached start (`defer`): nothing is spawned before the launcher's GO line.
    Until then the launcher may hold reach's conversation here (shim_talk.Reach; a `{"close"}`
    line -> `{"closed"}` once the listeners are gone); answers on stdout (the task's output
    comes only after GO). Returns stdin's line queue at GO; None on EOF, STOP, or silence
    (heartbeats included) longer than the heartbeat timeout: nothing was started, and the
    listeners close with the process."""
    lines = talk.stdin_lines()
    silence = float(req.get("heartbeat_timeout") or proto.DEFAULT_HEARTBEAT_TIMEOUT)
    reach = talk.Reach(req.get("cluster_dir"))
    try:
        while True:
            line = talk.next_line(lines, time.monotonic() + silence)
            if line is None or is_stop(line):
                return None
            if line == proto.GO_LINE:
                return lines
            if line == proto.HEARTBEAT_LINE:
                continue
            if not reach.answer(json.loads(line)):
                write_all(1, proto.json_line({"closed": True}))
    finally:
        reach.close()


class Attached:
    """An attached task: log bytes to stdout, heartbeats/STOP on stdin, watchdog; with
    a restart policy in its request it restarts the task in place (shim_protocol.py).
    `lines`: stdin's line queue when a reader already owns stdin (a deferred start)."""

    def __init__(self, proc: subprocess.Popen, req: dict, log: str, offset: int, lines=None) -> None:
        self.proc, self.req, self.log, self.offset = proc, req, log, offset
        restart = req.get("restart") or {}
        self.policy, self.max_restarts = restart.get("policy"), int(restart.get("max_restarts") or 0)
        self.restarts = int(restart.get("done") or 0)
        self.zero_ends = bool(restart.get("zero_ends"))   # a script's exit 0 is its success
        self.limit = None                # a log offset the tailer must not pass yet (an unconfirmed attempt)
        self.confirmed = threading.Event()   # set: the launcher confirmed every restart so far
        self.confirmed.set()
        self.tail_wake = threading.Event()
        self.attempt_started = time.monotonic()
        self.lines = lines
        self.tag = req["tag"]
        self.owner = str(os.getpid())    # our sweeps spare an attempt another shim started (SHIM_VAR)
        self.hb_timeout = float(req.get("heartbeat_timeout") or proto.DEFAULT_HEARTBEAT_TIMEOUT)
        self.grace = float(req.get("grace") if req.get("grace") is not None else proto.DEFAULT_GRACE)
        self.last_beat = time.monotonic()
        self.reason = None          # "stop" | "eof" | "signal" once cleanup is wanted
        self.wake = threading.Event()
        self.quiet = threading.Event()   # set: the tailer must not write any more
        self.task_done = threading.Event()
        self.swept = False               # our sweep left nothing of the task's tag
        self.deflate = _deflater() if req.get("deflate") else None   # the channel carries deflated bytes
        self.said: dict = {}             # more for the handshake (a warm standby's take: shim_warm.py)

    def run(self) -> int:
        for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.on_signal)   # a handler, not SIG_IGN: the task must not inherit it
        try:
            write_all(2, proto.json_line(dict(self.said, pid=self.proc.pid, deflate=self.deflate is not None)))
        except OSError:           # the launcher left between our start and the handshake
            self.reason = "eof"
        tailer = threading.Thread(target=self.tail, daemon=True)
        tailer.start()
        threading.Thread(target=self.read_stdin, daemon=True).start()
        # the task's exit wakes the loop at once (a restart waits on this), not the next tick
        threading.Thread(target=self.watch_exit, args=(self.proc,), daemon=True).start()
        while True:
            self.wake.clear()          # before the poll: an exit after it still wakes the wait
            if self.proc.poll() is not None and self.confirmed.is_set():
                if self.restart():
                    continue
                break
            if self.reason is None and time.monotonic() - self.last_beat > self.hb_timeout:
                self.reason = "heartbeat"
            if self.reason is not None:
                return self.stop(tailer)
            self.wake.wait(0.1)
        self.finish()
        tailer.join()
        return self.last_word(exit_code(self.proc.returncode))

    def watch_exit(self, proc: subprocess.Popen) -> None:
        """Wake the loop when the task exits, without reaping it (WNOWAIT): only the loop
        reaps, so the task's pid and group stay ours until stop() is done with them."""
        try:
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        except (OSError, AttributeError):  # already reaped; no waitid: the 0.1 s tick remains
            pass
        self.wake.set()

    def on_signal(self, signum, frame) -> None:
        self.reason = self.reason or "signal"
        self.wake.set()

    def read_stdin(self) -> None:
        stdin = sys.stdin.buffer
        while True:
            if self.lines is not None:
                line = self.lines.get() or b""
            else:
                try:
                    line = stdin.readline()
                except (OSError, ValueError):
                    line = b""
            if not line:
                self.reason = self.reason or "eof"
                break
            self.last_beat = time.monotonic()
            if line == proto.GO_LINE or line.startswith(proto.GO_WITH):
                if line != proto.GO_LINE:      # its TF_CONFIG, for an in-place restart too
                    self.req["env"] = dict(self.req.get("env") or {},
                                           TF_CONFIG=line[len(proto.GO_WITH):].decode().strip())
                self.req["pidfile"] = release(self.proc, self.req["pidfile"], self.req.get("pidfile_on_go"), line)
            elif line == proto.CONTINUE_LINE:
                self.limit = None          # the new attempt's output may follow
                self.confirmed.set()
                self.tail_wake.set()
                self.wake.set()
            elif line == proto.SAVE_LINE:
                self.request_save()
            elif is_stop(line):
                self.reason = self.reason or "stop"
                break
        self.wake.set()

    def request_save(self) -> None:
        """The checkpoint request: SIGUSR1 to the running attempt (a script that handles it
        saves and trains on; one that does not inherited SIG_IGN for it from the shim's main)."""
        proc = self.proc
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGUSR1)
            except OSError:
                pass

    def restart(self) -> bool:
        """The task exited: start its next attempt in place when the policy says so and
        the launcher is there. Its output is held back until the launcher says CONT."""
        rc = exit_code(self.proc.returncode)
        if (self.reason is not None or not self.policy or (rc == 0 and self.zero_ends)
                or not proto.should_restart(self.policy, self.max_restarts, rc, self.restarts)):
            return False
        self.limit = os.path.getsize(self.log)   # hold before the next attempt can write
        env = dict(self.req.get("env") or {}, **{proto.RESTART_VAR: str(self.restarts + 1)})
        try:
            proc, _log, offset = spawn(dict(self.req, env=env, hold=False))
        except (ShimError, OSError):
            self.limit = None
            return False                 # the launcher's own restart says why
        self.restarts += 1
        self.confirmed.clear()
        self.proc, self.limit, self.attempt_started = proc, offset, time.monotonic()
        threading.Thread(target=self.watch_exit, args=(proc,), daemon=True).start()
        said = {proto.RESTARTED: self.restarts, "exit": rc, "pid": proc.pid, "at": offset - self.offset}
        try:
            write_all(2, proto.json_line(said))
        except OSError:
            self.reason = self.reason or "eof"   # nobody to confirm it: stop() ends it
        self.sweep_before(proc.pid)      # while the new attempt starts, not before it
        return True

    def sweep_before(self, new_pid: int) -> None:
        """What earlier attempts left behind, swept as finish() sweeps (TERM, then KILL,
        for at most 2 s): processes of the task's tag outside the new attempt, i.e. not in
        its session and without its RESTART_VAR. One /proc scan when nothing is left."""
        mark = ("%s=%d" % (proto.RESTART_VAR, self.restarts)).encode()

        def older(pid: int) -> bool:
            try:
                if os.getsid(pid) == new_pid:
                    return False
                with open("/proc/%d/environ" % pid, "rb") as f:
                    return mark not in f.read().split(b"\0")
            except OSError:
                return False             # gone already
        sig, deadline = signal.SIGTERM, time.monotonic() + 2.0
        while True:
            left = [pid for pid in procs.tagged(lambda t: t == self.tag, self.owner) if older(pid)]
            if not left or time.monotonic() > deadline:
                return
            for pid in left:
                procs.signal_quietly(pid, sig)
            sig = signal.SIGKILL
            time.sleep(POLL)

    def tail(self) -> None:
        """Copy the log file to stdout as it grows; the task never sees our pipe. The kernel
        copies (sendfile: a file to a pipe, Linux >= 2.6.33) where it can; read and write
        where it cannot."""
        try:
            with open(self.log, "rb") as f:
                pos = self.offset
                copy = self.deflate or _sendfile
                write_all(1, proto.DEFLATE_MARK if self.deflate else b"")
                while not self.quiet.is_set():
                    finished = self.task_done.is_set()
                    limit = self.limit
                    want = TAIL_CHUNK if limit is None else max(0, min(TAIL_CHUNK, limit - pos))
                    try:
                        sent = copy(f, pos, want)
                    except _NoSendfile:
                        copy = _read_write
                        sent = copy(f, pos, want)
                    if sent:
                        pos += sent
                    elif finished:
                        return               # an attempt never confirmed is not shown
                    else:
                        fresh = time.monotonic() - self.attempt_started < FAST_WINDOW
                        self.tail_wake.wait(FAST_POLL if fresh else POLL)   # finish() wakes us
                        self.tail_wake.clear()
        except OSError:  # reader gone (EPIPE) or log removed: nothing more to say
            self.quiet.set()

    def finish(self) -> None:
        """The task is gone: sweep what it left behind, drop the pid file."""
        left = kill_tasks([], lambda t: t == self.tag, grace=0.0, owner=self.owner)  # its pgid may be reused
        self.swept = not left
        procs.remove_own(expand(self.req["pidfile"]), self.proc.pid)
        self.task_done.set()
        self.tail_wake.set()

    def stop(self, tailer: threading.Thread) -> int:
        if self.reason != "stop":
            self.quiet.set()  # nobody is listening (or the reader stalled): never block on stdout
        # our unreaped child's group; a restarted attempt that exited unconfirmed is reaped
        group = [self.proc.pid] if self.proc.returncode is None else []
        left = kill_tasks(group, lambda t: t == self.tag, grace=self.grace, owner=self.owner)
        if self.proc.poll() is None:  # alive yet untagged (its environment replaced): still our child
            procs.signal_quietly(self.proc.pid, signal.SIGKILL, group=True)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        procs.remove_own(expand(self.req["pidfile"]), self.proc.pid)
        self.task_done.set()
        self.tail_wake.set()
        if not self.quiet.is_set():
            tailer.join(timeout=5)  # a live reader asked to STOP: give it the last output
        rc = self.proc.returncode
        self.swept = not left and rc is not None
        return self.last_word(exit_code(rc) if rc is not None else 128 + signal.SIGKILL)

    def last_word(self, code: int) -> int:
        """Tell a launcher still listening that nothing of the task's tag is left."""
        if self.swept and not self.quiet.is_set():
            try:
                write_all(2, proto.json_line({"exit": code, proto.SWEPT: True}))
            except OSError:
                pass
        return code
