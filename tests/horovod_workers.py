"""What each worker checks for `tests/test_horovod_migration.py`.

Run as a script on every task of `keras-dist launch --workers 2` (Horovod's
`horovodrun -np 2`); each worker prints one line, `HOROVOD_MIGRATION {json}`,
with what it saw. `cluster_checks` is a module-level function, so
`keras_dist.testing.run_workers` can run it too.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MARKER = "HOROVOD_MIGRATION "
EPOCHS, GLOBAL_BATCH = 2, 32


def shard(task):
    """This worker's own digits: even images on worker 0, odd ones on worker 1."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x[:512] / 16.0).astype("float32")
    y = y[:512].astype("int32")
    return x[task::2], y[task::2]


def worker_dataset(strategy, x, y):
    """This worker's shard, in batches of `GLOBAL_BATCH / 2` per replica.

    A dataset function gives each worker the pipeline it builds, unsplit:
    each worker reads only its own shard, as each Horovod rank reads its own.
    Repeated, so `fit` and `evaluate` take their `steps` (tf_keras needs
    them with a distributed dataset).
    """
    import tensorflow as tf

    def dataset_fn(context):
        batch = context.get_per_replica_batch_size(GLOBAL_BATCH)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()

    return strategy.distribute_datasets_from_function(dataset_fn)


def keras3_model(keras, keras_dist):
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    return keras_dist.DistributedModel(inputs, keras.layers.Dense(10)(hidden))


def tf_keras_model(tf_keras):
    return tf_keras.Sequential(
        [
            tf_keras.layers.Dense(32, activation="relu", input_shape=(64,)),
            tf_keras.layers.Dense(10),
        ]
    )


def cluster_checks():
    """The Horovod rows on one cluster: init, broadcast, metric averaging.

    Returns:
        A JSON-able dict: the strategy `auto_strategy()` built and this
        worker's rank and size; the initial weights of a Keras 3 and a
        tf_keras model created in the strategy's scope, and created outside
        it, with a different seed on each worker; the `History` and
        `evaluate` results of both kinds of model trained on this worker's
        own shard, and the loss of the final model on this shard alone.
    """
    import numpy as np

    import keras_dist

    # hvd.init(): the strategy, this worker's rank and the replica count.
    strategy = keras_dist.auto_strategy()
    import keras
    import tf_keras

    from keras_dist.tf_keras import DistributedOptimizer

    task = int(strategy.cluster_resolver.task_id)
    report = {
        "strategy": type(strategy).__name__,
        "rank": task,
        "size": int(strategy.num_replicas_in_sync),
    }

    def digest(weights):
        return [np.asarray(w).astype("float64").sum().item() for w in weights]

    # BroadcastGlobalVariablesCallback(0): different seeds, same variables.
    keras.utils.set_random_seed(100 + task)
    tf_keras.utils.set_random_seed(100 + task)
    report["outside_scope"] = {
        "keras3": digest(keras3_model(keras, keras_dist).get_weights()),
        "tf_keras": digest(tf_keras_model(tf_keras).get_weights()),
    }
    with strategy.scope():
        k3 = keras3_model(keras, keras_dist)
        tk = tf_keras_model(tf_keras)
    report["in_scope"] = {
        "keras3": digest(k3.get_weights()),
        "tf_keras": digest(tk.get_weights()),
    }

    # MetricAverageCallback: each worker trains on its own shard.
    x, y = shard(task)
    with strategy.scope():
        k3.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        tk.compile(
            optimizer=DistributedOptimizer(tf_keras.optimizers.SGD(0.1)),
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    dataset = worker_dataset(strategy, x, y)
    for name, model, loss in (
        ("keras3", k3, keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
        (
            "tf_keras",
            tk,
            tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        ),
    ):
        steps = len(x) // (GLOBAL_BATCH // 2)  # one pass over this shard
        history = model.fit(dataset, epochs=EPOCHS, steps_per_epoch=steps, verbose=0)
        evaluated = model.evaluate(dataset, steps=steps, verbose=0)
        # This worker's shard alone, the final model, no strategy involved.
        own = float(loss(y, model(x, training=False)).numpy())
        report[name] = {
            "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
            "evaluate": [float(v) for v in evaluated],
            "own_shard_loss": own,
            "weights": digest(model.get_weights()),
        }
    return report


if __name__ == "__main__":
    print(MARKER + json.dumps(cluster_checks()), flush=True)
