"""Training speed of templates/between_graph.py: `tfcluster train` vs the same cluster by hand.

1 ps + 2 workers on 127.0.0.1, `--steps S --log_every L` (default S=2000, L=50).
tfcluster: `python -m tfcluster train SPEC -- --steps S --log_every L` (it starts the three
servers, waits until they accept connections, ships and starts the two scripts, stops it all).
Baseline (by hand, like tests/tf_launch.py HandLaunch): three `python -c SERVER_PROGRAM` started
in parallel, ports polled until all accept, then the two scripts started with the same
environment tfcluster gives them (TF_CONFIG, TFCLUSTER_MASTER, ...).
Measured on both sides from each `step=G loss=...` line (G = global step), timestamped by this
benchmark as it arrives on the pipe (tfcluster: its live stdout, `worker:N │ ` prefix stripped):
  * steps/s  = (last G - first G) / (t(last line) - t(first line)), over both workers' lines:
    the steady-state training rate, start-up excluded;
  * time to first step = launch -> first `step=` line (includes TF import, servers, connect);
  * end-to-end wall time of the whole launch (informative).

tfcluster's servers import TensorFlow lean (docs/design/remote-execs.md, "The servers' import");
`--server-import full` gives them the baseline's full `import tensorflow`.

    python benchmarks/train_steps.py [--steps 2000] [--log-every 50] [--reps 3] [--server-import full] [--smoke]
"""
from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

from _common import (
    ROOT,
    SERVER_PROGRAM,
    TFCLUSTER,
    Bench,
    alternate,
    cluster_tasks,
    free_ports,
    hand_env,
    parser,
    report,
    tf_config,
    wait_ports,
    wait_ports_free,
    write_spec,
)

TARGET = 0.98
OFF = "  checks: {placement: false, reachability: false, proxy_guard: false, hang_after: off}\n"
STEP = re.compile(r"(?:^|│ )step=(\d+) loss=")


