"""Small models, data and a fresh-interpreter runner shared by the tests."""

import os
import pathlib
import subprocess
import sys
import textwrap

import keras
import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def make_data(n=64, features=8, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    return x, y


def mlp(cls=keras.Model, features=8, classes=3, seed=1, dtype=None):
    """A two-layer MLP in the functional form of `cls`, seeded."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(16, activation="relu", dtype=dtype)(inputs)
    outputs = keras.layers.Dense(classes, dtype=dtype)(hidden)
    return cls(inputs, outputs)


def compile_model(model, optimizer, metrics=("accuracy",)):
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
    )
    return model


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
}


def max_abs_diff(weights_a, weights_b):
    assert len(weights_a) == len(weights_b)
    return max(float(np.max(np.abs(a - b))) for a, b in zip(weights_a, weights_b))


def sharded_dataset(x, y, global_batch):
    """`(x, y)` batched at `global_batch`, sharded by data across workers.

    DATA sharding gives every worker its slice of each global batch, so a
    multi-worker step sees the same examples as one device with that batch.
    """
    import tensorflow as tf

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(global_batch)
        .with_options(options)
    )


def uneven_data(examples, features=8, seed=0):
    """Regression data for the uneven-last-batch tests."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, features)).astype("float32")
    y = rng.normal(size=(examples, 2)).astype("float32")
    return x, y


def uneven_model(accumulation_steps=1, cls=None, features=8, seed=4):
    """A compiled MLP (DistributedModel by default) with SGD(0.1), MSE."""
    import keras_dist

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    model = (cls or keras_dist.DistributedModel)(inputs, keras.layers.Dense(2)(hidden))
    optimizer = keras.optimizers.SGD(0.1)
    if accumulation_steps > 1:
        optimizer = keras_dist.GradientAccumulationOptimizer(
            optimizer, accumulation_steps=accumulation_steps
        )
    model.compile(optimizer, "mse")
    return model


def run_python(code, env=None, timeout=120, check=True):
    """Runs `python -c code` in a fresh interpreter from the repository root.

    For what this test session cannot show: conftest has already initialised
    TensorFlow (4 logical CPUs), and `keras_dist`, TensorFlow and Keras are
    imported. The child starts in the repository root, so it imports this copy
    of `keras_dist`.

    Args:
        code: Str. Python source, dedented before it runs.
        env: Dict or `None`. Variables set over `os.environ`,
            `TF_CPP_MIN_LOG_LEVEL=3` and `KERAS_BACKEND=tensorflow`; a value of
            `None` removes that variable. Defaults to `None`.
        timeout: Float. Seconds before `subprocess.TimeoutExpired`. Defaults
            to `120`.
        check: Bool. Assert that the exit code is 0, showing the end of
            stderr if not. Defaults to `True`.

    Returns:
        The `subprocess.CompletedProcess`, with `stdout` and `stderr` as text.
    """
    child_env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "KERAS_BACKEND": "tensorflow",
        **(env or {}),
    }
    child_env = {name: value for name, value in child_env.items() if value is not None}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert result.returncode == 0, result.stderr[-4000:]
    return result
