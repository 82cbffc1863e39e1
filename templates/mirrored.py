"""TF2 MultiWorkerMirroredStrategy, custom training loop.

tfcluster starts no server in this mode; this script runs on every worker task,
reads its place from TF_CONFIG, and every worker holds a full copy of the model:
each step, every worker computes gradients on its own shard of the data and the
updates are averaged by all-reduce (synchronous; no ps). All workers must run
for a step to finish. Worker 0 is the chief: it prints the result line and owns
the checkpoints. Model: linear regression on synthetic data, plain SGD written
out (no Keras: Keras 3 `model.fit` fails under this strategy, see README.md).

    python mirrored.py --steps 300 --batch_size 32 --learning_rate 0.05 [--model_dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time

import numpy as np
import tensorflow as tf

FEATURES = 8
EXAMPLES = 2048

# tfcluster stops a task with SIGTERM and KILLs it train.stop_grace later (10 s unless the spec
# says otherwise): a task whose loop cannot get back to the signal ends itself before that
# (docs/hostloss.md).
STOP_DEADLINE = 4.0


class Stop:
    """SIGTERM (a run's stop, a drain, a move to a spare) asks the training loop to end at
    its next step, save a checkpoint and exit 128+15. A thread sees the signal at once, even
    while the main thread waits inside TensorFlow; if the loop has not asked by
    STOP_DEADLINE seconds later (a task it waits for is gone), the thread ends the process
    with the same code. A loop that did ask saves for as long as it needs.

    SIGUSR1 is a checkpoint request: save now and train on (tfcluster's when a host warns
    with too little time to move its tasks, Slurm's `--signal=USR1@90` ahead of a job's time
    limit). The same thread sees it; the loop asks save_asked() once per step."""

    EXIT = 128 + signal.SIGTERM

    def __init__(self) -> None:
        self.requested, self.noticed, self.save = threading.Event(), threading.Event(), threading.Event()
        read, write = os.pipe()
        os.set_blocking(write, False)
        # The wakeup fd is written only for a signal that has a Python handler; this one
        # does nothing, the thread acts (a Python handler runs only between bytecodes).
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        signal.signal(signal.SIGUSR1, lambda signum, frame: None)
        signal.set_wakeup_fd(write)
        threading.Thread(target=self._watch, args=(read,), name="sigterm", daemon=True).start()

    def asked(self) -> bool:
        """The training loop's question, once per step."""
        if self.requested.is_set():
            self.noticed.set()
            return True
        return False

    def save_asked(self) -> bool:
        """The training loop's other question, once per step: a checkpoint request came."""
        if self.save.is_set():
            self.save.clear()
            return True
        return False

    def _watch(self, fd: int) -> None:
        while True:
            got = os.read(fd, 64)
            if int(signal.SIGUSR1) in got:
                self.save.set()
            if int(signal.SIGTERM) in got:
                break
        self.requested.set()
        if self.noticed.wait(STOP_DEADLINE):
            return
        print(f"stopped by SIGTERM: still inside TensorFlow {STOP_DEADLINE:g}s later, "
              f"leaving without saving", flush=True)
        os._exit(self.EXIT)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="training steps (every worker runs each one)")
    p.add_argument("--batch_size", type=int, default=32, help="per-worker batch size")
    p.add_argument("--learning_rate", type=float, default=0.05)
    p.add_argument("--model_dir", default=None, help="checkpoint directory (saved every ~steps/10, restored)")
    p.add_argument("--log_every", type=int, default=50, help="print step/loss every N steps")
    p.add_argument("--min_step_time", type=float, default=0.0,
                   help="seconds each step takes at least (this toy model's take a few milliseconds): "
                        "a drill of a lost host or a notice wants a real model's pace")
    return p.parse_args(argv)


def synthetic_data(seed: int = 0):
    """y = Xw + b + noise, identical on every worker (fixed seed); each trains on its shard."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
    w = rng.normal(size=(FEATURES, 1)).astype(np.float32)
    y = x @ w + 0.5 + 0.01 * rng.normal(size=(EXAMPLES, 1)).astype(np.float32)
    return x, y


def checkpoint_dir(model_dir: str, is_chief: bool, index: int) -> str:
    """Saving is collective (every worker must call it); only the chief's copy is kept."""
    return model_dir if is_chief else os.path.join(model_dir, f".tmp-worker-{index}")


def from_chief(strategy, variables) -> None:
    """Every worker takes the chief's values (the chief's replica is the first): only the
    chief restores, so only the chief's host needs the checkpoint (no shared filesystem)."""
    @tf.function
    def masked(v):
        first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
        return tf.where(first, v.read_value(), tf.zeros_like(v))

    for v in variables:   # one all-reduce each: one of mixed types is refused
        v.assign(strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(masked, args=(v,)), axis=None))


