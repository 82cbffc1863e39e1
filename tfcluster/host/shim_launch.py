"""Starting servers on a host and waiting until they are ready: `launch` and `wait`, and
`up` in one remote execution (docs/design/remote-execs.md, "The round trips of `up`").

Shipped beside shim.py (standard library only, Python >= 3.8). `up` is one request (its
batch answered first, by shim.py), then a conversation on stdin/stdout, one JSON line each
way:

1. the request's `commands` (info, status, ports) are answered as `batch` would, with
   `warm`: the servers started warm. A server is started warm only when this host's own
   checks pass (TensorFlow installed, none of this cluster's processes alive here, every
   server port free): it imports TensorFlow and then waits for GO on its stdin (a pipe
   held here) before it binds its port;
2. optionally a reach request (`listen`): listeners up, `{"listening", "busy"}`; then its
   targets: `{"results"}`; the listeners stay up until the next line;
3. `{"go": [keys]}`: the listeners close, the warm servers named get GO (the others are
   stopped), the servers named that are not warm are started, and readiness streams as
   `launch` streams it, stdin watched;
4. EOF (or any other line, or `lifetime` seconds of silence) before GO: every warm server
   is stopped and waited for, its pid file removed, and the shim exits: nothing started
   here outlives a failed check on any host.
"""
from __future__ import annotations

import json
import os
import select
import sys
import time

if __package__:
    from . import shim_fence as fence
    from . import shim_fs as fs
    from . import shim_ports as ports
    from . import shim_procs as procs
    from . import shim_protocol as proto
    from . import shim_talk as talk
    from . import shim_tasks as tasks
else:  # shipped: the shim's directory is first on sys.path
    import shim_fence as fence
    import shim_fs as fs
    import shim_ports as ports
    import shim_procs as procs
    import shim_protocol as proto
    import shim_talk as talk
    import shim_tasks as tasks

LIFETIME = 120.0      # seconds the conversation waits for its next line


def up(req: dict, answers: dict) -> None:
    """`up`'s conversation, this host's batch `answers` given (shim.cmd_up)."""
    lines = talk.stdin_lines()
    lifetime = float(req.get("lifetime", LIFETIME))
    starts = {s["key"]: dict(s, req=dict(s["req"], tag=procs.qualify(s["req"]["tag"], s["req"]["cluster_dir"])))
              for s in req.get("starts", [])}
    warm = {}               # key -> Popen, started with hold
    reach = talk.Reach(next((s["req"].get("cluster_dir") for s in starts.values()), None))
    went = False
    try:
        if req.get("warm") and _may_warm(answers, starts.values()):
            for key, start in starts.items():
                warm[key] = (tasks.spawn(dict(start["req"], hold=True))[0], start["req"])
        procs.write_all(1, proto.json_line({"answers": answers, "warm": sorted(warm)}))
        while True:
            line = talk.next_line(lines, time.monotonic() + lifetime)
            msg = json.loads(line) if line is not None else {}
            if reach.answer(msg):
                continue
            if "go" not in msg:
                return                # EOF, silence or an abort word: the finally stops the warm ones
            went = True
            _launch(msg["go"], starts, warm, lines, float(req.get("timeout", 60)))
            return
    finally:
        reach.close()
        _stop(warm)
        for start in list(starts.values())[:1]:    # nothing of the cluster left here: no table
            fence.release_if_idle(start["req"]["cluster_dir"], start["req"]["tag"])
        install = req.get("commands", {}).get(proto.FENCE)
        if not went and not starts and isinstance(install, dict):
            # no GO: the `up` failed, or its launcher went before it could learn of this
            # install (Ctrl-C as the answer went out); a spare keeps its table only on GO
            fence.release_if_idle(install["cluster_dir"], install["tag_prefix"])


def _may_warm(answers: dict, starts) -> bool:
    info, status, ports = (answers.get(k) for k in (proto.INFO, proto.STATUS, proto.PORTS))
    if proto.error_of(info) or proto.error_of(status) or proto.error_of(ports):
        return False
    return (bool(info.get("tf_version")) and not any(s.get("alive") and not s.get("warm") for s in status)
            and all(ports.get(str(s["port"])) is None for s in starts))


