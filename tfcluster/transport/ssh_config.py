"""Where and how to reach an SSH host: explicit options merged with ~/.ssh/config.

Resolution follows ssh(1): explicit options first, then ~/.ssh/config (looked up by
the host's address, then its name), then defaults. This module is imported to build
`SshOptions` by commands that never connect (`tfcluster plan`), so paramiko is only
imported inside the functions that parse a config file.
"""
from __future__ import annotations

import getpass
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tfcluster.errors import ConnectError

if TYPE_CHECKING:
    import paramiko

USER_CONFIG = "~/.ssh/config"


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


@dataclass(frozen=True)
class Endpoint:
    """One SSH destination after merging the options, ~/.ssh/config and defaults."""

    name: str                       # the host's name as the caller knows it, or the jump as written
    address: str                    # what we open TCP to (config HostName applied)
    port: int
    user: str
    key_files: tuple[str, ...]
    look_for_keys: bool             # default ~/.ssh/id_* keys, when no identity is given
    known_hosts: tuple[str, ...]    # as written; the first one is where accept-new writes
    policy: str
    timeout: float
    jump: str | None                # "user@host:port[,...]" or a config alias
    role: str = "host"              # "host" or "jump host", for messages

    @property
    def label(self) -> str:
        return f"{self.name} ({self.address}:{self.port})"

    @property
    def key_name(self) -> str:
        """The known_hosts name, as OpenSSH writes it: `[addr]:port` off port 22."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"

    def error(self, problem: str, hint: str | None = None) -> ConnectError:
        """A one-line ConnectError naming this endpoint."""
        return ConnectError(f"{self.role} {self.label}: {problem}", hint=hint)


def load_ssh_config(path: str = USER_CONFIG) -> paramiko.SSHConfig:
    """The parsed ssh_config at `path` (empty when there is none)."""
    import paramiko
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(path)
    except Exception as e:  # noqa: BLE001 - paramiko raises several types here
        raise ConnectError(f"{path}: cannot parse ssh config: {e}") from None


def _config_options(config: paramiko.SSHConfig, name: str, address: str) -> dict:
    """ssh_config options for `address`, missing ones filled from a lookup by `name`.

    HostName only ever comes from the address: an address the caller gives is explicit."""
    options = {k: v for k, v in config.lookup(name).items() if k != "hostname"} \
        if name != address else {}
    options.update(config.lookup(address))
    return options


def resolve(name: str, address: str, options: SshOptions, config: paramiko.SSHConfig,
            extra_keys: tuple[str, ...] = (), role: str = "host") -> Endpoint:
    """The endpoint for host `name` at `address`; raises ConnectError for a missing key."""
    opts = _config_options(config, name, address)
    exp = os.path.expanduser
    if options.identity_file:
        keys, look = (exp(options.identity_file),), False
    elif "identityfile" in opts:
        keys, look = tuple(exp(k) for k in opts["identityfile"] if os.path.isfile(exp(k))), False
    else:
        keys, look = (), True
    keys += tuple(k for k in extra_keys if k not in keys and os.path.isfile(k))
    known = (options.known_hosts,) if options.known_hosts else \
        tuple(opts.get("userknownhostsfile", "~/.ssh/known_hosts").split())
    jump = options.jump_host or opts.get("proxyjump")
    ep = Endpoint(name=name, address=opts.get("hostname", address),
                  port=int(options.port or opts.get("port", 22)),
                  user=options.user or opts.get("user") or getpass.getuser(),
                  key_files=keys, look_for_keys=look, known_hosts=known,
                  policy=options.host_key_policy, timeout=float(options.connect_timeout),
                  jump=None if (jump or "none").lower() == "none" else jump, role=role)
    if options.identity_file and not os.path.isfile(keys[0]):
        raise ep.error(f"identity file {options.identity_file} not found",
                       "fix ssh.identity_file in the spec")
    return ep


def jump_endpoint(target: Endpoint, options: SshOptions,
                  config: paramiko.SSHConfig) -> Endpoint:
    """The last hop of target.jump; earlier hops (A,B -> B via A) become its own jump.

    `options` are the target's: the jump shares its known_hosts, policy and timeout."""
    assert target.jump, "jump_endpoint needs a target with a jump"
    hops = [h.strip() for h in target.jump.split(",") if h.strip()]
    hop = hops[-1].removeprefix("ssh://")
    user, _, hostport = hop.rpartition("@")
    host, port = hostport, None
    if hostport.count(":") == 1 and not hostport.startswith("["):
        host, port = hostport.split(":")
    elif hostport.startswith("[") and "]:" in hostport:
        host, port = hostport[1:].split("]:")
    host = host.strip("[]")
    hop_options = SshOptions(user=user or None, port=int(port) if port else None,
                             known_hosts=options.known_hosts,
                             host_key_policy=options.host_key_policy,
                             jump_host=",".join(hops[:-1]) or None,
                             connect_timeout=options.connect_timeout)
    # the target's explicit key is a fallback for the jump (usually one key for the whole lab)
    extra = (os.path.expanduser(options.identity_file),) if options.identity_file else ()
    return resolve(host, host, hop_options, config, extra, role="jump host")
