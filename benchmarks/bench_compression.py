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
(same name, `.png`) when matplotlib is importable.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _common import pyplot, save_figure

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
NUM_CLASSES = 10
BASE_PORT = 23456


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=(
            "Step time of DistributedModel with each compression hook, 2 "
            "worker processes on a shaped loopback (needs root)."
        )
    )
    parser.add_argument(
        "--rate", default="1gbit", help="tc rate of the shaped loopback (1gbit)."
    )
    parser.add_argument("--steps", type=int, default=8, help="Timed steps per hook.")
    parser.add_argument(
        "--warmup", type=int, default=2, help="Untimed steps per hook after tracing."
    )
    parser.add_argument(
        "--batch-size", type=int, default=16, help="Global batch size (2 workers)."
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
    parser.add_argument(
        "--out",
        default=os.path.join("docs", "benchmarks", "compression.json"),
        help="JSON file for the raw results; the plot goes next to it (.png).",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --- Worker (runs inside the namespace) --------------------------------------


def worker_main(job_path):
    with open(job_path) as handle:
        job = json.load(handle)
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    sys.path.insert(0, REPO_ROOT)
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_dist
    from keras_dist import compression

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    samples = job["batch_size"] * (job["steps"] + job["warmup"] + 1)
    x = rng.normal(size=(samples, INPUT_DIM)).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=samples).astype("int32")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(job["batch_size"], drop_remainder=True)
        .repeat()
        .with_options(options)
    )

    class StepTimer(keras.callbacks.Callback):
        """Records the wall time of each training batch."""

        def __init__(self):
            super().__init__()
            self.durations = []
            self._start = None

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            # Reading the loss waits for the step to finish.
            if logs and "loss" in logs:
                float(logs["loss"])
            self.durations.append(time.perf_counter() - self._start)

    results = {}
    for key in job["hooks"]:
        class_name, kwargs = HOOKS[key]
        hook = getattr(compression, class_name)(**kwargs)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((INPUT_DIM,))
            h = keras.layers.Dense(HIDDEN, activation="relu")(inputs)
            h = keras.layers.Dense(HIDDEN, activation="relu")(h)
            outputs = keras.layers.Dense(NUM_CLASSES)(h)
            model = keras_dist.DistributedModel(inputs, outputs, all_reduce_hook=hook)
            model.compile(
                optimizer=keras.optimizers.SGD(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        timer = StepTimer()
        start = time.perf_counter()
        model.fit(dataset, epochs=1, steps_per_epoch=1 + job["warmup"], verbose=0)
        first = time.perf_counter() - start
        model.fit(
            dataset,
            epochs=1,
            steps_per_epoch=job["steps"],
            callbacks=[timer],
            verbose=0,
        )
        stats = hook.stats()
        results[key] = {
            "step_seconds": timer.durations,
            "median_step_seconds": statistics.median(timer.durations),
            "trace_and_warmup_seconds": first,
            "raw_bytes": stats.raw_bytes,
            "sent_bytes": stats.sent_bytes,
            "ratio": stats.ratio,
            "parameters": int(model.count_params()),
        }
    with open(job["result"], "w") as handle:
        json.dump(results, handle)
    sys.stdout.flush()
    os._exit(0)


# --- Parent: namespaces, workers, report --------------------------------------


def _run(command, check=True):
    return subprocess.run(command, check=check, capture_output=True, text=True)


def run_condition(args, shaped, workdir):
    """Runs both workers in a fresh namespace; returns worker 0's results."""
    namespace = f"kd_bench_{os.getpid()}_{'shaped' if shaped else 'plain'}"
    _run(["ip", "netns", "add", namespace])
    procs = []
    try:
        _run(["ip", "-n", namespace, "link", "set", "lo", "up"])
        if shaped:
            _run(
                [
                    *("ip", "netns", "exec", namespace),
                    *("tc", "qdisc", "add", "dev", "lo", "root", "tbf"),
                    *("rate", args.rate, "burst", "512kb", "latency", "100ms"),
                ]
            )
        workers = [f"127.0.0.1:{BASE_PORT + i}" for i in range(2)]
        for index in range(2):
            result = os.path.join(workdir, f"{namespace}_{index}.json")
            job = {
                "hooks": args.hooks,
                "steps": args.steps,
                "warmup": args.warmup,
                "batch_size": args.batch_size,
                "result": result,
            }
            job_path = os.path.join(workdir, f"{namespace}_{index}_job.json")
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
            log = open(os.path.join(workdir, f"{namespace}_{index}.log"), "w")  # noqa: SIM115
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
                    result,
                )
            )
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p, _, _ in procs):
            failed = [p for p, _, _ in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for index, (proc, log, _) in enumerate(procs):
            if proc.poll() != 0:
                log.flush()
                with open(log.name) as handle:
                    tail = handle.read()[-3000:]
                raise RuntimeError(
                    f"worker {index} ({'shaped' if shaped else 'unshaped'}) "
                    f"failed or timed out (code {proc.poll()}):\n{tail}"
                )
        with open(procs[0][2]) as handle:
            return json.load(handle)
    finally:
        for proc, log, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        _run(["ip", "netns", "del", namespace], check=False)


def format_table(results, rate) -> str:
    plain, shaped = results["unshaped"], results["shaped"]
    base_plain = plain["none"]["median_step_seconds"]
    base_shaped = shaped["none"]["median_step_seconds"]
    lines = [
        f"| hook | sent per step (per worker) | ratio | unshaped step (s) "
        f"| vs none, unshaped | {rate} step (s) | speedup at {rate} |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, row in shaped.items():
        lines.append(
            f"| {LABELS[key]} | {row['sent_bytes'] / 1e6:.2f} MB | "
            f"{row['ratio']:.1f}x | {plain[key]['median_step_seconds']:.3f} | "
            f"{base_plain / plain[key]['median_step_seconds']:.2f}x | "
            f"{row['median_step_seconds']:.3f} | "
            f"{base_shaped / row['median_step_seconds']:.2f}x |"
        )
    return "\n".join(lines)


def plot(results, rate, path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
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
    save_figure(fig, path, dpi=120)
    return True


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print(
            "bench_compression needs root and iproute2 (`ip`, `tc`) to create "
            "and shape a private network namespace. Run it with sudo.",
            file=sys.stderr,
        )
        return 2
    workdir = tempfile.mkdtemp(prefix="kd_bench_compression_")
    started = time.time()
    results = {}
    for condition, shaped in (("unshaped", False), ("shaped", True)):
        print(f"Running {len(args.hooks)} hooks, {condition} loopback...", flush=True)
        try:
            results[condition] = run_condition(args, shaped, workdir)
        except RuntimeError:
            print(f"Worker logs kept in {workdir}", file=sys.stderr)
            raise
    shutil.rmtree(workdir, ignore_errors=True)
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
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    record = {
        "command": " ".join(
            ["python", "benchmarks/bench_compression.py", *sys.argv[1:]]
        ),
        "rate": args.rate,
        "steps": args.steps,
        "warmup": args.warmup,
        "global_batch_size": args.batch_size,
        "results": results,
        "targets": checks,
        "table": table,
        "seconds": time.time() - started,
        "environment": {
            "python": platform.python_version(),
            "tensorflow": importlib.metadata.version("tensorflow"),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
    }
    with open(args.out, "w") as handle:
        json.dump(record, handle, indent=2)
    png = os.path.splitext(args.out)[0] + ".png"
    if plot(results, args.rate, png):
        print(f"Wrote {args.out} and {png}")
    else:
        print(f"Wrote {args.out} (no matplotlib: no plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
