"""How fast a run gets going again after a host dies, and what the keepalive that finds a silent
host costs a run's steps (docs/hostloss.md, docs/design/host-loss.md).

Every host is a throwaway sshd on a loopback address: the ps and the surviving worker on one
shared sshd, the host that dies and the spare on an sshd each. "The host dies": its sshd and
everything started through it SIGKILLed (tests/test_host_loss.py's kill_host). The script is
templates/between_graph.py (1 ps + 2 workers, `--log_every 50 --model_dir {workdir}/ckpt`: the
chief saves a checkpoint every 50 steps).

  * worker: the plain worker's host dies; tfcluster restarts every task on the new cluster,
    that worker on the spare (`spare: true`, on_host_loss as resolved: spare): its ps dials a
    worker at the address it started with.
  * chief: the chief's host dies, with `train.checkpoint` (sync every 2 s); every task restarts
    on the new cluster from the launcher's copy. The benchmark deletes the checkpoint directory
    with the host (its disk is gone), as a lab without a shared filesystem would find it.

Each timed from the kill to the first `step=` line of the lost host's task after the move (the
run's output, live); steps lost from the manifest's `moves[0]` (steps_lost: step_at -
resumed_step, at least 0), with the times it records (decided, new tasks started) from the kill.

Baseline, the same recovery by a script: `tfcluster train` with `on_host_loss: fail`, wait for
it to fail naming the lost host (exit 3; exit 5 where the lost task's end is judged first),
rewrite the spec with the lost host's tasks on the spare host (the host entry dropped, the
spare made a plain host), `tfcluster down`, `tfcluster train` again with the same --model_dir;
timed from the kill to the first `step=` line of the same task in the new run.
Steps lost: the last step the first run printed - the first step the new run printed, as the
manifest counts them (the first step said after the move), and against the step the new run
says it restored; the step printed last before the kill is shown too. The checkpoint directory is on the loopback
"hosts'" shared filesystem and survives the kill, which favours the baseline: without a shared
filesystem it has no checkpoint to resume from at all.

  * keepalive: steady-state steps/s of the same template, 2,000 steps, on a 2-host SSH cluster
    (ps + worker:0 on one address, worker:1 on another, one sshd), with tfcluster's keepalive
    as shipped against a launcher whose transport/liveness.Watch is replaced by nothing (a
    wrapper that patches it in this benchmark's launcher process only; both sides run through
    the wrapper). steps/s as train_steps.py measures it, from the step lines' arrival times.
    Target: keepalive >= 0.99x of without.

    python benchmarks/recovery.py [--reps 3] [--only worker,chief,keepalive] [--smoke]
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from _common import TFCLUSTER, Bench, alternate, free_ports, parser, report, stats

SHARED = ("127.0.0.81", "127.0.0.82")     # h2 (ps), h3: one sshd
LOST, SPARE = "127.0.0.83", "127.0.0.84"  # h4 (the host that dies), h5 (the spare)
KEEP_HOSTS = ("127.0.0.85", "127.0.0.86")
KEEPALIVE_TARGET = 0.99
STEP = re.compile(r"^(\S+)\s+│ step=(\d+) loss=")

# The launcher, run as `python -c WRAPPER train ...`; BENCH_KEEPALIVE=off replaces the Watch
# (one thread per SSH connection, transport/liveness.py) by an object that does nothing.
WRAPPER = """
import os, runpy, sys
if os.environ.get("BENCH_KEEPALIVE") == "off":
    from tfcluster.transport import liveness

    class NoWatch:
        probes = 0

        def __init__(self, transport, *a, **k):
            self.transport = transport

        def stop(self):
            pass

    liveness.Watch = NoWatch
    print("bench: keepalive off", file=sys.stderr, flush=True)
