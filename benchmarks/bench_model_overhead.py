"""Step-time overhead of `keras_dist.DistributedModel` against `keras.Model`.

Trains the same small CNN (same weights, same Adam, same data, same strategy)
as a stock `keras.Model` and as a `keras_dist.DistributedModel`, and compares
the median time per training step. Two strategies are measured: the default
(no-op) strategy and a `MirroredStrategy` over two logical CPU devices.

Two timings per run, in one process, alternating which model goes first in
each round so that drifts of a shared, noisy machine hit both models alike:

- `fit`: `model.fit(dataset, epochs=1, steps_per_epoch=N, verbose=0)`, divided
  by N: what a user sees, including fit's fixed per-call cost.
- `step`: single calls of `model.train_function` on an already-open
  distributed iterator, each timed on its own (up to reading the loss), the
  two models interleaved call by call: the compiled step alone, and the
  pairing that best resists a machine whose load changes under the run.

Usage:

    python benchmarks/bench_model_overhead.py [--steps N] [--rounds R]
        [--out docs/benchmarks/model_overhead.json]

Prints a markdown table; writes the raw timings, the environment and the
command to the JSON file, and a plot next to it (same name, `.png`) when
matplotlib is importable.
"""

from __future__ import annotations

import argparse
import os
import statistics
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

NUM_LOGICAL_CPUS = 2
IMAGE_SIZE = 8
NUM_CLASSES = 10
NUM_EXAMPLES = 2048
MODEL_NAMES = ("keras.Model", "DistributedModel", "DistributedModel, no finite check")
# The check for a non-finite reduced gradient (`compile(...,
# check_finite_gradients=...)`, on by default) is timed on its own by the
# third copy, which turns it off.
UNCHECKED = MODEL_NAMES[2]
TARGET_RATIO = 1.03
WARMUP_STEPS = 5


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=(
            "Median training-step time of keras_dist.DistributedModel vs "
            "keras.Model under the default strategy and MirroredStrategy."
        )
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=60,
        help="Training steps per fit call and per round of single steps.",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=7,
        help="Rounds; each times one fit call and N single steps per model.",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="Global batch size.")
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=("default", "mirrored"),
        default=["default", "mirrored"],
        help="Strategies to measure.",
    )
    parser.add_argument(
        "--out",
        default=os.path.join("docs", "benchmarks", "model_overhead.json"),
        help="JSON file for the raw results; the plot goes next to it (.png).",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "rounds", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1.")
    if args.batch_size % NUM_LOGICAL_CPUS:
        parser.error(
            f"--batch-size must be divisible by {NUM_LOGICAL_CPUS} (the "
            f"MirroredStrategy replicas). Received: {args.batch_size}."
        )
    return args


def make_data(np):
    """Digits-sized synthetic data: 8x8x1 images whose label is learnable."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_EXAMPLES, IMAGE_SIZE, IMAGE_SIZE, 1)).astype("float32")
    weights = rng.normal(size=(IMAGE_SIZE * IMAGE_SIZE, NUM_CLASSES))
    y = np.argmax(x.reshape(NUM_EXAMPLES, -1) @ weights, axis=1).astype("int32")
    return x, y


def build_model(keras, model_class, check_finite=True):
    """Conv 32 -> conv 64 -> pool -> dense 128 -> dense 10, fixed init."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((IMAGE_SIZE, IMAGE_SIZE, 1))
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(128, activation="relu")(x)
    outputs = keras.layers.Dense(NUM_CLASSES)(x)
    model = model_class(inputs, outputs)
    extra = {} if check_finite else {"check_finite_gradients": False}
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **extra,
    )
    return model


def time_fit(model, dataset, steps):
    start = time.perf_counter()
    model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False)
    return (time.perf_counter() - start) / steps


def time_one_step(model, iterator):
    start = time.perf_counter()
    logs = model.train_function(iterator)
    # Reading a value waits for the step, whatever the runtime queued.
    logs["loss"].numpy()
    return time.perf_counter() - start


def run_strategy(tf, keras, keras_dist, strategy_name, args, x, y):
    if strategy_name == "mirrored":
        devices = [d.name for d in tf.config.list_logical_devices("CPU")]
        strategy = tf.distribute.MirroredStrategy(devices)
    else:
        strategy = tf.distribute.get_strategy()
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(args.batch_size, drop_remainder=True)
        .repeat()
        .prefetch(tf.data.AUTOTUNE)
    )
    with strategy.scope():
        models = {
            "keras.Model": build_model(keras, keras.Model),
            "DistributedModel": build_model(keras, keras_dist.DistributedModel),
            UNCHECKED: build_model(
                keras, keras_dist.DistributedModel, check_finite=False
            ),
        }
    reference = models["keras.Model"].get_weights()
    for name in MODEL_NAMES[1:]:
        models[name].set_weights(reference)

    # Warm-up: the first fit traces and builds the train function.
    warm_loss = {}
    for name, model in models.items():
        history = model.fit(
            dataset, epochs=1, steps_per_epoch=WARMUP_STEPS, verbose=0, shuffle=False
        )
        warm_loss[name] = history.history["loss"][-1]
    iterators = {
        name: iter(strategy.experimental_distribute_dataset(dataset)) for name in models
    }
    for name, model in models.items():
        model.make_train_function()
        for _ in range(3):
            time_one_step(model, iterators[name])

    timings = {"fit": {n: [] for n in models}, "step": {n: [] for n in models}}
    for round_index in range(args.rounds):
        order = MODEL_NAMES if round_index % 2 == 0 else MODEL_NAMES[::-1]
        for name in order:
            timings["fit"][name].append(time_fit(models[name], dataset, args.steps))
        for _ in range(args.steps):
            for name in order:
                timings["step"][name].append(
                    time_one_step(models[name], iterators[name])
                )
        print(
            f"  [{strategy_name}] round {round_index + 1}/{args.rounds}: "
            + ", ".join(
                f"fit {name} {timings['fit'][name][-1] * 1e3:.2f} ms"
                for name in MODEL_NAMES
            ),
            file=sys.stderr,
        )
    return {
        "num_replicas": strategy.num_replicas_in_sync,
        "warmup_final_loss": warm_loss,
        "seconds_per_step": timings,
    }


