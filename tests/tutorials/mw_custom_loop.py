"""The multi-worker custom training loop tutorial's APIs, as written (fewer steps): a
MultiWorkerMirroredStrategy, distribute_datasets_from_function, strategy.run with a
tf.function step, Keras metrics reset every epoch with reset_states(), and a checkpoint written
by the chief (the others write to a temporary directory)."""
import json
import os

import numpy as np
import tensorflow as tf

tf_config = json.loads(os.environ['TF_CONFIG'])
num_workers = len(tf_config['cluster']['worker'])
task_type, task_id = tf_config['task']['type'], tf_config['task']['index']
global_batch_size = 64 * num_workers
num_epochs, num_steps_per_epoch = 3, 15

strategy = tf.distribute.MultiWorkerMirroredStrategy()


def dataset_fn(input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    rng = np.random.default_rng(input_context.input_pipeline_id)
    x = rng.random((1200, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, size=(1200,)).astype(np.int64)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1200).repeat()
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return dataset.batch(batch_size).prefetch(2)


def build_cnn_model():
    return tf.keras.Sequential([
        tf.keras.Input(shape=(28, 28)),
        tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(32, 3, activation='relu'),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dense(10)
    ])


with strategy.scope():
    multi_worker_model = build_cnn_model()
    multi_worker_dataset = strategy.distribute_datasets_from_function(dataset_fn)
    optimizer = tf.keras.optimizers.RMSprop(learning_rate=0.001)
    train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name='train_accuracy')


@tf.function
def train_step(iterator):
    def step_fn(inputs):
        x, y = inputs
        with tf.GradientTape() as tape:
            predictions = multi_worker_model(x, training=True)
            per_batch_loss = tf.keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction=tf.keras.losses.Reduction.NONE)(y, predictions)
            loss = tf.nn.compute_average_loss(per_batch_loss, global_batch_size=global_batch_size)
        grads = tape.gradient(loss, multi_worker_model.trainable_variables)
        optimizer.apply_gradients(zip(grads, multi_worker_model.trainable_variables))
        train_accuracy.update_state(y, predictions)
        return loss

    per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if task_type != 'worker' or task_id != 0:   # the chief is worker 0 here
        dirpath = os.path.join(dirpath, 'workertemp_' + str(task_id))
    tf.io.gfile.makedirs(dirpath)
    return os.path.join(dirpath, base)


epoch = tf.Variable(initial_value=tf.constant(0, dtype=tf.dtypes.int64), name='epoch')
step_in_epoch = tf.Variable(initial_value=tf.constant(0, dtype=tf.dtypes.int64), name='step_in_epoch')
checkpoint = tf.train.Checkpoint(model=multi_worker_model, epoch=epoch, step_in_epoch=step_in_epoch)
checkpoint_dir = write_filepath(os.path.join(os.getcwd(), 'ckpt'), task_type, task_id)
checkpoint_manager = tf.train.CheckpointManager(checkpoint, directory=checkpoint_dir, max_to_keep=1)

iterator = iter(multi_worker_dataset)
while epoch.numpy() < num_epochs:
    total_loss, num_batches = 0.0, 0
    while step_in_epoch.numpy() < num_steps_per_epoch:
        total_loss += train_step(iterator)
        num_batches += 1
        step_in_epoch.assign_add(1)
    train_loss = total_loss / num_batches
    print('Epoch: %d, accuracy: %f, train_loss: %f.'
          % (epoch.numpy(), train_accuracy.result(), train_loss), flush=True)
    train_accuracy.reset_states()
    checkpoint_manager.save()
    epoch.assign_add(1)
    step_in_epoch.assign(0)