sys.argv = ["tfcluster", *sys.argv[1:]]
runpy.run_module("tfcluster", run_name="__main__", alter_sys=True)
"""


class Follower:
    """Reads a process's merged output; every line with its arrival time (monotonic)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self.cond = threading.Condition()
        self.done = False
        self.thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self.thread.start()

    def _read(self, pipe) -> None:
        for raw in pipe:
            with self.cond:
                self.lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))
                self.cond.notify_all()
        with self.cond:
            self.done = True
            self.cond.notify_all()

    def wait(self, pattern: str, timeout: float, start: int = 0) -> int:
        """Index of the first line from `start` on that matches `pattern`."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        i = start
        with self.cond:
            while True:
                while i < len(self.lines):
                    if regex.search(self.lines[i][1]):
                        return i
                    i += 1
                left = deadline - time.monotonic()
                if self.done or left <= 0:
                    tail = "\n".join(x for _, x in self.lines[:25] + [(0, "...")] + self.lines[-25:])
                    raise RuntimeError(f"no line matching {pattern!r} "
                                       f"({'output ended' if self.done else f'{timeout:g}s'}):\n{tail}")
                self.cond.wait(min(left, 1.0))

    def steps(self, start: int = 0, end: int | None = None) -> list[int]:
        with self.cond:
            found = [STEP.search(x) for _, x in self.lines[start:end]]
        return [int(m.group(2)) for m in found if m]

    def text(self) -> str:
        with self.cond:
            return "\n".join(x for _, x in self.lines)


ESCAPED: list[str] = []          # processes started through a killed sshd but not under it


def kill_host(b: Bench, sshd) -> None:
    """The host dies: its sshd, every session's sshd and all started through them, SIGKILLed
    together (the listener first, so nothing can reconnect in between). "Started through it"
    also finds, by the SSH_CONNECTION its sessions set, a process no longer under the sshd
    (one forked as the tree was read); such a find is said."""
    listener = psutil.Process(sshd.procs[0].pid)
    tree = [listener] + listener.children(recursive=True)
    mark = f" {sshd.addresses[0]} {sshd.port}".encode()
    pids = {p.pid for p in tree}
    others = []
    for p in b.ours():
        with contextlib.suppress(OSError):
            with open(f"/proc/{p.pid}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            if p.pid not in pids and any(e.startswith(b"SSH_CONNECTION=") and e.endswith(mark) for e in env):
                others.append(p)
    for p in tree + others:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    sshd.procs[0].wait(10)
    if others:
        ESCAPED.append(", ".join(f"{p.pid}" for p in others))
        print(f"  note: {len(others)} process(es) started through the killed sshd were not under it", flush=True)


def recovery_spec(b: Bench, shared, lost, spare, name: str, scenario: str, *, by_hand: bool,
                  steps: int, warm: bool = False) -> Path:
    """ps on h2; the chief (worker:0) on h3 and worker:1 on h4 (`worker`), or the chief on h4
    and worker:1 on h3 (`chief`); h5 the spare."""
    p = free_ports(3)
    a, c = SHARED
    workers = f"'h3:{p[1]}', 'h4:{p[2]}'" if scenario == "worker" else f"'h4:{p[1]}', 'h3:{p[2]}'"
    text = (f"name: {name}\npython: {sys.executable}\nworkdir: {b.tmp / 'remote'}\n"
            f"ssh:\n  port: {shared.port}\n  connect_timeout: 5\n"
            f"hosts:\n  - {{name: h2, address: {a}}}\n  - {{name: h3, address: {c}}}\n"
            f"  - {{name: h4, address: {lost.addresses[0]}, ssh: {{port: {lost.port}}}}}\n"
            f"  - {{name: h5, address: {spare.addresses[0]}, spare: {'warm' if warm else 'true'}, "
            f"ssh: {{port: {spare.port}}}}}\n"
            f"jobs:\n  ps: {{tasks: ['h2:{p[0]}']}}\n  worker: {{tasks: [{workers}]}}\n"
            f"train:\n  mode: between-graph\n  script: template:between_graph\n"
            f"  args: ['--steps', '{steps}', '--log_every', '50', '--model_dir', '{{workdir}}/ckpt',"
            f" '--cleanup_timeout', '10']\n")
    if by_hand:
        text += "  on_host_loss: fail\n"
    elif scenario == "chief":
        text += "  checkpoint: {dir: '{workdir}/ckpt', keep: 2, sync: 2s}\n"
    path = b.tmp / f"{name}.yaml"
    path.write_text(text)
    return path


def moved_by_hand(text: str) -> str:
    """What the baseline's script does to the spec: h4's entry dropped, its tasks on h5, h5 a
    plain host."""
    lines = [ln for ln in text.splitlines() if "name: h4," not in ln]
    text = "\n".join(lines) + "\n"
    return text.replace("'h4:", "'h5:").replace(", spare: true", "").replace("  on_host_loss: fail\n", "")


def start_train(b: Bench, spec: Path, wrapper: bool = False, **env) -> tuple[subprocess.Popen, Follower]:
    argv = [sys.executable, "-c", WRAPPER] if wrapper else TFCLUSTER
    proc = subprocess.Popen(argv + ["train", str(spec)], env=b.env(**env), cwd=b.cwd,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, Follower(proc)


NOT_STOPPED: list[str] = []      # runs Ctrl-C did not stop within INTERRUPT_WAIT (a finding)
INTERRUPT_WAIT = 15.0


def interrupt(b: Bench, proc: subprocess.Popen, name: str = "", f: Follower | None = None) -> None:
    """Ctrl-C for the run (it stops its tasks and writes its manifest); SIGTERM (which stops a
    run as Ctrl-C does) if it goes on, then SIGKILL; then whatever is left. A run that goes
    on is said, with what it said since the signal (its step lines left out)."""
    since = len(f.lines) if f is not None else 0
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        if sig != signal.SIGINT:
            NOT_STOPPED.append(f"{name}: still running {INTERRUPT_WAIT:g}s after "
                               f"{'SIGINT' if sig == signal.SIGTERM else 'SIGTERM'}")
            print(f"  note: {NOT_STOPPED[-1]}", flush=True)
            if f is not None:
                said = [x for _, x in f.lines[since:] if not STEP.search(x)]
                print("    it said since: " + (" / ".join(said[-8:]) or "nothing but step lines"), flush=True)
                since = len(f.lines)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(INTERRUPT_WAIT)
    kill_left(b)


def kill_left(b: Bench) -> None:
    """Bench.kill_tagged, again when a process ended between being found and being killed."""
    for _ in range(5):
        try:
            b.kill_tagged()
            return
        except psutil.Error:
            time.sleep(0.2)
    b.kill_tagged()


def pulled(b: Bench, name: str) -> bool:
    return any(p.name.rpartition("-")[2].isdigit() and int(p.name.rpartition("-")[2]) > 0
               for p in (b.cwd / "runs").glob(f"{name}-*/checkpoints/*"))


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {timeout:g}s: {what}")
        time.sleep(0.1)


def run_dir(b: Bench, name: str) -> Path:
    (d,) = [d for d in (b.cwd / "runs").iterdir() if d.is_dir() and d.name.startswith(name + "-")]
    return d


class Recovery:
    """Both sides of one scenario; each call one rep, returning seconds from kill to step."""

    def __init__(self, b: Bench, scenario: str, shared, spare, steps: int, warm: bool = False) -> None:
        self.b, self.scenario, self.shared, self.spare, self.steps = b, scenario, shared, spare, steps
        self.warm = warm            # `spare: warm`: the kill waits until h5's standby is ready
        self.standby: list[dict] = []   # what each ready standby cost while idle
        self.task = "worker:1" if scenario == "worker" else "worker:0"
        self.n = 0
        self.info: dict[str, list[dict]] = {"hand": [], "tfc": []}

    def _name(self, side: str) -> str:
        self.n += 1
        # unique across rows of one sitting: run_dir() finds a run by this name, and the
        # checkpoint directory is the cluster's (a warm row must not resume the cold row's)
        return f"r{self.scenario[0]}{'w' if self.warm else ''}{side}{self.n}"

    def _warm(self, f: Follower, name: str, by_hand: bool) -> None:
        """Until the lost host's task trains and (chief) a checkpoint past step 0 exists where
        the side will resume from: the launcher's copy, or the shared directory."""
        f.wait(rf"^{self.task}\s+│ step=", 300)
        if self.scenario != "chief":
            return
        if by_hand:
            ckpt = self.b.tmp / "remote" / name / "ckpt"
            wait_until(lambda: any(int(p.name[len("model.ckpt-"):-len(".index")]) > 0
                                   for p in ckpt.glob("model.ckpt-*.index")), 120, "a checkpoint in the model dir")
        else:
            wait_until(lambda: pulled(self.b, name), 120, "a checkpoint pulled to the launcher")

    def ours(self) -> float:
        b, name = self.b, self._name("t")
        lost = b.start_sshd([LOST])
        spec = recovery_spec(b, self.shared, lost, self.spare, name, self.scenario, by_hand=False,
                             steps=self.steps, warm=self.warm)
        proc, f = start_train(b, spec)
        try:
            self._warm(f, name, by_hand=False)
            if self.warm:
                self.standby.append(standby_cost(b, name))
                warm_state(b, name)
            at_kill = max(f.steps())
            t0, wall0 = time.monotonic(), time.time()
            kill_host(b, lost)
            if self.scenario == "chief":
                shutil.rmtree(b.tmp / "remote" / name / "ckpt")    # the chief's disk, gone with it
            i = f.wait(r"h4\b.*: moving \S.* to h5", 60)
            j = f.wait(rf"^{self.task}\s+│ step=", 300, i)
            took = f.lines[j][0] - t0
            run_step = max(f.steps(0, j + 1))     # the run's furthest step by then
            k = f.wait(r"resumed at step \d+", 60, i)
            for t, x in [(t, x) for t, x in f.lines[:j + 1] if t >= t0]:     # where a warm move's time went: the stop, the servers, each take
                if any(m in x for m in ("standby", "cold start", "held before the break", "ready on",
                                        "stopped by SIGTERM", "restoring")):
                    print(f"  {name} +{t - t0:.2f}s: {x.strip()}", flush=True)
        finally:
            interrupt(b, proc, name, f)
        doc = json.loads((run_dir(b, name) / "manifest.json").read_text())
        if "moves" not in doc:       # killed, not stopped: the line the run said instead
            said = re.search(r"resumed at step (\d+) \((\d+) step", f.lines[k][1])
            print(f"  note: {name}: no finished manifest (exit {proc.returncode}); steps from the run's "
                  f"line: {f.lines[k][1].strip()}", flush=True)
            self.info["tfc"].append({"at_kill": at_kill, "run_step": run_step, "lost": int(said.group(2)), "step_at": None, "resumed": int(said.group(1)),
                                     "decided": float("nan"), "started": float("nan")})
            return took
        (move,) = doc["moves"]
        assert move["to"] == "h5" and move["action"] == "restart", move
        self.info["tfc"].append({"at_kill": at_kill, "run_step": run_step, "lost": move["steps_lost"], "step_at": move["step_at"],
                                 "resumed": move["resumed_step"], "decided": move["at"] - wall0,
                                 "started": move["done_at"] - wall0})
        return took

    def baseline(self) -> float:
        b, name = self.b, self._name("h")
        lost = b.start_sshd([LOST])
        spec = recovery_spec(b, self.shared, lost, self.spare, name, self.scenario, by_hand=True,
                             steps=self.steps)
        proc, f = start_train(b, spec)
        proc2 = None
        try:
            self._warm(f, name, by_hand=True)
            at_kill = max(f.steps())
            t0 = time.monotonic()
            kill_host(b, lost)
            rc = proc.wait(120)
            failed = time.monotonic() - t0
            f.thread.join(10)
            # a script acts on any failed end that names the lost host: exit 3 (host lost) is
            # what tfcluster says, but exit 5 (the lost task's exit 255 judged first) was seen too
            if rc == 0 or not re.search(r"h4 lost: ", f.text()):
                raise RuntimeError(f"train exited {rc} without naming h4 lost:\n{f.text()[-3000:]}")
            last = max(f.steps())
            spec.write_text(moved_by_hand(spec.read_text()))
            down = subprocess.run(TFCLUSTER + ["down", str(spec)], env=b.env(), cwd=b.cwd, check=False,
                                  capture_output=True, text=True, timeout=120)
            if down.returncode:
                raise RuntimeError(f"down exited {down.returncode}: {down.stderr[-2000:]}")
            proc2, f2 = start_train(b, spec)
            j = f2.wait(rf"^{self.task}\s+│ step=", 300)
            took = f2.lines[j][0] - t0
            first = f2.steps()[0]
            k = f2.wait(r"restored \S+ at step=\d+", 10)
            restored = int(re.search(r"at step=(\d+)", f2.lines[k][1]).group(1))
        finally:
            interrupt(b, proc, name)
            if proc2 is not None:
                interrupt(b, proc2, name + " (again)")
        self.info["hand"].append({"lost": max(0, last - first), "at_kill": at_kill, "last": last, "first": first,
                                  "restored": restored, "lost_restored": max(0, last - restored),
                                  "failed": failed, "rc": rc})
        return took


