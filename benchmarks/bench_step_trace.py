"""Where one uncompressed step's time goes: keras_dist and DDP, profiled.

Each framework alone in its own pair of worker processes (2 workers on
127.0.0.1 inside a private network namespace, unshaped loopback), on the
21M-parameter MLP of `bench_ddp.py` (1024-4096-4096-10, batch 8 per worker,
SGD, 4 MiB buckets, no compression): keras_dist's `DistributedModel.fit`
with its default collectives (gloo where PyTorch is installed), and PyTorch
`DistributedDataParallel` over gloo with `OMP_WAIT_POLICY=PASSIVE` (DDP's
best on 2 cores: docs/benchmarks/ddp.md; `--omp-default` leaves PyTorch's
default). Each pair of processes warms up, times `--steps` steps, then
runs 3 steps under its framework's profiler (TensorFlow's, host tracer
level 3; `torch.profiler`). The frameworks alternate for `--rounds` rounds
(keras_dist, DDP, then DDP, keras_dist, ...), a fresh pair of processes
each time.

Reports: the step times of both (the ratio of their medians); keras_dist's
last profiled step of worker 0 as a timeline of its ops longer than 0.3
ms (start and duration in ms from the step's start: the forward and
backward matrix products, the gloo starts and waits, the update) and its
time per op type; DDP's `torch.profiler` table (self CPU time per op over
the 3 steps). The profiled steps are slower than the timed ones (the
profiler's own work): read them for the order of things, the timed steps
for the time.

Needs root and iproute2 (`ip`), and PyTorch (extra `bench`):

    sudo .venv/bin/python benchmarks/bench_step_trace.py --steps 8 \\
        --rounds 2 --out docs/benchmarks/step_trace.json
"""

from __future__ import annotations

import collections
import os
import shutil
import statistics
import sys
import tempfile

import _harness as harness
import _profile
from _torch_ddp import build_ddp, torch_steps

# (input width, hidden layers, per-worker batch, learning rate): bench_ddp's
# "mlp21m".
MODEL = (1024, [4096, 4096], 8, 1e-2)
WORKERS = 2
WARMUP_STEPS = 5
PROFILED_STEPS = 3
# Ops shorter than this are left out of the timeline.
TIMELINE_MIN_MS = 0.3


def parse_args(argv=None):
    parser = harness.parser(
        __doc__.split("\n")[0],
        "step_trace.json",
        jobs=True,
        steps=(8, "Timed steps per framework and round."),
        rounds=(2, "Rounds; each runs both frameworks in fresh processes."),
    )
    parser.add_argument(
        "--omp-default",
        action="store_true",
        help="Leave PyTorch's OpenMP wait policy at its default for DDP.",
    )
    parser.add_argument("--timeout", type=float, default=900.0)
    return parser.parse_args(argv)


# --- Worker ---------------------------------------------------------------------


def worker_main(job):
    tf, keras, keras_dist = harness.import_stack()
    import numpy as np

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = harness.task_index()
    width, hidden, batch, learning_rate = MODEL
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * WORKERS * 4, width)).astype("float32")
    y = rng.integers(0, 10, size=batch * WORKERS * 4).astype("int32")
    result = {"default_collectives": harness.default_collectives(strategy)}
    if job["framework"] == "keras":
        dataset = harness.sharded_dataset(tf, x, y, batch * WORKERS)
        with strategy.scope():
            model = harness.build_mlp(
                keras,
                keras_dist,
                width,
                hidden,
                keras_dist.compression.NoCompression(),
                learning_rate,
            )
        model.fit(dataset, epochs=1, steps_per_epoch=WARMUP_STEPS, verbose=0)
        result["step_seconds"] = harness.timed_fit(keras, model, dataset, job["steps"])
        tf.profiler.experimental.start(
            os.path.join(job["trace"], f"w{rank}"),
            options=tf.profiler.experimental.ProfilerOptions(host_tracer_level=3),
        )
        model.fit(dataset, epochs=1, steps_per_epoch=PROFILED_STEPS, verbose=0)
        tf.profiler.experimental.stop()
    else:
        import torch
        import torch.distributed as dist
        from torch.profiler import ProfilerActivity, profile

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{job['gloo_port']}",
            rank=rank,
            world_size=WORKERS,
        )
        own = slice(rank * batch, (rank + 1) * batch)
        tx, ty = torch.from_numpy(x[own]), torch.from_numpy(y[own]).long()
        ddp, optimizer = build_ddp(
            torch, width, hidden, "none", "ddp_4m", learning_rate
        )
        torch_steps(torch, ddp, optimizer, tx, ty, WARMUP_STEPS)
        result["step_seconds"] = torch_steps(
            torch, ddp, optimizer, tx, ty, job["steps"]
        )
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            torch_steps(torch, ddp, optimizer, tx, ty, PROFILED_STEPS)
        result["ops"] = [
            {
                "name": event.key,
                "self_cpu_ms": event.self_cpu_time_total / 1000.0,
                "calls": event.count,
            }
            for event in sorted(
                profiled.key_averages(), key=lambda e: -e.self_cpu_time_total
            )[:20]
        ]
    harness.finish_job(job, result)


