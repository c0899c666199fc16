"""What several test modules share; imported by the worker processes too.

Small models and data, a harness for all-reduce hooks, the one config
round-trip check (`assert_config_round_trip`), a fresh-interpreter runner,
process checks and what the launcher's tests share (`write_script`,
`task_lines`, `SLEEPER`). Like `workers.py`, it imports neither pytest nor
conftest.
"""

import inspect
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import tensorflow as tf

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def make_data(n=64, features=8, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    return x, y


SEGMENT_BYTES = 64
"""`ShardedOptimizer(bucket_bytes=...)` for the tests' small models: the
default (4 MiB) makes one segment of them; 64 bytes cuts `mlp`'s four
variables into three segments (128, 16 and 51 elements), padded apart."""


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


class Boom(keras.callbacks.Callback):
    """Stops `fit` with `KeyboardInterrupt` after the N-th batch (a crash in
    one process: the backup tests resume in the same process)."""

    def __init__(self, at):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            raise KeyboardInterrupt("crash")


def max_abs_diff(weights_a, weights_b):
    assert len(weights_a) == len(weights_b)
    return max(float(np.max(np.abs(a - b))) for a, b in zip(weights_a, weights_b))


def sharded_dataset(x, y, global_batch):
    """`(x, y)` batched at `global_batch`, sharded by data across workers.

    DATA sharding gives every worker its slice of each global batch, so a
    multi-worker step sees the same examples as one device with that batch.
    """
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


class Harness:
    """Variables of given shapes under `strategy`, a built hook, a traced step."""

    def __init__(self, strategy, hook, shapes, dtypes=None):
        self.strategy = strategy
        self.hook = hook
        dtypes = dtypes or ["float32"] * len(shapes)
        with strategy.scope():
            self.variables = [
                tf.Variable(tf.zeros(shape, dtype), name=f"v{i}")
                for i, (shape, dtype) in enumerate(zip(shapes, dtypes))
            ]
            hook.build(self.variables)

        @tf.function
        def step(values):
            return strategy.run(
                lambda g: hook.reduce(list(g), self.variables), (values,)
            )

        self._step = step

    def reduce(self, per_replica):
        """Runs one reduction; `per_replica[r]` lists replica r's gradients.

        Returns, per gradient, the list of every replica's result (numpy).
        """
        values = self.strategy.experimental_distribute_values_from_function(
            lambda ctx: [
                tf.constant(g) for g in per_replica[ctx.replica_id_in_sync_group]
            ]
        )
        outputs = self._step(values)
        return [
            [t.numpy() for t in self.strategy.experimental_local_results(out)]
            for out in outputs
        ]

    def local(self, variable):
        return [v.numpy() for v in self.strategy.experimental_local_results(variable)]


# A conv kernel and its bias, a dense kernel and its bias: the shapes the
# hooks' tests reduce unless they need others.
LAYER_SHAPES = [(3, 3, 4, 16), (16,), (64, 48), (48,)]


def assert_same_on_replicas(results):
    """Every replica got the same result (`results` as `Harness.reduce` gives)."""
    for per_replica in results:
        for other in per_replica[1:]:
            np.testing.assert_array_equal(other, per_replica[0])


def record_payload(monkeypatch, module, name, sizes):
    """Wraps `module.name` (a collective helper) to add its payload bytes."""
    from keras_dist.compression import tensor_bytes

    original = getattr(module, name)

    def recording(*args):
        tensors = [t for arg in args if isinstance(arg, list) for t in arg]
        sizes.append(sum(tensor_bytes(t) for t in tensors))
        return original(*args)

    monkeypatch.setattr(module, name, recording)


def random_grads(shapes, replicas, seed=0, dtype="float32"):
    rng = np.random.default_rng(seed)
    return [
        [rng.normal(size=shape).astype(dtype) for shape in shapes]
        for _ in range(replicas)
    ]


def exact_sum(per_replica):
    return [np.sum(np.stack(parts), axis=0) for parts in zip(*per_replica)]


def assert_config_round_trip(instance, exact_arguments=True):
    """Checks `instance`'s config round trips; returns the revived object.

    The one config check of the test suite, after Keras's
    `TestCase.run_class_serialization_test`: `get_config` -> `from_config`
    gives an object of the same class with an equal config, and so does
    `keras.saving.serialize_keras_object` -> `deserialize_keras_object`,
    in memory and through JSON (as a `.keras` file stores it). A
    `keras_dist` class is registered under the package `keras_dist`.

    Args:
        instance: The object (hook, optimizer, schedule, model).
        exact_arguments: Bool. Also check that the config's keys are
            exactly the constructor's named arguments (the house rule for
            hooks, optimizers and schedules; a functional model's config is
            Keras's). Defaults to `True`.

    Returns:
        The object `deserialize_keras_object` revived (in memory).
    """
    cls = type(instance)
    config = instance.get_config()
    if exact_arguments:
        named = [
            name
            for name, parameter in inspect.signature(cls).parameters.items()
            if parameter.kind
            not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        assert set(config) == set(named), (sorted(config), sorted(named))
    clone = cls.from_config(config)
    assert type(clone) is cls
    assert clone.get_config() == config
    serialized = keras.saving.serialize_keras_object(instance)
    if cls.__module__.startswith("keras_dist."):
        assert serialized["registered_name"] == f"keras_dist>{cls.__name__}"
    from_json = keras.saving.deserialize_keras_object(
        json.loads(json.dumps(serialized))
    )
    assert type(from_json) is cls
    # JSON has no tuples: compare both sides as JSON.
    assert _as_json(from_json.get_config()) == _as_json(config)
    revived = keras.saving.deserialize_keras_object(serialized)
    assert type(revived) is cls
    assert revived.get_config() == config
    return revived


def _as_json(config):
    return json.loads(json.dumps(config, sort_keys=True))


def launch_workers(launch_args, script_args, timeout):
    """Runs `keras-dist launch LAUNCH_ARGS -- python SCRIPT_ARGS` from the
    repository; returns `(status, stdout + stderr)`."""
    command = [sys.executable, "-m", "keras_dist", "launch", *launch_args, "--"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("TF_CONFIG", None)
    done = subprocess.run(
        [*command, sys.executable, *script_args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=timeout,
    )
    return done.returncode, done.stdout + done.stderr


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


def is_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pid, timeout=10.0):
    """Waits for process `pid` to exit; kills it and fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while is_alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"process {pid} is still running")
        time.sleep(0.05)


def write_script(folder, name, source):
    """Writes the dedented `source` to `folder/name`; returns its path."""
    path = pathlib.Path(folder) / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def task_lines(output, task):
    """The lines of a launcher's `output` that `task` printed, unprefixed."""
    prefix = f"[{task}] "
    return [
        line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix)
    ]


# A launched task's script: writes its pid to <argv[1]>/<task>.pid
# (atomically), says "ready", then sleeps <argv[2]> seconds.
SLEEPER = """
    import os, sys, time
    task = os.environ["KERAS_DIST_TASK"].replace(":", "_")
    path = os.path.join(sys.argv[1], task + ".pid")
    with open(path + ".tmp", "w") as handle:
        handle.write(str(os.getpid()))
    os.rename(path + ".tmp", path)
    print("ready", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def train_example(out, *args, env=None, timeout=300):
    """Runs `examples/train.py --out=out *args` on one device (no cluster)."""
    child_env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    child_env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO_ROOT))
    child_env.update(env or {})
    script = REPO_ROOT / "examples" / "train.py"
    result = subprocess.run(
        [sys.executable, str(script), f"--out={out}", *args],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return example_weights(pathlib.Path(out) / "weights-single.npz")


def example_weights(path):
    """The weights `examples/train.py --out` wrote to `path`, as a list."""
    with np.load(path) as archive:
        return [archive[f"arr_{index}"] for index in range(len(archive.files))]