def standby_cost(b: Bench, name: str, idle: float = 10.0) -> dict:
    """Once h5's standby said it is ready (its log): its RSS (and PSS, shared pages shared
    out) and its CPU over `idle` seconds of waiting, from /proc via psutil."""
    logs = lambda: list((b.tmp / "remote" / name / "runs").glob("*/standby-*.log"))  # noqa: E731
    wait_until(lambda: any("standby ready" in p.read_text(errors="replace") for p in logs()), 300,
               "h5's standby ready")
    said = next(p.read_text(errors="replace") for p in logs() if "standby ready" in p.read_text(errors="replace"))
    imported = float(re.search(r"imported in ([\d.]+)s", said).group(1))
    pid = next(int(json.loads(p.read_text())["pid"]) for p in (b.tmp / "remote" / name / "pids").glob("*standby*.pid"))
    proc = psutil.Process(pid)
    cpu0, t0 = proc.cpu_times(), time.monotonic()
    time.sleep(idle)           # the measurement's window, not a synchronisation
    cpu1, t1 = proc.cpu_times(), time.monotonic()
    mem = proc.memory_full_info()
    return {"import_s": imported, "rss_mb": mem.rss / 2**20, "pss_mb": mem.pss / 2**20,
            "cpu_pct": 100 * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / (t1 - t0)}


