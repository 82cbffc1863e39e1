"""`plan`, `up`, `down`, `status` and `exec`: the cluster's lifecycle from the command line.

Heavy modules (paramiko, the session machinery) are imported inside the commands that need
them, so `--help` and `plan` stay instant.
"""
from __future__ import annotations

import time
from typing import List, Optional

import typer

from tfcluster.cli.app import SKEW_HELP, SpecArg, StoppedWatching, app, load, plan_of, seconds, ui
from tfcluster.errors import ExitCode, UsageError, did_you_mean
from tfcluster.safetext import shell_word

MIN_INTERVAL = 0.2      # status --watch: seconds between refreshes at least


@app.command()
def plan(
    spec_path: str = SpecArg,
    json_: bool = typer.Option(False, "--json", help="One JSON document on stdout, nothing else."),
    commands: bool = typer.Option(False, "--commands", "-c",
                                  help="Show each task's exact command and environment."),
    check: bool = typer.Option(False, "--check",
                               help="Also connect to every host and run the preflight checks "
                                    "(python, tensorflow, GPUs, ports free). Starts nothing."),
    allow_skew: bool = typer.Option(False, "--allow-skew", help=SKEW_HELP + " (only with --check)."),
    to: Optional[str] = typer.Option(None, "--to", metavar="ENGINE",
                                     help="slurm: also show which Slurm rank plays which task."),
) -> int:
    """Show what would run where: tasks, ports, GPUs, TF_CONFIG. No network unless --check.

    Example:  tfcluster plan lab.yaml --commands
    """
    from tfcluster.ui.views import plan_json, print_plan

    if to is not None and to != "slurm":
        raise UsageError(f"plan --to {to!r}: only slurm has a rank mapping to show")
    if allow_skew and not check:
        raise UsageError("plan --allow-skew: only --check compares the hosts' versions",
                         hint=f"`tfcluster plan {shell_word(spec_path)} --check --allow-skew`")
    spec, p = load(spec_path, preview=True)
    if json_:
        ui.json({**plan_json(p), **({"slurm": slurm_ranks(p)} if to else {})})
    else:
        print_plan(ui, p, commands=commands)
        if to:
            print_ranks(p)
    if check:
        from tfcluster.launch.cluster import lifecycle
        lifecycle.check(p, ui, allow_skew=allow_skew)
    return ExitCode.OK


@app.command()
def up(
    spec_path: str = SpecArg,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; touch nothing."),
    timeout: float = typer.Option(120.0, "--timeout", parser=seconds, metavar="DURATION",
                                  help="How long to wait for every server: seconds, or 90s, 5m."),
    allow_skew: bool = typer.Option(False, "--allow-skew", help=SKEW_HELP + "."),
) -> int:
    """Start the cluster's TF servers and wait until each listens on its port.

    Runs preflight first (reachable, python + tensorflow, GPUs, ports free); if any
    server fails, everything this `up` started is stopped again. Running `up` on a
    cluster that is already up starts nothing.

    Example:  tfcluster up lab.yaml
    """
    p = load(spec_path, scan=True)[1]
    if dry_run:
        from tfcluster.ui.views import print_plan

        print_plan(ui, p, commands=True)
        return ExitCode.OK
    from tfcluster.launch.cluster import lifecycle
    return lifecycle.up(p, ui, timeout=timeout, allow_skew=allow_skew)


@app.command()
def down(
    spec_path: str = SpecArg,
    grace: float = typer.Option(5.0, "--grace", parser=lambda text: seconds(text, zero=True), metavar="DURATION",
                                help="How long between TERM and KILL: seconds, or 5s, 1m (0: KILL at once)."),
) -> int:
    """Stop every task of the cluster on every host and verify nothing survived.

    Works without local state (reads the hosts' pid files) and is safe to repeat.

    Example:  tfcluster down lab.yaml
    """
    from tfcluster.launch.cluster import lifecycle
    return lifecycle.down(plan_of(spec_path), ui, grace=grace)


