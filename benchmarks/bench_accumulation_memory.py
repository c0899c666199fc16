"""Peak memory of gradient accumulation against one step of the big batch.

`keras_dist.GradientAccumulationOptimizer` lets `k` micro-steps of batch `b`
stand in for one step of batch `k * b`. This script checks the memory side of
that promise on CPU: it trains the same activation-heavy CNN (five Conv2D
layers on 64x64x3 synthetic images, 75k parameters, so activations dominate)
as a `keras_dist.DistributedModel` under the default strategy, in three
configurations:

- `big batch`: plain Adam, batch `k * b`, one update per step;
- `accumulation`: `GradientAccumulationOptimizer(Adam, k)`, micro-batch `b`;
- `micro-batch`: plain Adam, batch `b` (what accumulation should cost).

Each configuration processes the same examples (`--updates` updates of
`k * b` examples) in its own fresh subprocess, because peak RSS only ever
grows within a process. In the child:

1. build and compile the model, build the optimizer;
2. run one warm-up step of batch 1 that traces the train function (the
   dataset's batch dimension is unknown, so the real batches reuse that
   trace; a Python counter in the loss checks it);
3. read `VmRSS` (the *baseline*: model, optimizer, traced graph, data), reset
   the peak (`echo 5 > /proc/self/clear_refs`), train, and read `VmHWM` after
   every step.

"Above baseline" is therefore the memory that training steps add: activations
and their gradients, kernel workspaces, and whatever the allocator keeps. The
configurations run interleaved (`--repeats` rounds, order rotated) and the
table reports medians. `--sweep-batches` adds plain steps of other batch
sizes, to plot memory against batch size.

TensorFlow's CPU allocator in this build is glibc `malloc` (oneDNN is off, so
TensorFlow does not pick its BFC-backed `MklCPUAllocator`). glibc serves
blocks above its mmap threshold with `mmap` and unmaps them on free, but
raises that threshold to the size of each freed block (up to 32 MiB), after
which blocks are carved from arenas it does not return to the system.
`--allocators mmap64k` runs every configuration with
`MALLOC_MMAP_THRESHOLD_=65536` instead, which fixes the threshold so that RSS
follows live tensor memory closely (each child takes ~30 s on a loaded 2-core
machine, so the two settings are two runs).

Usage:

    python benchmarks/bench_accumulation_memory.py [--micro-batch 16]
        [--accumulation-steps 8] [--updates 2] [--repeats 3]
        [--allocators default|mmap64k ...] [--sweep-batches B ...]
        [--out docs/benchmarks/accumulation_memory.json]

Prints a markdown table; writes the raw numbers, the environment and the
command to the JSON file, and a plot next to it (same name, `.png`) when
matplotlib is importable (`--replot JSON` redraws it). Linux only (reads
/proc/self/status).
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time

import _harness as harness

IMAGE_SIZE = 64
NUM_CLASSES = 10
NUM_EXAMPLES = 256
FULL_RESOLUTION_CHANNELS = (32, 32, 32)
HALF_RESOLUTION_CHANNELS = (64, 64)
MAIN_CONFIGS = ("big batch", "accumulation", "micro-batch")
ALLOCATORS = {
    "default": {},
    # A fixed threshold turns off glibc's dynamic threshold: every block above
    # 64 KiB is mmapped and returned to the system when freed.
    "mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536"},
}
MIB = 1024 * 1024


def parse_args(argv=None):
    parser = harness.parser(
        "Peak RSS of training with GradientAccumulationOptimizer "
        "(micro-batch b, k steps) vs one step of batch k*b.",
        "accumulation_memory.json",
        jobs=True,
    )
    parser.add_argument(
        "--micro-batch",
        type=harness.positive_int,
        default=16,
        help="Micro-batch size b.",
    )
    parser.add_argument(
        "--accumulation-steps",
        type=int,
        default=8,
        help="Micro-steps per update k; the big batch is k*b.",
    )
    parser.add_argument(
        "--updates",
        type=harness.positive_int,
        default=2,
        help="Updates per run (each k*b examples), after the warm-up step.",
    )
    parser.add_argument(
        "--repeats",
        type=harness.positive_int,
        default=3,
        help="Fresh processes per configuration and allocator setting.",
    )
    parser.add_argument(
        "--allocators",
        nargs="+",
        choices=sorted(ALLOCATORS),
        default=["default"],
        help=(
            "glibc settings to run: `default`, and/or `mmap64k` "
            "(MALLOC_MMAP_THRESHOLD_=65536). Defaults to `default`."
        ),
    )
    parser.add_argument(
        "--sweep-batches",
        type=harness.positive_int,
        nargs="*",
        default=[],
        help=(
            "Extra plain batch sizes to run (same number of examples), to "
            "plot memory against batch size."
        ),
    )
    args = parser.parse_args(argv)
    if args.accumulation_steps < 2:
        parser.error(
            "--accumulation-steps must be >= 2 (1 is no accumulation). "
            f"Received: {args.accumulation_steps}."
        )
    return args


# --- Child process: one configuration -------------------------------------


def read_status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field} line.")


def reset_peak_rss():
    # Linux >= 4.0: resets VmHWM (and ru_maxrss) to the current RSS.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build_model(keras, keras_dist):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((IMAGE_SIZE, IMAGE_SIZE, 3))
    x = inputs
    for channels in FULL_RESOLUTION_CHANNELS:
        x = keras.layers.Conv2D(channels, 3, padding="same", activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    for channels in HALF_RESOLUTION_CHANNELS:
        x = keras.layers.Conv2D(channels, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(NUM_CLASSES)(x)
    model = keras_dist.DistributedModel(inputs, outputs)
    return model


def layer_output_bytes_per_example(model):
    """Sum of every layer's float32 output size for one example."""
    total = 0
    for layer in model.layers:
        shape = layer.output.shape[1:]
        size = 1
        for dim in shape:
            size *= dim
        total += size * 4
    return total


