"""The keras-io multi-GPU guide's shape: a single-host strategy (or none), a model built in
its scope, a short model.fit; every worker runs it alone. `--strategy mirrored|none`."""
import sys

import numpy as np
import tensorflow as tf

strategy = tf.distribute.MirroredStrategy() if "none" not in sys.argv else tf.distribute.get_strategy()
print(f"Number of devices: {strategy.num_replicas_in_sync}", flush=True)
x = np.random.rand(64, 4).astype("float32")
y = np.random.rand(64, 1).astype("float32")
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd")
model.fit(x, y, epochs=1, batch_size=16, verbose=2)
print("trained", flush=True)
