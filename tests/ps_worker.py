"""One script for every task of a parameter-server job (test_parameter_server.py).

Run by `keras-dist launch --workers 2 --ps M --chief -- python ps_worker.py
MODE OUT_DIR`: on the workers `keras_dist.auto_strategy()` serves (never
returns); on the chief it returns the `ParameterServerStrategy` and the
script runs MODE and writes what it measured to `OUT_DIR/result.json`.

Modes:
- `train`: the errors of `fit` under parameter servers, then a digits model
  trained with `fit` (NumPy input, validation data, callbacks), `evaluate`
  and `predict` checked against the same model run on the chief, and a
  `dataset_fn` input.
- `sharded`: 2 ps tasks, an embedding split across them by a
  `variable_partitioner`; then a worker is SIGKILLed mid-`fit`, then a ps
  task (the job then fails, as it must: the result is written first).
"""

import json
import os
import signal
import sys
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MODE, OUT_DIR = sys.argv[1], sys.argv[2]
TASK = os.environ["KERAS_DIST_TASK"]
# Written before `auto_strategy` serves, so the chief can SIGKILL a worker.
with open(os.path.join(OUT_DIR, f"{TASK.replace(':', '_')}.pid"), "w") as file:
    file.write(str(os.getpid()))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_dist  # noqa: E402
from keras_dist.parameter_server.training import fetch  # noqa: E402

NUM_PS = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["ps"])
partitioner = None
if NUM_PS > 1:
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=1024, max_shards=NUM_PS
    )
strategy = keras_dist.auto_strategy(variable_partitioner=partitioner)
# Only the chief gets here.
assert TASK == "chief:0", TASK

x, y = load_digits(return_X_y=True)
# A seeded shuffle before the split: digits' last 297 images are the hardest
# (a one-device MLP reaches only ~0.90-0.92 on them), a random 297 ~0.95-0.98.
order = np.random.default_rng(0).permutation(len(x))
x = (x[order] / 16.0).astype("float32")
y = y[order].astype("int32")
x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]
result = {"strategy": type(strategy).__name__}


def dense_model(**compile_kwargs):
    with strategy.scope():
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(64, activation="relu")(inputs)
        outputs = keras.layers.Dense(10)(hidden)
        model = keras_dist.DistributedModel(inputs, outputs)
        model.compile(
            optimizer=compile_kwargs.pop("optimizer", keras.optimizers.Adam(0.01)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            **compile_kwargs,
        )
    return model


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs, self.batch_ends, self.batch_begins = [], [], []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if len(self.epochs) == 0:
            self.batch_begins.append(batch)

    def on_train_batch_end(self, batch, logs=None):
        if len(self.epochs) == 0:
            self.batch_ends.append([batch, sorted(logs)])


def error_of(function):
    try:
        function()
    except (ValueError, TypeError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def errors():
    found = {}
    with strategy.scope():
        inputs = keras.Input((64,))
        hooked = keras_dist.DistributedModel(
            inputs,
            keras.layers.Dense(10)(inputs),
            all_reduce_hook=keras_dist.compression.FP16(),
        )
        hooked.compile(optimizer="sgd", loss="mse")
    found["hook"] = error_of(lambda: hooked.fit(x_train, y_train, verbose=0))
    accumulating = dense_model(
        optimizer=keras_dist.GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.1), accumulation_steps=2
        )
    )
    found["accumulation"] = error_of(
        lambda: accumulating.fit(x_train, y_train, verbose=0)
    )
    model = dense_model()
    found["autoscale"] = error_of(
        lambda: model.fit(
            x_train,
            y_train,
            verbose=0,
            callbacks=[keras_dist.callbacks.AutoScaleBatch(16)],
        )
    )
    with strategy.scope():
        local_sgd = keras_dist.LocalSGDOptimizer(keras.optimizers.SGD(0.1), 4)
    local = dense_model(optimizer=local_sgd)
    found["local_sgd"] = error_of(lambda: local.fit(x_train, y_train, verbose=0))
    infinite = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(32)
    found["infinite"] = error_of(lambda: model.fit(infinite.repeat(), verbose=0))
    found["dataset_fn"] = error_of(
        lambda: model.fit(lambda context: infinite, verbose=0)
    )
    for steps in (0, -3):
        found[f"steps_{steps}"] = error_of(
            lambda steps=steps: model.fit(infinite, steps_per_epoch=steps, verbose=0)
        )
    found["class_weight"] = error_of(
        lambda: model.fit(x_train, y_train, class_weight={0: 2.0}, verbose=0)
    )
    found["train_on_batch"] = error_of(
        lambda: model.train_on_batch(x_train[:32], y_train[:32])
    )
    return found


