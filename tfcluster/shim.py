"""tfcluster host shim: owns the task processes on one host (DESIGN.md §5).

Shipped to every host and run as `PYTHON shim.py SUBCOMMAND`, with one JSON
request line on stdin (env and secrets never travel on a command line) and JSON
answers on stdout. Standard library only, Python >= 3.8, no tfcluster imports.

Every task runs in its own session with TFCLUSTER_JOB_ID=<tag> in its
environment; that tag, read back from /proc/<pid>/environ, is how the shim
recognises its tasks (pid reuse, setsid escapees). Nothing is killed by name.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

TAG_VAR = "TFCLUSTER_JOB_ID"
TF_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly",
                    "tf-nightly-cpu", "tf-nightly-gpu", "tensorflow-intel", "tensorflow-macos")
POLL = 0.05


class ShimError(Exception):
    """A request the shim cannot honour; reported as {"error": ...}."""


# ---------------------------------------------------------------- /proc helpers

def expand(path: str) -> str:
    return os.path.expanduser(path) if path.startswith("~") else path


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start_time in clock ticks) of a pid, or None if it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()
    return fields[0], int(fields[19])


def is_alive(pid: int) -> bool:
    """Running and not a zombie (`kill -0` says a zombie is alive; it is not)."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def tag_of(pid: int) -> str | None:
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            environ = f.read()
    except OSError:  # gone, or not ours to read
        return None
    prefix = (TAG_VAR + "=").encode()
    for item in environ.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode(errors="replace")
    return None


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def tagged(match) -> dict[int, str]:
    """pid -> tag of every live process (not this shim) whose tag satisfies `match`."""
    me = os.getpid()
    found = {}
    for pid in all_pids():
        if pid == me:
            continue
        tag = tag_of(pid)
        if tag is not None and match(tag) and is_alive(pid):
            found[pid] = tag
    return found


def signal_quietly(pid: int, sig: int, group: bool = False) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


# ---------------------------------------------------------------- killing

