"""tfcluster host shim: owns the task processes on one host.

Shipped to every host and run as `PYTHON shim.py COMMAND`, one JSON request line on
stdin (env and secrets never travel on a command line), JSON answers on stdout; the
protocol is in shim_protocol.py and docs/ARCHITECTURE.md. Standard library only,
Python >= 3.8, no imports from an installed tfcluster (the host may have another
version): its siblings come from its own directory.

Every task runs in its own session with its tag in its environment; that tag, read
back from /proc/<pid>/environ with the start time and the process's owner, is how the
shim recognises its tasks (pid reuse, setsid escapees, other users). Nothing is killed
by name. Tags arrive without the cluster's identity; the shim adds it (qualify).
"""
from __future__ import annotations

import base64
import hashlib
import importlib
import json
import os
import signal
import sys
import time

if __package__:
    from . import shim_cgroup as cgroup
    from . import shim_facts as facts
    from . import shim_fence as fence
    from . import shim_fs as fs
    from . import shim_launch as launch
    from . import shim_net as net
    from . import shim_ports as ports
    from . import shim_procs as procs
    from . import shim_protocol as proto
    from . import shim_talk as talk
    from . import shim_tasks as tasks
else:  # shipped: this file's directory is first on sys.path
    import shim_cgroup as cgroup
    import shim_facts as facts
    import shim_fence as fence
    import shim_fs as fs
    import shim_launch as launch
    import shim_net as net
    import shim_ports as ports
    import shim_procs as procs
    import shim_protocol as proto
    import shim_talk as talk
    import shim_tasks as tasks

expand, is_alive, kill_tasks = fs.expand, procs.is_alive, procs.kill_tasks
remove_quietly, write_all = fs.remove_quietly, procs.write_all
spawn, Attached = tasks.spawn, tasks.Attached

ShimError = proto.ShimError



def cmd_info(req: dict) -> dict:
    answer = {"python_version": "%d.%d.%d" % sys.version_info[:3], "machine_id": facts.machine_id()}
    if req.get("light"):        # down, status: which machine it is, and nothing that costs (nvidia-smi)
        return answer
    gpus, driver = facts.nvidia()
    tf = facts.tf_version()      # first: it may run `site`, which the others then see
    tb, keras = facts.installed_versions(facts.TB_DISTRIBUTIONS, facts.KERAS_DISTRIBUTIONS)
    tf_keras, jax, jaxlib, jax_cuda = facts.installed_versions(
        facts.TF_KERAS_DISTRIBUTIONS, facts.JAX_DISTRIBUTIONS, facts.JAXLIB_DISTRIBUTIONS,
        facts.JAX_CUDA_DISTRIBUTIONS, fallback=False)
    answer.update({"tf_version": tf, "gpus": gpus, "driver_version": driver,
                   "tensorboard_version": tb, "keras_version": keras, "tf_keras_version": tf_keras,
                   "jax_version": jax, "jaxlib_version": jaxlib, "jax_cuda_version": jax_cuda,
                   "proxy": net.proxy_report(os.environ)})
    answer.update(facts.tf_build())
    if jax:                     # only where mode keras-jax could run: a lookup may go to DNS
        answer["hostname_address"] = facts.hostname_address()
    return answer


def cmd_ports(req: dict) -> dict:
    return {str(p): (None if ports.port_free(int(p)) else ports.port_holder(int(p)))
            for p in req["ports"]}


def qualified(req: dict) -> dict:
    """A start request with the cluster's identity added to its tag."""
    return dict(req, tag=procs.qualify(req["tag"], req["cluster_dir"]))


