"""The fence: one nftables table per cluster that closes its task ports to everyone but
the cluster's owner and its hosts (docs/security.md, "TensorFlow's ports").

A TF server runs any graph anyone who reaches its port sends it, as the user who started
it. The table, named after the cluster's identity (`tfcluster_<name>_<instance>`), holds
two chains:

- output: a new TCP connection (a bare SYN) to one of this host's task ports at a local
  address, or to any task's address and port of the cluster, from a socket that is not the
  cluster's own is refused with a reset. Loopback traffic passes the output hook, so this
  is what keeps the other users of a host out. The cluster's own sockets are those made in
  its cgroup v2 (`<cgroup2 mount>/tfcluster/<instance>`, which the shim joins before it
  spawns or probes anything for the cluster: `socket cgroupv2`), so the owner's other
  processes (an unfenced TF server that would relay a stranger in) are refused too. Where
  that cannot be had (no cgroup2 that nft can name, not writable, iptables), the owner's
  uid (`meta skuid`) is the match, and the answer says which (`match`);
- input: a connection to one of this host's task ports from an address that is neither
  local nor one of the cluster's hosts is refused the same way.

It is installed before anything binds (in the batch that opens `up`'s and `train`'s
conversations), replaced whole in one nft transaction, and deleted when nothing of the
cluster runs on the host any more (release_if_idle: the last attached shim, `stop`,
`down`, a failed `up`), its cgroup with it. A root shim also deletes, on a fence install,
`up` and `down`, another cluster's table that nothing of its cluster runs for any more
(sweep: a killed run's table would refuse the next cluster on those ports). A root shim runs `nft`; another user's shim runs `sudo -n nft`
when sudo lets it, else the ports stay open and the answer says why and who else has
processes on the host. The rules themselves, in nft's and iptables' words: shim_rules.py.
Shipped beside shim.py: standard library only, Python >= 3.8.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time

if __package__:
    from . import shim_cgroup as cgroup
    from . import shim_facts as facts
    from . import shim_fs as fs
    from . import shim_ports as ports
    from . import shim_procs as procs
    from . import shim_rules as rules
else:  # shipped: the shim's directory is first on sys.path
    import shim_cgroup as cgroup
    import shim_facts as facts
    import shim_fs as fs
    import shim_ports as ports
    import shim_procs as procs
    import shim_rules as rules

PREFIX = "tfcluster_"          # every table tfcluster makes starts so; none other is touched
MARK = "fence-%s.json"         # <cluster dir>/fence-<host>.json: this host's table and how it was made
NFT_TIMEOUT = 10.0
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
MAX_OTHERS = 8                 # other users named in a warning
SWEEP_GRACE = 300.0            # a table younger than this is never swept (its shim may not
                               # have joined or spawned yet: a launcher's in-process install)


def table_name(cluster_dir: str, tag_prefix: str) -> str:
    """`tfcluster_<name>_<instance>`: the cluster's name (characters nft would need quoted
    turned to `_`) and its instance, which makes it unique per cluster directory."""
    safe = re.sub(r"[^A-Za-z0-9_]", "_", _name(tag_prefix))[:64]
    return "%s%s_%s" % (PREFIX, safe, procs.instance_id(cluster_dir))


def _name(tag_prefix: str) -> str:
    """The cluster's name from a tag or prefix, qualified (`lab@<id>:...`) or not."""
    return str(tag_prefix).partition(":")[0].partition("@")[0]


def _which(program: str) -> str | None:
    for d in os.environ.get("PATH", "").split(os.pathsep) + list(SBIN):
        path = os.path.join(d or ".", program)
        if d and os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
    return None


def _run(argv: list, script: str | None = None) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, input=(script or "").encode(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=NFT_TIMEOUT, close_fds=True)
    except (OSError, subprocess.SubprocessError) as e:
        return 127, str(e)
    text = (done.stderr or done.stdout or b"").decode(errors="replace").strip()
    return done.returncode, " ".join(text.split())[:300]


