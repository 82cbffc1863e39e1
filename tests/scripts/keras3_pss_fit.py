"""The ParameterServerStrategy tutorial's model.fit path, with random data."""
import numpy as np
import tensorflow as tf

resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
strategy = tf.distribute.ParameterServerStrategy(resolver)
x = np.random.rand(256, 10).astype("float32")
y = np.random.rand(256, 1).astype("float32")
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    model.compile(tf.keras.optimizers.SGD(), loss="mse", steps_per_execution=2)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256).repeat().batch(32)
model.fit(dataset, epochs=2, steps_per_epoch=4)
print("trained", flush=True)
