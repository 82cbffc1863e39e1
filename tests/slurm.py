"""A real one-node Slurm cluster (Debian's slurm-wlm + MUNGE) for the Slurm tests,
loaded as a pytest plugin by conftest.

`slurm_cluster` (session scope) starts munged, slurmctld and slurmd as root, each from its
own private directory under the temp dir (config, key, socket, state, spool, logs, pid
files) and on ports free at the time, so it never meets the machine's own Slurm or
another session's. The node is this machine (`hostname -s`, address 127.0.0.1), declared
with CPUs=8 (SlurmdParameters=config_overrides keeps it in service on a 2-core machine),
so a job may ask for `--nodes=1 --ntasks-per-node=4`. Finished jobs stay visible to
`scontrol show job` for MinJobAge=600 s. No accounting, no cgroups (proctrack/linuxproc,
task/none).

Every process of the cluster is found with psutil: the daemons (and slurmstepd, which
inherits their environment) carry MARK_VAR=<its directory>, and every job process carries
SLURM_CLUSTER_NAME=<this cluster's unique name>. Teardown cancels the jobs, stops the
daemons (TERM, then KILL) and fails if any of those processes survive; the start kills
what a crashed earlier run left (its owner process is gone).
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

MARK_VAR = "TFCLUSTER_SLURM_DIR"
PREFIX = "tfcluster-slurm-"
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
NEEDED = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo",
          "squeue", "scancel")
# States in which a job is over; anything else (PENDING, RUNNING, COMPLETING, ...) is not.
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"}
START_TIMEOUT = 30.0


@dataclass
class SlurmCluster:
    root: Path                  # the private directory (0711, root's)
    conf: Path                  # slurm.conf
    name: str                   # ClusterName, unique per fixture ("tfc<hex>")
    node: str                   # NodeName = `hostname -s`
    partition: str
    env: dict[str, str]         # for sbatch/srun/scontrol: os.environ + SLURM_CONF + MARK_VAR
    daemons: dict[str, subprocess.Popen] = field(repr=False, default_factory=dict)
    start_seconds: float = 0.0  # how long the start took (munged up to the node idle)

    def run(self, *argv: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command (scontrol, sinfo, ...) against this cluster."""
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def submit(self, script: str | os.PathLike, cwd: str | os.PathLike | None = None,
               args: Sequence[str] = ()) -> str:
        """`sbatch --parsable [args] script` from `cwd` (the job's working directory, where
        slurm-<id>.out lands unless the script says --output); the job id ("7")."""
        out = subprocess.run(["sbatch", "--parsable", *args, str(script)], env=self.env,
                             cwd=cwd, capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise AssertionError(f"sbatch failed ({out.returncode}): {out.stderr.strip()}")
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o <id>` as a dict (JobState, ExitCode, StdOut, NodeList, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout.strip()
        return parse_record(out)

    def wait(self, job_id: str, timeout: float = 60) -> dict[str, str]:
        """Wait until the job is over; {"state": "COMPLETED", "exit_code": "0:0", "job": {...}}.
        exit_code is Slurm's "<exit status>:<signal>" of the batch script."""
        deadline = time.monotonic() + timeout
        while True:
            record = self.job(job_id)
            state = record.get("JobState", "")
            if state in FINAL:
                return {"state": state, "exit_code": record.get("ExitCode", ""), "job": record}
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {state} after {timeout}s: {record}\n"
                                     f"{self.log_tail()}")
            time.sleep(0.1)

    def output_of(self, job_id: str) -> str:
        """The job's stdout file (the path scontrol reports as StdOut, patterns resolved)."""
        return Path(self.job(job_id)["StdOut"]).read_text()

    def jobs_not_over(self) -> list[str]:
        out = self.run("squeue", "-h", "-o", "%i %T", check=False).stdout
        return [line.split()[0] for line in out.splitlines() if line.strip()]

    def cancel_all(self, timeout: float = 20) -> None:
        """scancel every job and wait until squeue lists none (COMPLETING included)."""
        ids = self.jobs_not_over()
        if ids:
            self.run("scancel", *ids, check=False)
        deadline = time.monotonic() + timeout
        while self.jobs_not_over():
            if time.monotonic() > deadline:
                raise AssertionError(f"jobs not over {timeout}s after scancel: {self.jobs_not_over()}")
            time.sleep(0.1)

    def processes(self) -> list[psutil.Process]:
        """Every live process of this cluster: daemons, slurmstepd, job processes."""
        return cluster_processes(str(self.root), self.name)

    def job_processes(self) -> list[psutil.Process]:
        """Live processes of this cluster other than the daemons: slurmstepd and the tasks.
        (slurmctld's own child, slurmscriptd, lives as long as slurmctld: a daemon too.)"""
        daemons = {p.pid for p in self.daemons.values()}
        ctld = self.daemons.get("slurmctld")
        found = []
        for p in self.processes():
            try:
                if p.pid in daemons or (ctld is not None and p.ppid() == ctld.pid):
                    continue
            except psutil.Error:
                continue
            found.append(p)
        return found

    def wait_no_job_processes(self, timeout: float = 15) -> None:
        """Wait until no slurmstepd or job process is left; fail naming them otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.job_processes()
            if not left:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"job processes left: {describe(left)}")
            time.sleep(0.1)

    def log_tail(self, chars: int = 3000) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)


def parse_record(line: str) -> dict[str, str]:
    """`Key=value Key2=value two ...` (scontrol -o); a value may hold spaces."""
    fields = re.split(r" (?=[A-Za-z][\w:/]*=)", line.strip())
    return dict(f.split("=", 1) for f in fields if "=" in f)


def describe(procs) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline()) or p.name()}")
        except psutil.Error:
            out.append(str(p.pid))
    return "; ".join(out)


def _environ(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def cluster_processes(root: str | None, name: str | None) -> list[psutil.Process]:
    """Live processes whose environment names this cluster's directory or cluster name."""
    wanted = set()
    if root:
        wanted.add(f"{MARK_VAR}={root}".encode())
    if name:
        wanted.add(f"SLURM_CLUSTER_NAME={name}".encode())
    found = []
    for proc in psutil.process_iter(["status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
            continue
        if wanted.intersection(_environ(proc.pid)):
            found.append(proc)
    return found


def _kill_all(procs: list[psutil.Process], timeout: float = 10) -> list[psutil.Process]:
    """TERM, then KILL what is left at the deadline; the survivors (none, normally)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        _gone, procs = psutil.wait_procs(procs, timeout=timeout)
        procs = [p for p in procs if _alive(p)]
        if not procs:
            return []
    return procs


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _owner_alive(root: Path) -> bool:
    try:
        pid, started = (root / "owner").read_text().split()
        return abs(psutil.Process(int(pid)).create_time() - float(started)) < 1
    except (OSError, ValueError, psutil.Error):
        return False


def clean_stale(tmp: Path) -> None:
    """Kill the processes and remove the directory of every earlier cluster whose owner
    (the pytest that started it) is gone; a live session's cluster is left alone."""
    roots = set()
    for proc in psutil.process_iter(["status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        for item in _environ(proc.pid):
            if item.startswith(f"{MARK_VAR}=".encode()):
                roots.add(item.split(b"=", 1)[1].decode(errors="replace"))
            elif re.fullmatch(rb"SLURM_CLUSTER_NAME=tfc[0-9a-f]{8}", item):
                roots.add(str(tmp / (PREFIX + item[-8:].decode())))
    roots.update(str(p) for p in tmp.glob(PREFIX + "*"))
    for root in roots:
        path = Path(root)
        if not path.name.startswith(PREFIX) or _owner_alive(path):
            continue
        name = "tfc" + path.name[len(PREFIX):]
        _kill_all(cluster_processes(root, name), timeout=2)
        shutil.rmtree(path, ignore_errors=True)


def _free_port() -> int:
    """A port free on 127.0.0.1 and on the wildcard address (slurmctld and slurmd bind 0.0.0.0)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


def _require() -> None:
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    missing = [b for b in NEEDED if not shutil.which(b, path=path)]
    if missing:
        pytest.skip(f"Slurm/MUNGE not installed (missing {', '.join(missing)}; "
                    "scripts/test.sh installs slurm-wlm and munge)")
    if os.geteuid() != 0:
        pytest.skip("the one-node Slurm cluster runs its daemons as root (CI runs as root)")


def _conf(root: Path, name: str, node: str, partition: str, ctld_port: int, d_port: int) -> str:
    settings = {
        "ClusterName": name,
        "SlurmctldHost": f"{node}(127.0.0.1)",
        "SlurmctldPort": ctld_port, "SlurmdPort": d_port,
        "AuthType": "auth/munge", "CredType": "cred/munge",
        "AuthInfo": f"socket={root}/munge.sock",
        "SlurmUser": "root", "SlurmdUser": "root",
        "StateSaveLocation": root / "state", "SlurmdSpoolDir": root / "spool",
        "SlurmctldPidFile": root / "slurmctld.pid", "SlurmdPidFile": root / "slurmd.pid",
        "SlurmctldLogFile": root / "slurmctld.log", "SlurmdLogFile": root / "slurmd.log",
        "SlurmctldDebug": "info", "SlurmdDebug": "info",
        "PlugStackConfig": root / "plugstack.conf",     # not /etc/slurm's
        "MailProg": "/bin/true",
        "ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none",
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none", "JobCompType": "jobcomp/none",
        "SelectType": "select/cons_tres", "SelectTypeParameters": "CR_CPU",
        "SchedulerType": "sched/builtin", "MpiDefault": "none", "SwitchType": "switch/none",
        "SchedulerParameters": "batch_sched_delay=0",    # start a job in ~0 s, not 3
        "ReturnToService": 2, "MinJobAge": 600, "KillWait": 2, "InactiveLimit": 0,
        # the node declares more CPUs than the machine has; this keeps it in service
        "SlurmdParameters": "config_overrides",
    }
    lines = [f"{k}={v}" for k, v in settings.items()]
    lines.append(f"NodeName={node} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN")
    lines.append(f"PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _popen(argv: list[str], root: Path, log: str, env: dict[str, str]) -> subprocess.Popen:
    with open(root / log, "ab") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                cwd=root, start_new_session=True)


def _wait_until(predicate, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for daemon, proc in cluster.daemons.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{daemon} exited ({proc.returncode}) while waiting for "
                                   f"{what}\n{cluster.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}\n{cluster.log_tail()}")
        time.sleep(0.1)


def _start(tmp: Path) -> SlurmCluster:
    token = secrets.token_hex(4)
    root = tmp / (PREFIX + token)
    root.mkdir(mode=0o711)      # munged wants every directory above its socket searchable
    root.chmod(0o711)
    me = psutil.Process()
    (root / "owner").write_text(f"{me.pid} {me.create_time()}\n")
    for sub in ("state", "spool"):
        (root / sub).mkdir(mode=0o700)
    (root / "plugstack.conf").write_text("")
    key = root / "munge.key"
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    key.chmod(0o400)            # owned by root, the user munged runs as here

    node = socket.gethostname().split(".")[0]
    name = "tfc" + token
    path = os.pathsep.join(dict.fromkeys([*os.environ.get("PATH", "").split(os.pathsep), *SBIN]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=path, SLURM_CONF=str(root / "slurm.conf"), **{MARK_VAR: str(root)})
    cluster = SlurmCluster(root, root / "slurm.conf", name, node, "tfctest", env)
    started = time.monotonic()
    try:
        _start_daemons(cluster, key)
        cluster.start_seconds = round(time.monotonic() - started, 2)
    except BaseException:
        for proc in cluster.daemons.values():
            _stop(proc)
        _kill_all(cluster.processes(), timeout=5)
        raise
    return cluster


def _start_daemons(cluster: SlurmCluster, key: Path) -> None:
    root, env, node = cluster.root, cluster.env, cluster.node
    munge_sock = root / "munge.sock"
    cluster.daemons["munged"] = _popen(
        ["munged", "--foreground", f"--socket={munge_sock}", f"--key-file={key}",
         f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
         f"--seed-file={root}/munged.seed"], root, "munged.out", env)
    _wait_until(lambda: subprocess.run(["munge", "-n", "-S", str(munge_sock)], env=env,
                                       capture_output=True, timeout=10).returncode == 0,
                START_TIMEOUT, "munged", cluster)

    for _attempt in range(3):       # a port free when probed may be taken by then
        ctld_port, d_port = _free_port(), _free_port()
        while d_port == ctld_port:
            d_port = _free_port()
        cluster.conf.write_text(_conf(root, cluster.name, node, cluster.partition, ctld_port, d_port))
        cluster.daemons["slurmctld"] = _popen(["slurmctld", "-D", "-f", str(cluster.conf)],
                                              root, "slurmctld.out", env)
        cluster.daemons["slurmd"] = _popen(["slurmd", "-D", "-f", str(cluster.conf), "-N", node],
                                           root, "slurmd.out", env)
        try:
            _wait_until(lambda: cluster.run("sinfo", "-h", "-o", "%T", check=False,
                                            timeout=10).stdout.split() == ["idle"],
                        START_TIMEOUT, "the node to be idle (sinfo)", cluster)
            return
        except RuntimeError:
            log = cluster.log_tail()
            for daemon in ("slurmd", "slurmctld"):
                _stop(cluster.daemons.pop(daemon))
            if "Address already in use" not in log:
                raise
    raise RuntimeError(f"slurmctld/slurmd found no free ports\n{cluster.log_tail()}")


def _stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(timeout=timeout)


def stop(cluster: SlurmCluster) -> None:
    """Cancel the jobs, stop slurmd, slurmctld, munged; fail if any process of the cluster survives."""
    problems = []
    try:
        if cluster.daemons.get("slurmctld") and cluster.daemons["slurmctld"].poll() is None:
            cluster.cancel_all()
            cluster.wait_no_job_processes()
    except (AssertionError, subprocess.SubprocessError) as e:
        problems.append(str(e))
    for daemon in ("slurmd", "slurmctld", "munged"):
        if daemon in cluster.daemons:
            _stop(cluster.daemons[daemon])
    deadline = time.monotonic() + 10
    left = cluster.processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = cluster.processes()
    if left:
        problems.append(f"processes of the Slurm cluster survived its teardown: {describe(left)}")
        _kill_all(left, timeout=5)
    if not problems:
        shutil.rmtree(cluster.root, ignore_errors=True)
    assert not problems, "\n".join(problems) + f"\n(logs kept in {cluster.root})"


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running one-node Slurm cluster (SlurmCluster); stopped and checked at session end."""
    _require()
    tmp = Path(tempfile.gettempdir())
    clean_stale(tmp)
    cluster = _start(tmp)
    try:
        yield cluster
    finally:
        stop(cluster)