def warm_state(b: Bench, name: str, timeout: float = 300) -> None:
    """Until the run's warm state is whole, as it is for most of a long run: a standby ready for
    each script (the restart's own) besides h5's, and a held twin for each server, its import
    done (idle over a second). They are made once the run stepped; a kill while they still
    import measures their start-up, not a warm move."""
    rundir = b.tmp / "remote" / name
    scripts = 2                  # worker:0 and worker:1 (the layout of recovery_spec)
    servers = 3                  # ps:0, worker:0, worker:1

    def ready() -> bool:
        logs = list((rundir / "runs").glob("*/standby-*.log"))
        if sum("standby ready" in p.read_text(errors="replace") for p in logs) < 1 + scripts:
            return False
        twins = []
        for p in (rundir / "pids").glob("*.next.pid"):
            try:
                twins.append(psutil.Process(int(json.loads(p.read_text())["pid"])))
            except (OSError, ValueError, KeyError, psutil.Error):
                return False
        if len(twins) < servers:
            return False
        try:
            busy = [t.cpu_percent(None) for t in twins]
            time.sleep(1.0)      # the window the CPU is read over, not a synchronisation
            busy = [t.cpu_percent(None) for t in twins]
        except psutil.Error:
            return False
        return not busy or max(busy) < 10.0

    wait_until(ready, timeout, "every standby ready and every server's twin imported")