def how() -> tuple[dict | None, str | None]:
    """(the tool to run, None) or (None, why the ports cannot be closed here). The tool is
    {"nft": argv} (nftables' own command), else {"iptables": argv, "ip6tables": argv}
    (iptables-nft, where nft is not installed); as root, or through `sudo -n`."""
    nft = _which("nft")
    ipt = [_which(n) for n in ("iptables-nft", "ip6tables-nft")]
    if None in ipt:
        ipt = [_which(n) for n in ("iptables", "ip6tables")]
    if nft is None and None in ipt:
        return None, "neither nftables (the nft command) nor iptables is installed"
    sudo = [] if os.geteuid() == 0 else [_which("sudo")]
    if None in sudo:
        return None, _not_root()
    if nft is not None and (not sudo or _run(sudo + ["-n", nft, "list", "tables"])[0] == 0):
        return {"nft": sudo + (["-n"] if sudo else []) + [nft]}, None
    if None not in ipt and (not sudo or _run(sudo + ["-n", ipt[0], "-S", "INPUT"])[0] == 0):
        pre = sudo + (["-n"] if sudo else [])
        return {"iptables": pre + [ipt[0], "-w"], "ip6tables": pre + [ipt[1], "-w"]}, None
    return None, _not_root()


def _not_root() -> str:
    return "tfcluster runs as %s there, not root, and `sudo -n nft` is not allowed" % ports.user_name(os.geteuid())


def other_users() -> list:
    """Who else has processes on this host (root excluded: root can always get in), from
    /proc: the names, sorted."""
    me, uids = os.geteuid(), set()
    for pid in procs.all_pids():
        try:
            with open("/proc/%d/status" % pid, "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        uids.add(int(line.split()[1]))
                        break
        except (OSError, ValueError, IndexError):
            continue
    return sorted(ports.user_name(u) for u in uids - {0, me})


def _install(tool: dict, table: str, req: dict, cgroup=None) -> tuple[int, str]:
    args = (table, os.geteuid(), req.get("ports", ()), req.get("targets", ()), req.get("peers", ()))
    if "nft" in tool:
        picked = rules.picked_range() if req.get("listeners") else None
        return _run(tool["nft"] + ["-f", "-"], rules.script(*args, cgroup=cgroup, listeners=picked))
    _delete(tool, table)
    out_chain, in_chain = rules.chains(table)
    for family, family_rules in rules.iptables_rules(*args).items():
        ipt = tool["iptables" if family == 4 else "ip6tables"]
        steps = [["-N", out_chain], ["-N", in_chain]] + family_rules
        steps += [["-I", "OUTPUT", "-j", out_chain], ["-I", "INPUT", "-j", in_chain]]
        for step in steps:
            rc, said = _run(ipt + step)
            if rc:
                _delete(tool, table)
                return rc, said
    return 0, ""


def _exists_with(tool: dict, table: str) -> bool:
    if "nft" in tool:
        return _run(tool["nft"] + ["list", "table", "inet", table])[0] == 0
    return _run(tool["iptables"] + ["-S", rules.chains(table)[0]])[0] == 0


def _delete(tool: dict, table: str) -> tuple[int, str]:
    """Remove the table (or the chains and their jumps); (0, "") when none is left."""
    if "nft" in tool:
        rc, said = _run(tool["nft"] + ["delete", "table", "inet", table])
        return (0, "") if rc == 0 or not _exists_with(tool, table) else (rc, said)
    out_chain, in_chain = rules.chains(table)
    for ipt in (tool["iptables"], tool["ip6tables"]):
        for hook, chain in (("OUTPUT", out_chain), ("INPUT", in_chain)):
            for _ in range(8):          # a jump inserted twice is deleted twice
                if _run(ipt + ["-D", hook, "-j", chain])[0]:
                    break
            _run(ipt + ["-F", chain])
            _run(ipt + ["-X", chain])
    return (1, "chain %s is still there" % out_chain) if _exists_with(tool, table) else (0, "")


# ---------------------------------------------------------------- other clusters' tables

def _tables(tool: dict) -> list | None:
    """The tfcluster tables on this host (inet family), or None where they cannot be listed."""
    rc, said = _run_out(tool["nft"] + ["list", "tables"])
    if rc:
        return None
    return [w[2] for w in (line.split() for line in said.splitlines())
            if len(w) == 3 and w[0] == "table" and w[1] == "inet" and w[2].startswith(PREFIX)]


def _run_out(argv: list) -> tuple[int, str]:
    """_run with the whole of stdout (a listing)."""
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=NFT_TIMEOUT, close_fds=True)
    except (OSError, subprocess.SubprocessError) as e:
        return 127, str(e)
    return done.returncode, (done.stdout or b"").decode(errors="replace")


def _instance(table: str) -> str | None:
    tail = table[-12:]
    return tail if len(table) > len(PREFIX) + 13 and table[-13] == "_" and re.fullmatch(r"[0-9a-f]{12}", tail) else None


def _made(tool: dict, table: str) -> tuple[float | None, int | None]:
    """When a table was made and for whose cluster (uid), from the comment install() gives it;
    None for each without one (a table of another tfcluster version, or not ours)."""
    rc, said = _run_out(tool["nft"] + ["list", "table", "inet", table])
    return (rules.made_at(said), rules.made_by(said)) if rc == 0 else (None, None)


