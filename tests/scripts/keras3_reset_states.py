"""The multi-worker custom training loop tutorial's shape: MWMS, a distributed dataset,
a Keras metric reset at the end of each epoch with reset_states()."""
import numpy as np
import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
x = np.random.rand(256, 28, 28).astype("float32")
y = np.random.randint(0, 10, 256).astype("int64")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256).repeat().batch(64)
dist = iter(strategy.experimental_distribute_dataset(dataset))
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Flatten(), tf.keras.layers.Dense(10)])
    optimizer = tf.keras.optimizers.SGD(0.001)
    accuracy = tf.keras.metrics.SparseCategoricalAccuracy()


@tf.function
def step(iterator):
    def replica_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        accuracy.update_state(labels, logits)
        return loss
    return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=(next(iterator),)), axis=None)


for epoch in range(2):
    for _ in range(3):
        loss = step(dist)
    print(f"epoch={epoch} loss={float(loss):.4f} accuracy={float(accuracy.result()):.3f}", flush=True)
    accuracy.reset_states()
