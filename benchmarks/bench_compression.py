"""Step time with gradient compression on a bandwidth-limited network.

Runs 2 `MultiWorkerMirroredStrategy` worker processes on 127.0.0.1 inside a
private network namespace, first with the namespace's loopback unshaped, then
shaped to `--rate` (default 1 Gbit/s) with a token-bucket filter, and times
`DistributedModel.fit` steps of a 21M-parameter MLP with each all-reduce hook:
no compression, FP16, BF16, TopK(0.01) and PowerSGD(rank 4). All traffic
stays on the namespace's own loopback; the script creates the namespace and
deletes it when it ends, so it needs root and `ip`/`tc` (iproute2):

    ip netns add NS; ip -n NS link set lo up
    ip netns exec NS tc qdisc add dev lo root tbf rate 1gbit burst 512kb latency 100ms
    ip netns exec NS python ... (2 workers)
    ip netns del NS

Usage:

    sudo .venv/bin/python benchmarks/bench_compression.py [--rate 1gbit]
        [--steps 8] [--out docs/benchmarks/compression.json]

Prints a markdown table; writes the raw step times, the bytes each hook sent,
the environment and the command to the JSON file, and a plot next to it
(same name, `.png`) when matplotlib is importable (`--replot JSON` redraws
it).
"""

from __future__ import annotations

import statistics
import sys
import time

import _harness as harness

HOOKS = {
    "none": ("NoCompression", {}),
    "fp16": ("FP16", {}),
    "bf16": ("BF16", {}),
    "topk": ("TopK", {"ratio": 0.01}),
    "powersgd": ("PowerSGD", {"rank": 4, "start_step": 0}),
}
LABELS = {
    "none": "no compression",
    "fp16": "FP16",
    "bf16": "BF16",
    "topk": "TopK(0.01)",
    "powersgd": "PowerSGD(rank 4)",
}
TARGETS = {"fp16": 1.6, "powersgd": 3.0}
INPUT_DIM = 1024
HIDDEN = 4096


def parse_args(argv=None):
    parser = harness.parser(
        "Step time of DistributedModel with each compression hook, 2 "
        "worker processes on a shaped loopback (needs root).",
        "compression.json",
        jobs=True,
        steps=(8, "Timed steps per hook."),
        batch_size=(16, "Global batch size (2 workers)."),
    )
    parser.add_argument(
        "--rate", default="1gbit", help="tc rate of the shaped loopback (1gbit)."
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="Untimed steps per hook after tracing."
    )
    parser.add_argument(
        "--hooks",
        nargs="+",
        choices=sorted(HOOKS),
        default=list(HOOKS),
        help="Hooks to measure, in this order.",
    )
    parser.add_argument(
        "--timeout", type=float, default=1800, help="Seconds per network condition."
    )
    return parser.parse_args(argv)


# --- Worker (runs inside the namespace) --------------------------------------


def worker_main(job):
    tf, keras, keras_dist = harness.import_stack()
    import numpy as np

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    samples = job["batch_size"] * (job["steps"] + job["warmup"] + 1)
    x = rng.normal(size=(samples, INPUT_DIM)).astype("float32")
    y = rng.integers(0, 10, size=samples).astype("int32")
    dataset = harness.sharded_dataset(tf, x, y, job["batch_size"])
    results = {}
    for key in job["hooks"]:
        class_name, kwargs = HOOKS[key]
        hook = getattr(keras_dist.compression, class_name)(**kwargs)
        with strategy.scope():
            model = harness.build_mlp(
                keras, keras_dist, INPUT_DIM, [HIDDEN, HIDDEN], hook, 0.01
            )
        start = time.perf_counter()
        model.fit(dataset, epochs=1, steps_per_epoch=1 + job["warmup"], verbose=0)
        first = time.perf_counter() - start
        durations = harness.timed_fit(keras, model, dataset, job["steps"])
        stats = hook.stats()
        results[key] = {
            "step_seconds": durations,
            "median_step_seconds": statistics.median(durations),
            "trace_and_warmup_seconds": first,
            "raw_bytes": stats.raw_bytes,
            "sent_bytes": stats.sent_bytes,
            "ratio": stats.ratio,
            "parameters": int(model.count_params()),
        }
    harness.finish_job(job, results)


# --- Parent: namespaces, workers, report --------------------------------------


def run_condition(args, shaped):
    """Runs both workers in a fresh namespace; returns worker 0's results."""
    return harness.run_processes(
        __file__,
        harness.job_from(args, "hooks", "steps", "warmup", "batch_size"),
        workers=2,
        namespace=True,
        rate=args.rate if shaped else None,
        timeout=args.timeout,
        name=f"compression_{'shaped' if shaped else 'plain'}",
    )


def format_table(results, rate) -> str:
    plain, shaped = results["unshaped"], results["shaped"]
    base_plain = plain["none"]["median_step_seconds"]
    base_shaped = shaped["none"]["median_step_seconds"]
    header = ["hook", "sent per step (per worker)", "ratio", "unshaped step (s)"]
    header += ["vs none, unshaped", f"{rate} step (s)", f"speedup at {rate}"]
    return harness.table(
        header,
        (
            [
                LABELS[key],
                f"{row['sent_bytes'] / 1e6:.2f} MB",
                f"{row['ratio']:.1f}x",
                f"{plain[key]['median_step_seconds']:.3f}",
                f"{base_plain / plain[key]['median_step_seconds']:.2f}x",
                f"{row['median_step_seconds']:.3f}",
                f"{base_shaped / row['median_step_seconds']:.2f}x",
            ]
            for key, row in shaped.items()
        ),
    )


def plot(plt, report, path):
    results, rate = report["results"], report["rate"]
    keys = list(results["shaped"])
    positions = range(len(keys))
    width = 0.38
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for offset, (condition, label) in enumerate(
        [("unshaped", "unshaped loopback"), ("shaped", f"loopback shaped to {rate}")]
    ):
        values = [results[condition][k]["median_step_seconds"] for k in keys]
        bars = ax.bar(
            [p + (offset - 0.5) * width for p in positions], values, width, label=label
        )
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(list(positions), [LABELS[k] for k in keys])
    ax.set_ylabel("median step time (s)")
    params = results["shaped"][keys[0]]["parameters"]
    ax.set_title(
        f"DistributedModel, 2 workers (MultiWorkerMirroredStrategy), "
        f"{params / 1e6:.1f}M-parameter MLP"
    )
    ax.legend()
    return harness.save_figure(fig, path, dpi=120)


def run(args, report):
    harness.require_root("bench_compression")
    results = {}
    for condition, shaped in (("unshaped", False), ("shaped", True)):
        print(f"Running {len(args.hooks)} hooks, {condition} loopback...", flush=True)
        results[condition] = run_condition(args, shaped)
    table = format_table(results, args.rate)
    print(table)
    shaped = results["shaped"]
    checks = {}
    if "none" in shaped:
        for key, target in TARGETS.items():
            if key in shaped:
                speedup = (
                    shaped["none"]["median_step_seconds"]
                    / shaped[key]["median_step_seconds"]
                )
                checks[key] = {"speedup": speedup, "target": target}
                verdict = "meets" if speedup >= target else "MISSES"
                print(f"{LABELS[key]}: {speedup:.2f}x at {args.rate}", end=" ")
                print(f"({verdict} the {target}x target)")
    fields = {
        "rate": args.rate,
        "steps": args.steps,
        "warmup": args.warmup,
        "global_batch_size": args.batch_size,
        "results": results,
        "targets": checks,
        "table": table,
    }
    report.write(fields)


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot, job=worker_main))
