"""A warm standby: a script's interpreter with TensorFlow imported, waiting for its task.

Shipped beside shim.py and started by it (shim_warm.py) with the task's interpreter, in the
cluster's cgroup, in a session of its own, with a standby tag and the environment its task
will have (TF_CONFIG aside). It imports TensorFlow, says `{"ready": seconds}` on stdout (a
pipe to its shim) and waits on stdin for one JSON line: the task's argv, environment, cwd,
log and tag. Then it becomes the task, in this same process, so that the move skips the
interpreter's and TensorFlow's start:

- anything TensorFlow or Python read at start-up must already be right: every variable that
  differs between the environment it started with and the task's must be one read only later
  (LATE: TF_CONFIG is read when a cluster resolver or strategy is made, never at import), else
  it refuses and its shim starts the task cold;
- its tag is written in place into the environment the kernel shows (/proc/PID/environ, which
  the shim's sweeps and `status` read): the standby was started with room for it;
- its stdout and stderr become the task's log; argv, cwd and sys.path[0] are the script's,
  then the script runs as `__main__`.

Standard library only (plus TensorFlow, imported); shim_protocol is read for its names only.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time

TAG_VAR = "TFCLUSTER_JOB_ID"        # shim_protocol.TAG_VAR (this file imports no sibling: see main)
ROOM_VAR = "TFCLUSTER_STANDBY_ROOM"  # padding right after the tag: room for the task's longer tag
ROOM = 256
# Read after the interpreter's and TensorFlow's start, so a standby may differ in them:
# TF_CONFIG (a cluster resolver's, at strategy creation), the tag and the run's counters.
IMPORT_VAR = "TFCLUSTER_STANDBY_IMPORT"   # what it imports: "tensorflow" unless told (the spec's env)
LATE = ("TF_CONFIG", TAG_VAR, ROOM_VAR, "TFCLUSTER_RESTART", "TFCLUSTER_RUN_ID", "TFCLUSTER_HOLD")
# tfcluster's own variables say which task this is (TFCLUSTER_JOB, _TASK_INDEX, _IS_CHIEF,
# _MASTER, ...): only the script reads them, after the take, so a warm spare's standby started
# as one worker can become another. Those read before the script are not late: the start-up
# probe's (sitecustomize, at the interpreter's start) and what the standby imports.
EARLY_OURS = ("TFCLUSTER_PROBE", "TFCLUSTER_STDOUT_FLUSH", IMPORT_VAR)


def late(key: str) -> bool:
    return key in LATE or (key.startswith("TFCLUSTER_") and key not in EARLY_OURS)


def say(obj) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())


def differs(started: dict, wanted: dict) -> list[str]:
    """The variables, other than LATE ones, whose value the task needs and this process did
    not start with."""
    keys = set(started) | set(wanted)
    return sorted(k for k in keys if not late(k) and started.get(k) != wanted.get(k))


def retag(tag: str) -> None:
    """Write `tag` over this process's own TAG_VAR value where the kernel shows it
    (/proc/self/environ: the memory between the stat fields env_start and env_end), with
    ROOM_VAR's bytes after it as room. Raises OSError when it cannot."""
    import ctypes

    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])      # env_start, env_end (stat fields 50, 51)
    with open("/proc/self/environ", "rb") as f:
        block = f.read()
    key, room = (TAG_VAR + "=").encode(), (ROOM_VAR + "=").encode()
    at = 0 if block.startswith(key) else block.find(b"\0" + key) + 1
    if at <= 0 and not block.startswith(key):
        raise OSError("no %s in the environment" % TAG_VAR)
    value = at + len(key)
    after = block.find(b"\0", value)
    if not block[after + 1:].startswith(room):
        raise OSError("no room after %s" % TAG_VAR)
    stop = block.find(b"\0", after + 1)
    stop = len(block) if stop < 0 else stop
    new = tag.encode()
    if len(block) != end - start or len(new) > stop - value:
        raise OSError("the task's tag does not fit (%d bytes, room for %d)" % (len(new), stop - value))
    os.environ.pop(ROOM_VAR, None)      # its pointer goes before its bytes are written over
    # the tag's value, then NULs up to the room's end: tag_of() reads up to the first NUL
    ctypes.memmove(start + value, new + b"\0" * (stop - value - len(new)), stop - value)


def started_with() -> dict:
    """The environment this process started with, as the kernel shows it (a start-up hook
    may have changed os.environ since: the probe takes itself off PYTHONPATH)."""
    with open("/proc/self/environ", "rb") as f:
        items = [i.decode(errors="surrogateescape") for i in f.read().split(b"\0") if i]
    return dict(i.split("=", 1) for i in items if "=" in i)


def become(task: dict) -> tuple[str, list[str]]:
    """This process becomes the task (its shim's take request); returns (script path, argv).
    Raises ValueError with the reason it cannot."""
    env = {str(k): str(v) for k, v in task["env"].items()}
    started = started_with()
    bad = differs(started, env)
    if bad:
        raise ValueError("started with other values of %s than the task's" % ", ".join(bad[:5]))
    argv = [str(a) for a in task["argv"]]
    if len(argv) < 2 or argv[1].startswith("-") or not argv[1].endswith(".py"):
        raise ValueError("the task's command is not `python SCRIPT.py ...`")
    try:
        retag(env[TAG_VAR])
    except (OSError, ImportError, ValueError, IndexError) as e:
        raise ValueError("cannot take the task's tag: %s" % e)
    # only what differs is set: what a start-up hook did to the rest stands, as in a cold start
    for k in started:
        if k not in env:
            os.environ.pop(k, None)
    for k, v in env.items():
        if started.get(k) != v:
            os.environ[k] = v
    os.chdir(task["cwd"])
    script = os.path.join(task["cwd"], argv[1])
    return script, argv[1:]


def main() -> int:
    began = time.monotonic()
    for name in filter(None, os.environ.get(IMPORT_VAR, "tensorflow").split(",")):
        importlib.import_module(name)   # the import is what the standby is for
    took = round(time.monotonic() - began, 3)
    say({"ready": took})
    # its own log (stderr): when it was ready, for a person or a benchmark reading it
    print("tfcluster: standby ready, %s imported in %.1fs" % (os.environ.get(IMPORT_VAR, "tensorflow"), took),
          file=sys.stderr, flush=True)
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return 0                        # its shim stopped it before any task came
    task = json.loads(line)
    try:
        script, argv = become(task)
        log = os.open(task["log"], os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
    except (ValueError, OSError, KeyError) as e:
        say({"refused": str(e)})
        return 0
    say({"took": os.getpid()})
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)                     # the pipe to the shim closes here: it reads EOF
    os.dup2(log, 2)
    os.close(log)
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)    # fd 0 again, as a cold start's stdin
    sys.argv = argv
    sys.path[0] = os.path.dirname(script)   # as `python SCRIPT.py` puts it, not this file's bin dir
    import runpy

    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
