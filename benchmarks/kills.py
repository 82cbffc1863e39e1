"""Is a host killed outright always judged lost? N `tfcluster train` runs on a bed of separate
hosts (tests/netns.py: each host a network + PID + mount namespace with its own sshd), each
killing the host that holds ps:0 and worker:1 mid-run, for real (every process of the host
SIGKILLed at once, then its link down), and recording how the run judged it.

The bug this hunts (a race): "a host killed outright is sometimes not judged lost: exit 5,
`ps:0 server on h2 failed with exit code 255`, hint train.restart, manifest `hosts_lost: {}`".
Target: every kill judged lost (docs/design/host-loss.md, "Lost, dropped, silent").

  * --scenario fail (default, the cheapest): hosts h2 (ps:0, worker:1) and h3 (worker:0, the
    chief), `on_host_loss: fail`, a run that never finishes by itself. Judged lost: exit 3, the
    error names `h2 lost: ...`, the manifest's `hosts_lost` names h2, no task failure (exit 5).
  * --scenario spare: the same with h4 a spare, a checkpoint (`--model_dir`, train.checkpoint)
    and `on_host_loss: spare`. Judged lost: `h2 lost: ...` said, `hosts_lost` names h2, one
    move from h2 to h4, and the run finishes, exit 0.

Each rep makes its own bed (bridge, namespaces, sshds), kills h2 after the k-th `worker:1 ...
step=` line (k cycles through 1, 2, 3, 5, 8) plus a random 0-0.5 s (`--seed`), since the bug
is a race; and ends with the bed closed and no tagged process left (tests/helpers.py's
`tagged_processes`), Ctrl-C included. Needs root, ip(8), nft(8), unshare, nsenter, sshd.

`--kill namespace` (default) is the bed's kill: the kernel kills every process of the host at
once. `--kill tasks-first` kills the host's shims and tasks 0.2 s before the rest of it, as when
a host's processes die one by one: its sshd, still up, closes their channels before its
connections end (the case that was judged "back", not lost; README, "Kills").

    python benchmarks/kills.py [--reps 30] [--scenario fail|spare] [--kill namespace|tasks-first]
                               [--seed 1] [--keep-logs DIR] [--smoke]

Prints one row per rep, then `judged lost: N/REPS`; exits 1 when any rep was misjudged.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from _common import compile_launcher, keygen, parser

# tests/ is a plain package: the bed and the session marker come from there, as the tests use them
from tests.helpers import SESSION_VAR, tagged_processes  # noqa: E402  (sets the session marker)
from tests import netns  # noqa: E402

PORTS = (25100, 25101, 25102)        # each bed host has its own ports
STEP_LINES = (1, 2, 3, 5, 8)         # kill after the k-th `worker:1 ... step=` line
START_TIMEOUT = 240.0                # the run's first step lines (TF's start on a loaded machine)
TASKS_FIRST_GAP = 0.2                # --kill tasks-first: the tasks' death to the host's
END_TIMEOUT = {"fail": 120.0, "spare": 300.0}   # the kill to the run's exit


@dataclass
class Rep:
    n: int
    k: int
    jitter: float
    rc: int | None = None
    named: bool = False              # the run's output names `h2 lost: ...`
    error_named: bool = False        # fail: the error line; spare: the move line
    hosts_lost: list[str] = field(default_factory=list)
    moves: list[str] = field(default_factory=list)
    exit5: bool = False              # a task failure: `... failed with exit code N`, exit 5
    kill_to_lost: float | None = None        # the kill to the `h2 lost:` line, in the live output
    kill_to_noticed: float | None = None     # the kill to the manifest's `noticed`
    kill_to_exit: float | None = None
    failure: str = ""                # the task-failure line, when there was one
    note: str = ""
    output: str = ""                 # the run's whole output, kept when misjudged

    def judged(self, scenario: str) -> bool:
        if self.exit5 or not self.named or "h2" not in self.hosts_lost:
            return False
        if scenario == "fail":
            return self.rc == 3 and self.error_named
        return self.rc == 0 and self.moves == ["h2->h4"]


def spec_text(tmp: Path, bed: netns.Bed, name: str, scenario: str) -> str:
    h2, h3 = bed.add("h2"), bed.add("h3")
    hosts = f"  - {h2.spec()}\n  - {h3.spec()}\n"
    args = ["--log_every", "50", "--cleanup_timeout", "3"]
    train = ""
    if scenario == "spare":
        hosts += f"  - {bed.add('h4').spec(spare='true')}\n"
        args += ["--steps", "2500", "--model_dir", "{workdir}/ckpt"]
        train = "  checkpoint: {dir: '{workdir}/ckpt', keep: 2, sync: 2s}\n  on_host_loss: spare\n"
    else:
        args += ["--steps", "5000000"]
        train = "  on_host_loss: fail\n"
    return (f"name: {name}\npython: {sys.executable}\nworkdir: {tmp / 'remote'}\n"
            f"ssh: {{connect_timeout: 5}}\nhosts:\n{hosts}"
            f"jobs:\n  ps: {{tasks: ['h2:{PORTS[0]}']}}\n"
            f"  worker: {{tasks: ['h3:{PORTS[1]}', 'h2:{PORTS[2]}']}}\n"
            f"train:\n  mode: between-graph\n  script: template:between_graph\n"
            f"  args: [{', '.join(repr(a) for a in args)}]\n{train}")


class Lines:
    """The run's output, read by a thread, each line with the time.monotonic() it came."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines = proc, []
        self._cond = threading.Condition()
        self._eof = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append((time.monotonic(), line))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_for(self, pattern: str, count: int, timeout: float) -> None:
        """Until the `count`-th line matching `pattern`."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while sum(1 for _, ln in self.lines if regex.search(ln)) < count:
                if self._eof:
                    raise RuntimeError(f"the run ended before {count} line(s) matching {pattern!r}:\n"
                                       + "".join(ln for _, ln in self.lines[-40:]))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"no {count} line(s) matching {pattern!r} within {timeout:g}s:\n"
                                       + "".join(ln for _, ln in self.lines[-40:]))
                self._cond.wait(min(left, 1.0))

    def first(self, pattern: str, after: float) -> float | None:
        regex = re.compile(pattern)
        with self._cond:
            return next((t for t, ln in self.lines if t >= after and regex.search(ln)), None)

    def text(self) -> str:
        with self._cond:
            return "".join(ln for _, ln in self.lines)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def open_bed(root: Path, user_key: Path, known_hosts: Path) -> netns.Bed:
    """What tests/netns.py's `bed` fixture does, without pytest: a free /24's bridge, its
    address; hosts come with `bed.add`. The caller releases it (Bed.release)."""
    index, bridge, lock = netns._new_bridge()
    d = root / f"bed{index}-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir()
    shutil.copyfile(user_key.with_suffix(".pub"), d / "authorized_keys")
    bed = netns.Bed(d, user_key, known_hosts, index, bridge, lock=lock)
    try:
        netns._ip("addr", "add", f"{bed.prefix}.1/24", "dev", bridge)
        netns._ip("link", "set", bridge, "up")
    except BaseException:
        bed.release()
        raise
    return bed


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def no_tagged_left(timeout: float) -> dict[int, str]:
    """Wait for no tagged process of this session; SIGKILL what is left then; what was left."""
    deadline = time.monotonic() + timeout
    while (left := tagged_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left


def below_sshd(host: netns.BedHost) -> list[int]:
    """The host's processes that are not its sshds (shims, tasks, shells)."""
    found = []
    for pid in host.pids():
        try:
            with open(f"/proc/{pid}/comm") as f:
                if not f.read().startswith("sshd"):
                    found.append(pid)
        except OSError:
            continue
    return found


