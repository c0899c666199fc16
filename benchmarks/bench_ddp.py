"""keras_dist against PyTorch DistributedDataParallel, step for step.

What a user would pick instead of keras_dist is PyTorch's
`DistributedDataParallel` (DDP). This script trains the same MLPs in both, in
the SAME two worker processes (each process is a worker of a
`MultiWorkerMirroredStrategy` cluster and a rank of a gloo process group), on
127.0.0.1 inside a private network namespace whose loopback is shaped to
`--rate` (token-bucket filter) or unshaped, and times the steps:

- keras_dist: `keras_dist.DistributedModel.fit` with `NoCompression()`,
  `FP16()` and `PowerSGD(rank=4, start_step=0)` (4 MiB buckets, the
  default), SGD; each model twice, with TensorFlow's collectives and with
  keras_dist's gloo backend (`KERAS_DIST_COLLECTIVES=gloo`, switched per
  model before its step is traced);
- DDP (gloo backend): no hook, `fp16_compress_hook` and `powerSGD_hook`
  (rank 4, warm start and error feedback as keras_dist's), SGD, with
  `bucket_cap_mb=4` to match keras_dist's buckets; uncompressed also with
  DDP's default 25 MiB, and PowerSGD also in one bucket with the stock hook
  unwrapped (see `OrderedHook`).

Two models, the same per-worker batch in both frameworks: `balanced` (8 x
Dense(1024) on 1024 inputs, 10 logits, 8.4M parameters, batch 1024 per
worker: compute and communication of the same order at 1 Gbit/s) and
`mlp21m` (1024-4096-4096-10, 21M parameters, batch 8 per worker:
communication dominates). Four conditions, each a fresh pair of processes:
`shaped` / `unshaped` loopback, each with the default threads and with the
cores split (`TF_NUM_INTRAOP_THREADS=1` and `torch.set_num_threads(1)`, what
`keras-dist launch` and torchrun do on one machine). Plus a raw all-reduce of
100 MB of float32 in each framework (TensorFlow's collective through the
strategy, whole and subdivided; keras_dist's gloo backend; gloo's
`all_reduce`) against the ring floor 2(N-1)·S/B.

The frameworks alternate block by block inside the same processes (the
order reversed every other round), so a change in the machine's load hits
both alike; the ratio keras_dist/DDP is the ratio of the medians of all the
timed steps.

PyTorch's stock `powerSGD_hook` deadlocks on gloo with more than one bucket
(measured: both ranks hang at the first compressing step): it issues the
all-reduces of the P and Q factors from the completion callbacks of each
bucket's first all-reduce, so two ranks can issue the collectives of
different buckets in different orders. `OrderedHook` runs the stock hook
for one bucket at a time on a thread of its own: the autograd thread goes on
computing, and every rank issues every collective in bucket order. The
arithmetic is the stock hook's (the weights' sum matched a wrapper that
waits inside the hook).

Needs root and iproute2 (`ip`, `tc`), and PyTorch (the CPU build, extra
`bench`: `pip install ".[bench]"`):

    sudo .venv/bin/python benchmarks/bench_ddp.py --steps 4 --rounds 3 \\
        --out docs/benchmarks/ddp.json

`--threads-check` measures the launcher's thread split instead
(`keras-dist launch`'s `TF_NUM_INTRAOP_THREADS`, keras_dist only, no PyTorch
needed): the balanced model's step on 1, 2 and 4 workers started by
`keras_dist.launcher.launch` with the split and without it
(`KERAS_DIST_SPLIT_THREADS=0`), 2 workers also with 1 inter-op thread, and
one process of 2 logical CPU replicas (`cpu_replicas=2`, which the launcher
does not start) with TensorFlow's default and with 1 intra-op thread; on the
unshaped loopback, `--rounds` launches per configuration:

    .venv/bin/python benchmarks/bench_ddp.py --threads-check --steps 6 \\
        --rounds 3 --out docs/benchmarks/ddp_threads.json

Prints a markdown table; writes the raw step times, the environment and the
command to the JSON file, and a plot next to it (`.png`; none for
`--threads-check`).
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import statistics
import sys
import time

import _harness as harness
from _torch_ddp import (
    DDP_CONFIGS,
    DDP_LABELS,
    POWERSGD_RANK,
    build_ddp,
    torch_mlp,
    torch_steps,
)

INSTALL_HINT = (
    "bench_ddp.py compares against PyTorch DDP and needs PyTorch: run "
    '`pip install ".[bench]"` in the clone\'s root (the CPU build of torch '
    "2.13.0)."
)
MODELS = {
    # name: (input width, hidden layers, per-worker batch, learning rate)
    "balanced": (1024, [1024] * 8, 1024, 1e-4),
    "mlp21m": (1024, [4096, 4096], 8, 1e-2),
}
HOOKS = ("none", "fp16", "powersgd")
HOOK_LABELS = {"none": "uncompressed", "fp16": "FP16", "powersgd": "PowerSGD r4"}
CONDITIONS = {
    "shaped": {"shaped": True, "split": False},
    "shaped_split": {"shaped": True, "split": True},
    "unshaped": {"shaped": False, "split": False},
    "unshaped_split": {"shaped": False, "split": True},
}
CONDITION_LABELS = {
    "shaped": "{rate}, default threads",
    "shaped_split": "{rate}, split threads",
    "unshaped": "unshaped, default threads",
    "unshaped_split": "unshaped, split threads",
}
ALL_REDUCE_BYTES = 100_000_000
WORKERS = 2
SPLIT_ENV = {"TF_NUM_INTRAOP_THREADS": "1"}
# --threads-check: (label, workers, cpu_replicas, extra environment).
THREAD_RUNS = [
    ("1 worker", 1, None, {}),
    ("2 workers", 2, None, {}),
    ("2 workers, inter-op 1", 2, None, {"TF_NUM_INTEROP_THREADS": "1"}),
    ("4 workers", 4, None, {}),
    ("1 process, cpu_replicas=2", 0, 2, {}),
]


def parse_args(argv=None):
    parser = harness.parser(
        "keras_dist vs PyTorch DDP: step time of the same MLPs in the same 2 "
        "worker processes, shaped and unshaped loopback, default and split "
        "threads, plus a raw 100 MB all-reduce (needs root and PyTorch; "
        "--replot does not).",
        "ddp.json",
        jobs=True,
        steps=(4, "Timed steps per block (per launch with --threads-check)."),
        rounds=(3, "Rounds: blocks per configuration (launches with --threads-check)."),
    )
    parser.add_argument("--rate", default="1gbit", help="tc rate (1gbit).")
    parser.add_argument(
        "--models", nargs="+", choices=list(MODELS), default=list(MODELS)
    )
    parser.add_argument("--hooks", nargs="+", choices=list(HOOKS), default=list(HOOKS))
    parser.add_argument(
        "--conditions", nargs="+", choices=list(CONDITIONS), default=list(CONDITIONS)
    )
    parser.add_argument(
        "--warmup",
        type=harness.positive_int,
        default=3,
        help="Untimed steps per config.",
    )
    parser.add_argument(
        "--all-reduce-reps",
        type=int,
        default=2,
        help="Timed 100 MB all-reduces per framework per round (0: none).",
    )
    parser.add_argument(
        "--local",
        action="store_true",
        help="Also time each model without communication in the same "
        "processes: Keras on one device, PyTorch without DDP.",
    )
    parser.add_argument(
        "--frameworks",
        choices=("both", "keras", "ddp"),
        default="both",
        help="Which framework's models the worker processes build and time: "
        "both (side by side, the ratios), or one (its medians only; run the "
        "other in processes of its own to compare without the other "
        "framework's threads in the process).",
    )
    parser.add_argument(
        "--threads-check",
        action="store_true",
        help="Measure keras-dist launch's thread split instead (no PyTorch).",
    )
    parser.add_argument("--timeout", type=float, default=1500)
    args = parser.parse_args(argv)
    if args.local and args.frameworks != "both":
        parser.error(
            f"--local times both frameworks without communication; received "
            f"--frameworks {args.frameworks}. Drop --local, or use --frameworks both."
        )
    return args


def require_torch() -> None:
    """Exits with status 2 and the install line when PyTorch is missing."""
    if importlib.util.find_spec("torch") is None:
        print(INSTALL_HINT, file=sys.stderr)
        raise SystemExit(2)


# --- Worker: both frameworks in one process -----------------------------------


def keras_hook(keras_dist, hook):
    compression = keras_dist.compression
    if hook == "fp16":
        return compression.FP16()
    if hook == "powersgd":
        return compression.PowerSGD(rank=POWERSGD_RANK, start_step=0)
    return compression.NoCompression()


def all_reduce_times(tf, torch, strategy, job):
    """Alternating blocks of a 100 MB float32 all-reduce in each framework."""
    import torch.distributed as dist

    count = ALL_REDUCE_BYTES // 4
    source = tf.ones([count], tf.float32)
    set_subdivisions, default_subdivisions = harness.ring_subdivisions()

    def traced_all_reduce(subdivisions):
        # The launchers' setting is read when the all-reduce is traced.
        set_subdivisions(strategy, subdivisions)

        @tf.function
        def tf_all_reduce():
            def step():
                ctx = tf.distribute.get_replica_context()
                summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, source)
                return summed[:1]

            return strategy.run(step)

        tf_all_reduce.get_concrete_function()

        def run():
            start = time.perf_counter()
            float(tf_all_reduce()[0])
            return time.perf_counter() - start

        return run

    # TensorFlow's whole-tensor ring first, then keras_dist's subdivided one
    # (what the models below train with).
    run_tf_whole = traced_all_reduce(-1)
    run_tf = traced_all_reduce(default_subdivisions)

    # keras_dist's gloo backend: the collective layer's sum, traced with it.
    from keras_dist.core import collectives

    use_gloo = harness.gloo_switch()
    use_gloo(strategy, True)

    @tf.function
    def backend_all_reduce():
        def step():
            return collectives.all_reduce_sum([source])[0][:1]

        return strategy.run(step)

    backend_all_reduce.get_concrete_function()
    use_gloo(strategy, False)

    def run_backend():
        start = time.perf_counter()
        float(backend_all_reduce()[0])
        return time.perf_counter() - start

    tensor = torch.ones(count, dtype=torch.float32)

    def run_torch():
        start = time.perf_counter()
        dist.all_reduce(tensor)
        return time.perf_counter() - start

    runners = {
        "tensorflow": run_tf,
        "tensorflow_whole": run_tf_whole,
        "keras_dist_gloo": run_backend,
        "gloo": run_torch,
    }
    for runner in runners.values():
        runner()  # trace, connect, allocate
    times = {name: [] for name in runners}
    for round_index in range(job["rounds"]):
        for name in harness.alternate(runners, round_index):
            times[name] += [runners[name]() for _ in range(job["all_reduce_reps"])]
    return {
        name: {"seconds": values, "median_seconds": statistics.median(values)}
        for name, values in times.items()
    }


def worker_main(job):
    if job.get("threads_check"):
        threads_worker(job)
        return
    tf, keras, keras_dist = harness.import_stack()
    import numpy as np
    import torch
    import torch.distributed as dist

    if job["split"]:
        torch.set_num_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = harness.task_index()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{job['gloo_port']}",
        rank=rank,
        world_size=WORKERS,
    )
    results = {
        # What a user gets without choosing (gloo where PyTorch is, as here);
        # the keras / keras_gloo runs below set each explicitly.
        "default_collectives": harness.default_collectives(strategy),
        "threads": {
            "tf_intra_op_env": os.environ.get("TF_NUM_INTRAOP_THREADS"),
            "torch_intra_op": torch.get_num_threads(),
            "torch_inter_op": torch.get_num_interop_threads(),
        },
    }
    if job["all_reduce_reps"]:
        results["all_reduce"] = all_reduce_times(tf, torch, strategy, job)
    for model_name in job["models"]:
        width, hidden, batch, learning_rate = MODELS[model_name]
        rng = np.random.default_rng(0)
        # The global batch: each worker's tf.data shard is `batch` rows.
        x = rng.normal(size=(batch * WORKERS * 4, width)).astype("float32")
        y = rng.integers(0, 10, size=batch * WORKERS * 4).astype("int32")
        dataset = harness.sharded_dataset(tf, x, y, batch * WORKERS)
        own = slice(rank * batch, (rank + 1) * batch)
        tx, ty = torch.from_numpy(x[own]), torch.from_numpy(y[own]).long()
        runners, first = {}, {}
        use_gloo = harness.gloo_switch()
        frameworks = job.get("frameworks", "both")
        keras_backends = () if frameworks == "ddp" else ("keras", "keras_gloo")
        for hook in job["hooks"]:
            # keras_dist with TensorFlow's collectives, then with its gloo
            # backend (the switch acts on what the warm-up fit traces).
            for backend in keras_backends:
                use_gloo(strategy, backend == "keras_gloo")
                with strategy.scope():
                    model = harness.build_mlp(
                        keras,
                        keras_dist,
                        width,
                        hidden,
                        keras_hook(keras_dist, hook),
                        learning_rate,
                    )
                start = time.perf_counter()
                model.fit(dataset, epochs=1, steps_per_epoch=job["warmup"], verbose=0)
                first[f"{hook}/{backend}"] = time.perf_counter() - start
                runners[f"{hook}/{backend}"] = (
                    lambda steps, model=model, dataset=dataset: harness.timed_fit(
                        keras, model, dataset, steps
                    )
                )
            use_gloo(strategy, False)
            for config in DDP_CONFIGS[hook] if frameworks != "keras" else ():
                ddp, optimizer = build_ddp(
                    torch, width, hidden, hook, config, learning_rate
                )
                start = time.perf_counter()
                torch_steps(torch, ddp, optimizer, tx, ty, job["warmup"])
                first[f"{hook}/{config}"] = time.perf_counter() - start
                runners[f"{hook}/{config}"] = (
                    lambda steps, ddp=ddp, optimizer=optimizer, tx=tx, ty=ty: (
                        torch_steps(torch, ddp, optimizer, tx, ty, steps)
                    )
                )
        groups = list(job["hooks"])
        if job.get("local"):
            runners.update(
                local_runners(tf, keras, keras_dist, torch, model_name, x, y, own)
            )
            groups.append("local")
        durations = {name: [] for name in runners}
        for round_index in range(job["rounds"]):
            for hook in harness.alternate(groups, round_index):
                names = [n for n in runners if n.startswith(hook + "/")]
                for name in harness.alternate(names, round_index):
                    durations[name] += runners[name](job["steps"])
        results[model_name] = {
            name: {
                "step_seconds": values,
                "median_step_seconds": statistics.median(values),
                "warmup_seconds": first.get(name),
            }
            for name, values in durations.items()
        }
        del runners
    harness.finish_job(job, results)


def local_runners(tf, keras, keras_dist, torch, model_name, x, y, own):
    """The model of `model_name` on this worker's rows without communication:
    Keras outside the strategy's scope (one device; `fit` as above, the
    rows in batches of the per-worker batch) and PyTorch without DDP. What
    each framework's step costs before any all-reduce: the floor under
    keras_dist / DDP."""
    width, hidden, batch, learning_rate = MODELS[model_name]
    local_data = (
        tf.data.Dataset.from_tensor_slices((x[own], y[own])).batch(batch).repeat()
    )
    model = harness.build_mlp(
        keras, keras_dist, width, hidden, keras_hook(keras_dist, "none"), learning_rate
    )
    model.fit(local_data, epochs=1, steps_per_epoch=3, verbose=0)
    plain = torch_mlp(torch, width, hidden)
    optimizer = torch.optim.SGD(plain.parameters(), lr=learning_rate)
    tx, ty = torch.from_numpy(x[own]), torch.from_numpy(y[own]).long()
    torch_steps(torch, plain, optimizer, tx, ty, 3)
    return {
        "local/keras": lambda steps: harness.timed_fit(keras, model, local_data, steps),
        "local/torch": lambda steps: torch_steps(
            torch, plain, optimizer, tx, ty, steps
        ),
    }


# --- Parent: namespaces, workers, report --------------------------------------


def run_condition(args, name):
    condition = CONDITIONS[name]
    cluster = harness.import_stack()[2].cluster
    job = harness.job_from(
        args,
        *(
            "models",
            "hooks",
            "steps",
            "rounds",
            "warmup",
            "all_reduce_reps",
            "local",
            "frameworks",
        ),
        split=condition["split"],
        gloo_port=cluster.free_ports(1)[0],
    )
    env = {"GLOO_SOCKET_IFNAME": "lo", **(SPLIT_ENV if condition["split"] else {})}
    return harness.run_processes(
        __file__,
        job,
        workers=WORKERS,
        namespace=True,
        rate=args.rate if condition["shaped"] else None,
        env=env,
        timeout=args.timeout,
        name=f"ddp_{name}",
    )


def ring_floor_seconds(rate: str) -> float:
    """2(N-1)·S/B: the bytes a ring all-reduce of S bytes puts through a
    loopback that all N workers share, at `rate` (`tc` units, SI)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
    for suffix, scale in units.items():
        if rate.endswith(suffix):
            bits_per_second = float(rate[: -len(suffix)]) * scale
            break
    else:
        raise ValueError(
            f"`--rate` must end in kbit, mbit or gbit. Received: {rate!r}."
        )
    return 2 * (WORKERS - 1) * ALL_REDUCE_BYTES * 8 / bits_per_second


