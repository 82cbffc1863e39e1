"""Is the host still there? A keepalive that wants an answer, on every SSH connection.

paramiko's own keepalive (`Transport.set_keepalive`) sends `keepalive@lag.net` without asking
for a reply, so nothing tells a silent host (its packets dropped, its box hung) from a quiet
one: TCP would retransmit for a quarter of an hour before giving up. Here, as ssh(1)'s
ServerAliveInterval does, a connection from which nothing was heard for `interval` seconds
gets a `keepalive@openssh.com` global request with want-reply set; sshd answers every such
request (with a failure: it knows no such request, which is all we ask). Anything received
counts as heard, an answer or task output, so a busy connection carries no probe at all.
Nothing heard for `silent_after` seconds: the connection is closed, and its channels end as a
dropped connection's do, with the reason kept for whoever asks why (docs/design/host-loss.md).

One thread per watched connection: a probe's send can block only while the connection's key
exchange or socket buffer does, and then it holds up no other host's verdict.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

PROBE_INTERVAL = 5.0       # seconds of quiet before a probe
SILENT_AFTER = 20.0        # seconds without a packet from the host before it is declared silent
TICK = 0.5                 # how often the watcher looks
STALL = 2.0                # a look this late: this process did not run (Ctrl-Z, a suspended laptop)
PROBE = "keepalive@openssh.com"


def received_packets(transport) -> int | None:
    """paramiko's count of packets received on the connection (reset at each rekey, which is a
    change too); None when this paramiko keeps no such count (then silence is never declared)."""
    return getattr(transport.packetizer, "_Packetizer__received_packets", None)


def send_probe(transport) -> bool:
    """Send one keepalive that asks for an answer, unless a key exchange is under way (its
    send would wait for it). False when nothing was sent."""
    from paramiko.common import cMSG_GLOBAL_REQUEST
    from paramiko.message import Message

    if not transport.is_active() or not transport.clear_to_send.is_set():
        return False
    m = Message()
    m.add_byte(cMSG_GLOBAL_REQUEST)
    m.add_string(PROBE)
    m.add_boolean(True)            # want reply: the answer is the proof of life
    try:
        transport._send_user_message(m)
    except Exception:  # noqa: BLE001 - a dying connection: its reader says so
        return False
    return True


class Watch:
    """Watches one paramiko transport until it closes; calls `on_silent(reason)` once, from its
    own thread, then closes the connection with `close()`."""

    def __init__(self, transport, close: Callable[[], None], on_silent: Callable[[str], None],
                 interval: float = PROBE_INTERVAL, silent_after: float = SILENT_AFTER,
                 name: str = "") -> None:
        self.transport = transport
        self.interval = interval
        self.silent_after = silent_after
        self.probes = 0
        self._close = close
        self._on_silent = on_silent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tfcluster-alive-{name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        count = received_packets(self.transport)
        heard = probed = last = time.monotonic()
        while not self._stop.wait(TICK):
            if not self.transport.is_active():
                return
            now = time.monotonic()
            if now - last > STALL:             # this process was stopped or starved, not the host:
                heard = now                    # the host gets its full time again
            last = now
            seen = received_packets(self.transport)
            if seen is None:
                return                     # cannot tell: never declare a host silent blindly
            if seen != count:
                count, heard = seen, now
                continue
            if now - heard >= self.silent_after:
                self._declare()
                return
            if now - heard >= self.interval and now - probed >= self.interval:
                probed = now
                self.probes += send_probe(self.transport)

    def _declare(self) -> None:
        self._on_silent(f"silent for {self.silent_after:g}s, no answer to keepalives")
        self._close()
