"""What a run leaves on this machine: runs/<run id>/ with each task's log,
manifest.json and progress.tsv, and reading them back (`tfcluster logs`, `runs`, `plot`).

manifest.json says `"outcome": "running"` with the writer's pid (and its start time) from
the start of a run until `finish` writes the outcome: a run is live while that says
running and that process still lives (a tfcluster killed with SIGKILL never finishes it).
progress.tsv has one line per progress line of a script (a step or a loss; each Keras bar
update that reached the watchers), as it reached this machine:
`<unix time>\t<task>\t<step or ->\t<loss or ->`; the saved logs have no times, so
steps per second come from here."""
from __future__ import annotations

import collections
import json
import os
import re
import stat
import threading
import time
from dataclasses import replace

from tfcluster.errors import TfclusterError, UsageError, did_you_mean
from tfcluster.localfs import (
    NOFOLLOW,
    open_saved,
    private_dir,
    read_saved,
    saved_lines,
    write_private,
)
from tfcluster.plan import JOB_NAMES, Plan, plan_to_dict
from tfcluster.plan.names import is_run_of, key_of_log, log_file
from tfcluster.ui.units import size
from tfcluster.watch.metrics import KERAS_LOSS_NOTE, MWMS_SUMS, Tracker, keras_said, target_of

PROGRESS_FILE = "progress.tsv"
CHECKPOINTS_DIR = "checkpoints"     # runs/<run id>/checkpoints/<name>/: one checkpoint each
_STEP = re.compile(r"-(\d+)$")
MANIFEST_CAP = 64 << 20     # bytes: a plan of thousands of tasks, with room to spare


class Manifest:
    """runs/<run id>/manifest.json: spec hash, plan (secrets redacted), per-task outcome
    (per process: `started` its first attempt, `last_restart` its last restart or null)."""

    def __init__(self, plan: Plan, run_id: str, directory: str) -> None:
        self.plan = plan
        self.run_id = run_id
        self.path = os.path.join(directory, "manifest.json")
        self.started = time.time()
        private_dir(directory, "runs", top=os.path.dirname(directory))
        self._write({"outcome": "running", "pid": os.getpid(), "pid_start": _start_ticks(os.getpid())})

    def finish(self, procs, outcome: tuple[int, str], checks: dict[str, str] | None = None,
               progress: dict | None = None, hosts_lost: dict | None = None,
               moves: list | None = None, checkpoints: list | None = None,
               notices: list | None = None) -> None:
        """`hosts_lost`: host -> how it was found lost, its tasks, when (launch/cluster/hostloss.py);
        `moves`: each host given up and what the run did (launch/run/moves.py); `checkpoints`:
        each checkpoint copied here, {name, step, bytes, at} (launch/run/ckptsync.py);
        `notices`: each warning that a host was about to go, and what the run did
        (launch/run/notices.py)."""
        tasks = {}
        for p in procs:
            entry = tasks.setdefault(p.task.key, {"host": p.task.host})
            entry[p.role] = {"exit_code": p.exit_code, "restarts": p.restarts,
                             "started": p.started, "last_restart": p.restarted, "ended": p.ended}
            if p.host_lost:                         # counted apart from the restarts
                entry["host_lost"] = p.host_lost
        self._write({"outcome": outcome[1], "exit_code": outcome[0], "ended": time.time(),
                     "tasks": tasks, "checks": checks or {}, "progress": progress or {},
                     "hosts_lost": hosts_lost or {}, "moves": moves or [], "checkpoints": checkpoints or [],
                     "notices": notices or []})

    def _write(self, extra: dict) -> None:
        doc = {"run_id": self.run_id, "cluster": self.plan.name, "mode": self.plan.mode,
               "spec_sha256": self.plan.spec_digest, "started": self.started,
               "script": self.plan.script, **extra, "plan": plan_to_dict(self.plan, redact=True)}
        try:
            write_private(self.path, json.dumps(doc, indent=2).encode())
        except OSError as e:     # a full disk: one line naming the file, never a traceback
            raise TfclusterError(f"cannot write {self.path}: {e.strerror or e}") from None


