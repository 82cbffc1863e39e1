"""The parameter server training tutorial's model.fit path, as written (fewer steps): a
ParameterServerStrategy from TF_CONFIG with a variable partitioner, a DatasetCreator, a legacy
optimizer with steps_per_execution, and the tutorial's callbacks. Runs once, as the chief."""
import os

import tensorflow as tf

NUM_PS = 1
cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
variable_partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
    min_shard_bytes=(256 << 10), max_shards=NUM_PS)
strategy = tf.distribute.ParameterServerStrategy(
    cluster_resolver, variable_partitioner=variable_partitioner)


def dataset_fn(input_context):
    global_batch_size = 64
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    x = tf.random.uniform((10, 10))
    y = tf.random.uniform((10,))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat()
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    dataset = dataset.batch(batch_size)
    dataset = dataset.prefetch(2)
    return dataset


dc = tf.keras.utils.experimental.DatasetCreator(dataset_fn)

with strategy.scope():
    model = tf.keras.models.Sequential([tf.keras.layers.Dense(10)])
    model.compile(tf.keras.optimizers.legacy.SGD(), loss="mse", steps_per_execution=10)

working_dir = os.path.join(os.getcwd(), "my_working_dir")
log_dir = os.path.join(working_dir, "log")
ckpt_filepath = os.path.join(working_dir, "ckpt")
backup_dir = os.path.join(working_dir, "backup")
callbacks = [
    tf.keras.callbacks.TensorBoard(log_dir=log_dir),
    tf.keras.callbacks.ModelCheckpoint(filepath=ckpt_filepath),
    tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir),
]
model.fit(dc, epochs=3, steps_per_epoch=20, callbacks=callbacks)