def _runs(instance: str, uid: int | None = None) -> bool:
    """Whether anything of the cluster `instance` runs on this host: a process in its cgroup
    (only its owner and root can put one there), or one carrying its tag (root reads every
    process's tag) of the uid the table fences for (any, unknown): another user who copies the
    tag into a process of theirs does not keep a dead cluster's table, refusing everyone at its
    ports, alive."""
    mount = cgroup.mount_point()
    if mount and cgroup.populated(os.path.join(mount, cgroup.PARENT, instance)):
        return True
    mark = "@%s:" % instance
    for pid in procs.all_pids():
        tag = procs.tag_of(pid) if pid > 1 else None
        if tag is not None and mark in tag and procs.is_alive(pid) and (uid is None or _uid(pid) == uid):
            return True
    return False


def _uid(pid: int) -> int | None:
    try:
        return os.stat("/proc/%d" % pid).st_uid
    except OSError:
        return None


def sweep(keep: str | None = None, tool: dict | None = None) -> list:
    """A root shim's sweep: delete every tfcluster table (but `keep`) whose cluster has
    nothing running on this host and that is older than SWEEP_GRACE (so never one whose
    `up` is still between its install and its first task), with its empty cgroup. Such a
    table is a killed run's, and it refuses everyone else's connections to its ports. The
    tables deleted; never raises."""
    gone = []
    try:
        if os.geteuid() != 0:
            return gone
        tool = tool or how()[0]
        if not tool or "nft" not in tool:
            return gone
        tables = _tables(tool)
        if tables is None:
            return gone
        for table in tables:
            instance = _instance(table)
            if table == keep or instance is None:
                continue
            made, uid = _made(tool, table)
            if made is None or time.time() - made < SWEEP_GRACE or _runs(instance, uid):
                continue
            if _delete(tool, table)[0] == 0:
                gone.append(table)
                cgroup.drop("", instance)
        cgroup.sweep_empty({_instance(t) for t in tables if t not in gone}, SWEEP_GRACE)
    except (OSError, ValueError):
        pass
    return gone


def holders(port: int, exclude=()) -> list | None:
    """The tfcluster tables on this host whose rules refuse connections to `port` (some
    other cluster's, a killed run's), or None where the tables cannot be listed (not root)."""
    if os.geteuid() != 0:
        return None
    tool = how()[0]
    if not tool or "nft" not in tool:
        return None
    tables = _tables(tool)
    if tables is None:
        return None
    found = []
    for table in tables:
        if table in exclude:
            continue
        rc, said = _run_out(tool["nft"] + ["-j", "list", "table", "inet", table])
        try:
            items = json.loads(said).get("nftables", []) if rc == 0 else []
        except ValueError:
            items = []
        if any(port in rules.ports_of(item["rule"]) for item in items
               if isinstance(item, dict) and isinstance(item.get("rule"), dict)):
            found.append(table)
    return found


def refused_hint(port: int, exclude=()) -> str:
    """What a refused connection to `port` adds to its reason: the tables that hold it here."""
    try:
        found = holders(port, exclude)
    except (OSError, ValueError):
        found = None
    if found is None:
        return "another tfcluster cluster's rules may hold this port"
    if not found:
        return ""
    return ("%s on this host %s port %d (another tfcluster cluster's; `tfcluster down` its spec, "
            "or as root `nft delete table inet NAME`)" % (", ".join(found),
                                                         "holds" if len(found) == 1 else "hold", port))


def _mark_path(cluster_dir: str) -> str:
    """One mark per host: a cluster dir on a shared filesystem (an NFS home) is every host's,
    and one host's release must not delete another's mark, which would leave that host's
    table behind. A host is its machine id and its network namespace (nft tables live in
    one; the machine id alone would make the namespaces of one machine one host)."""
    return os.path.join(fs.expand(cluster_dir), MARK % _host_key())


def _host_key() -> str:
    return hashlib.sha256(("%s:%d" % (facts.machine_file(), facts.net_namespace())).encode()).hexdigest()[:12]


def _read_mark(cluster_dir: str) -> dict | None:
    try:
        mark = json.loads(fs.read_file(_mark_path(cluster_dir)) or b"null")
    except (OSError, ValueError):
        return None
    if not isinstance(mark, dict) or not str(mark.get("table", "")).startswith(PREFIX):
        return None
    tool = mark.get("tool")
    if not isinstance(tool, dict) or not tool or not all(
            isinstance(v, list) and all(isinstance(w, str) for w in v) for v in tool.values()):
        return None
    return mark


