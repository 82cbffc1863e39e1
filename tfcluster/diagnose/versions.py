"""Version skew across hosts: which hosts run another Python or TensorFlow minor version
than the rest. Pure (host infos in, a verdict out); preflight.py reports it.

The tasks of one cluster exchange graphs and ops, which TF minor versions may not agree
on, and the Python minor decides which TF build a host gets; a patch release apart is
not reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

# (the name people know, the HostInfo field), in the order they are reported
FIELDS = (("TensorFlow", "tf_version"), ("Python", "python_version"))
# Mode keras-jax: the processes run one XLA program and speak JAX's own wire protocol, which only
# one jax and jaxlib release are sure to share: these must be equal, patch included (and so
# must Keras, whose distribution code lays out every array).
JAX_FIELDS = (("jax", "jax_version"), ("jaxlib", "jaxlib_version"), ("Keras", "keras_version"),
              ("Python", "python_version"))
NAMED = 4   # hosts named in a message before "and N more"


@dataclass(frozen=True)
class Skew:
    """One field that differs: the odd hosts' versions and the reference group's."""

    what: str                  # "TensorFlow" | "Python"
    odd: dict[str, str]        # host -> full version, for the hosts that differ
    usual: dict[str, str]      # host -> full version, for the reference group

    def describe(self) -> str:
        return f"{self.what} differs across hosts: {_who(self.odd)}, {_who(self.usual)}"


def minor(version: str) -> str:
    """`2.21.0` and `2.21.1rc0` -> `2.21`: what must match across hosts."""
    return ".".join(version.split(".")[:2])


def find_skew(what: str, versions: Mapping[str, str | None], exact: bool = False) -> Skew | None:
    """The hosts whose minor version (`exact`: whole version) differs from the majority's;
    on a tie the group of the alphabetically first host is the reference. Hosts without a
    version (TF not installed) are left to the TF-missing check."""
    groups: dict[str, dict[str, str]] = {}
    for host in sorted(versions):
        if versions[host]:
            groups.setdefault(versions[host] if exact else minor(versions[host]), {})[host] = versions[host]
    if len(groups) < 2:
        return None
    reference = max(groups, key=lambda m: len(groups[m]))  # the first of equals: alphabetical
    odd = {h: v for m, group in groups.items() if m != reference for h, v in group.items()}
    return Skew(what, odd, groups[reference])


def find_skews(infos: Mapping[str, object], mode: str = "") -> list[Skew]:
    """Every field of FIELDS that differs across `infos` (host -> HostInfo); in mode keras-jax,
    every field of JAX_FIELDS, jax, jaxlib and Keras to the patch."""
    fields = JAX_FIELDS if mode == "keras-jax" else FIELDS
    found = (find_skew(what, {h: getattr(i, attr) for h, i in infos.items()},
                       exact=mode == "keras-jax" and what != "Python") for what, attr in fields)
    return [s for s in found if s is not None]


def odd_fields(skews: list[Skew]) -> dict[str, list[str]]:
    """host -> the fields it is odd in (lower case, as the table's columns are named)."""
    odd: dict[str, list[str]] = {}
    for skew in skews:
        for host in skew.odd:
            odd.setdefault(host, []).append(skew.what.lower())
    return odd


def message(skews: list[Skew]) -> str:
    return "; ".join(s.describe() for s in skews)


def _who(versions: dict[str, str]) -> str:
    """`b has 2.12.0` / `a and c have 2.21.0, d has 2.21.1`."""
    by_version: dict[str, list[str]] = {}
    for host, version in versions.items():
        by_version.setdefault(version, []).append(host)
    return ", ".join(f"{names(hosts)} {'has' if len(hosts) == 1 else 'have'} {version}"
                     for version, hosts in by_version.items())


def names(hosts: list[str]) -> str:
    """`a`, `a and b`, `a, b, c, d and 2 more`."""
    if len(hosts) > NAMED:
        return f"{', '.join(hosts[:NAMED])} and {len(hosts) - NAMED} more"
    return hosts[0] if len(hosts) == 1 else f"{', '.join(hosts[:-1])} and {hosts[-1]}"