def round_ratios(numerator, denominator, steps: int) -> list:
    """Per round, the ratio of two configurations' median steps.

    `numerator` and `denominator` are `step_seconds` lists: `steps` values
    per round, rounds in order. The blocks of one round ran minutes apart
    at most, so a round's ratio is paired against the machine's drift
    (other tenants, frequency) that moves a whole run's medians.
    """
    return [
        statistics.median(numerator[start : start + steps])
        / statistics.median(denominator[start : start + steps])
        for start in range(0, min(len(numerator), len(denominator)), steps)
    ]


def summarize(results, steps=None) -> dict:
    """keras_dist/DDP ratio of the medians, per condition, model and hook.

    With `steps` (timed steps per block), also each round's paired
    keras_dist gloo/DDP 4 MiB ratio (`round_ratios`).
    """
    summary = {}
    for condition, entry in results.items():
        for model_name in MODELS:
            rows = entry.get(model_name)
            if not rows:
                continue
            for hook in HOOKS:
                configs = [f"{hook}/{c}" for c in ("keras", *DDP_CONFIGS[hook])]
                if any(name not in rows for name in configs):
                    continue  # one framework only (`--frameworks`)
                keras_step = rows[f"{hook}/keras"]["median_step_seconds"]
                item = {"keras_dist": keras_step}
                for config in DDP_CONFIGS[hook]:
                    ddp_step = rows[f"{hook}/{config}"]["median_step_seconds"]
                    item[config] = ddp_step
                    item[f"ratio_{config}"] = keras_step / ddp_step
                if f"{hook}/keras_gloo" in rows:
                    gloo_step = rows[f"{hook}/keras_gloo"]["median_step_seconds"]
                    item["keras_dist_gloo"] = gloo_step
                    item["ratio_gloo_ddp_4m"] = gloo_step / item["ddp_4m"]
                    if steps:
                        item["round_ratios_gloo_ddp_4m"] = round_ratios(
                            rows[f"{hook}/keras_gloo"]["step_seconds"],
                            rows[f"{hook}/ddp_4m"]["step_seconds"],
                            steps,
                        )
                summary[f"{condition}/{model_name}/{hook}"] = item
    return summary


