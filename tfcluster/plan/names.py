"""Every name tfcluster gives to things: process tags, run ids, paths, log files.

Pure functions and frozen records, no I/O. The package builds each name here once
and sends it to the host inside requests; the shim never derives a name itself.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

TENSORBOARD = "tensorboard"    # the role of the TensorBoard a run starts on its chief's host
ROLES = ("server", "script", TENSORBOARD)


@dataclass(frozen=True)
class Tag:
    """What the shim writes into a task's environment to recognise it later.

    Text form `cluster:run:job:index:role`; a prefix of it selects a whole cluster
    (`cluster:`) or one run (`cluster:run:`). Cluster names and run ids never hold a
    colon or an `@` (the spec loader refuses them), so the form parses back unambiguously.
    The host adds the cluster's identity (`cluster@instance:...`, docs/ARCHITECTURE.md
    "Naming") to every tag and prefix it receives; the package never builds one with it."""

    cluster: str
    run: str
    job: str
    index: int
    role: str
    instance: str = ""          # set only on tags read back from a host

    def __str__(self) -> str:
        cluster = f"{self.cluster}@{self.instance}" if self.instance else self.cluster
        return f"{cluster}:{self.run}:{self.job}:{self.index}:{self.role}"

    @property
    def key(self) -> str:
        return task_key(self.job, self.index)

    @classmethod
    def parse(cls, text: str) -> "Tag | None":
        parts = text.split(":")
        if len(parts) != 5 or not parts[3].isdigit() or parts[4] not in ROLES:
            return None
        cluster, _, instance = parts[0].partition("@")
        return cls(cluster, parts[1], parts[2], int(parts[3]), parts[4], instance)


def task_key(job: str, index: int) -> str:
    return f"{job}:{index}"


def cluster_prefix(cluster: str) -> str:
    return f"{cluster}:"


def run_prefix(cluster: str, run_id: str) -> str:
    return f"{cluster}:{run_id}:"


def same_task(a: str, b: str) -> bool:
    """Whether two tags name the same start of a task (cluster, run, job, index, role): a tag
    read back from a host carries the cluster's instance, one the package built does not."""
    x, y = Tag.parse(a), Tag.parse(b)
    return x is not None and y is not None and (x.cluster, x.run, x.key, x.role) == (y.cluster, y.run, y.key, y.role)


def server_workdir(holder: str, cluster: str) -> str | None:
    """The workdir of a port's holder that is a server of a cluster named `cluster`, from its
    command line (`pid N (python3 /W/<cluster>/bin/tfserver.py)`): this cluster started with
    another workdir, whose tag (its instance) this spec cannot name. None for anything else,
    and for another user's process (the holder names its user, `, user U`)."""
    if ", user " in holder:
        return None
    found = re.search(r"(?:^|[\s(])((?:/[^\s/]+)*)/" + re.escape(cluster) + r"/bin/tfserver\.py(?=[\s)]|$)",
                      holder)
    return (found.group(1) or "/") if found else None


def other_users(holder: str | None) -> bool:
    """A port's holder (shim_ports.describe_holder) that runs as another user: the text names
    the user only then (`pid N (...), user U`, or `a process of user U` when unseen)."""
    return bool(holder) and (", user " in holder or holder.startswith("a process of user "))


def other_workdir(holder: str, cluster: str) -> str | None:
    """The hint's words for a port held by a server of this cluster started with another
    workdir (server_workdir), or None: `a server of cluster 'c' started with workdir W,
    not this spec's: run `tfcluster down` with the spec that has that workdir`."""
    workdir = server_workdir(holder or "", cluster)
    if workdir is None:
        return None
    return (f"a server of cluster {cluster!r} started with workdir {workdir}, not this spec's: "
            f"run `tfcluster down` with the spec that has that workdir")


def other_cluster(holder: str, cluster: str) -> str | None:
    """The hint's words for a port held by a task of another tfcluster cluster of ours (the
    holder's text names it from the process's tag, shim_ports.describe; a renamed spec's old
    cluster is one, and so is one of this name another HOME or workdir started), or None. Only
    asked of a holder that is not this cluster's own."""
    found = re.search(r", task (\S+) of tfcluster cluster '([^']*)'$", holder or "")
    if found is None:
        return None
    task, name = found.groups()
    if name == cluster:     # not this one's: its tag's instance (workdir, HOME) is another
        return (f"{task} of another cluster named {name!r}, started with another workdir or HOME: "
                f"`tfcluster down` with the spec and HOME that started it stops it")
    return f"{task} of tfcluster cluster {name!r}: `tfcluster down` with that cluster's spec stops it"


def new_run_id(prefix: str, now: float | None = None, token: str | None = None) -> str:
    """`<prefix>-YYYYmmdd-HHMMSS-<4 hex>`: sorts by start time; the token keeps two runs
    started in the same second apart."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{prefix}-{stamp}-{token or os.urandom(2).hex()}"


def is_run_of(prefix: str, run_id: str) -> bool:
    """Whether `run_id` has new_run_id's form for `prefix`: `lab-x-20260101-000000-ab12`
    is a run of `lab-x`, never of `lab`."""
    return re.fullmatch(re.escape(prefix) + r"-[0-9]{8}-[0-9]{6}-[0-9a-f]{4}", run_id) is not None


def log_name(key: str, role: str = "script") -> str:
    """On a host: `worker:1` -> `worker-1.log`; a server's `worker-1.server.log`; the
    run's TensorBoard `tensorboard.log`."""
    if role == TENSORBOARD:
        return log_file(TENSORBOARD)
    return log_file(f"{key}.server" if role == "server" else key)


def log_file(mux_key: str) -> str:
    """The file a LogMux key is saved in: `worker:1` -> `worker-1.log`,
    `worker:1.server` -> `worker-1.server.log`."""
    return mux_key.replace(":", "-") + ".log"


def key_of_log(filename: str, servers: bool = False) -> str | None:
    """The task key a script's log file belongs to; None for anything else. `servers`: a
    task's server log beside its script's too, as its LogMux key (`worker:1.server`)."""
    if not filename.endswith(".log"):
        return None
    stem, server = filename[:-4], filename.endswith(".server.log")
    if server and not servers:
        return None
    job, sep, index = stem.removesuffix(".server").rpartition("-")
    if not (sep and job and index.isdigit()):
        return None
    return task_key(job, int(index)) + (".server" if server else "")


def mux_key(key: str, role: str, task_runs_both: bool) -> str:
    """The LogMux key of a process: a server shares its task's key unless the task also
    runs a script, whose output owns the plain key."""
    return f"{key}.server" if role == "server" and task_runs_both else key


@dataclass(frozen=True)
class ClusterPaths:
    """Where a cluster lives on a host: `<workdir>/<name>/` (may start with `~/`)."""

    root: str

    @property
    def bindir(self) -> str:
        return f"{self.root}/bin"

    @property
    def piddir(self) -> str:
        return f"{self.root}/pids"

    @property
    def cache(self) -> str:
        return f"{self.root}/cache"

    @property
    def runs(self) -> str:
        return f"{self.root}/runs"

    def rundir(self, run_id: str) -> str:
        return f"{self.runs}/{run_id}"

    def log(self, run_id: str, key: str, role: str = "script") -> str:
        return f"{self.rundir(run_id)}/{log_name(key, role)}"

    def pidfile(self, tag: Tag | str) -> str:
        return f"{self.piddir}/{str(tag).replace(':', '_')}.pid"
