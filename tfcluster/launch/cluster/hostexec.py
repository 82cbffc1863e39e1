"""`tfcluster exec`: one command on many hosts, output prefixed per host.

The command runs as plain words through each host's agent (no shim, no Python
needed there, so `exec` can install what the hosts lack), under a small sh that
merges its stderr into stdout and stops it when exec is interrupted.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass

from tfcluster.errors import ExitCode, TfclusterError
from tfcluster.launch.cluster.session import Session

EXEC_FANOUT = 64
# The command runs in the background of a small sh, stderr merged into stdout on the host (lines
# keep their order), stdin /dev/null (as `ssh -n`: a command that reads it sees its end, not a
# pipe held open for ever), in a process group of its own where `setsid` is there. A watcher
# holds the channel's own stdin: its end (exec interrupted, or the launcher gone: ssh closes
# the channel) TERMs that group, which without a terminal would otherwise run on orphaned.
# The status is the shell's: 128+N for a command killed by signal N, which a command's own
# `exit 130` gives too (sh cannot tell them apart), so it is said as both.
_WRAP = ('exec 3<&0 </dev/null; '
         'command -v "$1" >/dev/null 2>&1 || { echo "tfcluster: command not found: $1"; exit 127; }; '
         'if command -v setsid >/dev/null 2>&1; then setsid "$@" 3<&- 2>&1 & else "$@" 3<&- 2>&1 & fi; c=$!; '
         '(cat <&3 >/dev/null 2>&1; kill -TERM -"$c" 2>/dev/null || kill -TERM "$c") >/dev/null 2>&1 & w=$!; '
         'exec 3<&-; '
         'wait "$c"; rc=$?; kill "$w" 2>/dev/null; exit "$rc"')


@dataclass(frozen=True)
class ExecOutcome:
    exit_codes: dict[str, int]              # host -> the command's exit status
    failures: dict[str, BaseException]      # host -> why the command could not run there


def exec_on_hosts(session: Session, argv: list[str], mux) -> ExecOutcome:
    """Run argv on each of the session's hosts in parallel, feeding `mux` per host."""
    wrapped = ["sh", "-c", _WRAP, "sh", *argv]       # argv stays word for word

    def run_one(name: str) -> int:
        try:
            with session.agent(name).run_command(wrapped) as proc:
                while chunk := proc.read(65536):
                    mux.feed(name, chunk)
                return proc.wait()
        finally:
            mux.close_task(name)

    results = session.parallel(run_one, session.host_names, limit=EXEC_FANOUT)
    mux.close()
    return ExecOutcome(
        exit_codes={h: r for h, r in results.items() if not isinstance(r, BaseException)},
        failures={h: r for h, r in results.items() if isinstance(r, BaseException)})


def exit_code_of(outcome: ExecOutcome, ui) -> int:
    """The worst exit status; hosts where the command could not run raise one error (exit 3)."""
    statuses = {host: _status(rc) for host, rc in outcome.exit_codes.items()}
    for host, rc in sorted(outcome.exit_codes.items()):
        if rc == -1:
            ui.warn(f"host {host}: ended without an exit status (killed by a signal?): counted as 255")
        elif rc < 0:
            ui.warn(f"host {host}: killed by signal {-rc} (exit code {statuses[host]})")
        elif 128 < rc < 128 + signal.NSIG:
            ui.warn(f"host {host}: exit code {rc} (128 + {_signal_name(rc - 128)}: the command was "
                    f"killed by that signal, or exited with this code)")
        elif rc:
            ui.warn(f"host {host}: exit code {rc}")
    if outcome.failures:
        first_host, first = next(iter(outcome.failures.items()))
        message = str(first) if isinstance(first, TfclusterError) else f"host {first_host}: {first}"
        others = [h for h in outcome.failures if h != first_host]
        if others:
            message += f" (also failed: {', '.join(others)})"
        raise TfclusterError(message, hint=getattr(first, "hint", None), exit_code=ExitCode.CONNECT)
    return max(statuses.values(), default=0)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _status(rc: int) -> int:
    """A command's status as a shell gives it: killed by signal N (a local process's -N) is
    128+N; no status at all (paramiko's -1: the channel ended with a signal) is 255, as ssh(1)."""
    return 255 if rc == -1 else 128 - rc if rc < 0 else rc