def cmd_start(req: dict):
    req = qualified(req)
    detached = None
    try:      # from the batch on: a launcher gone by its answer leaves no table here
        if req.get("batch"):          # a held start that is also the bootstrap's command (held.py)
            write_all(1, proto.json_line(cmd_batch(req["batch"])))
        if not req.get("attached"):
            detached = spawn(req)[0].pid      # it runs on: the table stays for it
            return {"pid": detached}
        if req.get("standby"):               # a warm standby, held until a task is handed to it
            if __package__:
                from . import shim_warm as warm
            else:
                import shim_warm as warm
            return warm.run(req, qualified)
        lines = None
        if req.get("defer"):
            lines = tasks.held(req)              # until GO
            if lines is None:
                return 0                         # the launcher ended it before GO: nothing started
        if talk.at_eof(lines) if lines is not None else launch.launcher_gone():
            raise ShimError("the launcher went away before the task started")
        proc, log, offset = spawn(req)
        return Attached(proc, req, log, offset, lines).run()     # the task's exit status is ours
    finally:     # the cluster's last process on this host gone: its ports' table goes too,
        if detached is None and not tasks.FENCE_KEPT.is_set():    # unless a move starts the next ones here
            fence.release_if_idle(req["cluster_dir"], req["tag"])


# ---------------------------------------------------------------- stop / status

def cmd_stop(req: dict) -> dict:
    """Stop this cluster's processes of this prefix: only our own (uid), tagged ones; a
    group is read from a verified live process, never from a pid file."""
    if not req["tag_prefix"]:
        raise ShimError("stop needs a tag prefix (an empty one would match every cluster)")
    prefix = procs.qualify(req["tag_prefix"], req["cluster_dir"])
    match = lambda t: t.startswith(prefix)  # noqa: E731
    records = procs.read_pidfiles(req["piddir"], prefix)
    live = [r for _, r in records if procs.verified(r)]
    before = procs.tagged(match)
    groups = [procs.group_of(r["pid"], match) for r in live]
    left = kill_tasks([g for g in groups if g], match, float(req.get("grace", proto.DEFAULT_GRACE)), before)
    stopped = {r["pid"]: r["tag"] for r in live}
    stopped.update(before)
    for pid in left:
        stopped.pop(pid, None)
    for path, record in records:
        if procs.as_pid(record.get("pid")) not in left:
            remove_quietly(path)
    fence.release_if_idle(req["cluster_dir"], prefix)
    return {"stopped": [{"tag": t, "pid": p} for p, t in sorted(stopped.items())],
            "survivors": [{"tag": t, "pid": p} for p, t in sorted(left.items())]}


def cmd_down(req: dict) -> dict:
    """`down` in one remote execution, batched after `info` in the bootstrap's exec: `stop`,
    then poll here until every port of `ports` binds again or `settle` seconds passed (a
    just-killed server's socket may take a moment to go). `stop`'s answer plus `ports`:
    port -> null (bindable) or who holds it (docs/ARCHITECTURE.md, "The shim protocol")."""
    answer = cmd_stop(req)
    if not answer["survivors"]:     # also a table a killed run left, its mark gone with its dir
        answer["fence"] = fence.remove(req["cluster_dir"], req["tag_prefix"], always=True)
        cgroup.drop(req["cluster_dir"])
    answer["swept"] = fence.sweep(keep=fence.table_name(req["cluster_dir"], req["tag_prefix"]))
    wanted = [int(p) for p in req.get("ports", [])]
    answer["ports"] = ports.wait_bindable(wanted, float(req.get("settle", proto.PORT_SETTLE)))
    return answer


def cmd_up(req: dict) -> None:
    """`up` in one remote execution: this host's batch, then the conversation (shim_launch).
    A root shim first sweeps other clusters' stale tables (tf_ports: open asks no fence)."""
    if proto.FENCE not in req["commands"]:      # an install sweeps as it goes
        fence.sweep()
    return launch.up(req, cmd_batch({"commands": req["commands"]})["answers"])