class Stepper:
    """Timestamps `step=` lines read from several pipes."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.points: list[tuple[float, int]] = []
        self.lock = threading.Lock()
        self.tail: list[str] = []

    def follow(self, pipe) -> threading.Thread:
        def read():
            for raw in pipe:
                line = raw.decode(errors="replace")
                m = STEP.search(line)
                if m:
                    with self.lock:
                        self.points.append((time.perf_counter() - self.t0, int(m.group(1))))
                self.tail = (self.tail + [line])[-40:]
        th = threading.Thread(target=read, daemon=True)
        th.start()
        return th

    def result(self) -> tuple[float, float]:
        pts = sorted(self.points)
        if len(pts) < 2:
            raise RuntimeError("fewer than 2 step lines:\n" + "".join(self.tail))
        (t1, g1), (t2, _) = pts[0], pts[-1]
        g2 = max(g for _, g in pts)
        return (g2 - g1) / (t2 - t1), t1


def main(argv=None) -> int:
    p = parser(__doc__, reps=3)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--checks", choices=("on", "off"), default="on",
                   help="tfcluster's run checks (train.checks: placement, reachability, proxy guard, "
                        "hang watchdog): on (the default) or all off")
    p.add_argument("--tf-log-level", default=None,
                   help="TF_CPP_MIN_LOG_LEVEL for tfcluster's tasks (default: tfcluster's own, 0)")
    p.add_argument("--server-import", choices=("lean", "full"), default="lean",
                   help="tfcluster's servers: lean import (the default) or the full `import tensorflow`")
    a = p.parse_args(argv)
    steps, every = (100, 10) if a.smoke else (a.steps, a.log_every)
    nw = 1 if a.smoke else 2          # smoke: 1 ps + 1 worker
    reps = 1 if a.smoke else a.reps
    script = ROOT / "templates" / "between_graph.py"
    args = ["--steps", str(steps), "--log_every", str(every), "--cleanup_timeout", "10"]
    with Bench("train_steps") as b:
        ports = free_ports(1 + nw)
        cluster = {"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{x}" for x in ports[1:]]}
        spec = write_spec(b.tmp / "train.yaml", name="benchtrain", hosts=[("local", "127.0.0.1")],
                          jobs={"ps": [f"local:{ports[0]}"], "worker": [f"local:{x}" for x in ports[1:]]},
                          train="train:\n  mode: between-graph\n  script: template:between_graph\n"
                          + (OFF if a.checks == "off" else ""),
                          env={**({"TF_CPP_MIN_LOG_LEVEL": a.tf_log_level} if a.tf_log_level else {}),
                               **({"TFCLUSTER_SERVER_IMPORT": "full"} if a.server_import == "full" else {})} or None)
        first = {"hand": [], "tfc": []}
        wall = {"hand": [], "tfc": []}
        nrun = [0]

        def hand() -> float:
            nrun[0] += 1
            t = time.perf_counter()
            servers = [subprocess.Popen([sys.executable, "-c", SERVER_PROGRAM], env=hand_env(b, cluster, job, i),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True, cwd=b.cwd)
                       for job, i, _ in cluster_tasks(cluster)]
            try:
                wait_ports([("127.0.0.1", x) for x in ports], timeout=120)
                st = Stepper(t)
                scripts, readers = [], []
                for i in range(nw):
                    env = hand_env(b, cluster, "worker", i)
                    env.update(TF_CONFIG=tf_config(cluster, "worker", i), TFCLUSTER_MASTER=f"grpc://{cluster['worker'][i]}",
                               TFCLUSTER_JOB="worker", TFCLUSTER_TASK_INDEX=str(i),
                               TFCLUSTER_IS_CHIEF="1" if i == 0 else "0", TFCLUSTER_RUN_ID=f"hand{nrun[0]}",
                               TFCLUSTER_NUM_WORKERS=str(nw), TFCLUSTER_JOB_ID=f"bench-hand:script:{i}")
                    pr = subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=b.cwd,
                                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, start_new_session=True)
                    scripts.append(pr)
                    readers.append(st.follow(pr.stdout))
                rcs = [pr.wait(600) for pr in scripts]
                for r in readers:
                    r.join(10)
                wall["hand"].append(time.perf_counter() - t)
                if any(rcs):
                    raise RuntimeError(f"hand scripts exited {rcs}:\n{''.join(st.tail)}")
            finally:
                b.kill_tagged()
                for server in servers:      # reaped, not left as zombies until the benchmark ends
                    server.wait(30)
                wait_ports_free(ports)
            rate, t_first = st.result()
            first["hand"].append(t_first)
            return rate

        def tfc() -> float:
            t = time.perf_counter()
            st = Stepper(t)
            pr = subprocess.Popen(TFCLUSTER + ["train", str(spec), "--", *args], env=b.env(), cwd=b.cwd,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            reader = st.follow(pr.stdout)
            rc = pr.wait(600)
            reader.join(10)
            wall["tfc"].append(time.perf_counter() - t)
            if rc:
                raise RuntimeError(f"tfcluster train exited {rc}:\n{''.join(st.tail)}")
            wait_ports_free(ports)
            rate, t_first = st.result()
            first["tfc"].append(t_first)
            return rate

        print(f"train_steps: between_graph.py, 1 ps + {nw} worker(s) local, --steps {steps} "
              f"--log_every {every}, {reps} reps", flush=True)
        ra, rb = alternate(reps, hand, tfc)
        report(f"train_steps ({steps} steps, steady-state)", f"servers + {nw} script(s) by hand", ra,
               "tfcluster train", rb, "steps/s", TARGET, higher_is_better=True, prec=1)
        report("train_time_to_first_step", "by hand (launch -> first step= line)", first["hand"],
               "tfcluster train", first["tfc"], "s", 1.03, prec=2)
        report("train_wall (informative)", "by hand, launch -> scripts exit", wall["hand"],
               "tfcluster train, spawn -> exit", wall["tfc"], "s", 1.1, prec=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
