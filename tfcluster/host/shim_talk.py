"""The shim's side of a conversation with the launcher: stdin's lines as they come, and the
reach exchange that `reach`, a held start and `up` all speak (docs/ARCHITECTURE.md, "The
shim protocol").

Shipped beside shim.py (standard library only, Python >= 3.8). The exchange, one JSON line
each way: `{"listen": [ports]}` -> `{"listening", "busy"}` (listeners up, accepting);
`{"targets": [[address, port], ...]}` -> `{"results"}` (connect only; the listeners stay
up); any other line closes the listeners (a held start answers `{"close"}` with
`{"closed"}`).
"""
from __future__ import annotations

import json
import queue
import sys
import threading
import time

if __package__:
    from . import shim_cgroup as cgroup
    from . import shim_fence as fence
    from . import shim_net as net
    from . import shim_procs as procs
    from . import shim_protocol as proto
else:  # shipped: the shim's directory is first on sys.path
    import shim_cgroup as cgroup
    import shim_fence as fence
    import shim_net as net
    import shim_procs as procs
    import shim_protocol as proto


def stdin_lines() -> queue.Queue:
    """Lines of stdin as they come, None at EOF (a thread: the buffered reader that read
    the request may hold more, so select() on the descriptor would not see it). The one
    reader of stdin from then on."""
    lines = queue.Queue()

    def read() -> None:
        while True:
            try:
                line = sys.stdin.buffer.readline()
            except (OSError, ValueError):
                line = b""
            lines.put(line or None)
            if not line:
                return

    threading.Thread(target=read, daemon=True).start()
    return lines


def next_line(lines: queue.Queue, deadline: float):
    """The next non-empty line, or None at EOF or once the deadline passed."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            return None
        if line is None:
            lines.put(None)
            return None
        if line.strip():
            return line


def at_eof(lines: queue.Queue) -> bool:
    """The launcher's stdin ended (the reader thread queued None)."""
    try:
        line = lines.get_nowait()
    except queue.Empty:
        return False
    lines.put(line)
    return line is None


def probe(targets, timeout: float, cluster_dir: str | None) -> dict:
    """net.probe_all from inside the cluster's cgroup (its fence admits the cluster's own
    connections only); a refused connection's reason names the tfcluster tables of this
    host that hold its port (another cluster's, a killed run's)."""
    if cluster_dir:
        cgroup.join(cluster_dir)
    results = net.probe_all(targets, timeout)
    own = {procs.instance_id(cluster_dir)} if cluster_dir else set()
    said = {}
    for key, reason in results.items():
        if reason in ("connection refused", "connection reset by peer"):
            port = int(key.rpartition(":")[2])
            if port not in said:
                said[port] = fence.refused_hint(port, own)
            if said[port]:
                results[key] = "%s; %s" % (reason, said[port])
    return results


class Reach:
    """This host's side of the reach exchange, inside a longer conversation; `cluster_dir`
    the cluster whose cgroup its connections are opened from."""

    def __init__(self, cluster_dir: str | None = None) -> None:
        self.acceptor = None
        self.cluster_dir = cluster_dir

    def answer(self, msg: dict) -> bool:
        """Answer `msg` when it is a step of the exchange (True); any other line closes the
        listeners first (False: the caller's own line)."""
        if "targets" in msg:
            results = probe(msg["targets"], float(msg.get("timeout", net.CONNECT_TIMEOUT)), self.cluster_dir)
            procs.write_all(1, proto.json_line({"results": results}))
            return True
        self.close()
        if "listen" in msg:
            sockets, busy = net.listen(msg["listen"] or [])
            self.acceptor = net.Acceptor(sockets.values())
            procs.write_all(1, proto.json_line({"listening": sorted(sockets), "busy": busy}))
            return True
        return False

    def close(self) -> None:
        if self.acceptor is not None:
            self.acceptor.close()
            self.acceptor = None


def cmd_reach(req: dict):
    """`reach` on its own exec: with `targets`, connect only; else listeners up, the
    launcher's targets, then the listeners held until stdin ends (or `lifetime`)."""
    timeout = float(req.get("timeout", net.CONNECT_TIMEOUT))
    if "targets" in req:
        return {"results": probe(req["targets"], timeout, req.get("cluster_dir"))}
    deadline = time.monotonic() + float(req.get("lifetime", net.LIFETIME))
    reach = Reach(req.get("cluster_dir"))
    lines = stdin_lines()
    try:
        reach.answer({"listen": req.get("listen") or []})
        go = next_line(lines, deadline)
        if go is not None:
            go = json.loads(go)
            reach.answer({"targets": go.get("targets") or [], "timeout": go.get("timeout", timeout)})
            while next_line(lines, deadline) is not None:
                pass                     # hold the listeners until stdin ends
    finally:
        reach.close()
    # a reader thread may still block on stdin (lifetime passed): the shim's entry point
    # leaves without joining it
    return None
