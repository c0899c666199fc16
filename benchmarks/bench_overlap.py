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
  collective launch shows.

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

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _common import (
    REPO_ROOT,
    RunClock,
    command,
    plot_path,
    pyplot,
    save_figure,
    write_report,
)

BASE_PORT = 23556
MODELS = {
    # name: (input width, hidden layers, global batch)
    "balanced": (1024, [1024] * 8, 2048),
    "mlp21m": (1024, [4096, 4096], 16),
    "deep": (512, [512] * 32, 1024),
}
BUCKETS = {
    "none": None,
    "1m": 2**20,
    "4m": 4 * 2**20,
    "16m": 16 * 2**20,
    "25m": 25 * 2**20,
}
CONDITIONS = {
    "shaped": {"shaped": True, "threads": None},
    "shaped_1thread": {"shaped": True, "threads": (1, 4)},
    "unshaped": {"shaped": False, "threads": None},
}
TRACED = ("none", "4m")
HOOKS = {"none": "NoCompression", "fp16": "FP16", "powersgd": "PowerSGD"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=(
            "Step time of DistributedModel with gradient buckets, 2 worker "
            "processes on a shaped loopback (needs root)."
        )
    )
    parser.add_argument("--rate", default="1gbit", help="tc rate (1gbit).")
    parser.add_argument("--steps", type=int, default=6, help="Timed steps per round.")
    parser.add_argument("--rounds", type=int, default=2, help="Rounds per config.")
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
    parser.add_argument(
        "--out", default=os.path.join("docs", "benchmarks", "overlap.json")
    )
    parser.add_argument(
        "--replot",
        metavar="JSON",
        help="Redraw the plots of an earlier report (no run; no root needed).",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --- Worker (runs inside the namespace) --------------------------------------


def worker_main(job_path):
    with open(job_path) as handle:
        job = json.load(handle)
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    sys.path.insert(0, REPO_ROOT)
    import tensorflow as tf

    if job["threads"]:
        intra, inter = job["threads"]
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(inter)
    import keras
    import numpy as np

    import keras_dist
    from keras_dist import compression
    from keras_dist.compression import AllReduceHook

    class LocalOnly(AllReduceHook):
        """Sends nothing: each worker applies its own gradient (times the
        number of replicas). Timing only: the compute without communication."""

        def reduce(self, gradients, variables):
            gradients, _ = self.prepare(gradients, variables)
            n = tf.distribute.get_replica_context().num_replicas_in_sync
            return [g * tf.cast(n, g.dtype) for g in gradients]

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.durations = []

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # waits for the step
            self.durations.append(time.perf_counter() - self._start)

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    configs = ["local", *job["buckets"]]
    results = {}
    for model_name in job["models"]:
        width, hidden, batch = MODELS[model_name]
        rng = np.random.default_rng(0)
        x = rng.normal(size=(batch * 4, width)).astype("float32")
        y = rng.integers(0, 10, size=batch * 4).astype("int32")
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        dataset = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .batch(batch, drop_remainder=True)
            .repeat()
            .with_options(options)
        )
        models = {}
        for config in configs:
            if config == "local":
                hook = LocalOnly()
            elif job["hook"] == "powersgd":
                hook = compression.PowerSGD(
                    rank=4, start_step=0, bucket_bytes=BUCKETS[config]
                )
            else:
                hook = getattr(compression, HOOKS[job["hook"]])(BUCKETS[config])
            with strategy.scope():
                keras.utils.set_random_seed(0)
                inputs = keras.Input((width,))
                h = inputs
                for units in hidden:
                    h = keras.layers.Dense(units, activation="relu")(h)
                outputs = keras.layers.Dense(10)(h)
                model = keras_dist.DistributedModel(
                    inputs, outputs, all_reduce_hook=hook
                )
                model.compile(
                    optimizer=keras.optimizers.SGD(1e-4),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                )
            start = time.perf_counter()
            model.fit(dataset, epochs=1, steps_per_epoch=3, verbose=0)
            models[config] = (model, time.perf_counter() - start)
        durations = {config: [] for config in configs}
        for _ in range(job["rounds"]):
            for config in configs:
                timer = StepTimer()
                models[config][0].fit(
                    dataset,
                    epochs=1,
                    steps_per_epoch=job["steps"],
                    callbacks=[timer],
                    verbose=0,
                )
                durations[config].extend(timer.durations)
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
    if task == 0:
        with open(job["result"], "w") as handle:
            json.dump(results, handle)
    sys.stdout.flush()
    os._exit(0)


# --- Parent: namespaces, workers, report --------------------------------------


def _run(command_line, check=True):
    return subprocess.run(command_line, check=check, capture_output=True, text=True)


