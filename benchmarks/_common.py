"""Shared benchmark plumbing: throwaway sshds, isolated HOME, specs, timing, cleanup.

No pytest here: every benchmark is a plain script. Everything a benchmark starts carries
`TFCLUSTER_BENCH=<id>` in its environment (children inherit it; the benchmark sshd passes it
to its sessions with SetEnv), so `Bench.__exit__` can find and kill whatever survived and then
verify that nothing did: no process tagged `TFCLUSTER_JOB_ID` and no sshd of ours.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

# Run from the background of a shell script (`python recovery.py ... &`, nohup), this process
# starts with SIGINT ignored, and every tfcluster it starts would inherit that, as a background
# job should: the Ctrl-C a benchmark sends to stop a run would then do nothing.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SSHD = "/usr/sbin/sshd"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
MARK_VAR = "TFCLUSTER_BENCH"
SESSION_VAR = "TFCLUSTER_TEST_SESSION"   # tests/conftest.py's leak-check scope
BARE_LOGIN_VAR = "TFCLUSTER_BENCH_BARE_LOGIN"   # set by --bare-login
TAG = b"TFCLUSTER_JOB_ID="
TFCLUSTER = [sys.executable, "-m", "tfcluster"]

# What tfcluster's server program (tfcluster/tfserver.py) does, as one -c program.
SERVER_PROGRAM = (
    "import json, os, tensorflow as tf\n"
    "c = json.loads(os.environ['TF_CONFIG'])\n"
    "tf.distribute.Server(tf.train.ClusterSpec(c['cluster']), job_name=c['task']['type'],"
    " task_index=c['task']['index'], protocol='grpc', start=True).join()\n"
)


# -- arguments, timing, reporting ----------------------------------------------------------

def parser(doc: str, reps: int = 5) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    p.add_argument("--reps", type=int, default=reps, help=f"A/B repetitions (default {reps})")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 1 rep (for the test suite)")
    p.add_argument("--bare-login", action=_BareLogin, nargs=0,
                   help="informative: the throwaway sshd gives its sessions an empty HOME, so the "
                        "remote login shell sources no ~/.bashrc (both sides alike)")
    return p


class _BareLogin(argparse.Action):
    """--bare-login: every sshd this process starts sets HOME to an empty directory for its
    sessions (SetEnv overrides the HOME sshd sets). bash sources ~/.bashrc for a command run
    by sshd; this machine's root .bashrc runs `pyenv init` (0.15 s of CPU per remote command),
    which both sides pay per host. Tasks and shims are unaffected: the specs name the Python
    and the workdir by absolute path."""

    def __call__(self, parser, namespace, values, option_string=None):
        os.environ[BARE_LOGIN_VAR] = "1"
        setattr(namespace, self.dest, True)


def stats(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def fmt(xs: list[float], unit: str, prec: int = 3) -> str:
    med, lo, hi = stats(xs)
    return f"{med:.{prec}f} {unit} (min {lo:.{prec}f}, max {hi:.{prec}f}, n={len(xs)})"


def alternate(reps: int, a, b, between=None) -> tuple[list, list]:
    """Run a() and b() reps times each, alternating which goes first (AB, BA, AB, ...)."""
    ra, rb = [], []
    for i in range(reps):
        order = [(a, ra), (b, rb)] if i % 2 == 0 else [(b, rb), (a, ra)]
        for fn, out in order:
            out.append(fn())
            if between:
                between()
        print(f"  rep {i + 1}/{reps}: baseline={_short(ra[-1])} tfcluster={_short(rb[-1])}", flush=True)
    return ra, rb


def _short(x) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def report(name: str, baseline_label: str, base: list[float], tf_label: str, tfc: list[float],
           unit: str, target: float, higher_is_better: bool = False, prec: int = 3) -> bool:
    """Print both sides and the ratio tfcluster/baseline of the medians; return target met."""
    mb, mt = statistics.median(base), statistics.median(tfc)
    ratio = mt / mb if mb else float("inf")
    met = ratio >= target if higher_is_better else ratio <= target
    op = ">=" if higher_is_better else "<="
    print(f"{name}:")
    print(f"  baseline  {baseline_label:<42} {fmt(base, unit, prec)}")
    print(f"  tfcluster {tf_label:<42} {fmt(tfc, unit, prec)}")
    lo = min(tfc) / max(base) if max(base) else float("inf")
    hi = max(tfc) / min(base) if min(base) else float("inf")
    print(f"RATIO {name} = {ratio:.3f}x tfcluster/baseline (range {lo:.3f}-{hi:.3f}; target {op} "
          f"{target}x) {'MET' if met else 'MISSED'}", flush=True)
    return met


def run(argv, timeout: float = 300, env=None, cwd=None, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, env=env, cwd=cwd, timeout=timeout, capture_output=True, **kw)
    if check and r.returncode != 0:
        out = r.stdout if isinstance(r.stdout, str) else r.stdout.decode(errors="replace")
        err = r.stderr if isinstance(r.stderr, str) else r.stderr.decode(errors="replace")
        raise RuntimeError(f"{argv[:6]} exited {r.returncode}:\n{out[-2000:]}\n{err[-3000:]}")
    return r


def timed_run(argv, **kw) -> float:
    t = time.perf_counter()
    run(argv, **kw)
    return time.perf_counter() - t


def train_followed(b: "Bench", spec: Path, watch, args=(), timeout: float = 600) -> None:
    """`tfcluster train SPEC [-- ARGS]`, its output read by watch.follow(pipe) as it comes;
    raises with watch.tail (its last lines) if it fails."""
    pr = subprocess.Popen(TFCLUSTER + ["train", str(spec), *(["--", *args] if args else [])], env=b.env(),
                          cwd=b.cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    reader = watch.follow(pr.stdout)
    rc = pr.wait(timeout)
    reader.join(10)
    if rc:
        raise RuntimeError(f"tfcluster train exited {rc}:\n{''.join(watch.tail)}")


# -- ports ---------------------------------------------------------------------------------

def free_ports(n: int, host: str = "0.0.0.0") -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def listening(host: str, port: int) -> bool:
    """Whether something listens at host:port, read from the kernel's socket table rather
    than by connecting: tfcluster's fence refuses a connection from outside the cluster,
    this process's included."""
    import psutil

    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.laddr.ip in (host, "0.0.0.0", "::")
               for c in psutil.net_connections(kind="tcp"))