def kill_tasks(groups: list[int], match, grace: float) -> dict[int, str]:
    """TERM the groups and every matching process, wait up to `grace`, KILL, sweep.

    Returns the processes still alive at the end (pid -> tag)."""
    for pgid in groups:
        signal_quietly(pgid, signal.SIGTERM, group=True)
    for pid in tagged(match):
        signal_quietly(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and tagged(match):
        time.sleep(POLL)
    # A group whose leader is gone may still hold untagged members; its pgid cannot
    # be reused while any member lives, so KILLing it is safe.
    for pgid in groups:
        signal_quietly(pgid, signal.SIGKILL, group=True)
    deadline = time.monotonic() + 2.0
    while True:
        left = tagged(match)
        for pid in left:
            signal_quietly(pid, signal.SIGKILL)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(POLL)


# ---------------------------------------------------------------- pid files

def write_pidfile(path: str, record: dict) -> None:
    tmp = "%s.tmp.%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def read_pidfiles(piddir: str, tag_prefix: str) -> list[tuple[str, dict]]:
    piddir = expand(piddir)
    try:
        names = sorted(os.listdir(piddir))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        if not name.endswith(".pid"):
            continue
        path = os.path.join(piddir, name)
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if str(record.get("tag", "")).startswith(tag_prefix):
            found.append((path, record))
    return found


def verified(record: dict) -> bool:
    """The pid in a pid file is still that task: same tag, same start time."""
    pid = int(record.get("pid", 0))
    stat = proc_stat(pid) if pid > 0 else None
    return (stat is not None and stat[0] not in ("Z", "X")
            and stat[1] == record.get("start_time") and tag_of(pid) == record.get("tag"))


# ---------------------------------------------------------------- info / ports

def tf_version() -> str | None:
    try:
        from importlib import metadata
    except ImportError:  # pragma: no cover - Python < 3.8
        return None
    for dist in TF_DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except Exception:
            continue
    return None


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, timeout=20).stdout
        return sum(1 for line in out.decode(errors="replace").splitlines()
                   if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def machine_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            continue
    return ""


def cmd_info(req: dict) -> dict:
    return {"home": os.path.expanduser("~"), "hostname": socket.gethostname(),
            "python_version": "%d.%d.%d" % sys.version_info[:3], "tf_version": tf_version(),
            "machine_id": machine_id(), "gpus": gpu_count(), "pid": os.getpid()}


def port_free(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def socket_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and int(cols[1].rsplit(":", 1)[1], 16) == port and cols[9] != "0":
                inodes.add(cols[9])
    return inodes


def describe(pid: int) -> str:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        argv = []
    words = [os.path.basename(a) if i == 0 else a for i, a in enumerate(argv)]
    text = " ".join(words)
    return "pid %d (%s)" % (pid, text[:80]) if text else "pid %d" % pid


def port_holder(port: int) -> str:
    wanted = {"socket:[%s]" % inode for inode in socket_inodes(port)}
    for pid in all_pids() if wanted else []:
        try:
            fds = os.listdir("/proc/%d/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink("/proc/%d/fd/%s" % (pid, fd)) in wanted:
                    return describe(pid)
            except OSError:
                continue
    return "in use"


def cmd_ports(req: dict) -> dict:
    return {str(p): (None if port_free(int(p)) else port_holder(int(p))) for p in req["ports"]}


# ---------------------------------------------------------------- start

def open_private(path: str) -> int:
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def spawn(req: dict) -> tuple[subprocess.Popen, str, int]:
    """Start the task; returns (popen, log path, log offset before the task wrote)."""
    tag = req["tag"]
    argv = [expand(a) if a.startswith("~/") else a for a in req["argv"]]
    cwd = expand(req.get("cwd") or "~")
    log, pidfile = expand(req["log"]), expand(req["pidfile"])
    os.makedirs(cwd, mode=0o700, exist_ok=True)
    os.makedirs(os.path.dirname(pidfile), mode=0o700, exist_ok=True)
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
    env[TAG_VAR] = tag
    log_fd = open_private(log)
    offset = os.fstat(log_fd).st_size
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log_fd,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    except OSError as e:
        raise ShimError("cannot start %s: %s" % (argv[0], e))
    finally:
        os.close(log_fd)
    stat = proc_stat(proc.pid)
    record = {"pid": proc.pid, "pgid": proc.pid, "start_time": stat[1] if stat else None,
              "started_at": time.time(), "tag": tag, "argv": argv, "log": log}
    if req.get("port") is not None:
        record["port"] = req["port"]
    write_pidfile(pidfile, record)
    return proc, log, offset


def write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


class Attached:
    """An attached task: log bytes to stdout, heartbeats/STOP on stdin, watchdog."""

    def __init__(self, proc: subprocess.Popen, req: dict, log: str, offset: int) -> None:
        self.proc, self.req, self.log, self.offset = proc, req, log, offset
        self.tag = req["tag"]
        self.hb_timeout = float(req.get("heartbeat_timeout") or 30.0)
        self.grace = float(req.get("grace") if req.get("grace") is not None else 5.0)
        self.last_beat = time.monotonic()
        self.reason = None          # "stop" | "eof" | "signal" once cleanup is wanted
        self.wake = threading.Event()
        self.quiet = threading.Event()   # set: the tailer must not write any more
        self.task_done = threading.Event()

    def run(self) -> int:
        write_all(2, (json.dumps({"pid": self.proc.pid}) + "\n").encode())
        for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.on_signal)   # a handler, not SIG_IGN: the task must not inherit it
        tailer = threading.Thread(target=self.tail, daemon=True)
        tailer.start()
        threading.Thread(target=self.read_stdin, daemon=True).start()
        while self.proc.poll() is None:
            if self.reason is None and time.monotonic() - self.last_beat > self.hb_timeout:
                self.reason = "heartbeat"
            if self.reason is not None:
                return self.stop(tailer)
            self.wake.wait(0.1)
        self.finish()
        tailer.join()
        return exit_code(self.proc.returncode)

    def on_signal(self, signum, frame) -> None:
        self.reason = self.reason or "signal"
        self.wake.set()

    def read_stdin(self) -> None:
        stdin = sys.stdin.buffer
        while True:
            try:
                line = stdin.readline()
            except (OSError, ValueError):
                line = b""
            if not line:
                self.reason = self.reason or "eof"
                break
            self.last_beat = time.monotonic()
            if line.strip() == b"STOP":
                self.reason = self.reason or "stop"
                break
        self.wake.set()

    def tail(self) -> None:
        """Copy the log file to stdout as it grows; the task never sees our pipe."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                while not self.quiet.is_set():
                    finished = self.task_done.is_set()
                    chunk = f.read(65536)
                    if chunk:
                        write_all(1, chunk)
                    elif finished:
                        return
                    else:
                        time.sleep(POLL)
        except OSError:  # reader gone (EPIPE) or log removed: nothing more to say
            self.quiet.set()

    def finish(self) -> None:
        """The task is gone: sweep what it left behind, drop the pid file."""
        kill_tasks([], lambda t: t == self.tag, grace=0.0)  # leader reaped: its pgid may be reused
        remove_quietly(expand(self.req["pidfile"]))
        self.task_done.set()

    def stop(self, tailer: threading.Thread) -> int:
        if self.reason != "stop":
            self.quiet.set()  # nobody is listening (or the reader stalled): never block on stdout
        kill_tasks([self.proc.pid], lambda t: t == self.tag, grace=self.grace)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        remove_quietly(expand(self.req["pidfile"]))
        self.task_done.set()
        if not self.quiet.is_set():
            tailer.join(timeout=5)  # a live reader asked to STOP: give it the last output
        rc = self.proc.returncode
        return exit_code(rc) if rc is not None else 128 + signal.SIGKILL


def cmd_start(req: dict):
    proc, log, offset = spawn(req)
    if not req.get("attached"):
        return {"pid": proc.pid}
    code = Attached(proc, req, log, offset).run()
    # Threads may still block on the pipes; nothing is left to clean up.
    os._exit(code)


# ---------------------------------------------------------------- stop / status

def cmd_stop(req: dict) -> dict:
    prefix = req["tag_prefix"]
    records = read_pidfiles(req["piddir"], prefix)
    live = [(path, r) for path, r in records if verified(r)]
    before = tagged(lambda t: t.startswith(prefix))
    left = kill_tasks([int(r.get("pgid") or r["pid"]) for _, r in live],
                      lambda t: t.startswith(prefix), float(req.get("grace", 5.0)))
    stopped = {int(r["pid"]): r["tag"] for _, r in live}
    stopped.update(before)
    for pid in left:
        stopped.pop(pid, None)
    survivors = {pid: tag for pid, tag in left.items()}
    for path, record in records:
        if int(record["pid"]) not in survivors:
            remove_quietly(path)
    return {"stopped": [{"tag": t, "pid": p} for p, t in sorted(stopped.items())],
            "survivors": [{"tag": t, "pid": p} for p, t in sorted(survivors.items())]}


def cmd_status(req: dict) -> list:
    out = []
    for _, r in read_pidfiles(req["piddir"], req.get("tag_prefix", "")):
        alive = verified(r)
        started = r.get("started_at")
        out.append({"tag": r.get("tag"), "pid": r.get("pid"), "alive": alive,
                    "start_time": r.get("start_time"), "argv": r.get("argv"), "log": r.get("log"),
                    "uptime_s": round(time.time() - started, 3) if alive and started else None})
    return out


# ---------------------------------------------------------------- wait / tail

def accepts(port: int) -> bool:
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(0.5)
        try:
            s.connect((host, port))
            return True
        except OSError:
            continue
        finally:
            s.close()
    return False


def cmd_wait(req: dict) -> None:
    pending = list(req["items"])
    deadline = time.monotonic() + float(req.get("timeout", 60))
    while pending:
        for item in list(pending):
            state = None
            if accepts(int(item["port"])):
                state = "ready"
            elif not is_alive(int(item["pid"])):
                state = "exited"
            elif time.monotonic() > deadline:
                state = "timeout"
            if state:
                pending.remove(item)
                write_all(1, (json.dumps({"key": item["key"], "state": state}) + "\n").encode())
        if pending:
            time.sleep(0.1)
    return None


def cmd_launch(req: dict) -> None:
    """Start detached servers, then wait for them, in one exec: a line {"key", "pid"} per
    start, then cmd_wait's lines. Saves `up` a round trip (a login shell + an interpreter)."""
    items = []
    for start in req["starts"]:
        proc, _log, _offset = spawn(start["req"])
        write_all(1, (json.dumps({"key": start["key"], "pid": proc.pid}) + "\n").encode())
        items.append({"key": start["key"], "port": start["port"], "pid": proc.pid})
    cmd_wait({"items": items, "timeout": req.get("timeout", 60)})


def cmd_tail(req: dict) -> dict:
    lines = int(req.get("lines", 20))
    try:
        with open(expand(req["path"]), "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max(65536, lines * 1024)))
            data = f.read()
    except FileNotFoundError:
        raise ShimError("no such log: %s" % req["path"])
    text = b"\n".join(data.splitlines()[-lines:]) if lines > 0 else b""
    return {"text": text.decode(errors="replace")}


def cmd_files(req: dict) -> dict:
    """Place cached files (by sha256) into a run dir; name the ones the cache lacks.

    The launcher uploads only the missing ones into the cache, then asks again, so an
    unchanged script or data file crosses the network once per host. Small payloads come
    inline (`inline`: sha256 -> base64), saving those two round trips; `added` names the
    ones the cache did not have yet."""
    cache = expand(req["cache"])
    dest = expand(req["dest"])
    added = []
    for digest, encoded in sorted(req.get("inline", {}).items()):
        path = os.path.join(cache, digest)
        if digest.isalnum() and not os.path.isfile(path):
            os.makedirs(cache, mode=0o700, exist_ok=True)
            tmp = "%s.tmp.%d" % (path, os.getpid())
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(base64.b64decode(encoded))
            os.replace(tmp, path)
            added.append(digest)
    missing = []
    for entry in req["files"]:
        digest, rel = entry["sha256"], entry["path"]
        if not digest.isalnum() or rel.startswith("/") or ".." in rel.split("/"):
            raise ShimError("bad file entry: %r" % (entry,))
        cached = os.path.join(cache, digest)
        if not os.path.isfile(cached):
            missing.append(digest)
            continue
        target = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
        tmp = "%s.tmp.%d" % (target, os.getpid())
        shutil.copyfile(cached, tmp)  # a copy, not a link: a script editing its own dir stays local
        os.chmod(tmp, entry.get("mode", 0o600))
        os.replace(tmp, target)
    return {"missing": sorted(set(missing)), "added": added}


BATCHABLE = ("info", "ports", "status", "start", "stop", "tail")


def cmd_batch(req: dict) -> dict:
    """Several one-shot commands in one exec: each answer, or its error, in order.

    Every exec costs a login shell and an interpreter start on the host (about 0.2 s
    with a pyenv .bashrc), so `up` asks for status + ports, then every start, in one go."""
    answers = []
    for item in req["commands"]:
        name, sub = item["cmd"], item.get("req", {})
        if name not in BATCHABLE or (name == "start" and sub.get("attached")):
            raise ShimError("not batchable: %s" % name)
        try:
            answers.append(COMMANDS[name](sub))
        except (ShimError, OSError, KeyError, ValueError) as e:
            answers.append({"error": str(e) if isinstance(e, ShimError) else "%s: %s" % (type(e).__name__, e)})
    return {"answers": answers}


# ---------------------------------------------------------------- main

COMMANDS = {"info": cmd_info, "ports": cmd_ports, "start": cmd_start, "stop": cmd_stop,
            "status": cmd_status, "wait": cmd_wait, "tail": cmd_tail, "files": cmd_files,
            "batch": cmd_batch, "launch": cmd_launch}


def main(argv: list) -> int:
    if len(argv) != 2 or argv[1] not in COMMANDS:
        sys.stderr.write("usage: shim.py {%s} < request.json\n" % ",".join(sorted(COMMANDS)))
        return 2
    line = sys.stdin.buffer.readline()
    req = json.loads(line) if line.strip() else {}
    try:
        answer = COMMANDS[argv[1]](req)
    except (ShimError, OSError, KeyError, ValueError) as e:
        text = str(e) if isinstance(e, ShimError) else "%s: %s" % (type(e).__name__, e)
        fd = 2 if req.get("attached") else 1
        write_all(fd, (json.dumps({"error": text}) + "\n").encode())
        return 3
    if answer is not None:
        write_all(1, (json.dumps(answer) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
