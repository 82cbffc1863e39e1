"""What closing TensorFlow's ports costs: `up` and training speed, `tf_ports: open` vs the
default (`auto`: one nftables table per cluster, docs/security.md "TensorFlow's ports").

1 ps + 2 workers on 127.0.0.1. Two specs alike but for `tf_ports:`; the baseline is `open`
(no table, nothing asked of the host), tfcluster's side the default, which installs the table
in the batch that opens the host and removes it when the cluster stops. Needs root and
nftables for the table to be made (without, both sides measure the same thing: it says so).

  * up: `tfcluster up` timed from spawn to exit (`down` after each rep, untimed);
  * steps/s: `tfcluster train` of templates/between_graph.py, the steady-state rate from the
    `step=G loss=` lines as they arrive (first to last line, start-up excluded), as
    train_steps.py measures it.

    python benchmarks/fence_cost.py [--reps 3] [--steps 2000] [--smoke]
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from _common import TFCLUSTER, Bench, alternate, free_ports, parser, report, up_down, wait_ports_free, write_spec
from train_steps import Stepper

UP_TARGET = 1.05       # the table may cost at most 5% of `up`
STEPS_TARGET = 0.98    # ... and nothing measurable per step (the rule sees only new connections)


def can_close() -> bool:
    nft = shutil.which("nft") or "/usr/sbin/nft"
    return os.geteuid() == 0 and os.access(nft, os.X_OK)


def main(argv=None) -> int:
    p = parser(__doc__, reps=3)
    p.add_argument("--steps", type=int, default=2000)
    a = p.parse_args(argv)
    reps = 1 if a.smoke else a.reps
    steps, every = (100, 10) if a.smoke else (a.steps, 50)
    with Bench("fence_cost") as b:
        ports = free_ports(3)
        jobs = {"ps": [f"local:{ports[0]}"], "worker": [f"local:{x}" for x in ports[1:]]}
        train = (f"train:\n  mode: between-graph\n  script: template:between_graph\n"
                 f"  args: [--steps, '{steps}', --log_every, '{every}', --cleanup_timeout, '10']\n")
        specs = {}
        for ports_are in ("open", "auto"):
            spec = write_spec(b.tmp / f"{ports_are}.yaml", name=f"benchfence{ports_are}",
                              hosts=[("local", "127.0.0.1")], jobs=jobs, train=train)
            spec.write_text(spec.read_text() + f"tf_ports: {ports_are}\n")
            specs[ports_are] = spec
        print(f"fence_cost: 1 ps + 2 workers on 127.0.0.1, {reps} reps; tables "
              + ("made (root, nftables)" if can_close() else "NOT made here (not root or no nft): both sides alike"),
              flush=True)

        def up(which: str):
            def run() -> float:
                up_s, _ = up_down(b, specs[which])
                wait_ports_free(ports)
                return up_s
            return run

        ra, rb = alternate(reps, up("open"), up("auto"))
        up_met = report("fence_cost up (1 ps + 2 workers)", "tfcluster up, tf_ports: open", ra,
                        "tfcluster up, ports closed", rb, "s", UP_TARGET)

        def train_rate(which: str):
            def run() -> float:
                t = time.perf_counter()
                proc = subprocess.Popen(TFCLUSTER + ["train", str(specs[which])], env=b.env(), cwd=b.cwd,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT)
                st = Stepper(t)
                reader = st.follow(proc.stdout)
                rc = proc.wait(600)
                reader.join(10)
                if rc:
                    raise RuntimeError(f"tfcluster train exited {rc}:\n{''.join(st.tail)}")
                wait_ports_free(ports)
                return st.result()[0]
            return run

        sa, sb = alternate(reps, train_rate("open"), train_rate("auto"))
        steps_met = report(f"fence_cost steps/s ({steps} steps)", "train, tf_ports: open", sa,
                           "train, ports closed", sb, "steps/s", STEPS_TARGET, higher_is_better=True)
    del up_met, steps_met       # the numbers belong in README.md, not the exit status
    return 0


if __name__ == "__main__":
    sys.exit(main())
