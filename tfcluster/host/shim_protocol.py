"""The shim protocol, defined once: both the shim (on the host) and HostAgent import it.

Shipped to every host beside shim.py, so: standard library only, Python >= 3.8, no
tfcluster imports. See docs/ARCHITECTURE.md, "The shim protocol".

A request is one JSON line on the shim's stdin; a one-shot answer is one JSON line
on stdout. Streaming commands (`wait`, `launch`) answer one line per event. An
attached `start` answers its handshake on stderr, then copies the task's log to
stdout while reading control lines from stdin. Any failure is the envelope
{"error": "one line"}; nothing else ever has an "error" key.
"""
from __future__ import annotations

import json

# Commands
INFO = "info"            # python/TF/Keras versions, TF build (CUDA/cuDNN), GPUs + driver, machine id
                         # ({"light": true}: python version and machine id only)
PORTS = "ports"          # port -> null (free) or who holds it
STATUS = "status"        # pid files of a tag prefix, each verified alive or not
STOP = "stop"            # TERM, grace, KILL, sweep by tag
TAIL = "tail"            # last lines of a log
FILES = "files"          # place cached files into a run dir
BATCH = "batch"          # several one-shot commands in one exec, answers keyed by command
START = "start"          # one task; attached (dies with the launcher) or detached
WAIT = "wait"            # stream: each server's readiness
LAUNCH = "launch"        # stream: start detached servers, then wait for them
REACH = "reach"          # stream: listen on task ports, connect to every task address
UP = "up"                # stream: batch, warm the servers, reach, then launch on GO (shim_launch.py)
DOWN = "down"            # stop, then wait until the ports can be bound again (shim.cmd_down)
FENCE = "fence"          # close the cluster's task ports to other users (shim_fence.py), or say why not
CKPT = "ckpt"            # stream: the newest complete checkpoint of a directory (shim_ckpt.py)
NOTICE = "notice"        # stream: the host's notices that it is about to go (shim_notice.py)

ONE_SHOT = (INFO, PORTS, STATUS, STOP, TAIL, FILES, BATCH, DOWN, FENCE)
BATCHABLE = (INFO, PORTS, STATUS, STOP, TAIL, FILES, DOWN, FENCE)
# Safe to run inside the launcher's own process (a local host on tfcluster's own
# interpreter): they neither write to fd 1/2 nor end the process.
IN_PROCESS = ONE_SHOT

# Control lines the launcher sends to an attached start's stdin.
STOP_LINE = b"STOP\n"
# STOP, from a launcher whose move starts the cluster's next tasks on this host: the host's
# fence table stays when this was its last task (the move replaces it whole, meanwhile).
STOP_KEEP_LINE = b"STOP keep\n"
HEARTBEAT_LINE = b"HB\n"
CONTINUE_LINE = b"CONT\n"       # the launcher took note of a restart in place: its output may follow
SAVE_LINE = b"SAVE\n"           # the checkpoint request: SIGUSR1 to the task (the script contract's)
# An attached start asked to deflate writes this before its deflated stdout; what comes
# before it (a login shell's words) is not the task's.
DEFLATE_MARK = b"\x00tfcluster-deflate\x00"

# Restarts in place (docs/design/restarts.md, "Restarts in place"). A start request may carry
# {"restart": {"policy", "max_restarts", "done", "zero_ends"}}; the shim then restarts its
# task itself when should_restart says so (never an exit 0 with zero_ends, a script's
# success) while its launcher is there, with RESTART_VAR set to the
# count, and says on stderr {"restarted": n, "exit": N, "pid": P, "at": K}: K is the number
# of stdout bytes before the new attempt's first. Those follow only after CONTINUE_LINE; a
# launcher that does not want the restart sends STOP_LINE instead.
RESTARTED = "restarted"
RESTART_VAR = "TFCLUSTER_RESTART"   # in the task's environment: how many restarts came before it
ON_FAILURE, EXIT_CODE = "on-failure", "exit-code"
# `exit-code` retries what a restart can fix: a task killed by a signal (128+N, OOM
# killer, a lost host) or an infrastructure failure; exits 1-127 are the script's own.
RETRYABLE = range(128, 256)


def retryable(policy: str, rc: int) -> bool:
    """Whether the policy restarts a process that exited with `rc` at all."""
    return policy == ON_FAILURE or (policy == EXIT_CODE and rc in RETRYABLE)


def should_restart(policy: str, max_restarts: int, rc: int, restarts_done: int) -> bool:
    """The one restart decision: the supervisor's (policy.py) and the shim's."""
    return retryable(policy, rc) and restarts_done < max_restarts

# An attached start's last stderr line, once its own sweep left nothing of the task's tag:
# {"exit": N, "swept": true}. A launcher that got it from every shim of a run skips the
# run's stop sweep (docs/ARCHITECTURE.md, "The remote process model").
SWEPT = "swept"

# Defaults both sides share.
DEFAULT_GRACE = 5.0              # seconds between TERM and KILL
PORT_SETTLE = 5.0                # seconds `down` waits for a just-killed server's socket to go
DEFAULT_HEARTBEAT_TIMEOUT = 30.0  # an attached task whose launcher is silent this long is stopped
HEARTBEATS_PER_TIMEOUT = 3       # the launcher beats three times per timeout

TAG_VAR = "TFCLUSTER_JOB_ID"     # the environment variable that carries a task's tag
SHIM_VAR = "TFCLUSTER_SHIM"      # the pid of the shim that started the task: its sweeps spare another's
HOLD_VAR = "TFCLUSTER_HOLD"      # "1": a warm TF server; it binds its port only after a GO line
GO_LINE = b"GO\n"
# GO with the server's TF_CONFIG (one line of JSON) after it: a server held before its cluster
# was known (a held server, launch/run/heldservers.py) serves the cluster it is given.
GO_WITH = b"GO "
PROBE_VAR = "TFCLUSTER_PROBE"    # "placement,waits": run the start-up probe (probe/) in this task
FLUSH_VAR = "TFCLUSTER_STDOUT_FLUSH"  # seconds: the probe buffers the script's stdout, flushed this often
EXIT_ERROR = 3                   # the shim's exit status after an error envelope


class ShimError(Exception):
    """A request the shim cannot honour; reported as the error envelope."""


def error_answer(text: str) -> dict:
    return {"error": text}


def error_of(answer) -> str | None:
    """The envelope's text, or None when `answer` is not an error."""
    if isinstance(answer, dict) and "error" in answer:
        return str(answer["error"])
    return None


def describe_exception(exc: BaseException) -> str:
    # shim_fs.Refused (one line naming the path and the fix) cannot import ShimError
    one_line = isinstance(exc, ShimError) or getattr(exc, "one_line", False)
    return str(exc) if one_line else "%s: %s" % (type(exc).__name__, exc)


def json_line(obj) -> bytes:
    """One protocol line: compact JSON and a newline."""
    return (json.dumps(obj) + "\n").encode()