FAILED: list[str] = []           # reps that did not recover, with why (the row goes on)


def tolerant(fn, label: str):
    """One side's rep; a rep that fails is said and left out of the medians."""
    def run() -> float:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - said, counted, and the sitting goes on
            FAILED.append(f"{label}: {str(exc).splitlines()[0]}")
            print(f"  FAILED rep, {FAILED[-1]}", flush=True)
            return float("nan")
    return run


def recovery_rows(b: Bench, scenario: str, reps: int, shared, spare) -> None:
    # the template saves every steps/10 (and on SIGTERM): the chief's row needs saves while it
    # runs (about every 10 s here); the worker's row trains on past any recovery
    warm = scenario.endswith("-warm")
    scenario = scenario.removesuffix("-warm")
    r = Recovery(b, scenario, shared, spare, 20_000 if scenario == "chief" else 10_000_000, warm=warm)
    ra, rb = alternate(reps, tolerant(r.baseline, f"{scenario} script"), tolerant(r.ours, f"{scenario} tfcluster"))
    ra, rb = [x for x in ra if not math.isnan(x)], [x for x in rb if not math.isnan(x)]
    if not ra or not rb:
        print(f"recovery {scenario}: no rep of one side recovered: {FAILED}", flush=True)
        return
    what = "a plain worker's host" if scenario == "worker" else "the chief's host, train.checkpoint"
    report(f"recovery {scenario}{' warm' if warm else ''} (kill -> first step of {r.task})",
           "script: fail, rewrite, down, train", ra,
           "tfcluster: every task restarted" + (", h5 a warm spare" if warm else ""), rb, "s",
           1.0, prec=2)
    for cost in r.standby:
        print(f"  h5's standby while idle: TensorFlow imported in {cost['import_s']:.1f}s, RSS {cost['rss_mb']:.0f} MB "
              f"(PSS {cost['pss_mb']:.0f} MB), CPU {cost['cpu_pct']:.2f}% of a core", flush=True)
    hand, tfc = r.info["hand"], r.info["tfc"]
    print(f"  {what} lost: steps lost, tfcluster (the manifest's steps_lost, max(0, step_at - resumed_step)): "
          f"{[x['lost'] for x in tfc]} (step_at {[x['step_at'] for x in tfc]}, resumed {[x['resumed'] for x in tfc]})")
    print(f"  steps lost, script (max(0, last step the old run printed - first the new one printed)): "
          f"{[x['lost'] for x in hand]}; against the step it restored: {[x['lost_restored'] for x in hand]} "
          f"(printed last before the kill {[x['at_kill'] for x in hand]}, old run's last {[x['last'] for x in hand]}, "
          f"new run restored {[x['restored'] for x in hand]}, printed first {[x['first'] for x in hand]})")
    print(f"  the run's furthest step, tfcluster: {[x['at_kill'] for x in tfc]} before the kill, "
          f"{[x['run_step'] for x in tfc]} at the moved task's first step; script: {[x['at_kill'] for x in hand]} "
          f"before the kill, {[x['first'] for x in hand]} at the new run's first step")
    print(f"  tfcluster's manifest, from the kill: decided {fmt_list([x['decided'] for x in tfc])}, "
          f"new tasks started {fmt_list([x['started'] for x in tfc])}; the script's first run exited 3 after "
          f"{fmt_list([x['failed'] for x in hand])} (exit codes {[x['rc'] for x in hand]})", flush=True)