# --- Parent: processes, trace, report -------------------------------------------


def read_keras_trace(folder) -> dict:
    """Worker 0's last profiled step: its timeline and time per op type."""
    step_start, step_end, kept = _profile.last_step_ops(folder)
    per_type = collections.defaultdict(float)
    for start, end, _, op_type in kept:
        per_type[op_type] += end - start
    return {
        "step_ms": step_end - step_start,
        "timeline": [
            {
                "start_ms": round(start - step_start, 2),
                "ms": round(end - start, 2),
                "op": op_name.rsplit("/", 1)[-1],
                "type": op_type,
            }
            for start, end, op_name, op_type in kept
            if end - start >= TIMELINE_MIN_MS
        ],
        "ms_per_op_type": dict(sorted(per_type.items(), key=lambda kv: -kv[1])),
    }


def run(args, report):
    harness.require_root(__file__)
    from keras_dist import cluster

    env = {"GLOO_SOCKET_IFNAME": "lo"}
    ddp_env = dict(env) if args.omp_default else {**env, "OMP_WAIT_POLICY": "PASSIVE"}
    steps = {"keras": [], "ddp": []}
    traces = {}
    for round_index in range(args.rounds):
        for framework in harness.alternate(["keras", "ddp"], round_index):
            folder = tempfile.mkdtemp(prefix=f"kd_step_trace_{framework}_")
            job = {
                "framework": framework,
                "steps": args.steps,
                "trace": folder,
                "gloo_port": cluster.free_ports(1)[0],
            }
            result = harness.run_processes(
                __file__,
                job,
                workers=WORKERS,
                namespace=True,
                env=ddp_env if framework == "ddp" else env,
                timeout=args.timeout,
                name=f"step_trace_{framework}",
            )
            steps[framework] += result["step_seconds"]
            if framework == "keras":
                traces["keras"] = read_keras_trace(os.path.join(folder, "w0"))
                traces["keras_default_collectives"] = result["default_collectives"]
            else:
                traces["ddp_ops"] = result["ops"]
            # Each round's profile is read (the last one kept) and dropped.
            shutil.rmtree(folder, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in steps.items()}
    summary = {
        "median_step_seconds": medians,
        "keras_over_ddp": medians["keras"] / medians["ddp"],
    }
    print(format_steps(summary))
    print()
    print(format_timeline(traces["keras"]))
    print()
    print(format_ddp_ops(traces["ddp_ops"]))
    report.write(
        {
            "setup": {
                "model": MODEL,
                "workers": WORKERS,
                "steps": args.steps,
                "rounds": args.rounds,
                "ddp_omp_wait_policy": None if args.omp_default else "PASSIVE",
            },
            "results": {"step_seconds": steps, **traces},
            "summary": summary,
            "table": format_steps(summary),
        }
    )
    return 0


def format_steps(summary) -> str:
    medians = summary["median_step_seconds"]
    return harness.table(
        ["keras_dist step (s)", "DDP step (s)", "keras_dist / DDP"],
        [
            [
                f"{medians['keras']:.3f}",
                f"{medians['ddp']:.3f}",
                f"**{summary['keras_over_ddp']:.2f}**",
            ]
        ],
        align="rrr",
    )


def format_timeline(trace) -> str:
    rows = [
        [f"{item['start_ms']:.1f}", f"{item['ms']:.1f}", item["type"], item["op"]]
        for item in trace["timeline"]
    ]
    return harness.table(["start (ms)", "ms", "op type", "op"], rows, align="rrll")


def format_ddp_ops(ops) -> str:
    rows = [[op["name"], f"{op['self_cpu_ms']:.1f}", op["calls"]] for op in ops[:12]]
    return harness.table(["DDP op", "self CPU (ms, 3 steps)", "calls"], rows)


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, None, job=worker_main))
