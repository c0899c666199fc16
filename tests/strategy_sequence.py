"""Trains several models, each on a fresh MirroredStrategy, in one process.

Run by `tests/test_collectives.py`, as a script in a fresh interpreter (the
test session's TensorFlow already has its devices and strategies):

    python tests/strategy_sequence.py OUT.npz CONFIG [CONFIG ...]

Each CONFIG (a key of `CONFIGS`) gets a new `tf.distribute.MirroredStrategy`
over 2 logical CPUs with TensorFlow's default cross-device ops (collectives),
a model of its own size and its own all-reduce hook, and one epoch of the
digits data. The weights go into OUT.npz as `<config>/<index>`.
"""

import sys

import tensorflow as tf

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * 2,
)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_dist  # noqa: E402
from keras_dist import compression  # noqa: E402


def _sgd():
    return keras.optimizers.SGD(0.05, momentum=0.9)


# name -> (hidden widths, hook factory, optimizer factory, accumulation steps)
CONFIGS = {
    "none": ((32,), lambda: None, _sgd, 1),
    "fp16": ((64, 32), compression.FP16, _sgd, 1),
    "topk": ((48,), lambda: compression.TopK(0.1), _sgd, 1),
    "powersgd": (
        (40, 24),
        lambda: compression.PowerSGD(rank=2, start_step=0, min_compression_rate=1),
        _sgd,
        1,
    ),
    "dgc": (
        (56,),
        lambda: compression.DGC(0.1, momentum=0.9),
        lambda: keras.optimizers.SGD(0.05),
        1,
    ),
    "accumulation": (
        (16, 16, 16),
        compression.NoCompression,
        lambda: keras.optimizers.Adam(0.01),
        2,
    ),
}


def train(name, x, y):
    widths, make_hook, make_optimizer, steps = CONFIGS[name]
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        keras.utils.set_random_seed(len(name))
        inputs = keras.Input((64,))
        hidden = inputs
        for width in widths:
            hidden = keras.layers.Dense(width, activation="relu")(hidden)
        model = keras_dist.DistributedModel(
            inputs, keras.layers.Dense(10)(hidden), all_reduce_hook=make_hook()
        )
        optimizer = make_optimizer()
        if steps > 1:
            optimizer = keras_dist.GradientAccumulationOptimizer(optimizer, steps)
        model.compile(
            optimizer,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def main(out, names):
    x, y = load_digits(return_X_y=True)
    x = (x[:640] / 16).astype("float32")
    y = y[:640]
    arrays = {}
    for name in names:
        for index, weight in enumerate(train(name, x, y)):
            arrays[f"{name}/{index}"] = weight
    np.savez(out, **arrays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
