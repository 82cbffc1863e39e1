"""Watching runs from their saved files: the table of past runs (`runs`) and following a
live run's logs (`logs -f`). Reads only runs/<run id>/ on this machine."""
from __future__ import annotations

import os
import time

from tfcluster.localfs import LINE_CAP, saved_tail
from tfcluster.plan.names import log_file
from tfcluster.safetext import escape
from tfcluster.ui.units import duration
from tfcluster.watch import runs
from tfcluster.watch.metrics import Tracker

FOLLOW_POLL = 0.2         # seconds between looks at the logs while nothing new came
FINAL_TAIL = 1 << 20      # bytes of the chief's log read for a run's last step


def run_rows(runs_dir: str, name: str, progress=None, warn=None) -> list[dict]:
    """One dict per saved run of `name`, oldest first: id, started, ended, duration,
    mode, outcome, restarts, task (the chief's), step, loss, steps_per_s (recorded at the
    run's end; None before), and from Keras' `model.fit` epoch, epochs, fit (which fit of
    the script) and the other metrics (None, None, None, {} without), checkpoint (the newest
    kept in runs/<run id>/checkpoints/, runs.kept_checkpoints; None without). `progress`: the
    current spec's train.progress, for runs whose manifest has none. `warn` is told of
    each saved file not read (runs.read_manifest)."""
    out = []
    for run_id in runs.run_dirs(runs_dir, name):
        directory = os.path.join(runs_dir, run_id)
        doc = runs.read_manifest(directory, warn)
        started, ended = _num(doc.get("started")), _num(doc.get("ended"))
        state = runs.run_state(doc)
        end = ended if ended is not None else (time.time() if state == "running" else None)
        chief = _chief(doc)
        final = _final(directory, doc, chief, progress, warn)
        kept = runs.kept_checkpoints(directory)
        out.append({"run": run_id, "started": started, "ended": ended,
                    "duration": None if started is None or end is None else round(end - started, 1),
                    "mode": doc.get("mode") if isinstance(doc.get("mode"), str) else None,
                    "outcome": _outcome(state, doc.get("exit_code")), "exit_code": doc.get("exit_code"),
                    "message": _message(state, doc.get("outcome")),
                    "restarts": _restarts(doc), "task": chief, **final,
                    "checkpoint": kept[-1] if kept else None, "moves": _moves(doc), "notices": _notices(doc)})
    return out


def _moves(doc: dict) -> list[dict]:
    """The manifest's moves (launch/run/moves.py's records), each with the fields `runs` shows,
    anything malformed left out: the manifest is only as trusted as runs/ is."""
    keys = {"at": (int, float), "host": str, "why": str, "action": str, "to": str, "tasks": list,
            "resumed_step": int, "steps_lost": int}
    out = []
    for m in doc.get("moves") if isinstance(doc.get("moves"), list) else ():
        if isinstance(m, dict) and isinstance(m.get("host"), str):
            out.append({k: m.get(k) if isinstance(m.get(k), t) else None for k, t in keys.items()})
    return out


def _notices(doc: dict) -> list[dict]:
    """The manifest's notices (launch/run/notices.py's records), checked as _moves checks."""
    keys = {"at": (int, float), "host": str, "source": str, "kind": str, "deadline": (int, float),
            "action": str, "line": str, "steps_lost": int}
    out = []
    for n in doc.get("notices") if isinstance(doc.get("notices"), list) else ():
        if isinstance(n, dict) and isinstance(n.get("host"), str):
            out.append({k: n.get(k) if isinstance(n.get(k), t) else None for k, t in keys.items()})
    return out


def notice_line(n: dict) -> str:
    """One notice as `runs` says it: when, which host, from where, its deadline, what was done."""
    def clock(t) -> str:
        return "--:--:--" if t is None else time.strftime("%H:%M:%S", time.localtime(t))
    ahead = "" if n["deadline"] is None else f", deadline {clock(n['deadline'])}"
    lost = "" if n["steps_lost"] is None else f"; {n['steps_lost']} step(s) lost"
    line = f": {n['line']}" if n["line"] else ""
    return f"{clock(n['at'])} {n['host']} notice ({n['source']} {n['kind']}{ahead}): {n['action']}{line}{lost}"


