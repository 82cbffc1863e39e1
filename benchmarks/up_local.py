"""`tfcluster up` of 1 ps + 2 workers on localhost vs the same three TF servers started by hand.

tfcluster: `python -m tfcluster up SPEC` (local transport, no SSH), timed from spawn to exit
(it exits once every server accepts connections); `down` runs after each rep, untimed.
Baseline: three `python -c SERVER_PROGRAM` (tf.distribute.Server ... .join(), what
tfcluster/tfserver.py does) started in parallel with Popen (own session, TF_CONFIG each),
timed until all three ports accept a TCP connection (polled every 50 ms); then killed, untimed.
Reps alternate which side goes first.

    python benchmarks/up_local.py [--reps 3] [--smoke]
"""
from __future__ import annotations

import subprocess
import sys
import time

from _common import (
    SERVER_PROGRAM,
    Bench,
    alternate,
    cluster_tasks,
    free_ports,
    hand_env,
    parser,
    print_phases,
    report,
    up_down,
    wait_ports,
    wait_ports_free,
    write_spec,
)

TARGET = 1.1


def main(argv=None) -> int:
    a = parser(__doc__, reps=3).parse_args(argv)
    reps = 1 if a.smoke else a.reps
    with Bench("up_local") as b:
        ports = free_ports(2 if a.smoke else 3)   # smoke: 1 ps + 1 worker
        cluster = {"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{p}" for p in ports[1:]]}
        spec = write_spec(b.tmp / "local.yaml", name="benchlocal", hosts=[("local", "127.0.0.1")],
                          jobs={"ps": [f"local:{ports[0]}"], "worker": [f"local:{p}" for p in ports[1:]]})
        downs, phases = [], []

        def hand() -> float:
            t = time.perf_counter()
            procs = [subprocess.Popen([sys.executable, "-c", SERVER_PROGRAM], env=hand_env(b, cluster, job, i),
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True, cwd=b.cwd)
                     for job, i, _ in cluster_tasks(cluster)]
            wait_ports([("127.0.0.1", p) for p in ports], timeout=120)
            dt = time.perf_counter() - t
            b.kill_tagged()
            for p in procs:
                p.wait()
            wait_ports_free(ports)
            return dt

        def tfc() -> float:
            up_s, down_s = up_down(b, spec, phases=phases)
            downs.append(down_s)
            wait_ports_free(ports)
            return up_s

        print(f"up_local: 1 ps + {len(ports) - 1} workers on 127.0.0.1, {reps} reps", flush=True)
        ra, rb = alternate(reps, hand, tfc)
        print(f"  (untimed) tfcluster down took median {sorted(downs)[len(downs) // 2]:.2f} s")
        print_phases(phases)
        report(f"up_local (1 ps + {len(ports) - 1} workers)", f"{len(ports)}x Popen(TF server) + poll ports", ra,
               "tfcluster up", rb, "s", TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())