def condition_label(condition: str, rate: str) -> str:
    """The row label of `condition` (a key of `CONDITIONS`) at tc `rate`."""
    return CONDITION_LABELS[condition].format(rate=rate.replace("gbit", " Gbit/s"))


def summarize_local(results) -> dict:
    """Keras/PyTorch ratio of the medians without communication (`--local`)."""
    summary = {}
    for condition, entry in results.items():
        for model_name in MODELS:
            rows = entry.get(model_name) or {}
            if "local/keras" not in rows:
                continue
            keras_step = rows["local/keras"]["median_step_seconds"]
            torch_step = rows["local/torch"]["median_step_seconds"]
            summary[f"{condition}/{model_name}"] = {
                "keras": keras_step,
                "torch": torch_step,
                "ratio": keras_step / torch_step,
            }
    return summary


def format_local(summary, rate) -> str:
    rows = [
        [
            condition_label(key.split("/")[0], rate),
            key.split("/")[1],
            f"{item['keras']:.3f}",
            f"{item['torch']:.3f}",
            f"**{item['ratio']:.2f}**",
        ]
        for key, item in summary.items()
    ]
    header = [
        "network, threads",
        "model",
        "Keras, one device (s)",
        "PyTorch, no DDP (s)",
        "Keras / PyTorch",
    ]
    return harness.table(header, rows, align="llrrr")


