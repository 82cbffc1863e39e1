"""The shim's side of a warm standby (`start` with `standby`): a script's interpreter with
TensorFlow imported (shim_standby.py), held until the launcher hands it a task.

Shipped beside shim.py (standard library only, Python >= 3.8). The conversation is a held
start's (shim_tasks.held): heartbeats on stdin, EOF, STOP or silence end it and the standby
with it, having run nothing. Instead of GO, the launcher sends `{"take": <a start request>}`:

- the standby, once its import is done, gets the task's argv, environment, cwd and log, and
  answers `took` (it is the task now: same pid, its tag written over its own) or `refused`;
- a standby that refused, died or did not answer is stopped, and the task starts cold, as any
  attached start;

then the handshake on stderr says which, `{"pid", "deflate", "warm": true|false, "why",
"ready_s"}`, and the shim is the task's attached shim (shim_tasks.Attached) from there on.

The standby is spawned as any task is (its own session, the cluster's cgroup, a pid file with
its own tag, marked `standby`), so `stop`, `down` and the run's sweeps find it by its run's
prefix; it listens on nothing before it becomes its task.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time

if __package__:
    from . import shim_cgroup as cgroup
    from . import shim_fs as fs
    from . import shim_procs as procs
    from . import shim_protocol as proto
    from . import shim_talk as talk
    from . import shim_tasks as tasks
else:  # shipped: the shim's directory is first on sys.path
    import shim_cgroup as cgroup
    import shim_fs as fs
    import shim_procs as procs
    import shim_protocol as proto
    import shim_talk as talk
    import shim_tasks as tasks

ROOM_VAR, ROOM = "TFCLUSTER_STANDBY_ROOM", 256   # shim_standby.py's: room for the task's tag
READY_WAIT = 300.0     # a take waits this long for an import still under way (a cold start is slower)
ANSWER_WAIT = 30.0     # ... and this long for the standby's answer once it has the task


class Standby:
    """One standby process and what it said on its pipe."""

    def __init__(self, req: dict) -> None:
        self.req = req
        self.ready = threading.Event()
        self.ready_s = None            # its import's seconds
        self.answers: list = []
        self.heard = threading.Condition()
        env = tasks.task_env(req)
        tag = env.pop(proto.TAG_VAR)
        env.pop(ROOM_VAR, None)
        env[proto.TAG_VAR] = tag       # last, the room right after it (shim_standby.retag)
        env[ROOM_VAR] = "x" * ROOM
        here = os.path.dirname(os.path.abspath(__file__))
        argv = [req["argv"][0], os.path.join(here, "shim_standby.py")]
        cwd = fs.expand(req.get("cwd") or "~")
        fs.private_dir(cwd)
        self.pidfile = fs.expand(req["pidfile"])
        fs.private_dir(os.path.dirname(self.pidfile))
        log_fd = tasks.open_private(fs.expand(req["log"]))
        cgroup.join(req.get("cluster_dir"))     # born in the cluster's cgroup, under its fence
        try:
            self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log_fd, start_new_session=True, close_fds=True)
        except OSError as e:
            raise proto.ShimError("cannot start a standby with %s: %s" % (argv[0], e))
        finally:
            os.close(log_fd)
        stat = procs.proc_stat(self.proc.pid)
        procs.write_pidfile(self.pidfile, {"pid": self.proc.pid, "start_time": stat[1] if stat else None,
                                           "started_at": time.time(), "tag": req["tag"], "argv": argv,
                                           "log": fs.expand(req["log"]), "standby": True})
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        """Its pipe's JSON lines (anything else there is a start-up hook's, skipped)."""
        for line in self.proc.stdout:
            try:
                said = json.loads(line)
            except ValueError:
                continue
            if not isinstance(said, dict):
                continue
            if "ready" in said:
                self.ready_s = said["ready"]
                self.ready.set()
            with self.heard:
                self.answers.append(said)
                self.heard.notify_all()
        with self.heard:
            self.answers.append(None)           # EOF: it became its task, or died
            self.heard.notify_all()
        self.ready.set()

    def _answer(self, timeout: float):
        deadline = time.monotonic() + timeout
        with self.heard:
            while True:
                found = next((a for a in self.answers if a is None or "took" in a or "refused" in a), False)
                if found is not False or time.monotonic() > deadline:
                    return found or None
                self.heard.wait(max(0.0, deadline - time.monotonic()))

    def take(self, take: dict):
        """Hand it the task. (Popen, log, offset, handshake extra): the standby itself, or a
        cold start of the task when it cannot."""
        log = fs.expand(take["log"])
        waited = time.monotonic()
        why = None
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() - waited > READY_WAIT:
                break
        if self.proc.poll() is not None:
            why = "its standby had exited (%s)" % _how(self.proc.returncode)
        elif self.ready_s is None:
            why = "its standby was not ready in %.0fs" % READY_WAIT
        if why is None:
            fd = tasks.open_private(log)    # the task's log, private, before the standby writes it
            offset = os.fstat(fd).st_size
            os.close(fd)
            env = tasks.task_env(take)
            argv = [fs.expand(a) if a.startswith("~/") else a for a in take["argv"]]
            task = {"argv": argv, "env": env, "cwd": fs.expand(take.get("cwd") or "~"), "log": log}
            try:
                self.proc.stdin.write(proto.json_line(task))
                self.proc.stdin.close()
            except OSError:
                pass
            said = self._answer(ANSWER_WAIT)
            if said and said.get("took") == self.proc.pid:
                self.proc.stdin = None      # a stray GO must not reach the task (shim_tasks.release)
                stat = procs.proc_stat(self.proc.pid)
                procs.write_pidfile(fs.expand(take["pidfile"]), {
                    "pid": self.proc.pid, "start_time": stat[1] if stat else None, "started_at": time.time(),
                    "tag": take["tag"], "argv": argv, "log": log, "from_standby": self.req["tag"]})
                fs.remove_quietly(self.pidfile)
                return self.proc, log, offset, {"warm": True, "ready_s": self.ready_s,
                                                "waited_s": round(time.monotonic() - waited, 3)}
            why = ("its standby refused: %s" % said["refused"] if said and "refused" in said
                   else "its standby did not answer" if self.proc.poll() is None
                   else "its standby exited (%s)" % _how(self.proc.wait()))
        self.stop()
        proc, log, offset = tasks.spawn(take)
        return proc, log, offset, {"warm": False, "why": why}

    def stop(self) -> None:
        """Stop it (unless it became its task), wait for it, drop its pid file."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()          # an import that finishes now reads EOF and exits
            except OSError:
                pass
        tag = self.req["tag"]
        if self.proc.returncode is None:
            group = [self.proc.pid] if self.proc.poll() is None else []
            procs.kill_tasks(group, lambda t: t == tag, grace=0.5)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        fs.remove_quietly(self.pidfile)


def _how(rc) -> str:
    return "killed by signal %d" % -rc if rc is not None and rc < 0 else "exit %s" % rc


def run(req: dict, qualify) -> int:
    """shim.cmd_start's `standby`: hold the standby until its take (or the end), then be the
    task's attached shim. `qualify`: the shim's tag qualifier for the take's request."""
    standby = Standby(req)
    taken = False
    try:
        lines = talk.stdin_lines()
        silence = float(req.get("heartbeat_timeout") or proto.DEFAULT_HEARTBEAT_TIMEOUT)
        while True:
            line = talk.next_line(lines, time.monotonic() + silence)
            if line is None or tasks.is_stop(line):
                return 0                        # ended before any take: nothing of a task ran
            if line == proto.HEARTBEAT_LINE:
                continue
            msg = json.loads(line)
            if isinstance(msg, dict) and isinstance(msg.get("take"), dict):
                break
        take = qualify(dict(msg["take"], cluster_dir=req.get("cluster_dir")))
        proc, log, offset, said = standby.take(take)
        taken = said["warm"]
        attached = tasks.Attached(proc, take, log, offset, lines)
        attached.said = said
        return attached.run()
    finally:
        if not taken:
            standby.stop()
