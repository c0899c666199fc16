"""Bodies of the sharded-optimizer tests that run in real worker processes.

Like `workers.py`: no tests here, and neither pytest nor conftest imported.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# name -> factory of the inner optimizer (also used by tests/test_sharding.py).
INNER = {
    "sgd": lambda keras: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda keras: keras.optimizers.Adam(0.01),
    "adamw": lambda keras: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda keras: keras.optimizers.RMSprop(0.01, momentum=0.5),
    "adagrad": lambda keras: keras.optimizers.Adagrad(0.1),
    "adamax": lambda keras: keras.optimizers.Adamax(0.01),
    "nadam": lambda keras: keras.optimizers.Nadam(0.01),
    "lion": lambda keras: keras.optimizers.Lion(0.001),
    "adadelta": lambda keras: keras.optimizers.Adadelta(1.0),
    "ftrl": lambda keras: keras.optimizers.Ftrl(0.1, l2_regularization_strength=0.01),
    "global_clipnorm": lambda keras: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
    "clipnorm": lambda keras: keras.optimizers.Adam(0.01, clipnorm=0.02),
    "clipvalue": lambda keras: keras.optimizers.SGD(0.1, clipvalue=0.01),
}

# name -> factory of an optimizer that needs whole variables: sharded by
# variables (tests/test_sharding_ownership.py).
OWNED = {
    "adafactor": lambda keras: keras.optimizers.Adafactor(0.05),
    "lamb": lambda keras: keras.optimizers.Lamb(0.01),
    "muon": lambda keras: keras.optimizers.Muon(0.01),
}


def sharded_cases(cases, epochs=2, save_to=None, strategy=None):
    """ShardedOptimizer with DistributedModel on MultiWorkerMirroredStrategy,
    one strategy for all cases `(name, accumulation_steps, micro_batch,
    hook_config)` (`name` a key of `INNER` or `OWNED`, `hook_config` a
    serialized all-reduce hook or `None`); with `save_to`, each worker saves
    each model as `<name>-<task>.keras` there. `strategy`: the
    `MultiWorkerMirroredStrategy` to train under (`None`: a new one).

    Returns a list, in the cases' order, of each case's weights, iterations,
    the shape of a slot's local slices, the variables whose state this
    worker keeps when sharded by variables (`owned`), and, with the gloo
    backend, the group's running count of collectives by kind (`None` on
    TensorFlow's collectives).
    """
    import keras
    import tensorflow as tf
    from helpers import (
        SEGMENT_BYTES,
        compile_model,
        make_data,
        mlp,
        sharded_dataset,
    )

    import keras_dist
    import keras_dist.compression  # registers the hooks for deserialization
    from keras_dist.core import gloo

    strategy = strategy or tf.distribute.MultiWorkerMirroredStrategy()
    x, y = make_data()
    results = []
    for name, accumulation_steps, micro_batch, hook_config in cases:
        dataset = sharded_dataset(x, y, micro_batch * strategy.num_replicas_in_sync)
        with strategy.scope():
            optimizer = keras_dist.ShardedOptimizer(
                {**INNER, **OWNED}[name](keras),
                accumulation_steps=accumulation_steps,
                bucket_bytes=SEGMENT_BYTES,
            )
            model = compile_model(mlp(keras_dist.DistributedModel), optimizer)
            if hook_config is not None:
                hook = keras.saving.deserialize_keras_object(hook_config)
                model.register_all_reduce_hook(hook)
        model.fit(dataset, epochs=epochs, verbose=0)
        if save_to is not None:
            # Every worker saves (the collectives of a save need them all).
            task = strategy.cluster_resolver.task_id
            model.save(os.path.join(save_to, f"{name}-{task}.keras"))
        group = gloo.group_for(strategy)
        slots = optimizer.inner_optimizer.variables[-1]
        local = strategy.experimental_local_results(slots.value)
        owned = getattr(optimizer, "_owned", None)
        results.append(
            {
                "weights": model.get_weights(),
                "iterations": int(optimizer.iterations.numpy()),
                "slot_shape": [tuple(c.shape) for c in local],
                # Sharded by variables: those whose state this worker keeps.
                "owned": None if owned is None else sorted(owned.optimizers),
                "gloo": None if group is None else dict(group.ops),
            }
        )
    return results
