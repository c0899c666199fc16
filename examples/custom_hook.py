"""A custom all-reduce hook: int8 gradients with error feedback, 4x fewer bytes.

Shows: how to write your own gradient compressor by subclassing
`keras_dist.compression.AllReduceHook`, with its extension points:
`build` + `add_state` (per-replica state), `reduce` (the collectives),
`sent_bytes` (what `stats()` and the `compression_ratio` in the fit logs
report) and `get_config` (saving). The hook trains a small CNN on digits on
2 replicas (logical CPU devices without a GPU) next to the plain sum
(`NoCompression`) and the built-in `FP16` cast, then each hook reduces one
batch's gradient many times, to show what error feedback buys.

`Int8` sends every gradient entry as one signed byte, `round(g / scale)`
with one float32 `scale = max|g| / 127` per tensor: a quarter of float32's
bytes. What the rounding loses is kept in a per-replica residual and added
to the next step's gradient (error feedback, Seide et al., "1-bit SGD",
Interspeech 2014; Karimireddy et al., "Error Feedback Fixes SignSGD", ICML
2019), so over many steps nothing is lost. TensorFlow's CPU collectives do
not move int8, so the bytes travel packed four to an int32 word, in one
`all_gather`; each replica then adds up every replica's values in float32.
An all-gather's received bytes grow with the number of replicas, unlike an
all-reduce: this pays off for a few replicas on a slow network.

    python examples/custom_hook.py
    python examples/custom_hook.py --smoke   # seconds, for the tests
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def define_hook():
    """Defines the hook class (here, so that TensorFlow loads only in `main`)."""
    import keras
    import tensorflow as tf

    from keras_dist.compression import (
        AllReduceHook,
        num_elements,
        replica_context,
        zero_if_not_finite,
    )

    @keras.saving.register_keras_serializable(package="examples")
    class Int8(AllReduceHook):
        """Sums gradients sent as int8, one float32 scale per tensor.

        Args:
            error_feedback: Bool. Whether each replica carries its rounding
                error into its next gradient. Defaults to `True`.
        """

        def __init__(self, error_feedback=True):
            super().__init__()
            self.error_feedback = bool(error_feedback)

        def build(self, variables):
            super().build(variables)  # fills `self.variable_specs`
            for spec in self.variable_specs:
                if not spec.dtype.is_floating:
                    raise ValueError(
                        "Int8 quantises floating-point gradients only. "
                        f"Received: variable {spec.name!r} of dtype "
                        f"{spec.dtype.name}. Mark it `trainable=False`."
                    )
            # One flat float32 residual per variable and replica. "sum": a
            # checkpoint keeps the total still owed to the model.
            self.residuals = []
            if self.error_feedback:
                self.residuals = [
                    self.add_state(f"residual_{i}", (num_elements(s.shape),), "float32")
                    for i, s in enumerate(self.variable_specs)
                ]

        def reduce(self, gradients, variables):
            gradients, indices = self.prepare(gradients, variables)
            scales, quantised, updates = [], [], []
            for gradient, index in zip(gradients, indices):
                flat = tf.reshape(tf.cast(gradient, tf.float32), [-1])
                if self.error_feedback:
                    flat += self.residuals[index]
                scale = tf.reduce_max(tf.abs(flat)) / 127.0
                scale = tf.where(scale > 0, scale, 1.0)  # an all-zero gradient
                values = tf.cast(tf.round(flat / scale), tf.int8)
                if self.error_feedback:
                    lost = flat - tf.cast(values, tf.float32) * scale
                    updates.append(
                        self.residuals[index].assign(zero_if_not_finite(lost))
                    )
                scales.append(scale)
                quantised.append(values)
            # One row of int32 words: the scales' bits, then the int8 values
            # four to a word.
            sizes = [int(q.shape[0]) for q in quantised]
            values = tf.pad(tf.concat(quantised, 0), [[0, -sum(sizes) % 4]])
            row = tf.concat(
                [
                    tf.bitcast(tf.stack(scales), tf.int32),
                    tf.bitcast(tf.reshape(values, [-1, 4]), tf.int32),
                ],
                axis=0,
            )
            ctx = replica_context()
            replicas = ctx.num_replicas_in_sync
            rows = ctx.all_gather(row, axis=0) if replicas > 1 else row
            rows = tf.reshape(rows, [replicas, -1])
            all_scales = tf.bitcast(rows[:, : len(sizes)], tf.float32)
            all_values = tf.reshape(
                tf.bitcast(rows[:, len(sizes) :], tf.int8), [replicas, -1]
            )[:, : sum(sizes)]
            # Every replica's values, dequantised and summed in float32.
            summed = tf.reduce_sum(
                tf.cast(all_values, tf.float32) * tf.repeat(all_scales, sizes, axis=1),
                axis=0,
            )
            with tf.control_dependencies(updates):
                return [
                    tf.reshape(tf.cast(s, g.dtype), g.shape)
                    for s, g in zip(tf.split(summed, sizes), gradients)
                ]

        def sent_bytes(self, indices):
            # One byte per entry, padded to whole int32 words, plus the scales.
            entries = sum(num_elements(self.variable_specs[i].shape) for i in indices)
            return entries + -entries % 4 + 4 * len(indices)

        def get_config(self):
            return {"error_feedback": self.error_feedback}

    return Int8


def build_model(keras, keras_dist, hook):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, activation="relu")(inputs)
    h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(10)(h)
    model = keras_dist.DistributedModel(inputs, outputs, all_reduce_hook=hook)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def drift(strategy, model, hooks, x, y, steps):
    """Reduces one batch's gradient `steps` times with each of `hooks`.

    Returns `(repr, error of 1 step, error of the sum of all steps)` per hook:
    relative L2 errors against the plain float32 sum (the first hook's). Error
    feedback shows over many steps: what one step rounds off, the next pays.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    variables = model.trainable_variables
    with strategy.scope():
        for hook in hooks:
            hook.build(variables)  # fresh instances: a hook serves one model
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x))
    batch = next(iter(strategy.experimental_distribute_dataset(data)))

    def reduce_with_each_hook(features, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(features)) / strategy.num_replicas_in_sync
        grads = tape.gradient(loss, variables)
        summed = [hook.reduce(grads, variables) for hook in hooks]
        return [tf.concat([tf.reshape(g, [-1]) for g in s], 0) for s in summed]

    step = tf.function(lambda b: strategy.run(reduce_with_each_hook, args=b))
    # Every replica holds the same sums: read the first replica's.
    runs = [
        [strategy.experimental_local_results(out)[0].numpy() for out in step(batch)]
        for _ in range(steps)
    ]
    exact = runs[0][0]

    def error(value, reference):
        return float(np.linalg.norm(value - reference) / np.linalg.norm(reference))

    return [
        (
            repr(hook),
            error(runs[0][i], exact),
            error(sum(r[i] for r in runs), steps * exact),
        )
        for i, hook in enumerate(hooks)
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--per-replica-batch", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="tiny, fast run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs, args.per_replica_batch = 1, 16

    import keras_dist

    strategy = keras_dist.auto_strategy(cpu_replicas=2)

    import keras
    import numpy as np
    from sklearn.datasets import load_digits

    from keras_dist.compression import FP16, NoCompression

    Int8 = define_hook()
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = 256 if args.smoke else int(0.8 * len(x))
    x_train, y_train, x_test, y_test = x[:split], y[:split], x[split:], y[split:]
    batch = args.per_replica_batch * strategy.num_replicas_in_sync
    print(f"digits: {split} training images; {strategy.num_replicas_in_sync} replicas")

    rows = []
    for hook in (NoCompression(), FP16(), Int8()):
        print(f"--- training with {hook!r}")
        with strategy.scope():
            model = build_model(keras, keras_dist, hook)
        history = model.fit(
            x_train,
            y_train,
            batch_size=batch,
            epochs=args.epochs,
            shuffle=False,
            verbose=2,
        )
        _, accuracy = model.evaluate(x_test, y_test, batch_size=batch, verbose=0)
        stats = hook.stats()
        ratio = history.history.get("compression_ratio", [1.0])[-1]
        print(
            f"  hook.stats(): {stats.raw_bytes:,} bytes of gradients, "
            f"{stats.sent_bytes:,} sent per step and replica, ratio "
            f"{stats.ratio:.3f} (fit logs: compression_ratio {ratio:.3f})"
        )
        rows.append((repr(hook), history.history["loss"][-1], accuracy, stats.ratio))

    # State made by add_state: read in cross-replica context, a "sum" state
    # is the total over replicas.
    owed = max(float(np.max(np.abs(r.numpy()))) for r in hook.residuals)
    print(f"Int8 error-feedback residual after training: max |r| = {owed:.1e}")
    clone = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(hook)
    )
    print(f"Int8 round trip through get_config: {clone!r}")

    print("\n| hook | ratio | final loss | test accuracy |")
    print("| --- | ---: | ---: | ---: |")
    for name, loss, accuracy, ratio in rows:
        print(f"| {name} | {ratio:.3f} | {loss:.4f} | {accuracy:.3f} |")

    steps = 10 if args.smoke else 100
    hooks = [NoCompression(), FP16(), Int8(error_feedback=False), Int8()]
    errors = drift(strategy, model, hooks, x_train[:batch], y_train[:batch], steps)
    print(
        f"\nOne batch's gradient reduced {steps} times by each hook, against "
        "the exact float32 sum (relative L2 error):\n"
        f"| hook | 1 step | sum of {steps} steps |\n| --- | ---: | ---: |"
    )
    for name, one, many in errors:
        print(f"| {name} | {one:.1e} | {many:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