def fmt_list(xs: list[float]) -> str:
    xs = [x for x in xs if not math.isnan(x)] or [float("nan")]
    med, lo, hi = stats(xs)
    return f"{med:.2f} s [{lo:.2f}-{hi:.2f}]"


def keepalive_rows(b: Bench, reps: int, steps: int) -> None:
    sshd = b.start_sshd(list(KEEP_HOSTS))
    n = [0]

    def side(keepalive: bool):
        def run() -> float:
            n[0] += 1
            p = free_ports(3)
            spec = b.tmp / f"keep{n[0]}.yaml"
            spec.write_text(
                f"name: keep{n[0]}\npython: {sys.executable}\nworkdir: {b.tmp / 'remote'}\n"
                f"ssh:\n  port: {sshd.port}\n  connect_timeout: 5\n"
                f"hosts:\n  - {{name: a, address: {KEEP_HOSTS[0]}}}\n  - {{name: c, address: {KEEP_HOSTS[1]}}}\n"
                f"jobs:\n  ps: {{tasks: ['a:{p[0]}']}}\n  worker: {{tasks: ['a:{p[1]}', 'c:{p[2]}']}}\n"
                f"train:\n  mode: between-graph\n  script: template:between_graph\n"
                f"  args: ['--steps', '{steps}', '--log_every', '50', '--cleanup_timeout', '10']\n")
            proc, f = start_train(b, spec, wrapper=True, BENCH_KEEPALIVE="on" if keepalive else "off")
            try:
                rc = proc.wait(600)
                f.thread.join(10)
            finally:
                interrupt(b, proc)
            text = f.text()
            if rc:
                raise RuntimeError(f"train exited {rc}:\n{text[-3000:]}")
            assert ("bench: keepalive off" in text) != keepalive, "the wrapper did not do its part"
            pts = [(t, int(m.group(2))) for t, x in f.lines if (m := STEP.search(x))]
            (t1, g1), (t2, _) = pts[0], pts[-1]
            return (max(g for _, g in pts) - g1) / (t2 - t1)
        return run

    ra, rb = alternate(reps, side(False), side(True))
    report(f"recovery keepalive ({steps} steps, steady-state, 2 SSH hosts)", "keepalive off (Watch replaced)",
           ra, "keepalive as shipped", rb, "steps/s", KEEPALIVE_TARGET, higher_is_better=True, prec=1)


