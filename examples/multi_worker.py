"""Exercises 2 and 3: MultiWorkerMirroredStrategy simulated on one machine.

Shows: several worker processes forming one synchronous cluster through
`TF_CONFIG` on different localhost ports, started by the keras_dist launcher,
and `keras_dist.DistributedModel.fit` training across them (stock Keras 3
`fit` fails under this strategy). The log lines show the coordination: each
worker's role, the cluster, its data shard, a cross-worker all-reduce, and
identical weights on every worker at the end.

    keras-dist launch --workers 2 -- python examples/multi_worker.py
    keras-dist launch --workers 2 -- python examples/multi_worker.py --smoke

Exercise 3 (parameter servers): `examples/parameter_server.py` trains the
same kind of model asynchronously with `keras-dist launch --workers 2 --ps 1
--chief`, and compares it with this synchronous strategy, with and without a
slow worker (docs/guides/parameter_servers.md).
"""

import argparse
import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--per-worker-batch", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="tiny, fast run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs = 1
    if not os.environ.get("TF_CONFIG"):
        print(
            "No TF_CONFIG: start this script through the launcher, e.g.\n"
            "  keras-dist launch --workers 2 -- python examples/multi_worker.py",
            file=sys.stderr,
        )
        return 2

    import keras
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    import keras_dist

    config = json.loads(os.environ["TF_CONFIG"])
    task = config["task"]
    print(f"I am {task['type']}:{task['index']} of cluster {config['cluster']}")
    strategy = keras_dist.auto_strategy()
    print(
        f"strategy {type(strategy).__name__}: "
        f"{strategy.num_replicas_in_sync} replicas in sync"
    )

    # A cross-worker all-reduce: every worker contributes its task index + 1.
    total = strategy.reduce(
        "SUM",
        strategy.run(lambda: tf.constant(float(task["index"] + 1))),
        axis=None,
    )
    print(f"all-reduce of (task index + 1) over workers: {float(total):g}")

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    if args.smoke:
        x, y = x[:256], y[:256]
    global_batch = args.per_worker_batch * strategy.num_replicas_in_sync
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=0)
        .batch(global_batch)
        .with_options(options)
    )
    print(
        f"global batch {global_batch} = {args.per_worker_batch} per worker x "
        f"{strategy.num_replicas_in_sync}; each worker reads its shard of "
        "every batch"
    )
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((8, 8, 1))
        h = keras.layers.Conv2D(16, 3, activation="relu")(inputs)
        h = keras.layers.Flatten()(h)
        outputs = keras.layers.Dense(10)(h)
        model = keras_dist.DistributedModel(inputs, outputs)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    model.fit(dataset, epochs=args.epochs, verbose=2)
    loss, accuracy = model.evaluate(dataset, verbose=0)
    digest = hashlib.sha256(
        b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())
    ).hexdigest()[:16]
    print(f"loss {loss:.4f} accuracy {accuracy:.3f} (over all workers' data)")
    print(f"weights sha256 {digest} (identical on every worker)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
