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

import numpy as np
import tensorflow as tf

FEATURES = 8
EXAMPLES = 2048


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="training steps (every worker runs each one)")
    p.add_argument("--batch_size", type=int, default=32, help="per-worker batch size")
    p.add_argument("--learning_rate", type=float, default=0.05)
    p.add_argument("--model_dir", default=None, help="checkpoint directory (saved every ~steps/10, restored)")
    p.add_argument("--log_every", type=int, default=50, help="print step/loss every N steps")
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


def main(argv=None) -> int:
    args = parse_args(argv)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    # With a cluster the strategy takes SIGTERM as a preemption notice and trains on; a run's
    # stop (Ctrl-C, its timeout, a failed task) is SIGTERM: end now, as a plain script would.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
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
        latest = tf.train.latest_checkpoint(args.model_dir)
        if latest:
            ckpt.restore(latest)
            print(f"restored {latest} at step={int(step.numpy())}", flush=True)

    def dataset_fn(ctx: tf.distribute.InputContext):
        ds = tf.data.Dataset.from_tensor_slices((x_all, y_all))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.shuffle(EXAMPLES, seed=ctx.input_pipeline_id).repeat().batch(args.batch_size)

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

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

        losses = strategy.run(replica_fn, args=next(iterator))
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, losses, axis=None)

    save_every = max(1, args.steps // 10)
    start = int(step.numpy())
    for i in range(start, args.steps):
        loss = train_step(iterator)
        done = i + 1
        if done % args.log_every == 0 or done == start + 1 or done == args.steps:
            print(f"step={int(step.numpy())} loss={float(loss):.6f}", flush=True)
        if manager and done % save_every == 0:
            manager.save(checkpoint_number=done)
    if manager and not is_chief:
        shutil.rmtree(manager.directory, ignore_errors=True)

    final = float(np.mean(np.square(x_all @ w.numpy() + b.numpy() - y_all)))
    print(f"tfcluster-result: global_step={int(step.numpy())} loss={final:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
