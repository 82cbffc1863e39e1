"""Where and how to reach an SSH host: explicit options merged with ~/.ssh/config.

Resolution follows ssh(1): explicit options first, then ~/.ssh/config and the system's
/etc/ssh/ssh_config (each looked up by the host's address, then its name), then defaults.
This module is imported to build `SshOptions` by commands that never connect
(`tfcluster plan`), so paramiko is only imported inside the functions that parse a config
file. What follows ssh(1) and what does not: docs/design/ssh.md.
"""
from __future__ import annotations

import dataclasses
import functools
import getpass
import os
import re
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tfcluster.errors import Cause, ConnectError
from tfcluster.transport.options import SshOptions

if TYPE_CHECKING:
    from tfcluster.transport._paramiko import paramiko

USER_CONFIG = "~/.ssh/config"
# The tests point this elsewhere (an empty value: none), as they do HOME.
SYSTEM_CONFIG_VAR = "TFCLUSTER_SSH_SYSTEM_CONFIG"
SYSTEM_CONFIG = "/etc/ssh/ssh_config"
USER_KNOWN_HOSTS = "~/.ssh/known_hosts ~/.ssh/known_hosts2"
GLOBAL_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2"
FIRST_PROXY = "tfcluster-first-proxy"    # which of ProxyCommand/ProxyJump a block names first


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
    proxy_command: str | None = None    # tokens expanded; never together with `jump`
    allow_agent: bool = True        # False: IdentitiesOnly (agent keys only if in key_files)
    global_known_hosts: tuple[str, ...] = ()    # read, never written
    hash_known_hosts: bool = False  # accept-new records the name hashed
    # (probe after this many quiet seconds, silent after this many) from ServerAliveInterval
    # and ServerAliveCountMax; None: the transport's own (transport/liveness.py)
    alive: tuple[float, float] | None = None

    @property
    def label(self) -> str:
        return f"{self.name} ({self.address}:{self.port})"

    @property
    def key_name(self) -> str:
        """The known_hosts name, as OpenSSH writes it: `[addr]:port` off port 22."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"

    def error(self, problem: str, hint: str | None = None, cause: Cause = Cause.OTHER) -> ConnectError:
        """A one-line ConnectError naming this endpoint."""
        return ConnectError(f"{self.role} {self.label}: {problem}", hint=hint, cause=cause)


def load_ssh_config(path: str = USER_CONFIG, system: str | None = None) -> paramiko.SSHConfig:
    """The parsed ssh_config at `path`, then the system's (either may be missing).

    As in ssh(1), the first value found for an option wins, the user's file first."""
    if system is None:
        system = os.environ.get(SYSTEM_CONFIG_VAR, SYSTEM_CONFIG)
    config = _config_class()()
    for p, own in ((os.path.expanduser(path), True), (system, False)):
        if not p or not os.path.isfile(p):
            continue
        with open(p) as f:
            st = os.fstat(f.fileno())
            if own and (st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022):
                # ssh(1) refuses it too: someone else could make us run their ProxyCommand
                raise ConnectError(f"{p}: bad owner or permissions",
                                   hint=f"it must be yours and not writable by others: "
                                        f"chmod go-w {shlex.quote(p)}")
            try:
                config.parse(f)
            except Exception as e:  # noqa: BLE001 - paramiko raises several types here
                raise ConnectError(f"{p}: cannot parse ssh config: {e}") from None
    return config


@functools.cache
def _config_class() -> type:
    """paramiko's SSHConfig that leaves ProxyCommand's tokens to us (paramiko takes %p from
    the config, not from the port we connect to) and notes which of ProxyCommand and
    ProxyJump each block names first (ssh(1): the first one found wins)."""
    from tfcluster.transport._paramiko import enable_match_exec, paramiko

    class SSHConfig(paramiko.SSHConfig):
        TOKENS_BY_CONFIG_KEY = {k: v for k, v in paramiko.SSHConfig.TOKENS_BY_CONFIG_KEY.items()
                                if k != "proxycommand"}

        def parse(self, file_obj) -> None:
            super().parse(file_obj)
            if any(m.get("type") == "exec" for c in self._config for m in c.get("matches", ())):
                enable_match_exec()
            for context in self._config:
                first = next((k for k in context["config"]
                              if k in ("proxycommand", "proxyjump")), None)
                if first and FIRST_PROXY not in context["config"]:
                    context["config"][FIRST_PROXY] = first

    return SSHConfig


def _config_options(config: paramiko.SSHConfig, name: str, address: str) -> dict:
    """ssh_config options for `address`, missing ones filled from a lookup by `name`.

    HostName only ever comes from the address: an address the caller gives is explicit."""
    options = {k: v for k, v in config.lookup(name).items() if k != "hostname"} \
        if name != address else {}
    options.update(config.lookup(address))
    return options


