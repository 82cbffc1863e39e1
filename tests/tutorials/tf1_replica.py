"""A TF1 between-graph replicated trainer in the style of TensorFlow's old mnist_replica.py and
the distributed how-to: flags --ps_hosts/--worker_hosts/--job_name/--task_index, its own
tf.train.Server, replica_device_setter, a global step, SyncReplicas-free asynchronous SGD and a
MonitoredTrainingSession with a StopAtStepHook. The ps task joins its server forever."""
import argparse
import sys

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()

parser = argparse.ArgumentParser()
parser.add_argument("--ps_hosts", required=True)
parser.add_argument("--worker_hosts", required=True)
parser.add_argument("--job_name", required=True)
parser.add_argument("--task_index", type=int, required=True)
parser.add_argument("--train_steps", type=int, default=200)
parser.add_argument("--quiet", action="store_true", help="print nothing per step (the how-to's skeleton)")
FLAGS, _ = parser.parse_known_args()

cluster = tf.train.ClusterSpec({"ps": FLAGS.ps_hosts.split(","), "worker": FLAGS.worker_hosts.split(",")})
server = tf.train.Server(cluster, job_name=FLAGS.job_name, task_index=FLAGS.task_index)
if FLAGS.job_name == "ps":
    server.join()
    sys.exit(0)

is_chief = FLAGS.task_index == 0
with tf.device(tf.train.replica_device_setter(
        worker_device="/job:worker/task:%d" % FLAGS.task_index, cluster=cluster)):
    global_step = tf.train.get_or_create_global_step()
    x = tf.placeholder(tf.float32, [None, 784])
    y_ = tf.placeholder(tf.float32, [None, 10])
    hid_w = tf.Variable(tf.truncated_normal([784, 100], stddev=1.0 / 28), name="hid_w")
    hid_b = tf.Variable(tf.zeros([100]), name="hid_b")
    sm_w = tf.Variable(tf.truncated_normal([100, 10], stddev=0.1), name="sm_w")
    sm_b = tf.Variable(tf.zeros([10]), name="sm_b")
    hid = tf.nn.relu(tf.nn.xw_plus_b(x, hid_w, hid_b))
    y = tf.nn.softmax(tf.nn.xw_plus_b(hid, sm_w, sm_b))
    cross_entropy = -tf.reduce_sum(y_ * tf.log(tf.clip_by_value(y, 1e-10, 1.0)))
    train_op = tf.train.AdamOptimizer(0.01).minimize(cross_entropy, global_step=global_step)

config = tf.ConfigProto(device_filters=["/job:ps", "/job:worker/task:%d" % FLAGS.task_index])
hooks = [tf.train.StopAtStepHook(last_step=FLAGS.train_steps)]
rng = np.random.default_rng(FLAGS.task_index)
with tf.train.MonitoredTrainingSession(master=server.target, is_chief=is_chief, hooks=hooks,
                                       config=config) as sess:
    local_step = 0
    while not sess.should_stop():
        batch_xs = rng.random((100, 784), dtype=np.float32)
        batch_ys = np.eye(10, dtype=np.float32)[rng.integers(0, 10, 100)]
        _, loss, step = sess.run([train_op, cross_entropy, global_step], feed_dict={x: batch_xs, y_: batch_ys})
        local_step += 1
        if not FLAGS.quiet:
            print("Worker %d: training step %d done (global step: %d)" % (FLAGS.task_index, local_step, step),
                  flush=True)
