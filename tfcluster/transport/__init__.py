"""Transports: how tfcluster reaches a host (DESIGN.md §4).

Importing this package stays cheap: paramiko and the local transport load only
when `make_transport` builds one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tfcluster.spec import Host
    from tfcluster.transport.base import Transport


def make_transport(host: Host) -> Transport:
    """The transport for `host`: local processes when `host.local`, else SSH."""
    if host.local:
        from tfcluster.transport.local import LocalTransport
        return LocalTransport(host.name)
    from tfcluster.transport.ssh import SshTransport
    return SshTransport(host)
