"""The model, data and sample counter of the elastic-resume tests.

Shared by tests/test_elastic.py (logical CPU replicas, one process) and
tests/elastic_worker.py (worker processes under `keras-dist launch`).

Every example's first feature is its index; the `SeenSamples` layer counts,
per example, how often a training step used it (a per-replica `SUM`
variable, so it is in the backups and follows the `"sum"` rule like any
other per-replica state) and drops the index before the dense layers.
"""

import json
import os

import keras
import numpy as np
import tensorflow as tf

import keras_dist

FEATURES = 6
PER_REPLICA = 8
UPDATE_BATCH = 96  # per-replica 8 x 4 replicas x 3 accumulation steps
EXAMPLES = 6 * UPDATE_BATCH


def data(examples=EXAMPLES):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(examples, FEATURES)).astype("float32")
    y = x @ rng.normal(size=(FEATURES, 2)) + 0.5 * rng.normal(size=(examples, 2))
    index = np.arange(examples, dtype="float32")[:, None]
    return np.concatenate([index, x], axis=1), y.astype("float32")


class SeenSamples(keras.layers.Layer):
    """Counts how often each example was trained on; drops its index."""

    def __init__(self, examples, **kwargs):
        super().__init__(**kwargs)
        self.examples = examples

    def build(self, input_shape):
        self.seen = keras.Variable(
            np.zeros(self.examples, "float32"),
            trainable=False,
            synchronization="on_read",
            aggregation="sum",
            name="seen",
        )

    def call(self, inputs, training=False):
        if training:
            index = tf.cast(inputs[:, 0], tf.int32)
            self.seen.assign_add(
                tf.reduce_sum(tf.one_hot(index, self.examples), axis=0)
            )
        return inputs[:, 1:]


def make_model(
    strategy,
    accumulation_steps,
    hook=None,
    examples=EXAMPLES,
    lr=0.05,
    sharded=False,
    sharded_steps=1,
    momentum=0.9,
):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras_dist.DistributedModel.from_model(
            keras.Sequential(
                [
                    keras.Input((FEATURES + 1,)),
                    SeenSamples(examples),
                    keras.layers.Dense(16, activation="tanh"),
                    keras.layers.Dense(2),
                ]
            ),
            all_reduce_hook=hook,
        )
        inner = keras.optimizers.SGD(lr, momentum=momentum)
        if sharded:
            inner = keras_dist.ShardedOptimizer(inner, accumulation_steps=sharded_steps)
        model.compile(
            optimizer=keras_dist.GradientAccumulationOptimizer(
                inner, accumulation_steps=accumulation_steps
            ),
            loss="mse",
        )
    return model


def seen(model, strategy):
    """Every example's count, summed over the replicas (and workers)."""
    variable = _find_counter(model).seen.value
    return strategy.reduce("SUM", variable, axis=None).numpy()


def write_result(folder, model, counts, workers, history):
    """What the elastic tests compare: the weights (but the counter),
    `counts` (`seen`'s result), and a summary, into `folder`."""
    os.makedirs(folder, exist_ok=True)
    np.savez(
        os.path.join(folder, "weights.npz"),
        *[w.numpy() for w in model.weights if "seen" not in w.path],
    )
    np.save(os.path.join(folder, "seen.npy"), counts)
    with open(os.path.join(folder, "summary.json"), "w") as handle:
        json.dump(
            {
                "workers": workers,
                "iterations": int(model.optimizer.iterations.numpy()),
                "accumulation_steps": model.optimizer.accumulation_steps,
                "loss": history.history["loss"],
            },
            handle,
        )


def _find_counter(layer):
    if isinstance(layer, SeenSamples):
        return layer
    for inner in getattr(layer, "layers", []):
        found = _find_counter(inner)
        if found is not None:
            return found
    return None