def run_condition(args, name, workdir):
    """Runs both workers in a fresh namespace; returns worker 0's results."""
    condition = CONDITIONS[name]
    namespace = f"kd_overlap_{os.getpid()}_{name}"
    _run(["ip", "netns", "add", namespace])
    procs = []
    try:
        _run(["ip", "-n", namespace, "link", "set", "lo", "up"])
        if condition["shaped"]:
            _run(
                [
                    *("ip", "netns", "exec", namespace),
                    *("tc", "qdisc", "add", "dev", "lo", "root", "tbf"),
                    *("rate", args.rate, "burst", "512kb", "latency", "100ms"),
                ]
            )
        workers = [f"127.0.0.1:{BASE_PORT + i}" for i in range(2)]
        result = os.path.join(workdir, f"{name}.json")
        trace = os.path.join(workdir, f"trace_{name}") if args.trace_here(name) else ""
        for index in range(2):
            job = {
                "buckets": args.buckets,
                "hook": args.hook,
                "models": args.models,
                "steps": args.steps,
                "rounds": args.rounds,
                "threads": condition["threads"],
                "trace": trace,
                "result": result,
            }
            job_path = os.path.join(workdir, f"{name}_{index}_job.json")
            with open(job_path, "w") as handle:
                json.dump(job, handle)
            env = dict(os.environ)
            env["TF_CONFIG"] = json.dumps(
                {
                    "cluster": {"worker": workers},
                    "task": {"type": "worker", "index": index},
                }
            )
            env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            env["PYTHONPATH"] = REPO_ROOT
            log = open(os.path.join(workdir, f"{name}_{index}.log"), "w")  # noqa: SIM115
            procs.append(
                (
                    subprocess.Popen(
                        [
                            *("ip", "netns", "exec", namespace, sys.executable),
                            *(os.path.abspath(__file__), "--worker", job_path),
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                    ),
                    log,
                )
            )
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p, _ in procs):
            if any(p.poll() not in (None, 0) for p, _ in procs):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for index, (proc, log) in enumerate(procs):
            if proc.poll() != 0:
                log.flush()
                with open(log.name) as handle:
                    tail = handle.read()[-3000:]
                raise RuntimeError(
                    f"worker {index} ({name}) failed or timed out "
                    f"(code {proc.poll()}):\n{tail}"
                )
        with open(result) as handle:
            report = json.load(handle)
        if trace:
            report["_trace"] = {
                config: read_trace(os.path.join(trace, config, "w0"))
                for config in TRACED
                if config in args.buckets
            }
        return report
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        _run(["ip", "netns", "del", namespace], check=False)


def read_trace(folder) -> dict:
    """The last profiled step of worker 0: backward ops and collectives.

    Returns the intervals (milliseconds from the step's first op) of the
    backward pass's ops (`gradient_tape/...`), of the forward ops and of the
    collectives (`CollectiveReduceV2` ops longer than 1 ms: the gradient
    buckets, and the batch-size sum at the start of the step, which waits
    for the other worker), and how much of the collectives' time fell inside
    the backward pass.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    (path,) = glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.xplane.pb"))
    space = xplane_pb2.XSpace()
    with open(path, "rb") as handle:
        space.ParseFromString(handle.read())
    (plane,) = [p for p in space.planes if p.name == "/host:CPU"]
    events = []
    steps = []
    for line in plane.lines:
        for event in line.events:
            name = plane.event_metadata[event.metadata_id].name
            start = (line.timestamp_ns * 1000 + event.offset_ps) / 1e9  # ms
            end = start + event.duration_ps / 1e9
            if name.startswith("EagerLocalExecute: __inference_") and (
                "step_on_iterator" in name
            ):
                steps.append((start, end))
            elif ":" in name and "::" not in name:
                op_name, op_type = name.rsplit(":", 1)
                events.append((start, end, op_name, op_type))
    if not steps:
        raise RuntimeError(f"no train step found in the trace of {folder}")
    step_start, step_end = max(steps)
    kept = [e for e in events if step_start <= e[0] <= step_end]
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
    lines = [
        "| network, threads | model | bucket_bytes | buckets | step (s) "
        "| speed-up vs none | communication hidden |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
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
            lines.append(
                f"| {label} | {model_name} | {name} | {row['buckets']} | "
                f"{item['step']:.3f} | {speedup} | {hidden} |"
            )
    return "\n".join(lines)


def plot(results, summary, path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
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
    save_figure(fig, path)
    return True


def plot_trace(traces, path) -> bool:
    plt = pyplot()
    if plt is None or not traces:
        return False
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
    save_figure(fig, path)
    return True


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    if args.replot:
        with open(args.replot) as handle:
            report = json.load(handle)
        base = os.path.splitext(args.replot)[0]
        plot(report["results"], report["summary"], base + ".png")
        plot_trace(report["traces"], base + "_trace.png")
        print(f"Wrote {base}.png and {base}_trace.png")
        return 0
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print(
            "bench_overlap needs root and iproute2 (`ip`, `tc`) to create and "
            "shape a private network namespace. Run it with sudo.",
            file=sys.stderr,
        )
        return 2
    traced = "shaped" if "shaped" in args.conditions else args.conditions[0]
    args.trace_here = lambda name: args.trace and name == traced
    workdir = tempfile.mkdtemp(prefix="kd_bench_overlap_")
    clock = RunClock()
    results = {}
    for name in args.conditions:
        print(f"Running {name}...", flush=True)
        try:
            results[name] = run_condition(args, name, workdir)
        except RuntimeError:
            print(f"Worker logs kept in {workdir}", file=sys.stderr)
            raise
    shutil.rmtree(workdir, ignore_errors=True)
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
    import importlib.metadata

    report = {
        "command": command(),
        "rate": args.rate,
        "hook": HOOKS[args.hook],
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "models": {k: MODELS[k] for k in args.models},
        "results": results,
        "summary": summary,
        "traces": traces,
        "table": table,
        "environment": clock.environment(
            {"tensorflow": importlib.metadata.version("tensorflow")}
        ),
    }
    base = os.path.splitext(plot_path(args.out))[0]
    if plot(results, summary, base + ".png"):
        report["plot"] = base + ".png"
    if plot_trace(traces, base + "_trace.png"):
        report["plot"] += " and " + base + "_trace.png"
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
