"""`tfcluster plot` and `tfcluster runs` on a saved run of 100,000 step lines vs a plain
Python reader of the same files.

The run is written as `train` leaves one: worker-0.log with `step=N loss=X` lines and
progress.tsv with each line's arrival time, 10 ms apart. The baseline is the least any
plot does: a fresh interpreter that reads both files line by line and parses each step
and loss with one regex. `plot` reads the same and computes steps/s over a one-second
window per sample (once a walk back from the attempt's start per sample: quadratic, about
5 minutes at this size); `runs` reads the run's manifest (and, for a run that died, only
the last MiB of the chief's log).

    python benchmarks/saved_runs.py [--reps 5] [--lines 100000] [--smoke]
"""
from __future__ import annotations

import json
import sys

from _common import TFCLUSTER, Bench, alternate, parser, report, timed_run, write_spec

TARGET = 3.0        # plot within three times a bare reader's time (interpreter and imports included)
RUN = "sv-20991231-235959-ffff"
BASELINE = r"""
import re, sys
pattern = re.compile(rb"step=(\d+) loss=([0-9.eE+-]+)")
points, times = [], []
with open(sys.argv[1], "rb") as f:
    for line in f:
        m = pattern.search(line)
        if m:
            points.append((int(m.group(1)), float(m.group(2))))
with open(sys.argv[2], "rb") as f:
    for line in f:
        parts = line.split(b"\t")
        times.append((float(parts[0]), int(parts[2])))
assert len(points) == len(times) > 0
"""


def write_run(b: Bench, lines: int):
    (b.cwd / "s.py").write_text("print('step=1 loss=1.0')\n")
    spec = write_spec(b.cwd / "sv.yaml", name="sv", hosts=[("local", "127.0.0.1")],
                      jobs={"worker": ["local:23999"]},
                      train="train:\n  mode: mirrored\n  script: s.py\n")
    run = b.cwd / "runs" / RUN
    run.mkdir(parents=True, mode=0o700)
    (b.cwd / "runs").chmod(0o700)
    plan = {"tasks": [{"task": "worker:0", "chief": True, "script": ["python3", "s.py"]}]}
    (run / "manifest.json").write_text(json.dumps(
        {"run_id": RUN, "cluster": "sv", "mode": "mirrored", "started": 0.0, "ended": lines / 100,
         "outcome": "succeeded", "exit_code": 0, "plan": plan, "tasks": {},
         "progress": {"worker:0": {"step": lines, "loss": 1 / lines}}}))
    (run / "worker-0.log").write_text("".join(f"step={i} loss={1 / i:.6f}\n" for i in range(1, lines + 1)))
    (run / "progress.tsv").write_text("".join(f"{i / 100:.3f}\tworker:0\t{i}\t-\n" for i in range(1, lines + 1)))
    return spec, run


def main(argv=None) -> int:
    p = parser(__doc__, reps=5)
    p.add_argument("--lines", type=int, default=100_000)
    a = p.parse_args(argv)
    lines, reps = (5_000, 1) if a.smoke else (a.lines, a.reps)
    with Bench("saved_runs") as b:
        spec, run = write_run(b, lines)
        env = b.env()
        reader = b.tmp / "reader.py"
        reader.write_text(BASELINE)
        timed_run(TFCLUSTER + ["plot", str(spec)], env=env, cwd=b.cwd)   # warm the page cache, untimed

        def base() -> float:
            return timed_run([sys.executable, str(reader), str(run / "worker-0.log"), str(run / "progress.tsv")],
                             env=env, cwd=b.cwd)

        def plot() -> float:
            return timed_run(TFCLUSTER + ["plot", str(spec)], env=env, cwd=b.cwd)

        def runs() -> float:
            return timed_run(TFCLUSTER + ["runs", str(spec)], env=env, cwd=b.cwd)

        print(f"saved_runs: {lines} step lines, {reps} reps", flush=True)
        ra, rb = alternate(reps, base, plot)
        report(f"saved_runs plot ({lines} lines)", "python: read and parse both files", ra,
               "tfcluster plot > /dev/null", rb, "s", TARGET)
        ra, rb = alternate(reps, base, runs)
        report(f"saved_runs runs ({lines} lines)", "python: read and parse both files", ra,
               "tfcluster runs", rb, "s", TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())