def _write_mark(cluster_dir: str, mark: dict) -> None:
    fs.private_dir(fs.expand(cluster_dir))
    fs.write_new(_mark_path(cluster_dir), json.dumps(mark).encode())


def cmd_fence(req: dict) -> dict:
    """`fence`: `mode` "install" (close this host's task ports; `up`, `train`), "probe"
    (could they be closed? `plan --check`), "status" (are they? `status`) or "release" (the
    table goes if nothing of the cluster runs here: a host a move left, whose tasks' stop kept
    it until the move's new tasks ran). Never an error
    envelope: the answer says {"closed", "table", "why", "others"} and the launcher decides
    (a warning, or an error for `tf_ports: closed`); an install also says what admits the
    cluster's own connections (`match`: "cgroup", or "uid" with `match_why`) and which stale
    tables of other clusters it deleted (`swept`)."""
    cluster_dir, mode = req["cluster_dir"], req.get("mode", "install")
    table = table_name(cluster_dir, req["tag_prefix"])
    answer = {"closed": False, "table": table, "why": None, "others": [], "user": ports.user_name(os.geteuid())}
    try:
        if mode == "release":
            release_if_idle(cluster_dir, req["tag_prefix"])
            answer["closed"] = _read_mark(cluster_dir) is not None
            return answer
        if mode == "status":
            mark = _read_mark(cluster_dir)
            tool = mark["tool"] if mark else how()[0]
            answer["closed"] = bool(tool) and _exists_with(tool, table)
            if not answer["closed"]:
                answer["why"] = how()[1]
            return answer
        tool, why = how()
        if tool is None or mode == "probe":
            answer.update(why=why, can=tool is not None)
        else:
            answer["swept"] = sweep(keep=table, tool=tool)
            matched, answer["match_why"] = cgroup.make(cluster_dir) if "nft" in tool else (
                None, "iptables matches the owner's uid")
            if matched is not None:
                cgroup.join(cluster_dir)         # a shim of its own: the cgroup is never empty while it runs
            rc, said = _install(tool, table, req, matched)
            if rc and matched is not None:    # this nft cannot match a cgroup: the uid, and why
                answer["match_why"] = "nft refused the cgroup match: %s" % said
                cgroup.drop(cluster_dir)
                matched = None
                rc, said = _install(tool, table, req)
            if rc == 0:
                _write_mark(cluster_dir, {"table": table, "tool": tool,
                                          "cgroup": matched[0] if matched else None})
                answer.update(closed=True, match="cgroup" if matched else "uid")
                if matched:
                    answer["match_why"] = None
            else:
                answer["why"] = "%s refused the rules: %s" % ("nft" if "nft" in tool else "iptables", said)
    except (OSError, ValueError, KeyError, TypeError) as e:
        answer["why"] = "%s: %s" % (type(e).__name__, e)
    if not answer["closed"]:
        answer["others"] = other_users()[:MAX_OTHERS + 1]
    return answer


def remove(cluster_dir: str, tag_prefix: str, always: bool = False) -> str | None:
    """Delete the cluster's table and its mark. Without `always` only when the mark says one
    was made here; `always` (`down`) also tries when it is gone (a killed run's table whose
    cluster dir was removed), where nft can be run. None, or why it could not."""
    table = table_name(cluster_dir, tag_prefix)
    mark = _read_mark(cluster_dir)
    tool = mark["tool"] if mark else None
    if tool is None:
        if not always or os.geteuid() != 0:    # sudo's own check costs a process: only with a mark
            return None
        tool = how()[0]
        if tool is None or not _exists_with(tool, table):
            return None
    rc, said = _delete(tool, table)
    if rc:
        return "could not delete the rules of %s: %s" % (table, said)
    fs.remove_quietly(_mark_path(cluster_dir))
    cgroup.drop(cluster_dir)
    return None


def release_if_idle(cluster_dir: str, tag_prefix: str) -> None:
    """Remove the table once nothing of the cluster runs on this host: called as each of its
    processes ends (the last one removes it). Costs nothing where no table was made."""
    try:
        marked = _read_mark(cluster_dir) is not None
        if not marked and not cgroup.joined():
            return
        qualified = procs.qualify(_name(tag_prefix) + ":", cluster_dir)
        if not procs.tagged(lambda t: t.startswith(qualified)):
            if marked:
                remove(cluster_dir, tag_prefix)
            else:           # its table already went: the cgroup this shim joined goes too
                cgroup.drop(cluster_dir)
    except (OSError, ValueError):      # never the reason a stop or a task's end fails
        pass
