"""What a run leaves on this machine: runs/<run id>/ with each task's log and
manifest.json, and reading them back (`tfcluster logs`)."""
from __future__ import annotations

import json
import os
import time

from tfcluster.errors import UsageError
from tfcluster.fsutil import private_dir, write_private
from tfcluster.names import is_run_of, key_of_log, log_file
from tfcluster.plan import JOB_NAMES, Plan, plan_to_dict


class Manifest:
    """runs/<run id>/manifest.json: spec hash, plan (secrets redacted), per-task outcome."""

    def __init__(self, plan: Plan, run_id: str, directory: str) -> None:
        self.plan = plan
        self.run_id = run_id
        self.path = os.path.join(directory, "manifest.json")
        self.started = time.time()
        private_dir(directory, "runs", top=os.path.dirname(directory))
        self._write({"outcome": "running"})

    def finish(self, procs, outcome: tuple[int, str], checks: dict[str, str] | None = None) -> None:
        tasks = {}
        for p in procs:
            entry = tasks.setdefault(p.task.key, {"host": p.task.host})
            entry[p.role] = {"exit_code": p.exit_code, "restarts": p.restarts,
                             "started": p.started, "ended": p.ended}
        self._write({"outcome": outcome[1], "exit_code": outcome[0], "ended": time.time(),
                     "tasks": tasks, "checks": checks or {}})

    def _write(self, extra: dict) -> None:
        doc = {"run_id": self.run_id, "cluster": self.plan.name, "mode": self.plan.mode,
               "spec_sha256": self.plan.spec_digest, "started": self.started,
               "script": self.plan.script, **extra, "plan": plan_to_dict(self.plan, redact=True)}
        write_private(self.path, json.dumps(doc, indent=2).encode())


def run_dirs(runs_dir: str, name: str) -> list[str]:
    """This cluster's saved runs, oldest first (only its own: not those of `name-x`)."""
    try:
        entries = os.listdir(runs_dir)
    except FileNotFoundError:
        return []
    runs = [e for e in entries if is_run_of(name, e)
            and os.path.isfile(os.path.join(runs_dir, e, "manifest.json"))]
    return sorted(runs)


def show_logs(ui, name: str, runs_dir: str, run: str | None, task: str | None, out) -> int:
    from tfcluster.logmux import LogMux

    runs = run_dirs(runs_dir, name)
    if not runs:
        raise UsageError(f"no saved runs of cluster {name!r} under {runs_dir}/")
    if run is None:
        run = runs[-1]
    elif run not in runs:
        raise UsageError(f"no run {run!r} under {runs_dir}/ (latest: {runs[-1]})")
    directory = os.path.join(runs_dir, run)
    # only task logs: another file's name would land in every line's prefix
    keys = sorted(k for k in map(key_of_log, os.listdir(directory))
                  if k is not None and k.split(":")[0] in JOB_NAMES)
    if task is not None:
        if task not in keys:
            raise UsageError(f"run {run} has no log for {task} (has: {', '.join(keys)})")
        keys = [task]
    ui.info(f"run {run}")
    mux = LogMux(out, keys, color=ui.color)
    for key in keys:
        with open(os.path.join(directory, log_file(key)), "rb") as f:
            while chunk := f.read(1 << 16):
                mux.feed(key, chunk)
        mux.close_task(key)
    mux.close()
    return 0
