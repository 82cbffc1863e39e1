"""A coordinator-mode script run by the chief and the evaluator alike: both create
ParameterServerStrategy. The evaluator starts once the chief's server listens, as it would
after a chief that starts first; the chief then waits, standing in for its training."""
import json
import os
import socket
import time

import tensorflow as tf

config = json.loads(os.environ["TF_CONFIG"])
if config["task"]["type"] == "evaluator":
    host, port = config["cluster"]["chief"][0].rsplit(":", 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.TFConfigClusterResolver())
print(config["task"]["type"], "connected; training", flush=True)
time.sleep(60)
