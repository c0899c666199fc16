"""Exercise 1: a simple CNN on CIFAR-10 with MirroredStrategy, 1 vs N devices.

Shows: the same Keras model trained on one device (stock `keras.Model`) and
on every available device (GPUs, or logical CPU devices on a laptop) with
`keras_dist.DistributedModel`, and the training speed of each. Both runs
use the same global batch, initial weights and batch order, so they make
the same updates and end at the same model, to float rounding: the example
prints how far apart the weights are. On N GPUs it prints the speed-up;
logical CPU devices share the machine's cores, so there it says that the
comparison shows correctness and overhead, not speed.

Data: `keras.datasets.cifar10` (downloads ~170 MB once). Without network
access it falls back to scikit-learn's bundled digits, upsampled to 32x32x3,
and says so.

    python examples/mirrored_cnn.py                    # every GPU
    python examples/mirrored_cnn.py --cpu-replicas 2   # no GPU: 2 logical CPUs
    python examples/mirrored_cnn.py --smoke            # seconds, for the tests
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

LEARNING_RATE = 1e-3


def load_data(smoke):
    import numpy as np

    if not smoke:
        try:
            import keras

            (x, y), (x_test, y_test) = keras.datasets.cifar10.load_data()
            return (
                (x / 255.0).astype("float32"),
                y,
                (x_test / 255.0).astype("float32"),
                y_test,
                "CIFAR-10",
            )
        except Exception as error:
            print(f"CIFAR-10 unavailable ({type(error).__name__}); using digits.")
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.kron(digits.images / 16.0, np.ones((4, 4)))[..., None]
    images = np.repeat(images, 3, axis=-1).astype("float32")
    labels = digits.target.astype("int32")
    # Mixed once with a fixed seed: both runs then train with shuffle=False
    # on the same batches in the same order.
    order = np.random.default_rng(0).permutation(len(images))
    images, labels = images[order], labels[order]
    split = int(0.8 * len(images))
    if smoke:
        split = 256
        return (
            images[:split],
            labels[:split],
            images[split:512],
            labels[split:512],
            ("digits (smoke)"),
        )
    return images[:split], labels[:split], images[split:], labels[split:], "digits"


def build_cnn(keras, model_class):
    """The CNN, seeded: every run starts from the same weights."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(64, 3, activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    outputs = keras.layers.Dense(10)(x)
    return model_class(inputs, outputs)


def epoch_timer(keras):
    """A callback that records the seconds of every epoch."""

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self.start)

    return EpochTimer()


def train(strategy, model_class, data, batch, epochs, keras):
    """Trains under `strategy` with the global batch `batch`.

    Returns `(samples/s, test accuracy, updates, weights)`. The model and its
    optimizer are created inside `strategy.scope()`, the one they train in.
    """
    x, y, x_test, y_test = data
    with strategy.scope():
        model = build_cnn(keras, model_class)
        model.compile(
            optimizer=keras.optimizers.Adam(LEARNING_RATE),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    timer = epoch_timer(keras)
    model.fit(
        x,
        y,
        batch_size=batch,
        epochs=epochs,
        shuffle=False,
        callbacks=[timer],
        verbose=2,
    )
    # The first epoch also traces and compiles the step: time the others.
    timed = timer.seconds[1:] or timer.seconds
    speed = len(x) * len(timed) / sum(timed)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=batch, verbose=0)
    updates = int(model.optimizer.iterations.numpy())
    return speed, accuracy, updates, model.get_weights()


