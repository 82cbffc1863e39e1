"""`logs`, `runs` and `plot`: a cluster's saved runs. The commands read runs/<run id>/
here, never the hosts."""
from __future__ import annotations

import os
from typing import Optional

import typer

from tfcluster.cli.app import SpecArg, StoppedWatching, app, plan_of, ui
from tfcluster.errors import ExitCode, TfclusterError, UsageError

RunsDir = typer.Option("runs", "--runs-dir", help="Where runs were saved.")


@app.command()
def logs(
    spec_path: str = SpecArg,
    task: Optional[str] = typer.Argument(None, help="Only this task, e.g. worker:1."),
    run: Optional[str] = typer.Option(None, "--run", help="Run id (default: the latest run)."),
    task_option: Optional[str] = typer.Option(None, "--task", help="Same as TASK (as train spells it)."),
    runs_dir: str = RunsDir,
    follow: bool = typer.Option(False, "--follow", "-f",
                                help="Keep printing lines as the run writes them, until it ends "
                                     "(Ctrl-C: stop, exit 130). A run that has ended is shown "
                                     "to its end."),
    verbose: bool = typer.Option(False, "--verbose", "-v",
                                 help="Also show TF's start-up log noise and C++ INFO lines (as train -v)."),
) -> int:
    """Show a past run's saved logs (prefixed), latest run by default; -f follows a live run.

    Example:  tfcluster logs lab.yaml worker:1 --run lab-20261122-101500-ab12
    """
    if task_option is not None and task not in (None, task_option):
        raise UsageError(f"logs: TASK {task} and --task {task_option} differ; give one")
    task = task or task_option
    name = plan_of(spec_path).name
    if not follow:
        from tfcluster.watch.runs import show_logs

        return show_logs(ui, name, runs_dir, run, task, ui.byte_stdout, verbose=verbose)
    from tfcluster.watch.follow import follow as follow_run

    try:
        return follow_run(ui, name, runs_dir, run, task, ui.byte_stdout, verbose=verbose)
    except KeyboardInterrupt:
        raise StoppedWatching() from None


@app.command("runs")
def runs_(
    spec_path: str = SpecArg,
    json_: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    runs_dir: str = RunsDir,
) -> int:
    """The cluster's saved runs, oldest first: start, duration, outcome, restarts, final step and loss.

    The step and loss are the chief's (worker 0 without one), read from what the run
    saved; a run that trained with Keras' model.fit adds its last epoch. A run whose
    tfcluster was killed shows `died`.

    Example:  tfcluster runs lab.yaml --json
    """
    from tfcluster.watch.follow import print_runs, run_rows

    plan = plan_of(spec_path)
    rows = run_rows(runs_dir, plan.name, plan.progress, ui.warn)
    if json_:
        ui.json({"cluster": plan.name, "runs_dir": runs_dir, "order": "oldest first", "runs": rows})
    elif not rows:
        ui.info(f"no saved runs of cluster {plan.name!r} under {runs_dir}/")
    else:
        print_runs(ui, plan.name, rows, runs_dir)
    return ExitCode.OK


@app.command()
def plot(
    spec_path: str = SpecArg,
    run: Optional[str] = typer.Option(None, "--run", help="Run id (default: the latest run)."),
    output: Optional[str] = typer.Option(None, "--output", "-o", metavar="FILE.png",
                                         help="Write a PNG (needs matplotlib: tfcluster[plot]); "
                                              "default: a plot in the terminal."),
    runs_dir: str = RunsDir,
) -> int:
    """Loss and steps/s per task against the global step, from a run's saved logs.

    Steps/s come from when each step line reached tfcluster (runs/<run id>/progress.tsv).

    Example:  tfcluster plot lab.yaml -o loss.png
    """
    from tfcluster.watch import runs
    from tfcluster.watch.plotting import run_series, text_plot, write_png

    plan = plan_of(spec_path)
    if output is not None:
        if not output.lower().endswith(".png"):
            raise UsageError(f"-o {output}: plot writes PNG files; name it FILE.png")
        if not os.path.isdir(os.path.dirname(output) or "."):
            raise UsageError(f"-o {output}: no such directory: {os.path.dirname(output)}")
    run_id = runs.pick_run(runs_dir, plan.name, run)
    directory = os.path.join(runs_dir, run_id)
    series = run_series(directory, runs.read_manifest(directory, ui.warn), plan.progress, ui.warn)
    if not series:
        raise TfclusterError(f"run {run_id}: no step or loss lines in its logs",
                             hint="scripts print `step=N loss=X`, or train with Keras' model.fit "
                                  "(verbose=1 or 2); for another format set "
                                  "train.progress: {step: REGEX, loss: REGEX} in the spec")
    if output is None:
        for line in text_plot(run_id, series):
            ui.text(line)
        return ExitCode.OK
    write_png(output, run_id, series)
    ui.ok(f"wrote {output} (run {run_id}, {len(series)} task(s))")
    return ExitCode.OK