def kill_host(bed: netns.Bed, name: str, how: str) -> None:
    """`namespace`: the bed's kill (the PID namespace's init SIGKILLed: the kernel kills every
    process of the host at once, no process of it runs again), then its link down.
    `tasks-first`: every process of the host but its sshds (the shims, the tasks) SIGKILLed
    TASKS_FIRST_GAP s before the rest of it, as when a host's processes die one by one: its
    sshd, still up for that moment, closes their channels (an exit-signal, no exit status)
    before its connections end."""
    if how == "tasks-first":
        for pid in below_sshd(bed.hosts[name]):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(TASKS_FIRST_GAP)
    bed.kill(name)


def one_rep(rep: Rep, scenario: str, tmp: Path, home: Path, key: Path, env: dict, mark: str,
            how: str = "namespace") -> None:
    d = tmp / f"rep{rep.n}"
    cwd = d / "cwd"
    cwd.mkdir(parents=True)
    known_hosts = home / ".ssh" / "known_hosts"
    known_hosts.write_text("")            # every bed reuses the addresses, with new host keys
    known_hosts.chmod(0o600)
    bed = proc = None
    try:
        bed = open_bed(d, key, known_hosts)
        spec = d / "kills.yaml"
        spec.write_text(spec_text(d, bed, f"kl{mark}r{rep.n}", scenario))
        proc = subprocess.Popen([sys.executable, "-m", "tfcluster", "train", str(spec)], cwd=cwd, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        lines = Lines(proc)
        lines.wait_for(r"worker:1 .*step=", rep.k, START_TIMEOUT)
        time.sleep(rep.jitter)
        killed_wall, killed = time.time(), time.monotonic()
        kill_host(bed, "h2", how)
        try:
            proc.wait(END_TIMEOUT[scenario])
        except subprocess.TimeoutExpired:
            rep.note = f"still running {END_TIMEOUT[scenario]:g}s after the kill: killed"
            kill_group(proc)
        lines.join(10)
        rep.rc = proc.returncode
        rep.kill_to_exit = time.monotonic() - killed
        out = lines.text()
        lost_at = lines.first(r"\bh2 lost: ", killed)
        rep.named = lost_at is not None
        rep.kill_to_lost = None if lost_at is None else lost_at - killed
        if scenario == "fail":
            rep.error_named = re.search(r"tfcluster: error: h2 lost: ", out) is not None
        else:
            rep.error_named = re.search(r"h2: moving .*\bto h4\b", out) is not None
        failed = re.search(r"^.*failed with exit code \d+.*$", out, re.MULTILINE)
        rep.exit5 = rep.rc == 5 or failed is not None
        rep.failure = failed.group(0).strip() if failed else ""
        runs = [p for p in (cwd / "runs").glob("*/manifest.json")] if (cwd / "runs").is_dir() else []
        if runs:
            doc = json.loads(runs[0].read_text())
            lost = doc.get("hosts_lost") or {}
            rep.hosts_lost = sorted(lost)
            if "h2" in lost and lost["h2"].get("noticed"):
                rep.kill_to_noticed = lost["h2"]["noticed"] - killed_wall
            rep.moves = [f"{m.get('host')}->{m.get('to')}" for m in doc.get("moves") or []]
        else:
            rep.note = (rep.note + "; " if rep.note else "") + "no manifest"
        if not rep.judged(scenario):
            rep.output = out
            rep.note = (rep.note + "; " if rep.note else "") + "output tail: " + " | ".join(
                ln.strip() for ln in out.strip().splitlines()[-8:])
    finally:
        if proc is not None:
            kill_group(proc)
        if bed is not None:
            bed.release()
        left = no_tagged_left(30)
        if left:
            rep.note = (rep.note + "; " if rep.note else "") + f"tagged processes left: {sorted(left.values())}"


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv=None) -> int:
    p = parser(__doc__, reps=30)
    p.add_argument("--scenario", choices=("fail", "spare"), default="fail")
    p.add_argument("--kill", choices=("namespace", "tasks-first"), default="namespace",
                   help="how the host dies (default: every process at once, the bed's kill)")
    p.add_argument("--seed", type=int, default=1, help="the kill moments' jitter")
    p.add_argument("--keep-logs", metavar="DIR", help="write each misjudged rep's whole output here")
    a = p.parse_args(argv)
    reps = 1 if a.smoke else a.reps
    why = netns._unavailable()
    if why:
        print(f"kills: cannot run: {why}", flush=True)
        return 2
    compile_launcher()
    rng = random.Random(a.seed)
    mark = uuid.uuid4().hex[:6]
    tmp = Path(tempfile.mkdtemp(prefix="tfcb-kills-"))
    home = tmp / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    key = home / ".ssh" / "id_ed25519"
    keygen(key)
    env = {**os.environ, "HOME": str(home), "NO_COLOR": "1", "COLUMNS": "200",
           "TFCLUSTER_SSH_SYSTEM_CONFIG": "", SESSION_VAR: os.environ[SESSION_VAR]}
    env.pop("SSH_AUTH_SOCK", None)
    added = netns._ip("route", "add", "blackhole", netns.RANGE, check=False).returncode == 0

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    done: list[Rep] = []
    print(f"kills: {reps} reps, scenario {a.scenario}, host h2 (ps:0, worker:1) killed ({a.kill}) after the k-th "
          f"`worker:1 ... step=` line (k in {STEP_LINES}) + 0-0.5 s; seed {a.seed}", flush=True)
    try:
        for n in range(1, reps + 1):
            rep = Rep(n, STEP_LINES[(n - 1) % len(STEP_LINES)], round(rng.uniform(0, 0.5), 2))
            try:
                one_rep(rep, a.scenario, tmp, home, key, env, mark, a.kill)
            except (RuntimeError, AssertionError, subprocess.SubprocessError) as e:
                rep.note = (rep.note + "; " if rep.note else "") + f"rep failed: {str(e)[-1500:]}"
            done.append(rep)
            ok = rep.judged(a.scenario)
            print(f"  rep {n}/{reps}: k={rep.k} +{rep.jitter:.2f}s exit={rep.rc} lost-line={'y' if rep.named else 'n'} "
                  f"hosts_lost={rep.hosts_lost} kill->lost={fmt_s(rep.kill_to_lost)}s "
                  f"{'judged lost' if ok else 'MISJUDGED'}"
                  + (f" [{rep.failure}]" if rep.failure else "") + (f" ({rep.note})" if rep.note else ""),
                  flush=True)
            if not ok and a.keep_logs:
                Path(a.keep_logs).mkdir(parents=True, exist_ok=True)
                (Path(a.keep_logs) / f"kills-{mark}-rep{n}.log").write_text(rep.output)
    except KeyboardInterrupt:
        print("kills: interrupted; every bed closed", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if added:
            netns._ip("route", "delete", "blackhole", netns.RANGE, check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    report(done, a.scenario)
    left = tagged_processes()
    print(f"cleanup: no process of this benchmark survives ({len(left)} tagged process(es) left; "
          f"{len(done)} bed(s) closed)" if not left else f"cleanup: FAILED, tagged processes left: {left}", flush=True)
    judged = sum(r.judged(a.scenario) for r in done)
    return 0 if done and judged == len(done) == reps and not left else 1


def report(done: list[Rep], scenario: str) -> None:
    if not done:
        return
    print(f"\n{'rep':>3} {'k':>2} {'+s':>5} {'exit':>4} {'lost line':>9} {'error/move':>10} {'hosts_lost':>10} "
          f"{'exit 5':>6} {'kill->noticed':>13} {'kill->lost':>10} {'kill->exit':>10}  verdict")
    for r in done:
        print(f"{r.n:>3} {r.k:>2} {r.jitter:>5.2f} {str(r.rc):>4} {'yes' if r.named else 'no':>9} "
              f"{'yes' if r.error_named else 'no':>10} {','.join(r.hosts_lost) or '{}':>10} "
              f"{'yes' if r.exit5 else 'no':>6} {fmt_s(r.kill_to_noticed):>13} {fmt_s(r.kill_to_lost):>10} "
              f"{fmt_s(r.kill_to_exit):>10}  {'judged lost' if r.judged(scenario) else 'MISJUDGED'}")
    for r in done:
        if not r.judged(scenario):
            print(f"  rep {r.n} misjudged: {r.failure or ''} {r.note}")
    times = [r.kill_to_lost for r in done if r.kill_to_lost is not None]
    if times:
        print(f"kill -> `h2 lost` line: median {statistics.median(times):.2f} s (min {min(times):.2f}, "
              f"max {max(times):.2f}, n={len(times)})")
    judged = sum(r.judged(scenario) for r in done)
    print(f"judged lost: {judged}/{len(done)}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
