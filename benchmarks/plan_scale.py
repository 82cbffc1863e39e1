"""`tfcluster plan --json` of a 1,000-task spec vs `python -c pass` (interpreter start-up).

Spec: 50 hosts, explicit `tasks:` lists (one ps per host, 19 workers per host = 1,000 tasks;
--smoke: 5 hosts, 100 tasks). Each rep times, wall clock, one `python -c pass` and one
`python -m tfcluster plan --json SPEC > /dev/null`, alternating which runs first.

    python benchmarks/plan_scale.py [--reps 9] [--hosts 50] [--smoke]
"""
from __future__ import annotations

import subprocess
import sys

from _common import TFCLUSTER, Bench, alternate, parser, report, timed_run, write_spec

TARGET = 5.0


def main(argv=None) -> int:
    p = parser(__doc__, reps=9)
    p.add_argument("--hosts", type=int, default=50)
    p.add_argument("--per-host", type=int, default=20, help="tasks per host (1 ps + the rest workers)")
    a = p.parse_args(argv)
    hosts, per = (5, 20) if a.smoke else (a.hosts, a.per_host)
    reps = 1 if a.smoke else a.reps
    with Bench("plan") as b:
        names = [(f"h{i:03d}", f"10.0.{i // 250}.{i % 250 + 1}") for i in range(hosts)]
        ps = [f"{n}:2222" for n, _ in names]
        workers = [f"{n}:{2300 + k}" for n, _ in names for k in range(per - 1)]
        spec = write_spec(b.tmp / "big.yaml", name="big", hosts=names, jobs={"ps": ps, "worker": workers},
                          train="train:\n  mode: between-graph\n  script: template:between_graph\n")
        total = len(ps) + len(workers)
        env = b.env()
        # warm the page cache and write the .pyc files once, untimed: an installed tfcluster
        # has its bytecode compiled; a checkout run under PYTHONDONTWRITEBYTECODE=1 would
        # otherwise compile every module on every rep (~+50% here)
        warm = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
        timed_run(TFCLUSTER + ["plan", "--json", str(spec)], env=warm, cwd=b.cwd)
        out = subprocess.run(TFCLUSTER + ["plan", "--json", str(spec)], env=env, cwd=b.cwd,
                             capture_output=True, text=True, check=True).stdout
        assert out.count('"worker"') >= len(workers), "plan --json does not list every task"

        def base() -> float:
            return timed_run([sys.executable, "-c", "pass"], env=env, cwd=b.cwd)

        def tfc() -> float:
            return _plan(spec, env, b.cwd)

        print(f"plan_scale: {total} tasks on {hosts} hosts, {reps} reps", flush=True)
        ra, rb = alternate(reps, base, tfc)
        report(f"plan_scale ({total} tasks)", "python -c pass", ra, "tfcluster plan --json > /dev/null",
               rb, "s", TARGET)
    return 0


def _plan(spec, env, cwd) -> float:
    import time
    t = time.perf_counter()
    r = subprocess.run(TFCLUSTER + ["plan", "--json", str(spec)], env=env, cwd=cwd,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    dt = time.perf_counter() - t
    if r.returncode:
        raise RuntimeError(r.stderr.decode()[-2000:])
    return dt


if __name__ == "__main__":
    sys.exit(main())
