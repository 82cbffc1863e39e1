"""TF2 ParameterServerStrategy + ClusterCoordinator, custom training loop.

tfcluster has started a server for every ps and worker task; this script runs
once, as the chief (TF_CONFIG has a chief entry), and drives them: variables
live on the ps tasks, `coordinator.schedule` sends training steps to whichever
worker is free, and a step that was running on a worker that dies is retried on
another one. Model: linear regression on synthetic data, plain SGD written out
(no Keras: Keras 3 `model.fit` fails under this strategy, see README.md).

    python coordinator.py --steps 300 --batch_size 32 --learning_rate 0.05 [--model_dir DIR] [--min_step_time S]
"""
from __future__ import annotations

import argparse
import os
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
    p.add_argument("--steps", type=int, default=300, help="training steps to schedule")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--learning_rate", type=float, default=0.05)
    p.add_argument("--model_dir", default=None, help="checkpoint directory (saved every ~steps/10, restored)")
    p.add_argument("--log_every", type=int, default=50, help="print step/loss every N steps")
    p.add_argument("--min_step_time", type=float, default=0.0,
                   help="seconds between two scheduled steps at least (this toy model's take about a "
                        "millisecond): a drill of a lost host or a notice wants a real model's pace")
    return p.parse_args(argv)


def synthetic_data(seed: int = 0):
    """y = Xw + b + noise (fixed seed)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
    w = rng.normal(size=(FEATURES, 1)).astype(np.float32)
    y = x @ w + 0.5 + 0.01 * rng.normal(size=(EXAMPLES, 1)).astype(np.float32)
    return x, y


def stopped(coordinator, manager, step) -> int:
    """After a SIGTERM: the steps already scheduled finish, then the checkpoint is saved
    at the step they reached (no --model_dir: nothing to save)."""
    coordinator.join()
    if manager:
        path = manager.save(checkpoint_number=int(step.numpy()))
        print(f"saved {path} at step={int(step.numpy())}", flush=True)
    print("chief:0 stopped by SIGTERM", flush=True)
    return Stop.EXIT


def main(argv=None) -> int:
    args = parse_args(argv)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    x_all, y_all = synthetic_data()

    with strategy.scope():  # variables go to the ps tasks, in this fixed order
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        w = tf.Variable(tf.zeros([FEATURES, 1]), name="w")
        b = tf.Variable(tf.zeros([1]), name="b")

    manager = None
    if args.model_dir:
        ckpt = tf.train.Checkpoint(global_step=step, w=w, b=b)
        manager = tf.train.CheckpointManager(ckpt, args.model_dir, max_to_keep=3)
        if manager.latest_checkpoint:
            ckpt.restore(manager.latest_checkpoint)
            print(f"restored {manager.latest_checkpoint} at step={int(step.numpy())}", flush=True)

    def dataset_fn():
        ds = tf.data.Dataset.from_tensor_slices((x_all, y_all))
        return ds.shuffle(EXAMPLES).repeat().batch(args.batch_size)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def train_step(iterator):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
            gw, gb = tape.gradient(loss, [w, b])
            w.assign_sub(args.learning_rate * gw)
            b.assign_sub(args.learning_rate * gb)
            step.assign_add(1)
            return loss

        x, y = next(iterator)
        return strategy.run(replica_fn, args=(x, y))

    save_every = max(1, args.steps // 10)
    start = int(step.numpy())
    stop = Stop()
    for i in range(start, args.steps):
        if stop.asked():
            return stopped(coordinator, manager, step)
        began = time.monotonic()
        loss = coordinator.schedule(train_step, args=(iterator,))
        done = i + 1
        if done % args.log_every == 0 or done == start + 1 or done == args.steps:
            coordinator.join()  # wait for everything scheduled so far
            print(f"step={int(step.numpy())} loss={float(loss.fetch()):.6f}", flush=True)
        if manager and done % save_every == 0:
            coordinator.join()
            manager.save(checkpoint_number=int(step.numpy()))
        elif manager and stop.save_asked():      # a checkpoint request: what was scheduled, then save
            coordinator.join()
            path = manager.save(checkpoint_number=int(step.numpy()))
            print(f"saved {path} at step={int(step.numpy())} (checkpoint request)", flush=True)
        # the pace's wait ends at a SIGTERM: the loop then stops at once
        stop.requested.wait(max(0.0, began + args.min_step_time - time.monotonic()))
    coordinator.join()

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
