"""Transports: how tfcluster reaches a host (local processes, or SSH).

Importing this package stays cheap: paramiko and the local transport load only
when `make_transport` builds one. Nothing here knows the spec: callers hand over
a name, an address and, for SSH, `SshOptions` (tfcluster.transport.ssh_config).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tfcluster.transport.base import Transport
    from tfcluster.transport.ssh_config import SshOptions


def make_transport(name: str, address: str, *, local: bool,
                   ssh: SshOptions | None = None) -> Transport:
    """The transport for host `name`: local processes when `local`, else SSH to `address`.

    `ssh` defaults to `SshOptions()`: everything from ~/.ssh/config and ssh's defaults."""
    if local:
        from tfcluster.transport.local import LocalTransport
        return LocalTransport(name)
    from tfcluster.transport.ssh import SshTransport
    from tfcluster.transport.ssh_config import SshOptions
    return SshTransport(name, address, ssh or SshOptions())
