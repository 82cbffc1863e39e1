"""Calls into paramiko from the main thread run on a thread of their own.

Python raises KeyboardInterrupt (Ctrl-C) and Terminated (SIGTERM) in the main thread, between
two bytecodes, wherever it is. paramiko is not written for that: it takes its locks with
`lock.acquire()` and protects them with a `try:` a few bytecodes later (the connection's
`clear_to_send_lock`, a channel's lock, the packetizer's write lock), and it sends a packet
with a loop over `socket.send`. A Ctrl-C landing in between leaves a lock held, or half a
packet sent; the next call on that connection then waits forever (seen: a `train` that never
stopped after Ctrl-C during "Starting 3 server(s)", when the main thread was writing GO).

So a call made on the main thread runs on a daemon thread, and the main thread waits for it.
Ctrl-C interrupts that wait at once, as before; the call itself ends cleanly on its thread,
and whatever follows (the run's stop) finds the connection whole. Calls from other threads
run as they are: no signal is ever raised in them.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


def off_main(method: F) -> F:
    """`method`, run on a thread of its own when called from the main thread."""

    @functools.wraps(method)
    def call(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return method(*args, **kwargs)
        outcome: list = []
        done = threading.Event()

        def run() -> None:
            try:
                outcome.append((True, method(*args, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                outcome.append((False, exc))
            finally:
                done.set()

        threading.Thread(target=run, daemon=True, name=f"off-main {method.__qualname__}").start()
        done.wait()           # Ctrl-C lands here, never inside the library
        ok, value = outcome[0]
        if ok:
            return value
        try:
            raise value
        finally:
            del value         # no cycle through the frame

    return call  # type: ignore[return-value]
