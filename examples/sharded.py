"""ZeRO for Keras: `ShardedOptimizer` keeps 1/N of Adam's state per replica.

Shows: `keras_dist.ShardedOptimizer(keras.optimizers.Adam(...))` training a
small MLP on scikit-learn's digits, one log line per epoch. Each of the N
replicas keeps Adam's two slots for its own slice of the flattened
parameters only, plus the float32 copy of the slice its update runs on;
the example prints, per replica, the bytes of optimizer state it holds
next to the `2 x 4 x P` bytes (two float32 slots per parameter) that plain
Adam keeps on every replica, then the test accuracy. It then trains the
same model with plain Adam and prints how far apart the two sets of
weights are: sharding changes where the state lives, not the result.

One script for one process or several (`keras_dist.auto_strategy()` reads
what the launcher set):

    python examples/sharded.py --cpu-replicas 2     # no GPU: 2 logical CPUs
    python examples/sharded.py                      # every GPU of the machine
    keras-dist launch --workers 2 -- python examples/sharded.py
    python examples/sharded.py --accumulation-steps 4 --cpu-replicas 2
    python examples/sharded.py --smoke --cpu-replicas 2   # seconds, for the tests

With `--accumulation-steps K > 1` (ZeRO stage 2) the gradients are summed
into slice-sized accumulators too, and an update runs every K batches.
On one replica there is nothing to shard: the example says so.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FLOAT32_BYTES = 4


def load_data(smoke):
    """Digits, shuffled once with a fixed seed: (x, y, x_test, y_test)."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    # Mixed once, with a fixed seed: fit then runs with shuffle=False, so the
    # sharded and the plain run see the same batches in the same order.
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = 256 if smoke else int(0.8 * len(x))
    end = 512 if smoke else len(x)
    return x[:split], y[:split], x[split:end], y[split:end]


def build_model(keras, keras_dist, optimizer, hidden):
    """A seeded MLP, so the sharded and the plain run start from the same weights."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    h = keras.layers.Dense(hidden, activation="relu")(inputs)
    h = keras.layers.Dense(hidden // 2, activation="relu")(h)
    outputs = keras.layers.Dense(10)(h)
    model = keras_dist.DistributedModel(inputs, outputs)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def local_bytes(strategy, variables):
    """Bytes of the non-scalar `variables` held by each replica of this process.

    A `ShardedOptimizer`'s state is one value per replica (not mirrored):
    `experimental_local_results` gives this process's replicas' own values.
    The scalars (step counters, learning rate) are left out.
    """
    totals = [0] * local_replicas(strategy)
    for variable in variables:
        if len(variable.shape) == 0:
            continue
        values = strategy.experimental_local_results(variable.value)
        totals = [total + value.numpy().nbytes for total, value in zip(totals, values)]
    return totals


def local_replicas(strategy):
    """The replicas of `strategy` in this process."""
    try:
        return len(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy has no devices list: one
        return 1


def first_replica_id(strategy):
    """The global id of this process's first replica (0 without a cluster)."""
    local = local_replicas(strategy)
    resolver = getattr(strategy, "cluster_resolver", None)
    task_id = getattr(resolver, "task_id", None) or 0
    return int(task_id) * local