def judge(runs_dir: str) -> None:
    """runs/ judged as `train` judges it before anything in it is read: owned by this user
    (or root) and writable by no one else, else PreflightError (exit 4) naming it; a
    runs/ that is not there, or is a plain file (the listing says so, exit 2), is left so."""
    if os.path.islink(runs_dir) or os.path.isdir(runs_dir):
        private_dir(runs_dir, "runs", top=runs_dir)


def run_dirs(runs_dir: str, name: str) -> list[str]:
    """This cluster's saved runs, oldest first (only its own: not those of `name-x`), from
    a runs/ judged first."""
    judge(runs_dir)
    try:
        entries = os.listdir(runs_dir)
    except FileNotFoundError:
        return []
    except OSError as e:     # a file, or another user's directory
        raise UsageError(f"runs directory {runs_dir}: cannot list it: {e.strerror}",
                         hint="--runs-dir names the directory `train` saved the runs in") from None
    runs = sorted(e for e in entries if is_run_of(name, e)
                  and os.path.lexists(os.path.join(runs_dir, e, "manifest.json")))
    return _by_start(runs_dir, runs)


def _by_start(runs_dir: str, runs: list[str]) -> list[str]:
    """Run ids (sorted) in the order they started: an id holds the second, and its last part is
    random, so runs of one second are put in order by their manifests' `started`."""
    second = {r: r[:-5] for r in runs}
    tied = {s for s, n in collections.Counter(second.values()).items() if n > 1}
    if not tied:
        return runs

    def started(run: str) -> float:
        value = read_manifest(os.path.join(runs_dir, run)).get("started")
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0
    return sorted(runs, key=lambda r: (second[r], started(r) if second[r] in tied else 0.0, r))


def pick_run(runs_dir: str, name: str, run: str | None) -> str:
    """The run id asked for (the latest when None); UsageError naming what there is."""
    runs = run_dirs(runs_dir, name)
    if not runs:
        raise UsageError(f"no saved runs of cluster {name!r} under {runs_dir}/")
    if run is None:
        return runs[-1]
    if run not in runs:
        raise UsageError(f"no run {run!r} under {runs_dir}/ (latest: {runs[-1]})")
    private_dir(os.path.join(runs_dir, run), "runs", top=runs_dir)
    return run


def task_logs(directory: str, run: str, task: str | None = None) -> list[str]:
    """The task keys with a saved log in the run (only `task` when given: a task's server
    beside its script, `worker:1.server`, too, as the summary names it)."""
    # only task logs: another file's name would land in every line's prefix
    every = sorted(k for k in (key_of_log(n, servers=True) for n in os.listdir(directory))
                   if k is not None and k.split(":")[0] in JOB_NAMES)
    if task is None:
        return [k for k in every if not k.endswith(".server")]
    if task not in every:
        raise UsageError(f"run {run} has no log for {task} (has: {', '.join(every) or 'none'})"
                         + did_you_mean(task, every))
    return [task]


def read_manifest(directory: str, warn=None) -> dict:
    """The run's manifest ({} when unreadable: a run is listed whatever its state); one
    that is no regular file, or too large, is not read, and `warn` is told why."""
    path = os.path.join(directory, "manifest.json")
    try:
        doc = json.loads(read_saved(path, MANIFEST_CAP))
    except FileNotFoundError:
        return {}
    except OSError as e:
        refused(warn, path, e)
        return {}
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def refused(warn, path: str, e: OSError) -> None:
    """One line naming a saved file that was not read, and why."""
    if warn is not None:
        warn(f"{path}: {e.strerror or e}; skipped")


def step_of(name: str) -> int | None:
    """A checkpoint's step when its name ends in -N (ckpt-30, model.ckpt-17000)."""
    m = _STEP.search(name)
    return int(m.group(1)) if m else None


def kept_checkpoints(directory: str) -> list[dict]:
    """The checkpoints a run kept here (launch/run/ckptsync.py), oldest copy first: {name, step,
    bytes, path, at}; `at` is when it was copied. Only directories count (no link is
    followed); a name starting with "." is a copy still being written."""
    root = os.path.join(directory, CHECKPOINTS_DIR)
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if name.startswith(".") or not stat.S_ISDIR(st.st_mode):
                continue
            size = sum(os.lstat(os.path.join(path, f)).st_size for f in os.listdir(path) if f != "checkpoint")
        except OSError:                  # removed meanwhile (only the newest are kept)
            continue
        found.append({"name": name, "step": step_of(name), "bytes": size, "path": path, "at": st.st_mtime})
    return sorted(found, key=lambda c: (c["at"], c["name"]))


