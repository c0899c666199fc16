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

With `--workers N` the same CNN trains under `MultiWorkerMirroredStrategy`
in N worker processes on 127.0.0.1 (the benchmark harness starts them with
the `TF_CONFIG` of a local cluster, as `keras-dist launch` would). Stock
`keras.Model.fit` fails there (see docs/why.md), so the reference is stock
Keras's own `train_step` run by a minimal train function (`strategy.run`,
logs left on each worker: no log collective at all), against
`DistributedModel.train_function`, both at each `--steps-per-execution`,
interleaved call by call; a sample is one call divided by its steps. With
`--baseline PATH` (another checkout of keras_dist, e.g. a `git worktree` of
an older commit) every launch is repeated with that checkout's keras_dist,
alternating the two (this checkout first, then the baseline, then the
baseline again, then this checkout, ...), for a before/after comparison:

    python benchmarks/bench_model_overhead.py --workers 2 \
        --baseline ../keras_dist_old --launches 2 \
        --out docs/benchmarks/model_overhead_workers.json

Prints a markdown table; writes the raw timings, the environment and the
command to the JSON file, and a plot next to it (same name, `.png`) when
matplotlib is importable (with `--workers`, only where `--plot` says);
`--replot JSON` redraws it.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import _harness as harness

NUM_LOGICAL_CPUS = 2
IMAGE_SIZE = 8
NUM_CLASSES = 10
NUM_EXAMPLES = 2048
MODEL_NAMES = ("keras.Model", "DistributedModel", "DistributedModel, no finite check")
# The check for a non-finite reduced gradient (`compile(...,
# non_finite_gradients=...)`, "skip" by default) is timed on its own by the
# third copy, which turns it off.
UNCHECKED = MODEL_NAMES[2]
TARGET_RATIO = 1.03
WARMUP_STEPS = 5


def parse_args(argv=None):
    parser = harness.parser(
        "Median training-step time of keras_dist.DistributedModel vs "
        "keras.Model under the default strategy and MirroredStrategy.",
        None,
        out_help=(
            "JSON file for the raw results; the plot goes next to it (.png). "
            "Defaults to docs/benchmarks/model_overhead.json, or "
            "model_overhead_workers.json with --workers."
        ),
        jobs=True,
        steps=(60, "Training steps per fit call and per round of single steps."),
        rounds=(7, "Rounds; each times one fit call and N single steps per model."),
        batch_size=(64, "Global batch size."),
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=("default", "mirrored"),
        default=["default", "mirrored"],
        help="Strategies to measure.",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help=(
            "Run under MultiWorkerMirroredStrategy in this many worker "
            "processes; 0 for the in-process strategies."
        ),
    )
    parser.add_argument(
        "--steps-per-execution",
        type=harness.positive_int,
        nargs="+",
        default=[1, 4],
        help="With --workers: the steps_per_execution values to time.",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help=(
            "With --workers: a checkout of keras_dist (its repository root) "
            "to time as well, in alternating launches, as 'before'."
        ),
    )
    parser.add_argument(
        "--launches",
        type=harness.positive_int,
        default=1,
        help="With --workers: launches per keras_dist version.",
    )
    parser.add_argument(
        "--plot",
        default=None,
        help=(
            "With --workers: PNG file for a box plot of the paired ratios "
            "(none by default: every plot in docs/benchmarks must be embedded "
            "in its index)."
        ),
    )
    args = parser.parse_args(argv)
    if args.out is None:
        name = "model_overhead_workers.json" if args.workers else "model_overhead.json"
        args.out = os.path.join(harness.RESULTS, name)
    if args.workers < 0:
        parser.error(f"--workers must be >= 0. Received: {args.workers}.")
    if args.baseline is not None and not os.path.isdir(
        os.path.join(args.baseline, "keras_dist")
    ):
        parser.error(
            "--baseline must be a checkout holding a keras_dist package. "
            f"Received: {args.baseline}."
        )
    if args.batch_size % max(NUM_LOGICAL_CPUS, args.workers):
        parser.error(
            "--batch-size must be divisible by the number of replicas "
            f"({max(NUM_LOGICAL_CPUS, args.workers)}). Received: {args.batch_size}."
        )
    return args