def summarize(results):
    rows = []
    for strategy_name, result in results.items():
        for mode, timings in result["seconds_per_step"].items():
            medians = {n: statistics.median(t) for n, t in timings.items()}
            for name in MODEL_NAMES[1:]:
                # Ratio of paired samples (adjacent in time, same machine
                # load): one per round for `fit`, one per interleaved call
                # for `step`.
                paired = [d / k for k, d in zip(timings["keras.Model"], timings[name])]
                if len(paired) > 1:
                    q1, q2, q3 = statistics.quantiles(paired, n=4, method="inclusive")
                else:
                    q1 = q2 = q3 = paired[0]
                rows.append(
                    {
                        "strategy": strategy_name,
                        "replicas": result["num_replicas"],
                        "mode": mode,
                        "model": name,
                        "samples": len(paired),
                        "keras_ms": medians["keras.Model"] * 1e3,
                        "distributed_ms": medians[name] * 1e3,
                        "ratio_of_medians": medians[name] / medians["keras.Model"],
                        "paired_ratio_median": q2,
                        "paired_ratio_q1": q1,
                        "paired_ratio_q3": q3,
                    }
                )
    return rows


def markdown_table(rows):
    lines = [
        "| strategy | replicas | timing | model | samples | keras.Model ms/step | "
        "model ms/step | ratio of medians | paired ratio median [IQR] |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        flag = "" if row["ratio_of_medians"] <= TARGET_RATIO else " (> 1.03)"
        lines.append(
            f"| {row['strategy']} | {row['replicas']} | {row['mode']} | "
            f"{row['model']} | {row['samples']} | {row['keras_ms']:.2f} | "
            f"{row['distributed_ms']:.2f} | {row['ratio_of_medians']:.3f}{flag} | "
            f"{row['paired_ratio_median']:.3f} "
            f"[{row['paired_ratio_q1']:.3f}, {row['paired_ratio_q3']:.3f}] |"
        )
    return "\n".join(lines)


def plot(results, path):
    plt = pyplot()
    if plt is None:
        return None

    panels = [
        (strategy_name, mode, timings)
        for strategy_name, result in results.items()
        for mode, timings in result["seconds_per_step"].items()
    ]
    figure, axes = plt.subplots(
        1, len(panels) + 1, figsize=(3.2 * (len(panels) + 1), 3.8), squeeze=False
    )
    for axis, (strategy_name, mode, timings) in zip(axes[0], panels):
        data = [[t * 1e3 for t in timings[name]] for name in MODEL_NAMES]
        axis.boxplot(data, showfliers=False)
        axis.set_xticks(
            [1, 2, 3], ["keras.Model", "Distributed\nModel", "no finite\ncheck"]
        )
        axis.set_title(f"{strategy_name}, {mode}")
        axis.set_ylabel("ms per step")
        axis.set_ylim(bottom=0)
        axis.grid(axis="y", alpha=0.3)
    axis = axes[0][-1]
    ratios = [
        [d / k for k, d in zip(timings[MODEL_NAMES[0]], timings[name])]
        for _, _, timings in panels
        for name in MODEL_NAMES[1:]
    ]
    axis.boxplot(ratios, showfliers=False)
    axis.set_xticks(
        range(1, len(ratios) + 1),
        [
            f"{strategy_name}\n{mode}\n{'checked' if name == MODEL_NAMES[1] else 'off'}"
            for strategy_name, mode, _ in panels
            for name in MODEL_NAMES[1:]
        ],
        fontsize=7,
    )
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.axhline(TARGET_RATIO, color="red", linewidth=0.8, linestyle="--")
    axis.set_title("paired ratio DistributedModel / keras.Model", fontsize=9)
    axis.grid(axis="y", alpha=0.3)
    figure.suptitle("Training step time, same CNN, same strategy (lower is better)")
    return save_figure(figure, path)


def main(argv=None):
    args = parse_args(argv)
    tf, keras, keras_dist = import_stack(NUM_LOGICAL_CPUS)
    import numpy as np

    x, y = make_data(np)
    clock = RunClock()
    results = {}
    for strategy_name in args.strategies:
        results[strategy_name] = run_strategy(
            tf, keras, keras_dist, strategy_name, args, x, y
        )
    rows = summarize(results)
    print(markdown_table(rows))
    report = {
        "command": command(),
        "environment": clock.environment(
            versions(tf, keras, keras_dist), logical_cpu_devices=NUM_LOGICAL_CPUS
        ),
        "setup": {
            "steps": args.steps,
            "rounds": args.rounds,
            "global_batch_size": args.batch_size,
            "input_shape": [IMAGE_SIZE, IMAGE_SIZE, 1],
            "model": "Conv2D(32)-Conv2D(64)-MaxPool-Dense(128)-Dense(10)",
            "optimizer": "Adam(1e-3)",
            "metrics": ["accuracy"],
        },
        "results": results,
        "summary": rows,
        "plot": plot(results, plot_path(args.out)),
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