def print_state(strategy, optimizer, parameters, accumulation_steps):
    """The table of optimizer state per replica, against plain Adam's."""
    inner = optimizer.inner_optimizer
    own = {id(v) for v in inner.variables}
    slots = local_bytes(strategy, inner.variables)  # Adam's momentum, velocity
    # The wrapper's own state: the float32 parameter slice the update runs
    # on, and with accumulation the slice-sized gradient accumulator.
    wrapper = local_bytes(
        strategy, [v for v in optimizer.variables if id(v) not in own]
    )
    unsharded_slots = 2 * FLOAT32_BYTES * parameters
    # Bytes per parameter beyond the slots: plain Adam under
    # GradientAccumulationOptimizer keeps a full-size float32 accumulator,
    # stage 2 a slice-sized one.
    extra = FLOAT32_BYTES if accumulation_steps > 1 else 0
    unsharded = unsharded_slots + extra * parameters
    replicas = strategy.num_replicas_in_sync
    print(
        f"\nOptimizer state per replica (P = {parameters:,} float32 parameters, "
        f"{replicas} replica(s); bytes):\n"
        "| replica | Adam's slots | unsharded slots | slice + accumulator "
        "| total | unsharded total |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: |"
    )
    first = first_replica_id(strategy)
    for i, (slot_bytes, own_bytes) in enumerate(zip(slots, wrapper)):
        print(
            f"| {first + i} | {slot_bytes:,} | {unsharded_slots:,} | "
            f"{own_bytes:,} | {slot_bytes + own_bytes:,} | {unsharded:,} |"
        )
    kept = "the slice copy and the accumulator" if extra else "the slice copy"
    print(
        "Unsharded, every replica keeps Adam's two float32 slots for all "
        f"{parameters:,} parameters:\n  2 x 4 x {parameters:,} = "
        f"{unsharded_slots:,} bytes. Sharded over {replicas}, each keeps them "
        f"for its slice only: {slots[0] / unsharded_slots:.2f}x.\n  With "
        f"{kept}: {(slots[0] + wrapper[0]) / unsharded:.2f}x of the unsharded "
        f"total ({12 + extra}P/N against {8 + extra}P), smaller with every "
        "replica added.\n  The update's short-lived copies come on top: see "
        "docs/guides/sharding.md."
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--per-replica-batch", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument(
        "--accumulation-steps",
        type=int,
        default=1,
        help="micro-batches per update (> 1: ZeRO stage 2)",
    )
    parser.add_argument("--hidden", type=int, default=256, help="first layer width")
    parser.add_argument(
        "--cpu-replicas",
        type=int,
        help="logical CPU devices in this one process (ignored under "
        "keras-dist launch, where each worker is a replica)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny, fast run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs, args.per_replica_batch, args.hidden = 2, 16, 64
        args.learning_rate = 1e-2  # few updates: larger ones, to show learning
    for name in ("epochs", "per_replica_batch", "accumulation_steps"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be >= 1. "
                f"Received: {getattr(args, name)}."
            )
    if args.hidden < 2:  # the second layer is half as wide
        parser.error(f"--hidden must be >= 2. Received: {args.hidden}.")

    import keras
    import numpy as np

    import keras_dist

    if args.cpu_replicas and os.environ.get("TF_CONFIG"):
        # auto_strategy refuses cpu_replicas in a multi-process job: every
        # process would train on its own instead of with the others.
        print(
            f"--cpu-replicas {args.cpu_replicas} ignored: TF_CONFIG describes "
            "a cluster (keras-dist launch), whose workers are the replicas.",
            file=sys.stderr,
        )
    if args.cpu_replicas and not os.environ.get("TF_CONFIG"):
        strategy = keras_dist.auto_strategy(cpu_replicas=args.cpu_replicas)
    else:
        strategy = keras_dist.auto_strategy()
    replicas = strategy.num_replicas_in_sync
    x, y, x_test, y_test = load_data(args.smoke)
    batch = args.per_replica_batch * replicas
    print(
        f"digits: {len(x)} training / {len(x_test)} test images; "
        f"{type(strategy).__name__}, {replicas} replica(s); global batch "
        f"{batch}, {args.accumulation_steps} batch(es) per update"
    )
    if replicas == 1:
        print(
            "One replica: nothing to shard (its slice is every parameter, so "
            "it keeps more than plain Adam,\n  below). Pass --cpu-replicas 2, "
            "or start it with keras-dist launch --workers 2."
        )

    def train(optimizer):
        with strategy.scope():  # the model and its optimizer: one scope
            model = build_model(keras, keras_dist, optimizer(), args.hidden)
        model.fit(x, y, batch_size=batch, epochs=args.epochs, shuffle=False, verbose=2)
        return model

    def adam():
        return keras.optimizers.Adam(args.learning_rate)

    print("--- ShardedOptimizer(Adam)")
    sharded = train(
        lambda: keras_dist.ShardedOptimizer(
            adam(), accumulation_steps=args.accumulation_steps
        )
    )
    _, accuracy = sharded.evaluate(x_test, y_test, batch_size=batch, verbose=0)
    parameters = sum(int(np.prod(v.shape)) for v in sharded.trainable_variables)
    print_state(strategy, sharded.optimizer, parameters, args.accumulation_steps)
    updates = int(sharded.optimizer.iterations.numpy())
    print(f"test accuracy: {accuracy:.3f} after {updates} updates")

    print("--- plain Adam, the same model, data and batches")
    if args.accumulation_steps > 1:
        plain = train(
            lambda: keras_dist.GradientAccumulationOptimizer(
                adam(), accumulation_steps=args.accumulation_steps
            )
        )
    else:
        plain = train(adam)
    _, plain_accuracy = plain.evaluate(x_test, y_test, batch_size=batch, verbose=0)
    difference = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(sharded.get_weights(), plain.get_weights())
    )
    print(
        f"plain Adam: test accuracy {plain_accuracy:.3f}; max |w_sharded - "
        f"w_plain| = {difference:.1e} over {parameters:,} weights: the same "
        "training, to float rounding (the slices are summed in another order)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