def make_data(np):
    """Digits-sized synthetic data: 8x8x1 images whose label is learnable."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_EXAMPLES, IMAGE_SIZE, IMAGE_SIZE, 1)).astype("float32")
    weights = rng.normal(size=(IMAGE_SIZE * IMAGE_SIZE, NUM_CLASSES))
    y = np.argmax(x.reshape(NUM_EXAMPLES, -1) @ weights, axis=1).astype("int32")
    return x, y


def build_model(keras, model_class, check_finite=True, steps_per_execution=1):
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
    extra = {} if check_finite else {"non_finite_gradients": "apply"}
    if steps_per_execution != 1:
        extra["steps_per_execution"] = steps_per_execution
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
        order = harness.alternate(MODEL_NAMES, round_index)
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
                q1, q2, q3 = harness.quartiles(paired)
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
    header = ["strategy", "replicas", "timing", "model", "samples"]
    header += ["keras.Model ms/step", "model ms/step", "ratio of medians"]
    header += ["paired ratio median [IQR]"]
    cells = []
    for row in rows:
        flag = "" if row["ratio_of_medians"] <= TARGET_RATIO else " (> 1.03)"
        cells.append(
            [row[key] for key in ("strategy", "replicas", "mode", "model", "samples")]
            + [f"{row['keras_ms']:.2f}", f"{row['distributed_ms']:.2f}"]
            + [f"{row['ratio_of_medians']:.3f}{flag}", harness.paired_ratio_cell(row)]
        )
    return harness.table(header, cells, align="lrllrrrrl")


def plot(plt, report, path):
    """The box plots of a run; with `--workers`, those of `plot_multi_worker`."""
    results = report["results"]
    if "launches" in report["setup"]:
        return plot_multi_worker(plt, results, path)
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
    return harness.save_figure(figure, path)


# --- Multi-worker mode -------------------------------------------------------

REFERENCE = "keras.Model train_step"
DISTRIBUTED = "DistributedModel"


def reference_function(tf, model, strategy, steps_per_execution):
    """Stock Keras's `train_step`, `steps_per_execution` times, logs unreduced.

    What a stock `keras.Model` would run under MultiWorkerMirroredStrategy
    if its logs needed no collective: the lower bound for the step.
    """

    @tf.function
    def function(iterator):
        logs = strategy.run(model.train_step, args=(next(iterator),))
        for _ in tf.range(steps_per_execution - 1):
            logs = strategy.run(model.train_step, args=(next(iterator),))
        return strategy.experimental_local_results(logs)[0]

    return function


def time_call(function, iterator, steps_per_execution):
    start = time.perf_counter()
    function(iterator)["loss"].numpy()
    return (time.perf_counter() - start) / steps_per_execution


def run_worker(job):
    """One worker's share of a `--workers` launch; worker 0 writes the timings."""
    if job["keras_dist_root"]:
        # The baseline's keras_dist, imported before `import_stack` adds
        # this checkout's.
        sys.path.insert(0, job["keras_dist_root"])
        import keras_dist
    tf, keras, keras_dist = harness.import_stack()
    import numpy as np

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = make_data(np)
    dataset = harness.sharded_dataset(tf, x, y, job["batch_size"]).prefetch(
        tf.data.AUTOTUNE
    )
    functions = {}
    for steps in job["steps_per_execution"]:
        with strategy.scope():
            reference = build_model(keras, keras.Model)
            distributed = build_model(
                keras, keras_dist.DistributedModel, steps_per_execution=steps
            )
            distributed.set_weights(reference.get_weights())
            # Stock Keras builds metrics and optimizer in `fit`, which fails
            # under MultiWorkerMirroredStrategy: build them here.
            reference._symbolic_build(data_batch=(x[:2], y[:2]))
            reference.optimizer.build(reference.trainable_variables)
        distributed.fit(
            dataset, epochs=1, steps_per_epoch=WARMUP_STEPS * steps, verbose=0
        )
        functions[steps] = {
            REFERENCE: reference_function(tf, reference, strategy, steps),
            DISTRIBUTED: distributed.make_train_function(),
        }
    iterators = {
        (steps, name): iter(strategy.experimental_distribute_dataset(dataset))
        for steps in functions
        for name in functions[steps]
    }
    for steps, pair in functions.items():
        for name, function in pair.items():
            for _ in range(WARMUP_STEPS):
                time_call(function, iterators[(steps, name)], steps)

    timings = {str(steps): {REFERENCE: [], DISTRIBUTED: []} for steps in functions}
    for round_index in range(job["rounds"]):
        order = harness.alternate((REFERENCE, DISTRIBUTED), round_index)
        for steps, pair in functions.items():
            calls = max(1, job["steps"] // steps)
            for _ in range(calls):
                for name in order:
                    timings[str(steps)][name].append(
                        time_call(pair[name], iterators[(steps, name)], steps)
                    )
    result = {"keras_dist_file": keras_dist.__file__, "seconds_per_step": timings}
    harness.finish_job(job, result)


def run_multi_worker(args):
    versions_to_run = {"this checkout": None}
    if args.baseline is not None:
        versions_to_run["baseline"] = args.baseline
    launches = {name: [] for name in versions_to_run}
    for launch_index in range(args.launches):
        for name in harness.alternate(versions_to_run, launch_index):
            print(
                f"  launch {launch_index + 1}/{args.launches}: {name}", file=sys.stderr
            )
            root = versions_to_run[name]
            job = harness.job_from(
                args,
                *("steps", "rounds", "batch_size", "steps_per_execution"),
                keras_dist_root=root and os.path.abspath(root),
            )
            launches[name].append(
                harness.run_processes(
                    __file__, job, workers=args.workers, name="model_overhead"
                )
            )
    return {
        name: {
            "keras_dist_root": versions_to_run[name] or harness.REPO_ROOT,
            "keras_dist_file": runs[0]["keras_dist_file"],
            "launches": [run["seconds_per_step"] for run in runs],
        }
        for name, runs in launches.items()
    }


def summarize_multi_worker(results):
    rows = []
    for version, result in results.items():
        for steps in result["launches"][0]:
            reference = [t for run in result["launches"] for t in run[steps][REFERENCE]]
            distributed = [
                t for run in result["launches"] for t in run[steps][DISTRIBUTED]
            ]
            paired = [d / k for k, d in zip(reference, distributed)]
            q1, q2, q3 = harness.quartiles(paired)
            rows.append(
                {
                    "version": version,
                    "steps_per_execution": int(steps),
                    "samples": len(paired),
                    "keras_ms": statistics.median(reference) * 1e3,
                    "distributed_ms": statistics.median(distributed) * 1e3,
                    "ratio_of_medians": statistics.median(distributed)
                    / statistics.median(reference),
                    "paired_ratio_median": q2,
                    "paired_ratio_q1": q1,
                    "paired_ratio_q3": q3,
                }
            )
    return rows


def markdown_table_multi_worker(rows):
    header = ["keras_dist", "steps_per_execution", "samples"]
    header += [f"{REFERENCE} ms/step", f"{DISTRIBUTED} ms/step", "ratio of medians"]
    header += ["paired ratio median [IQR]"]
    return harness.table(
        header,
        (
            [
                row["version"],
                row["steps_per_execution"],
                row["samples"],
                f"{row['keras_ms']:.2f}",
                f"{row['distributed_ms']:.2f}",
                f"{row['ratio_of_medians']:.3f}",
                harness.paired_ratio_cell(row),
            ]
            for row in rows
        ),
        align="lrrrrrl",
    )


def plot_multi_worker(plt, results, path):
    labels, ratios = [], []
    for version, result in results.items():
        for steps in result["launches"][0]:
            paired = [
                d / k
                for run in result["launches"]
                for k, d in zip(run[steps][REFERENCE], run[steps][DISTRIBUTED])
            ]
            labels.append(f"{version}\nsteps_per_execution={steps}")
            ratios.append(paired)
    figure, axis = plt.subplots(figsize=(1.9 * len(ratios) + 1.5, 4.0))
    axis.boxplot(ratios, showfliers=False)
    axis.set_xticks(range(1, len(ratios) + 1), labels, fontsize=7)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_ylabel(f"{DISTRIBUTED} / {REFERENCE}, per call")
    axis.grid(axis="y", alpha=0.3)
    axis.set_title("Step time under MultiWorkerMirroredStrategy (lower is better)")
    return harness.save_figure(figure, path)


def run_workers(args, report):
    results = run_multi_worker(args)
    rows = summarize_multi_worker(results)
    print(markdown_table_multi_worker(rows))
    fields = {
        "setup": {
            "steps": args.steps,
            "rounds": args.rounds,
            "launches": args.launches,
            "global_batch_size": args.batch_size,
            "steps_per_execution": args.steps_per_execution,
            "input_shape": [IMAGE_SIZE, IMAGE_SIZE, 1],
            "model": "Conv2D(32)-Conv2D(64)-MaxPool-Dense(128)-Dense(10)",
            "optimizer": "Adam(1e-3)",
            "metrics": ["accuracy"],
            "reference": (
                "stock keras.Model.train_step through strategy.run in a "
                "tf.function, logs left on each worker (no log collective)"
            ),
        },
        "results": results,
        "summary": rows,
    }
    # Only where --plot says: every plot in docs/benchmarks is in its index.
    report.plot, report.png = (plot if args.plot else None), args.plot
    report.write(fields, workers=args.workers)


def run(args, report):
    if args.workers:
        return run_workers(args, report)
    tf, keras, keras_dist = harness.import_stack(NUM_LOGICAL_CPUS)
    import numpy as np

    x, y = make_data(np)
    results = {}
    for strategy_name in args.strategies:
        results[strategy_name] = run_strategy(
            tf, keras, keras_dist, strategy_name, args, x, y
        )
    rows = summarize(results)
    print(markdown_table(rows))
    fields = {
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
    }
    report.write(fields, logical_cpu_devices=NUM_LOGICAL_CPUS)


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot, job=run_worker))
