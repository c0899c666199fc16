"""Micro-step time vs update-step time of `GradientAccumulationOptimizer`.

On a `MirroredStrategy` over two logical CPU devices, trains the same model
(small CNN with a 1M-parameter dense layer, so that reducing and applying the
gradients is a visible part of a step) as two `keras_dist.DistributedModel`s
with the same weights, data and per-replica batch:

- `accumulation`: `GradientAccumulationOptimizer(Adam, k)`. A *micro-step*
  adds each replica's gradients into replica-local accumulators (no gradient
  all-reduce); every k-th call is an *update step* that also all-reduces the
  accumulated gradients and applies Adam once.
- `plain`: `Adam`; every step all-reduces and applies.

`--optimizer sgd` uses SGD in both instead, whose apply costs almost nothing,
so that the update step's extra time is mostly the all-reduce.

Each call of `model.train_function(iterator)` (`steps_per_execution=1`) is
timed on its own with `time.perf_counter`, up to reading the loss (which waits
for the step), and the two models are called alternately, call by call, so a
shared machine's changing load hits both alike. A call of the accumulation
model is an update step when the optimizer's `iterations` (the number of
updates) advanced during it; this is read outside the timed region.

Reported: medians of plain steps, micro-steps and update steps; the ratio of
each to the plain step (ratio of medians, and the median of paired ratios
between adjacent calls); and the amortised cost per micro-batch of
accumulation, `((k - 1) * micro + update) / k`.

Usage:

    python benchmarks/bench_accumulation_steps.py [--micro-batch 32]
        [--accumulation-steps 4] [--updates 25] [--rounds 5] [--optimizer adam]
        [--out docs/benchmarks/accumulation_steps.json]

Prints a markdown table; writes the raw timings, the environment and the
command to the JSON file, and a plot next to it (same name, `.png`) when
matplotlib is importable (`--replot JSON` redraws it). Creates logical CPU
devices, so it must run in its own process.
"""

from __future__ import annotations

import statistics
import sys
import time

import _harness as harness

NUM_LOGICAL_CPUS = 2
IMAGE_SIZE = 16
NUM_CLASSES = 10
NUM_EXAMPLES = 4096
DENSE_UNITS = 256
WARMUP_UPDATES = 3
KINDS = ("plain", "micro", "update")
OPTIMIZERS = {"adam": "Adam", "sgd": "SGD"}


def parse_args(argv=None):
    parser = harness.parser(
        "Time of GradientAccumulationOptimizer micro-steps (no all-reduce) "
        "vs update steps (all-reduce + apply) vs plain DistributedModel "
        "steps, on MirroredStrategy over 2 logical CPUs.",
        "accumulation_steps.json",
        rounds=(5, "Rounds."),
    )
    parser.add_argument(
        "--micro-batch",
        type=harness.positive_int,
        default=32,
        help="Per-replica batch size (global batch = 2x).",
    )
    parser.add_argument(
        "--accumulation-steps", type=int, default=4, help="Micro-steps per update k."
    )
    parser.add_argument(
        "--updates",
        type=harness.positive_int,
        default=25,
        help="Updates per round (k calls each, and as many plain calls).",
    )
    parser.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="adam",
        help="Inner optimizer of both models (sgd: near-free apply).",
    )
    args = parser.parse_args(argv)
    if args.accumulation_steps < 2:
        parser.error(
            "--accumulation-steps must be >= 2 (1 has no micro-steps). "
            f"Received: {args.accumulation_steps}."
        )
    return args


def make_data(np):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_EXAMPLES, IMAGE_SIZE, IMAGE_SIZE, 3)).astype("float32")
    weights = rng.normal(size=(IMAGE_SIZE * IMAGE_SIZE * 3, NUM_CLASSES))
    y = np.argmax(x.reshape(NUM_EXAMPLES, -1) @ weights, axis=1).astype("int32")
    return x, y


