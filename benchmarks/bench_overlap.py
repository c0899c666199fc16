"""Step time with gradient buckets: does the all-reduce overlap the backward pass?

Runs 2 `MultiWorkerMirroredStrategy` worker processes on 127.0.0.1 inside a
private network namespace (loopback shaped to `--rate` with a token-bucket
filter, or unshaped) and times `DistributedModel.fit` steps with
`NoCompression(bucket_bytes=B)` (or `--hook fp16`: `FP16`, `--hook powersgd`:
`PowerSGD(rank=4, start_step=0)`) for each `B` of `--buckets` ("none" is one
collective per dtype after the whole backward pass), plus a step whose hook
sends nothing ("local": the compute alone, so the communication time is
`none - local`). Three models:

- `balanced`: 8 Dense(1024) layers on 1024 inputs (8.4M parameters, 34 MB
  of gradients), global batch 2048, so that on 2 shared cores and a 1 Gbit/s
  loopback compute and communication take about the same time;
- `mlp21m`: the 21M-parameter MLP of `bench_compression.py` (1024-4096-4096
  -10), global batch 16: communication dominates;
- `deep`: 32 Dense(512) layers (8.4M parameters in 66 tensors of at most
  1 MiB), global batch 1024: many small buckets, where the cost of each
  collective launch shows;
- `balanced_backwards`: `balanced` as a subclassed model whose layers are
  created in the reverse of the order they are called in, so its
  `trainable_variables` list the last layer first. Buckets follow the order
  the traced backward pass computes the gradients (`4m`); `4m_listed` is
  the plan of the list instead (the reverse of `trainable_variables`,
  keras_dist before it read the order from the graph), which sends the
  first layer's gradients, computed last, first.

The configurations alternate in `--rounds` rounds inside the same two worker
processes (each model is traced once), so a change in the machine's load
hits all of them. `--conditions` picks the network and threading: `shaped`
(TensorFlow's default thread pools), `shaped_1thread` (1 intra-op thread and
4 inter-op threads per worker: the 2 workers share 2 cores, and the
collectives' gRPC work competes with the matrix multiplications) and
`unshaped`. With `--trace`, 2 more steps of the `balanced` model are profiled
for "none" and for the default bucket size, and worker 0's trace (op start and
end times from TensorFlow's profiler) becomes a timeline plot: the proof of
whether the collectives run during the backward pass.

Needs root and iproute2 (`ip`, `tc`), like `bench_compression.py`:

    sudo .venv/bin/python benchmarks/bench_overlap.py --trace \\
        --out docs/benchmarks/overlap.json

Prints a markdown table; writes the raw step times, the environment and the
command to the JSON file, and plots next to it (`.png`, `_trace.png`).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import _harness as harness
import _profile

MODELS = {
    # name: (input width, hidden layers, global batch)
    "balanced": (1024, [1024] * 8, 2048),
    "mlp21m": (1024, [4096, 4096], 16),
    "deep": (512, [512] * 32, 1024),
    "balanced_backwards": (1024, [1024] * 8, 2048),
}
# Subclassed, layers created last-called first (see the module docstring).
BACKWARDS = {"balanced_backwards"}
BUCKETS = {
    "none": None,
    "1m": 2**20,
    "4m": 4 * 2**20,
    "16m": 16 * 2**20,
    "25m": 25 * 2**20,
    # 4 MiB, planned over the list of variables, not the traced order.
    "4m_listed": 4 * 2**20,
}
CONDITIONS = {
    "shaped": {"shaped": True, "threads": None},
    "shaped_1thread": {"shaped": True, "threads": (1, 4)},
    "unshaped": {"shaped": False, "threads": None},
}
TRACED = ("none", "4m")
HOOKS = {"none": "NoCompression", "fp16": "FP16", "powersgd": "PowerSGD"}


def parse_args(argv=None):
    parser = harness.parser(
        "Step time of DistributedModel with gradient buckets, 2 worker "
        "processes on a shaped loopback (needs root; --replot does not).",
        "overlap.json",
        jobs=True,
        steps=(6, "Timed steps per round."),
        rounds=(2, "Rounds per config."),
    )
    parser.add_argument("--rate", default="1gbit", help="tc rate (1gbit).")
    parser.add_argument(
        "--buckets",
        nargs="+",
        choices=list(BUCKETS),
        default=list(BUCKETS),
        help="bucket_bytes values to time (none = one collective per dtype).",
    )
    parser.add_argument(
        "--models", nargs="+", choices=list(MODELS), default=list(MODELS)
    )
    parser.add_argument(
        "--hook",
        choices=list(HOOKS),
        default="none",
        help="The hook whose bucket_bytes varies (default: NoCompression).",
    )
    parser.add_argument(
        "--conditions",
        nargs="+",
        choices=list(CONDITIONS),
        default=list(CONDITIONS),
    )
    parser.add_argument(
        "--trace", action="store_true", help="Profile the balanced model (shaped)."
    )
    parser.add_argument("--timeout", type=float, default=2400)
    return parser.parse_args(argv)


# --- Worker (runs inside the namespace) --------------------------------------


def make_hook(tf, compression, hook, config):
    """The hook of `config`: a bucket size, or "local" (sends nothing)."""

    class LocalOnly(compression.AllReduceHook):
        """Sends nothing: each worker applies its own gradient (times the
        number of replicas). Timing only: the compute without communication."""

        def reduce(self, gradients, variables):
            gradients, _ = self.prepare(gradients, variables)
            n = tf.distribute.get_replica_context().num_replicas_in_sync
            return [g * tf.cast(n, g.dtype) for g in gradients]

    if config == "local":
        return LocalOnly()
    if hook == "powersgd":
        made = compression.PowerSGD(rank=4, start_step=0, bucket_bytes=BUCKETS[config])
    else:
        made = getattr(compression, HOOKS[hook])(BUCKETS[config])
    if config.endswith("_listed"):
        # The plan of the list of variables: keras_dist's aggregation path
        # hands the hook the traced order through this method.
        made._set_ready_order = lambda order: None
    return made


def build_backwards(keras, keras_dist, width, hidden, hook, learning_rate):
    """`harness.build_mlp`'s model as a subclass whose layers are created
    in the reverse of the order they are called in."""
    keras.utils.set_random_seed(0)

    class Backwards(keras_dist.DistributedModel):
        def __init__(self):
            super().__init__()
            # Created head first: `trainable_variables` lists it first.
            self.stack = [keras.layers.Dense(10)] + [
                keras.layers.Dense(units, activation="relu")
                for units in reversed(hidden)
            ]

        def call(self, x):
            for layer in reversed(self.stack):
                x = layer(x)
            return x

    model = Backwards()
    model.register_all_reduce_hook(hook)
    model(keras.ops.zeros((1, width)))
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def worker_main(job):
    import tensorflow as tf

    if job["threads"]:
        intra, inter = job["threads"]
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(inter)
    tf, keras, keras_dist = harness.import_stack()
    import numpy as np

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = harness.task_index()
    configs = ["local", *job["buckets"]]
    results = {}
    for model_name in job["models"]:
        width, hidden, batch = MODELS[model_name]
        rng = np.random.default_rng(0)
        x = rng.normal(size=(batch * 4, width)).astype("float32")
        y = rng.integers(0, 10, size=batch * 4).astype("int32")
        dataset = harness.sharded_dataset(tf, x, y, batch)
        models = {}
        for config in configs:
            hook = make_hook(tf, keras_dist.compression, job["hook"], config)
            build = build_backwards if model_name in BACKWARDS else harness.build_mlp
            with strategy.scope():
                model = build(keras, keras_dist, width, hidden, hook, 1e-4)
            start = time.perf_counter()
            model.fit(dataset, epochs=1, steps_per_epoch=3, verbose=0)
            models[config] = (model, time.perf_counter() - start)
        durations = {config: [] for config in configs}
        for _ in range(job["rounds"]):
            for config in configs:
                durations[config].extend(
                    harness.timed_fit(keras, models[config][0], dataset, job["steps"])
                )
        results[model_name] = {
            config: {
                "step_seconds": durations[config],
                "median_step_seconds": statistics.median(durations[config]),
                "trace_and_warmup_seconds": models[config][1],
                "bucket_bytes": None if config == "local" else BUCKETS[config],
                "buckets": (
                    0
                    if config == "local"
                    else len(
                        models[config][0].all_reduce_hook.buckets(
                            models[config][0].trainable_variables
                        )
                    )
                ),
                "parameters": int(models[config][0].count_params()),
            }
            for config in configs
        }
        if job["trace"] and model_name == "balanced":
            for config in TRACED:
                if config not in models:
                    continue
                folder = os.path.join(job["trace"], config, f"w{task}")
                tf.profiler.experimental.start(
                    folder,
                    options=tf.profiler.experimental.ProfilerOptions(
                        host_tracer_level=3
                    ),
                )
                models[config][0].fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
                tf.profiler.experimental.stop()
        del models
    harness.finish_job(job, results)


# --- Parent: namespaces, workers, report --------------------------------------


def run_condition(args, name, trace):
    """Runs both workers in a fresh namespace; returns worker 0's results.

    With `trace` (a folder), the workers profile the balanced model there
    and worker 0's trace is read into the results' `_trace`.
    """
    condition = CONDITIONS[name]
    job = harness.job_from(
        args,
        *("buckets", "hook", "models", "steps", "rounds"),
        threads=condition["threads"],
        trace=trace,
    )
    report = harness.run_processes(
        __file__,
        job,
        workers=2,
        namespace=True,
        rate=args.rate if condition["shaped"] else None,
        timeout=args.timeout,
        name=f"overlap_{name}",
    )
    if trace:
        report["_trace"] = {
            config: read_trace(os.path.join(trace, config, "w0"))
            for config in TRACED
            if config in args.buckets
        }
    return report


def read_trace(folder) -> dict:
    """The last profiled step of worker 0: backward ops and collectives.

    Returns the intervals (milliseconds from the step's first op) of the
    backward pass's ops (`gradient_tape/...`), of the forward ops and of the
    collectives (`CollectiveReduceV2` ops longer than 1 ms: the gradient
    buckets, and the batch-size sum at the start of the step, which waits
    for the other worker), and how much of the collectives' time fell inside
    the backward pass.
    """
    step_start, step_end, kept = _profile.last_step_ops(folder)
    backward = [e for e in kept if "gradient_tape" in e[2] and e[1] - e[0] > 0.05]
    collectives = [
        e for e in kept if e[3] == "CollectiveReduceV2" and e[1] - e[0] > 1.0
    ]
    backward_start = min((e[0] for e in backward), default=step_end)
    forward = [
        e
        for e in kept
        if e[0] < backward_start
        and e[1] - e[0] > 0.05
        and "gradient_tape" not in e[2]
        and not e[3].startswith("Collective")
    ]
    backward_span = (
        (min(e[0] for e in backward), max(e[1] for e in backward)) if backward else None
    )
    inside = 0.0
    if backward_span:
        for start, end, *_ in collectives:
            inside += max(
                0.0, min(end, backward_span[1]) - max(start, backward_span[0])
            )

    def rel(items):
        return [(s - step_start, e - step_start, n, t) for s, e, n, t in items]

    return {
        "step_ms": step_end - step_start,
        "backward_ms": (backward_span[1] - backward_span[0]) if backward_span else 0,
        "collective_ms": sum(e - s for s, e, *_ in collectives),
        "collective_ms_during_backward": inside,
        "collectives": len(collectives),
        "forward": rel(forward),
        "backward": rel(backward),
        "collective_intervals": rel(collectives),
    }


def summarize(results) -> dict:
    """Per condition and model: speed-up of each bucket size over "none" and
    the fraction of the communication time it hid."""
    summary = {}
    for condition, models in results.items():
        for model_name, rows in models.items():
            if model_name.startswith("_"):
                continue
            none = rows.get("none", {}).get("median_step_seconds")
            local = rows["local"]["median_step_seconds"]
            entry = {}
            for config, row in rows.items():
                step = row["median_step_seconds"]
                item = {"step": step}
                if none:
                    item["speedup"] = none / step
                    communication = none - local
                    if config != "local" and communication > 0:
                        item["hidden"] = (none - step) / communication
                entry[config] = item
            summary[f"{condition}/{model_name}"] = entry
    return summary


def format_table(results, summary, rate) -> str:
    rows = []
    for key, entry in summary.items():
        condition, model_name = key.split("/")
        label = {
            "shaped": f"{rate}, default threads",
            "shaped_1thread": f"{rate}, 1 intra-op thread",
            "unshaped": "unshaped, default threads",
        }[condition]
        for config, item in entry.items():
            row = results[condition][model_name][config]
            name = "local (no communication)" if config == "local" else config
            speedup = f"{item['speedup']:.2f}x" if "speedup" in item else ""
            hidden = f"{item['hidden']:.0%}" if "hidden" in item else ""
            step = f"{item['step']:.3f}"
            rows.append(
                [label, model_name, name, row["buckets"], step, speedup, hidden]
            )
    header = ["network, threads", "model", "bucket_bytes", "buckets", "step (s)"]
    header += ["speed-up vs none", "communication hidden"]
    return harness.table(header, rows, align="lllrrrr")


def plot(plt, report, path):
    """Step times by bucket size (`path`) and, with traces, the timeline
    (`_trace.png` beside it); returns what was written."""
    written = plot_steps(plt, report["summary"], path)
    trace_path = os.path.splitext(path)[0] + "_trace.png"
    if report["traces"]:
        written += " and " + plot_trace(plt, report["traces"], trace_path)
    return written


def plot_steps(plt, summary, path):
    conditions = list(dict.fromkeys(key.split("/")[0] for key in summary))
    models = list(dict.fromkeys(key.split("/")[1] for key in summary))
    fig, axes = plt.subplots(
        len(conditions),
        len(models),
        figsize=(3.4 * len(models), 2.6 * len(conditions)),
        squeeze=False,
    )
    titles = {
        "shaped": "1 Gbit/s",
        "shaped_1thread": "1 Gbit/s, 1 intra-op thread",
        "unshaped": "unshaped",
    }
    for row, condition in enumerate(conditions):
        for column, model_name in enumerate(models):
            ax = axes[row][column]
            entry = summary.get(f"{condition}/{model_name}")
            if entry is None:
                ax.set_visible(False)
                continue
            configs = list(entry)
            values = [entry[c]["step"] for c in configs]
            colors = ["#999999" if c == "local" else "#1f77b4" for c in configs]
            bars = ax.bar(range(len(configs)), values, color=colors)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
            ax.set_xticks(range(len(configs)), configs, fontsize=8)
            ax.set_ylim(0, max(values) * 1.18)
            ax.set_title(
                f"{model_name}, {titles.get(condition, condition)}", fontsize=9
            )
            if column == 0:
                ax.set_ylabel("median step (s)")
    fig.suptitle(
        "DistributedModel, 2 workers: step time by bucket_bytes "
        "(grey: the step without communication)",
        fontsize=10,
    )
    return harness.save_figure(fig, path)


def plot_trace(plt, traces, path):
    fig, axes = plt.subplots(len(traces), 1, figsize=(9, 1.6 + 1.2 * len(traces)))
    if len(traces) == 1:
        axes = [axes]
    for ax, (config, trace) in zip(axes, traces.items()):
        rows = [
            ("forward", trace["forward"], "#2ca02c"),
            ("backward", trace["backward"], "#ff7f0e"),
            ("collectives", trace["collective_intervals"], "#1f77b4"),
        ]
        for y, (_, intervals, color) in enumerate(rows):
            ax.broken_barh(
                [(s, e - s) for s, e, *_ in intervals],
                (y - 0.35, 0.7),
                facecolors=color,
                edgecolors="white",
                linewidth=0.5,
            )
        ax.set_yticks(range(len(rows)), [r[0] for r in rows])
        ax.set_xlim(0, trace["step_ms"] * 1.02)
        hidden = trace["collective_ms_during_backward"] / max(trace["collective_ms"], 1)
        ax.set_title(
            f"bucket_bytes={config}: step {trace['step_ms']:.0f} ms, "
            f"{trace['collectives']} collectives, "
            f"{hidden:.0%} of their time during the backward pass",
            fontsize=9,
        )
    axes[-1].set_xlabel("ms since the step started (worker 0, TensorFlow profiler)")
    fig.tight_layout()
    return harness.save_figure(fig, path)


def run(args, report):
    harness.require_root("bench_overlap")
    traced = "shaped" if "shaped" in args.conditions else args.conditions[0]
    results = {}
    with tempfile.TemporaryDirectory(prefix="kd_bench_overlap_trace_") as folder:
        for name in args.conditions:
            print(f"Running {name}...", flush=True)
            trace = folder if args.trace and name == traced else ""
            results[name] = run_condition(args, name, trace)
    traces = {}
    for name in list(results):
        traces.update(results[name].pop("_trace", {}))
    summary = summarize(results)
    table = format_table(results, summary, args.rate)
    print(table)
    for config, trace in traces.items():
        print(
            f"trace {config}: step {trace['step_ms']:.0f} ms, collectives "
            f"{trace['collective_ms']:.0f} ms, of which "
            f"{trace['collective_ms_during_backward']:.0f} ms during the backward "
            f"pass ({trace['backward_ms']:.0f} ms)"
        )
    fields = {
        "rate": args.rate,
        "hook": HOOKS[args.hook],
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "models": {k: MODELS[k] for k in args.models},
        "results": results,
        "summary": summary,
        "traces": traces,
        "table": table,
    }
    report.write(fields)


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot, job=worker_main))
