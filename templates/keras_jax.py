"""Keras 3 on JAX over many hosts: `model.fit` under DataParallel, or ModelParallel with a
LayoutMap (`--model_parallel`).

tfcluster's mode keras-jax runs this script once per JAX process (one per host with all its
devices, or one per GPU) with KERAS_BACKEND=jax and the coordinator, the process count
and the process id in KERAS_DISTRIBUTION_*; `keras.distribution.initialize()` reads them.
Process 0 (worker 0) serves JAX's coordinator, prints the progress and owns the
checkpoints. Model: a small regression network on synthetic data made here (fixed seed,
no downloads).

DataParallel: every device holds the whole model and a slice of each batch; each process
feeds its own shard of the data (rows process_id::process_count), so the global batch is
--batch_size. ModelParallel: the hidden layer's kernel is split over every device (a
LayoutMap), the batch is not split, so every process feeds the same batches.

Resumable: with --model_dir, process 0 saves after every epoch and, on a start, restores
the newest checkpoint and hands it to the other processes (only its host needs it; a
restart of every process after a failure resumes there, mid-epoch if it was saved there).
A stop (SIGTERM: tfcluster's drain, a host's notice) and a checkpoint request (SIGUSR1)
save too, at a step every process agrees on (saving is a collective): a stop through JAX's
own preemption sync point, a request through a gather every SAVE_CHECK steps (Saver). A
checkpoint is written as `ckpt-<step>.data-00000-of-00001` (the arrays, npz) then
`ckpt-<step>.index`, each renamed into place: the layout tfcluster's checkpoint sync
recognises, numbered by the global step as the TensorFlow templates' are.

    python keras_jax.py --epochs 5 --batch_size 64 --learning_rate 0.01 [--model_dir DIR] [--model_parallel]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import sys
import threading

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "jax")     # tfcluster sets it; run by hand, too
import jax  # noqa: E402
import keras  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

FEATURES = 8
EXAMPLES = 2048
HIDDEN = 32
CKPT = re.compile(r"^ckpt-(\d+)\.index$")
# tfcluster stops a task with SIGTERM and KILLs it train.stop_grace later (10 s unless the spec
# says otherwise): the processes agree on a step at once and save it well within that (a peer
# gone, the processes wait for it inside a collective until the KILL, the last checkpoint
# standing). Exit 128+15: a stop, not a failure.
STOP_EXIT = 128 + signal.SIGTERM
SAVE_CHECK = 10       # steps between two looks for a checkpoint request (a gather, a few ms here)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=64, help="the global batch, over every process")
    p.add_argument("--learning_rate", type=float, default=0.01)
    p.add_argument("--examples", type=int, default=EXAMPLES)
    p.add_argument("--model_dir", default=None, help="checkpoints: saved by process 0, restored at start")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept in --model_dir")
    p.add_argument("--model_parallel", action="store_true",
                   help="ModelParallel with a LayoutMap instead of DataParallel")
    return p.parse_args(argv)


def start_distribution(model_parallel: bool, alone: bool) -> None:
    """Join the other processes (unless run alone), then lay the model out over every device
    of every process."""
    if not alone:
        keras.distribution.initialize()
    devices = keras.distribution.list_devices()
    if model_parallel:
        mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
        layout = keras.distribution.LayoutMap(mesh)
        layout["hidden/kernel"] = (None, "model")       # columns of the hidden layer per device
        layout["hidden/bias"] = ("model",)
        layout["out/kernel"] = ("model", None)
        keras.distribution.set_distribution(keras.distribution.ModelParallel(
            layout_map=layout, batch_dim_name="batch", auto_shard_dataset=False))
    else:
        # NumPy arrays: each process feeds its own shard, so Keras must not shard again
        keras.distribution.set_distribution(keras.distribution.DataParallel(
            devices=devices, auto_shard_dataset=False))


def make_data(examples: int, local_batch: int, model_parallel: bool) -> tuple[np.ndarray, np.ndarray]:
    """This process's part of the data: whole batches only, the same count in every
    process (a process with one batch more would wait forever for the others)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(examples, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, 1)).astype("float32")
    y = np.tanh(x @ w) + 0.05 * rng.normal(size=(examples, 1)).astype("float32")
    if model_parallel:
        usable = examples // local_batch * local_batch
        return x[:usable], y[:usable]   # the batch is not split: every process feeds all of it
    me, n = jax.process_index(), jax.process_count()
    usable = examples // (n * local_batch) * n * local_batch
    return x[me:usable:n], y[me:usable:n]


