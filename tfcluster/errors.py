"""Exit codes and the exception family every core module raises.

The CLI is the only place that catches these (one error boundary); everything
else raises with a one-line message that names the file/line, host or task.
"""
from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1            # generic failure (a host-side error, something did not stop)
    USAGE = 2            # bad command line or bad spec
    CONNECT = 3          # a host could not be reached / authenticated
    PREFLIGHT = 4        # hosts reachable but not fit (python/TF missing, port busy, GPUs)
    TASK_FAILED = 5      # a training task (chief/worker) failed
    TIMEOUT = 6          # a deadline passed (readiness, train.timeout)
    LOCKED = 7           # another tfcluster holds this cluster's lock
    INCONSISTENT = 8     # the workers disagree (variable placement) or cannot train together (strategy)
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


class Cause(enum.Enum):
    """Why a connection failed, as the transport told it apart where it caught the error
    (transport/ssh_connect.py): code decides on this, never on the message's words."""

    REFUSED = "refused"          # the host answered: nothing listens at the port
    UNREACHABLE = "unreachable"  # no route to it (EHOSTUNREACH, ENETUNREACH, EHOSTDOWN)
    TIMEOUT = "timeout"          # the TCP connect went unanswered in time
    RESOLVE = "resolve"          # the address does not resolve here
    HANDSHAKE = "handshake"      # connected, but the SSH handshake failed or timed out
    DROPPED = "dropped"          # sshd dropped the handshake again and again (MaxStartups)
    AUTH = "auth"                # the host refused every key offered
    HOST_KEY = "host-key"        # its host key is unknown, changed or revoked
    PROXY = "proxy"              # the ProxyCommand could not run or exited
    LOST = "lost"                # a host lost during a run (launch/cluster/hostloss.py)
    OTHER = "other"


class ConnectError(TfclusterError):
    """A host could not be reached, authenticated or trusted; `cause` says which."""

    exit_code = ExitCode.CONNECT

    def __init__(self, message: str, *, cause: Cause = Cause.OTHER, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.cause = cause
        # an unknown host key: (port, address, known_hosts) ssh-keyscan records it with
        self.scan: tuple[int, str, str] | None = None


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
    """The tasks of one run disagree about the model (a placement mismatch) or cannot train it
    together (a strategy that does not fit the mode): exit 8."""

    exit_code = ExitCode.INCONSISTENT


class DeadlineError(TfclusterError):
    exit_code = ExitCode.TIMEOUT


class LockedError(TfclusterError):
    """Another tfcluster holds the cluster's lock: its pid and command (`train`, `up`, ...)
    as its lock file says them, None when it says nothing readable."""

    exit_code = ExitCode.LOCKED

    def __init__(self, message: str, *, holder_pid: int | None = None,
                 holder_command: str | None = None, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.holder_pid = holder_pid
        self.holder_command = holder_command


class Terminated(BaseException):
    """SIGTERM, turned into the same orderly stop as Ctrl-C (tasks stopped, state kept).

    Not a KeyboardInterrupt: typer turns those into a silent exit 130."""


def did_you_mean(word: str, choices) -> str:
    """`; did you mean 'x'?` for the closest of `choices` to a word nothing matched, or ""."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
