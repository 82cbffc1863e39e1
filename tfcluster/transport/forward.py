"""A local port forwarded to a port on a host through its SSH connection (`ssh -L`).

A listening socket on 127.0.0.1; each accepted connection gets its own channel (opened
by the transport, `direct-tcpip`) and a pair of pump threads, one per direction.
`close()` stops accepting, closes every connection and joins every thread. See
docs/design/tensorboard.md, "TensorBoard on the chief".
"""
from __future__ import annotations

import socket
import threading
from typing import Callable

from tfcluster.transport.base import Forward
from tfcluster.transport.offmain import off_main

CHUNK = 65536
JOIN_TIMEOUT = 5.0


def listen(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:`port`, or on a free port when that one is taken."""
    for candidate in dict.fromkeys((port, 0)):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", candidate))
            sock.listen(16)
            return sock
        except OSError:
            sock.close()
            if candidate == 0:
                raise
    raise AssertionError("unreachable")


class Forwarder(Forward):
    """Connections to 127.0.0.1:`local_port` here reach what `open_channel` opens.

    `open_channel(origin)` returns a paramiko-like channel (recv, sendall, shutdown_write,
    close) or raises; the accepted connection is then closed at once."""

    def __init__(self, open_channel: Callable[[tuple[str, int]], object], local_port: int = 0,
                 name: str = "") -> None:
        self._listener = listen(local_port)
        super().__init__(self._listener.getsockname()[1])
        self._open = open_channel
        self._name = name
        self._lock = threading.Lock()
        self._closed = False
        self._open_pairs: set[tuple[socket.socket, object]] = set()
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept, "accept")

    def _spawn(self, target, what: str, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True,
                                  name=f"tfcluster-forward-{self._name}-{what}")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, origin = self._listener.accept()
            except OSError:          # closed (close() shuts it down to wake us)
                return
            with self._lock:
                closed = self._closed
            if closed:
                client.close()
                return
            self._spawn(self._serve, "conn", client, origin)

    def _serve(self, client: socket.socket, origin: tuple[str, int]) -> None:
        try:
            chan = self._open(origin)
        except Exception:  # noqa: BLE001 - nothing listens there (yet), or the connection died
            client.close()
            return
        pair = (client, chan)
        with self._lock:
            if self._closed:
                client.close()
                chan.close()
                return
            self._open_pairs.add(pair)
        back = threading.Thread(target=_pump_back, args=(chan, client), daemon=True,
                                name=f"tfcluster-forward-{self._name}-back")
        back.start()
        try:
            _pump_out(client, chan)
            back.join()
        finally:
            _close_pair(pair)
            with self._lock:
                self._open_pairs.discard(pair)

    @off_main      # it closes channels: transport/offmain.py
    def close(self) -> None:
        """Stop accepting, drop every connection, join every thread. Idempotent."""
        with self._lock:
            self._closed = True
            pairs = list(self._open_pairs)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)   # wakes accept()
        except OSError:
            pass
        self._listener.close()
        for pair in pairs:
            _close_pair(pair)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(JOIN_TIMEOUT)


def _pump_out(client: socket.socket, chan) -> None:
    """Local connection -> channel, until EOF (then half-close) or an error."""
    try:
        while data := client.recv(CHUNK):
            chan.sendall(data)
        chan.shutdown_write()
    except (OSError, EOFError):
        _close_pair((client, chan))


def _pump_back(chan, client: socket.socket) -> None:
    """Channel -> local connection, until EOF (then half-close) or an error."""
    try:
        while data := chan.recv(CHUNK):
            client.sendall(data)
        client.shutdown(socket.SHUT_WR)
    except (OSError, EOFError):
        _close_pair((client, chan))


def _close_pair(pair: tuple[socket.socket, object]) -> None:
    client, chan = pair
    try:
        client.shutdown(socket.SHUT_RDWR)   # wakes a recv() blocked in the other pump
    except OSError:
        pass
    client.close()
    try:
        chan.close()
    except (OSError, EOFError):
        pass