def wait_ports(addrs: list[tuple[str, int]], timeout: float, interval: float = 0.05) -> None:
    """Poll until every (host, port) accepts a TCP connection."""
    pending = list(addrs)
    deadline = time.monotonic() + timeout
    while pending:
        pending = [a for a in pending if not port_open(*a)]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not listening after {timeout}s: {pending}")
        time.sleep(interval)


def wait_ports_free(ports: list[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while any(port_open("127.0.0.1", p) for p in ports):
        if time.monotonic() > deadline:
            raise RuntimeError(f"ports still busy after {timeout}s: {ports}")
        time.sleep(0.1)


# -- sshd ----------------------------------------------------------------------------------

def keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tfcluster-bench",
                    "-f", str(path)], check=True, capture_output=True)
    return " ".join(path.with_suffix(".pub").read_text().split()[:2])


def _accepts_ssh(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=0.5) as s:
            return s.recv(4).startswith(b"SSH-")
    except OSError:
        return False


@dataclass
class Sshd:
    port: int
    addresses: tuple[str, ...]
    user_key: Path
    known_hosts: Path
    procs: list = field(repr=False)   # one sshd per 16 addresses (sshd's MAX_LISTEN_SOCKS)

    def ssh_options(self) -> list[str]:
        """OpenSSH client options for the baseline: the same key and known_hosts tfcluster uses."""
        return ["-i", str(self.user_key), "-o", f"UserKnownHostsFile={self.known_hosts}",
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-p", str(self.port)]

    def ssh(self, addr: str, command: str) -> list[str]:
        return ["ssh", *self.ssh_options(), addr, command]


def compile_launcher() -> None:
    """Write tfcluster's .pyc files, as `pip install` does: a checkout run under
    PYTHONDONTWRITEBYTECODE=1 (these sessions' environment) would otherwise compile every
    module the launcher imports on every run (~0.1 s of CPU per `train`). Python still reads
    existing .pyc files under that variable; nothing else about the runs changes."""
    import compileall
    compileall.compile_dir(str(ROOT / "tfcluster"), quiet=1)


class Bench:
    """A benchmark's sandbox: tmp dir, isolated HOME (~/.ssh with key + known_hosts), the
    process marker, the sshds it started; on exit kills and verifies everything."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mark = uuid.uuid4().hex[:12]
        self.tmp = Path(tempfile.mkdtemp(prefix=f"tfcb-{name}-"))
        self.home = self.tmp / "home"
        (self.home / ".ssh").mkdir(parents=True, mode=0o700)
        self.cwd = self.tmp / "cwd"
        self.cwd.mkdir()
        self.sshds: list[Sshd] = []
        self._prev = os.environ.get(MARK_VAR)
        self._user_key: Path | None = None

    # environment for every child: isolated HOME, no agent, plain output
    def env(self, **extra) -> dict[str, str]:
        env = {**os.environ, "HOME": str(self.home), "NO_COLOR": "1", "COLUMNS": "200", MARK_VAR: self.mark}
        env.pop("SSH_AUTH_SOCK", None)
        env.update(extra)
        return env

    def __enter__(self) -> Bench:
        os.environ[MARK_VAR] = self.mark
        compile_launcher()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.cleanup()
        finally:
            if self._prev is None:
                os.environ.pop(MARK_VAR, None)
            else:
                os.environ[MARK_VAR] = self._prev
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- sshd
    def start_sshd(self, addresses, **options) -> Sshd:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        if self._user_key is None:
            self._user_key = self.home / ".ssh" / "id_ed25519"
            keygen(self._user_key)
            (self.tmp / "authorized_keys").write_text(self._user_key.with_suffix(".pub").read_text())
        d = self.tmp / f"sshd{len(self.sshds)}"
        d.mkdir()
        pub = keygen(d / "host_ed25519")
        setenv = f"{MARK_VAR}={self.mark}"
        if os.environ.get(BARE_LOGIN_VAR):
            (self.tmp / "bare-home").mkdir(exist_ok=True)
            setenv += f" HOME={self.tmp / 'bare-home'}"
        if os.environ.get(SESSION_VAR):
            setenv += f" {SESSION_VAR}={os.environ[SESSION_VAR]}"
        groups = [addresses[i:i + 16] for i in range(0, len(addresses), 16)]
        for _attempt in range(3):
            port = self._port_free_on_all(addresses)
            procs = []
            for g, group in enumerate(groups):
                settings = {"Port": port, "HostKey": d / "host_ed25519",
                            "AuthorizedKeysFile": self.tmp / "authorized_keys",
                            "PasswordAuthentication": "no", "KbdInteractiveAuthentication": "no",
                            "PubkeyAuthentication": "yes", "PermitRootLogin": "yes",
                            "StrictModes": "no", "UsePAM": "no", "MaxStartups": "200:30:300",
                            "MaxSessions": 64, "PidFile": d / f"sshd{g}.pid", "LogLevel": "ERROR",
                            "Subsystem": f"sftp {SFTP_SERVER}", "SetEnv": setenv}
                settings.update(options)
                lines = [f"ListenAddress {a}" for a in group] + [f"{k} {v}" for k, v in settings.items()]
                (d / f"sshd_config{g}").write_text("\n".join(lines) + "\n")
                with open(d / "sshd.log", "ab") as log:
                    procs.append(subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / f"sshd_config{g}")],
                                                  stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                  env=self.env()))
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and all(p.poll() is None for p in procs):
                if all(_accepts_ssh(a, port) for a in addresses):
                    break
                time.sleep(0.05)
            else:
                for p in procs:
                    _stop(p)
                continue
            kh = self.home / ".ssh" / "known_hosts"
            with open(kh, "a") as f:
                f.writelines(f"[{a}]:{port} {pub}\n" for a in addresses)
            kh.chmod(0o600)
            s = Sshd(port, tuple(addresses), self._user_key, kh, procs)
            self.sshds.append(s)
            return s
        raise RuntimeError(f"sshd did not start: {(d / 'sshd.log').read_text()[-2000:]}")

    @staticmethod
    def _port_free_on_all(addresses) -> int:
        for _ in range(50):
            port = free_ports(1, addresses[0])[0]
            ok = True
            for a in addresses:
                with socket.socket() as s:
                    try:
                        s.bind((a, port))
                    except OSError:
                        ok = False
                        break
            if ok:
                return port
        raise RuntimeError("no port free on every address")

    # -- processes
    def ours(self) -> list[psutil.Process]:
        """Live processes carrying this benchmark's marker (never this process itself)."""
        mark = f"{MARK_VAR}={self.mark}".encode()
        found = []
        for p in psutil.process_iter(["pid", "status"]):
            if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                with open(f"/proc/{p.pid}/environ", "rb") as f:
                    items = f.read().split(b"\0")
            except OSError:
                continue
            if mark in items:
                found.append(p)
        return found

    def tagged(self) -> list[psutil.Process]:
        out = []
        for p in self.ours():
            try:
                with open(f"/proc/{p.pid}/environ", "rb") as f:
                    if TAG in f.read():
                        out.append(p)
            except OSError:
                pass
        return out

    def kill_tagged(self) -> int:
        """SIGKILL every tagged (TFCLUSTER_JOB_ID) process of ours with its group; how many."""
        procs = self.tagged()
        for p in procs:
            with contextlib.suppress(OSError):
                os.killpg(os.getpgid(p.pid), signal.SIGKILL)
            with contextlib.suppress(OSError):
                p.kill()
        psutil.wait_procs(procs, timeout=10)
        return len(procs)

    def cleanup(self) -> None:
        self.kill_tagged()
        for s in self.sshds:
            for p in s.procs:
                _stop(p)
        # anything else of ours (ssh clients, pdsh, shims, stray tfcluster) goes too
        deadline = time.monotonic() + 10
        while (left := self.ours()) and time.monotonic() < deadline:
            for p in left:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(left, timeout=2)
        left = self.ours()
        if left:
            desc = [(p.pid, _cmd(p)) for p in left]
            raise RuntimeError(f"processes survived cleanup: {desc}")
        print(f"cleanup: no process of this benchmark survives (no TFCLUSTER_JOB_ID task, "
              f"{len(self.sshds)} sshd stopped)", flush=True)


def _cmd(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(p.cmdline())[:120]
    return "?"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# -- specs ---------------------------------------------------------------------------------

def write_spec(path: Path, *, name: str, hosts: list[tuple[str, str]], jobs: dict[str, list[str]],
               ssh_port: int | None = None, workdir: Path | None = None, train: str = "",
               env: dict[str, str] | None = None) -> Path:
    """A spec with explicit `tasks:` lists. hosts: (name, address); jobs: job -> ["host:port"]."""
    lines = [f"name: {name}", f"python: {sys.executable}"]
    if workdir:
        lines.append(f"workdir: {workdir}")
    if env:
        lines.append("env:")
        lines += [f"  {k}: {v!r}" for k, v in env.items()]
    if ssh_port:
        lines += ["ssh:", f"  port: {ssh_port}", "  connect_timeout: 10"]
    lines.append("hosts:")
    lines += [f"  - {{name: {n}, address: {a}}}" for n, a in hosts]
    lines.append("jobs:")
    for job, tasks in jobs.items():
        lines.append(f"  {job}: {{tasks: [{', '.join(repr(t) for t in tasks)}]}}")
    text = "\n".join(lines) + "\n" + train
    path.write_text(text)
    return path


def loopback(n: int, first: int = 2) -> list[str]:
    """127.0.0.<first> ... : n distinct loopback "hosts"."""
    return [f"127.0.0.{first + i}" for i in range(n)]


# -- TF servers by hand (the baseline for `up`) --------------------------------------------

def tf_config(cluster: dict, job: str, index: int) -> str:
    import json
    return json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})


