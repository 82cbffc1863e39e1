"""Known failure signatures of distributed TF: how a task's output ends when it fails in a
way seen before, what happened, and the fix.

A failed task's summary reads the end of its saved log (bounded: the last TAIL_BYTES of its
last attempt), not the few lines the live view kept: a Keras error under
MultiWorkerMirroredStrategy prints a whole batch of tensors inside its message, and its
first line is hundreds of lines up. The table, with each entry's real output: the user
guide's docs/troubleshooting.md, "Failures tfcluster recognises"; how it is matched:
docs/design/diagnoses.md, "Failure signatures". Pure but for `read_tail`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from tfcluster.localfs import saved_tail

TAIL_BYTES = 256 * 1024        # how much of a failed task's saved log is read
LINE_CHARS = 200               # a matched line quoted in the summary, at most
TAIL_LINE_CHARS = 500          # a line of an unmatched failure's tail, at most
RESTART_NOTE = b"[tfcluster] exited with code "   # restart_note as LogMux saves it

_LEGACY = ("set `train.keras: legacy` in the spec (every task gets TF_USE_LEGACY_KERAS=1; each host "
           "needs `pip install --no-deps tf_keras` matching its TensorFlow)")


@dataclass(frozen=True)
class Signature:
    """One known failure: a line holding any of `needles`, in a tail that also holds every
    one of `also`, of a task of one of `jobs` (none: any job)."""

    name: str
    needles: tuple[bytes, ...]
    what: str                                   # what happened, one sentence
    fix: str                                    # the fix in any mode without its own
    also: tuple[bytes, ...] = ()
    jobs: tuple[str, ...] = ()
    fixes: dict[str, str] = field(default_factory=dict)   # mode -> its own fix
    consequence: bool = False                   # this task failed because another did first

    def fix_for(self, mode: str) -> str:
        return self.fixes.get(mode, self.fix)


SIGNATURES = (
    Signature(
        "keras3-mwms-fit", (b"Attempt to convert a value (PerReplica:{",),
        "Keras 3 cannot run model.fit under MultiWorkerMirroredStrategy (keras-team/keras#20585)",
        f"{_LEGACY}, or train with a custom training loop",
        also=(b"with an unsupported type",)),
    Signature(
        "keras3-pss-fit", (b"you need to pass this dataset to ClusterCoordinator.create_per_worker_dataset",),
        "Keras 3's model.fit does not support ParameterServerStrategy (keras-team/keras#18624)",
        f"{_LEGACY}, or train with a ClusterCoordinator loop "
        f"(coordinator.create_per_worker_dataset, coordinator.schedule)",
        also=(b"/keras/",)),
    Signature(
        "pss-dataset", (b"you need to pass this dataset to ClusterCoordinator.create_per_worker_dataset",
                        b"You need to use this dataset in ClusterCoordinator.create_per_worker_dataset"),
        "under ParameterServerStrategy the coordinator iterated a dataset itself",
        "build it with coordinator.create_per_worker_dataset(dataset_fn) and use its iterator "
        "inside coordinator.schedule"),
    Signature(
        "keras3-reset-states", (b"object has no attribute 'reset_states'",),
        "Keras 3 metrics have no reset_states() (Keras 3 calls it reset_state())",
        f"call metric.reset_state(), which both Keras versions have, or {_LEGACY}"),
    Signature(
        "keras3-legacy-optimizer", (b"`keras.optimizers.legacy` is not supported in Keras 3",),
        "Keras 3 has no tf.keras.optimizers.legacy",
        f"use the optimizer of the same name in tf.keras.optimizers, or {_LEGACY}",
        # the parameter-server tutorial's model.fit: Keras 3 cannot run it whatever its optimizer
        fixes={"coordinator": f"{_LEGACY}: Keras 3's model.fit cannot run under ParameterServerStrategy "
                              f"whatever the optimizer (in a ClusterCoordinator loop, the optimizer of the "
                              f"same name in tf.keras.optimizers does)"}),
    # Mode keras-jax (Keras 3 and JAX over many processes). The backend's own first:
    # keras3-missing-api would take its AttributeError for a Keras 2 API.
    Signature(
        "keras-backend-not-jax", (b"distribution_lib' has no attribute 'initialize'",),
        "keras.distribution.initialize() ran on a Keras backend other than JAX, and only JAX runs "
        "Keras 3 on many processes",
        "set `train.mode: keras-jax`: it runs Keras 3's distribution API, with KERAS_BACKEND=jax for "
        "every process (TensorFlow's modes run TensorFlow's strategies)",
        fixes={"keras-jax": "remove the script's own KERAS_BACKEND setting (`os.environ[\"KERAS_BACKEND\"] "
                            "= ...` before `import keras`, or a keras.json it reads): mode keras-jax sets "
                            "KERAS_BACKEND=jax for every process"}),
    Signature(
        # keras-io's guides set KERAS_BACKEND=jax themselves: under a TensorFlow mode nothing
        # names a coordinator
        "jax-no-coordinator", (b"coordinator_address should be defined",),
        "keras.distribution.initialize() (or jax.distributed.initialize()) found no JAX coordinator "
        "to join: tfcluster names one to every process (worker 0's address) only in mode keras-jax",
        "set `train.mode: keras-jax` for a Keras 3 script on JAX (TensorFlow's modes run "
        "TensorFlow's strategies)"),
    Signature(
        "jax-device-put-differs", (b"passed to device_put is not the same on each process",),
        "a value put on a sharding over every process's devices differed between the processes: "
        "JAX takes such a value to be the same in every process, and each passed its own (its "
        "slice of the data, or weights from an initializer without a common seed)",
        "make each process's slice of a batch one global array with "
        "jax.make_array_from_process_local_data(sharding, local_batch) (Keras' fit does so under a "
        "keras.distribution); for values meant to be equal, the same seed in every process "
        "(keras.utils.set_random_seed(N) before building the model)"),
    Signature(
        "jax-device-count", (b"AssertionError",),
        "the JAX processes see different numbers of local devices, and JAX needs the same count "
        "in every process (hosts with different GPU counts, or XLA_FLAGS forcing a CPU device "
        "count in some processes only)",
        "give every process the same devices: the same GPUs per host (hosts[].gpus), one process "
        "per GPU (jobs.worker.per_gpu: true), and the same XLA_FLAGS everywhere",
        also=(b"in _get_mesh_devices",)),
    Signature(
        # keras-io's distribution guide builds DeviceMesh(shape=(8,)) for one host's 8 GPUs
        "keras-mesh-shape", (b"Shape does not match the number of devices",),
        "the script's DeviceMesh names another number of devices than the cluster has: "
        "keras.distribution.list_devices() returns every process's devices together (the "
        "processes times the devices each sees), and the mesh's shape must multiply to that",
        "build the mesh from what list_devices() returns, e.g. `devices = "
        "keras.distribution.list_devices()` then `DeviceMesh(shape=(len(devices),), "
        "axis_names=[\"data\"], devices=devices)`, or `DataParallel(devices=devices)` with no mesh",
        also=(b"/keras/",)),
    Signature(
        "jax-incarnation", (b"unexpectedly tried to connect with a different incarnation",
                            b"wrong service incarnation", b"from a newer incarnation"),
        "a JAX process restarted alone: JAX's coordination service refuses a process of a new "
        "incarnation, so every process must start again together",
        "restart every process, from the checkpoint: mode keras-jax does so with train.restart "
        "{policy: on-failure}; a script must not call jax.distributed.initialize again in a "
        "process that already joined"),
    Signature(
        # jax 0.10 ends such a process with the dead-peer line, then the call that failed
        "jax-coordinator-unreachable", (b"Failed to connect to distributed JAX controller",
                                        b"failed to register with the leader",
                                        b"CoordinationService/RegisterTask"),
        "this process could not reach JAX's coordinator (process 0, worker 0's address and port) "
        "in time, or some processes never joined",
        "look at worker:0's log (process 0 serves the coordinator: did it start, or fail first?); "
        "`tfcluster plan --check SPEC` dials worker 0's port from every host", consequence=True),
    Signature(
        "jax-peer-died", (b"heartbeat timeout. This indicates that the remote task has failed",
                          b"stopped sending heartbeats",
                          b"Terminating process because the JAX distributed service detected fatal errors",
                          b"Gloo all-reduce failed"),
        "another JAX process died or stopped answering (its connection closed mid-collective, or "
        "JAX's coordination service missed its heartbeats), and JAX ends every process with it",
        "the first failure is in another process's log (`tfcluster logs`); with train.restart "
        "{policy: on-failure} mode keras-jax restarts every process from the checkpoint", consequence=True),
    Signature(
        "jax-barrier", (b"Barrier timed out",),
        "the JAX processes are out of step: one reached a barrier (a checkpoint, a collective) "
        "the others never did",
        "every process must run the same steps: the same data count per process (whole batches), "
        "the same epochs, and any save or gather called by every process"),
    Signature(
        "keras3-missing-api", (b"AttributeError: module 'keras.",),
        "the script uses a tf.keras API of Keras 2 that Keras 3 does not have (TensorFlow's "
        "tutorials were written for Keras 2: DatasetCreator, tf.keras.utils.experimental, ...)",
        f"{_LEGACY}, or port the script to Keras 3's API",
        also=(b"has no attribute",)),
    Signature(
        "keras3-tf-op-on-input", (b"A KerasTensor cannot be used as input to a TensorFlow function",),
        "a TensorFlow function (tf.reduce_mean, tf.concat, ...) was called on a Keras 3 model input "
        "(a KerasTensor) while building a functional model; Keras 2 wrapped such calls in layers "
        "itself, Keras 3 does not (TensorFlow's parameter server tutorial does this)",
        f"use the keras.ops function of the same name (keras.ops.mean for tf.reduce_mean) or wrap the "
        f"call in a layer, or {_LEGACY}"),
    Signature(
        "tf-estimator-removed", (b"has no attribute 'estimator'", b"cannot import name 'estimator' from 'tensorflow",
                                 b"No module named 'tensorflow.python.estimator'",
                                 b"No module named 'tensorflow_estimator'"),
        "the script uses tf.estimator, which TensorFlow removed in 2.16",
        "port it to Keras (model.fit under MultiWorkerMirroredStrategy, `train.mode: mirrored`; "
        "TensorFlow's guide: tensorflow.org/guide/migrate/migrating_estimator), or run it with "
        "TensorFlow 2.15 or older on every host (`python:` naming that interpreter)"),
    Signature(
        "collectives-late", (b"Collective ops must be configured at program startup",),
        "MultiWorkerMirroredStrategy was created after TensorFlow had already run something "
        "(an op, a tensor, a dataset, a device query)",
        "create the strategy first, straight after `import tensorflow`, before anything else "
        "touches TensorFlow"),
    Signature(
        "evaluator-strategy", (b"KeyError: 'evaluator'",),
        "the evaluator created MultiWorkerMirroredStrategy, which cannot run there: TensorFlow "
        "keeps the evaluator out of the cluster that trains (its TF_CONFIG names no evaluator job)",
        "in the evaluator (TF_CONFIG's task type `evaluator`) create no strategy: evaluate the "
        "checkpoints the workers write, e.g. with tf.keras.utils.SidecarEvaluator",
        also=(b"multi_worker_util",)),
    Signature(
        "evaluator-pss", (b"Could not start gRPC server",),
        "the evaluator created ParameterServerStrategy, which joins the cluster as its "
        "coordinator, on the chief's address, whose port the chief's server holds",
        "in the evaluator (TF_CONFIG's task type `evaluator`) create no strategy: evaluate the "
        "checkpoints the chief writes, e.g. with tf.keras.utils.SidecarEvaluator",
        also=(b"_connect_to_cluster",), jobs=("evaluator",)),
    Signature(
        "port-bound", (b"Could not start gRPC server", b"Address already in use"),
        "a TF server could not bind its task's port: something already listens there",
        "another process holds the port (a task of an earlier run: `tfcluster status SPEC` and "
        "`tfcluster down SPEC`; or another program): free it or give the task another port",
        fixes={
            "between-graph": "in between-graph mode tfcluster already runs this task's TF server; "
                             "a script that builds its own tf.distribute.Server (old "
                             "--job_name/--task_index style) needs `train.mode: classic`",
            "mirrored": "MultiWorkerMirroredStrategy starts this task's server itself, from "
                        "TF_CONFIG: drop the script's own tf.distribute.Server, or run an old-style "
                        "trainer in `train.mode: classic`",
            "coordinator": "in coordinator mode tfcluster runs the ps and worker servers and "
                           "ParameterServerStrategy starts the chief's: drop the script's own "
                           "tf.distribute.Server",
        }),
    Signature(
        "no-tensorflow", (b"No module named 'tensorflow'",),
        "a Python without TensorFlow ran the script's code (tfcluster checked the spec's "
        "`python:`, so the script or a process it started used another interpreter or environment)",
        "start child processes with sys.executable, and set `python:` in the spec to the "
        "interpreter that has TensorFlow"),
    Signature(
        "bad-arguments", (b"error: unrecognized arguments", b"error: the following arguments are required",
                          b": error: argument "),
        "the script rejected its arguments",
        "check train.args (or the arguments after `--`)"),
)


@dataclass(frozen=True)
class Diagnosis:
    name: str
    what: str
    fix: str
    line: str          # the line that matched, on one line, clipped
    consequence: bool = False   # of another task's failure (Signature.consequence)


def diagnose(mode: str, tail: bytes, job: str = "", signatures=SIGNATURES) -> Diagnosis | None:
    """The signature whose line comes last in `tail`, the output of a task of `job` as it
    ended (the table's order breaks a tie), or None."""
    best: tuple[int, Signature] | None = None
    for sig in signatures:
        if sig.jobs and job not in sig.jobs:
            continue
        at = max(tail.rfind(n) for n in sig.needles)
        if at >= 0 and all(a in tail for a in sig.also) and (best is None or at > best[0]):
            best = (at, sig)
    if best is None:
        return None
    at, sig = best
    start = tail.rfind(b"\n", 0, at) + 1
    end = tail.find(b"\n", at)
    line = tail[start:] if end < 0 else tail[start:end]
    return Diagnosis(sig.name, sig.what, sig.fix_for(mode), clip(line.decode("utf-8", "replace")), sig.consequence)


# The exception line of a failed task: the line Python prints after the frames of its last
# traceback, `ValueError: A KerasTensor cannot ...` (a dotted class name, a colon and the
# message's first line, or the bare name). A message may go on for many lines after it
# (Keras 3 appends paragraphs of help), so it is looked for, not taken from the end.
TRACEBACK = b"Traceback (most recent call last):"
# a class name as Python's own exceptions end (Error, Exception, Exit, Interrupt, Warning,
# StopIteration, ExceptionGroup), or, for the first unindented line, any class-like name
_EXC_NAMED = re.compile(rb"(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Warning|Iteration|Group)"
                        rb"(?::(?: |$)|$)")
_EXC_ANY = re.compile(rb"(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?::(?: |$)|$)")
EXCERPT_LINES = 15             # lines of an unmatched failure's excerpt


def exception_line(tail: bytes) -> str | None:
    """The exception line of the last traceback in `tail` (None: no traceback, or it was cut
    before its exception line). After `Traceback (most recent call last):` the frames are
    indented; the first line that names an exception class is the one (another thread's
    unindented line may come in between, so a named class is preferred to any unindented
    line)."""
    at = tail.rfind(TRACEBACK)
    if at < 0:
        return None
    lines = tail[at + len(TRACEBACK):].split(b"\n")[1:]
    unindented = [line.rstrip(b"\r") for line in lines if line[:1] not in (b" ", b"\t", b"")]
    found = next((line for line in unindented if _EXC_NAMED.match(line)), None)
    if found is None:
        found = next((line for line in unindented if _EXC_ANY.match(line)), None)
    return None if found is None else found.decode("utf-8", "replace")


def failure_excerpt(shown: list[str], tail: bytes, n: int = EXCERPT_LINES) -> list[str]:
    """What the summary shows of a failure no signature names: the last `n` lines shown of the
    task (`shown`, its live history), always with its exception line (exception_line of its
    saved log's `tail`): when that line is further up, it comes first, then how many lines
    are left out, then the last lines. Each line cut to TAIL_LINE_CHARS."""
    last = shown[-n:]
    exc = exception_line(tail)
    if exc is not None and not any(_same(line, exc) for line in last):
        older = shown[:-n] if n else shown
        at = next((i for i in range(len(older) - 1, -1, -1) if _same(older[i], exc)), None)
        between = f"… {len(older) - at - 1 + 2} lines …" if at is not None else "… (more lines in its whole log) …"
        last = [exc, between, *last[2:]]
    return [clip(line, TAIL_LINE_CHARS, squeeze=False) for line in last]


def _same(shown: str, exc: str) -> bool:
    """A line of the live history is the exception line (the history keeps 4 KiB of a line)."""
    return shown == exc or (shown.endswith("…") and exc.startswith(shown[:-1]))


def restart_note(rc: int, count: str) -> str:
    """The note LogMux saves between two attempts of a task (last_attempt reads after it)."""
    return f"exited with code {rc}; restarting ({count})"


def last_attempt(tail: bytes) -> bytes:
    """`tail` from where the last attempt began (after LogMux's restart note)."""
    at = tail.rfind(RESTART_NOTE)
    if at < 0:
        return tail
    end = tail.find(b"\n", at)
    return b"" if end < 0 else tail[end + 1:]


def read_tail(path: str, limit: int = TAIL_BYTES) -> bytes:
    """The last `limit` bytes of the saved log at `path`, from its first whole line (b"" if it
    cannot be read, or is no regular file: localfs.saved_tail)."""
    try:
        return saved_tail(path, limit)
    except OSError:
        return b""


def clip(line: str, n: int = LINE_CHARS, squeeze: bool = True) -> str:
    """`line` in at most `n` characters (a long one cut, saying how long it was); with
    `squeeze` its runs of whitespace are single spaces first."""
    if squeeze:
        line = " ".join(line.split())
    if len(line) <= n:
        return line
    # a line LogMux's history kept cut already ends in "…": its length is a floor
    more = f"… (over {len(line) - 1} characters)" if line.endswith("…") else f"… ({len(line)} characters)"
    return line[:max(0, n - len(more))] + more
