"""A ParameterServerStrategy custom loop that iterates its distributed dataset on the
coordinator itself instead of through ClusterCoordinator.create_per_worker_dataset."""
import tensorflow as tf

strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.TFConfigClusterResolver())
dataset = strategy.distribute_datasets_from_function(lambda context: tf.data.Dataset.range(8).batch(2))
for batch in dataset:
    print("batch", batch, flush=True)
