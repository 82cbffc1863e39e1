"""The multi-worker Keras tutorial's shape: MultiWorkerMirroredStrategy, a model built in
its scope, model.fit on a dataset of MNIST's shape (random data: no download)."""
import numpy as np
import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
x = np.random.rand(256, 28, 28).astype("float32")
y = np.random.randint(0, 10, 256).astype("int64")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256).repeat().batch(64)
with strategy.scope():
    model = tf.keras.Sequential([
        tf.keras.layers.InputLayer(input_shape=(28, 28)),
        tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(10),
    ])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.SGD(learning_rate=0.001), metrics=["accuracy"])
model.fit(dataset, epochs=2, steps_per_epoch=4)
print("trained", flush=True)