def show_checkpoints(ui, directory: str) -> None:
    """`logs`: one line per checkpoint the run kept (on stderr, beside the logs)."""
    for c in kept_checkpoints(directory):
        step = "" if c["step"] is None else f"step {c['step']}, "
        ui.info(f"checkpoint {c['name']} ({step}{size(c['bytes'])}): {c['path']}")


def run_state(doc: dict) -> str:
    """The manifest's outcome; a `running` one whose tfcluster is gone is `died`."""
    outcome = doc.get("outcome")
    if not isinstance(outcome, str):
        return "unknown"
    if outcome != "running":
        return outcome
    pid = doc.get("pid")
    if not isinstance(pid, int):
        return "running?"           # written before runs recorded their pid
    recorded = doc.get("pid_start")      # None where /proc was not there to read it
    alive = _start_ticks(pid) == recorded if recorded is not None else _pid_exists(pid)
    return "running" if alive else "died"


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None: no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ProgressLog:
    """Records every progress line's arrival (progress.tsv) and keeps each task's latest
    step, loss and rate for the summary and the manifest. `on_line` is LogMux's watch
    callback (called from the pump threads)."""

    def __init__(self, plan: Plan, directory: str, save_failed=None) -> None:
        self.path = os.path.join(directory, PROGRESS_FILE)
        self._save_failed = save_failed     # (path, OSError): a write failed (a full disk)
        targets = {t.key: target_of(plan.progress, t.argv[1:]) for t in plan.tasks if t.runs_script}
        self.tracker = Tracker(plan.progress, targets=targets)
        # where tf_keras's bars sum the loss over the workers (the loss note says why it is read
        # at each epoch's end): MultiWorkerMirroredStrategy, in mode mirrored with two or more
        self._sums = plan.mode == "mirrored" and plan.legacy_keras and len(targets) > 1
        # the summary's last loss line: a line the run's loss pattern finds, as shown (str)
        self._loss_line = re.compile(self.tracker.loss.regex.pattern.decode())
        self._lock = threading.Lock()
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | NOFOLLOW, 0o600)

    def watch(self, other=None) -> tuple:
        """LogMux's `watch`: this log's markers and callback, and `other`'s (markers,
        callback) if given, each called only for the lines with its own markers."""
        mine = self.tracker.markers
        if other is None:
            return mine, self.on_line
        theirs, callback = other

        def both(key: str, line: bytes) -> None:
            if any(m in line for m in theirs):
                callback(key, line)
            if any(m in line for m in mine):
                self.on_line(key, line)
        return tuple(theirs) + mine, both

    def on_line(self, key: str, line: bytes) -> None:
        if key.endswith(".server"):
            return
        now = time.time()
        with self._lock:
            said = self.tracker.feed(key, line, now)
            if said is None or (said.step is None and said.loss is None):
                return          # nothing, or only Keras' `Epoch k/N`
            if self._fd is not None:
                try:
                    os.write(self._fd, f"{now:.3f}\t{key}\t{'-' if said.step is None else said.step}\t"
                                       f"{'-' if said.loss is None else repr(said.loss)}\n".encode())
                except OSError as e:     # a full disk: stop recording, say so once
                    os.close(self._fd)
                    self._fd = None
                    if self._save_failed is not None:
                        self._save_failed(self.path, e)

    def states(self) -> dict:
        """task -> a copy of its metrics.TaskProgress (its last 16 samples), taken under
        the lock: for a reader on another thread (the live footer)."""
        with self._lock:
            return {key: replace(t, samples=collections.deque(list(t.samples)[-16:], maxlen=16),
                                 metrics=dict(t.metrics))
                    for key, t in self.tracker.tasks.items()}

    def summary(self) -> dict:
        """task -> {step, loss, steps_per_s, target, epoch, epochs, fit, metrics}, for the
        manifest (epoch, epochs: Keras' `Epoch k/N`, else None; fit: which `model.fit` of
        the script; metrics: Keras' others)."""
        with self._lock:
            return {key: {"step": t.step, "loss": t.loss, "target": t.target,
                          "steps_per_s": None if t.steps_per_s is None else round(t.steps_per_s, 3),
                          "epoch": t.epoch, "epochs": t.epochs, "fit": t.fit, "metrics": dict(t.metrics)}
                    for key, t in self.tracker.tasks.items()}

    def last_said(self, key: str, mux) -> str:
        """`train`'s summary's last loss line of `key`: a Keras script's fit, epoch, loss and
        metrics; else the latest line `mux` kept of it that the run's loss pattern finds
        (`train.progress.loss` or `loss=X`); else, when that line is no longer kept, the
        loss that pattern read last. "" when it read none."""
        with self._lock:
            got = self.tracker.tasks.get(key)
            got = None if got is None else replace(got, metrics=dict(got.metrics))
        if got is None:
            return ""
        said = keras_said(got) or (mux.last_line_matching(key, self._loss_line) or "").replace("tfcluster-result: ", "")
        return said or ("" if got.loss is None else f"loss {got.loss:.4g}")

    def loss_note(self) -> str | None:
        """The one line on what a Keras loss is, for a run where a script trained with `fit`."""
        with self._lock:
            keras = any(t.epoch is not None for t in self.tracker.tasks.values())
        if not keras or self.tracker.custom_loss:
            return None
        return KERAS_LOSS_NOTE + (MWMS_SUMS if self._sums else "")

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_progress(directory: str, warn=None) -> dict[str, list[tuple[float, int]]]:
    """progress.tsv as task -> [(time, step)] of the lines that gave a step ({} without one)."""
    out: dict[str, list[tuple[float, int]]] = {}
    path = os.path.join(directory, PROGRESS_FILE)
    try:
        f = open_saved(path)
    except FileNotFoundError:
        return out
    except OSError as e:
        refused(warn, path, e)
        return out
    with f:
        for line in saved_lines(f):
            parts = line.split(b"\t")
            if len(parts) == 4 and parts[2] != b"-":
                try:
                    out.setdefault(parts[1].decode(), []).append((float(parts[0]), int(parts[2])))
                except ValueError:
                    continue
    return out


