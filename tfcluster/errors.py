"""Exit codes and the exception family every core module raises.

The CLI is the only place that catches these (one error boundary); everything
else raises with a one-line message that names the file/line, host or task.
"""
from __future__ import annotations

import enum
import os
import sys


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1            # generic failure (a host-side error, something did not stop)
    USAGE = 2            # bad command line or bad spec
    CONNECT = 3          # a host could not be reached / authenticated
    PREFLIGHT = 4        # hosts reachable but not fit (python/TF missing, port busy, GPUs)
    TASK_FAILED = 5      # a training task (chief/worker) failed
    TIMEOUT = 6          # a deadline passed (readiness, train.timeout)
    LOCKED = 7           # another tfcluster holds this cluster's lock
    INCONSISTENT = 8     # the workers disagree (variable placement differs between them)
    INTERRUPTED = 130    # Ctrl-C
    TERMINATED = 143     # SIGTERM (a scheduler, `timeout`, systemd)


class TfclusterError(Exception):
    """Base class: a one-line message, an optional hint, and an exit code."""

    exit_code: ExitCode = ExitCode.ERROR

    def __init__(self, message: str, *, hint: str | None = None,
                 exit_code: ExitCode | None = None, details: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details = details  # multi-line context (a log tail) shown before the error line
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message


class SpecError(TfclusterError):
    """The spec file is malformed: message is `FILE:LINE: field.path: problem`."""

    exit_code = ExitCode.USAGE


class UsageError(TfclusterError):
    exit_code = ExitCode.USAGE


class ConnectError(TfclusterError):
    """A host could not be reached, authenticated or trusted."""

    exit_code = ExitCode.CONNECT


class PreflightError(TfclusterError):
    exit_code = ExitCode.PREFLIGHT


class HostError(TfclusterError):
    """Something failed on a host (the shim refused a request, a start failed): exit 1,
    never "a training task failed"."""

    exit_code = ExitCode.ERROR


class TaskError(TfclusterError):
    """A training task (chief/worker script) failed: exit 5."""

    exit_code = ExitCode.TASK_FAILED


class InconsistentError(TfclusterError):
    """The tasks of one run disagree about the model (a placement mismatch): exit 8."""

    exit_code = ExitCode.INCONSISTENT


class DeadlineError(TfclusterError):
    exit_code = ExitCode.TIMEOUT


class LockedError(TfclusterError):
    exit_code = ExitCode.LOCKED


class Terminated(BaseException):
    """SIGTERM, turned into the same orderly stop as Ctrl-C (tasks stopped, state kept).

    Not a KeyboardInterrupt: typer turns those into a silent exit 130."""


def terminate_like_ctrl_c() -> None:
    """SIGTERM (from `timeout`, a scheduler, systemd) stops a run as Ctrl-C does, so the
    tasks are stopped in order and the run's manifest and summary are still written (cli.main)."""
    import signal
    import threading

    def handler(signum, frame) -> None:
        raise Terminated()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def exit_now(rc: int) -> None:
    """Flush what was written and exit without the interpreter's teardown (cli.run).

    Every command has finished its work when main() returns: remote stops are waited for,
    files are closed, and the threads still alive are daemons (paramiko's transports, idle
    pumps) that teardown would abandon anyway. Tearing down ~600 modules and collecting the
    run's objects took 35-60 ms after a `train`'s last line (docs/ARCHITECTURE.md,
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