@app.command()
def drain(
    spec_path: str = SpecArg,
    host: str = typer.Argument(..., help="The host to take tasks off, as the spec names it."),
    wait: float = typer.Option(600.0, "--wait", parser=lambda text: seconds(text, zero=True), metavar="DURATION",
                               help="How long to wait for the move: seconds, or 90s, 10m (0: ask and return)."),
    deadline: Optional[float] = typer.Option(None, "--deadline", parser=seconds, metavar="DURATION",
                                             help="The host goes in this long (30s, 2m): recorded as a notice; "
                                                  "too short to move, the checkpoint is copied and the tasks "
                                                  "move once the host is gone."),
) -> int:
    """Move a host's tasks to a spare while `train` runs, losing no step.

    The running `train` (started from another terminal) stops the host's scripts, which save
    a checkpoint as they stop, and starts them on a spare host (`spare: true` in the spec),
    from that checkpoint. Exits 0 once moved, 1 when the run could not move them (it goes on
    where it was, or no `train` of the cluster runs), 2 for a host the spec does not have,
    6 when the move did not come within --wait.

    Example:  tfcluster drain lab.yaml gpu3
    """
    from tfcluster.launch.run import drains

    from tfcluster.launch.cluster import state

    p = plan_of(spec_path)
    names = [h.name for h in p.all_hosts]
    if host not in names:
        raise UsageError(f"{spec_path}: no host named {host!r} (hosts: {', '.join(names)})"
                         + did_you_mean(host, names))
    p = state.placed_by_train(p, ui) or p          # a spare the running train moved tasks to holds them
    if host in p.spares and not p.tasks_on(host):
        raise UsageError(f"{spec_path}: {host} is a spare holding no task (no move put any there): "
                         f"nothing to drain")
    if deadline is not None and deadline <= 0:
        raise UsageError(f"--deadline {deadline:g}: must be more than 0 seconds")
    return drains.request(p, host, wait, ui, deadline)


