"""The files a run ships: the training script and train.files, read here and placed
in the run's directory on every host that runs a script (content-addressed, so an
unchanged file crosses the network once per host)."""
from __future__ import annotations

import os

from tfcluster.errors import UsageError
from tfcluster.plan import Plan, TaskPlan
from tfcluster.session import Session, raise_first

MAX_SHIPPED_BYTES = 256 * 1024 * 1024


def collect_files(plan: Plan) -> list[tuple[str, bytes, int]]:
    """(path relative to the run dir, content, mode) for every (source, destination) pair
    of the plan; a directory brings every file under it."""
    out = []
    for source, dest in plan.files:
        if os.path.isdir(source):
            for root, _dirs, names in os.walk(source):
                for name in sorted(names):
                    full = os.path.join(root, name)
                    out.append((os.path.join(dest, os.path.relpath(full, source)), _read(full), 0o600))
        else:
            out.append((dest, _read(source), 0o600))
    if sum(len(d) for _, d, _ in out) > MAX_SHIPPED_BYTES:
        raise UsageError("train.files add up to more than 256 MiB; put data on the hosts instead")
    return out


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def ship(session: Session, tasks: list[TaskPlan], run_id: str) -> str:
    """Copy the files into this run's directory on each host that runs one of `tasks`;
    returns a one-line account of what crossed the network."""
    files = collect_files(session.plan)
    rundir = session.paths.rundir(run_id)
    hosts = list(dict.fromkeys(t.host for t in tasks))
    results = session.parallel(lambda h: session.agents[h].sync_files(files, rundir), hosts)
    raise_first(results, "host")
    sent = sum(results.values())
    total = sum(len(data) for _, data, _ in files) * len(hosts)
    return (f"Shipped {len(files)} file(s) to {len(hosts)} host(s): {_size(sent)} new, "
            f"{_size(total - sent)} already there")


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"
