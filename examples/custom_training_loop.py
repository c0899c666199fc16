"""A custom training loop with MirroredStrategy that matches one device.

Shows: the classic `tf.distribute` custom loop (`strategy.run` on a
distributed dataset, `strategy.reduce` of the per-replica losses, a loss
averaged over the GLOBAL batch) with keras_dist doing the gradient step:
`keras_dist.DistributedModel.apply_gradients` sums the replicas' gradients
once through the model's all-reduce hook, then lets the optimizer clip and
update. With `--accumulation-steps K` the model's optimizer is a
`keras_dist.GradientAccumulationOptimizer`: K micro-batches, one update.

The same loop then runs on one device, from the same initial weights, with
the batch that one update sees (K x the global batch), and the example
prints how far apart the two sets of trained weights are: float rounding.

Without a GPU, the replicas are logical CPU devices.

    python examples/custom_training_loop.py
    python examples/custom_training_loop.py --accumulation-steps 4
    python examples/custom_training_loop.py --smoke   # seconds, for the tests
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def make_strategy(tf, cpu_replicas):
    """MirroredStrategy over the GPUs, or over `cpu_replicas` logical CPUs."""
    if tf.config.list_physical_devices("GPU"):
        return tf.distribute.MirroredStrategy()
    # Must happen before TensorFlow initialises (before the first tensor).
    # `keras_dist.auto_strategy(cpu_replicas=...)` does the same in one call.
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * cpu_replicas
    )
    devices = [f"/cpu:{i}" for i in range(cpu_replicas)]
    # NCCL cannot reduce between CPU devices.
    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


def load_digits_data(smoke):
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    x, y = x[order], y[order]
    if smoke:
        return x[:256], y[:256], x[256:512], y[256:512]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def build_model(keras, keras_dist):
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, activation="relu")(inputs)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(64, activation="relu")(h)
    outputs = keras.layers.Dense(10)(h)
    return keras_dist.DistributedModel(inputs, outputs)


def train(strategy, data, initial_weights, args, batch, accumulation_steps):
    """Runs the custom loop under `strategy`; returns the trained model.

    `batch` is the global batch of one `strategy.run` step; one optimizer
    update sees `accumulation_steps` of them.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_dist

    x, y, x_test, y_test = data
    with strategy.scope():
        model = build_model(keras, keras_dist)
        model.set_weights(initial_weights)
        # SGD, not Adam: Adam is blind to the scale of the loss, so it would
        # hide the classic bug this comparison catches (a loss averaged per
        # replica instead of over the global batch, i.e. N times too large).
        optimizer = keras.optimizers.SGD(args.learning_rate, momentum=0.9)
        if accumulation_steps > 1:
            optimizer = keras_dist.GradientAccumulationOptimizer(
                optimizer, accumulation_steps=accumulation_steps
            )
        model.compile(optimizer=optimizer)
        # fit() builds the all-reduce hook and the optimizer itself; a custom
        # loop asks for it here, in cross-replica context, before the first
        # strategy.run (a GradientAccumulationOptimizer cannot build inside it).
        model.build_all_reduce_hook()
        # reduction=None: one loss per example, averaged below over the
        # GLOBAL batch, so that summing the replicas' losses (and gradients)
        # gives the mean over the global batch, as on one device.
        loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None
        )

    # Batches of exactly `batch` examples: compute_average_loss divides by
    # the global batch size, which must be the true one for every step.
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=0, reshuffle_each_iteration=True)
        .batch(batch, drop_remainder=True)
    )
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    def step_fn(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            logits = model(features, training=True)
            per_example = loss_fn(labels, logits)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
        grads = tape.gradient(loss, model.trainable_variables)
        # Sums over replicas with the model's hook, then clips and updates
        # (on every K-th call only, with accumulation).
        model.apply_gradients(grads, model.trainable_variables)
        correct = tf.reduce_sum(
            tf.cast(
                tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels),
                tf.float32,
            )
        )
        return loss, correct

    @tf.function
    def train_step(inputs):
        per_replica_losses, per_replica_correct = strategy.run(step_fn, args=(inputs,))
        loss = strategy.reduce(
            tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None
        )
        correct = strategy.reduce(
            tf.distribute.ReduceOp.SUM, per_replica_correct, axis=None
        )
        return loss, correct

    for epoch in range(1, args.epochs + 1):
        total_loss, total_correct, steps = 0.0, 0.0, 0
        start = time.perf_counter()
        for inputs in dist_dataset:
            loss, correct = train_step(inputs)
            total_loss += float(loss)
            total_correct += float(correct)
            steps += 1
        seconds = time.perf_counter() - start
        logits = model.predict(x_test, batch_size=256, verbose=0)
        test_accuracy = float(np.mean(np.argmax(logits, -1) == y_test))
        print(
            f"  epoch {epoch}: loss {total_loss / steps:.4f}  "
            f"accuracy {total_correct / (steps * batch):.3f}  "
            f"test accuracy {test_accuracy:.3f}  "
            f"({steps} steps, {int(model.optimizer.iterations.numpy())} updates "
            f"so far, {seconds:.1f}s)"
        )
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--per-replica-batch", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=0.02)
    parser.add_argument(
        "--accumulation-steps",
        type=int,
        default=1,
        help="micro-batches per update (GradientAccumulationOptimizer)",
    )
    parser.add_argument(
        "--cpu-replicas",
        type=int,
        default=2,
        help="logical CPU devices when there is no GPU",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny, fast run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs, args.per_replica_batch = 2, 16
    if args.accumulation_steps < 1 or args.cpu_replicas < 1:
        parser.error(
            "--accumulation-steps and --cpu-replicas must be >= 1. Received: "
            f"--accumulation-steps={args.accumulation_steps}, "
            f"--cpu-replicas={args.cpu_replicas}."
        )

    import tensorflow as tf

    strategy = make_strategy(tf, args.cpu_replicas)

    import keras
    import numpy as np

    import keras_dist

    replicas = strategy.num_replicas_in_sync
    global_batch = args.per_replica_batch * replicas
    k = args.accumulation_steps
    x, y, x_test, y_test = load_digits_data(args.smoke)
    # Whole updates only: a partial accumulation would carry over into the
    # next epoch, where the one-device run has no counterpart.
    used = len(x) // (k * global_batch) * (k * global_batch)
    if not used:
        parser.error(
            f"one update needs {k * global_batch} examples, more than the "
            f"{len(x)} training images. Received: --per-replica-batch="
            f"{args.per_replica_batch}, --accumulation-steps={k}. Lower either."
        )
    data = x[:used], y[:used], x_test, y_test
    devices = list(strategy.extended.worker_devices)
    print(
        f"digits: {len(data[0])} training / {len(data[2])} test images; "
        f"{replicas} replicas on {devices}"
    )
    print(
        f"global batch {global_batch} = {args.per_replica_batch} per replica x "
        f"{replicas}; {k} micro-batch(es) per update -> {k * global_batch} "
        "examples per update"
    )

    keras.utils.set_random_seed(0)
    initial_weights = build_model(keras, keras_dist).get_weights()

    print(f"--- {replicas} replicas, custom loop (strategy.run + apply_gradients)")
    distributed = train(strategy, data, initial_weights, args, global_batch, k)

    # The reference: one device, no accumulation, one step per update.
    print(f"--- 1 device, batch {k * global_batch}, same loop")
    single = tf.distribute.OneDeviceStrategy(devices[0])
    reference = train(single, data, initial_weights, args, k * global_batch, 1)

    difference = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(distributed.get_weights(), reference.get_weights())
    )
    print(
        f"max |w_{replicas} replicas - w_1 device| = {difference:.1e} "
        f"over {sum(w.size for w in reference.get_weights()):,} weights "
        f"after {int(reference.optimizer.iterations.numpy())} updates"
    )
    if difference > 1e-4:
        print("MISMATCH: the distributed loop did not reproduce one device.")
        return 1
    print("The distributed loop trains the same model as one device.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
