"""The ParameterServerStrategy tutorials' optimizer, as they write it."""
import tensorflow as tf

optimizer = tf.keras.optimizers.legacy.SGD(learning_rate=0.1)
print("optimizer:", optimizer, flush=True)
