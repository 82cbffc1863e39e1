"""The host's side of `down` in one remote execution (docs/ARCHITECTURE.md, "The round
trip of `down`").

Shipped beside shim.py (standard library only, Python >= 3.8). Batched after `info` in
the bootstrap's own exec: stop this cluster's processes as `stop` does (same request:
piddir, tag_prefix, cluster_dir, grace), then poll, here on the host, until every port
of `ports` can be bound again or `settle` seconds have passed (a just-killed server's
socket may take a moment to go). The answer is `stop`'s, plus `ports`: port -> null
(bindable) or who holds it, as `ports` answers.
"""
from __future__ import annotations

import time

if __package__:
    from . import shim_ports as ports
    from . import shim_protocol as proto
else:  # shipped: the shim's directory is first on sys.path
    import shim_ports as ports
    import shim_protocol as proto

POLL = 0.05


def cmd_down(req: dict, stop) -> dict:
    """`stop` (shim.cmd_stop), then the ports' wait."""
    answer = stop(req)
    wanted = [int(p) for p in req.get("ports", [])]
    answer["ports"] = wait_bindable(wanted, float(req.get("settle", proto.PORT_SETTLE)))
    return answer


def wait_bindable(wanted: list, settle: float) -> dict:
    """port -> None once it binds, else its holder after `settle` seconds of trying."""
    deadline, nap = time.monotonic() + max(0.0, settle), POLL / 10
    while True:
        busy = [p for p in wanted if not ports.port_free(p)]
        if not busy or time.monotonic() >= deadline:
            return {str(p): (ports.port_holder(p) if p in busy else None) for p in wanted}
        time.sleep(nap)            # a killed server's socket goes within ms: soon, then less often
        nap = min(POLL, nap * 2)