def cluster_tasks(cluster: dict) -> list[tuple[str, int, str]]:
    """(job, index, "addr:port") of every task, ps first."""
    return [(job, i, addr) for job, addrs in cluster.items() for i, addr in enumerate(addrs)]


def hand_env(b: Bench, cluster: dict, job: str, index: int) -> dict[str, str]:
    """What a careful hand launch gives a TF server (TF's C++ chatter off: tfcluster keeps it, for
    its hang watchdog, but hides it from the live view)."""
    return b.env(TF_CONFIG=tf_config(cluster, job, index), TF_CPP_MIN_LOG_LEVEL="2",
                 PYTHONUNBUFFERED="1", TFCLUSTER_JOB_ID=f"bench-hand:{job}:{index}",
                 CUDA_VISIBLE_DEVICES="")


def up_down(b: Bench, spec: Path, timeout: float = 300, phases: list | None = None) -> tuple[float, float]:
    """Time `tfcluster up SPEC` (spawn to exit) and then run `down` (untimed, also returned).

    `phases` gets (seconds to "Connecting", to "Starting N server(s)", to exit) for the report."""
    t = time.perf_counter()
    p = subprocess.Popen(TFCLUSTER + ["up", str(spec)], env=b.env(), cwd=b.cwd, text=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    marks, lines = {}, []
    for line in p.stderr:
        lines.append(line)
        for word in ("Connecting", "Starting"):
            if word in line and word not in marks:
                marks[word] = time.perf_counter() - t
    rc = p.wait(timeout)
    up_s = time.perf_counter() - t
    if rc:
        raise RuntimeError(f"tfcluster up exited {rc}:\n{''.join(lines)[-3000:]}")
    if phases is not None:
        phases.append((marks.get("Connecting", float("nan")), marks.get("Starting", float("nan")), up_s))
    t = time.perf_counter()
    r = run(TFCLUSTER + ["down", str(spec)], env=b.env(), cwd=b.cwd, timeout=timeout, check=False, text=True)
    if r.returncode:
        # seen here: "not fully stopped (ports still busy: ...)" right after a successful stop;
        # reported as a product finding, then down is run again
        DOWN_FAILURES.append(r.stderr.strip().splitlines()[-2:])
        print(f"  note: tfcluster down exited {r.returncode}: {r.stderr.strip().splitlines()[-2:]}; retrying",
              flush=True)
        time.sleep(1)
        run(TFCLUSTER + ["down", str(spec)], env=b.env(), cwd=b.cwd, timeout=timeout)
    return up_s, time.perf_counter() - t


DOWN_FAILURES: list = []


def print_phases(phases: list) -> None:
    if not phases:
        return
    med = [statistics.median(x[i] for x in phases) for i in range(3)]
    print(f"  tfcluster up phases (median): CLI start -> 'Connecting' {med[0]:.2f} s; connect + "
          f"preflight -> 'Starting' {med[1] - med[0]:.2f} s; start + wait ready + exit {med[2] - med[1]:.2f} s")


# -- the printer task (log streaming, RSS) ---------------------------------------------------

PRINTER = '''import os, sys
n = int(sys.argv[1])
me = os.environ.get("TFCLUSTER_TASK_INDEX", "0")
pad = "x" * 40
out = sys.stdout
for i in range(n):
    out.write(f"{me} {i:09d} {pad}\\n")
out.flush()
'''


def write_printer(path: Path) -> Path:
    path.write_text(PRINTER)
    return path


def check_lines(lines, tasks: int, n: int, where: str) -> None:
    """Every task's n lines arrived exactly once, in order: "<task> <i:09d> xxx..." lines."""
    nxt = [0] * tasks
    for line in lines:
        parts = line.split(" ", 2)
        if len(parts) != 3 or not parts[0].isdigit() or len(parts[1]) != 9:
            continue
        t, i = int(parts[0]), int(parts[1])
        if i != nxt[t]:
            raise AssertionError(f"{where}: task {t}: expected line {nxt[t]}, got {i}")
        nxt[t] += 1
    if nxt != [n] * tasks:
        raise AssertionError(f"{where}: lines per task {nxt}, expected {n} each")


def strip_prefix(line: str) -> tuple[str, str] | None:
    """'worker:3 │ body' -> ('worker:3', 'body')."""
    key, sep, body = line.partition(" │ ")
    return (key.strip(), body) if sep else None
