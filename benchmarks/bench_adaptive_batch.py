"""Adaptive batch growth (`AutoScaleBatch(adaptive=True)`) on scikit-learn digits.

Trains the same MLP on the same split of scikit-learn's digits (1,797 8x8
images; 80% train, 20% test, stratified) with `keras_dist.DistributedModel`
under a `MirroredStrategy` over two logical CPU devices, three ways:

- `fixed-small`: global batch 16 (8 per replica), SGD with momentum at the
  learning rate tuned for it;
- `fixed-large`: global batch `--max-batch` through accumulation steps, the
  rate scaled from batch 16 by `--lr-scaling` with a warmup;
- `adaptive`: starts at 16 and grows toward the measured gradient noise scale
  up to `--max-batch`, the rate following the same rule.

The two fixed runs also measure the noise scale (adaptive mode with
`max_batch_size` equal to their batch: measured, never grown). For each run
and epoch it records the test accuracy, the optimizer updates so far and the
wall time, and reports the updates each run needs to reach the accuracy of
`fixed-small`: the mean test accuracy of its last `--window` epochs. A run
reaches it at the first epoch where the mean of its own last `--window`
epochs does (test accuracy on 360 examples moves by a few 0.1% from epoch
to epoch; single epochs would make the comparison a lottery).

Usage:

    python benchmarks/bench_adaptive_batch.py [--epochs N] [--seeds S ...]
        [--out docs/benchmarks/adaptive_batch.json]

Prints a markdown table; writes the per-epoch records, the noise-scale
measurements, the environment and the command to the JSON file, and a plot
next to it (same name, `.png`) when matplotlib is importable. `--summarize
JSON` recomputes the summary, table and plot of an earlier run in place;
`--replot JSON` redraws only the plot.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import _harness as harness

NUM_LOGICAL_CPUS = 2
PER_REPLICA_BATCH = 8
BASE_BATCH = PER_REPLICA_BATCH * NUM_LOGICAL_CPUS
RUNS = ("fixed-small", "fixed-large", "adaptive")


def parse_args(argv=None):
    parser = harness.parser(
        "Optimizer updates, wall time and accuracy of fixed-small, "
        "fixed-large and adaptive batch training on digits, 2 replicas.",
        "adaptive_batch.json",
        epochs=(40, "Epochs per run."),
        seeds=([0, 1, 2], "Seeds to run."),
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=256,
        help="Global batch of fixed-large, and the cap of adaptive.",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=0.05,
        help="SGD learning rate for the base global batch of 16.",
    )
    parser.add_argument(
        "--lr-scaling",
        choices=("linear", "sqrt", "none"),
        default="sqrt",
        help="How the rate follows the batch in fixed-large and adaptive.",
    )
    parser.add_argument(
        "--warmup-epochs", type=float, default=2, help="Warmup of the scaled rate."
    )
    parser.add_argument(
        "--adapt-every", type=int, default=10, help="Updates between decisions."
    )
    parser.add_argument(
        "--window",
        type=int,
        default=3,
        help="Epochs averaged for the target and for reaching it.",
    )
    parser.add_argument(
        "--summarize",
        metavar="JSON",
        help=(
            "Do not train: recompute the summary, table and plot of a JSON file "
            "written by an earlier run (in place)."
        ),
    )
    return parser.parse_args(argv)


def load_digits(np):
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    x, y = sklearn_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    y = y.astype("int32")
    return train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)


def build(keras, keras_dist, strategy, run, seed, args):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(128, activation="relu")(inputs)
        hidden = keras.layers.Dense(64, activation="relu")(hidden)
        outputs = keras.layers.Dense(10)(hidden)
        model = keras_dist.DistributedModel(inputs, outputs)
        steps = args.max_batch // BASE_BATCH if run == "fixed-large" else 1
        model.compile(
            optimizer=keras_dist.GradientAccumulationOptimizer(
                keras.optimizers.SGD(args.learning_rate, momentum=0.9),
                accumulation_steps=steps,
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    scaling = None if args.lr_scaling == "none" else args.lr_scaling
    callback = keras_dist.callbacks.AutoScaleBatch(
        PER_REPLICA_BATCH,
        base_batch_size=BASE_BATCH,
        lr_scaling=scaling,
        warmup_epochs=args.warmup_epochs if run == "fixed-large" and scaling else 0,
        adaptive=True,
        max_batch_size=BASE_BATCH * steps if run != "adaptive" else args.max_batch,
        adapt_every=args.adapt_every,
    )
    return model, callback


class EpochRecorder:
    """Test accuracy, updates and time at the end of every epoch."""

    def __init__(self, keras, x_test, y_test):
        recorder = self

        class Callback(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                recorder.started = time.perf_counter()
                recorder.train_seconds = 0.0
                recorder.epochs = []

            def on_epoch_begin(self, epoch, logs=None):
                recorder.epoch_started = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                recorder.train_seconds += time.perf_counter() - recorder.epoch_started
                results = self.model.evaluate(
                    x_test, y_test, verbose=0, return_dict=True
                )
                recorder.epochs.append(
                    {
                        "epoch": epoch + 1,
                        "updates": int(self.model.optimizer.iterations.numpy()),
                        "train_seconds": recorder.train_seconds,
                        "test_accuracy": float(results["accuracy"]),
                        "train_loss": float(logs["loss"]),
                        "batch_size": int(logs["batch_size"]),
                        "learning_rate": float(logs["learning_rate"]),
                        "noise_scale": float(logs["noise_scale"]),
                    }
                )

        self.callback = Callback()


def train(keras, keras_dist, strategy, data, run, seed, args):
    x_train, x_test, y_train, y_test = data
    model, autoscale = build(keras, keras_dist, strategy, run, seed, args)
    recorder = EpochRecorder(keras, x_test, y_test)
    # DistributedModel batches the arrays at 8 x 2 (AutoScaleBatch).
    model.fit(
        x_train,
        y_train,
        epochs=args.epochs,
        callbacks=[autoscale, recorder.callback],
        verbose=0,
    )
    return {
        "run": run,
        "seed": seed,
        "epochs": recorder.epochs,
        "measurements": [
            {
                "update": m.update,
                "samples": m.samples,
                "noise_scale": m.noise_scale,
                "batch_size": m.batch_size,
            }
            for m in autoscale.measurements
        ],
    }


def trailing_mean(epochs, index, window):
    values = [
        e["test_accuracy"] for e in epochs[max(0, index - window + 1) : index + 1]
    ]
    return sum(values) / len(values)


def updates_to_reach(epochs, target, window):
    for index, record in enumerate(epochs):
        if index + 1 >= window and trailing_mean(epochs, index, window) >= target:
            return record["updates"], record["train_seconds"], record["epoch"]
    return None, None, None


def summarize(results, window, tolerances):
    """Per run: medians over seeds, and per seed, of the final accuracy and of
    the updates and epochs to reach each target (fixed-small's accuracy less a
    tolerance)."""
    rows = []
    by_seed = {}
    for result in results:
        by_seed.setdefault(result["seed"], {})[result["run"]] = result
    for run in RUNS:
        per_seed = []
        for runs in by_seed.values():
            small = runs["fixed-small"]["epochs"]
            reference = trailing_mean(small, len(small) - 1, window)
            epochs = runs[run]["epochs"]
            last = epochs[-1]
            record = {
                "target": reference,
                "final_accuracy": trailing_mean(epochs, len(epochs) - 1, window),
                "final_updates": last["updates"],
                "train_seconds": last["train_seconds"],
                "final_batch": last["batch_size"],
            }
            for name, tolerance in tolerances.items():
                updates, seconds, epoch = updates_to_reach(
                    epochs, reference - tolerance - 1e-9, window
                )
                record[f"updates_to_{name}"] = updates
                record[f"epochs_to_{name}"] = epoch
                record[f"seconds_to_{name}"] = seconds
            per_seed.append(record)

        def median(key, rows=per_seed):
            values = [r[key] for r in rows if r[key] is not None]
            return statistics.median(values) if values else None

        row = {"run": run, "seeds": len(per_seed)}
        for key in per_seed[0]:
            row[key] = median(key)
        for name in tolerances:
            row[f"reached_{name}"] = sum(
                r[f"updates_to_{name}"] is not None for r in per_seed
            )
        row["per_seed"] = per_seed
        rows.append(row)
    return rows


def markdown_table(rows, epochs, window, tolerances):
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    header = ["run", "final batch", f"test acc. (mean of last {window} epochs)"]
    header += [f"updates ({epochs} epochs)", f"train s ({epochs} epochs)"]
    for name in tolerances:
        label = name.replace("_", " ")
        header += [f"reached ({label})", f"updates to target ({label})"]
        header += [f"epochs to target ({label})"]
    cells = []
    for row in rows:
        line = [
            row["run"],
            fmt(row["final_batch"], ".0f"),
            fmt(row["final_accuracy"], ".4f"),
            fmt(row["final_updates"], ".0f"),
            fmt(row["train_seconds"], ".1f"),
        ]
        for name in tolerances:
            line += [
                f"{row[f'reached_{name}']}/{row['seeds']}",
                fmt(row[f"updates_to_{name}"], ".0f"),
                fmt(row[f"epochs_to_{name}"], ".0f"),
            ]
        cells.append(line)
    return harness.table(header, cells)


def plot(plt, report, path):
    results = report["results"]
    seed = results[0]["seed"]
    runs = {r["run"]: r for r in results if r["seed"] == seed}
    colors = {
        "fixed-small": "tab:blue",
        "fixed-large": "tab:orange",
        "adaptive": "tab:green",
    }
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for run, result in runs.items():
        epochs = result["epochs"]
        axes[0].plot(
            [e["updates"] for e in epochs],
            [e["test_accuracy"] for e in epochs],
            label=run,
            color=colors[run],
        )
        samples = [m["samples"] for m in result["measurements"]]
        axes[1].plot(
            samples,
            [m["noise_scale"] for m in result["measurements"]],
            label=f"{run}: noise scale",
            color=colors[run],
        )
        axes[2].plot(
            [e["epoch"] for e in epochs],
            [e["test_accuracy"] for e in epochs],
            label=run,
            color=colors[run],
        )
    adaptive = runs["adaptive"]["measurements"]
    axes[1].step(
        [m["samples"] for m in adaptive],
        [m["batch_size"] for m in adaptive],
        where="post",
        label="adaptive: global batch",
        color="black",
        linestyle="--",
    )
    axes[0].set_xscale("log")
    axes[0].set_xlabel("optimizer updates")
    axes[0].set_ylabel("test accuracy")
    axes[0].set_ylim(0.85, 1.0)
    axes[0].set_title("accuracy vs optimizer updates")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("training examples seen")
    axes[1].set_ylabel("examples")
    axes[1].set_title("noise scale B_simple and adaptive batch size")
    axes[2].set_xlabel("epoch")
    axes[2].set_ylim(0.85, 1.0)
    axes[2].set_title("accuracy vs epochs (data seen)")
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(f"digits, MLP, 2 replicas x 8 per replica, seed {seed}")
    return harness.save_figure(fig, path)


def target_tolerances(test_examples):
    # Test accuracy moves in steps of one example (1/360 here).
    return {"exact": 0.0, "one_example": 1.0 / test_examples}


def resummarize(path):
    with open(path) as f:
        report = json.load(f)
    setup = report["setup"]
    tolerances = target_tolerances(setup["test_examples"])
    report["summary"] = summarize(report["results"], setup["window"], tolerances)
    report["summary_command"] = harness.command()
    print(
        markdown_table(report["summary"], setup["epochs"], setup["window"], tolerances)
    )
    report["plot"] = harness.draw(plot, report, harness.plot_path(path))
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nRewrote {path}")


def run(args, report):
    if args.summarize:
        return resummarize(args.summarize)
    tf, keras, keras_dist = harness.import_stack(NUM_LOGICAL_CPUS)
    import numpy as np

    data = load_digits(np)
    strategy = tf.distribute.MirroredStrategy(
        [f"/cpu:{i}" for i in range(NUM_LOGICAL_CPUS)],
        cross_device_ops=tf.distribute.ReductionToOneDevice(),
    )
    results = []
    for seed in args.seeds:
        for name in RUNS:
            result = train(keras, keras_dist, strategy, data, name, seed, args)
            last = result["epochs"][-1]
            print(
                f"seed {seed} {name}: accuracy {last['test_accuracy']:.4f}, "
                f"{last['updates']} updates, batch {last['batch_size']}, "
                f"{last['train_seconds']:.1f} s",
                file=sys.stderr,
            )
            results.append(result)
    tolerances = target_tolerances(len(data[3]))
    rows = summarize(results, args.window, tolerances)
    print(markdown_table(rows, args.epochs, args.window, tolerances))

    fields = {
        "setup": {
            "data": "sklearn load_digits, x / 16, 80/20 stratified split (seed 0)",
            "model": "Dense(128, relu)-Dense(64, relu)-Dense(10)",
            "optimizer": f"SGD({args.learning_rate}, momentum=0.9) at batch 16",
            "per_replica_batch": PER_REPLICA_BATCH,
            "replicas": NUM_LOGICAL_CPUS,
            "max_batch": args.max_batch,
            "lr_scaling": args.lr_scaling,
            "warmup_epochs_fixed_large": args.warmup_epochs,
            "adapt_every": args.adapt_every,
            "epochs": args.epochs,
            "seeds": args.seeds,
            "target": "mean test accuracy of fixed-small's last `window` epochs "
            "(same seed); reached at the first epoch whose trailing mean of "
            "`window` epochs is >= it",
            "window": args.window,
            "test_examples": len(data[3]),
        },
        "results": results,
        "summary": rows,
    }
    report.write(fields, logical_cpu_devices=NUM_LOGICAL_CPUS)


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot))
