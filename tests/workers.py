"""Bodies of the multi-worker tests; each runs in a real worker process.

This module holds no tests. It lives apart from the test modules so the worker
processes import neither pytest nor conftest (which would reconfigure the
devices); `keras_dist.testing.run_workers` imports it by name in each worker.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")


def stock_keras_fit():
    """Stock `keras.Model.fit` under MultiWorkerMirroredStrategy."""
    import tensorflow as tf
    from helpers import compile_model, make_data, mlp

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = make_data()
    with strategy.scope():
        model = compile_model(mlp(), "sgd")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    model.fit(dataset, epochs=1, verbose=0)
    return "trained"


def distributed_fit(optimizer_names, epochs=2, batch_size=16, clip=False):
    """DistributedModel fit/evaluate/predict under MultiWorkerMirroredStrategy.

    Returns a dict per optimizer with weights, history, evaluation and
    predictions, to compare with single-device training in the parent.
    """
    import keras
    import tensorflow as tf
    from helpers import OPTIMIZERS, compile_model, make_data, mlp, sharded_dataset

    import keras_dist

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = make_data()
    dataset = sharded_dataset(x, y, batch_size)
    results = {}
    for name in optimizer_names:
        with strategy.scope():
            optimizer = OPTIMIZERS[name]()
            if clip:
                optimizer = keras.optimizers.SGD(0.5, global_clipnorm=0.05)
            model = compile_model(mlp(keras_dist.DistributedModel), optimizer)
        history = model.fit(dataset, epochs=epochs, verbose=0)
        results[name] = {
            "weights": model.get_weights(),
            "history": history.history,
            "evaluate": model.evaluate(dataset, verbose=0),
            "predict": model.predict(x, batch_size=batch_size, verbose=0),
        }
    return results


def accumulated_fit(optimizer_names, accumulation_steps, micro_batch, epochs=2):
    """GradientAccumulationOptimizer with DistributedModel, multi-worker.

    Returns a dict per optimizer name (keys of `ACCUMULATION_OPTIMIZERS` in
    tests/test_optimizers.py, rebuilt here without importing that module).
    """
    import keras
    import tensorflow as tf
    from helpers import OPTIMIZERS, compile_model, make_data, mlp, sharded_dataset

    import keras_dist

    factories = {
        **OPTIMIZERS,
        "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
        "adam_clip": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.1),
        "adamw_clip": lambda: keras.optimizers.AdamW(
            0.01, weight_decay=0.1, global_clipnorm=0.1
        ),
    }
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = make_data()
    global_micro = micro_batch * strategy.num_replicas_in_sync
    dataset = sharded_dataset(x, y, global_micro)
    results = {}
    for name in optimizer_names:
        with strategy.scope():
            optimizer = keras_dist.GradientAccumulationOptimizer(
                factories[name](), accumulation_steps=accumulation_steps
            )
            model = compile_model(mlp(keras_dist.DistributedModel), optimizer)
        model.fit(dataset, epochs=epochs, verbose=0)
        results[name] = {
            "weights": model.get_weights(),
            "iterations": int(optimizer.iterations.numpy()),
            "micro_steps": int(optimizer.micro_steps.numpy()),
        }
    return results


def adaptive_autoscale_fit(epochs=3):
    """Adaptive AutoScaleBatch under MultiWorkerMirroredStrategy.

    Returns the per-epoch batch size, learning rate and noise scale, and the
    final weights, so the parent can check that every worker decided alike.
    """
    import keras
    import numpy as np
    import tensorflow as tf
    from helpers import compile_model, mlp

    import keras_dist

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")
    with strategy.scope():
        optimizer = keras_dist.GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.05), accumulation_steps=1
        )
        model = compile_model(mlp(keras_dist.DistributedModel), optimizer)
    autoscale = keras_dist.callbacks.AutoScaleBatch(
        per_replica_batch_size=8,
        adaptive=True,
        max_batch_size=64,
        adapt_every=2,
        ema_decay=0.5,
    )
    history = model.fit(x, y, epochs=epochs, callbacks=[autoscale], verbose=0)
    return {
        "history": {
            key: history.history[key]
            for key in ("batch_size", "learning_rate", "noise_scale")
        },
        "weights": model.get_weights(),
    }


def uneven_fit(cases, epochs=2):
    """DistributedModel on datasets whose last batch is short, multi-worker.

    `cases` are `(examples, global_batch, accumulation_steps)`; returns the
    weights of each, to compare with one device in the parent.
    """
    import tensorflow as tf
    from helpers import sharded_dataset, uneven_data, uneven_model

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    results = []
    for examples, batch, steps in cases:
        x, y = uneven_data(examples)
        with strategy.scope():
            model = uneven_model(steps)
        model.fit(sharded_dataset(x, y, batch), epochs=epochs, verbose=0)
        results.append(model.get_weights())
    return results


def compressed_fit(hook_configs, epochs=2, batch_size=16, strategy=None):
    """Trains the helpers' MLP with each hook under MultiWorkerMirroredStrategy.

    Args:
        hook_configs: List of `keras.saving.serialize_keras_object` outputs.
        strategy: The `MultiWorkerMirroredStrategy` to train under (`None`:
            a new one).

    Returns:
        Per hook (in order): weights, loss history, stats ratio, this
        worker's copy of every hook state variable, and the gloo group's
        running count of all-reduces and bytes after that fit (`None` when
        the sums went through TensorFlow's collectives, see test_gloo.py).
    """
    import keras
    import tensorflow as tf
    from helpers import compile_model, make_data, mlp, sharded_dataset

    import keras_dist
    import keras_dist.compression  # registers the hooks for deserialization
    from keras_dist.core import gloo

    strategy = strategy or tf.distribute.MultiWorkerMirroredStrategy()
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
        group = gloo.group_for(strategy)
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
                "gloo": None if group is None else (group.calls, group.bytes),
            }
        )
    return results


def compressed_and_sharded_fits(hook_configs, sharded_cases):
    """`compressed_fit(hook_configs)`, then
    `sharding_workers.sharded_cases(sharded_cases)`, on one strategy (one
    cluster start for test_gloo.py's two equality checks).

    Returns:
        Dict: `"compressed"` and `"sharded"`, the two results, and
        `"sharded_base"`: the gloo group's running count of collectives by
        kind before the sharded fits (`None` on TensorFlow's collectives),
        and `"chunked"`: whether TensorFlow's collectives would carry the
        sharded segments in chunks (`core/chunked.py`).
    """
    import sharding_workers
    import tensorflow as tf

    from keras_dist.core import chunked, gloo

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    compressed = compressed_fit(hook_configs, strategy=strategy)
    group = gloo.group_for(strategy)
    return {
        "compressed": compressed,
        "sharded_base": None if group is None else dict(group.ops),
        "chunked": chunked.applies(strategy),
        "sharded": sharding_workers.sharded_cases(sharded_cases, strategy=strategy),
    }


def strategy_with_communication_options():
    """`auto_strategy(communication_options=...)` in a real worker: the options
    reach MultiWorkerMirroredStrategy, and a collective sums across workers."""
    import tensorflow as tf

    import keras_dist
    from keras_dist.core import watchdog

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=120,
    )
    strategy = keras_dist.auto_strategy(communication_options=options)
    total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
    used = strategy.extended._communication_options
    # The timeout moved to the watchdog (no thread per collective); the
    # user's options object is left as it was.
    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy),
        float(total),
        used.implementation.name,
        used.timeout_seconds,
        watchdog.timeout_of(strategy),
        options.timeout_seconds,
    )


def one_worker_without_pytorch():
    """Worker 1 cannot import PyTorch, worker 0 can, neither sets the
    backend: each returns the error `auto_strategy` gives, or `None`."""
    import json
    import os
    import sys

    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
        sys.modules["torch"] = None  # what `import torch` meets uninstalled
    return _auto_strategy_error()


def disagreeing_backends():
    """Worker 0 asks for the gloo backend, worker 1 for TensorFlow's: each
    returns the error `auto_strategy` gives, or `None`."""
    import json
    import os

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    os.environ["KERAS_DIST_COLLECTIVES"] = "gloo" if index == 0 else "tensorflow"
    return _auto_strategy_error()


def _auto_strategy_error():
    """The `ValueError` message `keras_dist.auto_strategy()` raises, or `None`."""
    import keras_dist

    try:
        keras_dist.auto_strategy()
    except ValueError as error:
        return str(error)
    return None


def half_sums(lengths, steps=2):
    """Sums float16 and bfloat16 vectors of `lengths` elements through gloo
    (`KERAS_DIST_COLLECTIVES=gloo`), worker `i` adding `i + 1` times a
    fixed random vector per length. Returns, per dtype, whether every sum
    has the bits of TensorFlow's adds of the workers' vectors in worker
    order (what gloo's half-precision path must return) and the first 3
    values of each sum as float32; and how many sums the group's second
    all-to-all completed."""
    import numpy as np
    import tensorflow as tf

    import keras_dist
    from keras_dist.core import collectives, gloo

    strategy = keras_dist.auto_strategy()
    rank = strategy.cluster_resolver.task_id
    workers = strategy.num_replicas_in_sync
    base = [
        tf.constant(np.random.default_rng(n).normal(size=n), tf.float32)
        for n in lengths
    ]
    out = {}
    for dtype in (tf.float16, tf.bfloat16):

        def own(worker, dtype=dtype):
            return [tf.cast(b * (worker + 1) / 3, dtype) for b in base]

        @tf.function
        def step(values):
            return strategy.run(
                lambda *parts: collectives.all_reduce_sum(list(parts)), args=values
            )

        for _ in range(steps):
            got = step(tuple(own(rank)))
        expected = own(0)
        for worker in range(1, workers):
            expected = [e + v for e, v in zip(expected, own(worker))]
        out[dtype.name] = {
            "equal": all(
                np.array_equal(
                    tf.bitcast(g, tf.int16).numpy(), tf.bitcast(e, tf.int16).numpy()
                )
                for g, e in zip(got, expected)
            ),
            "sums": [tf.cast(g, tf.float32).numpy().tolist()[:3] for g in got],
        }
    out["issued"] = gloo.group_for(strategy)._halves.issued
    return out
