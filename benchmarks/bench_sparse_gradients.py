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
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from _common import (
    RunClock,
    command,
    import_stack,
    plot_path,
    pyplot,
    save_figure,
    versions,
    write_report,
)

CONFIGS = ("keras.Model", "DistributedModel (sparse)", "DistributedModel (densified)")
NUM_LOGICAL_CPUS = 2


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocabulary", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument(
        "--out", default=os.path.join("docs", "benchmarks", "sparse_gradients.json")
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("vocabulary", "dim", "steps", "rounds", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1.")
    return args


def child(args):
    """Trains one configuration; prints its timings and peak memory as JSON."""
    tf, keras, keras_dist = import_stack(NUM_LOGICAL_CPUS)
    import numpy as np

    from keras_dist.compression import NoCompression
    from keras_dist.compression.base import all_reduce_sum

    class Densified(NoCompression):
        """NoCompression that densifies, as the first round's path did."""

        def reduce(self, gradients, variables):
            gradients, _ = self.prepare(gradients, variables)
            return all_reduce_sum(gradients)

    config = args.child
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices)
    rng = np.random.default_rng(0)
    n = args.batch_size * (args.steps + 5)
    x = rng.integers(0, args.vocabulary, size=(n, 8)).astype("int32")
    y = rng.normal(size=(n, 1)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,), dtype="int32")
        hidden = keras.layers.Embedding(args.vocabulary, args.dim)(inputs)
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
    for _ in range(args.steps):
        start = time.perf_counter()
        model.train_function(iterator)["loss"].numpy()
        times.append(time.perf_counter() - start)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds_per_step": times, "peak_rss_mb": peak_mb}))


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    clock = RunClock()
    results = {name: {"seconds_per_step": [], "peak_rss_mb": []} for name in CONFIGS}
    for round_index in range(args.rounds):
        order = CONFIGS if round_index % 2 == 0 else CONFIGS[::-1]
        for name in order:
            child_args = [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                name,
                "--vocabulary",
                str(args.vocabulary),
                "--dim",
                str(args.dim),
                "--steps",
                str(args.steps),
                "--batch-size",
                str(args.batch_size),
            ]
            output = subprocess.run(
                child_args, capture_output=True, text=True, check=True
            ).stdout
            record = json.loads(output.strip().splitlines()[-1])
            results[name]["seconds_per_step"] += record["seconds_per_step"]
            results[name]["peak_rss_mb"].append(record["peak_rss_mb"])
            print(
                f"  round {round_index + 1}: {name}: "
                f"{statistics.median(record['seconds_per_step']) * 1e3:.1f} ms/step, "
                f"peak {record['peak_rss_mb']:.0f} MB",
                file=sys.stderr,
            )
    stock = statistics.median(results["keras.Model"]["seconds_per_step"])
    rows = []
    lines = [
        "| configuration | median ms/step | vs keras.Model | peak RSS MB (max) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in CONFIGS:
        median = statistics.median(results[name]["seconds_per_step"])
        peak = max(results[name]["peak_rss_mb"])
        rows.append({"config": name, "ms_per_step": median * 1e3, "peak_mb": peak})
        lines.append(
            f"| {name} | {median * 1e3:.1f} | {median / stock:.2f}x | {peak:.0f} |"
        )
    print("\n".join(lines))
    tf, keras, keras_dist = import_stack()
    report = {
        "command": command(),
        "environment": clock.environment(
            versions(tf, keras, keras_dist), logical_cpu_devices=NUM_LOGICAL_CPUS
        ),
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
        "plot": plot(rows, plot_path(args.out)),
    }
    write_report(args.out, report)


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return None
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
    return save_figure(figure, path)


if __name__ == "__main__":
    main()
