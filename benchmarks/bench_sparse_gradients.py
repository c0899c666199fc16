"""Memory and step time of embedding (sparse) gradients through the hook path.

A model with a large `Embedding` gets `tf.IndexedSlices` gradients: only the
rows the batch touched. Stock Keras keeps them sparse; keras_dist's first
round densified them in its hook path (a vocabulary-sized tensor per step).
This compares, on 2 logical CPU replicas, in one run:

- `keras.Model` (stock, sparse);
- `DistributedModel` with the default `NoCompression` hook (sparse now);
- `DistributedModel` with a hook that densifies (what the first round did,
  kept here as the reference point).

Each configuration runs in its own process, so the peak resident memory
(`ru_maxrss`) is its own; the step time is the median over timed steps.
The configurations alternate over rounds so load drift hits all alike.

Usage:

    python benchmarks/bench_sparse_gradients.py [--vocabulary 1000000]
        [--dim 32] [--steps 30] [--rounds 2]
        [--out docs/benchmarks/sparse_gradients.json]

Prints a markdown table; writes the timings, the environment and the command
to the JSON file, and a plot next to it (same name, `.png`) when matplotlib
is importable (`--replot JSON` redraws it).
"""

from __future__ import annotations

import resource
import statistics
import sys
import time

import _harness as harness

CONFIGS = ("keras.Model", "DistributedModel (sparse)", "DistributedModel (densified)")
NUM_LOGICAL_CPUS = 2


def parse_args(argv=None):
    parser = harness.parser(
        __doc__.split("\n")[0],
        "sparse_gradients.json",
        jobs=True,
        steps=(30, None),
        rounds=(2, None),
        batch_size=(256, None),
    )
    parser.add_argument("--vocabulary", type=harness.positive_int, default=1_000_000)
    parser.add_argument("--dim", type=harness.positive_int, default=32)
    return parser.parse_args(argv)


def child(job):
    """Trains one configuration; writes its timings and peak memory."""
    tf, keras, keras_dist = harness.import_stack(NUM_LOGICAL_CPUS)
    import numpy as np

    compression = keras_dist.compression

    class Densified(compression.NoCompression):
        """NoCompression that densifies, as the first round's path did."""

        def reduce(self, gradients, variables):
            gradients, _ = self.prepare(gradients, variables)
            return compression.all_reduce_sum(gradients)

    config = job["config"]
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices)
    rng = np.random.default_rng(0)
    n = job["batch_size"] * (job["steps"] + 5)
    x = rng.integers(0, job["vocabulary"], size=(n, 8)).astype("int32")
    y = rng.normal(size=(n, 1)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(job["batch_size"])
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,), dtype="int32")
        hidden = keras.layers.Embedding(job["vocabulary"], job["dim"])(inputs)
        hidden = keras.layers.GlobalAveragePooling1D()(hidden)
        outputs = keras.layers.Dense(1)(hidden)
        if config == "keras.Model":
            model = keras.Model(inputs, outputs)
        else:
            hook = Densified() if "densified" in config else None
            model = keras_dist.DistributedModel(inputs, outputs, all_reduce_hook=hook)
        model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(dataset.take(3), verbose=0)  # trace and build
    iterator = iter(strategy.experimental_distribute_dataset(dataset.skip(3)))
    times = []
    for _ in range(job["steps"]):
        start = time.perf_counter()
        model.train_function(iterator)["loss"].numpy()
        times.append(time.perf_counter() - start)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    harness.finish_job(job, {"seconds_per_step": times, "peak_rss_mb": peak_mb})


def run(args, report):
    results = {name: {"seconds_per_step": [], "peak_rss_mb": []} for name in CONFIGS}
    for round_index in range(args.rounds):
        for name in harness.alternate(CONFIGS, round_index):
            job = harness.job_from(
                args, "vocabulary", "dim", "steps", "batch_size", config=name
            )
            record = harness.run_processes(__file__, job, name="sparse_gradients")
            results[name]["seconds_per_step"] += record["seconds_per_step"]
            results[name]["peak_rss_mb"].append(record["peak_rss_mb"])
            print(
                f"  round {round_index + 1}: {name}: "
                f"{statistics.median(record['seconds_per_step']) * 1e3:.1f} ms/step, "
                f"peak {record['peak_rss_mb']:.0f} MB",
                file=sys.stderr,
            )
    stock = statistics.median(results["keras.Model"]["seconds_per_step"])
    rows, cells = [], []
    for name in CONFIGS:
        median = statistics.median(results[name]["seconds_per_step"])
        peak = max(results[name]["peak_rss_mb"])
        rows.append({"config": name, "ms_per_step": median * 1e3, "peak_mb": peak})
        cells.append([name, f"{median * 1e3:.1f}", f"{median / stock:.2f}x"])
        cells[-1].append(f"{peak:.0f}")
    header = ["configuration", "median ms/step", "vs keras.Model"]
    print(harness.table([*header, "peak RSS MB (max)"], cells))
    fields = {
        "setup": {
            "vocabulary": args.vocabulary,
            "embedding_dim": args.dim,
            "batch_size": args.batch_size,
            "steps": args.steps,
            "rounds": args.rounds,
            "model": "Embedding-GlobalAveragePooling1D-Dense(1), SGD(0.1), MSE",
        },
        "results": results,
        "summary": rows,
    }
    report.write(fields, logical_cpu_devices=NUM_LOGICAL_CPUS)


def plot(plt, report, path):
    rows = report["summary"]
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    labels = [row["config"].replace(" (", "\n(") for row in rows]
    axes[0].bar(labels, [row["ms_per_step"] for row in rows], color="#4c72b0")
    axes[0].set_ylabel("median ms per step")
    axes[1].bar(labels, [row["peak_mb"] for row in rows], color="#dd8452")
    axes[1].set_ylabel("peak resident memory, MB")
    for axis in axes:
        axis.tick_params(axis="x", labelsize=8)
        axis.grid(axis="y", alpha=0.3)
    figure.suptitle("Embedding gradients on 2 logical CPU replicas (lower is better)")
    return harness.save_figure(figure, path)


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot, job=child))
