"""Between-graph replication (tf.compat.v1), the way tfcluster's default mode runs it.

tfcluster has already started a tf.distribute.Server for every ps and worker task;
this script runs once per worker task as a client of its own task's server
(TFCLUSTER_MASTER) and must not start a server. Model: linear regression on
synthetic data, asynchronous SGD, variables on the ps.

    python between_graph.py --steps 300 --batch_size 32 --learning_rate 0.05 [--model_dir DIR]
"""
from __future__ import annotations

import argparse
import json
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
    p.add_argument("--steps", type=int, default=300, help="final global step (exact)")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--learning_rate", type=float, default=0.05)
    p.add_argument("--model_dir", default=None, help="checkpoint directory (chief saves, restores on restart)")
    p.add_argument("--log_every", type=int, default=25, help="print step/loss every N local steps")
    p.add_argument("--min_step_time", type=float, default=0.0,
                   help="seconds each local step takes at least (this toy model's take about a "
                        "millisecond): a drill of a lost host or a notice wants a real model's pace")
    p.add_argument("--cleanup_timeout", type=float, default=60.0,
                   help="seconds the chief waits for the other workers before freeing this run's "
                        "state on the ps; 0 keeps the state (e.g. to inspect it)")
    return p.parse_args(argv)


def synthetic_data(seed: int = 0):
    """y = Xw + b + noise, identical on every worker (fixed seed)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
    w = rng.normal(size=(FEATURES, 1)).astype(np.float32)
    y = x @ w + 0.5 + 0.01 * rng.normal(size=(EXAMPLES, 1)).astype(np.float32)
    return x, y


def place() -> dict:
    """This task's place, from the environment tfcluster sets (TF_CONFIG + TFCLUSTER_*)."""
    config = json.loads(os.environ["TF_CONFIG"])
    cluster, task = config["cluster"], config["task"]
    return {
        "cluster": cluster,
        "job": task["type"],
        "index": int(task["index"]),
        "master": os.environ["TFCLUSTER_MASTER"],
        "is_chief": os.environ.get("TFCLUSTER_IS_CHIEF") == "1",
        "run_id": os.environ.get("TFCLUSTER_RUN_ID", "default"),
        # Every task that runs this script: the workers and the chief, if any.
        "replicas": len(cluster.get("worker", [])) + len(cluster.get("chief", [])),
    }


def build_model(args, replicas_device: str, cluster_spec) -> dict:
    """The graph. Variables are created in a fixed, explicit order, never by iterating
    a dict or set: replica_device_setter assigns ps tasks round-robin in creation
    order, and ps tasks share variables by name, so a different order on another
    worker would silently put "the same" variable on a different ps (seed 000)."""
    g = {}
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
            cluster=cluster_spec, worker_device=replicas_device,
            # The mutex of the CriticalSection below is ps state too.
            ps_ops=["Variable", "VariableV2", "VarHandleOp", "MutexV2"])):
        g["global_step"] = tf.compat.v1.train.get_or_create_global_step()          # 1st
        g["w"] = tf.compat.v1.get_variable("w", [FEATURES, 1], tf.float32,         # 2nd
                                           tf.compat.v1.zeros_initializer(), use_resource=True)
        g["b"] = tf.compat.v1.get_variable("b", [1], tf.float32,                   # 3rd
                                           tf.compat.v1.zeros_initializer(), use_resource=True)
        g["done"] = tf.compat.v1.get_variable("workers_done", [], tf.int32,       # 4th
                                              tf.compat.v1.zeros_initializer(), use_resource=True,
                                              trainable=False)
        # Exact final step: StopAtStepHook alone overshoots (two workers can both
        # apply at step N-1 and end at N+1). Instead, "if global_step < steps: apply
        # the gradients and increment" runs as one atomic unit under a mutex that
        # lives on the ps (shared by name between the workers), so the step can
        # never pass --steps; a worker that arrives late gets a no-op.
        lock = tf.CriticalSection(name="apply_lock", shared_name="apply_lock")

        g["x"] = tf.compat.v1.placeholder(tf.float32, [None, FEATURES], name="x")
        g["y"] = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        pred = tf.matmul(g["x"], g["w"]) + g["b"]
        g["loss"] = tf.reduce_mean(tf.square(pred - g["y"]))
        opt = tf.compat.v1.train.GradientDescentOptimizer(args.learning_rate)
        grads_and_vars = opt.compute_gradients(g["loss"], var_list=[g["w"], g["b"]])

        def capped_apply():
            step = g["global_step"].read_value()

            def apply():
                op = opt.apply_gradients(grads_and_vars, global_step=g["global_step"])
                with tf.control_dependencies([op]):
                    return tf.identity(g["global_step"].read_value())

            return tf.cond(step < args.steps, apply, lambda: tf.identity(step))

        g["train_op"] = lock.execute(capped_apply)
        # The CriticalSection bookkeeping is only needed while building the graph; left
        # in the graph's collections it makes every checkpoint's meta graph export warn.
        for name in ("critical_sections", "critical_section_executions"):
            tf.compat.v1.get_default_graph().clear_collection(name)
        g["done_inc"] = g["done"].assign_add(1)
        g["ready_op"] = tf.compat.v1.report_uninitialized_variables()
    return g


