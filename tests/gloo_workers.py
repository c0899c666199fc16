"""The gloo backend's lost-peer script (tests/test_gloo.py).

Run as a script in each worker process (not by `run_workers`, which would
stop worker 0 when worker 1 dies); the fits that compare the backends are
`workers.compressed_fit`. This module holds no tests, so the workers import
neither pytest nor conftest.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")


def sums_until_a_peer_dies(how="kill", deaths_after=2, sums=5):
    """Sums through gloo; worker 1 stops after `deaths_after` sums.

    `how`: `"kill"` (worker 1 SIGKILLs itself), `"hang"` (it sleeps, alive,
    its sockets open; the strategy's `collective_timeout` is 5 s) or
    `"stop"` (it SIGSTOPs itself, heartbeats included; no timeout);
    `"stop_first"`: worker 0 (the cluster's first, where collective groups
    are registered) SIGSTOPs itself, and worker 1 reports.

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

    dtype = tf.float16 if how.endswith("_half") else tf.float32
    how = how.removesuffix("_half")
    timeout = 5 if how == "hang" else None
    strategy = keras_dist.auto_strategy(collective_timeout=timeout)
    rank = strategy.cluster_resolver.task_id

    @tf.function
    def step(value):
        return strategy.run(lambda v: collectives.all_reduce_sum([v])[0], args=(value,))

    value = tf.ones([1000], dtype)
    victim = 0 if how == "stop_first" else 1
    for done in range(sums):
        if rank == victim and done == deaths_after:
            if how == "hang":
                time.sleep(120)
            if how in ("stop", "stop_first"):
                os.kill(os.getpid(), signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            total = float(tf.reduce_sum(tf.cast(step(value), tf.float32)))
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