def build_model(learning_rate: float) -> keras.Model:
    keras.utils.set_random_seed(1)     # the same initial weights in every process
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(HIDDEN, activation="relu", name="hidden"),
                              keras.layers.Dense(1, name="out")])
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="mse")
    model.optimizer.build(model.trainable_variables)    # its state is checkpointed too
    return model


def state(model: keras.Model) -> list:
    return list(model.weights) + list(model.optimizer.variables)


def gathered(model: keras.Model) -> list[np.ndarray]:
    """Every variable's whole value in this process (a collective: every process calls it;
    a ModelParallel kernel is split over processes)."""
    return [np.asarray(multihost_utils.process_allgather(v.value, tiled=True)) for v in state(model)]


def digest(values: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for v in values:
        h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()[:16]


def newest(model_dir: str) -> int | None:
    found = [int(m.group(1)) for name in os.listdir(model_dir) if (m := CKPT.match(name))]
    return max(found, default=None)


def restore(model: keras.Model, model_dir: str | None, steps: int) -> int:
    """The global step to start from: process 0 reads its newest checkpoint and every
    process takes its values (broadcast), so only process 0's host needs the files."""
    template = [np.zeros(v.shape, v.dtype) for v in state(model)]
    step, values, n = 0, template, None
    if jax.process_index() == 0 and model_dir and (n := newest(model_dir)) is not None:
        with open(os.path.join(model_dir, f"ckpt-{n}.index"), "rb") as f:
            index = json.loads(f.read())
        with np.load(os.path.join(model_dir, f"ckpt-{n}.data-00000-of-00001")) as data:
            values = [data[f"v{i}"] for i in range(len(template))]
        # numbered by its step; one this template wrote before that is numbered by its epoch
        step = index["step"] if "step" in index else n * steps
    step, values = multihost_utils.broadcast_one_to_all((np.int32(step), values))
    step = int(step)
    if step:
        for v, value in zip(state(model), values):
            v.assign(np.asarray(value))
        if jax.process_index() == 0:
            print(f"restored {model_dir}/ckpt-{n} at step={step}", flush=True)
    return step


def _atomic(path: str, write) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(model: keras.Model, model_dir: str, step: int, keep: int) -> str | None:
    """A collective (every process calls it at the same step); process 0 writes and returns
    the checkpoint's prefix."""
    values = gathered(model)
    if jax.process_index() != 0:
        return None
    prefix = os.path.join(model_dir, f"ckpt-{step}")
    _atomic(prefix + ".data-00000-of-00001", lambda f: np.savez(f, **{f"v{i}": v for i, v in enumerate(values)}))
    _atomic(prefix + ".index", lambda f: f.write(json.dumps({"step": step, "arrays": len(values)}).encode()))
    for old in sorted(int(m.group(1)) for name in os.listdir(model_dir) if (m := CKPT.match(name)))[:-keep]:
        for suffix in (".index", ".data-00000-of-00001"):
            try:
                os.unlink(os.path.join(model_dir, f"ckpt-{old}{suffix}"))
            except FileNotFoundError:
                pass
    return prefix


class Asked:
    """What this process was asked by signal: SIGUSR1, a checkpoint request, and, in a process
    run alone (no JAX coordination service), SIGTERM. A SIGTERM to a process of a multi-process
    job is JAX's: jax.distributed.initialize installs a handler for it (its preemption notifier)
    that tells every process, and multihost_utils.reached_preemption_sync_point answers True in
    all of them at one step."""

    def __init__(self, alone: bool) -> None:
        self.alone = alone
        self.stop, self.save = threading.Event(), threading.Event()
        signal.signal(signal.SIGUSR1, lambda signum, frame: self.save.set())
        if alone:
            signal.signal(signal.SIGTERM, lambda signum, frame: self.stop.set())


class Saver(keras.callbacks.Callback):
    """Counts the global step across fit calls; saves after every epoch, at a stop (SIGTERM:
    every process at the step JAX's preemption sync point names, then it ends, 143) and on a
    checkpoint request (SIGUSR1 to any process: every process learns it at the next multiple of
    SAVE_CHECK steps, a gather of one flag, and saves that step)."""

    def __init__(self, asked: Asked, model_dir: str | None, keep: int, step: int) -> None:
        super().__init__()
        self.asked, self.model_dir, self.keep, self.step = asked, model_dir, keep, step

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        alone = self.asked.alone
        stop = self.asked.stop.is_set() if alone else multihost_utils.reached_preemption_sync_point(self.step)
        save_now = False
        if self.step % SAVE_CHECK == 0:
            flag = np.int32(self.asked.save.is_set())
            save_now = bool(flag if alone else np.max(multihost_utils.process_allgather(flag)))
            self.asked.save.clear()
        if (stop or save_now) and self.model_dir:
            path = save(self.model, self.model_dir, self.step, self.keep)
            if path:
                print(f"saved {path} at step={self.step} ({'stop' if stop else 'checkpoint request'})", flush=True)
        if stop:
            if not alone:
                multihost_utils.sync_global_devices("stopped")      # process 0's files written before any leaves
            print(f"stopped by SIGTERM (to this process or another) at step={self.step}", flush=True)
            os._exit(STOP_EXIT)

    def on_epoch_end(self, epoch, logs=None):
        if self.model_dir:
            save(self.model, self.model_dir, self.step, self.keep)


def main(argv=None) -> int:
    args = parse_args(argv)
    alone = not os.environ.get("KERAS_DISTRIBUTION_JOB_ADDRESSES")    # no job to join: run by hand
    if alone and int(os.environ.get("TFCLUSTER_NUM_WORKERS") or 1) > 1:
        sys.exit(f"{os.path.basename(__file__)}: {os.environ['TFCLUSTER_NUM_WORKERS']} workers and no JAX "
                 f"coordinator to join: each would train its own copy. Keras 3's processes join only in "
                 f"mode keras-jax: set train.mode: keras-jax")
    asked = Asked(alone)
    start_distribution(args.model_parallel, alone)
    me, n = jax.process_index(), jax.process_count()
    local_batch = args.batch_size if args.model_parallel else args.batch_size // n
    if local_batch < 1 or (not args.model_parallel and args.batch_size % n):
        sys.exit(f"--batch_size {args.batch_size} does not split over {n} processes")
    x, y = make_data(args.examples, local_batch, args.model_parallel)
    if not len(x):
        sys.exit(f"--examples {args.examples} is less than one global batch ({args.batch_size})")
    steps = len(x) // local_batch
    model = build_model(args.learning_rate)
    if args.model_dir:
        os.makedirs(args.model_dir, exist_ok=True)
    step = restore(model, args.model_dir, steps)
    start, done = divmod(step, steps)
    print(f"process {me} of {n}: {jax.local_device_count()} local device(s), {jax.device_count()} in all, "
          f"{'model' if args.model_parallel else 'data'} parallel, epoch {start} of {args.epochs}"
          + (f", its step {done} of {steps}" if done else ""), flush=True)
    saver = Saver(asked, args.model_dir, args.keep, step)
    history = None
    if done and start < args.epochs:
        # the rest of the epoch it stopped in, without Keras' lines: `Epoch k/N` with a short
        # bar would tell a reader of the progress (tfcluster's) another epoch size
        if me == 0:
            print(f"epoch {start + 1}: its last {steps - done} steps, from step={step}", flush=True)
        history = model.fit(x[done * local_batch:], y[done * local_batch:], batch_size=local_batch,
                            epochs=start + 1, initial_epoch=start, shuffle=False, verbose=0, callbacks=[saver])
        start += 1
    if start < args.epochs:
        history = model.fit(x, y, batch_size=local_batch, epochs=args.epochs, initial_epoch=start, shuffle=False,
                            verbose=2 if me == 0 else 0, callbacks=[saver])
    values = gathered(model)
    loss = history.history["loss"][-1] if history and history.history.get("loss") else float("nan")
    print(f"weights sha256={digest(values[:len(model.weights)])} process={me}", flush=True)
    if me == 0:
        print(f"tfcluster-result: global_step={args.epochs * steps} loss={loss:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