class SayRestored(tf.compat.v1.train.SessionRunHook):
    """Chief: each session it opens restores the latest checkpoint in --model_dir, if any
    (a ps restart opens a new one); say which, and at what step, as `restored <path> at
    step=N`, the line tfcluster reads to say where a resumed run started."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir

    def after_create_session(self, session, coord) -> None:
        path = tf.train.latest_checkpoint(self.model_dir)
        if path:
            # The step saved in the checkpoint, not the ps's now: a worker may step at once.
            step = tf.train.load_variable(path, tf.compat.v1.GraphKeys.GLOBAL_STEP)
            print(f"restored {path} at step={step}", flush=True)


class SaveOnRequest(tf.compat.v1.train.SessionRunHook):
    """Chief: a checkpoint request (SIGUSR1) saves after the step under way, with the
    session's own saver, as its periodic saves do, and training goes on: `saved <path> at
    step=N (checkpoint request)`. The other workers hold nothing a checkpoint needs."""

    def __init__(self, model_dir: str, stop: Stop) -> None:
        self.path, self.stop = os.path.join(model_dir, "model.ckpt"), stop

    def after_run(self, run_context, run_values) -> None:
        if self.stop.save_asked():
            session = run_context.session
            step = session.run(tf.compat.v1.train.get_global_step())
            # The Scaffold's saver, which MonitoredTrainingSession put in the SAVERS collection
            saver = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.SAVERS)[0]
            path = saver.save(session, self.path, global_step=step)
            print(f"saved {path} at step={step} (checkpoint request)", flush=True)


def stopped(me: dict, model_dir: str | None) -> int:
    """After a SIGTERM: the chief's session saved a checkpoint as it closed; say which.
    The run's state on the ps is kept (the run goes on, or resumes, without this task)."""
    path = tf.train.latest_checkpoint(model_dir) if me["is_chief"] and model_dir else None
    if path:
        print(f"saved {path} at step={path.rsplit('-', 1)[1]}", flush=True)
    print(f"{me['job']}:{me['index']} stopped by SIGTERM", flush=True)
    return Stop.EXIT


def init_uninitialized(ready_op):
    """Scaffold init_fn for the chief: initialise only what is not initialised yet, so
    a chief restarted mid-run (no checkpoint) joins the running training instead of
    resetting it to step 0. (A tf.cond per variable cannot be used: the cond would
    have to be colocated with variables on the ps and ops on the worker at once.)"""
    by_name = {v.op.name: v for v in tf.compat.v1.global_variables()}

    def init_fn(scaffold, sess):
        missing = [n.decode() for n in sess.run(ready_op)]
        if missing:
            sess.run([by_name[n].initializer for n in missing])

    return init_fn


def wait_until_ready(master: str, config, ready_op, timeout: float = 600.0) -> None:
    """Non-chief: poll (every 0.2 s, not SessionManager's 30 s) until the chief has
    initialised or restored the variables, so MonitoredTrainingSession finds them ready."""
    deadline = time.monotonic() + timeout
    with tf.compat.v1.Session(master, config=config) as sess:
        while len(sess.run(ready_op)) and time.monotonic() < deadline:
            time.sleep(0.2)


def wait_for_replicas(master: str, config, done, replicas: int, timeout: float) -> bool:
    """Chief: wait until every replica has finished before freeing the run's state."""
    deadline = time.monotonic() + timeout
    with tf.compat.v1.Session(master, config=config) as sess:
        while sess.run(done) < replicas:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
    return True


def lost_state(before: int, now: int) -> int:
    """A ps restarted and, with no checkpoint to restore, the model started again from
    scratch: say so and fail instead of quietly training a new model."""
    print(f"error: the parameter servers lost this run's variables (global step went from "
          f"{before} back to {now}): a ps task restarted and there is no --model_dir checkpoint "
          f"to resume from. Pass --model_dir so training can survive a ps restart.",
          file=sys.stderr, flush=True)
    return 3


def main(argv=None) -> int:
    args = parse_args(argv)
    tf.compat.v1.disable_eager_execution()
    me = place()
    cluster_spec = tf.train.ClusterSpec(me["cluster"])
    device = f"/job:{me['job']}/task:{me['index']}"
    # Only the ps and this task: the other workers' health does not stall this one.
    config = tf.compat.v1.ConfigProto(device_filters=["/job:ps", device])

    # Isolation on a long-lived ps: a ps keeps every variable it ever held, shared by
    # name between all sessions, so run 2 would otherwise see run 1's global_step and
    # stop at once. Each run gets its own resource container on the ps (same run id
    # => same container, so a worker restarted mid-run rejoins the same state), and
    # the chief frees the container with Session.reset at the end so a long-lived ps
    # does not accumulate one model per run. Resuming from --model_dir still works:
    # checkpoints store variables by name, not container.
    container = f"run-{me['run_id']}"
    with tf.compat.v1.container(container):
        g = build_model(args, device, cluster_spec)

    x_all, y_all = synthetic_data()
    rng = np.random.default_rng(1000 + me["index"] + (100 if me["job"] == "chief" else 0))
    scaffold = tf.compat.v1.train.Scaffold(init_op=tf.no_op(), ready_op=g["ready_op"],
                                          init_fn=init_uninitialized(g["ready_op"]))
    if not me["is_chief"]:
        wait_until_ready(me["master"], config, g["ready_op"])

    every = max(1, args.steps // 10)
    local_steps = 0
    last_step = 0
    stop = Stop()
    # Leaving the `with` normally (no exception) closes the session through its hooks: the
    # chief's checkpoint saver then saves the step reached, which is how a SIGTERM saves.
    with tf.compat.v1.train.MonitoredTrainingSession(
            master=me["master"], is_chief=me["is_chief"], checkpoint_dir=args.model_dir,
            scaffold=scaffold, hooks=[tf.compat.v1.train.StopAtStepHook(last_step=args.steps)],
            chief_only_hooks=[SayRestored(args.model_dir), SaveOnRequest(args.model_dir, stop)]
            if args.model_dir else None,
            save_checkpoint_steps=every if args.model_dir else None, save_checkpoint_secs=None,
            save_summaries_steps=None, save_summaries_secs=None, log_step_count_steps=None,
            config=config) as sess:
        while not sess.should_stop() and not stop.asked():
            began = time.monotonic()
            idx = rng.integers(0, EXAMPLES, args.batch_size)
            step, loss = sess.run([g["train_op"], g["loss"]],
                                  feed_dict={g["x"]: x_all[idx], g["y"]: y_all[idx]})
            if step < last_step and not args.model_dir:
                return lost_state(last_step, step)
            last_step = max(last_step, step)
            local_steps += 1
            if local_steps == 1 or local_steps % args.log_every == 0:
                print(f"step={step} loss={loss:.6f}", flush=True)
            # the pace's wait ends at a SIGTERM: the loop then stops at once
            stop.requested.wait(max(0.0, began + args.min_step_time - time.monotonic()))
    if stop.asked():
        return stopped(me, args.model_dir)

    with tf.compat.v1.Session(me["master"], config=config) as sess:
        step = sess.run(g["global_step"])
        loss = sess.run(g["loss"], feed_dict={g["x"]: x_all, g["y"]: y_all})
        sess.run(g["done_inc"])  # last use of the ps state: the chief may free it now
    print(f"{me['job']}:{me['index']} local_steps={local_steps}", flush=True)
    print(f"tfcluster-result: global_step={step} loss={loss:.6f}", flush=True)

    if me["is_chief"] and args.cleanup_timeout > 0:
        if wait_for_replicas(me["master"], config, g["done"], me["replicas"], args.cleanup_timeout):
            tf.compat.v1.Session.reset(me["master"], containers=[container], config=config)
        else:   # a worker gone (a lost host) would hold the reset forever
            print(f"warning: not every replica finished within {args.cleanup_timeout}s; "
                  f"leaving container {container} on the ps", flush=True)
    return 0


def end_now(code: int) -> None:
    """Exit without the interpreter's teardown of TensorFlow (a second of CPU, more under load,
    that a move would wait for): after a stop, the checkpoint is saved. A run that ends well
    exits the usual way: its servers' teardown is what the others' last calls may still need
    (the chief's container reset reaches every worker's server)."""
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
