"""A classic-mode script (it builds its own server) without device_filters, so worker 0's
session waits for every task. Worker 1 starts its server only once the file named by
LATE_WORKER_GO exists: a worker that starts late, on a condition the test controls. Worker 0
stays up until worker 1 is done (worker 1's session needs worker 0's server too)."""
import json
import os
import time

import tensorflow as tf

tf.compat.v1.disable_eager_execution()
config = json.loads(os.environ["TF_CONFIG"])
job, index = config["task"]["type"], config["task"]["index"]
if (job, index) == ("worker", 1):
    print("worker 1: waiting for the go file before starting its server", flush=True)
    while not os.path.exists(os.environ["LATE_WORKER_GO"]):
        time.sleep(0.2)
server = tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]), job_name=job, task_index=index)
if job == "ps":
    server.join()
with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        cluster=tf.train.ClusterSpec(config["cluster"]), worker_device=f"/job:worker/task:{index}")):
    step = tf.compat.v1.train.get_or_create_global_step()
    bump = step.assign_add(1)
hooks = [tf.compat.v1.train.StopAtStepHook(last_step=20)]
with tf.compat.v1.train.MonitoredTrainingSession(master=server.target, is_chief=index == 0,
                                                 hooks=hooks) as sess:
    while not sess.should_stop():
        n = sess.run(bump)
print(f"worker {index} done at step={n}", flush=True)
done = os.environ["LATE_WORKER_GO"] + ".worker1-done"
if index == 1:
    open(done, "w").close()
else:
    while not os.path.exists(done):
        time.sleep(0.2)
