"""A between-graph script as people write it, with the seeds' pitfall: its variables are
created by iterating a Python set, so each process (own hash seed) creates them in its own
order and replica_device_setter puts "the same" variable on different ps tasks."""
import json
import os
import time

import tensorflow as tf

tf.compat.v1.disable_eager_execution()
config = json.loads(os.environ["TF_CONFIG"])
index = config["task"]["index"]
cluster = tf.train.ClusterSpec(config["cluster"])
with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        cluster=cluster, worker_device=f"/job:worker/task:{index}")):
    step = tf.compat.v1.train.get_or_create_global_step()
    layers = {f"layer{i}" for i in range(16)}
    weights = [tf.compat.v1.get_variable(name, [4], initializer=tf.compat.v1.zeros_initializer())
               for name in layers]
    loss = tf.add_n([tf.reduce_sum(tf.square(w - 1.0)) for w in weights])
    train = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(loss, global_step=step)

hooks = [tf.compat.v1.train.StopAtStepHook(last_step=100000)]
with tf.compat.v1.train.MonitoredTrainingSession(master=os.environ["TFCLUSTER_MASTER"],
                                                 is_chief=os.environ["TFCLUSTER_IS_CHIEF"] == "1",
                                                 hooks=hooks) as sess:
    while not sess.should_stop():
        n, _ = sess.run([step, train])
        time.sleep(0.02)     # a real model's step takes this long or more; this toy's, 1 ms
        if n % 100 == 0:
            print(f"step={n}", flush=True)
