"""Prune a tf_keras CNN to 80% sparsity on 2 replicas, with FP16 and accumulation.

tensorflow-model-optimization (tfmot) prunes only tf_keras (Keras 2) models.
This script trains one with keras_dist's tf_keras pieces:

- `keras_dist.tf_keras.DistributedOptimizer` wraps `tf_keras.optimizers.Adam`:
  the gradients are summed over the replicas once per update through the
  `keras_dist.compression.FP16()` hook (half the bytes), after
  `accumulation_steps=2` micro-steps accumulated on each replica without
  communication;
- `keras_dist.tf_keras.UpdatePruningStep()` instead of tfmot's callback: the
  pruning schedule counts optimizer updates, not micro-steps, so both
  micro-steps of one update use the same masks;
- `keras_dist.auto_strategy(cpu_replicas=2)`: a `MirroredStrategy` over 2
  logical CPU devices (on GPUs, `keras_dist.auto_strategy()`).

Data: scikit-learn's 8x8 digits, shuffled with a seeded permutation before
the split into 1,500 training and 297 test images (the file's last images
are harder than the rest). The schedule (`PolynomialDecay`, 0 to 80%,
pruning every 10 updates) ends two epochs before training does, so the
pruned model recovers.

Prints each pruned layer's sparsity, the test accuracy of the stripped model
(`strip_pruning`), the bytes the hook sent per update, and the stripped
model's size: its weights' nonzero count, and its `.h5` file compressed with
gzip next to the same file for the dense model (the initial weights), since
zeros compress and the file format itself does not shrink.

Usage:

    python examples/prune_distributed.py            # 8 epochs, about a minute
    python examples/prune_distributed.py --smoke    # 3 epochs, for the tests

Needs `pip install ".[tfmot]"` in the keras_dist clone.
"""

import argparse
import gzip
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from sklearn.datasets import load_digits

import keras_dist

TRAIN_EXAMPLES = 1500
LEARNING_RATE = 0.005
PRUNING_FREQUENCY = 10  # updates between two pruning steps


def digits(seed):
    """Digits as (x_train, y_train, x_test, y_test), shuffled before the split."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x = (x[order] / 16.0).astype("float32").reshape(-1, 8, 8, 1)
    y = y[order].astype("int32")
    return (
        x[:TRAIN_EXAMPLES],
        y[:TRAIN_EXAMPLES],
        x[TRAIN_EXAMPLES:],
        y[TRAIN_EXAMPLES:],
    )


def digits_cnn(tf_keras):
    return tf_keras.Sequential(
        [
            tf_keras.layers.Conv2D(16, 3, activation="relu", input_shape=(8, 8, 1)),
            tf_keras.layers.Flatten(),
            tf_keras.layers.Dense(64, activation="relu"),
            tf_keras.layers.Dense(10),
        ]
    )


def gzip_h5_bytes(tf_keras, model, folder, name):
    """Size of `model` saved as .h5 (no optimizer) and compressed with gzip."""
    path = os.path.join(folder, f"{name}.h5")
    tf_keras.models.save_model(model, path, include_optimizer=False)
    with open(path, "rb") as handle:
        return len(gzip.compress(handle.read()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="3 epochs")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.8, help="final sparsity")
    parser.add_argument("--accumulation-steps", type=int, default=2)
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=16,
        help="examples per replica per micro-step",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    epochs = 3 if args.smoke else args.epochs

    # Logical devices must exist before TensorFlow initialises.
    strategy = keras_dist.auto_strategy(cpu_replicas=2)
    import tensorflow as tf
    import tf_keras

    from keras_dist.tf_keras import (
        DistributedOptimizer,
        UpdatePruningStep,
        import_tfmot,
    )

    tfmot = import_tfmot()
    tf_keras.utils.set_random_seed(args.seed)
    x, y, x_test, y_test = digits(args.seed)
    global_micro = args.micro_batch * strategy.num_replicas_in_sync
    micro_steps_per_epoch = len(x) // global_micro  # the remainder is dropped
    updates = micro_steps_per_epoch * epochs // args.accumulation_steps
    end_step = micro_steps_per_epoch * max(epochs - 2, 1) // args.accumulation_steps
    end_step = max(end_step // PRUNING_FREQUENCY, 1) * PRUNING_FREQUENCY

    with strategy.scope():
        dense = digits_cnn(tf_keras)
        schedule = tfmot.sparsity.keras.PolynomialDecay(
            initial_sparsity=0.0,
            final_sparsity=args.target,
            begin_step=0,
            end_step=end_step,
            frequency=PRUNING_FREQUENCY,
        )
        model = tfmot.sparsity.keras.prune_low_magnitude(
            dense, pruning_schedule=schedule
        )
        hook = keras_dist.compression.FP16()
        model.compile(
            optimizer=DistributedOptimizer(
                tf_keras.optimizers.Adam(LEARNING_RATE),
                all_reduce_hook=hook,
                accumulation_steps=args.accumulation_steps,
            ),
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    with tempfile.TemporaryDirectory() as folder:
        dense_size = gzip_h5_bytes(tf_keras, dense, folder, "dense")
        dataset = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(len(x), seed=args.seed)
            .batch(global_micro, drop_remainder=True)
        )
        model.fit(dataset, epochs=epochs, callbacks=[UpdatePruningStep()], verbose=2)
        stripped = tfmot.sparsity.keras.strip_pruning(model)
        stripped_size = gzip_h5_bytes(tf_keras, stripped, folder, "stripped")

    stripped.compile(
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    _, accuracy = stripped.evaluate(x_test, y_test, verbose=0)
    kernels = [layer for layer in stripped.layers if hasattr(layer, "kernel")]
    weights = [w.numpy() for w in stripped.weights]
    nonzero = sum(int(np.count_nonzero(w)) for w in weights)
    total = sum(w.size for w in weights)
    stats = hook.stats()

    print(
        f"\ndigits CNN{' (smoke)' if args.smoke else ''}, "
        f"{strategy.num_replicas_in_sync} replicas, micro-batch {args.micro_batch} "
        f"per replica x {args.accumulation_steps} accumulation steps, FP16 hook, "
        f"{epochs} epochs, {int(model.optimizer.iterations.numpy())} updates "
        f"(expected {updates}), schedule 0 -> {args.target:.0%} by update {end_step}"
    )
    for layer in kernels:
        sparsity = float(np.mean(layer.kernel.numpy() == 0))
        print(f"sparsity {layer.name}: {sparsity:.4f}")
    print(f"test accuracy (stripped model): {accuracy:.4f}")
    print(
        f"bytes sent per update per replica: {stats.sent_bytes:,} "
        f"(uncompressed {stats.raw_bytes:,}, {stats.ratio:.1f}x); per micro-step: "
        f"{stats.sent_bytes / args.accumulation_steps:,.0f}"
    )
    print(f"nonzero weights (stripped model): {nonzero:,} of {total:,}")
    print(
        f"gzip-compressed .h5: stripped {stripped_size:,} bytes, "
        f"dense {dense_size:,} bytes ({dense_size / stripped_size:.2f}x smaller)"
    )


if __name__ == "__main__":
    main()
