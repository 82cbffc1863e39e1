"""known_hosts as ssh(1) reads them: the user's files and the global ones, host patterns,
hashed names, `@revoked`; and the host-key policy that decides on every connection.

Pure Python (no paramiko): keys are compared as their public blobs. What is and is not
like ssh(1) is listed in docs/design/ssh.md.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import shlex
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tfcluster.errors import Cause

if TYPE_CHECKING:
    from tfcluster.transport.ssh_config import Endpoint

_lock = threading.Lock()           # one writer at a time in this process (O_APPEND across them)
REVOKED = "@revoked"
CERT_AUTHORITY = "@cert-authority"


def shell_path(path: str) -> str:
    """`path` quoted for a shell, a leading `~/` left bare so that the shell expands it."""
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


@dataclass(frozen=True)
class Entry:
    marker: str | None              # None, "@revoked" or "@cert-authority"
    patterns: str                   # "a,b,*.lab,![x]:22" or one hashed "|1|salt|hash"
    key_type: str
    blob: bytes
    path: str                       # the file it came from, for messages

    def matches(self, host: str) -> bool:
        if self.patterns.startswith("|1|"):
            return _hashed_matches(host, self.patterns)
        found = False
        for pattern in self.patterns.split(","):
            negated = pattern.startswith("!")
            if _wildcard(pattern.removeprefix("!").lower()).fullmatch(host.lower()):
                if negated:
                    return False                # ssh(1): a negated match wins
                found = True
        return found


def _wildcard(pattern: str) -> re.Pattern:
    """ssh(1)'s patterns: `*` and `?` only (brackets, as in `[host]:port`, are literal)."""
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c)
                              for c in pattern))


def _hashed_matches(host: str, hashed: str) -> bool:
    try:
        _, _, salt, digest = hashed.split("|")
        salt, digest = base64.b64decode(salt), base64.b64decode(digest)
    except (ValueError, binascii.Error):
        return False
    return hmac.compare_digest(hmac.new(salt, host.encode(), hashlib.sha1).digest(), digest)


def hash_host(host: str) -> str:
    """`|1|salt|hash`, as `HashKnownHosts yes` writes it."""
    salt = os.urandom(20)
    digest = hmac.new(salt, host.encode(), hashlib.sha1).digest()
    return f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"


def fingerprint(blob: bytes) -> str:
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def parse(text: str, path: str) -> list[Entry]:
    """The entries of one known_hosts file; lines ssh(1) would skip are skipped."""
    entries = []
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = fields.pop(0) if fields[0].startswith("@") else None
        if marker not in (None, REVOKED, CERT_AUTHORITY) or len(fields) < 3:
            continue
        try:
            blob = base64.b64decode(fields[2], validate=True)
        except (ValueError, binascii.Error):
            continue
        entries.append(Entry(marker, fields[0], fields[1], blob, path))
    return entries


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None


class KnownHosts:
    """Every entry of an endpoint's known_hosts files, user files first."""

    def __init__(self, ep: Endpoint) -> None:
        self.ep = ep
        self.entries: list[Entry] = []
        for path in ep.known_hosts:
            path = os.path.expanduser(path)
            try:
                text = _read(path)
            except OSError as e:
                raise ep.error(f"cannot read known_hosts {path}: {e.strerror}") from None
            self.entries += parse(text or "", path)
        for path in ep.global_known_hosts:
            try:                                 # ssh(1) skips a global file it cannot read
                self.entries += parse(_read(os.path.expanduser(path)) or "", path)
            except OSError:
                pass

    def key_types(self) -> list[str]:
        """The key types known for this host, to be asked of the server first."""
        name = self.ep.key_name
        types = []
        for e in self.entries:
            if e.marker is None and e.key_type not in types and e.matches(name):
                types.append(e.key_type)
        return types

    def check(self, key_type: str, blob: bytes) -> bool:
        """True when the host's key is known; False when the host is unknown. A revoked
        key, or a host known with other keys only, raises ConnectError."""
        ep, name = self.ep, self.ep.key_name
        entries = [e for e in self.entries if e.marker != CERT_AUTHORITY and e.matches(name)]
        for e in entries:
            if e.marker == REVOKED and e.blob == blob:
                raise ep.error(f"host key REVOKED ({key_type} {fingerprint(blob)} is marked "
                               f"@revoked in {e.path})",
                               hint="the host must get a new host key; ask its administrator",
                               cause=Cause.HOST_KEY)
        known = [e for e in entries if e.marker is None]
        if any(e.blob == blob for e in known):
            return True
        if not known:
            return False
        old = next((e for e in known if e.key_type == key_type), known[0])
        raise ep.error(f"host key CHANGED ({key_type} {fingerprint(blob)}, known_hosts has "
                       f"{fingerprint(old.blob)}): possible man-in-the-middle",
                       hint="if the host was reinstalled, check the new fingerprint, then "
                            f"`ssh-keygen -R {shlex.quote(name)} -f {shell_path(old.path)}`",
                       cause=Cause.HOST_KEY)


class HostKeyPolicy:
    """paramiko's MissingHostKeyPolicy (duck-typed). The client is given no host keys of its
    own, so paramiko asks this policy on every connection: all checking happens here."""

    def __init__(self, ep: Endpoint, known: KnownHosts) -> None:
        self.ep = ep
        self.known = known

    def missing_host_key(self, client, hostname: str, key) -> None:
        ep, blob = self.ep, key.asbytes()
        if self.known.check(key.get_name(), blob):
            return
        if ep.policy != "accept-new":
            kh = shell_path(ep.known_hosts[0])
            scan = f"ssh-keyscan -p {ep.port} {shlex.quote(ep.address)} >> {kh}"
            error = ep.error(f"unknown host key ({key.get_name()} {fingerprint(blob)})",
                             hint=f"run `{scan}` after checking the fingerprint, "
                                  "or set ssh.host_key_policy: accept-new",
                             cause=Cause.HOST_KEY)
            error.scan = (ep.port, ep.address, kh)
            raise error
        append(os.path.expanduser(ep.known_hosts[0]), ep.key_name, key.get_name(), blob,
               hashed=ep.hash_known_hosts)


def append(path: str, name: str, key_type: str, blob: bytes, hashed: bool = False) -> None:
    """Record `name`'s key in the user's known_hosts `path` (0600, parent 0700), unless a
    concurrent connect recorded it already."""
    parent = os.path.dirname(path)
    host = hash_host(name) if hashed else name
    line = f"{host} {key_type} {base64.b64encode(blob).decode()}\n".encode()
    with _lock:
        if parent and not os.path.isdir(parent):
            os.makedirs(parent, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            with open(fd, "rb", closefd=False) as f:
                existing = f.read()
            if any(e.marker is None and e.blob == blob and e.matches(name)
                   for e in parse(existing.decode(errors="replace"), path)):
                return
            os.write(fd, (b"\n" if existing and not existing.endswith(b"\n") else b"") + line)
        finally:
            os.close(fd)
