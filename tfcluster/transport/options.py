"""How to reach one SSH host, as the plan states it: a frozen record and nothing that
connects, so the pure plan can hold it without importing the transport's machinery."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SshOptions:
    """How to reach one host; None means "ask ~/.ssh/config, then ssh's default"."""

    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    host_key_policy: str = "reject"     # or "accept-new"; a changed key is always refused
    jump_host: str | None = None        # "user@host:port[,...]" or a config alias
    connect_timeout: float = 10.0
