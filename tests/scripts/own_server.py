"""An old-style trainer that starts its own task's server from TF_CONFIG, then (with
--strategy) MultiWorkerMirroredStrategy, which starts the task's server too."""
import json
import os
import sys

import tensorflow as tf

config = json.loads(os.environ["TF_CONFIG"])
server = tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]), job_name=config["task"]["type"],
                              task_index=config["task"]["index"], start=True)
print("server started", server.target, flush=True)
if "--strategy" in sys.argv:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    print("replicas:", strategy.num_replicas_in_sync, flush=True)