def stopped(manager, step, is_chief: bool) -> int:
    """After a SIGTERM, every worker at the same step: save together (saving is
    collective), keep the chief's copy."""
    if manager:
        path = manager.save(checkpoint_number=int(step.numpy()))
        if is_chief:
            print(f"saved {path} at step={int(step.numpy())}", flush=True)
        else:
            shutil.rmtree(manager.directory, ignore_errors=True)
    print("stopped by SIGTERM (to this worker or another)", flush=True)
    return Stop.EXIT


def main(argv=None) -> int:
    args = parse_args(argv)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    # With a cluster the strategy takes SIGTERM as a preemption notice and trains on; a run's
    # stop (Ctrl-C, its timeout, a failed task, a move) is SIGTERM: Stop replaces its handler.
    stop = Stop()
    is_chief = task["type"] == "chief" or (task["type"] == "worker" and int(task["index"]) == 0)
    x_all, y_all = synthetic_data()

    with strategy.scope():
        # MEAN: each replica's update is averaged by all-reduce, which for SGD equals
        # one update with the averaged gradient.
        w = tf.Variable(tf.zeros([FEATURES, 1]), name="w", aggregation=tf.VariableAggregation.MEAN)
        b = tf.Variable(tf.zeros([1]), name="b", aggregation=tf.VariableAggregation.MEAN)
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step",
                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    manager = None
    if args.model_dir:
        ckpt = tf.train.Checkpoint(global_step=step, w=w, b=b)
        manager = tf.train.CheckpointManager(
            ckpt, checkpoint_dir(args.model_dir, is_chief, int(task["index"])), max_to_keep=3)
        latest = tf.train.latest_checkpoint(args.model_dir) if is_chief else None
        if latest:
            ckpt.restore(latest)
            print(f"restored {latest} at step={int(step.numpy())}", flush=True)
        from_chief(strategy, [w, b, step])

    def dataset_fn(ctx: tf.distribute.InputContext):
        ds = tf.data.Dataset.from_tensor_slices((x_all, y_all))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.shuffle(EXAMPLES, seed=ctx.input_pipeline_id).repeat().batch(args.batch_size)

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

    # 1.0 once this worker got SIGTERM, or a checkpoint request (SIGUSR1); its own (made
    # outside the strategy's scope).
    stop_asked = tf.Variable(0.0, trainable=False)
    save_asked = tf.Variable(0.0, trainable=False)

    @tf.function
    def train_step(iterator):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
            gw, gb = tape.gradient(loss, [w, b])
            w.assign_sub(args.learning_rate * gw)
            b.assign_sub(args.learning_rate * gb)
            step.assign_add(1)
            return tf.stack([loss, stop_asked.read_value(), save_asked.read_value()])

        # One all-reduce carries the loss and whether any worker was asked to stop or to
        # save, so every worker learns it after the same step and they save it together:
        # the sum of the replicas' losses, of their stop_asked and of their save_asked.
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_fn, args=next(iterator)),
                               axis=None)

    save_every = max(1, args.steps // 10)
    start = int(step.numpy())
    for i in range(start, args.steps):
        began = time.monotonic()
        if stop.asked():
            stop_asked.assign(1.0)
        if stop.save_asked():
            save_asked.assign(1.0)
        losses, asked, save = train_step(iterator).numpy()
        done = i + 1
        if done % args.log_every == 0 or done == start + 1 or done == args.steps:
            print(f"step={int(step.numpy())} loss={losses / strategy.num_replicas_in_sync:.6f}", flush=True)
        if asked > 0:
            return stopped(manager, step, is_chief)
        if manager and save > 0:        # a checkpoint request to any worker: all save this step
            save_asked.assign(0.0)
            path = manager.save(checkpoint_number=int(step.numpy()))
            if is_chief:
                print(f"saved {path} at step={int(step.numpy())} (checkpoint request)", flush=True)
        elif manager and done % save_every == 0:
            manager.save(checkpoint_number=done)
        if args.min_step_time:          # every worker waits alike: the next all-reduce pairs them
            stop.requested.wait(max(0.0, began + args.min_step_time - time.monotonic()))
    if manager and not is_chief:
        shutil.rmtree(manager.directory, ignore_errors=True)

    final = float(np.mean(np.square(x_all @ w.numpy() + b.numpy() - y_all)))
    print(f"tfcluster-result: global_step={int(step.numpy())} loss={final:.6f}", flush=True)
    return 0


def end_now(code: int) -> None:
    """Exit without the interpreter's teardown of TensorFlow (a second of CPU, more under load,
    that a move would wait for): after a stop, every worker has saved. A run that ends well
    exits the usual way, which lets the strategy's coordination service shut down in order."""
    import atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    if code == Stop.EXIT:
        end_now(code)
    raise SystemExit(code)
