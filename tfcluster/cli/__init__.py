"""The command line: argument parsing and the one error boundary.

`main()` owns every `except`; the command functions are the program without
error handling. Heavy modules (paramiko, the session machinery) are imported
inside the commands that need them, so `--help` and `plan` stay instant.
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional

import typer

from tfcluster import __version__
from tfcluster.errors import (ExitCode, Terminated, TfclusterError, UsageError, exit_now,
                              terminate_like_ctrl_c)
from tfcluster.ui import UI

HELP = """Run distributed TensorFlow (ps / worker / chief tasks) on your own machines.

One YAML spec names the hosts and jobs; tfcluster starts the TF servers over SSH
(or locally), runs your training script on the workers with the right TF_CONFIG,
streams every task's log with a prefix, and tears it all down.

Examples:

\b
  tfcluster plan sample_clusters/local.yaml    # what runs where (no network)
  tfcluster train sample_clusters/local.yaml   # 1 ps + 2 workers, this machine
  tfcluster up lab.yaml                        # long-lived servers over SSH
  tfcluster status lab.yaml
  tfcluster exec lab.yaml -- nvidia-smi -L     # a command on every host
  tfcluster down lab.yaml                      # stop all, verify it stopped
"""

app = typer.Typer(help=HELP, no_args_is_help=True, add_completion=True,
                  pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]})

_ui = UI()
STOPPED_WATCHING: list[bool] = []   # `logs -f`, `status --watch` end on Ctrl-C: 130, no error line

SpecArg = typer.Argument(..., help="Cluster spec (YAML), e.g. sample_clusters/local.yaml",
                         metavar="SPEC")
SKEW_HELP = "Hosts on different Python or TensorFlow minor versions: warn and go on, not exit 4"


def _seconds(text) -> float:
    """A --timeout in the spec's durations (`90`, `90s`, `30m`, `2h`); a default is a number."""
    from tfcluster.spec.yamltree import DURATION_WORDS, parse_duration

    seconds = float(text) if isinstance(text, (int, float)) else parse_duration(text.strip())
    if seconds is None:
        raise typer.BadParameter(f"{text!r}: must be {DURATION_WORDS}")
    return seconds


def _version(value: bool) -> None:
    if value:
        print(f"tfcluster {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    no_color: bool = typer.Option(False, "--no-color", help="No colours in output."),
) -> None:
    _ui.debug = debug
    if no_color:
        _ui.color = False


def _load(path: str, preview: bool = False):
    """The spec and its plan; `preview`: with the files a train would ship (or why not)."""
    from tfcluster.plan import build_plan
    from tfcluster.spec import load_spec, preview_train_files

    spec = load_spec(path)
    files, problem = preview_train_files(spec) if preview else ((), None)
    return spec, build_plan(spec, files=files, files_problem=problem)


def _plan(path: str):
    return _load(path)[1]


# -- plan --------------------------------------------------------------------------------

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
    from tfcluster.ui.views import print_plan, plan_json

    spec, p = _load(spec_path, preview=True)
    if json_:
        _ui.json(plan_json(p))
    else:
        print_plan(_ui, p, commands=commands)
    if to is not None:
        if to != "slurm":
            raise UsageError(f"plan --to {to!r}: only slurm has a rank mapping to show")
        from tfcluster.cli.render import print_ranks

        print_ranks(p)
    if check:
        from tfcluster.launch import lifecycle
        lifecycle.check(p, _ui, allow_skew=allow_skew)
    return ExitCode.OK


# -- up / down / status ------------------------------------------------------------------

@app.command()
def up(
    spec_path: str = SpecArg,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; touch nothing."),
    timeout: float = typer.Option(120.0, "--timeout", parser=_seconds, metavar="DURATION",
                                  help="How long to wait for every server: seconds, or 90s, 5m."),
    allow_skew: bool = typer.Option(False, "--allow-skew", help=SKEW_HELP + "."),
) -> int:
    """Start the cluster's TF servers and wait until each listens on its port.

    Runs preflight first (reachable, python + tensorflow, GPUs, ports free); if any
    server fails, everything this `up` started is stopped again. Running `up` on a
    cluster that is already up starts nothing.

    Example:  tfcluster up lab.yaml
    """
    p = _plan(spec_path)
    if dry_run:
        from tfcluster.ui.views import print_plan

        print_plan(_ui, p, commands=True)
        return ExitCode.OK
    from tfcluster.launch import lifecycle
    return lifecycle.up(p, _ui, timeout=timeout, allow_skew=allow_skew)


