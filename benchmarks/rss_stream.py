"""Peak RSS of tfcluster while it streams 32 tasks' output (mirrored mode, printer script).

Default: over SSH, one throwaway sshd on 4 loopback hosts (127.0.0.2-5), 8 worker tasks each
(32 tasks, each printing N lines of 60 bytes); `--local` runs the 32 tasks on 127.0.0.1 with
the local transport instead (then tfcluster's per-task shims are its children).
Sampled every 50 ms with psutil: RSS of the `tfcluster train` process plus its descendants that
are tfcluster itself (shims), never the tasks (processes tagged TFCLUSTER_JOB_ID) - the peak of
that sum, and of the main process alone.
Baseline: the hand equivalent's local footprint - 32 parallel `ssh HOST python printer.py N
>/dev/null` clients (`--local`: 32 local `python printer.py` are tasks, so the baseline is the
sum of 32 `cat`-like readers: the same 32 ssh clients); peak of their summed RSS.
Target: tfcluster peak <= 120 MB (absolute); the ratio is informative.

    python benchmarks/rss_stream.py [--lines 50000] [--reps 3] [--local] [--smoke]
"""
from __future__ import annotations

import shlex
import subprocess
import sys
import threading
import time

import psutil
from _common import TAG, TFCLUSTER, Bench, alternate, loopback, parser, report, write_printer, write_spec

TARGET_MB = 120.0
TASKS = 32


def _tagged(p: psutil.Process) -> bool:
    try:
        with open(f"/proc/{p.pid}/environ", "rb") as f:
            return TAG in f.read()
    except OSError:
        return True


class Sampler:
    """Peak summed RSS (MB) of some processes, sampled every 50 ms."""

    def __init__(self, procs) -> None:
        self.procs = procs         # callable -> list[psutil.Process]
        self.peak = self.peak_main = 0.0
        self.stop = threading.Event()
        self.th = threading.Thread(target=self.loop, daemon=True)
        self.th.start()

    def loop(self) -> None:
        while not self.stop.is_set():
            total = 0.0
            for i, p in enumerate(self.procs()):
                try:
                    rss = p.memory_info().rss / 2**20
                except psutil.Error:
                    continue
                total += rss
                if i == 0:
                    self.peak_main = max(self.peak_main, rss)
            self.peak = max(self.peak, total)
            time.sleep(0.05)

    def done(self) -> float:
        self.stop.set()
        self.th.join()
        return self.peak


def main(argv=None) -> int:
    p = parser(__doc__, reps=3)
    p.add_argument("--lines", type=int, default=50_000, help="lines per task")
    p.add_argument("--local", action="store_true", help="tasks on 127.0.0.1 (local transport)")
    p.add_argument("--tasks", type=int, default=TASKS)
    a = p.parse_args(argv)
    n = 1_000 if a.smoke else a.lines
    ntasks = 8 if a.smoke else a.tasks
    reps = 1 if a.smoke else a.reps
    with Bench("rss") as b:
        addrs = loopback(4)
        sshd = b.start_sshd(addrs)
        printer = write_printer(b.tmp / "printer.py")
        train = f"train:\n  mode: mirrored\n  script: {printer}\n"
        if a.local:
            hosts = [("local", "127.0.0.1")]
            tasks = [f"local:{22000 + i}" for i in range(ntasks)]
            spec = write_spec(b.tmp / "rss.yaml", name="benchrss", hosts=hosts, jobs={"worker": tasks}, train=train)
        else:
            hosts = [(f"h{ad.rsplit('.', 1)[1]}", ad) for ad in addrs]
            tasks = [f"{hosts[i % 4][0]}:{22000 + i}" for i in range(ntasks)]
            spec = write_spec(b.tmp / "rss.yaml", name="benchrss", hosts=hosts, jobs={"worker": tasks},
                              ssh_port=sshd.port, workdir=b.tmp / "remote", train=train)
        mains = []

        def hand() -> float:
            cmds = [sshd.ssh(addrs[i % 4], f"TFCLUSTER_TASK_INDEX={i} {shlex.quote(sys.executable)} "
                                           f"{shlex.quote(str(printer))} {n}") for i in range(ntasks)]
            procs = [subprocess.Popen(c, env=b.env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
                     for c in cmds]
            ps = []
            for pr in procs:
                try:
                    ps.append(psutil.Process(pr.pid))
                except psutil.Error:
                    pass
            s = Sampler(lambda: ps)
            rcs = [pr.wait(300) for pr in procs]
            peak = s.done()
            if any(rcs):
                raise RuntimeError(f"ssh printers exited {rcs}")
            return peak

        def tfc() -> float:
            with open(b.tmp / "rss.out", "wb") as out:
                pr = subprocess.Popen(TFCLUSTER + ["train", str(spec), "--", str(n)], env=b.env(), cwd=b.cwd,
                                      stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.PIPE)
                root = psutil.Process(pr.pid)

                def tree():
                    try:
                        kids = root.children(recursive=True)
                    except psutil.Error:
                        kids = []
                    return [root] + [k for k in kids if not _tagged(k)]
                s = Sampler(tree)
                err = pr.communicate(timeout=600)[1]
                peak = s.done()
            if pr.returncode:
                raise RuntimeError(f"tfcluster train exited {pr.returncode}: {err.decode()[-3000:]}")
            with open(b.tmp / "rss.out", "rb") as f:
                got = sum(1 for line in f if b" \xe2\x94\x82 " in line)
            if got < ntasks * n:
                raise RuntimeError(f"only {got} task lines of {ntasks * n} on stdout")
            mains.append(s.peak_main)
            return peak

        where = "127.0.0.1 (local transport)" if a.local else "4 loopback hosts over SSH"
        print(f"rss_stream: {ntasks} tasks x {n} lines on {where}, {reps} reps", flush=True)
        ra, rb = alternate(reps, hand, tfc)
        report(f"rss_stream ({ntasks} tasks, {'local' if a.local else 'SSH'}; ratio informative)",
               f"{ntasks} parallel ssh clients, summed", ra, "tfcluster train (+ own children)", rb, "MB",
               float("inf"), prec=1)
        peak = max(rb)
        print(f"  tfcluster main process alone: peak {max(mains):.1f} MB")
        print(f"TARGET rss_stream: tfcluster peak RSS {peak:.1f} MB (max over reps) <= {TARGET_MB:.0f} MB: "
              f"{'MET' if peak <= TARGET_MB else 'MISSED'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