def move_line(m: dict) -> str:
    """One move as `runs` says it: when, which host, why, what, to where, resumed, lost."""
    when = "--:--:--" if m["at"] is None else time.strftime("%H:%M:%S", time.localtime(m["at"]))
    tasks = ", ".join(str(t) for t in m["tasks"] or ())
    what = (f"went on without {tasks}" if m["action"] == "shrink" else
            f"{tasks} moved to {m['to']}" + (", every task restarted" if m["action"] == "restart" else ""))
    resumed = ("" if m["resumed_step"] is None else
               f"; resumed at step {m['resumed_step']}, {m['steps_lost']} step(s) lost")
    why = (m["why"] or "").split(":", 1)[0]
    return f"{when} {m['host']} {why}: {what}{resumed}"


OUTCOMES = {0: "succeeded", 6: "timeout", 130: "interrupted", 143: "terminated"}


def _message(state: str, written) -> str | None:
    """The manifest's outcome text; a died run's still says "running", which it is not."""
    if state == "died":
        return "tfcluster ended without writing the outcome (killed, or its machine went down)"
    return written if isinstance(written, str) else None


def _outcome(state: str, code) -> str:
    """running, died, running? (an old manifest), unknown, or by the exit code: succeeded,
    timeout, interrupted, terminated, failed (the manifest's message says how)."""
    if state in ("running", "died", "running?", "unknown") or not isinstance(code, int):
        return state
    return OUTCOMES.get(code, "failed")


def _num(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _chief(doc: dict) -> str | None:
    """The task whose script decides the run (the plan's chief), else the first script's."""
    tasks = [t for t in (doc.get("plan") or {}).get("tasks") or [] if isinstance(t, dict) and t.get("script")]
    chief = next((t for t in tasks if t.get("chief")), tasks[0] if tasks else None)
    return chief.get("task") if chief else None


def _restarts(doc: dict) -> int:
    total = 0
    for entry in (doc.get("tasks") or {}).values():
        for role in ("script", "server"):
            value = entry.get(role, {}).get("restarts") if isinstance(entry, dict) else None
            total += value if isinstance(value, int) else 0
    return total


def _final(directory: str, doc: dict, key: str | None, progress, warn=None) -> dict:
    """The chief's last step, loss, epoch, epochs and metrics: recorded in the manifest at
    the end of the run, else read from the tail of its saved log (older runs, a run still
    going or killed)."""
    none = {"step": None, "loss": None, "epoch": None, "epochs": None, "fit": None, "steps_per_s": None,
            "metrics": {}}
    if key is None:
        return none
    recorded = (doc.get("progress") or {}).get(key)
    if isinstance(recorded, dict) and doc.get("outcome") != "running":
        return {name: recorded.get(name, value) for name, value in none.items()}
    tracker = Tracker(patterns_of(doc, progress))
    path = os.path.join(directory, log_file(key))
    try:
        tail = saved_tail(path, FINAL_TAIL)
    except OSError as e:
        if not isinstance(e, FileNotFoundError):
            runs.refused(warn, path, e)
        return none
    for line in tail.split(b"\n"):
        tracker.feed_block(key, line[-LINE_CAP:])
    state = tracker.state(key)
    if state is None:
        return none
    return {"step": state.step, "loss": state.loss, "epoch": state.epoch, "epochs": state.epochs,
            "fit": state.fit, "steps_per_s": None, "metrics": state.metrics}     # a log has no times


class _Patterns:
    def __init__(self, step, loss, target) -> None:
        self.step, self.loss, self.target = step, loss, target


def patterns_of(doc: dict, progress=None):
    """The run's own train.progress from its manifest, else `progress` (the spec's now)."""
    found = (doc.get("plan") or {}).get("progress")
    if isinstance(found, dict):
        return _Patterns(found.get("step"), found.get("loss"), found.get("target"))
    return progress


def print_runs(ui, name: str, rows: list[dict], runs_dir: str) -> None:
    def when(t):
        return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))

    def outcome(r):
        return f"failed (exit {r['exit_code']})" if r["outcome"] == "failed" else r["outcome"]

    epochs = any(r.get("epoch") is not None for r in rows)     # a column only for Keras' runs

    def epoch(r):
        if not epochs:
            return ()
        later = f" (fit {r['fit']})" if isinstance(r.get("fit"), int) and r["fit"] > 1 else ""   # a later model.fit's
        return ("-" if r.get("epoch") is None else f"{r['epoch']}/{r['epochs']}{later}",)

    checkpoints = any(r.get("checkpoint") for r in rows)     # a column only where a run kept one

    def checkpoint(r):
        c = r.get("checkpoint")
        if not checkpoints:
            return ()
        return ("-" if c is None else c["name"] if c["step"] is None else f"{c['name']} (step {c['step']})",)

    table = [(r["run"], when(r["started"]), duration(r["duration"], tenths=True), r["mode"] or "-", outcome(r),
              str(r["restarts"]), "-" if r["step"] is None else str(r["step"]), *epoch(r),
              "-" if r["loss"] is None else f"{r['loss']:.4g}", *checkpoint(r)) for r in rows]
    ui.table(f"runs of {name!r} in {runs_dir}/ (oldest first)",
             ["run", "started", "duration", "mode", "outcome", "restarts", "step", *(("epoch",) if epochs else ()),
              "loss", *(("checkpoint",) if checkpoints else ())], table)
    for r in rows:          # every move of every run, under the table: hosts lost or drained
        for m in r.get("moves") or ():
            ui.text(escape(f"{r['run']}: {move_line(m)}"))
        for n in r.get("notices") or ():
            ui.text(escape(f"{r['run']}: {notice_line(n)}"))