def child_main(spec):
    import resource

    tf, keras, keras_dist = harness.import_stack()
    import numpy as np

    rss_after_import = read_status_mib("VmRSS")
    traces = []

    def counting_loss(y_true, y_pred):
        traces.append(1)  # Python side effect: runs only while tracing.
        return keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True
        )

    accumulate = spec["accumulation_steps"] > 1
    optimizer = keras.optimizers.Adam(1e-3)
    if accumulate:
        optimizer = keras_dist.GradientAccumulationOptimizer(
            optimizer, accumulation_steps=spec["accumulation_steps"]
        )

    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_EXAMPLES, IMAGE_SIZE, IMAGE_SIZE, 3)).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=NUM_EXAMPLES).astype("int32")

    def dataset(batch):
        # No drop_remainder: the batch dimension stays unknown, so the batch-1
        # warm-up trace serves every batch size.
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)

    model = build_model(keras, keras_dist)
    model.compile(optimizer=optimizer, loss=counting_loss)
    optimizer.build(model.trainable_variables)
    train_function = model.make_train_function()
    rss_after_build = read_status_mib("VmRSS")

    train_function(iter(dataset(1)))["loss"].numpy()
    if accumulate:
        optimizer.reset_accumulation()
    updates_before = int(optimizer.iterations.numpy())
    baseline = read_status_mib("VmRSS")
    peak_through_warmup = read_status_mib("VmHWM")
    reset_peak_rss()

    iterator = iter(dataset(spec["batch_size"]))
    peak_after_step = []
    started = time.perf_counter()
    for _ in range(spec["steps"]):
        train_function(iterator)["loss"].numpy()
        peak_after_step.append(read_status_mib("VmHWM"))
    train_seconds = time.perf_counter() - started

    result = {
        **spec,
        "updates_applied": int(optimizer.iterations.numpy()) - updates_before,
        "traces": len(traces),
        "rss_after_import_mib": rss_after_import,
        "rss_after_build_mib": rss_after_build,
        "baseline_rss_mib": baseline,
        "peak_rss_through_warmup_mib": peak_through_warmup,
        "peak_rss_mib": peak_after_step[-1],
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_above_baseline_mib": peak_after_step[-1] - baseline,
        "peak_above_baseline_after_step_mib": [p - baseline for p in peak_after_step],
        "train_seconds": train_seconds,
        "parameters": model.count_params(),
        "layer_output_mib_per_example": layer_output_bytes_per_example(model) / MIB,
        "versions": {
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "keras_dist": keras_dist.__version__,
            "numpy": np.__version__,
        },
    }
    del result["result"]
    harness.finish_job(spec, result)


# --- Parent process: schedule, summarise, report -----------------------------