def format_table(summary, rate) -> str:
    rows = []
    for key, item in summary.items():
        condition, model_name, hook = key.split("/")
        rows.append(
            [
                condition_label(condition, rate),
                model_name,
                HOOK_LABELS[hook],
                f"{item['keras_dist']:.3f}",
                f"{item.get('keras_dist_gloo', float('nan')):.3f}",
                f"{item['ddp_4m']:.3f}",
                f"**{item['ratio_ddp_4m']:.2f}**",
                f"**{item.get('ratio_gloo_ddp_4m', float('nan')):.2f}**",
                spread(item.get("round_ratios_gloo_ddp_4m")),
                "; ".join(
                    f"{DDP_LABELS[c]}: {item[c]:.3f} ({item['ratio_' + c]:.2f})"
                    for c in DDP_CONFIGS[hook][1:]
                ),
            ]
        )
    header = [
        "network, threads",
        "model",
        "hook",
        "keras_dist step (s)",
        "keras_dist, gloo backend step (s)",
        "DDP 4 MiB step (s)",
        "keras_dist / DDP",
        "keras_dist gloo / DDP",
        "gloo / DDP per round: median (min-max)",
        "other DDP: step (s) (keras_dist / it)",
    ]
    return harness.table(header, rows, align="lllrrrrrrr")


