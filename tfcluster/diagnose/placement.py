"""The placement-consistency check: do the workers agree where every variable lives?

Each between-graph or classic script process prints, when its first session with
variables is created, one `tfcluster-placement:` line (tfcluster/probe/sitecustomize.py).
This module parses those lines and compares them across tasks as they arrive. Two
workers that put "the same" variable on different ps tasks (variables created by
iterating a set or a dict: each process has its own hash seed) would otherwise train
against state nobody initialises. Pure: no I/O; the supervisor feeds it lines.
"""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

MARK = b"tfcluster-placement: "
WAIT_MARK = b"tfcluster-not-ready: "
MARKS = (MARK, WAIT_MARK)
FIX = ("create the variables in a fixed order on every worker (never by iterating a set or a "
       "dict), or give them explicit devices; switch the check off with train.checks.placement: false")
_DEVICE = re.compile(r"/job:([^/]+)|/replica:(\d+)|/task:(\d+)|/device:([^/]+)")


@dataclass(frozen=True)
class Variable:
    name: str
    device: str          # normalised: "/job:ps/task:1" or "this task"
    shape: str
    dtype: str


@dataclass(frozen=True)
class Report:
    task: str            # "worker:1"
    variables: tuple[Variable, ...]


@dataclass(frozen=True)
class Mismatch:
    variable: str
    what: str            # "device" | "shape" | "dtype"
    task_a: str
    value_a: str
    task_b: str
    value_b: str

    def message(self) -> str:
        return (f"placement mismatch: variable {self.variable!r} has {self.what} {self.value_a} "
                f"in {self.task_a} but {self.value_b} in {self.task_b}")


def normalise(device: str, task: str) -> str:
    """A device string as the comparison sees it: "/job:ps/task:1" (replica and device
    type dropped), or "this task" for the reporting task's own device and for a variable
    with no job (a worker's local variables legitimately live on different workers)."""
    job = index = None
    for m in _DEVICE.finditer(device):
        job = m.group(1) or job
        index = m.group(3) or index
    own_job, _, own_index = task.partition(":")
    if job is None or (job == own_job and (index or "0") == own_index):
        return "this task"
    return f"/job:{job}/task:{index or 0}"


def parse(line: bytes) -> Report | None:
    """The report on a `tfcluster-placement:` line, or None for anything else."""
    at = line.find(MARK)
    if at < 0:
        return None
    try:
        doc = json.loads(line[at + len(MARK):])
        task = str(doc["task"])
        rows = [(str(n), str(d or ""), json.dumps(s), str(t)) for n, d, s, t in doc["vars"]]
    except Exception:  # noqa: BLE001 - task output, any shape (200,000 `[` raise RecursionError)
        return None
    return Report(task, tuple(Variable(n, normalise(d, task), s, t) for n, d, s, t in rows))


def compare(a: Report, b: Report) -> Mismatch | None:
    """The first variable (in a's creation order) that b places, shapes or types differently."""
    theirs = {v.name: v for v in b.variables}
    for mine in a.variables:
        other = theirs.get(mine.name)
        if other is None:
            continue
        for what in ("device", "shape", "dtype"):
            if getattr(mine, what) != getattr(other, what):
                return Mismatch(mine.name, what, a.task, _shown(getattr(mine, what), a.task),
                                b.task, _shown(getattr(other, what), b.task))
    return None


def _shown(value: str, task: str) -> str:
    if value == "this task":
        return f"/job:{task.replace(':', '/task:')} (its own task)"
    return value


class PlacementCheck:
    """Collects reports as they arrive (any thread) and keeps the first mismatch."""

    def __init__(self, tasks) -> None:
        self._order = {key: i for i, key in enumerate(tasks)}   # plan order: the chief first
        self._reports: dict[str, Report] = {}
        self._lock = threading.Lock()
        self.mismatch: Mismatch | None = None

    def add(self, report: Report) -> Mismatch | None:
        if report.task not in self._order:
            return None
        with self._lock:
            self._reports[report.task] = report   # a restarted task's new report replaces its old
            if self.mismatch is None:
                for other in sorted(self._reports.values(), key=lambda r: self._order[r.task]):
                    if other.task == report.task:
                        continue
                    first, second = sorted((other, report), key=lambda r: self._order[r.task])
                    self.mismatch = compare(first, second)
                    if self.mismatch:
                        break
            return self.mismatch

    def summary(self) -> str:
        """One line for the run summary and manifest."""
        with self._lock:
            if self.mismatch:
                return self.mismatch.message()
            n = len(self._reports)
            if n == 0:
                return "no task reported its variables (no session was created, or the script is not TF1-style)"
            count = max(len(r.variables) for r in self._reports.values())
            if n == 1:
                return f"only {next(iter(self._reports))} reported ({count} variables): nothing to compare"
            return f"consistent across {n} tasks ({count} variables)"