def main(argv=None) -> int:
    p = parser(__doc__, reps=3)
    p.add_argument("--only", default="worker,chief,keepalive",
                   help="comma-separated rows: worker, worker-warm, chief, chief-warm (h5 a warm spare), keepalive")
    p.add_argument("--steps", type=int, default=2000, help="the keepalive row's steps")
    a = p.parse_args(argv)
    reps = 1 if a.smoke else a.reps
    rows = ["worker"] if a.smoke else a.only.split(",")
    with Bench("recovery") as b:
        print(f"recovery: {reps} reps, rows {', '.join(rows)}; load average {os.getloadavg()[0]:.1f}", flush=True)
        shared = spare = None
        if {"worker", "chief", "worker-warm", "chief-warm"} & set(rows):
            shared = b.start_sshd(list(SHARED))
            spare = b.start_sshd([SPARE])
        for scenario in ("worker", "worker-warm", "chief", "chief-warm"):
            if scenario in rows:
                recovery_rows(b, scenario, reps, shared, spare)
                print(f"  load average {os.getloadavg()[0]:.1f}", flush=True)
        if "keepalive" in rows:
            keepalive_rows(b, reps, a.steps)
            print(f"  load average {os.getloadavg()[0]:.1f}", flush=True)
        if FAILED:
            print(f"reps that failed: {len(FAILED)}: {FAILED}", flush=True)
        if ESCAPED:
            print(f"kills that found processes outside the sshd's tree: {len(ESCAPED)}", flush=True)
        if NOT_STOPPED:
            print(f"runs Ctrl-C did not stop: {len(NOT_STOPPED)}: {NOT_STOPPED}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
