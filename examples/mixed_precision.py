"""Mixed precision with keras_dist: float16 compute, float32 weights, loss scaling.

Shows: `keras.mixed_precision.set_global_policy("mixed_float16")` with a
`keras_dist.DistributedModel` on MirroredStrategy (GPUs, or 2 logical CPU
devices without one) and a `keras_dist.GradientAccumulationOptimizer`:

- `DistributedModel.compile` adds the loss scaling *inside* the accumulation
  optimizer, `GradientAccumulationOptimizer(LossScaleOptimizer(Adam))`, so
  the loss scale is checked on the all-reduced, accumulated gradient and a
  step that overflows is skipped on every replica alike (a plain
  `keras.Model` would build `LossScaleOptimizer(GradientAccumulation...)`);
  the example prints both nestings;
- the layers compute in float16 while their variables (the master weights
  the optimizer updates) stay float32; the last layer is float32, for a
  numerically stable softmax and loss;
- the dynamic loss scale, the updates it skipped, and the final accuracy,
  next to the same model trained in float32.

`--policy mixed_bfloat16` needs no loss scaling (bfloat16 has float32's
range), and none is added.

On a CPU, float16 is emulated and much SLOWER than float32; the speed-up is
on GPUs with tensor cores (NVIDIA Volta and later) and on TPUs (bfloat16).
The point here is correctness and the wiring, not the speed.

    python examples/mixed_precision.py
    python examples/mixed_precision.py --policy mixed_bfloat16
    python examples/mixed_precision.py --smoke   # seconds, for the tests
"""

import argparse
import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

POLICIES = ("mixed_float16", "mixed_bfloat16")


def load_digits_data(smoke):
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    if smoke:
        return x[:256], y[:256], x[256:512], y[256:512]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def build_model(keras, keras_dist):
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(32, 3, activation="relu", name="conv")(inputs)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(64, activation="relu", name="hidden")(h)
    # float32 logits: softmax and cross-entropy lose too much in float16.
    outputs = keras.layers.Dense(10, dtype="float32", name="logits")(h)
    return keras_dist.DistributedModel(inputs, outputs)


def describe(optimizer):
    """`Outer(...) -> Inner(...)`: the optimizer wrappers, outermost first."""
    import keras

    import keras_dist

    parts = []
    for nested in _nested(optimizer):
        name = type(nested).__name__
        if isinstance(nested, keras_dist.GradientAccumulationOptimizer):
            name += f"(accumulation_steps={nested.accumulation_steps})"
        elif isinstance(nested, keras.optimizers.LossScaleOptimizer):
            name += f"(initial_scale={nested.initial_scale:g})"
        else:
            name += f"(learning_rate={nested.learning_rate.numpy():g})"
        parts.append(name)
    return " -> ".join(parts)


def make_optimizer(keras, keras_dist, accumulation_steps):
    optimizer = keras.optimizers.Adam(1e-3)
    if accumulation_steps > 1:
        optimizer = keras_dist.GradientAccumulationOptimizer(
            optimizer, accumulation_steps=accumulation_steps
        )
    return optimizer


def show_keras_nesting(keras, keras_dist, accumulation_steps):
    """Prints how a plain keras.Model would nest the same optimizer."""
    inputs = keras.Input((4,))
    plain = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    plain.compile(
        optimizer=make_optimizer(keras, keras_dist, accumulation_steps), loss="mse"
    )
    print(f"  keras.Model.compile would give: {describe(plain.optimizer)}")