@app.command()
def status(
    spec_path: str = SpecArg,
    json_: bool = typer.Option(False, "--json", help="Machine-readable output."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh until Ctrl-C (exit 130)."),
    interval: float = typer.Option(2.0, "--interval", parser=seconds, metavar="DURATION",
                                   help="Time between refreshes with --watch: seconds, or 2s, 1m (at least 0.2s)."),
) -> int:
    """Each task: running or stopped, pid, uptime, port open.

    Exits 3 (after the table) when a host could not be reached; with --watch it keeps
    refreshing (in place on a terminal, one table after another otherwise).

    Example:  tfcluster status lab.yaml --json
    """
    from tfcluster.launch.cluster import lifecycle, state
    from tfcluster.launch.run import drains, notices
    from tfcluster.ui.views import print_status, print_watched, status_json, watched_json

    spec_plan = plan_of(spec_path)      # where a running train moved tasks, else where `up` put a down host's
    by_up = state.placed_by_up(spec_plan, ui)
    p = state.placed_by_train(spec_plan, ui) or by_up
    if watch:      # each refresh plans with the running train's moves as they are then
        return watch_status(lambda: state.placed_by_train(spec_plan, ui, say=False) or by_up, interval, json_)
    rows, unreachable = lifecycle.status(p, ui)
    draining = ({h: a for h, a in drains.answers(p).items() if a.get("state") == drains.DRAINING}
                if drains.running(p) == "train" else {})    # a drain's answers outlive an ended train
    watched = watched_json(p, notices.published(p))
    if json_:
        ui.json({**status_json(p, rows), "draining": {h: a.get("line") for h, a in draining.items()},
                 "watched": watched})
    else:
        print_status(ui, p, rows)
        print_watched(ui, watched)
        for host, answer in draining.items():
            ui.warn(f"{host}: draining ({answer.get('line')}); {p.again('drain', host)} waits for the move")
    if unreachable:
        raise lifecycle.unreachable_error(unreachable)
    return ExitCode.OK


@app.command("exec")
def exec_(
    spec_path: str = SpecArg,
    command: List[str] = typer.Argument(..., help="The command, after `--`.", metavar="-- CMD..."),
    hosts: Optional[str] = typer.Option(None, "--hosts", help="Comma-separated host names (default all)."),
) -> int:
    """Run a command on every host in parallel, output prefixed by host.

    Exit code is the worst of the hosts'. The command's words reach it as they are
    (no shell reads them); use `sh -c '...'` for pipes. Ctrl-C stops it on every host.

    Example:  tfcluster exec lab.yaml --hosts gpu0,gpu1 -- nvidia-smi -L
    """
    from tfcluster.launch.cluster.hostexec import exec_on_hosts, exit_code_of
    from tfcluster.launch.cluster.session import Session
    from tfcluster.watch.logmux import LogMux

    if not command[0]:
        raise UsageError("exec: the command is an empty word", hint="e.g. `tfcluster exec SPEC -- hostname`")
    spec, p = load(spec_path)
    names = _select_hosts(spec.path, [h.name for h in p.all_hosts], hosts)
    with Session(p, ui, names) as session:
        outcome = exec_on_hosts(session, command, LogMux(ui.byte_stdout, names, color=ui.color))
    return exit_code_of(outcome, ui)


def _select_hosts(path: str, known: list[str], hosts: str | None) -> list[str]:

    if not hosts:
        return known
    names = list(dict.fromkeys(h.strip() for h in hosts.split(",") if h.strip()))   # a,a: once
    if not names:
        raise UsageError(f"--hosts {hosts!r}: names no host (hosts: {', '.join(known)})")
    for name in names:
        if name not in known:
            raise UsageError(f"--hosts: no host named {name!r} in {path}"
                             + did_you_mean(name, known))
    return names


def watch_status(placed, interval: float, json_: bool) -> int:
    """`status --watch`: the status table again every `interval` seconds until Ctrl-C
    (exit 130, quietly). A terminal is cleared before each table; anything else gets each
    table after the last, a blank line between (JSON: one document per line)."""
    from tfcluster.launch.cluster import lifecycle
    from tfcluster.ui.views import print_status, status_json

    if interval < MIN_INTERVAL:     # a shorter one is a busy loop of SSH round trips
        raise UsageError(f"--interval {interval:g}s: must be at least {MIN_INTERVAL:g}s",
                         hint="see `tfcluster status --help`")
    tty = ui.stdout.isatty()
    try:
        for n in range(1_000_000_000):
            plan = placed()
            rows, unreachable = lifecycle.status(plan, ui)
            if json_:
                ui.json(status_json(plan, rows))
            else:
                ui.stdout.write("\x1b[H\x1b[2J" if tty else "\n" if n else "")
                ui.text(f"{time.strftime('%H:%M:%S')}  every {interval:g}s, Ctrl-C to stop")
                print_status(ui, plan, rows)
            if unreachable:
                ui.warn(lifecycle.unreachable_error(unreachable).message)
            ui.stdout.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        raise StoppedWatching() from None
    return ExitCode.OK


def slurm_ranks(plan) -> dict:
    """`plan --to slurm --json`: the rank table's rows as objects, under the job's shape."""
    from tfcluster.engines.slurm import rank_table, shape

    nodes, per_node, gpus = shape(plan)
    keys = ("rank", "node", "local", "task", "host", "gpus")
    ranks = [dict(zip(keys, (*row[:5], list(row[5])))) for row in rank_table(plan)]
    return {"nodes": nodes, "tasks_per_node": per_node, "gpus_per_node": gpus, "ranks": ranks}


def print_ranks(plan) -> None:
    """`plan --to slurm`: which Slurm rank plays which task."""
    from tfcluster.engines.slurm import rank_cells, rank_table, shape

    nodes, per_node, gpus = shape(plan)
    title = (f"render --to slurm: {nodes} node(s) x {per_node} task(s)"
             + (f", {gpus} GPU(s) per node" if gpus else "") + "; node i plays the i-th host")
    ui.table(title, ("rank", "node", "local", "task", "spec host", "GPUs"),
             [rank_cells(row) for row in rank_table(plan)])
