"""The command line's one error boundary.

`main()` owns every `except`: the commands (cli/cluster.py, train.py, runs.py, render.py,
all registered on cli/app.py's app) are the program without error handling. Only this module
exits the process.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import traceback

import typer

# each registers its commands on app, in the order --help lists them
from tfcluster.cli import cluster, train, render, runs  # noqa: F401, I001
from tfcluster.cli import app as app_module
from tfcluster.cli.app import StoppedWatching, app, ui
from tfcluster.errors import ExitCode, Terminated, TfclusterError

_ctrl_c = threading.Event()      # a Ctrl-C reached this process (main says "interrupted")


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
    ctx = getattr(exc, "ctx", None)      # click's context: the command the mistake is in
    return f"see `{getattr(ctx, 'command_path', None) or 'tfcluster'} --help`"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    app_module.argv[:] = argv
    ui.debug = "--debug" in argv
    terminate_like_ctrl_c()
    try:
        rc = app(args=argv, prog_name="tfcluster", standalone_mode=False)
        # typer turns a KeyboardInterrupt into a plain 130, which a command may also return
        # as its own outcome (`exec` whose command exited 130): only a Ctrl-C is "interrupted"
        if rc == ExitCode.INTERRUPTED and _ctrl_c.is_set():
            ui.error("interrupted")
        return int(rc or 0)
    except StoppedWatching:
        return int(ExitCode.INTERRUPTED)
    except TfclusterError as exc:
        if ui.debug:
            traceback.print_exc()       # then the same line and exit code as without --debug
        if exc.details:
            ui.details(exc.details)
        ui.error(exc.message, exc.hint)
        return int(exc.exit_code)
    except typer.Exit as exc:
        return exc.exit_code
    except _click("ClickException") as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":
            ui.stdout.write(exc.format_message() + "\n")  # the help text itself
            return 0
        ui.error(_once(exc.format_message()), _usage_hint(exc, argv))
        return exc.exit_code
    except Terminated:
        return _stopped(terminated=True)
    except (KeyboardInterrupt, typer.Abort) + _click("Abort"):
        return _stopped(terminated=False)
    except (BrokenPipeError, SystemExit) as exc:
        # `tfcluster plan ... | head`: the reader left; not an error worth a traceback.
        if isinstance(exc, SystemExit) and not _answered_broken_pipe(exc):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # what is still buffered
        return 0
    except OSError as exc:
        # this machine's files refused us (a full disk, a read-only or missing directory given
        # for the output or the state): the file and the system's words, not a traceback
        if ui.debug:
            traceback.print_exc()
        where = f"{exc.filename}: " if exc.filename else ""
        ui.error(f"{where}{exc.strerror or exc}")
        return int(ExitCode.ERROR)
    except Exception as exc:
        # A Ctrl-C or a SIGTERM that lands while a class is made (a dataclass field's
        # __set_name__, in a module imported on first use: the SSH transport's at the first
        # connection) comes out of Python 3.11 wrapped in a RuntimeError
        signalled = _signal_behind(exc)
        if signalled is None:
            raise
        return _stopped(terminated=isinstance(signalled, Terminated))


def _stopped(terminated: bool) -> int:
    """A stop by SIGTERM or Ctrl-C: one line, its exit code."""
    if terminated:
        ui.error("terminated (SIGTERM)")
        return int(ExitCode.TERMINATED)
    ui.error("interrupted")
    return int(ExitCode.INTERRUPTED)


def _signal_behind(exc: BaseException) -> BaseException | None:
    """The KeyboardInterrupt or Terminated this exception was raised from, if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (KeyboardInterrupt, Terminated)):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _answered_broken_pipe(exc: SystemExit) -> bool:
    """Whether this exit is click's answer to a broken pipe: it wraps the streams in a
    PacifyFlushWrapper (`_PacifyFlushWrapper` from click 8.5 on, which the name check of
    old missed) and exits 1. Typer's copy of click's main exits while it handles the
    BrokenPipeError; click 8.5's own main exits just after it."""
    wrapped = type(sys.stdout).__name__.lstrip("_") == "PacifyFlushWrapper"
    return exc.code == 1 and (wrapped or isinstance(exc.__context__, BrokenPipeError))


def _once(message: str) -> str:
    """typer and click (>= 8.2) each add a suggestion to an unknown command: keep one."""
    import re

    return re.sub(r"( Did you mean [^?]*\?)(\1)+", r"\1", message)


def run() -> None:
    """Console-script entry point."""
    rc = main()
    # The outcome is decided and reported: a late second Ctrl-C must not turn the
    # interpreter's shutdown into a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_now(rc)


def terminate_like_ctrl_c() -> None:
    """SIGTERM (from `timeout`, a scheduler, systemd) stops a run as Ctrl-C does, so the
    tasks are stopped in order and the run's manifest and summary are still written (main)."""
    def handler(signum, frame) -> None:
        raise Terminated()

    def ctrl_c(signum, frame) -> None:
        _ctrl_c.set()
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, ctrl_c)


def exit_now(rc: int) -> None:
    """Flush what was written and exit without the interpreter's teardown (run).

    Every command has finished its work when main() returns: remote stops are waited for,
    files are closed, and the threads still alive are daemons (paramiko's transports, idle
    pumps) that teardown would abandon anyway. Tearing down ~600 modules and collecting the
    run's objects took 35-60 ms after a `train`'s last line (docs/design/remote-execs.md,
    "Start-up cost"); nothing is registered with atexit that must run.
    """
    import logging

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a reader that left (BrokenPipe) or a closed stream
            pass
    logging.shutdown()
    os._exit(rc)


if __name__ == "__main__":
    run()
