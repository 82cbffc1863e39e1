"""How fast a lost host is named, and what the keepalive that finds a silent one costs
(docs/design/host-loss.md).

Each host is a throwaway sshd of its own on a loopback address; the "launcher" is tfcluster's
SshTransport in this process, holding one exec channel (`sleep`) as a task's shim would.

  * dropped: the host's sshd and everything started through it SIGKILLed; timed from the kill
    to HostLosses' verdict (the channel's end, then REOPEN_GRACE of refused dials). Baseline:
    ssh(1) running the same `sleep`, timed from the kill to its exit (it notices the drop, and
    tries nothing after it). Target: <= 5 s.
  * silent: every packet to and from the sshd dropped (an nftables table of its own, needs
    root); timed from the rule to the channel's end with `silent for Ns` said. Baseline: ssh(1)
    with ServerAliveInterval 5 and ServerAliveCountMax 4 (the same 20 s budget, configured by
    hand), timed from the rule to its exit. Target: <= 30 s.
  * cost: N idle connections for a window; the TCP payload bytes each carries (ss(8)'s
    bytes_sent/bytes_received) and this process's CPU time, with the keepalive and without
    (the Watch replaced by nothing).

    python benchmarks/host_loss.py [--reps 3] [--window 60] [--conns 8] [--smoke]
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import psutil
from _common import Bench, alternate, parser, report, stats

DROPPED_TARGET = 5.0
SILENT_TARGET = 30.0
TABLE = f"tfcluster_bench_silent_{os.getpid()}"
NFT = shutil.which("nft") or "/usr/sbin/nft"


def can_silence() -> bool:
    return os.geteuid() == 0 and os.access(NFT, os.X_OK)


def silence(address: str, port: int) -> None:
    rules = (f"table inet {TABLE} {{\n  chain input {{\n"
             f"    type filter hook input priority -10; policy accept;\n"
             f"    ip daddr {address} tcp dport {port} drop\n"
             f"    ip saddr {address} tcp sport {port} drop\n  }}\n}}\n")
    subprocess.run([NFT, "-f", "-"], input=rules, text=True, check=True, timeout=10)


def unsilence() -> None:
    subprocess.run([NFT, "delete", "table", "inet", TABLE], capture_output=True, timeout=10, check=False)


def kill_host(sshd) -> None:
    listener = psutil.Process(sshd.procs[0].pid)
    for p in [listener] + listener.children(recursive=True):
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    sshd.procs[0].wait(10)


def transport(sshd, address: str, interval: float, silent_after: float):
    from tfcluster.transport.ssh import SshTransport
    from tfcluster.transport.ssh_config import SshOptions
    t = SshTransport("bench", address, SshOptions(port=sshd.port, connect_timeout=5))
    t.keepalive_interval, t.silent_after = interval, silent_after
    return t


def ssh_sleep(b: Bench, sshd, address: str, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen(["ssh", *extra, *sshd.ssh_options(), address, "sleep 300"],
                            env=b.env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _wait_session(sshd)
    return proc


def _wait_session(sshd, timeout: float = 15) -> None:
    """Until the sshd runs a `sleep` for a session (the connection is up)."""
    deadline = time.monotonic() + timeout
    listener = psutil.Process(sshd.procs[0].pid)
    while time.monotonic() < deadline:
        for p in listener.children(recursive=True):
            try:
                if p.name() == "sleep":
                    return
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.02)
    raise RuntimeError("no session came up")


def dropped(b: Bench, addr: str, grace: float):
    from tfcluster.launch.cluster.hostloss import HostLosses

    def baseline() -> float:
        sshd = b.start_sshd([addr])
        proc = ssh_sleep(b, sshd, addr)
        t0 = time.monotonic()
        kill_host(sshd)
        proc.wait(30)
        return time.monotonic() - t0

    def ours() -> float:
        sshd = b.start_sshd([addr])
        t = transport(sshd, addr, 5.0, 20.0)
        try:
            chan = t.spawn(["sleep", "300"])
            _wait_session(sshd)
            t0 = time.monotonic()
            kill_host(sshd)
            while chan.read():
                pass
            verdict, _ = HostLosses(grace).judge("h", t, ("worker:1",), time.monotonic())
            took = time.monotonic() - t0
            assert verdict is not None, "a dead host was not found lost"
            return took
        finally:
            t.close()
    return baseline, ours


def silent(b: Bench, addr: str, interval: float, count: int):
    def baseline() -> float:
        sshd = b.start_sshd([addr])
        proc = ssh_sleep(b, sshd, addr, "-o", f"ServerAliveInterval={interval:g}",
                         "-o", f"ServerAliveCountMax={count}")
        t0 = time.monotonic()
        silence(addr, sshd.port)
        try:
            proc.wait(120)
            return time.monotonic() - t0
        finally:
            unsilence()
            proc.kill()

    def ours() -> float:
        sshd = b.start_sshd([addr])
        t = transport(sshd, addr, interval, interval * count)
        try:
            chan = t.spawn(["sleep", "300"])
            _wait_session(sshd)
            t0 = time.monotonic()
            silence(addr, sshd.port)
            while chan.read():
                pass
            took = time.monotonic() - t0
            assert t.lost and t.lost.startswith("silent for"), t.lost
            return took
        finally:
            unsilence()
            t.close()
    return baseline, ours


SS_BYTES = re.compile(r"bytes_sent:(\d+).*?bytes_received:(\d+)", re.DOTALL)


def tcp_bytes(port: int) -> int:
    """Payload bytes sent plus received on every client connection to `port` (ss -ti)."""
    out = subprocess.run(["ss", "-tin", f"dport = :{port}"], capture_output=True, text=True,
                         check=True).stdout
    return sum(int(s) + int(r) for s, r in SS_BYTES.findall(out))


def cost(b: Bench, addrs: list[str], window: float, interval: float):
    from tfcluster.transport import liveness

    real = liveness.Watch
    sshd = b.start_sshd(addrs)

    class NoWatch:
        def __init__(self, *a, **k) -> None:
            self.transport = a[0]

        def stop(self) -> None:
            pass

    def measure(watched: bool) -> tuple[float, float]:
        liveness.Watch = real if watched else NoWatch
        ts = [transport(sshd, a, interval, 1e9) for a in addrs]
        try:
            for t in ts:
                t.connect()
            time.sleep(interval + 0.5)        # past the connection's first exchanges
            before, cpu = tcp_bytes(sshd.port), time.process_time()
            time.sleep(window)
            return ((tcp_bytes(sshd.port) - before) / window / len(addrs),
                    (time.process_time() - cpu) / window * 100)
        finally:
            for t in ts:
                t.close()
            liveness.Watch = real

    sent: dict[bool, list[float]] = {False: [], True: []}

    def side(watched: bool):
        def run() -> float:
            per_conn, cpu = measure(watched)
            sent[watched].append(per_conn)
            return cpu
        return run
    return side(False), side(True), sent


def main(argv=None) -> int:
    p = parser(__doc__, reps=3)
    p.add_argument("--window", type=float, default=60.0, help="seconds of idle measured per rep")
    p.add_argument("--conns", type=int, default=8)
    a = p.parse_args(argv)
    reps = 1 if a.smoke else a.reps
    from tfcluster.launch.cluster.hostloss import REOPEN_GRACE
    from tfcluster.transport.liveness import PROBE_INTERVAL, SILENT_AFTER
    interval, count = (1.0, 3) if a.smoke else (PROBE_INTERVAL, int(SILENT_AFTER / PROBE_INTERVAL))
    window, conns = (3.0, 2) if a.smoke else (a.window, a.conns)
    with Bench("host_loss") as b:
        os.environ["HOME"] = str(b.home)               # this process's transport reads ~/.ssh
        os.environ.pop("SSH_AUTH_SOCK", None)
        os.environ["TFCLUSTER_SSH_SYSTEM_CONFIG"] = ""
        print(f"host_loss: {reps} reps; keepalive every {interval:g}s of quiet, silent after "
              f"{interval * count:g}s; re-open grace {REOPEN_GRACE:g}s", flush=True)
        ra, rb = alternate(reps, *dropped(b, "127.0.0.41", REOPEN_GRACE))
        report("host_loss dropped", "ssh(1) exits after the kill", ra, "tfcluster: lost (after the grace)",
               rb, "s", float("inf"))
        med = stats(rb)[0]
        print(f"TARGET host_loss dropped = {med:.2f}s (target <= {DROPPED_TARGET:g}s) "
              f"{'MET' if med <= DROPPED_TARGET else 'MISSED'}", flush=True)
        if can_silence():
            ra, rb = alternate(reps, *silent(b, "127.0.0.42", interval, count))
            report("host_loss silent", f"ssh(1) ServerAlive {interval:g}s x{count}", ra,
                   "tfcluster: silent", rb, "s", SILENT_TARGET / (interval * count))
            med = stats(rb)[0]
            print(f"TARGET host_loss silent = {med:.2f}s (target <= {SILENT_TARGET:g}s) "
                  f"{'MET' if med <= SILENT_TARGET else 'MISSED'}", flush=True)
        else:
            print("host_loss silent: skipped (dropping packets needs root and nftables)", flush=True)
        addrs = [f"127.0.0.{50 + i}" for i in range(conns)]
        base, ours, sent = cost(b, addrs, window, interval)
        ra, rb = alternate(reps, base, ours)
        report(f"host_loss keepalive CPU ({conns} idle connections)", "no keepalive (% of a core)", ra,
               "keepalive (% of a core)", rb, "%", 1.5)
        for watched, label in ((False, "without (paramiko's own, no reply)"), (True, "with the keepalive")):
            xs = sent[watched]
            print(f"host_loss bytes per idle connection {label}: {stats(xs)[0]:.1f} B/s "
                  f"(TCP payload, both ways; min {min(xs):.1f}, max {max(xs):.1f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
