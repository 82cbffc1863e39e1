"""`train`, and `init` for a script to start from (a run's logs, runs and plot: cli/runs.py)."""
from __future__ import annotations

from typing import List, Optional

import typer

from tfcluster.cli import app as app_module
from tfcluster.cli.app import SKEW_HELP, SpecArg, app, seconds, ui
from tfcluster.errors import ExitCode, UsageError


@app.command(context_settings={"allow_interspersed_args": True})
def train(
    spec_path: str = SpecArg,
    args: Optional[List[str]] = typer.Argument(None, help="Script arguments after `--` (replace train.args).",
                                               metavar="[-- ARGS...]"),
    script: Optional[str] = typer.Option(None, "--script", help="Training script (overrides train.script)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; touch nothing."),
    timeout: Optional[float] = typer.Option(None, "--timeout", parser=seconds, metavar="DURATION",
                                            help="End the run after this long: seconds, or 90s, 30m, 2h."),
    task: Optional[List[str]] = typer.Option(None, "--task", help="Show only this task live, e.g. worker:0 (repeatable)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No live task output; summary only."),
    runs_dir: str = typer.Option("runs", "--runs-dir", help="Where per-run logs and manifest are saved."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also show TF's start-up log noise."),
    allow_skew: bool = typer.Option(False, "--allow-skew", help=SKEW_HELP + "."),
    tensorboard: Optional[str] = typer.Option(
        None, "--tensorboard", metavar="LOGDIR",
        help="Run TensorBoard on LOGDIR on the chief's host for the run and print its URL "
             "(overrides train.tensorboard; same placeholders)."),
) -> int:
    """Run the training script on the cluster with live, prefixed logs.

    Brings up the servers the mode needs (or reuses a cluster that is `up`), ships the
    script, runs it on each task, saves logs under runs/<run id>/ and prints a summary.
    Succeeds once the chief does (every worker in mirrored, classic and keras-jax
    mode); a script that fails ends the run (exit 5). Ctrl-C stops everything in
    order (exit 130).

    Example:  tfcluster train sample_clusters/local.yaml -- --steps 500
    """
    from tfcluster.launch.run import runstate, supervisor
    from tfcluster.plan import build_plan
    from tfcluster.spec import (
        check_train_files,
        load_spec,
        with_train_overrides,
    )
    from tfcluster.spec.shipped import scan_scripts

    _only_after_dashes(args or [])
    spec = with_train_overrides(load_spec(spec_path), script=script, args=args, timeout=timeout,
                                tensorboard=tensorboard)
    if not spec.train.script:
        raise UsageError(f"{spec.path}: no training script: set train.script or pass --script",
                         hint="`tfcluster init` writes a template script to start from")
    files = check_train_files(spec)
    text = scan_scripts(spec)       # the script and its helpers, for the Keras and strategy warnings
    p = build_plan(spec, files=files, script_fits=text.fits if text else None, script_scan=text)
    supervisor.check_task_filter(p, tuple(task or ()))
    if dry_run:
        from tfcluster.ui.views import print_plan

        print_plan(ui, p, commands=True)
        return ExitCode.OK
    options = runstate.Options(show=tuple(task or ()), quiet=quiet, runs_dir=runs_dir, grace=p.stop_grace,
                               verbose=verbose, allow_skew=allow_skew)
    return supervisor.train(p, ui, options)


def _only_after_dashes(args: list[str]) -> None:
    """The script's arguments are the words after `--`: a word before it beside SPEC (`train
    lab.yaml train.py`, as one types `python train.py`) would replace train.args unseen."""
    words = app_module.argv
    after = words[words.index("--") + 1:] if "--" in words else []
    stray = args[:len(args) - len(after)] if args[len(args) - len(after):] == after else args
    if stray:
        shown = " ".join(stray)
        raise UsageError(f"train: unexpected {shown!r} after the spec; the script's arguments go after `--`",
                         hint=f"`tfcluster train SPEC -- {shown}` passes them to the script (replacing "
                              f"train.args); `--script FILE` runs another script")


@app.command()
def init(
    mode: str = typer.Argument("between-graph", help="between-graph | classic | coordinator | mirrored | keras-jax"),
    dest: Optional[str] = typer.Argument(None, help="Where to write it: a file, or a directory to write train_<mode>.py in (default: train_<mode>.py here)."),
) -> int:
    """Copy the training-script template for a mode into the current directory.

    Example:  tfcluster init coordinator my_train.py
    """
    from tfcluster.spec.templates import copy_template

    path = copy_template(mode, dest)
    ui.ok(f"wrote {path}")
    ui.info(f"next: in your spec, `train: {{mode: {mode}, script: {path}}}` (the path relative to the "
            f"spec's directory), then `tfcluster plan SPEC` to see what runs where")
    return ExitCode.OK
