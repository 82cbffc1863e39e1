"""The parameter server custom-loop tutorial's model under Keras 3: ParameterServerStrategy,
a functional model whose pooling is a TensorFlow function called on the Keras input, which
Keras 3 refuses while the model is built (no `.fit(` anywhere)."""
import tensorflow as tf

strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.TFConfigClusterResolver())
with strategy.scope():
    model_input = tf.keras.layers.Input(shape=(3,), dtype=tf.int64, name="model_input")
    emb_layer = tf.keras.layers.Embedding(input_dim=10, output_dim=8)
    emb_output = tf.reduce_mean(emb_layer(model_input), axis=1)
    model = tf.keras.Model({"features": model_input}, tf.keras.layers.Dense(units=1)(emb_output))
print("model built", flush=True)
