"""The run's decisions as pure functions: is this exit retried, has the run succeeded,
what stops when. The supervisor does the I/O; these say what to do, so they are tested
with tables in milliseconds, without TensorFlow.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from tfcluster.host import shim_protocol as proto


class Restart(Protocol):
    """train.restart as the plan carries it."""

    policy: str            # never | on-failure | exit-code
    max_restarts: int

NEVER, ON_FAILURE, EXIT_CODE = "never", proto.ON_FAILURE, proto.EXIT_CODE
RETRYABLE = proto.RETRYABLE     # exit-code's retries: killed by a signal, lost host (128-255)
CHIEF_ENDS_RUN = ("between-graph", "coordinator")   # other modes need every worker
TRAINING_JOBS = ("chief", "worker")
# Modes whose processes start together and cannot take one back alone: JAX's coordination
# service refuses a restarted process of an old incarnation, and the others die with the one
# that went, so a failure restarts every process, from the checkpoint (docs/modes.md).
TOGETHER = ("keras-jax",)


def stop_wave(role: str, job: str) -> int:
    """When a task stops in a run's stop or a restart of every task: 0, the scripts that
    train, first, so that the chief's last checkpoint can still read the variables; 1, what
    serves those variables: the servers, and the ps's own script in classic mode (it is its
    server: stopped with the others, the chief's save on SIGTERM found no ps and was KILLed)."""
    return 0 if role == "script" and job != "ps" else 1


STOP_WAVES = (0, 1)
PEER_GRACE = 60.0        # how long other workers and evaluators may take to finish after the chief succeeded


@dataclass(frozen=True)
class ScriptState:
    job: str
    is_chief: bool
    exit_code: int | None          # None while running


def restarts_together(mode: str) -> bool:
    """Whether a failed script restarts every script of the run, not itself alone."""
    return mode in TOGETHER


def retryable(restart: Restart, rc: int) -> bool:
    """Whether the policy restarts a process that exited with `rc` at all."""
    return proto.retryable(restart.policy, rc)


def should_restart(restart: Restart, rc: int, restarts_done: int) -> bool:
    """Defined once, in shim_protocol: an attached shim applies it to restart in place."""
    return proto.should_restart(restart.policy, restart.max_restarts, rc, restarts_done)


def ended_by_stop(stopping: bool, rc: int | None) -> bool:
    """Whether a process's end is the stop's, not a failure of its own: it was stopping and
    went by a signal (128-255: SIGTERM, the KILL after the grace, the templates' 143 after
    saving). A process stopped while it was already failing (an exception's exit 1, as two
    processes of one JAX run fail together) keeps its exit code."""
    return stopping and rc is not None and rc in RETRYABLE


def run_succeeded(mode: str, scripts: Sequence[ScriptState]) -> bool:
    """between-graph / coordinator: the chief exited 0 and every other training script and
    evaluator has ended (or PEER_GRACE runs out, which the supervisor times: an evaluator
    evaluates the chief's last checkpoint after the chief ends); mirrored / classic: every
    chief and worker exited 0."""
    training = [s for s in scripts if s.job in TRAINING_JOBS]
    if mode not in CHIEF_ENDS_RUN:
        return bool(training) and all(s.exit_code == 0 for s in training)
    chiefs = [s for s in scripts if s.is_chief]
    if not chiefs or chiefs[0].exit_code != 0:
        return False
    return all(s.exit_code is not None for s in scripts if s.job in (*TRAINING_JOBS, "evaluator"))


def starts_peer_grace(mode: str, is_chief: bool, rc: int) -> bool:
    """A chief that succeeds in a chief-ends-the-run mode gives the others PEER_GRACE."""
    return rc == 0 and is_chief and mode in CHIEF_ENDS_RUN


