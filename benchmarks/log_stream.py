"""Log streaming over SSH: 4 tasks each printing N lines (~60 bytes) through `tfcluster train`
vs 4 parallel `ssh HOST python printer.py N > /dev/null`.

One throwaway sshd on 127.0.0.2-5 (4 "hosts"), one worker task per host, mode `mirrored`
(no TF servers), script = a plain Python printer (`<task> <i:09d> xxxx...`, 60 bytes a line).
tfcluster: `python -m tfcluster train SPEC -- N`, stdout to a file, spawn to exit (includes
connect, preflight, shipping the script, the run, the summary). Throughput = 4*N lines / wall.
Baseline: 4 OpenSSH `ssh ... HOST 'TFCLUSTER_TASK_INDEX=i PYTHON printer.py N'` in parallel,
stdout to /dev/null, spawn to last exit.
Then checks that every line arrived exactly once, in order per task, both in tfcluster's live
stdout (`worker:N │ ` prefix stripped) and in the saved runs/<id>/worker-N.log.
Also printed: tfcluster's streaming window (first byte on its stdout -> exit), polled every 5 ms.

    python benchmarks/log_stream.py [--lines 200000] [--reps 3] [--smoke]
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time

from _common import (TFCLUSTER, Bench, alternate, check_lines, loopback, parser, report,
                     strip_prefix, write_printer, write_spec)

TARGET = 0.9
TASKS = 4


def main(argv=None) -> int:
    p = parser(__doc__, reps=3)
    p.add_argument("--lines", type=int, default=200_000, help="lines per task")
    a = p.parse_args(argv)
    n = 2_000 if a.smoke else a.lines
    reps = 1 if a.smoke else a.reps
    total = n * TASKS
    with Bench("log_stream") as b:
        addrs = loopback(TASKS)
        sshd = b.start_sshd(addrs)
        printer = write_printer(b.tmp / "printer.py")
        hosts = [(f"h{ad.rsplit('.', 1)[1]}", ad) for ad in addrs]
        spec = write_spec(b.tmp / "stream.yaml", name="benchstream", hosts=hosts,
                          jobs={"worker": [f"{h}:{21000 + i}" for i, (h, _) in enumerate(hosts)]},
                          ssh_port=sshd.port, workdir=b.tmp / "remote",
                          train=f"train:\n  mode: mirrored\n  script: {printer}\n")
        out_file = b.tmp / "train.out"
        windows = []
        last_run = {}

        def hand() -> float:
            cmds = [sshd.ssh(ad, f"TFCLUSTER_TASK_INDEX={i} {shlex.quote(sys.executable)} "
                                 f"{shlex.quote(str(printer))} {n}") for i, ad in enumerate(addrs)]
            t = time.perf_counter()
            procs = [subprocess.Popen(c, env=b.env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
                     for c in cmds]
            rcs = [pr.wait(300) for pr in procs]
            dt = time.perf_counter() - t
            if any(rcs):
                raise RuntimeError(f"ssh printers exited {rcs}")
            return total / dt

        def tfc() -> float:
            runs = b.cwd / "runs"
            before = set(os.listdir(runs)) if runs.exists() else set()
            first = {}
            done = threading.Event()
            with open(out_file, "wb") as out:
                t = time.perf_counter()
                proc = subprocess.Popen(TFCLUSTER + ["train", str(spec), "--", str(n)], env=b.env(),
                                        cwd=b.cwd, stdout=out, stderr=subprocess.PIPE)

                def watch():
                    while not done.is_set():
                        if os.path.getsize(out_file) > 0:
                            first["t"] = time.perf_counter() - t
                            return
                        time.sleep(0.005)
                th = threading.Thread(target=watch, daemon=True)
                th.start()
                err = proc.communicate(timeout=600)[1]
                dt = time.perf_counter() - t
                done.set()
            if proc.returncode:
                raise RuntimeError(f"tfcluster train exited {proc.returncode}: {err.decode()[-3000:]}")
            windows.append((first.get("t", dt), dt))
            new = set(os.listdir(runs)) - before
            last_run["dir"] = runs / new.pop()
            return total / dt

        def verify() -> None:
            live = []
            with open(out_file, encoding="utf-8", errors="replace") as f:
                for line in f:
                    kv = strip_prefix(line.rstrip("\n"))
                    if kv and kv[0].startswith("worker:"):
                        live.append(kv[1])
            check_lines(live, TASKS, n, "live stdout")
            for i in range(TASKS):
                with open(last_run["dir"] / f"worker-{i}.log", encoding="utf-8") as f:
                    saved = [x.rstrip("\n") for x in f]
                mine = [x for x in saved if x.startswith(f"{i} ")]
                check_lines([x.replace(f"{i} ", "0 ", 1) for x in mine], 1, n, f"saved worker-{i}.log")
            print(f"  verified: {total} lines, each exactly once and in order per task, in live stdout "
                  f"and in {last_run['dir'].name}/worker-*.log", flush=True)

        print(f"log_stream: {TASKS} tasks x {n} lines over SSH, {reps} reps", flush=True)
        ra, rb = alternate(reps, hand, tfc, between=lambda: last_run and verify())
        w = sorted(windows)[len(windows) // 2]
        print(f"  tfcluster: first task byte on stdout after {w[0]:.2f} s, exit at {w[1]:.2f} s -> "
              f"streaming window {total / max(w[1] - w[0], 1e-9):,.0f} lines/s (informative)")
        report(f"log_stream ({TASKS}x{n} lines, SSH)", "4x parallel ssh printer > /dev/null", ra,
               "tfcluster train > file", rb, "lines/s", TARGET, higher_is_better=True, prec=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
