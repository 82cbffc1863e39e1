"""TensorFlow's multi-worker Keras tutorial with one slip: the model is built and compiled
outside `strategy.scope()`, so Keras fits it under the default strategy and every worker
trains its own copy. `--epochs N` (default 1)."""
import sys

import numpy as np
import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
epochs = int(sys.argv[sys.argv.index("--epochs") + 1]) if "--epochs" in sys.argv else 1
x = np.random.rand(64, 4).astype("float32")
y = np.random.rand(64, 1).astype("float32")
model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)])
model.compile(loss="mse", optimizer="sgd")
model.fit(x, y, epochs=epochs, batch_size=16, verbose=0)
print("trained", flush=True)