def restart_hint(restart: Restart, restarts_done: int, rc: int) -> str | None:
    """What to tell the user when a failed process is not restarted."""
    if retryable(restart, rc):
        return (f"it failed {restarts_done + 1} times "
                f"(train.restart.max_restarts = {restart.max_restarts})")
    if restart.policy == NEVER and rc in RETRYABLE:
        # 1-127 is the script's own verdict (SyntaxError, ImportError, bad arguments): a
        # restart would fail the same way, so no hint to restart it
        return "set train.restart: {policy: on-failure} in the spec to restart failed tasks"
    return None


def ignored_term(mode: str, keys: Sequence[str], grace: float) -> str:
    """What to say of scripts the run's stop killed: they still ran `grace` seconds after
    SIGTERM. MultiWorkerMirroredStrategy installs a SIGTERM handler of its own (a preemption
    notice, docs/design/processes.md "Ctrl-C and SIGTERM") and trains on."""
    text = (f"{', '.join(keys)} still ran {grace:.0f}s after SIGTERM, so "
            f"{'it was' if len(keys) == 1 else 'they were'} killed")
    if mode == "mirrored":
        text += ("; TensorFlow's MultiWorkerMirroredStrategy takes SIGTERM as a preemption notice and "
                 "trains on: have the script exit on it (a SIGTERM handler, as the mirrored template has)")
    return text


# -- a lost host (docs/design/host-loss.md) --------------------------------------------------

FAIL, SHRINK, RESTART = "fail", "shrink", "restart"   # what the run does
SPARE = "spare"         # train.on_host_loss's default with spares (FAIL and SHRINK are choices too)


@dataclass(frozen=True)
class LostTask:
    job: str
    is_chief: bool


def on_host_loss(mode: str, choice: str, lost: Sequence[LostTask], spare: bool) -> tuple[str, str]:
    """(what the run does, why) when a host holding `lost` is gone, under train.on_host_loss
    `choice` (spare | shrink | fail), `spare` whether a spare can take its tasks.

    shrink: go on without them (a plain worker, where the chief ends the run). restart: stop
    every task and start them all again on the new cluster, resuming from the checkpoint:
    every task at a new address has someone who dials the old one (a ps pulls a worker's
    gradients from the address its ClusterSpec started with; the coordinator's cluster and
    MirroredStrategy's collectives are fixed at their start), a ps holds variables, a chief the
    checkpoints. fail: end the run."""
    if not lost:
        return SHRINK, "it held no task"
    plain = all(t.job == "worker" and not t.is_chief for t in lost)
    if choice == FAIL:
        return FAIL, "train.on_host_loss is fail"
    if choice == SHRINK and plain and mode in CHIEF_ENDS_RUN:
        return SHRINK, "its workers are not needed to finish (train.on_host_loss: shrink)"
    if not spare:
        if choice == SHRINK and mode == "mirrored":
            return FAIL, "MultiWorkerMirroredStrategy cannot shrink: every worker holds a share of each step"
        if choice == SHRINK and mode == "keras-jax":
            return FAIL, "JAX cannot shrink: its process count is fixed when its processes start"
        if choice == SHRINK and plain:
            return FAIL, f"{mode} mode needs every worker to finish, so it cannot shrink"
        what = "its workers" if plain else "a " + ("chief" if any(t.is_chief for t in lost) else "ps") + " task"
        return FAIL, f"no spare host (or none left) can take {what}"
    return RESTART, restart_reason(mode, lost)


def restart_reason(mode: str, lost: Sequence[LostTask]) -> str:
    """Why every task restarts (what follows it is always: from the checkpoint)."""
    if mode == "mirrored":
        return "MultiWorkerMirroredStrategy starts every worker together"
    if mode == "keras-jax":
        return "JAX starts every process together"
    if any(t.job == "ps" for t in lost):
        return "a ps held the variables"
    if any(t.is_chief for t in lost):
        return "the chief is gone"
    if mode == "coordinator":
        return "the coordinator's cluster is fixed at its start"
    return "a ps dials each worker at the address it started with"