def follow(ui, name: str, runs_dir: str, run: str | None, task: str | None, out,
           poll: float = FOLLOW_POLL, verbose: bool = False) -> int:
    """`logs -f`: the run's saved logs, prefixed, then every line appended to them until
    the manifest says the run ended (or its tfcluster died). A run that is not running is
    shown to its end at once. Returns 0."""
    from tfcluster.watch.logmux import LogMux

    run = runs.pick_run(runs_dir, name, run)
    directory = os.path.join(runs_dir, run)
    keys = runs.task_logs(directory, run, task)
    live = runs.run_state(runs.read_manifest(directory, ui.warn)) == "running"
    ui.info(f"run {run}" + (" is running: following its logs until it ends (Ctrl-C to stop)" if live
                            else f" is not running ({runs.run_state(runs.read_manifest(directory))}); "
                                 f"its logs as saved"))
    files = runs.open_logs(ui, directory, run, keys)
    if not files:
        runs.not_shown(run, keys, files)
    mux = LogMux(out, list(files), color=ui.color, hide_noise=not verbose)
    try:
        while True:
            got = _drain(files, mux)
            if got:
                continue
            if not live:
                break
            state = runs.run_state(runs.read_manifest(directory))
            if state != "running":
                live = False        # one more drain: what was written before the manifest
                continue
            time.sleep(poll)
        for key in files:
            mux.close_task(key)
        mux.close()
    finally:
        for f in files.values():
            f.close()
    ui.info(f"run {run}: {runs.run_state(runs.read_manifest(directory))}")
    runs.not_shown(run, keys, files)
    return 0


def _drain(files: dict, mux) -> bool:
    got = False
    for key, f in files.items():
        chunk = f.read(1 << 16)
        while chunk:
            got = True
            mux.feed(key, chunk)
            chunk = f.read(1 << 16)
    return got