def cpu_cores():
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def is_cpu(device):
    import tensorflow as tf

    return tf.DeviceSpec.from_string(device).device_type == "CPU"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--per-replica-batch", type=int, default=64)
    parser.add_argument(
        "--cpu-replicas", type=int, default=0, help="logical CPU devices (no GPU)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny, fast run")
    args = parser.parse_args(argv)
    if args.smoke:
        # 2 epochs: the second is timed without the first one's tracing.
        args.epochs, args.per_replica_batch = 2, 16
        args.cpu_replicas = args.cpu_replicas or 2
    for name in ("epochs", "per_replica_batch"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be >= 1. "
                f"Received: {getattr(args, name)}."
            )

    import keras
    import numpy as np
    import tensorflow as tf

    import keras_dist

    if args.cpu_replicas:
        strategy = keras_dist.auto_strategy(cpu_replicas=args.cpu_replicas)
    else:
        strategy = keras_dist.auto_strategy()
    *data, name = load_data(args.smoke)
    try:
        devices = list(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy: one device, no device list
        devices = [tf.config.list_logical_devices()[0].name]
    replicas = len(devices)
    batch = args.per_replica_batch * replicas
    print(f"{name}: {len(data[0])} training images; devices: {devices}")
    # The same global batch on 1 device and on N: the same batches, so the
    # same number of updates from the same weights, the same trained model;
    # on N devices each one computes 1/N of every batch. (N times the batch
    # on N devices would make N times fewer updates per epoch, and a lower
    # accuracy after the same epochs.)
    print(
        f"global batch {batch} in both runs ({args.per_replica_batch} per "
        f"replica x {replicas}), {args.epochs} epoch(s), no shuffling"
    )

    # The baseline is stock Keras on one device, in that device's scope; the
    # N-device run is a DistributedModel in the scope of the strategy
    # auto_strategy() built (a DistributedModel elsewhere warns: it would
    # train on fewer replicas than that strategy has).
    runs = [
        ("1 device", keras.Model, tf.distribute.OneDeviceStrategy(devices[0])),
        (f"{replicas} devices", keras_dist.DistributedModel, strategy),
    ]
    rows = []
    for label, model_class, chosen in runs[: 1 if replicas == 1 else 2]:
        print(f"--- {label}: {model_class.__name__}")
        trained = train(chosen, model_class, data, batch, args.epochs, keras)
        rows.append((label, *trained))
    print(
        "\n| run | updates | samples/s | test accuracy |\n| --- | ---: | ---: | ---: |"
    )
    for label, speed, accuracy, updates, _ in rows:
        print(f"| {label} | {updates} | {speed:,.0f} | {accuracy:.3f} |")
    if replicas == 1:
        print(
            "One device only: nothing to compare. Pass --cpu-replicas 2 "
            "(logical CPU devices, to check\n  the distributed run), or run "
            "on a machine with several GPUs (to measure the speed-up)."
        )
        return 0

    (_, one_speed, _, _, one_weights), (_, many_speed, _, _, many_weights) = rows
    difference = max(
        float(np.max(np.abs(a - b))) for a, b in zip(one_weights, many_weights)
    )
    print(
        f"max |w_{replicas} devices - w_1 device| = {difference:.1e}: the same "
        "updates on the same batches from the same weights.\n  Only float "
        "rounding sets the two models apart: the replicas' gradients are "
        "summed in another order,\n  and Adam, whose steps are about "
        f"{LEARNING_RATE:g} per weight whatever the gradient's size, lets "
        "such tiny\n  differences grow over the updates."
    )
    if all(is_cpu(device) for device in devices):
        print(
            f"The {replicas} devices are logical CPU devices: they share this "
            f"machine's {cpu_cores()} CPU core(s), which one device already "
            f"uses,\n  so {replicas} replicas cannot train faster than one. "
            "This comparison shows correctness (the same model) and the\n  "
            f"overhead of distributing, not speed: here the {replicas}-replica "
            f"run took {one_speed / many_speed:.2f}x the time of one device.\n"
            f"  On {replicas} GPUs the same script measures the speed-up."
        )
    else:
        print(
            f"speed-up: {many_speed / one_speed:.2f}x on {replicas} devices "
            f"(at most {replicas}x: each device computes 1/{replicas} of every "
            "batch, then the gradients are all-reduced)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
