"""Mode keras-jax: `tfcluster train` against the same processes started by hand, and what a
second process does to steps/s at the same global batch.

templates/keras_jax.py, DataParallel, `--epochs E --examples N --batch_size 64` (default E=6,
N=8192: 128 steps an epoch), JAX on CPU, two hosts: loopback addresses 127.0.0.93 and .94 of
one throwaway sshd (benchmarks/_common.py). Run this script with a Python that has jax and keras
(scripts/test.sh's extras-layer, or `pip install -e '.[jax]'`): every side runs that Python.
  * tfcluster: `python -m tfcluster train SPEC`, mode keras-jax, worker: a task on each host (it
    connects, checks the hosts' versions, ships the script, starts both, streams their output).
  * by hand: one `ssh HOST 'cd DIR && exec env VARS python keras_jax.py ARGS'` per host, started at
    once, VARS what tfcluster gives each process (KERAS_BACKEND=jax, KERAS_DISTRIBUTION_*,
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, gloo), the coordinator on a port
    of the first host free at the time: what a careful person types.
  * one process: by hand on the first host, alone, the same global batch (so the same steps an
    epoch).
Timed from launch, on process 0's output as it arrives:
  * ready: its `process 0 of 2: ...` line (JAX and Keras imported, the coordinator met, the
    model built);
  * first epoch: its first `K/K - ... - loss:` line (the first step's compilation included);
  * steps/s: 1 / Keras' per-epoch time a step, median over epochs 3 on (the first two compile).
Rows: ready and first epoch, tfcluster against by hand (target: <= 1.25x: the launcher's checks
and start-up on top of the same two processes); steps/s, two processes against one at the
same global batch (informative: on one machine's CPUs the two share the cores, so the row says
what the collectives cost, not what a second machine would add).

    python benchmarks/keras_jax.py [--epochs 6] [--examples 8192] [--reps 3] [--smoke]
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time

from _common import ROOT, Bench, alternate, free_ports, parser, report, train_followed, write_spec

from tfcluster.plan import jax_env  # the variables tfcluster gives each process: typed out by hand

READY = re.compile(r"(?:^|│ )process 0 of \d+: ")
EPOCH = re.compile(r"(?:^|│ )(\d+)/\1 - .*?(\d+(?:\.\d+)?)(s|ms|us)/step - loss:")
UNIT = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
TARGET = 1.25
HOSTS = ("127.0.0.93", "127.0.0.94")     # the two hosts: loopback addresses of one throwaway sshd


class Watch:
    """Process 0's output, timestamped from t0: when it was ready, its epochs' s/step."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.ready: float | None = None
        self.first_epoch: float | None = None
        self.step_s: list[float] = []
        self.tail: list[str] = []

    def follow(self, pipe) -> threading.Thread:
        def read():
            for raw in pipe:
                line = raw.decode(errors="replace")
                now = time.perf_counter() - self.t0
                if self.ready is None and READY.search(line):
                    self.ready = now
                m = EPOCH.search(line)
                if m:
                    if self.first_epoch is None:
                        self.first_epoch = now
                    self.step_s.append(float(m.group(2)) * UNIT[m.group(3)])
                self.tail = (self.tail + [line])[-40:]
        th = threading.Thread(target=read, daemon=True)
        th.start()
        return th

    def result(self) -> tuple[float, float, float]:
        """(ready, first epoch, steps/s)."""
        steady = self.step_s[2:]
        if self.ready is None or self.first_epoch is None or not steady:
            raise RuntimeError("no ready line, epoch line or third epoch in:\n" + "".join(self.tail))
        return self.ready, self.first_epoch, 1.0 / statistics.median(steady)


