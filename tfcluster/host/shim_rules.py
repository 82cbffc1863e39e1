"""The fence's rules in each tool's words: the nft program that makes a cluster's table, the
same rules as iptables arguments where nft is not installed, and the ports read back from a
table nft lists (shim_fence.py says when a table is made and removed, and why it holds what it
holds: docs/security.md, "TensorFlow's ports").

Shipped beside shim.py: standard library only, Python >= 3.8.
"""
from __future__ import annotations

import re
import socket
import time

# the packet mark bit a cluster's own new connection carries from the output chain to the input
# chain on one machine (`listeners`; docs/security.md, "TensorFlow's ports")
MARK = 0x20000000
# the comment every table carries: when it was made, and by whom (shim_fence.sweep reads it)
MADE = 'comment "tfcluster made %d uid %d"'
_MADE_READ = re.compile(re.escape(MADE).replace("%d", r"(\d+)"))   # made_at, made_by


def addresses(names) -> tuple[set, set]:
    """Every IPv4 and IPv6 address the names resolve to here (a name that does not resolve
    is left out: the reachability check names it)."""
    v4, v6 = set(), set()
    for name in names:
        try:
            infos = socket.getaddrinfo(str(name), None, 0, socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            continue
        for family, _t, _p, _c, sockaddr in infos:
            address = sockaddr[0].split("%")[0]
            if family == socket.AF_INET:
                v4.add(address)
            elif family == socket.AF_INET6:
                v6.add(address)
    return v4, v6


def task_ports(values) -> list:
    return sorted({int(p) for p in values if 0 < int(p) < 65536})


def resolve(ports, targets, peers) -> tuple[list, dict, dict]:
    """(this machine's task ports, family -> {(address, port)} of every task, family -> the
    cluster's host addresses), names resolved here."""
    mine = set(task_ports(ports))
    by_family = {4: set(), 6: set()}
    resolved = {}
    for address, port in targets:
        if address not in resolved:
            resolved[address] = addresses([address])
        v4, v6 = resolved[address]
        by_family[4].update((a, int(port)) for a in v4)
        by_family[6].update((a, int(port)) for a in v6)
        if any(_is_local(a) for a in v4 | v6):
            mine.add(int(port))     # another host of the spec that is this machine (127.0.0.x): one table
    peer4, peer6 = addresses(peers)
    return sorted(mine), by_family, {4: peer4, 6: peer6}


def script(table: str, uid: int, ports, targets, peers, cgroup=None, made=None, listeners=None) -> str:
    """The nft program that replaces the table whole (one transaction): `ports` this host's
    task ports, `targets` [address, port] of every task, `peers` the cluster's host addresses;
    `cgroup` (path under /sys/fs/cgroup, level) the cluster's cgroup, else the uid is matched.
    `listeners` (with a cgroup): the kernel's range of ports it picks, (low, high); a port in it
    that one of the cluster's processes listens on is closed to the other users of this machine
    too (mode keras-jax: JAX's collectives listen on such ports; a port someone chose,
    TensorBoard's, is left as it was).
    The table's comment says when it was made (`made`, epoch seconds) and by whom: sweep()."""
    mine, by_family, peers_by = resolve(ports, targets, peers)
    peer4, peer6 = peers_by[4], peers_by[6]
    # Every rule starts with the SYN test: the packets of a connection already made pass on
    # one flags compare per rule, and only a new connection meets the uid and route lookups.
    syn = "tcp flags & (syn | ack) == syn"
    out = []
    if cgroup is None:
        stranger = "%s meta skuid != %d" % (syn, uid)
    else:
        # the cluster's own sockets leave this table first; every other new connection meets
        # the rules below. (Not a `!=` on the cgroup: a socket whose cgroup is shallower than
        # the level has no ancestor there, and the match then fails both ways.)
        stranger = syn
        ours = '%s socket cgroupv2 level %d "%s"' % (syn, cgroup[1], cgroup[0])
        if listeners:
            # a connection that stays on this machine carries the mark from here to the input
            # chain below, which takes it off again: the one way a listener learns that the
            # process dialling it is the cluster's (the input hook sees no sender's socket)
            out.append("%s fib daddr type local meta mark set meta mark | 0x%08x accept" % (ours, MARK))
        out.append("%s accept" % ours)
    if mine:
        out.append("%s tcp dport { %s } fib daddr type local reject with tcp reset" % (stranger, _join(mine)))
    for family, ip in ((4, "ip"), (6, "ip6")):
        if by_family[family]:
            pairs = _join("%s . %d" % pair for pair in sorted(by_family[family]))
            out.append("%s %s daddr . tcp dport { %s } reject with tcp reset" % (stranger, ip, pairs))
    inp = []
    if listeners and cgroup is not None:
        # `socket` finds the listener a new connection is for: one of the cluster's admits the
        # cluster's own connections from this machine (marked above) and refuses the other
        # users' here. From other machines nothing changes: a GPU host's collectives (NCCL) may
        # dial from an interface no spec names
        theirs = '%s tcp dport %d-%d socket cgroupv2 level %d "%s" fib saddr type local' % (
            syn, listeners[0], listeners[1], cgroup[1], cgroup[0])
        inp.append("%s meta mark & 0x%08x == 0x%08x meta mark set meta mark & 0x%08x accept"
                   % (theirs, MARK, MARK, 0xFFFFFFFF ^ MARK))
        inp.append("%s reject with tcp reset" % theirs)
    if mine:
        ports = "%s tcp dport { %s }" % (syn, _join(mine))
        inp.append("%s fib saddr type local accept" % ports)
        for ip, peers_of in (("ip", peer4), ("ip6", peer6)):
            if peers_of:
                inp.append("%s %s saddr { %s } accept" % (ports, ip, _join(sorted(peers_of))))
        inp.append("%s reject with tcp reset" % ports)
    lines = ["table inet %s" % table, "delete table inet %s" % table, "table inet %s {" % table,
             "  " + MADE % (int(time.time() if made is None else made), uid),
             "  chain output {", "    type filter hook output priority filter; policy accept;"]
    lines += ["    " + rule for rule in out] + ["  }"]
    lines += ["  chain input {", "    type filter hook input priority filter; policy accept;"]
    lines += ["    " + rule for rule in inp] + ["  }", "}"]
    return "\n".join(lines) + "\n"


def picked_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple:
    """The ports the kernel picks for a socket bound to port 0 (both families), Linux's
    default where it cannot be read."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split())
        if 0 < low <= high < 65536:
            return low, high
    except (OSError, ValueError):
        pass
    return 32768, 60999


def chains(table: str) -> tuple[str, str]:
    """iptables' chains for a table (a chain name holds at most 28 characters): `TFC<instance>o`
    and `...i`, the instance being the table name's last 12 hex digits."""
    return "TFC%so" % table[-12:], "TFC%si" % table[-12:]


def iptables_rules(table: str, uid: int, ports, targets, peers) -> dict:
    """family (4, 6) -> the argument lists that fill the two chains, for iptables where nft
    is not installed: the same rules as script(), in iptables' words."""
    mine, by_family, peers_by = resolve(ports, targets, peers)
    out_chain, in_chain = chains(table)
    syn = ["-p", "tcp", "--syn"]
    stranger = syn + ["-m", "owner", "!", "--uid-owner", str(uid)]
    reject = ["-j", "REJECT", "--reject-with", "tcp-reset"]
    chunks = [mine[i:i + 15] for i in range(0, len(mine), 15)]     # multiport takes 15 ports
    rules = {}
    for family in (4, 6):
        dports = [["-m", "multiport", "--dports", ",".join(map(str, c))] for c in chunks]
        out = [["-A", out_chain] + stranger + d + ["-m", "addrtype", "--dst-type", "LOCAL"] + reject
               for d in dports]
        out += [["-A", out_chain] + stranger + ["-d", a, "--dport", str(p)] + reject
                for a, p in sorted(by_family[family])]
        inp = [["-A", in_chain] + syn + d + ["-m", "addrtype", "--src-type", "LOCAL", "-j", "RETURN"]
               for d in dports]
        inp += [["-A", in_chain] + syn + d + ["-s", a, "-j", "RETURN"]
                for d in dports for a in sorted(peers_by[family])]
        inp += [["-A", in_chain] + syn + d + reject for d in dports]
        rules[family] = out + inp
    return rules


def made_at(listing: str) -> float | None:
    """When a table was made, from `nft list table`'s text (its comment); None without one (a
    table of another tfcluster version, or not ours)."""
    found = _MADE_READ.search(listing)
    return float(found.group(1)) if found else None


def made_by(listing: str) -> int | None:
    """The uid whose cluster a table fences, from its comment; None without one."""
    found = _MADE_READ.search(listing)
    return int(found.group(2)) if found else None


def ports_of(rule: dict) -> set:
    """The TCP ports a rule of ours names (`tcp dport`, alone or after an address). None for
    the rules that match a listener's cgroup (`socket`, the kernel-picked ports of mode
    keras-jax): they refuse only where that cluster's own processes listen, so a refusal at
    any other port of their range is none of theirs."""
    exprs = rule.get("expr") or ()
    if any(isinstance(e, dict) and isinstance(e.get("match"), dict) and isinstance(e["match"].get("left"), dict)
           and "socket" in e["match"]["left"] for e in exprs):
        return set()
    ports = set()
    for expr in exprs:
        match = expr.get("match") if isinstance(expr, dict) else None
        if not isinstance(match, dict):
            continue
        left, right = match.get("left"), match.get("right")
        right = right.get("set") if isinstance(right, dict) and "set" in right else [right]
        concat = isinstance(left, dict) and "concat" in left
        if not concat and left != {"payload": {"protocol": "tcp", "field": "dport"}}:
            continue
        for value in right:
            if concat and isinstance(value, dict) and "concat" in value:
                value = value["concat"][-1]
            if isinstance(value, dict) and "range" in value:
                lo, hi = value["range"]
                if isinstance(lo, int) and isinstance(hi, int):
                    ports.update(range(lo, hi + 1))
            elif isinstance(value, int):
                ports.add(value)
    return ports


_LOCAL: dict = {}


def _is_local(address: str) -> bool:
    """Whether an address is this machine's (it can be bound here)."""
    if address not in _LOCAL:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((address, 0))
            _LOCAL[address] = True
        except OSError:
            _LOCAL[address] = False
    return _LOCAL[address]


def _join(items) -> str:
    return ", ".join(str(i) for i in items)