def format_medians(results, rate) -> str:
    """Each configuration's median step: a `--frameworks` run's table."""
    rows = []
    for condition, entry in results.items():
        for model_name in MODELS:
            for name, item in (entry.get(model_name) or {}).items():
                rows.append(
                    [
                        condition_label(condition, rate),
                        model_name,
                        name,
                        f"{item['median_step_seconds']:.3f}",
                    ]
                )
    header = ["network, threads", "model", "configuration", "median step (s)"]
    return harness.table(header, rows, align="lllr")


def spread(ratios) -> str:
    """`median (min-max)` of per-round ratios; blank for an older report."""
    if not ratios:
        return ""
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def format_all_reduce(results, rate) -> str:
    floor = ring_floor_seconds(rate)
    rows = []
    for condition, entry in results.items():
        times = entry.get("all_reduce")
        if not times:
            continue
        shaped = CONDITIONS[condition]["shaped"]
        tf_s = times["tensorflow"]["median_seconds"]
        gloo_s = times["gloo"]["median_seconds"]
        whole = times.get("tensorflow_whole", {}).get("median_seconds")
        backend = times.get("keras_dist_gloo", {}).get("median_seconds")
        rows.append(
            [
                condition_label(condition, rate),
                f"{tf_s:.3f}",
                "" if whole is None else f"{whole:.3f}",
                "" if backend is None else f"{backend:.3f}",
                f"{gloo_s:.3f}",
                f"{tf_s / gloo_s:.2f}",
                "" if backend is None else f"{backend / gloo_s:.2f}",
                f"{floor:.2f}" if shaped else "",
                f"{floor / tf_s:.0%}" if shaped else "",
                "" if backend is None or not shaped else f"{floor / backend:.0%}",
                f"{floor / gloo_s:.0%}" if shaped else "",
            ]
        )
    header = [
        "network, threads",
        "TensorFlow, subdivided (s)",
        "TensorFlow, whole tensors (s)",
        "keras_dist gloo backend (s)",
        "gloo (s)",
        "TF / gloo",
        "keras_dist gloo / gloo",
        "ring floor (s)",
        "TF of floor",
        "keras_dist gloo of floor",
        "gloo of floor",
    ]
    return harness.table(header, rows, align="lrrrrrrrrrr")


