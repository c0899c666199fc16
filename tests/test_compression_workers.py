"""Bodies of the multi-worker compression tests; each runs in a worker process.

This module holds no tests. It imports neither pytest nor conftest (which
would reconfigure the devices), so the worker processes can import it.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")


def compressed_fit(hook_configs, epochs=2, batch_size=16):
    """Trains the helpers' MLP with each hook under MultiWorkerMirroredStrategy.

    Args:
        hook_configs: List of `keras.saving.serialize_keras_object` outputs.

    Returns:
        Per hook (in order): weights, loss history, stats ratio, and this
        worker's copy of every hook state variable.
    """
    import keras
    import tensorflow as tf
    from helpers import compile_model, make_data, mlp, sharded_dataset

    import keras_dist
    import keras_dist.compression  # registers the hooks for deserialization

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = make_data()
    dataset = sharded_dataset(x, y, batch_size)
    results = []
    for config in hook_configs:
        hook = keras.saving.deserialize_keras_object(config)
        with strategy.scope():
            model = compile_model(
                mlp(keras_dist.DistributedModel), keras.optimizers.SGD(0.1)
            )
            model.register_all_reduce_hook(hook)
        history = model.fit(dataset, epochs=epochs, verbose=0)
        results.append(
            {
                "weights": model.get_weights(),
                "loss": history.history["loss"],
                "ratio": hook.stats().ratio,
                # The local copy, read without a collective.
                "state": {
                    name: strategy.experimental_local_results(variable)[0].numpy()
                    for name, variable in hook._state.items()
                },
            }
        )
    return results
