"""Every task of a mirrored run, the evaluator included, creates the strategy; the workers
then wait, standing in for their training."""
import time

import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
print("replicas:", strategy.num_replicas_in_sync, flush=True)
time.sleep(60)