def cmd_status(req: dict) -> list:
    out = []
    prefix = req.get("tag_prefix", "")
    prefix = procs.qualify(prefix, req["cluster_dir"]) if prefix else ""
    for _, r in procs.read_pidfiles(req["piddir"], prefix):
        if procs.as_pid(r.get("pid")) is None:
            continue  # not a record the shim wrote
        alive = procs.verified(r)
        started = r.get("started_at")
        started = started if isinstance(started, (int, float)) and not isinstance(started, bool) else None
        out.append({"tag": r.get("tag"), "pid": r["pid"], "alive": alive, "log": r.get("log"),
                    "uptime_s": round(time.time() - started, 3) if alive and started else None})
        if r.get("warm"):
            out[-1]["warm"] = True
        if type(r.get("port")) is int:
            out[-1]["port"] = r["port"]
    if req.get("sweep") and prefix:
        out += unrecorded(prefix, {r["pid"] for r in out if r["alive"]})
    return out


def unrecorded(prefix: str, known: set) -> list:
    """Live tasks of the cluster that no pid file names (its directory on this host was
    removed or replaced while they ran). A task leads its own process group; its children
    share its tag, not its group, so each task is counted once."""
    def match(tag):
        return tag.startswith(prefix)
    found = []
    for pid, tag in sorted(procs.tagged(match).items()):
        if pid not in known and procs.group_of(pid, match) == pid:
            found.append({"tag": tag, "pid": pid, "alive": True, "log": None,
                          "uptime_s": procs.uptime(pid), "unrecorded": True})
    return found


# ---------------------------------------------------------------- tail / files / batch

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
    ones the cache did not have yet. A cached file is used only if its content still has
    its name's sha256 (else it counts as missing, and is sent again); every entry is
    checked before anything is written."""
    cache, dest = expand(req["cache"]), expand(req["dest"])
    inline = {}
    for digest, encoded in sorted(req.get("inline", {}).items()):
        try:
            data = base64.b64decode(encoded, validate=True)
        except (TypeError, ValueError):
            data = None
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            raise ShimError("bad inline file: %r does not match its content" % (digest,))
        inline[digest] = data
    for entry in req["files"]:
        rel = entry.get("path")
        if (not _is_digest(entry.get("sha256")) or not isinstance(rel, str) or not rel
                or rel.startswith("/") or ".." in rel.split("/") or "\0" in rel):
            raise ShimError("bad file entry: %r" % (entry,))
    fs.private_dir(cache)
    fs.private_dir(dest)
    added, missing = [], set()
    for entry in req["files"]:
        digest, target = entry["sha256"], os.path.join(dest, entry["path"])
        fs.private_dir(os.path.dirname(target))
        mode = int(entry.get("mode", 0o600)) & 0o700
        if fs.copy_verified(os.path.join(cache, digest), target, digest, mode):
            continue
        if digest not in inline:
            missing.add(digest)
            continue
        fs.write_new(os.path.join(cache, digest), inline[digest])
        fs.write_new(target, inline[digest], mode)
        if digest not in added:
            added.append(digest)
    return {"missing": sorted(missing), "added": added}


def _is_digest(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def cmd_batch(req: dict) -> dict:
    """Several one-shot commands in one exec, answers keyed by command (an error envelope
    in place of a failed one). Every exec costs a login shell and an interpreter start on
    the host (about 0.2 s with a pyenv .bashrc), so `up` asks info + status + ports at once,
    and `down` info + down. Commands run in the request's order."""
    answers = {}
    for name, sub in req["commands"].items():
        if name not in proto.BATCHABLE:
            raise ShimError("not batchable: %s" % name)
        try:
            answers[name] = COMMANDS[name](sub)
        except (ShimError, OSError, KeyError, ValueError) as e:
            answers[name] = proto.error_answer(proto.describe_exception(e))
    return {"answers": answers}


# ---------------------------------------------------------------- main

def _module(name: str):
    """A module only a rare command needs, imported when it runs: the notice watcher's HTTP
    and e-mail date parsing, the checkpoint sender. Every task start is a shim start."""
    if __package__:
        return importlib.import_module("." + name, __package__)
    return importlib.import_module(name)


def cmd_ckpt(req: dict):
    return _module("shim_ckpt").cmd_ckpt(req)


def cmd_notice(req: dict):
    return _module("shim_notice").cmd_notice(req)


