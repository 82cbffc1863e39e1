"""The command line's shared parts: the typer app every command registers on, the one UI,
the spec argument and the loaders. Command modules import this module, never each other or
the package's boundary (tfcluster/cli/__init__.py), so the CLI has no import cycle.
"""
from __future__ import annotations

import typer

from tfcluster import __version__
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

ui = UI()
# the command line as main() got it: `train` tells the words after `--` from stray ones
argv: list[str] = []

SpecArg = typer.Argument(..., help="Cluster spec (YAML), e.g. sample_clusters/local.yaml",
                         metavar="SPEC")
SKEW_HELP = "Hosts on different Python or TensorFlow minor versions: warn and go on, not exit 4"


class StoppedWatching(Exception):
    """Ctrl-C is how one stops watching (`logs -f`, `status --watch`): the boundary then
    exits 130 without an error line or a traceback."""


def seconds(text, zero: bool = False) -> float:
    """A duration option in the spec's words (`90`, `90s`, `30m`, `2h`); a default is a
    number. `zero`: 0 is allowed too (`drain --wait 0`: ask and return)."""
    from tfcluster.spec.yamltree import DURATION_WORDS, parse_duration

    if isinstance(text, (int, float)):
        return float(text)
    text = text.strip()
    seconds = 0.0 if zero and text in ("0", "0s") else parse_duration(text)
    if seconds is None:
        raise typer.BadParameter(f"{text!r}: must be {DURATION_WORDS}" + (" (or 0)" if zero else ""))
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
    ui.debug = debug
    if no_color:
        ui.color = False


def load(path: str, preview: bool = False, scan: bool = False):
    """The spec and its plan; `preview`: with the files a train would ship (or why not);
    `preview` or `scan`: with whether the script calls `.fit(` (the Keras warning's input)."""
    from tfcluster.plan import build_plan
    from tfcluster.spec import load_spec, preview_train_files
    from tfcluster.spec.shipped import scan_scripts

    spec = load_spec(path)
    files, problem = preview_train_files(spec) if preview else ((), None)
    text = scan_scripts(spec) if preview or scan else None     # the script and its helpers
    return spec, build_plan(spec, files=files, files_problem=problem,
                            script_fits=text.fits if text else None, script_scan=text)


def plan_of(path: str):
    return load(path)[1]
