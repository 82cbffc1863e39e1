"""The files a run ships: the training script and train.files, read here and placed
in the run's directory on every host that runs a script (content-addressed, so an
unchanged file crosses the network once per host).

What ships is exactly the plan's file list, which check_train_files made (docs/design/spec-safety.md,
"Spec safety"): every file is read, and must still be the regular file of the size listed,
before the first byte goes to a host."""
from __future__ import annotations

import os
import stat

from tfcluster.errors import UsageError
from tfcluster.launch.cluster.session import Session, raise_first
from tfcluster.plan import Plan, TaskPlan
from tfcluster.ui.units import size


def collect_files(plan: Plan) -> list[tuple[str, bytes, int]]:
    """(path relative to the run dir, content, mode) for every file of the plan."""
    if plan.script and not plan.files:
        raise UsageError("the plan lists no files to ship: build it with check_train_files' list")
    return [(dest, _read(source, size), 0o600) for source, dest, size in plan.files]


def _read(path: str, size: int) -> bytes:
    """The file's bytes, refused unless it is still a regular file of `size` bytes (a link
    put in its place, a FIFO that would block, or a file that grew since the check)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        data = f.read(size + 1) if stat.S_ISREG(st.st_mode) else b""
    if not stat.S_ISREG(st.st_mode) or len(data) != size:
        raise UsageError(f"{path} changed since it was checked ({size} bytes then); nothing was shipped",
                         hint="run train again")
    return data


def ship(session: Session, tasks: list[TaskPlan], run_id: str,
         files: list[tuple[str, bytes, int]] | None = None) -> str:
    """Copy the files (default: collect_files) into this run's directory on each host
    that runs one of `tasks`; returns a one-line account of what crossed the network.
    A host whose bootstrap already placed them from its cache (Session.open's `ship`)
    costs nothing more."""
    files = collect_files(session.plan) if files is None else files
    rundir = session.paths.rundir(run_id)
    hosts = list(dict.fromkeys(t.host for t in tasks))
    results = session.parallel(lambda h: session.agents[h].sync_files(files, rundir), hosts)
    raise_first(results, "host")
    sent = sum(results.values())
    total = sum(len(data) for _, data, _ in files) * len(hosts)
    return (f"Shipped {len(files)} file(s) to {len(hosts)} host(s): {size(sent, whole_bytes=False)} new, "
            f"{size(total - sent, whole_bytes=False)} already there")
