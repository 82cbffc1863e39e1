"""What a run leaves on this machine (runs/<run id>/: logs + manifest.json), and
the files a run ships to the hosts."""
from __future__ import annotations

import json
import os
import shutil
import time

from tfcluster.errors import UsageError
from tfcluster.plan import Plan, plan_to_dict
from tfcluster.spec import MODES, Spec
from tfcluster.state import write_private

MAX_SHIPPED_BYTES = 256 * 1024 * 1024


class Manifest:
    """runs/<run id>/manifest.json: spec hash, plan (secrets redacted), per-task outcome."""

    def __init__(self, plan: Plan, run_id: str, directory: str) -> None:
        self.plan = plan
        self.run_id = run_id
        self.path = os.path.join(directory, "manifest.json")
        self.started = time.time()
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._write({"outcome": "running"})

    def finish(self, procs, outcome: tuple[int, str]) -> None:
        tasks = {}
        for p in procs:
            entry = tasks.setdefault(p.task.key, {"host": p.task.host})
            entry[p.role] = {"exit_code": p.exit_code, "restarts": p.restarts,
                             "started": p.started, "ended": p.ended}
        self._write({"outcome": outcome[1], "exit_code": outcome[0], "ended": time.time(),
                     "tasks": tasks})

    def _write(self, extra: dict) -> None:
        doc = {"run_id": self.run_id, "cluster": self.plan.name, "mode": self.plan.mode,
               "spec_sha256": self.plan.spec_digest, "started": self.started,
               "script": self.plan.script, **extra, "plan": plan_to_dict(self.plan, redact=True)}
        write_private(self.path, json.dumps(doc, indent=2).encode())


def collect_files(spec: Spec, plan: Plan) -> list[tuple[str, bytes, int]]:
    """(path relative to the run dir, content, mode) for the script and train.files."""
    out = [(os.path.basename(plan.script), _read(plan.script), 0o600)]
    for path in plan.files:
        rel_base = os.path.relpath(path, spec.base_dir)
        if os.path.isdir(path):
            for root, _dirs, names in os.walk(path):
                for name in sorted(names):
                    full = os.path.join(root, name)
                    out.append((os.path.relpath(full, spec.base_dir), _read(full), 0o600))
        else:
            out.append((rel_base, _read(path), 0o600))
    if sum(len(d) for _, d, _ in out) > MAX_SHIPPED_BYTES:
        raise UsageError("train.files add up to more than 256 MiB; put data on the hosts instead")
    return out


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def run_dirs(runs_dir: str, name: str) -> list[str]:
    """This cluster's saved runs, oldest first."""
    try:
        entries = os.listdir(runs_dir)
    except FileNotFoundError:
        return []
    runs = [e for e in entries if e.startswith(f"{name}-")
            and os.path.isfile(os.path.join(runs_dir, e, "manifest.json"))]
    return sorted(runs)


def show_logs(ui, name: str, runs_dir: str, run: str | None, task: str | None, out) -> int:
    from tfcluster.logs import LogMux

    runs = run_dirs(runs_dir, name)
    if not runs:
        raise UsageError(f"no saved runs of cluster {name!r} under {runs_dir}/")
    if run is None:
        run = runs[-1]
    elif run not in runs:
        raise UsageError(f"no run {run!r} under {runs_dir}/ (latest: {runs[-1]})")
    directory = os.path.join(runs_dir, run)
    logs = sorted(f for f in os.listdir(directory) if f.endswith(".log") and ".server." not in f)
    keys = [_key_of(f) for f in logs]
    if task is not None:
        if task not in keys:
            raise UsageError(f"run {run} has no log for {task} (has: {', '.join(keys)})")
        keys = [task]
    ui.info(f"run {run}")
    mux = LogMux(out, keys, color=ui.color)
    for key in keys:
        with open(os.path.join(directory, _file_of(key)), "rb") as f:
            while chunk := f.read(1 << 16):
                mux.feed(key, chunk)
        mux.close_task(key)
    mux.close()
    return 0


def _key_of(filename: str) -> str:
    job, _, index = filename[:-4].rpartition("-")
    return f"{job}:{index}"


def _file_of(key: str) -> str:
    job, _, index = key.rpartition(":")
    return f"{job}-{index}.log"


def copy_template(mode: str, dest: str | None) -> str:
    import importlib.resources

    if mode not in MODES:
        raise UsageError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    name = mode.replace("-", "_") + ".py"
    dest = dest or f"train_{name}"
    if os.path.exists(dest):
        raise UsageError(f"{dest} already exists; pass another destination")
    source = importlib.resources.files("tfcluster.templates").joinpath(name)
    with importlib.resources.as_file(source) as path:
        shutil.copyfile(path, dest)
    return dest
