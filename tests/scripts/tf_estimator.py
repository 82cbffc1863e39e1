"""The Estimator tutorial's first line of work: tf.estimator, gone from TensorFlow 2.16."""
import tensorflow as tf

strategy = tf.distribute.experimental.MultiWorkerMirroredStrategy()
config = tf.estimator.RunConfig(train_distribute=strategy)