def resolve(name: str, address: str, options: SshOptions, config: paramiko.SSHConfig,
            extra_keys: tuple[str, ...] = (), role: str = "host",
            identities_only: bool = False) -> Endpoint:
    """The endpoint for host `name` at `address`; raises ConnectError for a missing key.

    With an identity file in `options` (or `identities_only`, or IdentitiesOnly in the
    config) only the listed keys are offered: no other agent key, no ~/.ssh/id_*."""
    opts = _config_options(config, name, address)
    exp = os.path.expanduser
    only = bool(options.identity_file) or identities_only or _yes(opts, "identitiesonly")
    if options.identity_file:
        keys, look = (exp(options.identity_file),), False
    elif "identityfile" in opts:
        keys, look = tuple(exp(k) for k in opts["identityfile"] if os.path.isfile(exp(k))), False
    else:
        keys, look = (), not identities_only
    keys += tuple(k for k in extra_keys if k not in keys and os.path.isfile(k))
    port = options.port or opts.get("port", 22)
    if not str(port).isdigit() or not 1 <= int(port) <= 65535:
        raise ConnectError(f"{role} {name}: bad port {port!r} in ssh config")
    known = (options.known_hosts,) if options.known_hosts else \
        tuple(opts.get("userknownhostsfile", USER_KNOWN_HOSTS).split())
    if options.jump_host:                # explicit, like `ssh -J`: beats the config's proxies
        jump, command = options.jump_host, None
    else:
        jump, command = _proxy(opts)
    ep = Endpoint(name=name, address=opts.get("hostname", address),
                  port=int(port),
                  user=options.user or opts.get("user") or getpass.getuser(),
                  key_files=keys, look_for_keys=look, known_hosts=known,
                  policy=options.host_key_policy, timeout=float(options.connect_timeout),
                  jump=jump, role=role, allow_agent=not only,
                  global_known_hosts=tuple(opts.get("globalknownhostsfile",
                                                    GLOBAL_KNOWN_HOSTS).split()),
                  hash_known_hosts=_yes(opts, "hashknownhosts"), alive=_alive(opts))
    if options.identity_file and not os.path.isfile(keys[0]):
        raise ep.error(f"identity file {options.identity_file} not found",
                       "fix ssh.identity_file in the spec")
    if command:
        ep = dataclasses.replace(ep, proxy_command=_expand_proxy_command(ep, command, address))
    return ep


def _alive(opts: dict) -> tuple[float, float] | None:
    """ServerAliveInterval N with ServerAliveCountMax C (default 3), as ssh(1) reads them: a
    probe after N quiet seconds, the host given up after C unanswered ones, N * (C + 1) s of
    silence in all. None when not set, 0 or unreadable: tfcluster never runs without one."""
    try:
        interval = float(opts.get("serveraliveinterval", 0))
        count = int(opts.get("serveralivecountmax", 3))
    except ValueError:
        return None
    if interval <= 0 or count < 1:
        return None
    return interval, interval * (count + 1)


def _yes(opts: dict, key: str) -> bool:
    return str(opts.get(key, "no")).lower() == "yes"


def _proxy(opts: dict) -> tuple[str | None, str | None]:
    """(ProxyJump, ProxyCommand) from the config, at most one of them: the first one found,
    `none` meaning direct. `ProxyJump none` does not stop a later ProxyCommand (ssh -G)."""
    jump, command = opts.get("proxyjump"), opts.get("proxycommand")
    if jump and jump.lower() == "none":
        jump = None
    if jump and (opts.get(FIRST_PROXY) == "proxyjump" or "proxycommand" not in opts):
        return jump, None
    return None, command or None         # paramiko reads `ProxyCommand none` as None


def _expand_proxy_command(ep: Endpoint, command: str, address: str) -> str:
    """ssh_config's ProxyCommand tokens: %h %p %r of the endpoint, %n as given, %%."""
    values = {"h": ep.address, "p": str(ep.port), "r": ep.user, "n": address, "%": "%"}

    def token(m: re.Match) -> str:
        if m.group(1) not in values:
            raise ep.error(f"ProxyCommand `{command}`: unknown token %{m.group(1)}",
                           hint="ProxyCommand takes %h, %p, %r, %n and %%")
        return values[m.group(1)]
    return re.sub(r"%(.?)", token, command)


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
    if port and not port.isdigit():
        raise ConnectError(f"jump host {hop!r}: bad port {port!r}")
    hop_options = SshOptions(user=user or None, port=int(port) if port else None,
                             known_hosts=options.known_hosts,
                             host_key_policy=options.host_key_policy,
                             jump_host=",".join(hops[:-1]) or None,
                             connect_timeout=options.connect_timeout)
    # the target's explicit key is a fallback for the jump (usually one key for the whole
    # lab), and as for the target, no other key is offered
    extra = (os.path.expanduser(options.identity_file),) if options.identity_file else ()
    return resolve(host, host, hop_options, config, extra, role="jump host",
                   identities_only=bool(options.identity_file))