def train(policy, strategy, data, args):
    import keras
    import numpy as np

    import keras_dist

    x, y, x_test, y_test = data
    # The policy applies to the layers created after it is set.
    keras.mixed_precision.set_global_policy(policy)
    print(f"--- policy {policy}")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model(keras, keras_dist)
        model.compile(
            optimizer=make_optimizer(keras, keras_dist, args.accumulation_steps),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    print(f"  DistributedModel.compile gives:  {describe(model.optimizer)}")
    if policy == "mixed_float16" and args.accumulation_steps > 1:
        show_keras_nesting(keras, keras_dist, args.accumulation_steps)
    for name in ("hidden", "logits"):
        layer = model.get_layer(name)
        print(
            f"  layer {name!r}: computes in {layer.compute_dtype}, kernel "
            f"variable {layer.kernel.dtype}"
        )

    loss_scaler = next(
        (
            o
            for o in _nested(model.optimizer)
            if isinstance(o, keras.optimizers.LossScaleOptimizer)
        ),
        None,
    )
    batch = args.per_replica_batch * strategy.num_replicas_in_sync
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=batch, epochs=args.epochs, verbose=2)
    seconds = time.perf_counter() - start
    loss = history.history["loss"][-1]
    _, accuracy = model.evaluate(x_test, y_test, batch_size=batch, verbose=0)
    updates = int(model.optimizer.iterations.numpy())
    if loss_scaler is not None:
        micro_steps = math.ceil(len(x) / batch) * args.epochs
        tried = micro_steps // args.accumulation_steps
        # A skipped update does not advance the inner optimizer's iterations.
        print(
            f"  loss scale: {loss_scaler.initial_scale:g} at the start, "
            f"{float(loss_scaler.dynamic_scale.numpy()):g} now; "
            f"{tried - updates} of {tried} updates skipped for non-finite "
            "gradients (each skip halves the scale)"
        )
    else:
        print("  no loss scaling (none needed for this policy)")
    logits = model.predict(x_test[:1], verbose=0)
    print(
        f"  model output dtype {logits.dtype}; final training loss {loss:.4f} "
        f"(finite: {bool(np.isfinite(loss))}); test accuracy {accuracy:.3f}; "
        f"{seconds:.1f}s"
    )
    keras.mixed_precision.set_global_policy("float32")
    dtype = model.get_layer("hidden").compute_dtype
    return dtype, loss, accuracy, seconds, model.get_weights()


def _nested(optimizer):
    while optimizer is not None:
        yield optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", choices=POLICIES, default="mixed_float16")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--per-replica-batch", type=int, default=32)
    parser.add_argument(
        "--accumulation-steps",
        type=int,
        default=2,
        help="micro-batches per update; 1 for a plain Adam",
    )
    parser.add_argument(
        "--cpu-replicas", type=int, default=2, help="logical CPU devices (no GPU)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny, fast run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs, args.per_replica_batch = 1, 16
    if args.accumulation_steps < 1:
        parser.error(
            "--accumulation-steps must be >= 1. Received: "
            f"--accumulation-steps={args.accumulation_steps}."
        )

    import numpy as np
    import tensorflow as tf

    import keras_dist

    if tf.config.list_physical_devices("GPU"):
        strategy = keras_dist.auto_strategy()
    else:
        print(
            f"No GPU: {args.policy.split('_')[1]} math on a CPU is emulated or "
            "unoptimised, slower than float32. The wiring and the numbers are "
            "what matter here."
        )
        strategy = keras_dist.auto_strategy(cpu_replicas=args.cpu_replicas)
    data = load_digits_data(args.smoke)
    print(
        f"digits: {len(data[0])} training images; "
        f"{strategy.num_replicas_in_sync} replicas; "
        f"{args.accumulation_steps} micro-batch(es) per update"
    )
    rows = [
        (policy, *train(policy, strategy, data, args))
        for policy in (args.policy, "float32")
    ]
    print(
        "\n| policy | compute dtype | final loss | test accuracy | seconds |\n"
        "| --- | --- | ---: | ---: | ---: |"
    )
    for policy, dtype, loss, accuracy, seconds, _ in rows:
        print(f"| {policy} | {dtype} | {loss:.4f} | {accuracy:.3f} | {seconds:.1f} |")
    gap = rows[0][3] - rows[1][3]
    difference = max(
        float(np.max(np.abs(a - b))) for a, b in zip(rows[0][5], rows[1][5])
    )
    print(
        f"test accuracy {args.policy} - float32: {gap:+.3f}; "
        f"max |w_{args.policy} - w_float32| = {difference:.1e} (same start, "
        f"{args.policy.split('_')[1]} rounding in the forward and backward pass)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