def open_logs(ui, directory: str, run: str, keys: list[str]) -> dict:
    """key -> its saved log opened to read (open_saved); a log that is no regular file is
    named on one line and left out, and when any is, TfclusterError after the others
    were shown is the caller's (see not_shown)."""
    files = {}
    for key in keys:
        path = os.path.join(directory, log_file(key))
        try:
            files[key] = open_saved(path)
        except OSError as e:
            refused(ui.warn, path, e)
    return files


def not_shown(run: str, keys: list[str], files: dict) -> None:
    """The error for the logs open_logs left out (exit 1: what was shown is not all)."""
    missing = [k for k in keys if k not in files]
    if missing:
        raise TfclusterError(f"run {run}: {len(missing)} log(s) not read ({', '.join(missing)}: said above)",
                             hint="a saved log is read only when it is a regular file")


def show_logs(ui, name: str, runs_dir: str, run: str | None, task: str | None, out,
              verbose: bool = False) -> int:
    """`logs`: a run's saved logs, prefixed, task after task; TensorFlow's start-up noise and
    C++ INFO lines left out as the live view leaves them out, unless `verbose` (the files keep
    every byte)."""
    from tfcluster.watch.logmux import LogMux

    run = pick_run(runs_dir, name, run)
    directory = os.path.join(runs_dir, run)
    keys = task_logs(directory, run, task)
    ui.info(f"run {run}")
    show_checkpoints(ui, directory)
    files = open_logs(ui, directory, run, keys)
    mux = LogMux(out, list(files), color=ui.color, hide_noise=not verbose)
    try:
        for key, f in files.items():
            while chunk := f.read(1 << 16):
                mux.feed(key, chunk)
            mux.close_task(key)
        mux.close()
    finally:
        for f in files.values():
            f.close()
    not_shown(run, keys, files)
    return 0
