"""The host's side of `up` in one remote execution (docs/ARCHITECTURE.md, "The round
trips of `up`").

Shipped beside shim.py (standard library only, Python >= 3.8). One request, then a
conversation on stdin/stdout, one JSON line each way:

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
import time

if __package__:
    from . import shim_net as net
    from . import shim_procs as procs
    from . import shim_protocol as proto
    from . import shim_tasks as tasks
else:  # shipped: the shim's directory is first on sys.path
    import shim_net as net
    import shim_procs as procs
    import shim_protocol as proto
    import shim_tasks as tasks

LIFETIME = 120.0      # seconds the conversation waits for its next line


def cmd_up(req: dict, batch, wait) -> None:
    lines = net._stdin_lines()   # noqa: SLF001 - the one reader of stdin from here on
    lifetime = float(req.get("lifetime", LIFETIME))
    starts = {s["key"]: dict(s, req=dict(s["req"], tag=procs.qualify(s["req"]["tag"], s["req"]["cluster_dir"])))
              for s in req.get("starts", [])}
    answers = batch({"commands": req["commands"]})["answers"]
    warm = {}               # key -> Popen, started with hold
    acceptor = None
    try:
        if req.get("warm") and _may_warm(answers, starts.values()):
            for key, start in starts.items():
                warm[key] = (tasks.spawn(dict(start["req"], hold=True))[0], start["req"])
        procs.write_all(1, proto.json_line({"answers": answers, "warm": sorted(warm)}))
        while True:
            line = net._next_line(lines, time.monotonic() + lifetime)   # noqa: SLF001
            msg = json.loads(line) if line is not None else {}
            if acceptor is not None:
                acceptor.close()
                acceptor = None
            if "listen" in msg:
                sockets, busy = net.listen(msg["listen"] or [])
                acceptor = net.Acceptor(sockets.values())
                procs.write_all(1, proto.json_line({"listening": sorted(sockets), "busy": busy}))
                go = net._next_line(lines, time.monotonic() + lifetime)   # noqa: SLF001
                if go is None:
                    continue
                go = json.loads(go)
                results = net.probe_all(go.get("targets") or [], float(go.get("timeout", net.CONNECT_TIMEOUT)))
                procs.write_all(1, proto.json_line({"results": results}))
                continue
            if "go" not in msg:
                return                # EOF, silence or an abort word: the finally stops the warm ones
            _launch(msg["go"], starts, warm, lines, float(req.get("timeout", 60)), wait)
            return
    finally:
        if acceptor is not None:
            acceptor.close()
        _stop(warm)


def _may_warm(answers: dict, starts) -> bool:
    info, status, ports = (answers.get(k) for k in (proto.INFO, proto.STATUS, proto.PORTS))
    if proto.error_of(info) or proto.error_of(status) or proto.error_of(ports):
        return False
    return (bool(info.get("tf_version")) and not any(s.get("alive") and not s.get("warm") for s in status)
            and all(ports.get(str(s["port"])) is None for s in starts))


def _launch(keys: list, starts: dict, warm: dict, lines, timeout: float, wait) -> None:
    """GO to the warm servers named, start the rest, stream readiness; a launcher gone
    before every server is decided stops them all (as `launch` does)."""
    gone = lambda: _eof(lines)  # noqa: E731
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
        wait({"items": items, "timeout": timeout}, gone=gone)
    except BaseException:
        _kill(released)
        raise


def _eof(lines) -> bool:
    """The launcher's stdin ended (its reader thread queued None)."""
    try:
        line = lines.get_nowait()
    except Exception:  # noqa: BLE001 - queue.Empty: nothing yet
        return False
    lines.put(line)
    return line is None


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
        procs.remove_quietly(procs.expand(req["pidfile"]))


def _kill(started: dict) -> None:
    """TERM (then KILL) the processes started here, by verified group and by tag."""
    tags = set(started.values())
    match = lambda t: t in tags  # noqa: E731
    groups = [procs.group_of(pid, match) for pid in started]
    procs.kill_tasks([g for g in groups if g], match, proto.DEFAULT_GRACE)
