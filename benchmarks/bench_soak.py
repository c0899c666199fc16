"""A long multi-worker run: threads, open files, memory and step time over time.

Two worker processes train the same tiny model (8 features -> Dense 16 ->
Dense 1, SGD, batch 64) for `--steps` steps each (the same count on both
workers: a worker that stopped on its own clock would leave its peer
waiting in an all-reduce), one configuration after the other, each in
fresh processes:

- `keras_dist`: `DistributedModel.fit` under `auto_strategy()` with the
  collective timeout `keras-dist launch` gives its tasks (300 s), epochs of
  2,000 steps;
- `TF loop, timeout`: a custom training loop on TensorFlow's own
  `MultiWorkerMirroredStrategy`, `CommunicationOptions(timeout_seconds=300)`
  (what keras_dist passed to TensorFlow before it moved the timeout to one
  watchdog thread), Keras's optimizer summing the gradients, as in
  TensorFlow's custom-loop tutorial;
- `TF loop`: the same loop without a timeout.

Every process samples itself every `--interval` seconds
(`keras_dist.testing.ResourceSampler`): threads, open file descriptors,
resident memory and the steps done so far (so the step time of each
interval). A configuration that crashes (TensorFlow's thread per collective
exhausts the process's threads) is reported with the time and step it died
at.

Usage:

    python benchmarks/bench_soak.py [--steps 20000] [--interval 5]
        [--out docs/benchmarks/soak.json]

Prints a markdown table (per configuration: steps, step time in the first
and the last tenth of the run, threads, files and RSS at the start of the
window and at the end, RSS growth per 1,000 steps); writes the samples,
the environment and the command to the JSON file, and a plot next to it
(same name, `.png`) when matplotlib is importable (`--replot JSON` redraws
it).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import time

import _harness as harness

CONFIGS = ("keras_dist", "TF loop, timeout", "TF loop")
TIMEOUT_SECONDS = 300
BATCH = 64
FEATURES = 8
EPOCH_STEPS = 2000


def parse_args(argv=None):
    parser = harness.parser(
        "Threads, open files, RSS and step time of 2 worker processes over a "
        "long run: keras_dist's fit against TensorFlow custom loops.",
        "soak.json",
        jobs=True,
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=20000,
        help=f"Steps per configuration (a multiple of {EPOCH_STEPS}).",
    )
    parser.add_argument(
        "--interval", type=float, default=5.0, help="Seconds between samples."
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=CONFIGS,
        default=list(CONFIGS),
        help="Configurations to run, in order.",
    )
    return parser.parse_args(argv)


def worker_main(job):
    """One worker process: trains until the time is up, sampling itself."""
    tf, keras, keras_dist = harness.import_stack()
    import numpy as np

    index = harness.task_index()
    sampler = keras_dist.testing.ResourceSampler(
        f"{job['samples']}.{index}", interval=job["interval"]
    )
    sampler.labels = {"steps": 0}
    sampler.start()
    rng = np.random.default_rng(index)
    x = rng.normal(size=(BATCH * EPOCH_STEPS, FEATURES)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    if job["config"] == "keras_dist":
        os.environ["KERAS_DIST_COLLECTIVE_TIMEOUT"] = str(TIMEOUT_SECONDS)
        # TensorFlow's collectives, as the loops it is compared with (where
        # PyTorch is installed the default is gloo).
        os.environ["KERAS_DIST_COLLECTIVES"] = "tensorflow"
        keras_fit(keras, keras_dist, x, y, sampler, job["steps"])
    else:
        timeout = TIMEOUT_SECONDS if job["config"] == "TF loop, timeout" else None
        tf_loop(tf, keras, x, y, sampler, job["steps"], timeout)
    sampler.stop()
    harness.finish_job(job, {"done": True})


def keras_fit(keras, keras_dist, x, y, sampler, steps):
    strategy = keras_dist.auto_strategy()

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            sampler.labels = {"steps": sampler.labels["steps"] + 1}

    with strategy.scope():
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(hidden))
        model.compile(keras.optimizers.SGD(0.01), "mse")
    # Epochs of EPOCH_STEPS steps; each epoch's end reduces the metrics too.
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=steps // EPOCH_STEPS,
        shuffle=False,
        verbose=0,
        callbacks=[Count()],
    )


def tf_loop(tf, keras, x, y, sampler, steps, timeout):
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    with strategy.scope():
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        optimizer = keras.optimizers.SGD(0.01)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    @tf.function
    def step(iterator):
        def replica(batch):
            features, targets = batch
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(features) - targets) ** 2)
                loss = loss / strategy.num_replicas_in_sync
            grads = tape.gradient(loss, model.trainable_variables)
            # Keras's optimizer sums the gradients across replicas (one
            # all-reduce), as in TensorFlow's custom-loop tutorial.
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.run(replica, args=(next(iterator),))

    for _ in range(steps):
        step(iterator)
        sampler.labels = {"steps": sampler.labels["steps"] + 1}


def run(args, report):
    folder = tempfile.mkdtemp(prefix="kd_soak_")
    results = {}
    for config in args.configs:
        samples = os.path.join(folder, config.replace(" ", "_").replace(",", ""))
        job = {
            "config": config,
            "steps": args.steps,
            "interval": args.interval,
            "samples": samples,
        }
        print(f"{config}: {args.steps} steps ...", flush=True)
        started = time.monotonic()
        try:
            harness.run_processes(
                __file__,
                job,
                workers=2,
                timeout=3600,
                name="soak",
            )
            crashed = None
        except RuntimeError as error:
            crashed = {
                "after_seconds": round(time.monotonic() - started, 1),
                "error": str(error).splitlines()[0],
                "log_tail": str(error)[-600:],
            }
        results[config] = {
            "tasks": [_read_samples(f"{samples}.{index}") for index in range(2)],
            "crashed": crashed,
        }
    rows = [summary_row(config, result) for config, result in results.items()]
    print(
        harness.table(
            [
                "configuration",
                "steps",
                "step ms (first / last tenth)",
                "threads",
                "open files",
                "RSS MiB",
                "RSS growth per 1,000 steps",
                "ended",
            ],
            rows,
        )
    )
    report.write(
        {
            "setup": {
                "workers": 2,
                "steps": args.steps,
                "interval_seconds": args.interval,
                "model": f"{FEATURES} -> Dense 16 -> Dense 1, SGD, batch {BATCH}",
                "collective_timeout_seconds": TIMEOUT_SECONDS,
            },
            "results": results,
            "table": rows,
        }
    )


def _read_samples(path):
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def summary_row(config, result):
    """Worker 0's run, summarised (worker 1's is alike)."""
    samples = [s for s in result["tasks"][0] if s["steps"] > 0]
    if len(samples) < 4:
        return [config, 0, "-", "-", "-", "-", "-", _ended(result)]
    tenth = max(2, len(samples) // 10)

    def step_ms(window):
        steps = window[-1]["steps"] - window[0]["steps"]
        seconds = window[-1]["time"] - window[0]["time"]
        return f"{1000 * seconds / steps:.2f}" if steps else "-"

    first, last = samples[tenth], samples[-1]
    grown = (last["rss_bytes"] - first["rss_bytes"]) / 2**10
    per_thousand = 1000 * grown / max(1, last["steps"] - first["steps"])
    return [
        config,
        last["steps"],
        f"{step_ms(samples[:tenth])} / {step_ms(samples[-tenth:])}",
        f"{first['threads']} -> {last['threads']}",
        f"{first['open_files']} -> {last['open_files']}",
        f"{first['rss_bytes'] / 2**20:.0f} -> {last['rss_bytes'] / 2**20:.0f}",
        f"{per_thousand:.0f} KiB",
        _ended(result),
    ]


def _ended(result):
    crashed = result["crashed"]
    if crashed is None:
        return "ran to the end"
    return f"crashed after {crashed['after_seconds']:.0f} s"


def plot(plt, report, path):
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for config, result in report["results"].items():
        samples = [s for s in result["tasks"][0] if s["steps"] > 0]
        if len(samples) < 2:
            continue
        steps = [s["steps"] for s in samples]
        axes[0].plot(steps, [s["threads"] for s in samples], label=config)
        axes[1].plot(steps, [s["rss_bytes"] / 2**20 for s in samples], label=config)
        times = [
            1000 * (b["time"] - a["time"]) / max(1, b["steps"] - a["steps"])
            for a, b in itertools.pairwise(samples)
        ]
        axes[2].plot(steps[1:], times, label=config)
    axes[0].set(xlabel="steps", ylabel="threads (worker 0)", yscale="log")
    axes[1].set(xlabel="steps", ylabel="resident memory, MiB (worker 0)")
    axes[2].set(xlabel="steps", ylabel="ms per step (worker 0)", yscale="log")
    for axis in axes:
        axis.grid(alpha=0.3)
    axes[0].legend()
    figure.suptitle(
        "2 worker processes, "
        + report["setup"]["model"]
        + f"; {report['setup']['steps']:,} steps per configuration"
    )
    return harness.save_figure(figure, path)


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot, job=worker_main))