def build_model(keras, keras_dist, optimizer):
    """Conv 32 -> pool -> conv 64 -> flatten -> dense 256 -> dense 10."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((IMAGE_SIZE, IMAGE_SIZE, 3))
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(DENSE_UNITS, activation="relu")(x)
    outputs = keras.layers.Dense(NUM_CLASSES)(x)
    model = keras_dist.DistributedModel(inputs, outputs)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    optimizer.build(model.trainable_variables)
    return model


def timed_call(model, iterator):
    """Seconds for one train_function call, and whether it applied an update."""
    before = int(model.optimizer.iterations.numpy())
    start = time.perf_counter()
    logs = model.train_function(iterator)
    # Reading a value waits for the step, whatever the runtime queued.
    logs["loss"].numpy()
    elapsed = time.perf_counter() - start
    return elapsed, int(model.optimizer.iterations.numpy()) > before


def make_optimizer(keras, name):
    return getattr(keras.optimizers, OPTIMIZERS[name])(1e-3)


def measure(tf, keras, keras_dist, args, x, y):
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices)
    k = args.accumulation_steps
    global_batch = args.micro_batch * strategy.num_replicas_in_sync
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .repeat()
        .batch(global_batch, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )
    with strategy.scope():
        models = {
            "accumulation": build_model(
                keras,
                keras_dist,
                keras_dist.GradientAccumulationOptimizer(
                    make_optimizer(keras, args.optimizer), accumulation_steps=k
                ),
            ),
            "plain": build_model(
                keras, keras_dist, make_optimizer(keras, args.optimizer)
            ),
        }
    models["plain"].set_weights(models["accumulation"].get_weights())
    iterators = {
        name: iter(strategy.experimental_distribute_dataset(dataset)) for name in models
    }
    for name, model in models.items():
        model.make_train_function()
        for _ in range(WARMUP_UPDATES * k):
            timed_call(model, iterators[name])

    calls = {"accumulation": [], "plain": []}
    for round_index in range(args.rounds):
        order = harness.alternate(("accumulation", "plain"), round_index)
        for _ in range(args.updates * k):
            for name in order:
                seconds, updated = timed_call(models[name], iterators[name])
                calls[name].append(
                    {"round": round_index, "seconds": seconds, "updated": updated}
                )
        recent = calls["accumulation"][-args.updates * k :]
        print(
            f"  round {round_index + 1}/{args.rounds}: median ms "
            f"plain {1e3 * statistics.median(c['seconds'] for c in calls['plain']):.2f}"
            f", micro {1e3 * _median(recent, False):.2f}"
            f", update {1e3 * _median(recent, True):.2f}",
            file=sys.stderr,
        )
    accumulation = models["accumulation"]
    return {
        "num_replicas": strategy.num_replicas_in_sync,
        "parameters": accumulation.count_params(),
        "updates_applied": {
            name: int(model.optimizer.iterations.numpy())
            for name, model in models.items()
        },
        "micro_steps_counted": int(accumulation.optimizer.micro_steps.numpy()),
        "calls": calls,
    }


def _median(calls, updated):
    values = [c["seconds"] for c in calls if c["updated"] == updated]
    return statistics.median(values) if values else float("nan")


def summarize(result, k):
    accumulation = result["calls"]["accumulation"]
    plain = result["calls"]["plain"]
    seconds = {
        "plain": [c["seconds"] for c in plain],
        "micro": [c["seconds"] for c in accumulation if not c["updated"]],
        "update": [c["seconds"] for c in accumulation if c["updated"]],
    }
    # Calls i of both models ran back to back: pair them by index.
    paired = {
        "micro": [
            a["seconds"] / p["seconds"]
            for a, p in zip(accumulation, plain)
            if not a["updated"]
        ],
        "update": [
            a["seconds"] / p["seconds"]
            for a, p in zip(accumulation, plain)
            if a["updated"]
        ],
    }
    medians = {kind: statistics.median(seconds[kind]) for kind in KINDS}
    rows = []
    for kind in KINDS:
        row = {
            "kind": kind,
            "calls": len(seconds[kind]),
            "median_ms": medians[kind] * 1e3,
            "ratio_to_plain": medians[kind] / medians["plain"],
        }
        if kind in paired:
            q1, q2, q3 = harness.quartiles(paired[kind])
            row.update(paired_ratio_median=q2, paired_ratio_q1=q1, paired_ratio_q3=q3)
        rows.append(row)
    amortised = ((k - 1) * medians["micro"] + medians["update"]) / k
    total_ratio = sum(c["seconds"] for c in accumulation) / sum(
        c["seconds"] for c in plain
    )
    update_positions = [i for i, c in enumerate(accumulation) if c["updated"]]
    return {
        "rows": rows,
        "amortised_ms_per_micro_batch": amortised * 1e3,
        "amortised_ratio_to_plain": amortised / medians["plain"],
        "total_time_ratio": total_ratio,
        "update_minus_micro_ms": (medians["update"] - medians["micro"]) * 1e3,
        "plain_minus_micro_ms": (medians["plain"] - medians["micro"]) * 1e3,
        # Every k-th call must be an update: a check of the optimizer itself.
        "updates_every_k_calls": all((i + 1) % k == 0 for i in update_positions)
        and len(update_positions) == len(accumulation) // k,
    }


def markdown_table(summary, k, micro_batch):
    labels = {
        "plain": "plain step (all-reduce + apply every step)",
        "micro": "accumulation micro-step (no all-reduce)",
        "update": "accumulation update step (all-reduce + apply)",
    }
    cells = [
        [
            labels[row["kind"]],
            row["calls"],
            f"{row['median_ms']:.2f}",
            f"{row['ratio_to_plain']:.3f}",
            harness.paired_ratio_cell(row) if "paired_ratio_median" in row else "1",
        ]
        for row in summary["rows"]
    ]
    cells.append(
        [
            "accumulation, amortised per micro-batch ((k-1) micro + update) / k, "
            f"k={k}",
            "",
            f"{summary['amortised_ms_per_micro_batch']:.2f}",
            f"{summary['amortised_ratio_to_plain']:.3f}",
            "",
        ]
    )
    total = f"{summary['total_time_ratio']:.3f}"
    cells.append(["accumulation / plain, total time of all calls", "", "", total, ""])
    header = ["step", "calls", "median ms", "ratio of medians to plain"]
    header += ["paired ratio median [IQR]"]
    lines = [harness.table(header, cells, align="lrrrl"), ""]
    lines.append(
        f"Per-replica batch {micro_batch}, 2 replicas. Update step - micro-step: "
        f"{summary['update_minus_micro_ms']:.2f} ms; plain step - micro-step: "
        f"{summary['plain_minus_micro_ms']:.2f} ms. Updates exactly every "
        f"{k}th call: {summary['updates_every_k_calls']}."
    )
    return "\n".join(lines)


def plot(plt, report, path):
    result, k = report["results"], report["setup"]["accumulation_steps"]
    # "Adam(1e-3), wrapped for accumulation": the inner optimizer's class.
    optimizer = report["setup"]["optimizer"].split("(")[0]
    accumulation = result["calls"]["accumulation"]
    plain = result["calls"]["plain"]
    data = [
        [c["seconds"] * 1e3 for c in plain],
        [c["seconds"] * 1e3 for c in accumulation if not c["updated"]],
        [c["seconds"] * 1e3 for c in accumulation if c["updated"]],
    ]
    figure, axes = plt.subplots(
        1, 2, figsize=(11, 4.0), gridspec_kw={"width_ratios": [1, 2]}
    )
    axis = axes[0]
    axis.boxplot(data, showfliers=False)
    axis.set_xticks([1, 2, 3], ["plain\nstep", "micro-step", "update\nstep"])
    axis.set_ylabel("ms per call")
    axis.set_ylim(bottom=0)
    axis.grid(axis="y", alpha=0.3)
    axis.set_title("all rounds (no outliers shown)", fontsize=9)

    axis = axes[1]
    window = slice(0, min(len(accumulation), 12 * k))
    indices = range(len(accumulation))[window]
    axis.plot(
        indices,
        [c["seconds"] * 1e3 for c in plain[window]],
        color="tab:gray",
        marker=".",
        label="plain step",
    )
    axis.plot(
        indices,
        [c["seconds"] * 1e3 for c in accumulation[window]],
        color="tab:blue",
        marker=".",
        label="accumulation call",
    )
    updates = [i for i in indices if accumulation[i]["updated"]]
    axis.scatter(
        updates,
        [accumulation[i]["seconds"] * 1e3 for i in updates],
        color="tab:red",
        zorder=3,
        label="update step",
    )
    axis.set_xlabel(
        f"call index (first {len(indices)} calls), the models interleaved call by call"
    )
    axis.set_ylabel("ms")
    axis.set_ylim(bottom=0)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.suptitle(
        f"GradientAccumulationOptimizer({optimizer}) on MirroredStrategy, "
        f"2 logical CPUs, k={k}"
    )
    return harness.save_figure(figure, path)


def run(args, report):
    tf, keras, keras_dist = harness.import_stack(NUM_LOGICAL_CPUS)
    import numpy as np

    x, y = make_data(np)
    result = measure(tf, keras, keras_dist, args, x, y)
    summary = summarize(result, args.accumulation_steps)
    print(markdown_table(summary, args.accumulation_steps, args.micro_batch))
    fields = {
        "setup": {
            "micro_batch_per_replica": args.micro_batch,
            "global_batch_per_call": args.micro_batch * NUM_LOGICAL_CPUS,
            "accumulation_steps": args.accumulation_steps,
            "updates_per_round": args.updates,
            "rounds": args.rounds,
            "warmup_updates": WARMUP_UPDATES,
            "input_shape": [IMAGE_SIZE, IMAGE_SIZE, 3],
            "model": (
                f"DistributedModel: Conv2D(32)-MaxPool-Conv2D(64)-Flatten-"
                f"Dense({DENSE_UNITS})-Dense({NUM_CLASSES})"
            ),
            "parameters": result["parameters"],
            "optimizer": f"{OPTIMIZERS[args.optimizer]}(1e-3), wrapped for "
            "accumulation",
            "strategy": "MirroredStrategy over 2 logical CPU devices",
            "steps_per_execution": 1,
        },
        "results": result,
        "summary": summary,
    }
    report.write(fields, logical_cpu_devices=NUM_LOGICAL_CPUS)


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot))
