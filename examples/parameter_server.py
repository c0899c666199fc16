"""Exercise 3: asynchronous parameter servers against synchronous all-reduce.

One script, two strategies, chosen by how the job is launched:

    # asynchronous: a chief (the coordinator), 2 workers, 1 parameter server
    keras-dist launch --workers 2 --ps 1 --chief -- \\
        python examples/parameter_server.py --out ps.json

    # synchronous: 2 workers with MultiWorkerMirroredStrategy
    keras-dist launch --workers 2 -- \\
        python examples/parameter_server.py --out mwms.json

    # either, with worker 1 three times slower than the other (a straggler)
    keras-dist launch --workers 2 --ps 1 --chief -- \\
        python examples/parameter_server.py --straggler-factor 3
    keras-dist launch --workers 2 -- \\
        python examples/parameter_server.py --straggler-factor 3 --smoke

`keras_dist.auto_strategy()` reads the cluster from `TF_CONFIG`: with `ps`
tasks it returns a `ParameterServerStrategy` on the chief and, on the
worker and ps tasks, serves (never returns), so the same file runs on every
task; without them it returns a `MultiWorkerMirroredStrategy` on each
worker. `keras_dist.DistributedModel.fit` trains under both.

- **Parameter servers** (asynchronous): the variables live on the ps task;
  each worker runs a step on its own batch and pushes its update, without
  waiting for the other worker. A step is one worker's batch, one update.
- **MultiWorkerMirroredStrategy** (synchronous): every step, each worker
  computes on its batch and the gradients are summed across workers before
  the one update, so a step waits for the slowest worker.

Both read the same data (scikit-learn's digits), with the same batch per
worker (32), for the same number of examples: `--epochs` times the training
set (a PS step reads one worker's batch, an MWMS step one batch per worker,
so PS takes twice the steps). A warm-up of 3 short epochs before the timed
`fit` traces the step functions and measures a worker's step; it also
trains the model. `--straggler-factor F` then makes worker 1's input wait
F steps' time before each batch (Linux; see `sleep_on_worker_1`).

The chief prints one summary line and, with `--out`, writes it as JSON:
strategy, test accuracy, samples/s, training wall time, steps, final loss.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras

PER_WORKER_BATCH = 32
LEARNING_RATE = 3e-3
# Warm-up: 3 epochs of this many batches per worker; the first traces the
# step functions, the others measure how long a worker's step takes.
WARMUP_EPOCHS = 3
WARMUP_BATCHES_PER_WORKER = 10


class EpochTimer(keras.callbacks.Callback):
    """Records each epoch's wall time (under PS: every worker's steps done)."""

    def on_train_begin(self, logs=None):
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--epochs", type=int, default=10, help="passes' worth of the training set"
    )
    parser.add_argument(
        "--straggler-factor",
        type=float,
        default=1.0,
        help="worker 1's steps take about this many times as long (1: no straggler)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny, fast run")
    parser.add_argument("--out", help="JSON file the chief writes its results to")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1. Received: {args.epochs}.")
    if args.straggler_factor < 1:
        parser.error(
            f"--straggler-factor must be >= 1. Received: {args.straggler_factor}."
        )
    if args.smoke:
        args.epochs = 2
    return args


def sleep_on_worker_1(dataset, microseconds):
    """Simulates a straggler: worker 1's input waits before every batch.

    Under parameter servers TensorFlow traces `dataset_fn` once, on the
    chief, and runs that same graph on every worker (its `input_context`
    says pipeline 0 of 1 on all of them), so the graph itself must find out
    which task runs it: here from the process's environment, where
    `keras-dist launch` names the task. Linux only, and a simulation only;
    on a real cluster the slow machine does this for you.
    """
    import tensorflow as tf

    environ = tf.strings.split(tf.io.read_file("/proc/self/environ"), "\0")
    straggler = tf.reduce_any(tf.equal(environ, "KERAS_DIST_TASK=worker:1"))
    specs = tf.nest.flatten(dataset.element_spec)
    # TensorFlow has no public `tf.data` sleep (its tests use this op); it
    # waits without using the CPU, so the other tasks keep the cores.
    slowed = tf.raw_ops.SleepDataset(
        input_dataset=tf.data.experimental.to_variant(dataset),
        sleep_microseconds=tf.cast(straggler, tf.int64) * microseconds,
        output_types=[spec.dtype for spec in specs],
        output_shapes=[spec.shape for spec in specs],
    )
    return tf.data.experimental.from_variant(slowed, dataset.element_spec)


def main(argv=None):
    args = parse_args(argv)
    if not os.environ.get("TF_CONFIG"):
        print(
            "No TF_CONFIG: start this script through the launcher, e.g.\n"
            "  keras-dist launch --workers 2 --ps 1 --chief -- "
            "python examples/parameter_server.py",
            file=sys.stderr,
        )
        return 2

    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    import keras_dist

    # Everything above runs on every task; on the workers and the ps task of
    # a parameter-server cluster, this call serves and never returns.
    strategy = keras_dist.auto_strategy()
    asynchronous = isinstance(
        strategy, tf.distribute.experimental.ParameterServerStrategy
    )
    config = json.loads(os.environ["TF_CONFIG"])
    num_workers = len(config["cluster"]["worker"])
    # Under parameter servers only the chief gets here; under MWMS every
    # worker does, and worker 0 reports.
    chief = asynchronous or config["task"] == {"type": "worker", "index": 0}

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    y = y.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1437], y[:1437], x[1437:], y[1437:]
    # In a real job, load each worker's data in `dataset_fn` (files read
    # with tf.data) rather than from arrays on the chief: under parameter
    # servers the chief builds every worker's input graph and ships it.

    def dataset_fn_with(sleep_us):
        def dataset_fn(input_context):
            # Each worker reads the whole training set in its own random
            # order, rather than a shard: asynchronous workers take unequal
            # numbers of steps, and a slow worker's shard would be seen less.
            dataset = (
                tf.data.Dataset.from_tensor_slices((x_train, y_train))
                .shuffle(len(x_train))
                .repeat()
                .batch(PER_WORKER_BATCH, drop_remainder=True)
            )
            if sleep_us:
                dataset = sleep_on_worker_1(dataset, sleep_us)
            return dataset

        if asynchronous:
            return dataset_fn  # fit builds it on every worker
        return strategy.distribute_datasets_from_function(dataset_fn)

    # One step reads one worker's batch (PS) or one batch per worker (MWMS).
    batches_per_step = 1 if asynchronous else num_workers
    samples_per_step = PER_WORKER_BATCH * batches_per_step

    def steps_for(batches_per_worker):
        return batches_per_worker * num_workers // batches_per_step

    with strategy.scope():
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(128, activation="relu")(inputs)
        hidden = keras.layers.Dense(64, activation="relu")(hidden)
        model = keras_dist.DistributedModel(inputs, keras.layers.Dense(10)(hidden))
        model.compile(
            optimizer=keras.optimizers.Adam(LEARNING_RATE),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    timer = EpochTimer()
    warmup_steps = steps_for(WARMUP_BATCHES_PER_WORKER)
    model.fit(
        dataset_fn_with(0),
        epochs=WARMUP_EPOCHS,
        steps_per_epoch=warmup_steps,
        callbacks=[timer],
        verbose=0,
    )
    # Workers step side by side: a worker's step takes an epoch's time over
    # the steps each worker ran (the quickest epoch: the machine may be busy).
    step_seconds = min(timer.seconds[1:]) / WARMUP_BATCHES_PER_WORKER
    # The input pipeline runs ahead of the step, so a batch every F steps'
    # time makes the straggler's steps F times as long.
    sleep_us = 0
    if args.straggler_factor > 1:
        sleep_us = int(args.straggler_factor * step_seconds * 1e6)

    # An epoch: every worker reads its share of the training set once.
    steps_per_epoch = steps_for(-(-len(x_train) // (PER_WORKER_BATCH * num_workers)))
    updates_before = int(model.optimizer.iterations.numpy())
    start = time.perf_counter()
    history = model.fit(
        dataset_fn_with(sleep_us),
        epochs=args.epochs,
        steps_per_epoch=steps_per_epoch,
        verbose=0,
    )
    wall = time.perf_counter() - start
    steps = args.epochs * steps_per_epoch
    test = model.evaluate(x_test, y_test, return_dict=True, verbose=0)
    test_accuracy = test["accuracy"]

    if not chief:
        return 0
    result = {
        "strategy": (
            "ParameterServerStrategy" if asynchronous else "MultiWorkerMirroredStrategy"
        ),
        "asynchronous": asynchronous,
        "workers": num_workers,
        "per_worker_batch": PER_WORKER_BATCH,
        "epochs": args.epochs,
        "steps": steps,
        "updates": int(model.optimizer.iterations.numpy()) - updates_before,
        "samples": steps * samples_per_step,
        "wall_s": wall,
        "samples_per_s": steps * samples_per_step / wall,
        "test_accuracy": float(test_accuracy),
        "test_loss": float(test["loss"]),
        "final_loss": float(history.history["loss"][-1]),
        "loss_per_epoch": [float(v) for v in history.history["loss"]],
        "straggler_factor": args.straggler_factor,
        "warmup_step_ms": step_seconds * 1e3,
        "straggler_sleep_ms": sleep_us / 1e3,
    }
    print(
        f"{result['strategy']} ({'async' if asynchronous else 'sync'}, "
        f"{num_workers} workers, straggler x{args.straggler_factor:g}): "
        f"test accuracy {test_accuracy:.3f}, {result['samples_per_s']:,.0f} "
        f"samples/s, {wall:.1f} s, {steps} steps, final loss "
        f"{result['final_loss']:.4f}",
        flush=True,
    )
    if args.out:
        with open(args.out, "w") as file:
            json.dump(result, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
