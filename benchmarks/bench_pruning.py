"""Pruning to 80% on 2 replicas, with and without FP16 compression and accumulation.

Prunes the digits CNN of `examples/prune_distributed.py` (a tf_keras model,
Conv2D 16 -> Dense 64 -> Dense 10, 37,738 parameters) with
tensorflow-model-optimization's `prune_low_magnitude` on a `MirroredStrategy`
over two logical CPU devices, through `keras_dist.tf_keras.DistributedOptimizer`
(Adam 0.005) and `keras_dist.tf_keras.UpdatePruningStep`, in four
configurations:

- `none x1`: `NoCompression()`, no accumulation, 32 examples per replica;
- `fp16 x1`: `FP16()`, no accumulation, 32 per replica;
- `none x2`: `NoCompression()`, `accumulation_steps=2`, 16 per replica;
- `fp16 x2`: `FP16()`, `accumulation_steps=2`, 16 per replica.

Every update averages 64 examples, so all four see the same examples in the
same order (for a seed), make the same number of updates and follow the same
pruning schedule (`PolynomialDecay` from 0 to 80% over the first 6 of 8
epochs' updates, every 10 updates). Digits: 1,500 training and 297 test
images after a permutation seeded 0 (the file's last images are harder);
the seed sets the initial weights and the shuffle of each epoch.

Measured per run: the stripped model's test accuracy and per-layer
sparsity, the optimizer's updates, and the bytes one replica sends per
update (`hook.stats().sent_bytes`: the hook's own accounting; `raw_bytes` is
what plain float32 all-reduce sends) and per micro-step (per update divided
by `accumulation_steps`: the accumulating micro-steps send nothing). `fit`'s
wall time is recorded, not compared: the logical devices share two cores.

Usage:

    python benchmarks/bench_pruning.py [--seeds 0 1 2] [--epochs 8]
        [--out docs/benchmarks/pruning.json]

Prints a markdown table; writes every run, the environment and the command
to the JSON file, and a plot next to it (same name, `.png`) when matplotlib
is importable (`--replot JSON` redraws it).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import _harness as harness

NUM_LOGICAL_CPUS = 2
UPDATE_BATCH = 64  # examples per update, every configuration
LEARNING_RATE = 0.005
TARGET = 0.8
PRUNING_FREQUENCY = 10
SPLIT_SEED = 0
# (label, hook, accumulation steps)
CONFIGS = (
    ("none x1", "NoCompression", 1),
    ("fp16 x1", "FP16", 1),
    ("none x2", "NoCompression", 2),
    ("fp16 x2", "FP16", 2),
)


def parse_args(argv=None):
    parser = harness.parser(
        "Pruning to 80% on 2 logical replicas: accuracy, sparsity, bytes.",
        "pruning.json",
        seeds=([0, 1, 2], None),
        epochs=(8, None),
    )
    return parser.parse_args(argv)


def run_one(tf, np, keras_dist, strategy, data, config, seed, epochs):
    import tf_keras

    from keras_dist.tf_keras import (
        DistributedOptimizer,
        UpdatePruningStep,
        import_tfmot,
    )

    tfmot = import_tfmot()
    from prune_distributed import digits_cnn

    label, hook_name, accumulation_steps = config
    x, y, x_test, y_test = data
    global_micro = UPDATE_BATCH // accumulation_steps
    updates_per_epoch = len(x) // UPDATE_BATCH
    end_step = updates_per_epoch * (epochs - 2) // PRUNING_FREQUENCY * PRUNING_FREQUENCY
    tf_keras.utils.set_random_seed(seed)
    with strategy.scope():
        schedule = tfmot.sparsity.keras.PolynomialDecay(
            initial_sparsity=0.0,
            final_sparsity=TARGET,
            begin_step=0,
            end_step=end_step,
            frequency=PRUNING_FREQUENCY,
        )
        model = tfmot.sparsity.keras.prune_low_magnitude(
            digits_cnn(tf_keras), pruning_schedule=schedule
        )
        hook = getattr(keras_dist.compression, hook_name)()
        model.compile(
            optimizer=DistributedOptimizer(
                tf_keras.optimizers.Adam(LEARNING_RATE),
                all_reduce_hook=hook,
                accumulation_steps=accumulation_steps,
            ),
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=seed)
        .batch(global_micro, drop_remainder=True)
    )
    started = time.perf_counter()
    history = model.fit(
        dataset, epochs=epochs, callbacks=[UpdatePruningStep()], verbose=0
    )
    wall = time.perf_counter() - started
    stripped = tfmot.sparsity.keras.strip_pruning(model)
    stripped.compile(
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    _, accuracy = stripped.evaluate(x_test, y_test, verbose=0)
    kernels = [
        layer.kernel.numpy() for layer in stripped.layers if hasattr(layer, "kernel")
    ]
    stats = hook.stats()
    return {
        "config": label,
        "hook": hook_name,
        "accumulation_steps": accumulation_steps,
        "micro_batch_per_replica": global_micro // strategy.num_replicas_in_sync,
        "seed": seed,
        "test_accuracy": float(accuracy),
        "sparsity_per_layer": {
            f"{type(layer).__name__}({layer.kernel.shape[-1]})": float(
                np.mean(layer.kernel.numpy() == 0)
            )
            for layer in stripped.layers
            if hasattr(layer, "kernel")
        },
        "sparsity": float(
            sum(int(np.sum(k == 0)) for k in kernels) / sum(k.size for k in kernels)
        ),
        "updates": int(model.optimizer.iterations.numpy()),
        "micro_steps": updates_per_epoch * accumulation_steps * epochs,
        "expected_updates": updates_per_epoch * epochs,
        "sent_bytes_per_update": stats.sent_bytes,
        "raw_bytes_per_update": stats.raw_bytes,
        "sent_bytes_per_micro_step": stats.sent_bytes / accumulation_steps,
        "train_loss": [float(v) for v in history.history["loss"]],
        "fit_seconds": wall,
    }


def summarize(runs):
    rows = []
    for label, hook_name, steps in CONFIGS:
        mine = [r for r in runs if r["config"] == label]
        accuracies = [r["test_accuracy"] for r in mine]
        sparsities = [r["sparsity"] for r in mine]
        first = mine[0]
        rows.append(
            {
                "config": label,
                "hook": hook_name,
                "accumulation_steps": steps,
                "micro_batch_per_replica": first["micro_batch_per_replica"],
                "seeds": len(mine),
                "accuracy_mean": statistics.mean(accuracies),
                "accuracy_min": min(accuracies),
                "accuracy_max": max(accuracies),
                "accuracy_std": statistics.pstdev(accuracies),
                "sparsity_min": min(sparsities),
                "sparsity_max": max(sparsities),
                "updates": sorted({r["updates"] for r in mine}),
                "micro_steps": first["micro_steps"],
                "sent_bytes_per_update": first["sent_bytes_per_update"],
                "raw_bytes_per_update": first["raw_bytes_per_update"],
                "sent_bytes_per_micro_step": first["sent_bytes_per_micro_step"],
                "fit_seconds_median": statistics.median(r["fit_seconds"] for r in mine),
            }
        )
    return rows


def markdown_table(rows):
    header = ["configuration", "hook", "accumulation", "per replica per micro-step"]
    header += ["test accuracy, mean (min-max)", "final sparsity (min-max)"]
    header += ["updates", "micro-steps", "bytes sent per update"]
    header += ["bytes sent per micro-step", "compression"]
    cells = [
        [
            row["config"],
            f"{row['hook']}()",
            row["accumulation_steps"],
            row["micro_batch_per_replica"],
            f"{row['accuracy_mean']:.3f} "
            f"({row['accuracy_min']:.3f}-{row['accuracy_max']:.3f})",
            f"{row['sparsity_min']:.4f}-{row['sparsity_max']:.4f}",
            "/".join(str(u) for u in row["updates"]),
            row["micro_steps"],
            f"{row['sent_bytes_per_update']:,}",
            f"{row['sent_bytes_per_micro_step']:,.0f}",
            f"{row['raw_bytes_per_update'] / row['sent_bytes_per_update']:.1f}x",
        ]
        for row in rows
    ]
    return harness.table(header, cells, align="ll" + "r" * 9)


def plot(plt, report, path):
    rows, runs = report["summary"], report["runs"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [row["config"] for row in rows]
    positions = range(len(rows))
    left.bar(positions, [row["accuracy_mean"] for row in rows], color="#7a9cc6")
    for index, label in enumerate(labels):
        points = [r["test_accuracy"] for r in runs if r["config"] == label]
        left.scatter([index] * len(points), points, color="black", s=12, zorder=3)
    low = min(r["test_accuracy"] for r in runs)
    left.set_ylim(max(0.0, low - 0.05), 1.0)
    left.set_xticks(list(positions), labels)
    left.set_ylabel("test accuracy (stripped, 80% sparse)")
    left.set_title("accuracy: mean (bar) and each seed (dots)")
    width = 0.4
    right.bar(
        [p - width / 2 for p in positions],
        [row["sent_bytes_per_update"] / 1000 for row in rows],
        width,
        label="per update",
        color="#c69a7a",
    )
    right.bar(
        [p + width / 2 for p in positions],
        [row["sent_bytes_per_micro_step"] / 1000 for row in rows],
        width,
        label="per micro-step",
        color="#8fbf8f",
    )
    right.set_xticks(list(positions), labels)
    right.set_ylabel("kB sent per replica")
    right.set_title("bytes sent by the hook")
    right.legend()
    return harness.save_figure(figure, path)


def run(args, report):
    tf, _, keras_dist = harness.import_stack(logical_cpus=NUM_LOGICAL_CPUS)
    import numpy as np
    import tf_keras

    from keras_dist.tf_keras import import_tfmot

    tfmot = import_tfmot()
    strategy = keras_dist.auto_strategy(cpu_replicas=NUM_LOGICAL_CPUS)
    # The example's data and model: one definition for both.
    sys.path.insert(0, os.path.join(harness.REPO_ROOT, "examples"))
    from prune_distributed import digits

    data = digits(SPLIT_SEED)
    runs = []
    for round_index, seed in enumerate(args.seeds):
        for config in harness.alternate(CONFIGS, round_index):
            run = run_one(tf, np, keras_dist, strategy, data, config, seed, args.epochs)
            runs.append(run)
            print(
                f"seed {seed} {run['config']}: accuracy {run['test_accuracy']:.4f}, "
                f"sparsity {run['sparsity']:.4f}, updates {run['updates']}, "
                f"{run['fit_seconds']:.1f} s",
                flush=True,
            )
    rows = summarize(runs)
    table = markdown_table(rows)
    print()
    print(table)
    fields = {
        "setup": {
            "strategy": "MirroredStrategy over 2 logical CPUs",
            "model": "tf_keras Conv2D(16, 3)-Flatten-Dense(64)-Dense(10)",
            "optimizer": f"DistributedOptimizer(tf_keras Adam({LEARNING_RATE}))",
            "examples_per_update": UPDATE_BATCH,
            "train_examples": len(data[0]),
            "split_seed": SPLIT_SEED,
            "epochs": args.epochs,
            "seeds": args.seeds,
            "schedule": (
                f"PolynomialDecay(0 -> {TARGET}, begin_step=0, end_step=updates of "
                f"the first {args.epochs - 2} epochs (rounded down to a multiple of "
                f"{PRUNING_FREQUENCY}), frequency={PRUNING_FREQUENCY})"
            ),
            "callback": "keras_dist.tf_keras.UpdatePruningStep()",
        },
        "summary": rows,
        "runs": runs,
        "table": table,
    }
    report.write(
        fields,
        tf_keras=tf_keras.__version__,
        tfmot=tfmot.__version__,
        logical_cpu_devices=NUM_LOGICAL_CPUS,
    )


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot))