def _launch(keys: list, starts: dict, warm: dict, lines, timeout: float) -> None:
    """GO to the warm servers named, start the rest, stream readiness; a launcher gone
    before every server is decided stops them all (as `launch` does)."""
    gone = lambda: talk.at_eof(lines)  # noqa: E731
    released, items = {}, []
    try:
        for key in keys:
            if gone():
                raise proto.ShimError("the launcher went away; no more servers started")
            start = starts[key]
            proc = warm.pop(key, (None, None))[0]
            if proc is not None:
                tasks.release(proc, start["req"]["pidfile"])   # one that died warm: "exited"
            else:
                proc = tasks.spawn(start["req"])[0]
            released[proc.pid] = start["req"]["tag"]
            procs.write_all(1, proto.json_line({"key": key, "pid": proc.pid}))
            items.append({"key": key, "port": start["port"], "pid": proc.pid})
        cmd_wait({"items": items, "timeout": timeout}, gone=gone)
    except BaseException:
        _kill(released)
        raise


def _stop(warm: dict) -> None:
    """Stop warm servers that never got GO, wait until they are gone, drop their pid files."""
    if not warm:
        return
    for proc, _req in warm.values():
        try:
            proc.stdin.close()                  # an import that finishes now reads EOF
        except OSError:
            pass
    _kill({proc.pid: req["tag"] for proc, req in warm.values()})
    for proc, req in warm.values():
        proc.wait()
        fs.remove_quietly(fs.expand(req["pidfile"]))


def _kill(started: dict) -> None:
    """TERM (then KILL) the processes started here, by verified group and by tag."""
    tags = set(started.values())
    match = lambda t: t in tags  # noqa: E731
    groups = [procs.group_of(pid, match) for pid in started]
    procs.kill_tasks([g for g in groups if g], match, proto.DEFAULT_GRACE)


def cmd_wait(req: dict, gone=None) -> None:
    """A line per server: ready (the listening socket on its port is the started process's
    or a descendant's), taken (someone else listens there: `holder`), exited or timeout.
    `gone`: how to tell the launcher went away (default: EOF on stdin, with `watch_stdin`)."""
    pending = list(req["items"])
    deadline = time.monotonic() + float(req.get("timeout", 60))
    # `settle`: for so long a port someone else listens on is not yet "taken": the process a
    # held server replaces may still be stopping (its readiness asked before its GO)
    settled = time.monotonic() + float(req.get("settle", 0))
    gone = gone or (launcher_gone if req.get("watch_stdin") else None)
    while pending:
        if gone is not None and gone():
            raise proto.ShimError("the launcher went away before the servers were ready")
        asked = time.monotonic()
        table = ports.listeners()
        cost = time.monotonic() - asked   # sock_diag: ~0.1 ms; the /proc fallback: ms
        for item in list(pending):
            pid = int(item["pid"])
            state, holder = ports.readiness(pid, int(item["port"]), table)
            if state == "taken" and time.monotonic() < settled:
                state, holder = None, None
            if state is None and not procs.is_alive(pid):
                state = "exited"
            elif state is None and time.monotonic() > deadline:
                state = "timeout"
            if state:
                pending.remove(item)
                answer = {"key": item["key"], "state": state}
                if holder:
                    answer["holder"] = holder
                procs.write_all(1, proto.json_line(answer))
        if pending:
            time.sleep(min(0.05, max(0.01, 5 * cost)))
    return None


def launcher_gone() -> bool:
    """The launcher keeps a launch's stdin open; EOF means it was interrupted or died."""
    try:
        readable, _, _ = select.select([sys.stdin.buffer], [], [], 0)
        return bool(readable) and not os.read(sys.stdin.buffer.fileno(), 1)
    except (OSError, ValueError):
        return True


def cmd_launch(req: dict) -> None:
    """Start detached servers, then wait for them, in one exec: a line {"key", "pid"} per
    start, then cmd_wait's lines. Saves `up` a round trip (a login shell + an interpreter).

    With `watch_stdin` the launcher keeps our stdin open until every server is decided:
    if it goes away first (Ctrl-C, a dropped connection), no further server is started
    and those already started are stopped here, so nothing outlives an interrupted `up`
    whatever the timing of its own stop sweep."""
    watch = bool(req.get("watch_stdin"))
    started = {}
    try:
        items = []
        for start in req["starts"]:
            if watch and launcher_gone():
                raise proto.ShimError("the launcher went away; no more servers started")
            start_req = dict(start["req"], tag=procs.qualify(start["req"]["tag"], start["req"]["cluster_dir"]))
            proc, _log, _offset = tasks.spawn(start_req)
            started[proc.pid] = start_req["tag"]
            procs.write_all(1, proto.json_line({"key": start["key"], "pid": proc.pid}))
            items.append({"key": start["key"], "port": start["port"], "pid": proc.pid})
        cmd_wait({"items": items, "timeout": req.get("timeout", 60), "watch_stdin": watch})
    except BaseException:
        if watch and started:
            _kill(started)
        raise