def plot(plt, report, path):
    if report.get("threads_check"):
        return None
    summary, rate = report["summary"], report["rate"]
    if not summary:
        return None  # one framework only (`--frameworks`): no ratio to plot
    conditions = list(dict.fromkeys(k.split("/")[0] for k in summary))
    models = list(dict.fromkeys(k.split("/")[1] for k in summary))
    all_reduce = {
        c: r["all_reduce"] for c, r in report["results"].items() if "all_reduce" in r
    }
    columns = len(models) + (1 if all_reduce else 0)
    fig, axes = plt.subplots(1, columns, figsize=(4.6 * columns, 3.9), squeeze=False)
    width = 0.8 / max(len(conditions), 1)
    label_rate = rate.replace("gbit", " Gbit/s")
    for column, model_name in enumerate(models):
        ax = axes[0][column]
        hooks = [
            h for h in HOOKS if any(k.endswith(f"/{model_name}/{h}") for k in summary)
        ]
        for offset, condition in enumerate(conditions):
            values = [
                summary.get(f"{condition}/{model_name}/{h}", {}).get("ratio_ddp_4m", 0)
                for h in hooks
            ]
            bars = ax.bar(
                [
                    i + (offset - (len(conditions) - 1) / 2) * width
                    for i in range(len(hooks))
                ],
                values,
                width,
                label=condition_label(condition, rate),
            )
            ax.bar_label(bars, fmt="%.2f", fontsize=6)
            gloo_values = [
                summary.get(f"{condition}/{model_name}/{h}", {}).get(
                    "ratio_gloo_ddp_4m"
                )
                for h in hooks
            ]
            if any(v is not None for v in gloo_values):
                # The gloo backend's ratio: a black tick on the same bar.
                ax.scatter(
                    [
                        i + (offset - (len(conditions) - 1) / 2) * width
                        for i in range(len(hooks))
                    ],
                    [v or 0 for v in gloo_values],
                    marker="_",
                    s=120,
                    color="black",
                    zorder=3,
                    label="keras_dist, gloo backend" if offset == 0 else None,
                )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.35)
        ax.set_xticks(range(len(hooks)), [HOOK_LABELS[h] for h in hooks], fontsize=8)
        ax.set_ylabel("step time keras_dist / DDP (<1: keras_dist faster)", fontsize=8)
        ax.set_title(f"{model_name}", fontsize=9)
        if column == 0:
            ax.legend(fontsize=7, ncol=2, loc="upper left")
    if all_reduce:
        ax = axes[0][-1]
        names = list(all_reduce)
        positions = range(len(names))
        frameworks = [
            f
            for f in ("tensorflow_whole", "tensorflow", "keras_dist_gloo", "gloo")
            if all(f in all_reduce[c] for c in names)
        ]
        labels = {
            "tensorflow_whole": "TensorFlow, whole tensors",
            "tensorflow": "TensorFlow, subdivided (keras_dist)",
            "keras_dist_gloo": "keras_dist, gloo backend",
            "gloo": "gloo (PyTorch)",
        }
        bar = 0.8 / len(frameworks)
        for offset, framework in enumerate(frameworks):
            values = [all_reduce[c][framework]["median_seconds"] for c in names]
            bars = ax.bar(
                [p + (offset - (len(frameworks) - 1) / 2) * bar for p in positions],
                values,
                bar,
                label=labels[framework],
            )
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(
            ring_floor_seconds(rate),
            color="red",
            linestyle="--",
            linewidth=0.8,
            label=f"ring floor at {label_rate}",
        )
        ax.set_xticks(
            list(positions),
            [condition_label(c, rate).replace(", ", "\n") for c in names],
            fontsize=7,
        )
        ax.set_ylabel("seconds (median)")
        ax.set_title("all-reduce of 100 MB float32, 2 workers", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(
        "keras_dist (TensorFlow MWMS) vs PyTorch DDP (gloo), same MLP and batch, "
        "2 workers on 2 cores",
        fontsize=10,
    )
    return harness.save_figure(fig, path)


def run(args, report):
    if args.threads_check:
        return run_threads_check(args, report)
    require_torch()
    harness.require_root("bench_ddp")
    import torch

    results = {}
    for name in args.conditions:
        print(f"Running {name}...", flush=True)
        results[name] = run_condition(args, name)
    summary = summarize(results, args.steps)
    if args.frameworks == "both":
        table = format_table(summary, args.rate)
    else:
        table = format_medians(results, args.rate)
    all_reduce = format_all_reduce(results, args.rate)
    local = summarize_local(results)
    print(table)
    print()
    print(all_reduce)
    if local:
        print("\nWithout communication, in the same processes:\n")
        print(format_local(local, args.rate))
    defaults = {
        name: entry.get("default_collectives") for name, entry in results.items()
    }
    print(
        "\nkeras_dist's default collectives on these workers "
        f"(KERAS_DIST_COLLECTIVES={os.environ.get('KERAS_DIST_COLLECTIVES', '')!r}): "
        + "; ".join(f"{name}: {value}" for name, value in defaults.items())
    )
    fields = {
        "default_collectives": defaults,
        "collectives_env": os.environ.get("KERAS_DIST_COLLECTIVES"),
        "rate": args.rate,
        "steps_per_block": args.steps,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "all_reduce_reps": args.all_reduce_reps,
        "models": {k: MODELS[k] for k in args.models},
        "ring_floor_seconds": ring_floor_seconds(args.rate),
        "results": results,
        "summary": summary,
        "local_summary": local,
        "table": table,
        "all_reduce_table": all_reduce,
    }
    report.write(fields, torch=torch.__version__)
    return 0


# --- --threads-check: keras-dist launch's thread split ------------------------


def threads_worker(job):
    """One task of a launched job (or the one process of `cpu_replicas`)."""
    replicas = job["cpu_replicas"]
    tf, keras, keras_dist = harness.import_stack()
    import numpy as np

    strategy = keras_dist.auto_strategy(cpu_replicas=replicas)
    width, hidden, batch, learning_rate = MODELS["balanced"]
    global_batch = batch * strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    x = rng.normal(size=(global_batch * 2, width)).astype("float32")
    y = rng.integers(0, 10, size=global_batch * 2).astype("int32")
    dataset = harness.sharded_dataset(tf, x, y, global_batch)
    with strategy.scope():
        model = harness.build_mlp(
            keras,
            keras_dist,
            width,
            hidden,
            keras_dist.compression.NoCompression(),
            learning_rate,
        )
    model.fit(dataset, epochs=1, steps_per_epoch=job["warmup"], verbose=0)
    durations = harness.timed_fit(keras, model, dataset, job["steps"])
    harness.finish_job(
        job,
        {
            "step_seconds": durations,
            "median_step_seconds": statistics.median(durations),
            "replicas": strategy.num_replicas_in_sync,
            "TF_NUM_INTRAOP_THREADS": os.environ.get("TF_NUM_INTRAOP_THREADS"),
            "TF_NUM_INTEROP_THREADS": os.environ.get("TF_NUM_INTEROP_THREADS"),
        },
    )


def launch_threads_job(args, workers, replicas, env, split, timeout):
    """Runs `threads_worker` through `keras_dist.launcher.launch` (or, for
    logical replicas, as one process with the intra-op threads the rule
    would give per replica when `split`); returns task 0's result."""
    import tempfile

    from keras_dist import launcher

    job = harness.job_from(args, "steps", "rounds", "warmup")
    job.update(threads_check=True, cpu_replicas=replicas)
    base = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG",)}
    for name in ("TF_NUM_INTRAOP_THREADS", "OMP_NUM_THREADS", "TF_NUM_INTEROP_THREADS"):
        base.pop(name, None)
    base.update(env, PYTHONPATH=harness.REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    if not workers:
        # One process of `replicas` logical devices: the launcher's rule counts
        # processes, so it sets nothing; "split" here is what a rule counting
        # replicas would set (cores // replicas).
        if split:
            base["TF_NUM_INTRAOP_THREADS"] = str(max(1, os.cpu_count() // replicas))
        return harness.run_processes(
            __file__, job, env=base, timeout=timeout, name="ddp_threads"
        )
    base[launcher.SPLIT_THREADS_ENV_VAR] = "1" if split else "0"
    folder = tempfile.mkdtemp(prefix="kd_bench_ddp_threads_")
    job["result"] = os.path.join(folder, "result.json")
    command = [sys.executable, os.path.abspath(__file__), "--job", json.dumps(job)]
    output = io.StringIO()
    status = launcher.launch(
        command, workers=workers, environ=base, stdout=output, stderr=output
    )
    if status != 0 or not os.path.exists(job["result"]):
        tail = output.getvalue()[-3000:]
        raise RuntimeError(f"launch of {workers} workers failed ({status}):\n{tail}")
    with open(job["result"]) as handle:
        return json.load(handle)


def run_threads_check(args, report):
    """`--rounds` launches per configuration (the order reversed every other
    round; a thread setting is fixed for a process's life, so the split and
    no split cannot alternate inside one), `--steps` timed steps each."""
    launches = []
    for round_index in range(args.rounds):
        for index, (label, workers, replicas, env) in enumerate(
            harness.alternate(THREAD_RUNS, round_index)
        ):
            for split in harness.alternate((True, False), index + round_index):
                if env and not split:
                    continue  # an inter-op variant of the split only
                print(f"Round {round_index}: {label}, split={split}...", flush=True)
                result = launch_threads_job(
                    args, workers, replicas, env, split, args.timeout
                )
                launches.append(
                    {
                        "label": label,
                        "workers": workers,
                        "cpu_replicas": replicas,
                        "env": env,
                        "split": split,
                        "round": round_index,
                        **result,
                    }
                )
    summary = {}
    for label, *_ in THREAD_RUNS:
        for split in (True, False):
            runs = [r for r in launches if r["label"] == label and r["split"] == split]
            if not runs:
                continue
            steps = [s for r in runs for s in r["step_seconds"]]
            summary[f"{label}/{'split' if split else 'no split'}"] = {
                "median_step_seconds": statistics.median(steps),
                "launch_medians": [r["median_step_seconds"] for r in runs],
                "TF_NUM_INTRAOP_THREADS": runs[0]["TF_NUM_INTRAOP_THREADS"],
                "TF_NUM_INTEROP_THREADS": runs[0]["TF_NUM_INTEROP_THREADS"],
            }
    table = format_threads_table(summary)
    print(table)
    report.write(
        {
            "threads_check": True,
            "cores": len(os.sched_getaffinity(0)),
            "model": MODELS["balanced"],
            "steps_per_launch": args.steps,
            "launches_per_config": args.rounds,
            "warmup": args.warmup,
            "launches": launches,
            "summary": summary,
            "table": table,
        }
    )
    return 0


def format_threads_table(summary) -> str:
    def cell(item):
        low, high = min(item["launch_medians"]), max(item["launch_medians"])
        return f"{item['median_step_seconds']:.3f} ({low:.3f}-{high:.3f})"

    rows = []
    for label, *_ in THREAD_RUNS:
        on = summary[f"{label}/split"]
        # The inter-op variant is compared with the 2 workers without split.
        off = summary.get(f"{label}/no split") or summary["2 workers/no split"]
        rows.append(
            [
                label,
                on["TF_NUM_INTRAOP_THREADS"] or "unset (TF default)",
                on["TF_NUM_INTEROP_THREADS"] or "unset",
                cell(off),
                cell(on),
                f"{off['median_step_seconds'] / on['median_step_seconds']:.2f}x",
            ]
        )
    header = [
        "tasks",
        "intra-op with split",
        "inter-op",
        "step, no split (s) (launch medians)",
        "step, split (s) (launch medians)",
        "speed-up",
    ]
    return harness.table(header, rows, align="lllrrr")


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot, job=worker_main))
