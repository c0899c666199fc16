"""Bodies of the gloo backend's multi-worker tests (tests/test_gloo.py).

Each runs in a real worker process started by `keras_dist.testing.run_workers`
with `KERAS_DIST_COLLECTIVES` set (or not) in its environment. This module
holds no tests, so the workers import neither pytest nor conftest.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")


def hooks_fit(hook_configs, epochs=2, batch_size=16):
    """Trains the helpers' MLP with each hook on MultiWorkerMirroredStrategy.

    Returns, per hook: the weights and losses; and the gloo group's count of
    all-reduces and bytes (`None` when the gradients went through
    TensorFlow's collectives).
    """
    import keras
    import tensorflow as tf
    from helpers import compile_model, make_data, mlp, sharded_dataset

    import keras_dist
    import keras_dist.compression  # registers the hooks for deserialization
    from keras_dist.core import gloo

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = make_data()
    dataset = sharded_dataset(x, y, batch_size)
    results = []
    before = (0, 0)
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
                "gloo": None
                if group is None
                else (group.calls - before[0], group.bytes - before[1]),
            }
        )
        if group is not None:
            before = (group.calls, group.bytes)
    return results


def sums_until_a_peer_dies(how="kill", deaths_after=2, sums=5):
    """Sums through gloo; worker 1 stops after `deaths_after` sums.

    `how`: `"kill"` (worker 1 SIGKILLs itself) or `"hang"` (it sleeps, alive,
    its sockets open; the strategy's `collective_timeout` is 5 s).

    Run as a script by the test (not by `run_workers`, which would stop
    worker 0 when worker 1 dies). Prints worker 0's outcome as JSON: the
    sums that succeeded, the error's type and message, whether
    `gloo.is_failure` knows it, and the seconds the failing sum took.
    """
    import json
    import signal
    import time

    import tensorflow as tf

    import keras_dist
    from keras_dist.core import collectives, gloo

    timeout = 5 if how == "hang" else None
    strategy = keras_dist.auto_strategy(collective_timeout=timeout)
    rank = strategy.cluster_resolver.task_id

    @tf.function
    def step(value):
        return strategy.run(lambda v: collectives.all_reduce_sum([v])[0], args=(value,))

    value = tf.ones([1000])
    for done in range(sums):
        if rank == 1 and done == deaths_after:
            if how == "hang":
                time.sleep(120)
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            total = float(tf.reduce_sum(step(value)))
        except tf.errors.OpError as error:
            outcome = {
                "done": done,
                "type": type(error).__name__,
                "message": error.message,
                "is_failure": gloo.is_failure(error),
                "seconds": time.monotonic() - start,
            }
            break
        assert total == 2000.0, total
    else:
        outcome = {"done": sums}
    print("OUTCOME " + json.dumps(outcome), flush=True)


if __name__ == "__main__":
    import sys

    sums_until_a_peer_dies(sys.argv[1])