def main(argv=None) -> int:
    p = parser(__doc__, reps=3)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--examples", type=int, default=8192)
    a = p.parse_args(argv)
    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("keras") is None:
        print("keras_jax: this Python has no jax or keras: run it with one that has "
              "(pip install -e '.[jax]')", file=sys.stderr)
        return 2
    epochs, examples, reps = (3, 512, 1) if a.smoke else (a.epochs, a.examples, a.reps)
    script = ROOT / "templates" / "keras_jax.py"
    args = ["--epochs", str(epochs), "--examples", str(examples), "--batch_size", "64"]
    rows = {"hand": [], "tfc": [], "one": []}
    with Bench("keras_jax") as b:
        spec = b.tmp / "kj.yaml"

        sshd = b.start_sshd(HOSTS)

        def by_hand(processes: int, run: int) -> tuple[float, float, float]:
            coordinator = f"{HOSTS[0]}:{free_ports(1, HOSTS[0])[0]}"
            t = time.perf_counter()
            watch = Watch(t)
            procs = []
            try:
                for i in range(processes):     # one ssh per host, the variables on its command line
                    env = {"PYTHONUNBUFFERED": "1", "TFCLUSTER_JOB_ID": f"bench-hand{run}:worker:{i}",
                           **(jax_env(coordinator, str(processes), i, gpus=False) if processes > 1
                              else {"KERAS_BACKEND": "jax"})}
                    command = (f"cd {shlex.quote(str(b.cwd))} && exec env "
                               + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
                               + f" {shlex.join([sys.executable, str(script), *args])}")
                    procs.append(subprocess.Popen(sshd.ssh(HOSTS[i], command), env=b.env(), cwd=b.cwd,
                                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
                reader = watch.follow(procs[0].stdout)
                for extra in procs[1:]:      # drained, never read: a full pipe would stall it
                    threading.Thread(target=extra.stdout.read, daemon=True).start()
                rcs = [pr.wait(600) for pr in procs]
                reader.join(10)
                if any(rcs):
                    raise RuntimeError(f"by hand: exit codes {rcs}:\n{''.join(watch.tail)}")
            finally:
                b.kill_tagged()
            return watch.result()

        def tfc() -> tuple[float, float, float]:
            write_spec(spec, name="benchkj", hosts=[("h1", HOSTS[0]), ("h2", HOSTS[1])], ssh_port=sshd.port,
                       jobs={"worker": [f"h1:{free_ports(1, HOSTS[0])[0]}", f"h2:{free_ports(1, HOSTS[1])[0]}"]},
                       workdir=b.tmp / "work",
                       train=f"train:\n  mode: keras-jax\n  script: template:keras_jax\n  args: {args!r}\n")
            watch = Watch(time.perf_counter())
            train_followed(b, spec, watch)
            return watch.result()

        count = [0]

        def hand() -> tuple[float, float, float]:
            count[0] += 1
            rows["one"].append(by_hand(1, count[0]))   # the scaling row's baseline, beside it
            return by_hand(2, count[0])

        print(f"keras_jax: templates/keras_jax.py {' '.join(args)}, 2 processes on {' and '.join(HOSTS)} "
              f"over one sshd (CPU, gloo), {reps} rep(s); {os.cpu_count()} CPUs", flush=True)
        rows["hand"], rows["tfc"] = alternate(reps, hand, tfc)
        report("keras_jax_ready", "2 processes by hand (launch -> process 0 ready)", [r[0] for r in rows["hand"]],
               "tfcluster train", [r[0] for r in rows["tfc"]], "s", TARGET, prec=2)
        report("keras_jax_first_epoch", "2 processes by hand (launch -> epoch 1 said)",
               [r[1] for r in rows["hand"]], "tfcluster train", [r[1] for r in rows["tfc"]], "s", TARGET, prec=2)
        print("informative: steps/s at the same global batch, the two processes by hand against one alone")
        report("keras_jax_two_processes (informative)", "1 process, by hand", [r[2] for r in rows["one"]],
               "2 processes, by hand", [r[2] for r in rows["hand"]], "steps/s", 0.0, higher_is_better=True, prec=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
