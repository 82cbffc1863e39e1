"""Every task of a mirrored run, the evaluator included, creates the strategy."""
import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
print("replicas:", strategy.num_replicas_in_sync, flush=True)
