"""The host's side of the network checks: listeners on task ports, connections to every
task address (the `reach` exchange itself is spoken in shim_talk.py), and the proxy guard
(the no_proxy a task gets). See docs/design/remote-execs.md, "Checks before a run".

Shipped beside shim.py (standard library only, Python >= 3.8, no tfcluster imports).
A listener binds dual-stack `::`, else 0.0.0.0; a port someone else holds is reported with
its holder; connections go out in parallel and each gets a one-line reason or null.
"""
from __future__ import annotations

import errno
import os
import queue
import re
import selectors
import socket
import struct
import threading
import time

if __package__:
    from . import shim_ports
else:  # shipped: the shim's directory is first on sys.path
    import shim_ports

CONNECT_TIMEOUT = 5.0    # per target: one SYN retransmit (1 s) and then some
LIFETIME = 120.0         # a reach whose launcher went silent closes its listeners by then
MAX_THREADS = 64         # names resolved at once
MAX_INFLIGHT = 256       # connections opened at once (one file descriptor each)
RESOLVE_SLACK = 10.0     # a hung resolver may hold a probe this much past its timeout

# Variables that send a process's HTTP (and gRPC) connections through a proxy, in any case.
# gRPC reads grpc_proxy, https_proxy, http_proxy (lower case), and then no_grpc_proxy, else
# no_proxy, matching the target's host name (no port) exactly or as a suffix.
PROXY_VARS = ("http_proxy", "https_proxy", "grpc_proxy", "all_proxy")
NO_PROXY_VARS = ("no_proxy", "NO_PROXY")
GRPC_NO_PROXY = "no_grpc_proxy"   # when set, gRPC ignores no_proxy: extended too



# ---------------------------------------------------------------- listen / connect

def listen(ports) -> tuple[dict, dict]:
    """(port -> listening socket, port -> why it could not listen). A busy port is not an
    error here: it may be the cluster's own live server; the launcher decides."""
    sockets, busy = {}, {}
    for port in ports:
        try:
            sockets[int(port)] = _listener(int(port))
        except OSError as e:
            busy[str(port)] = (shim_ports.port_holder(int(port)) if e.errno == errno.EADDRINUSE
                               else "cannot listen: %s" % (e.strerror or e))
    return sockets, busy


def _listener(port: int) -> socket.socket:
    """Every interface, as a TF server binds: dual-stack when the host has IPv6."""
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:
        s = None
    if s is not None:
        try:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("::", port))
            s.listen(1024)
            return s
        except OSError as e:
            s.close()
            if e.errno == errno.EADDRINUSE:
                raise
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        s.listen(1024)
    except OSError:
        s.close()
        raise
    return s


