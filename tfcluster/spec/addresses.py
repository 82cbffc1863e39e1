"""Host addresses: what a spec may give as an address or jump host, and which are one machine.

An address ends up on ssh's command line and in shells, so anything that could be read as
an option or shell syntax is refused, whatever a resolver might make of it.
"""
from __future__ import annotations

import ipaddress
import re

import yaml

from tfcluster.spec.yamltree import BadValue, as_str, line_of

USER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_LABEL_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_SHELL_CHARS = set(";|&$`'\"<>(){}[]*?!\\#~^%,=")


def parse_address(node: yaml.Node, field: str) -> str:
    value = as_str(node, field)
    problem = _address_problem(value)
    if problem:
        raise BadValue(line_of(node), field, f"{problem}: {value!r}")
    return value


def _address_problem(value: str) -> str | None:
    """Why `value` is not a hostname, IPv4 or IPv6 address (it reaches ssh and shells)."""
    if not value:
        return "must not be empty"
    if any(c.isspace() or not c.isprintable() for c in value):
        return "must not contain whitespace or control characters"
    if value.startswith("-"):
        return "must not start with '-' (ssh would take it for an option)"
    bad = sorted(set(value) & _SHELL_CHARS)
    if bad:
        return f"must not contain shell metacharacter {bad[0]!r}"
    if _is_ip(value) and ipaddress.ip_address(value).is_unspecified:
        return ("is no host's address (it stands for every interface of a listening socket; "
                "dialled, it is this machine): give the host's name or IP")
    if _is_ip(value) or _is_hostname(value):
        return None
    return "not a valid hostname, IPv4 or IPv6 address"


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def _is_hostname(value: str) -> bool:
    labels = value[:-1].split(".") if value.endswith(".") else value.split(".")   # `lab.example.` is rooted
    if len(value) > 253 or not all(_LABEL_RE.fullmatch(label) for label in labels):
        return False
    return not all(label.isdigit() for label in labels)   # 10.1.0.300 is a broken IPv4


def host_port(address: str, port: int | str) -> str:
    """`address:port` as gRPC, TF's ClusterSpec and JAX read it: an IPv6 address in brackets
    (`[::1]:2222`), since `::1:2222` is itself an IPv6 address, with no port."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def machine_of(address: str) -> str:
    """One key per machine. Every loopback address is this machine: a TF server binds every
    interface, so 127.0.0.2:P and 127.0.0.3:P are the same port."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        name = address.lower().rstrip(".")
        return "loopback" if name == "localhost" else name
    mapped = getattr(ip, "ipv4_mapped", None)           # ::ffff:127.0.0.1 is 127.0.0.1
    return "loopback" if ip.is_loopback or (mapped is not None and mapped.is_loopback) else ip.compressed


def parse_jump_host(node: yaml.Node, field: str) -> str:
    value = as_str(node, field)
    user, _, rest = value.rpartition("@")
    host, port = rest, None
    if rest.count(":") == 1:       # host:port; a bare IPv6 address has several colons
        host, _, port = rest.partition(":")
    ok = (not user or USER_RE.fullmatch(user)) and (
        port is None or re.fullmatch(r"[0-9]{1,5}", port))
    problem = _address_problem(host) if ok else "must be [user@]host[:port]"
    if not problem and port and not 1 <= int(port) <= 65535:
        problem = "port must be from 1 to 65535"
    if problem and ":" in user:     # user:password@host: never echo what may be a password
        name = user.partition(":")[0]
        raise BadValue(line_of(node), field, f"must be [user@]host[:port], with no password (SSH logs in with "
                                             f"a key here): {name + ':***@' + rest!r}")
    if problem:
        raise BadValue(line_of(node), field, f"{problem}: {value!r}")
    return value
