"""Memory and step time of `ShardedOptimizer(Adam)` against plain Adam.

`keras_dist.ShardedOptimizer` gives each of the `N` replicas the optimizer
state of one slice of the flattened parameters (ZeRO stage 1). This script
trains a 25.2M-parameter MLP (Dense 1024 -> 4096 -> 4096 -> 1024, MSE, as in
`bench_backup.py`) as a `DistributedModel` with `Adam` and with
`ShardedOptimizer(Adam)`, in these settings:

- `workers`: 2 `MultiWorkerMirroredStrategy` worker processes on 127.0.0.1
  with TensorFlow's collectives (`KERAS_DIST_COLLECTIVES=tensorflow`)
  inside a private network namespace, its loopback unshaped and shaped to
  `--rate` (default 1 Gbit/s) with a token-bucket filter (needs root and
  `ip`/`tc`, like `bench_compression.py`);
- `gloo`: the same, with `KERAS_DIST_COLLECTIVES=gloo` (needs PyTorch): the
  unsharded buckets and the sharded reduce-scatter and all-gather through
  gloo;
- `logical`: one process, `MirroredStrategy` over `--logical-replicas`
  (default 4) logical CPU devices (`keras_dist.auto_strategy(cpu_replicas=N)`);
- `torch`: the same model, batch and optimizer in PyTorch over gloo, in the
  same 2-worker namespace: DDP with Adam, DDP with
  `ZeroRedundancyOptimizer(Adam)` (ZeRO-1) and FSDP2's
  `fully_shard(reshard_after_forward=False)` (ZeRO-2)
  (`benchmarks/_torch_sharding.py`; needs PyTorch).

Every configuration runs in fresh processes, so that the peak memory
(`VmHWM` of `/proc/self/status`) of one does not hide the other's. Each
process records:

- the optimizer state per replica, counted from the variables: the bytes of
  this replica's component of every variable of `model.optimizer` (Adam's
  two slots, and with sharding the float32 parameter slice), per variable;
- its resident memory before `fit` (model built), after the steps, and its
  high-water mark (`VmHWM`), in every worker;
- the wall time of `--steps` training steps after `--warmup` untimed ones
  (`harness.timed_fit`);
- a probe of the collectives alone on one flat float32 vector of the
  model's size (every worker, `--probe-repeats` times, alternating): one
  all-reduce against keras_dist's reduce-scatter (an all-to-all plus a
  local sum) followed by an all-gather, what a sharded update sends.

The configurations alternate (`harness.alternate`) over `--rounds` rounds;
the table reports the median over rounds of each launch's median step.

Usage (root for the namespaces; `--settings logical` needs none):

    sudo .venv/bin/python benchmarks/bench_sharding.py [--steps 10]
        [--rounds 3] [--settings workers gloo logical torch] [--rate 1gbit]
        [--logical-replicas 4] [--probe-repeats 4] [--no-profile]
        [--allocator default|mmap64k] [--out docs/benchmarks/sharding.json]

`--profile` (the default) also profiles one step of each configuration of
the 2 workers on the unshaped loopback (first round) and tabulates worker
0's busy time per op type: where the time goes. `--allocator mmap64k` runs
the processes with `MALLOC_MMAP_THRESHOLD_=65536`, so that the peak RSS is
that of live memory rather than of what glibc keeps after a free.

Prints a markdown table; writes the raw numbers, the environment and the
command to the JSON file, and a plot next to it (same name, `.png`) when
matplotlib is importable (`--replot JSON` redraws it). Linux only.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import _harness as harness
import _profile
import _torch_sharding
from _torch_sharding import TORCH_CONFIGS, TORCH_LABELS

WIDTHS = (1024, 4096, 4096, 1024)
CONFIGS = ("unsharded", "sharded", "one_segment")
LABELS = {
    "unsharded": "Adam",
    "sharded": "ShardedOptimizer(Adam)",
    "one_segment": "ShardedOptimizer(Adam, bucket_bytes=None)",
}
COLORS = {
    "unsharded": "#1f77b4",
    "sharded": "#ff7f0e",
    "one_segment": "#9467bd",
    "fsdp2": "#2ca02c",
}
WORKER_SETTINGS = ("workers", "gloo", "torch")
GOAL = 1.05
ALLOCATORS = {
    "default": {},
    # A fixed threshold turns off glibc's dynamic one: every block above
    # 64 KiB is mmapped and returned to the system when freed, so the peak
    # RSS is that of live memory (see bench_accumulation_memory.py).
    "mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536"},
}
MIB = 2**20


def parse_args(argv=None):
    parser = harness.parser(
        "Optimizer-state memory and step time of ShardedOptimizer(Adam) vs "
        "Adam: 2 worker processes (shaped and unshaped loopback; needs root) "
        "and logical CPU replicas in one process.",
        "sharding.json",
        jobs=True,
        steps=(10, "Timed steps per launch."),
        rounds=(3, "Rounds; each launches every configuration once."),
        batch_size=(16, "Global batch size."),
    )
    parser.add_argument(
        "--rate", default="1gbit", help="tc rate of the shaped loopback (1gbit)."
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="Untimed steps after tracing."
    )
    parser.add_argument(
        "--settings",
        nargs="+",
        choices=("workers", "gloo", "logical", "torch"),
        default=["workers", "gloo", "logical", "torch"],
        help=(
            "What to run: 2 worker processes (TensorFlow's collectives, and/or "
            "gloo's), logical replicas, and/or PyTorch's DDP, "
            "ZeroRedundancyOptimizer and FSDP2 on 2 worker processes."
        ),
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=CONFIGS,
        default=list(CONFIGS),
        help=(
            "keras_dist's configurations: Adam, ShardedOptimizer(Adam) (its "
            "segments of 4 MiB, reduce-scattered during the backward pass) "
            "and ShardedOptimizer(Adam, bucket_bytes=None) (one segment: the "
            "whole model flattened, after the backward pass). 'unsharded' is "
            "always run."
        ),
    )
    parser.add_argument(
        "--logical-replicas",
        type=harness.positive_int,
        default=4,
        help="Logical CPU replicas of the one-process setting.",
    )
    parser.add_argument(
        "--probe-repeats",
        type=int,
        default=4,
        help="Timed repeats of each collective in the probe (0: no probe).",
    )
    parser.add_argument(
        "--allocator",
        choices=sorted(ALLOCATORS),
        default="default",
        help=(
            "glibc setting of the measured processes: `default`, or `mmap64k` "
            "(MALLOC_MMAP_THRESHOLD_=65536: RSS follows the live tensors)."
        ),
    )
    parser.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Profile one step of each configuration (2 workers, unshaped).",
    )
    parser.add_argument(
        "--timeout", type=float, default=900, help="Seconds per launch at most."
    )
    return parser.parse_args(argv)


# --- Inside a process ------------------------------------------------------------


def status_mib(field: str) -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field} line.")


def build_model(keras, keras_dist, config: str):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTHS[0],))
    h = inputs
    for width in WIDTHS[1:-1]:
        h = keras.layers.Dense(width, activation="relu")(h)
    outputs = keras.layers.Dense(WIDTHS[-1])(h)
    model = keras_dist.DistributedModel(inputs, outputs)
    optimizer = keras.optimizers.Adam(1e-4)
    if config == "sharded":
        optimizer = keras_dist.ShardedOptimizer(optimizer)
    elif config == "one_segment":
        optimizer = keras_dist.ShardedOptimizer(optimizer, bucket_bytes=None)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def optimizer_state(tf, keras, strategy, optimizer) -> dict:
    """Bytes of every replica's component of the optimizer's variables."""
    per_variable = []
    for variable in optimizer.variables:
        value = variable.value if isinstance(variable, keras.Variable) else variable
        components = strategy.experimental_local_results(value)
        sizes = [
            int(c.shape.num_elements()) * tf.as_dtype(c.dtype).size for c in components
        ]
        per_variable.append(
            {
                "path": getattr(variable, "path", variable.name),
                "shape": list(components[0].shape),
                "bytes_per_replica": sizes,
            }
        )
    replicas = len(per_variable[0]["bytes_per_replica"])
    totals = [
        sum(v["bytes_per_replica"][r] for v in per_variable) for r in range(replicas)
    ]
    return {"per_replica_bytes": totals, "variables": per_variable}


def probe_collectives(tf, strategy, size: int, repeats: int) -> dict:
    """Times one all-reduce vs reduce-scatter + all-gather of `size` floats."""
    from keras_dist.core import collectives

    replicas = strategy.num_replicas_in_sync
    padded = -(-size // replicas) * replicas

    def all_reduce(flat):
        # The gradients' path: through gloo where the strategy's sums are.
        return collectives.all_reduce_sum([flat])[0]

    def scatter_gather(flat):
        local = collectives.reduce_scatter(flat)
        return tf.reshape(collectives.all_gather(local[None], axis=0), [-1])

    # A variable, not a constant: Grappler would fold a reduction of
    # constants (ReductionToOneDevice's sums) away.
    with strategy.scope():
        source = tf.Variable(tf.ones([padded]), name="probe")
    functions = {}
    for name, body in (("all_reduce", all_reduce), ("scatter_gather", scatter_gather)):

        @tf.function
        def step(body=body):
            def replica_fn():
                return tf.reduce_sum(body(tf.identity(source)))

            return strategy.run(replica_fn)

        functions[name] = step
    times = {name: [] for name in functions}
    for index in range(repeats + 1):
        for name in harness.alternate(functions, index):
            start = time.perf_counter()
            result = functions[name]()
            float(strategy.experimental_local_results(result)[0])
            if index:  # the first of each traces
                times[name].append(time.perf_counter() - start)
    return {
        "elements": padded,
        "seconds": times,
        "median_seconds": {k: statistics.median(v) for k, v in times.items() if v},
    }


def worker_main(job):
    if job["setting"] == "torch":
        result = _torch_sharding.torch_worker(
            job, WIDTHS, harness.task_index(), status_mib
        )
        _finish(job, result, workers=2)
        return
    logical = job["setting"] == "logical"
    tf, keras, keras_dist = harness.import_stack(job["replicas"] if logical else None)
    import numpy as np

    if logical:
        strategy = keras_dist.auto_strategy(cpu_replicas=job["replicas"])
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rss_start = status_mib("VmRSS")
    rng = np.random.default_rng(0)
    samples = job["batch_size"] * 4
    x = rng.normal(size=(samples, WIDTHS[0])).astype("float32")
    y = rng.normal(size=(samples, WIDTHS[-1])).astype("float32")
    dataset = harness.sharded_dataset(tf, x, y, job["batch_size"])
    with strategy.scope():
        model = build_model(keras, keras_dist, job["config"])
    rss_built = status_mib("VmRSS")
    start = time.perf_counter()
    model.fit(dataset, epochs=1, steps_per_epoch=1 + job["warmup"], verbose=0)
    first = time.perf_counter() - start
    durations = harness.timed_fit(keras, model, dataset, job["steps"])
    parameters = int(model.count_params())
    memory = {
        "rss_start_mib": rss_start,
        "rss_built_mib": rss_built,
        "rss_end_mib": status_mib("VmRSS"),
        "peak_rss_mib": status_mib("VmHWM"),
    }
    result = {
        "parameters": parameters,
        "replicas": strategy.num_replicas_in_sync,
        "local_replicas": len(strategy.extended.worker_devices),
        "step_seconds": durations,
        "median_step_seconds": statistics.median(durations),
        "trace_and_warmup_seconds": first,
        "memory": memory,
        "optimizer_state": optimizer_state(tf, keras, strategy, model.optimizer),
    }
    if job["profile"]:
        # After the memory readings: the profiler allocates its own buffers.
        tf.profiler.experimental.start(
            os.path.join(job["profile"], f"w{harness.task_index()}"),
            options=tf.profiler.experimental.ProfilerOptions(host_tracer_level=3),
        )
        model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
        tf.profiler.experimental.stop()
    if job["probe_repeats"] > 0:
        result["probe"] = probe_collectives(
            tf, strategy, parameters, job["probe_repeats"]
        )
    _finish(job, result, workers=1 if logical else 2)


def _finish(job, result, workers):
    """Writes this task's memory for the parent and exits with the others.

    Every worker's memory is read by the parent after all have exited. The
    file also says this task's collectives are done: a peer still pulling
    the last chunk of a ring from task 0 fails if task 0 exits first.
    """
    task = harness.task_index()
    with open(os.path.join(job["side"], f".task{task}.json"), "w") as handle:
        json.dump(result["memory"], handle)
    os.replace(
        os.path.join(job["side"], f".task{task}.json"),
        os.path.join(job["side"], f"task{task}.json"),
    )
    # Nobody exits before every task's last collective is done: task 0
    # waits for the others' files, the others for task 0's "done" (a task
    # that exits while its peer still pulls a chunk from it fails the peer).
    done = os.path.join(job["side"], "done")
    deadline = time.monotonic() + 300
    if task == 0:
        while (
            time.monotonic() < deadline
            and len(glob.glob(os.path.join(job["side"], "task*.json"))) < workers
        ):
            time.sleep(0.2)
        open(done, "w").close()
    else:
        while time.monotonic() < deadline and not os.path.exists(done):
            time.sleep(0.2)
    harness.finish_job(job, result)


# --- Parent ----------------------------------------------------------------------


def read_profile(folder, top=14) -> dict:
    """Worker 0's last profiled step: its length and busy time per op type.

    Ops run on several threads at once, so the busy times add up to more
    than the step; they say where the work went (matrix products, copies,
    collectives, the optimizer's arithmetic, assignments). Also the overlap:
    the span of the backward pass (`gradient_tape/...` ops), the time of
    the collectives longer than 1 ms (all-reduces, all-to-alls, gathers) and
    how much of it fell inside that span.
    """
    step_start, step_end, ops = _profile.last_step_ops(folder)
    busy: dict = {}
    for start, end, _, op_type in ops:
        busy[op_type] = busy.get(op_type, 0.0) + end - start
    ranked = sorted(busy.items(), key=lambda item: -item[1])
    backward = [e for e in ops if "gradient_tape" in e[2] and e[1] - e[0] > 0.05]
    collectives = [
        e for e in ops if e[3].startswith("Collective") and e[1] - e[0] > 1.0
    ]
    inside = 0.0
    span = (0.0, 0.0)
    if backward:
        span = (min(e[0] for e in backward), max(e[1] for e in backward))
        for start, end, *_ in collectives:
            inside += max(0.0, min(end, span[1]) - max(start, span[0]))
    return {
        "step_ms": step_end - step_start,
        "busy_ms_by_op_type": dict(ranked[:top]),
        "busy_ms_other": sum(ms for _, ms in ranked[top:]),
        "backward_ms": span[1] - span[0],
        "collective_ms": sum(e[1] - e[0] for e in collectives),
        "collective_ms_during_backward": inside,
        "collective_intervals": [
            (s - step_start, e - step_start, t) for s, e, _, t in collectives
        ],
        "backward_span": (span[0] - step_start, span[1] - step_start),
    }


def launch(args, setting, config, condition, round_index):
    side = tempfile.mkdtemp(prefix="kd_bench_sharding_")
    # One profiled step per configuration: 2 workers, unshaped, first round.
    profile = (
        os.path.join(side, "profile")
        if args.profile
        and setting == "workers"
        and condition == "unshaped"
        and round_index == 0
        else None
    )
    job = harness.job_from(
        args,
        "steps",
        "warmup",
        "batch_size",
        "probe_repeats",
        setting=setting,
        config=config,
        replicas=args.logical_replicas,
        side=side,
        profile=profile,
        torch_port=harness.import_stack()[2].cluster.free_ports(1)[0]
        if setting == "torch"
        else None,
    )
    workers = setting in WORKER_SETTINGS
    env = dict(ALLOCATORS[args.allocator])
    if setting == "torch":
        env["GLOO_SOCKET_IFNAME"] = "lo"
    elif workers:
        # Each setting names its backend: unset, `auto` would pick gloo
        # wherever PyTorch is installed.
        env["KERAS_DIST_COLLECTIVES"] = "gloo" if setting == "gloo" else "tensorflow"
    print(f"round {round_index}: {setting}, {condition}, {config}...", flush=True)
    result = harness.run_processes(
        __file__,
        job,
        workers=2 if workers else 0,
        namespace=workers,
        rate=args.rate if condition == "shaped" else None,
        env=env,
        timeout=args.timeout,
        name=f"sharding_{setting}_{condition}_{config}",
    )
    if profile:
        result["profile"] = read_profile(os.path.join(profile, "w0"))
    result["memory_per_task"] = []
    for name in sorted(glob.glob(os.path.join(side, "task*.json"))):
        with open(name) as handle:
            result["memory_per_task"].append(json.load(handle))
    shutil.rmtree(side, ignore_errors=True)
    print(
        f"  median step {result['median_step_seconds']:.3f} s, peak "
        + ", ".join(f"{m['peak_rss_mib']:.0f}" for m in result["memory_per_task"])
        + " MiB",
        flush=True,
    )
    return result


def conditions(setting):
    return ("one process",) if setting == "logical" else ("unshaped", "shaped")


def configs(setting, chosen=CONFIGS):
    if setting == "torch":
        return TORCH_CONFIGS
    return tuple(c for c in CONFIGS if c == "unsharded" or c in chosen)


def label(setting, config) -> str:
    return (TORCH_LABELS if setting == "torch" else LABELS)[config]


def summarize(runs) -> dict:
    """Per setting, condition and config: medians over the rounds."""
    summary = {}
    for setting, by_condition in runs.items():
        for condition, by_config in by_condition.items():
            row = {}
            for config, launches in by_config.items():
                peaks = [
                    m["peak_rss_mib"] for r in launches for m in r["memory_per_task"]
                ]
                ends = [
                    m["rss_end_mib"] for r in launches for m in r["memory_per_task"]
                ]
                state = launches[0]["optimizer_state"]["per_replica_bytes"]
                row[config] = {
                    "median_step_seconds": statistics.median(
                        r["median_step_seconds"] for r in launches
                    ),
                    "round_medians": [r["median_step_seconds"] for r in launches],
                    "peak_rss_mib": statistics.median(peaks),
                    "peak_rss_mib_all": peaks,
                    "rss_end_mib": statistics.median(ends),
                    "optimizer_state_bytes_per_replica": max(state),
                    "replicas": launches[0]["replicas"],
                    "local_replicas": launches[0]["local_replicas"],
                    "parameters": launches[0]["parameters"],
                }
                probes = [
                    r["probe"]["median_seconds"] for r in launches if "probe" in r
                ]
                profiles = [r["profile"] for r in launches if "profile" in r]
                if profiles:
                    row[config]["profile"] = profiles[0]
                if probes:
                    row[config]["probe_median_seconds"] = {
                        k: statistics.median(p[k] for p in probes) for k in probes[0]
                    }
            base, sharded = row["unsharded"], row["sharded"]
            row["step_ratio"] = (
                sharded["median_step_seconds"] / base["median_step_seconds"]
            )
            row["round_ratios"] = [
                s / u for s, u in zip(sharded["round_medians"], base["round_medians"])
            ]
            if "one_segment" in row:
                row["one_segment_step_ratio"] = (
                    row["one_segment"]["median_step_seconds"]
                    / base["median_step_seconds"]
                )
            if "fsdp2" in row:
                row["fsdp2_step_ratio"] = (
                    row["fsdp2"]["median_step_seconds"] / base["median_step_seconds"]
                )
            summary[f"{setting}/{condition}"] = row
    return summary


def format_table(summary, rate) -> str:
    header = [
        "setting",
        "network",
        "optimizer",
        "optimizer state per replica",
        "peak RSS per process",
        "median step (s)",
        "sharded / unsharded",
    ]
    rows = []
    for key, row in summary.items():
        setting, condition = key.split("/")
        first = row["unsharded"]
        where = {
            "workers": f"{first['replicas']} workers",
            "gloo": f"{first['replicas']} workers, gloo",
            "torch": f"{first['replicas']} workers, PyTorch (gloo)",
        }.get(setting, f"{first['replicas']} logical replicas, 1 process")
        network = f"shaped {rate}" if condition == "shaped" else condition
        for config in [c for c in configs(setting) if c in row]:
            cell = row[config]
            ratio = cell["median_step_seconds"] / first["median_step_seconds"]
            rows.append(
                [
                    where,
                    network,
                    label(setting, config),
                    f"{cell['optimizer_state_bytes_per_replica'] / MIB:.1f} MiB",
                    f"{cell['peak_rss_mib']:.0f} MiB",
                    f"{cell['median_step_seconds']:.3f}",
                    "" if config == "unsharded" else f"{ratio:.2f}x",
                ]
            )
    return harness.table(header, rows)


def format_probe(summary) -> str:
    rows = []
    for key, row in summary.items():
        probe = row["unsharded"].get("probe_median_seconds")
        if not probe:
            continue
        all_reduce, scatter = probe["all_reduce"], probe["scatter_gather"]
        rows.append(
            [key, f"{all_reduce:.3f}", f"{scatter:.3f}", f"{scatter / all_reduce:.2f}x"]
        )
    return harness.table(
        [
            "setting",
            "one all-reduce (s)",
            "reduce-scatter + all-gather (s)",
            "ratio",
        ],
        rows,
    )


def format_profile(summary) -> str:
    """Busy ms per op type in one profiled step, Adam vs sharded."""
    row = summary.get("workers/unshaped", {})
    profiles = {c: row[c]["profile"] for c in CONFIGS if "profile" in row.get(c, {})}
    present = list(profiles)
    if len(profiles) < 2:
        return ""
    busy = {c: p["busy_ms_by_op_type"] for c, p in profiles.items()}
    op_types = sorted(
        set().union(*busy.values()),
        key=lambda t: -max(b.get(t, 0) for b in busy.values()),
    )
    rows = [
        ["step (wall)", *(f"{profiles[c]['step_ms']:.0f}" for c in present)],
        *(
            [name, *(f"{profiles[c].get(key, 0):.0f}" for c in present)]
            for name, key in (
                ("backward pass (span)", "backward_ms"),
                ("collectives > 1 ms", "collective_ms"),
                ("... of it during the backward pass", "collective_ms_during_backward"),
            )
        ),
        *([f"`{t}`", *(f"{busy[c].get(t, 0):.0f}" for c in present)] for t in op_types),
        ["other op types", *(f"{profiles[c]['busy_ms_other']:.0f}" for c in present)],
    ]
    return harness.table(
        ["op type (worker 0)", *(f"{LABELS[c]} (ms)" for c in present)], rows
    )


def plot_label(key, summary, rate) -> str:
    setting, condition = key.split("/")
    replicas = summary[key]["unsharded"]["replicas"]
    if setting == "logical":
        return f"{replicas} logical replicas\n(1 process)"
    network = f"loopback {rate}" if condition == "shaped" else "loopback unshaped"
    backend = {"gloo": ", gloo", "torch": ", PyTorch"}.get(setting, "")
    return f"{replicas} workers{backend}\n{network}"


def plot(plt, report, path):
    summary = report["summary"]
    keys = list(summary)
    fig, (memory_ax, time_ax) = plt.subplots(1, 2, figsize=(13, 4.4))
    positions = range(len(keys))
    legend = {
        "unsharded": "unsharded (Adam; PyTorch: DDP + Adam)",
        "sharded": "sharded (ShardedOptimizer; PyTorch: ZeroRedundancyOptimizer)",
        "one_segment": "ShardedOptimizer, one segment (bucket_bytes=None)",
        "fsdp2": "PyTorch FSDP2 (reshard_after_forward=False)",
    }
    labelled = set()
    for position, key in zip(positions, keys):
        present = [c for c in (*CONFIGS, "fsdp2") if c in summary[key]]
        width = 0.8 / len(present)
        for offset, config in enumerate(present):
            where = position + (offset - (len(present) - 1) / 2) * width
            cell = summary[key][config]
            name = None if config in labelled else legend[config]
            labelled.add(config)
            bars = memory_ax.bar(
                where, cell["peak_rss_mib"], width, color=COLORS[config], label=name
            )
            memory_ax.bar_label(bars, fmt="%.0f", fontsize=7)
            # The optimizer state of every replica of the process.
            memory_ax.bar(
                where,
                cell["optimizer_state_bytes_per_replica"]
                * cell["local_replicas"]
                / MIB,
                width,
                fill=False,
                hatch="//",
                edgecolor="black",
                label=None if "state" in labelled else "optimizer state in the process",
            )
            labelled.add("state")
            bars = time_ax.bar(
                where,
                cell["median_step_seconds"],
                width,
                color=COLORS[config],
                label=name,
            )
            time_ax.bar_label(bars, fmt="%.2f", fontsize=7)
    names = [plot_label(k, summary, report["rate"]) for k in keys]
    for ax in (memory_ax, time_ax):
        ax.set_xticks(list(positions), names, fontsize=8)
        ax.legend(fontsize=8, loc="upper left")
    memory_ax.set_ylabel("peak RSS per process (MiB)")
    time_ax.set_ylabel("median step time (s)")
    parameters = summary[keys[0]]["unsharded"]["parameters"]
    memory_ax.set_title(f"{parameters / 1e6:.1f}M-parameter MLP, Adam: memory")
    rounds = report["rounds"]
    allocator = report.get("allocator", "default")
    time_ax.set_title(
        f"step time (median of {rounds} round{'s' if rounds > 1 else ''})"
        + ("" if allocator == "default" else f", glibc {allocator}")
    )
    memory_ax.set_ylim(0, max(memory_ax.get_ylim()[1], 1) * 1.12)
    time_ax.set_ylim(0, time_ax.get_ylim()[1] * 1.12)
    return harness.save_figure(fig, path, dpi=110)


def run(args, report):
    if set(WORKER_SETTINGS) & set(args.settings):
        harness.require_root("bench_sharding")
    runs = {
        setting: {
            c: {k: [] for k in configs(setting, args.configs)}
            for c in conditions(setting)
        }
        for setting in args.settings
    }
    for round_index in range(args.rounds):
        for setting in args.settings:
            for condition in harness.alternate(conditions(setting), round_index):
                chosen = configs(setting, args.configs)
                for config in harness.alternate(chosen, round_index):
                    runs[setting][condition][config].append(
                        launch(args, setting, config, condition, round_index)
                    )
    summary = summarize(runs)
    table = format_table(summary, args.rate)
    probe = format_probe(summary)
    print(table)
    print()
    print(probe)
    profile = format_profile(summary)
    if profile:
        print()
        print(profile)
    for key, row in summary.items():
        verdict = "meets" if row["step_ratio"] <= GOAL else "MISSES"
        print(f"{key}: sharded/unsharded {row['step_ratio']:.3f} ({verdict} {GOAL}x)")
        if "one_segment_step_ratio" in row:
            ratio = row["one_segment_step_ratio"]
            print(f"{key}: one segment/unsharded {ratio:.3f}")
        if "fsdp2_step_ratio" in row:
            print(f"{key}: FSDP2/unsharded {row['fsdp2_step_ratio']:.3f}")
    report.write(
        {
            "rate": args.rate,
            "allocator": args.allocator,
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "global_batch_size": args.batch_size,
            "model": "Dense " + " -> ".join(map(str, WIDTHS)) + ", MSE, Adam(1e-4)",
            "goal_step_ratio": GOAL,
            "summary": summary,
            "runs": runs,
            "table": table,
            "probe_table": probe,
            "profile_table": profile,
        }
    )


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot, job=worker_main))