class Acceptor:
    """Accepts (and holds) every connection to the listeners, so a full accept queue never
    turns into a false timeout; closing resets them (no TIME_WAIT on a task's port)."""

    def __init__(self, listeners) -> None:
        self.listeners = list(listeners)
        self.accepted = []
        self.stop = threading.Event()
        self.selector = selectors.DefaultSelector()     # epoll: no FD_SETSIZE limit
        for s in self.listeners:
            self.selector.register(s, selectors.EVENT_READ)
        # close() wakes the select at once (a timeout there cost every check its length)
        self.wake_r, self.wake_w = os.pipe()
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.thread = threading.Thread(target=self.run, daemon=True)
        if self.listeners:
            self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                ready = self.selector.select(1.0)
            except (OSError, ValueError):
                return
            for key, _ in ready:
                if key.fileobj == self.wake_r:
                    return
                try:
                    self.accepted.append(key.fileobj.accept()[0])
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass
        if self.thread.is_alive():
            self.thread.join(1.0)
        self.selector.close()
        for fd in (self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        for s in self.accepted + self.listeners:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            s.close()


def probe(address: str, port: int, timeout: float = CONNECT_TIMEOUT) -> str | None:
    """None when a TCP connection to address:port opens within `timeout`, else why not."""
    return probe_all([(address, port)], timeout)["%s:%s" % (address, port)]


def _resolve(address: str):
    """[(family, kind, proto, sockaddr without its port)] or the one-line reason it failed."""
    try:
        infos = socket.getaddrinfo(address, None, 0, socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return "name does not resolve"
        return "name does not resolve (%s)" % (e.strerror or e)
    return [(f, k, p, a) for f, k, p, _, a in infos] or "name does not resolve (no address)"


def _resolve_all(addresses, deadline: float) -> dict:
    """address -> _resolve(address); a literal IP at once, names in threads (a resolver can
    hang: a name not answered by `deadline` is left out)."""
    found, names = {}, []
    for a in addresses:
        try:
            socket.inet_pton(socket.AF_INET6 if ":" in a else socket.AF_INET, a)
            found[a] = _resolve(a)
        except (OSError, ValueError):
            names.append(a)
    lock, work = threading.Lock(), queue.Queue()
    for a in names:
        work.put(a)

    def worker() -> None:             # a hung name holds one worker, never the others
        while True:
            try:
                a = work.get_nowait()
            except queue.Empty:
                return
            answer = _resolve(a)
            with lock:
                found[a] = answer

    threads = [threading.Thread(target=worker, daemon=True) for _ in names[:MAX_THREADS]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    with lock:
        return dict(found)


def probe_all_bound(count: int, timeout: float) -> float:
    """How long probe_all may take for `count` targets: names resolved (a timeout, and
    the slack a hung resolver gets), then rounds of MAX_INFLIGHT connections."""
    return timeout * ((count - 1) // MAX_INFLIGHT + 2) + RESOLVE_SLACK


def probe_all(targets, timeout: float = CONNECT_TIMEOUT) -> dict:
    """"address:port" -> None | reason for every target: each name resolved once, then
    every connection opened at once (non-blocking, one selector, MAX_INFLIGHT at a time),
    each within `timeout` of its start; a target's addresses are tried in order."""
    keys = ["%s:%s" % (a, p) for a, p in targets]
    if not keys:
        return {}
    start = time.monotonic()
    resolved = _resolve_all({a for a, _ in targets}, start + timeout + RESOLVE_SLACK)
    results, todo = {}, []
    for (address, port), key in zip(targets, keys):
        found = resolved.get(address, "no answer within %gs (name resolution hung?)" % timeout)
        if isinstance(found, str):
            results[key] = found
        elif key not in results:
            results[key] = _timed_out(timeout)     # until a connection says otherwise
            todo.append((key, [(f, k, p, (a[0], int(port)) + tuple(a[2:])) for f, k, p, a in found]))
    _connect_all(todo, results, timeout)
    return {k: results[k] for k in keys}


def _connect_all(todo: list, results: dict, timeout: float) -> None:
    """Set results[key] to None or the reason for each (key, addresses) of `todo`."""
    sel = selectors.DefaultSelector()
    waiting = {}                                   # socket -> (key, addresses left, deadline)
    queue_ = list(reversed(todo))

    def attempt(key: str, addrs: list, deadline: float) -> None:
        while addrs:
            if time.monotonic() >= deadline:
                results[key] = _timed_out(timeout)
                return
            family, kind, proto, sockaddr = addrs[0]
            try:
                s = socket.socket(family, kind, proto)
            except OSError as e:
                results[key], addrs = (e.strerror or str(e)).lower(), addrs[1:]
                continue
            s.setblocking(False)
            code = s.connect_ex(sockaddr)
            if code in (errno.EINPROGRESS, errno.EALREADY):
                sel.register(s, selectors.EVENT_WRITE)
                waiting[s] = (key, addrs[1:], deadline)
                return
            s.close()
            if code == 0:
                results[key] = None
                return
            results[key], addrs = _reason(code), addrs[1:]

    try:
        while queue_ or waiting:
            while queue_ and len(waiting) < MAX_INFLIGHT:
                key, addrs = queue_.pop()
                attempt(key, addrs, time.monotonic() + timeout)
            if not waiting:
                continue
            wait = min(d for _, _, d in waiting.values()) - time.monotonic()
            for sk, _ in sel.select(max(0.0, wait)):
                s = sk.fileobj
                key, rest, deadline = waiting.pop(s)
                sel.unregister(s)
                code = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                s.close()
                if code == 0:
                    results[key] = None
                else:
                    results[key] = _reason(code)
                    attempt(key, rest, deadline)
            now = time.monotonic()
            for s, (key, _, deadline) in list(waiting.items()):
                if now >= deadline:
                    waiting.pop(s)
                    sel.unregister(s)
                    s.close()
                    results[key] = _timed_out(timeout)
    finally:
        for s in waiting:
            s.close()
        sel.close()


def _timed_out(timeout: float) -> str:
    return "timed out after %gs" % round(timeout, 1)


def _reason(code: int) -> str:
    if code == errno.ECONNREFUSED:
        return "connection refused"
    return os.strerror(code).lower()


# ---------------------------------------------------------------- proxy guard

def proxies_set(env) -> list:
    """The names of the proxy variables `env` sets to something (any case)."""
    return sorted(k for k, v in env.items() if k.lower() in PROXY_VARS and v.strip())


def guard_env(env, hosts) -> dict:
    """The no_proxy changes that keep connections to `hosts` off a proxy: {} unless `env`
    sets a proxy variable. Each no_proxy variable keeps its entries and gains the missing
    hosts (compared without case), comma-joined."""
    if not hosts or not proxies_set(env):
        return {}
    names = NO_PROXY_VARS + ((GRPC_NO_PROXY,) if GRPC_NO_PROXY in env else ())
    changes = {}
    for name in names:
        entries = [e.strip() for e in env.get(name, "").split(",") if e.strip()]
        have = {e.lower() for e in entries}
        entries += [h for h in dict.fromkeys(hosts) if h.lower() not in have]
        changes[name] = ",".join(entries)
    return changes


def proxy_report(env) -> dict:
    """The proxy-related variables of `env`, credentials in proxy URLs masked (for `info`)."""
    out = {}
    for name, value in env.items():
        if name.lower() in PROXY_VARS:
            out[name] = re.sub(r"://[^/@]*@", "://***@", value)
        elif name in NO_PROXY_VARS or name == GRPC_NO_PROXY:
            out[name] = value
    return out