COMMANDS = {proto.INFO: cmd_info, proto.PORTS: cmd_ports, proto.START: cmd_start,
            proto.STOP: cmd_stop, proto.STATUS: cmd_status, proto.WAIT: launch.cmd_wait,
            proto.TAIL: cmd_tail, proto.FILES: cmd_files, proto.BATCH: cmd_batch,
            proto.LAUNCH: launch.cmd_launch, proto.REACH: talk.cmd_reach,
            proto.UP: cmd_up, proto.DOWN: cmd_down, proto.FENCE: fence.cmd_fence,
            proto.CKPT: cmd_ckpt, proto.NOTICE: cmd_notice}


def main(argv: list) -> int:
    if len(argv) != 2 or argv[1] not in COMMANDS:
        sys.stderr.write("usage: shim.py {%s} < request.json\n" % ",".join(sorted(COMMANDS)))
        return 2
    # The checkpoint request (SIGUSR1, shim_tasks.Attached.request_save) ignored here, and so
    # in every task this shim starts (an ignored signal stays ignored across exec): a script
    # with a handler sets its own, one without is not killed by it (docs/own-scripts.md).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    line = sys.stdin.buffer.readline()
    req = json.loads(line) if line.strip() else {}
    installs = installs_of(argv[1], req)
    try:
        answer = COMMANDS[argv[1]](req)
    except (ShimError, OSError, KeyError, ValueError) as e:
        fd = 2 if req.get("attached") else 1
        write_all(fd, proto.json_line(proto.error_answer(proto.describe_exception(e))))
        return proto.EXIT_ERROR
    except SystemExit:               # a hangup (_leave) while the table went in
        take_back(installs)
        raise
    if isinstance(answer, int) and not isinstance(answer, bool):
        return answer                # an attached task's exit status
    if answer is not None:
        try:
            write_all(1, proto.json_line(answer))
        except OSError:              # the launcher is gone (Ctrl-C): nobody will take the table
            take_back(installs)     # this exec installed, and nothing here needs it
            return proto.EXIT_ERROR
    return 0


def installs_of(command: str, req: dict) -> dict | None:
    """The fence install an exec makes (`fence`'s, or a batch's: the opening survey's),
    else None. cmd_start undoes its own batch's; the launcher's in-process calls use this
    too (bootstrap.call_here)."""
    sub = req.get("commands") if command == proto.BATCH else {proto.FENCE: req} if command == proto.FENCE else None
    sub = sub.get(proto.FENCE) if isinstance(sub, dict) else None
    return sub if isinstance(sub, dict) and sub.get("mode", "install") == "install" else None


def take_back(installs: dict | None) -> None:
    """The table an unanswered install made goes, unless something of its cluster runs here."""
    if installs is not None:
        try:
            fence.release_if_idle(installs["cluster_dir"], installs["tag_prefix"])
        except (OSError, KeyError, ValueError, TypeError):
            pass


def _leave(signum, frame):
    """SIGHUP or SIGTERM before an attached task installs its own handlers: unwind, so that
    what this shim started (warm servers) is stopped and the cluster's table removed when
    nothing of it is left (docs/security.md, "TensorFlow's ports")."""
    raise SystemExit(128 + signum)


def run() -> None:
    """main(), then leave at once: the one exit of the shim. A daemon thread may still sit
    in a read of stdin or of a task's pipes (the launcher keeps its end open), holding the
    buffer's lock: the interpreter's teardown waited 1 s for that lock and then aborted
    ("Fatal Python error: _enter_buffered_busy", SIGABRT) after every `up`. Answers are
    written with os.write; nothing is left buffered."""
    cgroup.OWN_PROCESS = True                        # it may join its cluster's cgroup
    for sig in (signal.SIGHUP, signal.SIGTERM):     # sshd's hangup, a stop: leave through the
        signal.signal(sig, _leave)                     # finally blocks (a warm server, the fence)
    try:
        code = main(sys.argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - shown as Python would, then the same exit status
        import traceback
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