def make_variants(args):
    """The configurations to run, each as the spec its child receives."""
    b, k, updates = args.micro_batch, args.accumulation_steps, args.updates
    variants = [
        {
            "config": "big batch",
            "batch_size": k * b,
            "accumulation_steps": 1,
            "steps": updates,
        },
        {
            "config": "accumulation",
            "batch_size": b,
            "accumulation_steps": k,
            "steps": k * updates,
        },
        {
            "config": "micro-batch",
            "batch_size": b,
            "accumulation_steps": 1,
            "steps": k * updates,
        },
    ]
    for batch in sorted(set(args.sweep_batches) - {b, k * b}):
        variants.append(
            {
                "config": f"batch {batch}",
                "batch_size": batch,
                "accumulation_steps": 1,
                # The same number of examples as the other configurations.
                "steps": max(1, -(-k * b * updates // batch)),
            }
        )
    return variants


def variant_label(variant):
    if variant["config"] == "accumulation":
        return (
            f"accumulation, {variant['accumulation_steps']} x batch "
            f"{variant['batch_size']}"
        )
    if variant["config"] == "big batch":
        return f"one step of batch {variant['batch_size']}"
    return f"plain, batch {variant['batch_size']}"


def batch_curve(points):
    """Peak above baseline per batch size, and the MiB each extra example adds.

    Args:
        points: (batch size, MiB) pairs of plain (non-accumulating) steps.

    Returns:
        Dict with the sorted points and the slope between neighbours.
    """
    points = sorted(points)
    return {
        "points": points,
        "marginal_mib_per_example": [
            {
                "from_batch": b0,
                "to_batch": b1,
                "mib_per_example": (m1 - m0) / (b1 - b0),
            }
            for (b0, m0), (b1, m1) in itertools.pairwise(points)
        ],
    }


def summarize(runs, variants, allocators):
    rows = []
    curves = {}
    for allocator in allocators:
        medians = {}
        for variant in variants:
            mine = [
                r
                for r in runs
                if r["allocator"] == allocator and r["config"] == variant["config"]
            ]
            medians[variant["config"]] = {
                key: statistics.median(r[key] for r in mine)
                for key in (
                    "baseline_rss_mib",
                    "peak_rss_mib",
                    "peak_above_baseline_mib",
                    "train_seconds",
                )
            }
            medians[variant["config"]]["runs"] = len(mine)
        big = medians["big batch"]
        for variant in variants:
            m = medians[variant["config"]]
            rows.append(
                {
                    "allocator": allocator,
                    **variant,
                    "label": variant_label(variant),
                    **m,
                    "above_baseline_vs_big_batch": m["peak_above_baseline_mib"]
                    / big["peak_above_baseline_mib"],
                    "peak_vs_big_batch": m["peak_rss_mib"] / big["peak_rss_mib"],
                }
            )
        plain = {
            v["batch_size"]: medians[v["config"]]["peak_above_baseline_mib"]
            for v in variants
            if v["accumulation_steps"] == 1
        }
        if len(plain) >= 3:
            curves[allocator] = batch_curve(plain.items())
    return rows, curves


def markdown_table(rows, curves):
    header = ["allocator", "configuration", "runs", "baseline RSS MiB"]
    header += ["peak RSS MiB", "peak above baseline MiB"]
    header += ["above-baseline / big batch", "peak / big batch", "train s"]
    cells = [
        [
            row["allocator"],
            row["label"],
            row["runs"],
            f"{row['baseline_rss_mib']:.0f}",
            f"{row['peak_rss_mib']:.0f}",
            f"{row['peak_above_baseline_mib']:.0f}",
            f"{row['above_baseline_vs_big_batch']:.2f}",
            f"{row['peak_vs_big_batch']:.2f}",
            f"{row['train_seconds']:.1f}",
        ]
        for row in rows
    ]
    lines = [harness.table(header, cells, align="llrrrrrrr")]
    for allocator, curve in curves.items():
        slopes = ", ".join(
            f"{m['from_batch']}->{m['to_batch']}: {m['mib_per_example']:.2f}"
            for m in curve["marginal_mib_per_example"]
        )
        lines.append("")
        lines.append(
            f"{allocator}: MiB per extra example between plain batch sizes: {slopes}."
        )
    return "\n".join(lines)


def plot(plt, report, path):
    runs, rows, curves = report["runs"], report["summary"], report["batch_curves"]
    allocators = list(report["setup"]["allocators"])
    colors = {"big batch": "tab:red", "accumulation": "tab:blue"}
    colors["micro-batch"] = "tab:gray"
    panels = 1 + len(allocators) + (1 if curves else 0)
    figure, axes = plt.subplots(1, panels, figsize=(4.4 * panels, 4.2))
    axis = axes[0]
    width = 0.8 / len(MAIN_CONFIGS)
    for index, config in enumerate(MAIN_CONFIGS):
        xs = [a + (index - 1) * width for a in range(len(allocators))]
        heights = [
            next(
                r["peak_above_baseline_mib"]
                for r in rows
                if r["allocator"] == a and r["config"] == config
            )
            for a in allocators
        ]
        label = next(r["label"] for r in rows if r["config"] == config)
        axis.bar(xs, heights, width, color=colors[config], label=label)
        for x, allocator in zip(xs, allocators):
            points = [
                r["peak_above_baseline_mib"]
                for r in runs
                if r["allocator"] == allocator and r["config"] == config
            ]
            axis.scatter([x] * len(points), points, color="black", s=8, zorder=3)
    axis.set_xticks(range(len(allocators)), [f"allocator: {a}" for a in allocators])
    axis.set_ylabel("peak RSS above post-trace baseline (MiB)")
    axis.set_title("medians; dots = runs (fresh processes)", fontsize=9)
    axis.legend(fontsize=8)
    axis.grid(axis="y", alpha=0.3)
    for axis, allocator in zip(axes[1 : 1 + len(allocators)], allocators):
        for config in MAIN_CONFIGS:
            mine = [
                r for r in runs if r["allocator"] == allocator and r["config"] == config
            ]
            for run_index, run in enumerate(mine):
                examples = [
                    (i + 1) * run["batch_size"]
                    for i in range(len(run["peak_above_baseline_after_step_mib"]))
                ]
                axis.plot(
                    examples,
                    run["peak_above_baseline_after_step_mib"],
                    color=colors[config],
                    marker="o",
                    markersize=3,
                    alpha=0.6,
                    label=config if run_index == 0 else None,
                )
        axis.set_xlabel("examples trained")
        axis.set_ylabel("peak RSS above baseline so far (MiB)")
        axis.set_title(f"allocator: {allocator}; one line per run", fontsize=9)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    if curves:
        axis = axes[-1]
        for allocator, curve in curves.items():
            line = axis.plot(
                [p[0] for p in curve["points"]],
                [p[1] for p in curve["points"]],
                "o-",
                label=f"{allocator}: plain steps",
            )[0]
            for r in rows:
                if r["allocator"] == allocator and r["config"] == "accumulation":
                    axis.scatter(
                        [r["batch_size"]],
                        [r["peak_above_baseline_mib"]],
                        marker="x",
                        s=70,
                        color=line.get_color(),
                        zorder=3,
                        label=f"{allocator}: {r['label']}",
                    )
        axis.set_xlabel("batch size of one step")
        axis.set_ylabel("peak RSS above baseline (MiB)")
        axis.set_title("memory vs batch size (medians)", fontsize=9)
        axis.set_xlim(left=0)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    big = next(r for r in rows if r["config"] == "big batch")
    accumulation = next(r for r in rows if r["config"] == "accumulation")
    figure.suptitle(
        f"Peak RSS on CPU: batch {big['batch_size']} in one step vs "
        f"{accumulation['accumulation_steps']} x {accumulation['batch_size']} "
        "with GradientAccumulationOptimizer"
    )
    return harness.save_figure(figure, path)


def run(args, report):
    variants = make_variants(args)
    schedule = [
        {**variant, "allocator": allocator}
        for allocator in args.allocators
        for variant in variants
    ]
    runs = []
    for repeat in range(args.repeats):
        # Rotate the order so that no configuration always runs first.
        shift = repeat % len(schedule)
        for spec in schedule[shift:] + schedule[:shift]:
            result = harness.run_processes(
                __file__,
                {**spec, "repeat": repeat},
                env=ALLOCATORS[spec["allocator"]],
                name="accumulation_memory",
            )
            runs.append(result)
            print(
                f"  [{repeat + 1}/{args.repeats}] {spec['allocator']:8s} "
                f"{spec['config']:13s} baseline {result['baseline_rss_mib']:.0f} "
                f"MiB, peak {result['peak_rss_mib']:.0f} MiB "
                f"(+{result['peak_above_baseline_mib']:.0f}), "
                f"{result['train_seconds']:.1f} s",
                file=sys.stderr,
            )
    rows, curves = summarize(runs, variants, args.allocators)
    print(markdown_table(rows, curves))

    fields = {
        "setup": {
            "micro_batch": args.micro_batch,
            "accumulation_steps": args.accumulation_steps,
            "big_batch": args.micro_batch * args.accumulation_steps,
            "updates": args.updates,
            "sweep_batches": args.sweep_batches,
            "repeats": args.repeats,
            "allocators": {a: ALLOCATORS[a] for a in args.allocators},
            "input_shape": [IMAGE_SIZE, IMAGE_SIZE, 3],
            "model": (
                "DistributedModel: Conv2D(32)x3 -> MaxPool -> Conv2D(64)x2 -> "
                "GlobalAveragePooling -> Dense(10), relu, 3x3 same"
            ),
            "parameters": runs[0]["parameters"],
            "layer_output_mib_per_example": runs[0]["layer_output_mib_per_example"],
            "optimizer": "Adam(1e-3), wrapped for accumulation",
            "strategy": "default (one CPU device)",
            "baseline": (
                "VmRSS after build, compile, optimizer build and a batch-1 "
                "warm-up step that traces the train function; VmHWM reset there"
            ),
        },
        "runs": runs,
        "summary": rows,
        "batch_curves": curves,
    }
    report.write(fields, stack_versions=runs[0]["versions"])


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot, job=child_main))
