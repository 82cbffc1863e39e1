"""Restart latency: a worker's script SIGKILLed -> its replacement's first `step=` line.

Cluster: 2 workers on 127.0.0.1, `train.mode: mirrored` (no TF servers: the measured path is
the restart of a script, not TF), running a light script (RESUMER below, no TensorFlow) that
resumes from a step counter it keeps in a file and prints `step=N pid=P` every --period s until
--steps. Once worker 1 has printed --kill-at steps, this benchmark SIGKILLs its script process
(found with psutil by its cmdline and TFCLUSTER_TASK_INDEX=1 in its environment) and measures,
on the pipe it reads, the time from just before the kill to the first `step=` line of worker 1
from another pid.
  * baseline: the two scripts started by hand, each in a restart loop
    `bash -c 'until PY resumer.py ...; do :; done'` (same environment as tfcluster gives them);
  * tfcluster: `tfcluster train SPEC` with `train.restart: {policy: on-failure, max_restarts: 3}`
    (its defaults otherwise), live stdout read with the `worker:1 │ ` prefix.
Both sides then run to --steps and exit 0.

    python benchmarks/restart_latency.py [--reps 7] [--steps 200] [--period 0.02] [--smoke]
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
from _common import TFCLUSTER, Bench, alternate, free_ports, parser, report, train_followed, write_spec

TARGET = 1.1
STEP = re.compile(r"(?:^|│ )step=(\d+) pid=(\d+) task=(\d+)")

RESUMER = '''import os, sys, time
state, steps, period = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
me = os.environ["TFCLUSTER_TASK_INDEX"]
path = os.path.join(state, "step-" + me)
try:
    with open(path) as f:
        step = int(f.read() or 0)
except FileNotFoundError:
    step = 0
pid = os.getpid()
while step < steps:
    step += 1
    with open(path, "w") as f:
        f.write(str(step))
    print(f"step={step} pid={pid} task={me}", flush=True)
    time.sleep(period)
'''


class Watch:
    """Reads `step=` lines from pipes; kills task 1's script once, timestamps the replacement."""

    def __init__(self, b: Bench, script: str, kill_at: int) -> None:
        self.b, self.script, self.kill_at = b, script, kill_at
        self.t_kill: float | None = None
        self.killed_pid: int | None = None
        self.latency: float | None = None
        self.tail: list[str] = []
        self.lock = threading.Lock()

    def follow(self, pipe) -> threading.Thread:
        def read():
            for raw in pipe:
                now = time.perf_counter()
                line = raw.decode(errors="replace")
                self.tail = (self.tail + [line])[-40:]
                m = STEP.search(line)
                if m and m.group(3) == "1":
                    self.on_step(int(m.group(1)), int(m.group(2)), now)
        th = threading.Thread(target=read, daemon=True)
        th.start()
        return th

    def on_step(self, step: int, pid: int, now: float) -> None:
        with self.lock:
            if self.killed_pid is None and step >= self.kill_at:
                self.kill(pid)
            elif self.killed_pid is not None and pid != self.killed_pid and self.latency is None:
                self.latency = now - self.t_kill

    def kill(self, pid: int) -> None:
        victim = self.victim()
        if victim.pid != pid:
            raise RuntimeError(f"task 1 prints from pid {pid} but its script process is {victim.pid}")
        self.killed_pid = victim.pid
        self.t_kill = time.perf_counter()
        os.kill(victim.pid, signal.SIGKILL)

    def victim(self) -> psutil.Process:
        """Task 1's live script process, found by cmdline and environment."""
        for p in self.b.ours():
            try:
                if self.script not in " ".join(p.cmdline()) or p.name().startswith("bash"):
                    continue
                if p.environ().get("TFCLUSTER_TASK_INDEX") == "1":
                    return p
            except psutil.Error:
                continue
        raise RuntimeError("task 1's script process not found")

    def result(self) -> float:
        if self.latency is None:
            raise RuntimeError("no replacement step seen:\n" + "".join(self.tail))
        return self.latency


def main(argv=None) -> int:
    p = parser(__doc__, reps=7)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--period", type=float, default=0.02, help="seconds between two steps")
    p.add_argument("--kill-at", type=int, default=40, help="kill worker 1 after this step")
    a = p.parse_args(argv)
    steps, kill_at = (60, 20) if a.smoke else (a.steps, a.kill_at)
    reps = 1 if a.smoke else a.reps
    with Bench("restart") as b:
        script = b.tmp / "resumer.py"
        script.write_text(RESUMER)
        state = b.tmp / "state"
        args = [str(state), str(steps), str(a.period)]
        spec = write_spec(b.tmp / "restart.yaml", name="benchrestart", hosts=[("local", "127.0.0.1")],
                          jobs={"worker": [f"local:{x}" for x in free_ports(2)]},
                          train=f"train:\n  mode: mirrored\n  script: {script}\n"
                                f"  restart: {{policy: on-failure, max_restarts: 3}}\n")
        plan = _plan_envs(b, spec)

        def fresh_state() -> None:
            state.mkdir(mode=0o700, exist_ok=True)
            for f in state.iterdir():
                f.unlink()

        def hand() -> float:
            fresh_state()
            w = Watch(b, script.name, kill_at)
            loops, readers = [], []
            cmd = f"until {sys.executable} {script} {' '.join(args)}; do :; done"
            for i, env in enumerate(plan):
                pr = subprocess.Popen(["bash", "-c", cmd], env={**b.env(), **env,
                                      "TFCLUSTER_JOB_ID": f"bench-hand:script:{i}"},
                                      cwd=b.cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True)
                loops.append(pr)
                readers.append(w.follow(pr.stdout))
            try:
                rcs = [pr.wait(300) for pr in loops]
            finally:
                b.kill_tagged()
            for r in readers:
                r.join(10)
            if any(rcs):
                raise RuntimeError(f"hand loops exited {rcs}:\n{''.join(w.tail)}")
            return w.result()

        def tfc() -> float:
            fresh_state()
            w = Watch(b, script.name, kill_at)
            train_followed(b, spec, w, args, timeout=300)
            return w.result()

        print(f"restart_latency: 2 workers (mirrored, light resumer script, no TF), kill worker 1 "
              f"at step {kill_at} of {steps}, period {a.period}s, {reps} reps", flush=True)
        ra, rb = alternate(reps, hand, tfc)
        report("restart_latency (kill -> replacement's first step)", "bash `until script; do :; done`",
               ra, "tfcluster train, restart on-failure", rb, "s", TARGET)
    return 0


def _plan_envs(b: Bench, spec) -> list[dict[str, str]]:
    """Each script task's environment as tfcluster's plan gives it (TF_CONFIG, TFCLUSTER_*)."""
    import json
    out = subprocess.run(TFCLUSTER + ["plan", "--json", str(spec)], env=b.env(), cwd=b.cwd,
                         capture_output=True, text=True, check=True).stdout
    doc = json.loads(out)
    envs = []
    for t in doc["tasks"]:
        if not t["script"]:
            continue
        env = {k: v for k, v in t["env"].items() if v != "***"}
        env["TF_CONFIG"] = json.dumps({"cluster": doc["cluster"], "task": t["tf_config_task"]})
        envs.append(env)
    return envs


if __name__ == "__main__":
    sys.exit(main())
