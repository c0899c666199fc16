"""Exercise 1: a simple CNN on CIFAR-10 with MirroredStrategy, 1 vs N devices.

Shows: the same Keras model trained on one device and on every available
device (GPUs, or logical CPU devices on a laptop) with
`keras_dist.DistributedModel`, and the training speed of each.

Data: `keras.datasets.cifar10` (downloads ~170 MB once). Without network
access it falls back to scikit-learn's bundled digits, upsampled to 32x32x3,
and says so.

    python examples/mirrored_cnn.py                 # real run
    python examples/mirrored_cnn.py --cpu-replicas 2   # no GPU: 2 logical CPUs
    python examples/mirrored_cnn.py --smoke         # seconds, for the tests
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


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


def build_cnn(keras_dist, keras):
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(64, 3, activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    outputs = keras.layers.Dense(10)(x)
    return keras_dist.DistributedModel(inputs, outputs)


def train(strategy, data, per_replica_batch, epochs, keras_dist, keras):
    x, y, x_test, y_test = data
    with strategy.scope():
        model = build_cnn(keras_dist, keras)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    batch = per_replica_batch * strategy.num_replicas_in_sync
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)  # trace
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=epochs, verbose=2)
    seconds = time.perf_counter() - start
    _, accuracy = model.evaluate(x_test, y_test, batch_size=batch, verbose=0)
    return len(x) * epochs / seconds, accuracy


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
        args.epochs, args.per_replica_batch = 1, 16
        args.cpu_replicas = args.cpu_replicas or 2

    import keras
    import tensorflow as tf

    import keras_dist

    if args.cpu_replicas:
        strategy = keras_dist.auto_strategy(cpu_replicas=args.cpu_replicas)
    else:
        strategy = keras_dist.auto_strategy()
    *data, name = load_data(args.smoke)
    devices = strategy.extended.worker_devices
    print(f"{name}: {len(data[0])} training images; devices: {list(devices)}")
    single = tf.distribute.OneDeviceStrategy(devices[0])
    rows = []
    for label, chosen in [("1 device", single), (f"{len(devices)} devices", strategy)]:
        print(f"--- {label}")
        speed, accuracy = train(
            chosen, data, args.per_replica_batch, args.epochs, keras_dist, keras
        )
        rows.append((label, speed, accuracy))
    print("\n| run | samples/s | test accuracy |\n| --- | ---: | ---: |")
    for label, speed, accuracy in rows:
        print(f"| {label} | {speed:,.0f} | {accuracy:.3f} |")
    print(f"speed-up: {rows[1][1] / rows[0][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
