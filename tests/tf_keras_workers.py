"""tf_keras models, data and worker functions for `tests/test_tf_keras.py`.

Module-level functions, so `keras_dist.testing.run_workers` can run them in
real worker processes.
"""

import numpy as np

FEATURES, OUTPUTS, EXAMPLES = 8, 2, 64


def optimizers():
    import tf_keras

    return {
        "sgd": lambda: tf_keras.optimizers.SGD(0.1),
        "momentum": lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9),
        "adam": lambda: tf_keras.optimizers.Adam(0.01),
        "adam_clip": lambda: tf_keras.optimizers.Adam(0.01, global_clipnorm=0.1),
    }


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    y = rng.normal(size=(EXAMPLES, OUTPUTS)).astype("float32")
    return x, y


def initial_weights():
    rng = np.random.default_rng(1)
    return [
        rng.normal(size=(FEATURES, 16)).astype("float32"),
        np.zeros(16, "float32"),
        rng.normal(size=(16, OUTPUTS)).astype("float32"),
        np.zeros(OUTPUTS, "float32"),
    ]


def mlp(optimizer):
    """A small tf_keras MLP with fixed weights, compiled with `optimizer`."""
    import tf_keras

    model = tf_keras.Sequential(
        [
            tf_keras.layers.Dense(16, activation="tanh", input_shape=(FEATURES,)),
            tf_keras.layers.Dense(OUTPUTS),
        ]
    )
    model.set_weights(initial_weights())
    model.compile(optimizer=optimizer, loss="mse")
    return model


def one_device(name, batch_size, epochs):
    """The reference: the plain optimizer, one device, the big batch."""
    model = mlp(optimizers()[name]())
    x, y = data()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


def distributed_fit(strategy, name, accumulation_steps, global_micro, epochs, hook):
    from keras_dist.tf_keras import DistributedOptimizer

    with strategy.scope():
        optimizer = DistributedOptimizer(
            optimizers()[name](),
            all_reduce_hook=hook,
            accumulation_steps=accumulation_steps,
        )
        model = mlp(optimizer)
    x, y = data()
    model.fit(x, y, batch_size=global_micro, epochs=epochs, shuffle=False, verbose=0)
    return model


def multi_worker_fit(strategy, names, accumulation_steps, micro_batch, epochs):
    """DistributedOptimizer under MultiWorkerMirroredStrategy, one per name."""
    global_micro = micro_batch * strategy.num_replicas_in_sync
    results = {}
    for name in names:
        model = distributed_fit(
            strategy, name, accumulation_steps, global_micro, epochs, hook=None
        )
        results[name] = {
            "weights": model.get_weights(),
            "iterations": int(model.optimizer.iterations.numpy()),
        }
    return results


def digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32").reshape(-1, 8, 8, 1)
    return x[:1500], y[:1500].astype("int32"), x[1500:], y[1500:].astype("int32")


def digits_cnn():
    import tf_keras

    return tf_keras.Sequential(
        [
            tf_keras.layers.Conv2D(16, 3, activation="relu", input_shape=(8, 8, 1)),
            tf_keras.layers.Flatten(),
            tf_keras.layers.Dense(64, activation="relu"),
            tf_keras.layers.Dense(10),
        ]
    )


def pruned_fit(strategy, target=0.8, epochs=8, accumulation_steps=2, micro_batch=16):
    """Prunes the digits CNN to `target` with FP16 and accumulation.

    Returns the stripped model's per-layer sparsity and test accuracy, every
    replica's masks, the pruning steps and the optimizer's updates.
    """
    import tensorflow as tf
    import tf_keras

    import keras_dist
    from keras_dist.tf_keras import (
        DistributedOptimizer,
        UpdatePruningStep,
        import_tfmot,
    )

    tfmot = import_tfmot()
    x, y, x_test, y_test = digits()
    global_micro = micro_batch * strategy.num_replicas_in_sync
    batches_per_epoch = -(-len(x) // global_micro)
    # A partial accumulation carries over into the next epoch.
    updates = batches_per_epoch * epochs // accumulation_steps
    updates_per_epoch = batches_per_epoch // accumulation_steps
    with strategy.scope():
        schedule = tfmot.sparsity.keras.PolynomialDecay(
            initial_sparsity=0.0,
            final_sparsity=target,
            begin_step=0,
            end_step=updates_per_epoch * (epochs - 2),
            frequency=10,
        )
        model = tfmot.sparsity.keras.prune_low_magnitude(
            digits_cnn(), pruning_schedule=schedule
        )
        model.compile(
            optimizer=DistributedOptimizer(
                tf_keras.optimizers.Adam(0.005),
                all_reduce_hook=keras_dist.compression.FP16(),
                accumulation_steps=accumulation_steps,
            ),
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_micro)
    model.fit(dataset, epochs=epochs, callbacks=[UpdatePruningStep()], verbose=0)
    masks = []
    steps = []
    for layer in model.layers:
        if hasattr(layer, "pruning_vars"):
            steps.append(int(layer.pruning_step.numpy()))
            for _, mask, _ in layer.pruning_vars:
                masks.append(
                    [m.numpy() for m in strategy.experimental_local_results(mask)]
                )
    stripped = tfmot.sparsity.keras.strip_pruning(model)
    stripped.compile(
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    sparsity = {
        layer.name: float(np.mean(layer.kernel.numpy() == 0))
        for layer in stripped.layers
        if hasattr(layer, "kernel")
    }
    return {
        "sparsity": sparsity,
        "accuracy": float(stripped.evaluate(x_test, y_test, verbose=0)[1]),
        "masks": masks,
        "pruning_steps": steps,
        "updates": int(model.optimizer.iterations.numpy()),
        "expected_updates": updates,
        "weights": [w.numpy() for w in stripped.weights],
    }


def multi_worker_all(names):
    """The equality runs and the pruning run, on one cluster of workers."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    pruning = pruned_fit(strategy, epochs=6)
    del pruning["masks"]  # one replica per worker: compared across workers
    return {
        "equality": multi_worker_fit(strategy, names, 2, 8, epochs=2),
        "pruning": pruning,
    }