@app.command()
def down(
    spec_path: str = SpecArg,
    grace: float = typer.Option(5.0, "--grace", help="Seconds between TERM and KILL."),
) -> int:
    """Stop every task of the cluster on every host and verify nothing survived.

    Works without local state (reads the hosts' pid files) and is safe to repeat.

    Example:  tfcluster down lab.yaml
    """
    from tfcluster.launch import lifecycle
    return lifecycle.down(_plan(spec_path), _ui, grace=grace)


@app.command()
def status(
    spec_path: str = SpecArg,
    json_: bool = typer.Option(False, "--json", help="Machine-readable output."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh until Ctrl-C (exit 130)."),
    interval: float = typer.Option(2.0, "--interval", help="Seconds between refreshes with --watch."),
) -> int:
    """Each task: running or stopped, pid, uptime, port open.

    Exits 3 (after the table) when a host could not be reached; with --watch it keeps
    refreshing (in place on a terminal, one table after another otherwise).

    Example:  tfcluster status lab.yaml --json
    """
    from tfcluster.launch import lifecycle
    from tfcluster.ui.views import print_status, status_json

    p = _plan(spec_path)
    if watch:
        from tfcluster.cli.runs import watch_status

        return watch_status(p, interval, json_)
    rows, unreachable = lifecycle.status(p, _ui)
    if json_:
        _ui.json(status_json(p, rows))
    else:
        print_status(_ui, p, rows)
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

    Exit code is the worst of the hosts'. The command is passed as words (no shell);
    use `sh -c '...'` for pipes.

    Example:  tfcluster exec lab.yaml --hosts gpu0,gpu1 -- nvidia-smi -L
    """
    from tfcluster.launch.hostexec import exec_on_hosts, exit_code_of
    from tfcluster.watch.logmux import LogMux
    from tfcluster.launch.session import Session

    spec, p = _load(spec_path)
    names = _select_hosts(spec.path, [h.name for h in p.all_hosts], hosts)
    with Session(p, _ui, names) as session:
        outcome = exec_on_hosts(session, command, LogMux(_ui.byte_stdout, names, color=_ui.color))
    return exit_code_of(outcome, _ui)


def _select_hosts(path: str, known: list[str], hosts: str | None) -> list[str]:
    from tfcluster.spec import did_you_mean

    if not hosts:
        return known
    names = list(dict.fromkeys(h.strip() for h in hosts.split(",") if h.strip()))   # a,a: once
    for name in names:
        if name not in known:
            raise UsageError(f"--hosts: no host named {name!r} in {path}"
                             + did_you_mean(name, known))
    return names


# -- train (logs, runs and plot: cli_watch.py) ------------------------------------------

@app.command(context_settings={"allow_interspersed_args": True})
def train(
    spec_path: str = SpecArg,
    args: Optional[List[str]] = typer.Argument(None, help="Script arguments after `--` (replace train.args).",
                                               metavar="[-- ARGS...]"),
    script: Optional[str] = typer.Option(None, "--script", help="Training script (overrides train.script)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; touch nothing."),
    timeout: Optional[float] = typer.Option(None, "--timeout", parser=_seconds, metavar="DURATION",
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
    Exit code follows the chief (all workers in mirrored/classic mode). Ctrl-C stops
    everything in order (exit 130).

    Example:  tfcluster train sample_clusters/local.yaml -- --steps 500
    """
    from tfcluster.launch import supervisor
    from tfcluster.plan import build_plan
    from tfcluster.spec import check_train_files, load_spec, with_train_overrides

    spec = with_train_overrides(load_spec(spec_path), script=script, args=args, timeout=timeout,
                                tensorboard=tensorboard)
    if not spec.train.script:
        raise UsageError(f"{spec.path}: no training script: set train.script or pass --script",
                         hint="`tfcluster init` writes a template script to start from")
    p = build_plan(spec, files=check_train_files(spec))
    if dry_run:
        from tfcluster.ui.views import print_plan

        print_plan(_ui, p, commands=True)
        return ExitCode.OK
    options = supervisor.Options(show=tuple(task or ()), quiet=quiet, runs_dir=runs_dir,
                                 verbose=verbose, allow_skew=allow_skew)
    return supervisor.train(p, _ui, options)


@app.command()
def init(
    mode: str = typer.Argument("between-graph", help="between-graph | classic | coordinator | mirrored"),
    dest: Optional[str] = typer.Argument(None, help="Where to write it (default: train_<mode>.py)."),
) -> int:
    """Copy the training-script template for a mode into the current directory.

    Example:  tfcluster init coordinator my_train.py
    """
    from tfcluster.spec.templates import copy_template

    path = copy_template(mode, dest)
    _ui.ok(f"wrote {path}")
    return ExitCode.OK


# -- the error boundary ------------------------------------------------------------------

def _click(cls: str) -> tuple[type, ...]:
    """`cls` (ClickException, Abort) from whichever click typer uses (typer >= 0.2x vendors its own)."""
    found = []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(getattr(__import__(name, fromlist=[cls]), cls))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def _usage_hint(exc, argv: list[str]) -> str | None:
    if exc.exit_code != 2:
        return None
    if type(exc).__name__ == "NoSuchOption" and "train" in argv and "--" not in argv:
        return "arguments for the training script go after `--`, e.g. `tfcluster train SPEC -- --steps 100`"
    return "see `tfcluster --help`"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _ui.debug = "--debug" in argv
    terminate_like_ctrl_c()
    try:
        rc = app(args=argv, prog_name="tfcluster", standalone_mode=False)
        if rc == ExitCode.INTERRUPTED and not STOPPED_WATCHING:   # typer turned a KeyboardInterrupt
            _ui.error("interrupted")                             # into a plain 130
        return int(rc or 0)
    except TfclusterError as exc:
        if _ui.debug:
            raise
        if exc.details:
            _ui.details(exc.details)
        _ui.error(exc.message, exc.hint)
        return int(exc.exit_code)
    except typer.Exit as exc:
        return exc.exit_code
    except _click("ClickException") as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":
            _ui.stdout.write(exc.format_message() + "\n")  # the help text itself
            return 0
        _ui.error(_once(exc.format_message()), _usage_hint(exc, argv))
        return exc.exit_code
    except Terminated:
        _ui.error("terminated (SIGTERM)")
        return int(ExitCode.TERMINATED)
    except (KeyboardInterrupt, typer.Abort) + _click("Abort"):
        _ui.error("interrupted")
        return int(ExitCode.INTERRUPTED)
    except (BrokenPipeError, SystemExit) as exc:
        # `tfcluster plan ... | head`: the reader left; not an error worth a traceback. click
        # answers a broken pipe itself (it wraps the streams and exits 1) before we see it:
        # its exit is raised while it handles the BrokenPipeError, in every click release.
        if isinstance(exc, SystemExit) and not isinstance(exc.__context__, BrokenPipeError):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # what is still buffered
        return 0


def _once(message: str) -> str:
    """typer and click (>= 8.2) each add a suggestion to an unknown command: keep one."""
    import re

    return re.sub(r"( Did you mean [^?]*\?)(\1)+", r"\1", message)


import tfcluster.cli.render  # noqa: E402,F401  registers `render` on app
import tfcluster.cli.runs  # noqa: E402,F401  registers `logs`, `runs`, `plot` on app


def run() -> None:
    """Console-script entry point."""
    import signal

    rc = main()
    # The outcome is decided and reported: a late second Ctrl-C must not turn the
    # interpreter's shutdown into a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_now(rc)


if __name__ == "__main__":
    run()