def train():
    result["errors"] = errors()
    model = dense_model(steps_per_execution=3)
    recorder = Recorder()
    epochs = 4
    history = model.fit(
        x_train,
        y_train,
        batch_size=32,
        epochs=epochs,
        validation_data=(x_test, y_test),
        callbacks=[recorder],
        verbose=2,
    )
    steps = -(-len(x_train) // 32)
    result["history"] = history.history
    result["epochs_seen"] = recorder.epochs
    result["batch_begins"] = recorder.batch_begins
    result["batch_ends"] = recorder.batch_ends
    result["steps_per_epoch"] = steps
    result["epochs"] = epochs
    result["iterations"] = int(model.optimizer.iterations.numpy())
    result["evaluate"] = model.evaluate(x_test, y_test, return_dict=True, verbose=0)
    result["evaluate_list"] = model.evaluate(x_test, y_test, verbose=0)
    predictions = model.predict(x_test, batch_size=50, verbose=0)
    on_chief = keras.ops.convert_to_numpy(model(x_test))
    result["predict_vs_chief"] = float(np.max(np.abs(predictions - on_chief)))
    result["numpy_accuracy"] = float(np.mean(np.argmax(predictions, 1) == y_test))
    losses = keras.losses.sparse_categorical_crossentropy(
        y_test, predictions, from_logits=True
    )
    result["numpy_loss"] = float(np.mean(keras.ops.convert_to_numpy(losses)))

    # A dataset function: every worker runs its dataset (TensorFlow gives
    # each the context pipeline 0 of 1 under parameter servers, so the shard
    # is the whole set); every batch is full, so the metric's count shows
    # that the epoch's logs hold every worker's steps.
    def dataset_fn(context):
        dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
        dataset = dataset.shard(context.num_input_pipelines, context.input_pipeline_id)
        return dataset.shuffle(1000).batch(16, drop_remainder=True)

    before = result["iterations"]
    history = model.fit(dataset_fn, steps_per_epoch=20, epochs=1, verbose=0)
    result["dataset_fn_steps"] = int(model.optimizer.iterations.numpy()) - before
    accuracy = next(m for m in model.metrics if m.name == "compile_metrics")
    counts = [v for v in accuracy.variables if v.path.endswith("count")]
    result["dataset_fn_count"] = float(counts[0].numpy())
    result["dataset_fn_history"] = history.history


def sharded():
    with strategy.scope():
        inputs = keras.Input((64,))
        # Pixel intensity (0-16) of the first 16 pixels, one id range per
        # pixel: ids 0-376 of the 400 rows, on both shards.
        ids = keras.layers.Lambda(
            lambda v: tf.cast(v[:, :16] * 16.0, "int32") + tf.range(16) * 24
        )(inputs)
        embedded = keras.layers.Flatten()(keras.layers.Embedding(400, 8)(ids))
        hidden = keras.layers.Concatenate()(
            [embedded, keras.layers.Dense(32, activation="relu")(inputs)]
        )
        model = keras_dist.DistributedModel(inputs, keras.layers.Dense(10)(hidden))
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    model.build_all_reduce_hook()
    table = next(v for v in model.trainable_variables if "embedding" in v.path)
    shards = table.value.variables
    result["shard_devices"] = [shard.device for shard in shards]
    result["shard_rows"] = [int(shard.shape[0]) for shard in shards]
    before = [shard.numpy().copy() for shard in shards]
    model.fit(x_train, y_train, batch_size=32, epochs=3, verbose=2)
    result["shard_changed_rows"] = [
        int(np.sum(np.any(shard.numpy() != old, axis=1)))
        for shard, old in zip(shards, before)
    ]
    result["sharded_evaluate"] = model.evaluate(
        x_test, y_test, return_dict=True, verbose=0
    )

    # A worker is SIGKILLed mid-fit; its steps are retried on the other.
    class KillWorker(keras.callbacks.Callback):
        killed = False

        def on_train_batch_end(self, batch, logs=None):
            if not self.killed and batch >= 10:
                KillWorker.killed = True
                result["killed_at_batch"] = batch
                result["fetched_as_killed"] = _kill_worker_1_while_fetching()

    model = dense_model()
    history = model.fit(
        x_train, y_train, batch_size=32, epochs=3, callbacks=[KillWorker()], verbose=2
    )
    result["kill_history"] = history.history
    result["kill_iterations"] = int(model.optimizer.iterations.numpy())
    result["kill_steps"] = 3 * -(-len(x_train) // 32)
    result["kill_evaluate"] = model.evaluate(
        x_test, y_test, return_dict=True, verbose=0
    )
    ps_failure()


def ps_failure():
    model = dense_model()

    class KillPs(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                os.kill(_ps_pid(), signal.SIGKILL)

    try:
        model.fit(x_train, y_train, epochs=50, callbacks=[KillPs()], verbose=0)
        result["ps_failure"] = None
    except Exception as error:  # the test reads what it was
        result["ps_failure"] = f"{type(error).__name__}: {error}"
        result["ps_failure_cause"] = type(error.__cause__).__name__


def _kill_worker_1_while_fetching():
    """SIGKILLs worker:1 while big outputs are being read from the workers.

    The coordinator's thread for a worker copies each closure's outputs
    once they are marked ready, and so does `fetch` here: at the kill, one
    of them is copying from worker:1 and the other waits to. A CI run ended
    fit with this race (the thread that copies later copies from the dead
    worker). Returns the sum of each output.
    """
    with open(os.path.join(OUT_DIR, "worker_1.pid")) as file:
        pid = int(file.read())
    cluster = tf.distribute.coordinator.ClusterCoordinator(strategy)
    ones = tf.function(lambda: tf.ones([4 * 2**20]))  # 16 MB
    remotes = [cluster.schedule(ones) for _ in range(40)]
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    return [float(np.sum(fetch(cluster, remote))) for remote in remotes]


def _ps_pid():
    """The pid of this job's `ps:0` task (the launcher runs no script there)."""
    cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as file:
                environ = file.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        for line in environ:
            if line.startswith("TF_CONFIG="):
                config = json.loads(line[len("TF_CONFIG=") :])
                if config["cluster"] == cluster and config["task"] == {
                    "type": "ps",
                    "index": 0,
                }:
                    return int(entry)
    raise RuntimeError("no ps:0 process of this job found")


{"train": train, "sharded": sharded}[MODE]()
with open(os.path.join(OUT_DIR, "result.json"), "w") as file:
    json.dump(result, file, default=float)
print("result written", flush=True)
