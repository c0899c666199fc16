"""Local SGD and DiLoCo against synchronous training on a slow link.

When the link between workers is slow, a synchronous step waits for an
all-reduce of the whole gradient. Compressing the gradient (FP16, PowerSGD)
shrinks it; periodic methods skip it: every worker trains on its own for H
updates and the workers meet every H (`keras_dist.LocalSGDOptimizer`, which
averages the weights, and `keras_dist.DiLoCoOptimizer`, which applies an
outer Nesterov step to the averaged change). This script trains the same
model on the same data, in the same number of updates, with each method, and
records the training loss against wall time; then the loss of the final
(synchronized) model on a held-out set.

Two worker processes (`MultiWorkerMirroredStrategy` and, in the same
processes, a gloo process group for PyTorch) on 127.0.0.1 inside a private
network namespace whose loopback is shaped to each `--rates` (100 Mbit/s and
1 Gbit/s by default; token-bucket filter, see `_harness.network_namespace`),
one fresh namespace and pair of processes per rate. Each worker uses one
intra-op thread (`TF_NUM_INTRAOP_THREADS=1`, `torch.set_num_threads(1)`:
what `keras-dist launch` and torchrun give 2 workers on 2 cores).

The task: 64 Gaussian inputs, 10 classes drawn from the softmax of a fixed
random ReLU teacher network (so the loss has a floor above 0 and keeps
falling over the run); a fresh example for every step (no epoch repeats),
the same order for every method; 8,192 held-out examples. The model: an MLP
64 -> 1024 -> 1024 -> 10 (ReLU, 1.13M parameters, 4.5 MB of float32), global
batch 128 (64 per worker). Every method uses AdamW (learning rate 1e-3,
weight decay 0.01, epsilon 1e-8), so that what differs is only how the
workers communicate:

- keras_dist (`DistributedModel.fit`, 4 MiB buckets):
  `sync`: plain all-reduce of the gradients every step (`NoCompression()`);
  `fp16`: the `FP16()` hook; `powersgd`: `PowerSGD(rank=4,
  start_step=WARMUP)`; `local{H}`: `LocalSGDOptimizer(AdamW, H,
  warmup_steps=WARMUP)`; `diloco{H}`: `DiLoCoOptimizer(AdamW, H,
  warmup_steps=WARMUP)` with its default outer optimizer (SGD 0.7, Nesterov
  momentum 0.9, the paper's).
- PyTorch (DDP on gloo, `bucket_cap_mb=4`, the same initial weights, copied
  from the Keras model): `torch_ddp`: plain DDP; `torch_local{H}`: post-local
  SGD as in PyTorch's documentation: `post_localSGD_hook` with
  `PostLocalSGDState(start_localSGD_iter=WARMUP,
  post_local_gradient_allreduce=False)` (each worker stands for a node
  here, so there is no intra-node group to all-reduce in) and
  `PostLocalSGDOptimizer(AdamW, PeriodicModelAverager(period=H,
  warmup_steps=WARMUP))`. The averager syncs one update after keras_dist
  would (after update WARMUP + 1, then every H); a last average after the
  final update, inside the timed run, makes the final model one model as
  keras_dist's sync at its last update does.

The clock of a run starts when its first step ends (Keras traces its step
function in it; the table gives that step's time apart). Per step: the time
it ended and the training loss (the mean over the two workers, of each
worker's own model between syncs). The table per rate: wall time, steps/s,
what a worker all-reduces per step (payload, averaged over the run), the
time until the loss (trailing mean over `--smooth` steps) first reaches the
synchronous run's final value (each framework against its own synchronous
run), the final training loss (mean of the last `--smooth` steps) and the
held-out loss of the final weights (computed in NumPy, the same code for
both frameworks, on each worker: the two must agree after the last sync).

Needs root and iproute2 (`ip`, `tc`), and PyTorch (`pip install
".[bench]"`):

    sudo .venv/bin/python benchmarks/bench_local_sgd.py \\
        --out docs/benchmarks/local_sgd.json

400 updates per method by default: 16 synchronous, then 384 (3 x 128).
About 25 minutes on 2 cores, most of it the synchronous runs at 100 Mbit/s.
`--quick` runs 80 updates and H in {8, 32, 64} (about 12 minutes).
`--steps` minus `--warmup-steps` must be a multiple of every H, so that the
last update of a run is a sync (the run ends on one model). Prints a
markdown table per rate; writes the loss curves (every `--record-every`
steps), the results, the environment and the command to the JSON file, and
a plot next to it (`.png`; `--replot JSON` redraws it).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shutil
import sys
import tempfile
import time

import _harness as harness

INSTALL_HINT = (
    "bench_local_sgd.py compares against PyTorch's post-local SGD and needs "
    'PyTorch: run `pip install ".[bench]"` in the clone\'s root.'
)
WORKERS = 2
FEATURES = 64
HIDDEN = (1024, 1024)
CLASSES = 10
TEACHER_HIDDEN = 256
TEACHER_TEMPERATURE = 8.0
HELD_OUT = 8192
DATA_SEED = 1
HELD_OUT_SEED = 2
TEACHER_SEED = 1234
WEIGHT_DECAY = 0.01
EPSILON = 1e-8
POWERSGD_RANK = 4
BUCKET_MB = 4
FAMILIES = (
    "sync",
    "torch_ddp",
    "fp16",
    "powersgd",
    "local",
    "torch_local",
    "diloco",
)
PERIODIC = ("local", "torch_local", "diloco")
SPLIT_ENV = {"TF_NUM_INTRAOP_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
QUICK = {"steps": 80, "warmup_steps": 16, "sync_every": [8, 32, 64]}


def parse_args(argv=None):
    parser = harness.parser(
        "Local SGD and DiLoCo against synchronous, FP16 and PowerSGD training "
        "and PyTorch's DDP and post-local SGD: training loss against wall time "
        "of 2 worker processes on a loopback shaped to each rate (needs root "
        "and PyTorch; --replot does not).",
        "local_sgd.json",
        jobs=True,
        steps=(400, "Optimizer updates per method (the same for every method)."),
        batch_size=(128, "Global batch size (2 workers)."),
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=16,
        help="Synchronous updates before the periodic methods go local, and "
        "PowerSGD's start_step (16).",
    )
    parser.add_argument(
        "--sync-every",
        type=harness.positive_int,
        nargs="+",
        default=[8, 32, 128],
        help="H values of the periodic methods (8 32 128).",
    )
    parser.add_argument(
        "--rates",
        nargs="+",
        default=["100mbit", "1gbit"],
        help="tc rates of the shaped loopback, one run each (100mbit 1gbit).",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=FAMILIES,
        default=list(FAMILIES),
        help="Method families to run (the periodic ones at every H).",
    )
    parser.add_argument(
        "--learning-rate", type=float, default=1e-3, help="AdamW's (1e-3)."
    )
    parser.add_argument(
        "--smooth",
        type=harness.positive_int,
        default=32,
        help="Steps of the trailing mean the loss is compared in (32).",
    )
    parser.add_argument(
        "--record-every",
        type=harness.positive_int,
        default=4,
        help="Steps between the points of the loss curves in the report (4).",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="80 steps, H in {8, 32, 64}: a smoke run of a few minutes.",
    )
    parser.add_argument(
        "--timeout", type=float, default=2400, help="Seconds per rate (2400)."
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = QUICK["steps"]
        args.warmup_steps = QUICK["warmup_steps"]
        args.sync_every = QUICK["sync_every"]
    if args.job is None and not args.replot:
        if not 0 <= args.warmup_steps < args.steps:
            parser.error("--warmup-steps must be >= 0 and < --steps.")
        uneven = [h for h in args.sync_every if (args.steps - args.warmup_steps) % h]
        if uneven:
            parser.error(
                f"--steps minus --warmup-steps ({args.steps - args.warmup_steps}) "
                f"must be a multiple of every --sync-every; not of {uneven}."
            )
        if args.batch_size % WORKERS:
            parser.error(f"--batch-size must be a multiple of {WORKERS}.")
    return args


def require_torch() -> None:
    """Exits with status 2 and the install line when PyTorch is missing."""
    if importlib.util.find_spec("torch") is None:
        print(INSTALL_HINT, file=sys.stderr)
        raise SystemExit(2)


def method_keys(families, sync_every) -> list[str]:
    """The runs, in the order they run: periodic families at every H."""
    keys = []
    for family in ("sync", "torch_ddp", "fp16", "powersgd"):
        if family in families:
            keys.append(family)
    for h in sync_every:
        keys += [f"{f}{h}" for f in PERIODIC if f in families]
    return keys


def split_key(key: str) -> tuple[str, int | None]:
    """`"diloco32"` -> `("diloco", 32)`; `"sync"` -> `("sync", None)`."""
    for family in PERIODIC:
        if key.startswith(family) and key[len(family) :].isdigit():
            return family, int(key[len(family) :])
    return key, None


def label(key: str) -> str:
    family, h = split_key(key)
    return {
        "sync": "keras_dist synchronous",
        "fp16": "keras_dist FP16 hook",
        "powersgd": f"keras_dist PowerSGD r{POWERSGD_RANK}",
        "local": f"keras_dist LocalSGD H={h}",
        "diloco": f"keras_dist DiLoCo H={h}",
        "torch_ddp": "PyTorch DDP",
        "torch_local": f"PyTorch post-local SGD H={h}",
    }[family]


def framework(key: str) -> str:
    return "pytorch" if key.startswith("torch") else "keras_dist"


# --- The task (the same arrays in every process) --------------------------------


def make_data(np, steps: int, batch: int):
    """`(x, y, x_held_out, y_held_out, bayes_loss)`: `steps * batch` training
    examples in the order they are trained on, and `HELD_OUT` more.

    Labels are drawn from the softmax of a fixed random ReLU teacher
    (64 -> 256 -> 256 -> 10, logits times `TEACHER_TEMPERATURE`);
    `bayes_loss` is the teacher's own cross-entropy on the held-out set, the
    floor no model can go below.
    """
    teacher = np.random.default_rng(TEACHER_SEED)
    w1 = teacher.normal(size=(FEATURES, TEACHER_HIDDEN)) / np.sqrt(FEATURES)
    w2 = teacher.normal(size=(TEACHER_HIDDEN, TEACHER_HIDDEN)) / np.sqrt(
        TEACHER_HIDDEN / 2
    )
    w3 = teacher.normal(size=(TEACHER_HIDDEN, CLASSES)) / np.sqrt(TEACHER_HIDDEN)

    def draw(count, seed):
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(count, FEATURES))
        hidden = np.maximum(np.maximum(x @ w1, 0) @ w2, 0)
        logits = hidden @ w3 * TEACHER_TEMPERATURE
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        y = (p.cumsum(axis=1) > rng.random((count, 1))).argmax(axis=1)
        bayes = float(-np.log(p[np.arange(count), y]).mean())
        return x.astype("float32"), y.astype("int32"), bayes

    x, y, _ = draw(steps * batch, DATA_SEED)
    x_held, y_held, bayes = draw(HELD_OUT, HELD_OUT_SEED)
    return x, y, x_held, y_held, bayes


def numpy_loss(np, weights, x, y) -> float:
    """Cross-entropy of the MLP with `weights` (Keras layout: kernel `(in,
    out)`, bias, per layer) on `(x, y)`, in float64: the same evaluation
    for both frameworks."""
    h = x.astype("float64")
    layers = list(zip(weights[0::2], weights[1::2]))
    for index, (kernel, bias) in enumerate(layers):
        h = h @ kernel.astype("float64") + bias.astype("float64")
        if index < len(layers) - 1:
            h = np.maximum(h, 0)
    h = h - h.max(axis=1, keepdims=True)
    log_p = h - np.log(np.exp(h).sum(axis=1, keepdims=True))
    return float(-log_p[np.arange(len(y)), y].mean())


def parameter_count() -> int:
    sizes = [FEATURES, *HIDDEN, CLASSES]
    return sum(a * b + b for a, b in itertools.pairwise(sizes))


# --- Worker: keras_dist ----------------------------------------------------------


def build_model(keras, keras_dist, hook, optimizer):
    """The MLP as a compiled `DistributedModel` with `hook` and `optimizer`,
    seeded 0 (the same initial weights for every method). Call it inside the
    strategy's scope."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    h = inputs
    for units in HIDDEN:
        h = keras.layers.Dense(units, activation="relu")(h)
    outputs = keras.layers.Dense(CLASSES)(h)
    model = keras_dist.DistributedModel(inputs, outputs, all_reduce_hook=hook)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def adamw(keras, learning_rate):
    return keras.optimizers.AdamW(
        learning_rate=learning_rate, weight_decay=WEIGHT_DECAY, epsilon=EPSILON
    )


def keras_parts(keras, keras_dist, key, job):
    """`(all_reduce_hook, optimizer)` of a keras_dist method."""
    compression = keras_dist.compression
    family, h = split_key(key)
    inner = adamw(keras, job["learning_rate"])
    if family == "fp16":
        return compression.FP16(), inner
    if family == "powersgd":
        hook = compression.PowerSGD(rank=POWERSGD_RANK, start_step=job["warmup_steps"])
        return hook, inner
    hook = compression.NoCompression()
    if family == "local":
        return hook, keras_dist.LocalSGDOptimizer(
            inner, sync_every=h, warmup_steps=job["warmup_steps"]
        )
    if family == "diloco":
        return hook, keras_dist.DiLoCoOptimizer(
            inner, sync_every=h, warmup_steps=job["warmup_steps"]
        )
    return hook, inner


def run_keras(keras, keras_dist, np, strategy, dataset, key, job, held_out):
    with strategy.scope():
        hook, optimizer = keras_parts(keras, keras_dist, key, job)
        model = build_model(keras, keras_dist, hook, optimizer)

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends, self.running = [], []

        def on_train_batch_end(self, batch, logs=None):
            # Reading the loss waits for the step to finish.
            self.running.append(float(logs["loss"]))
            self.ends.append(time.perf_counter())

    recorder = Recorder()
    start = time.perf_counter()
    model.fit(
        dataset,
        epochs=1,
        steps_per_epoch=job["steps"],
        callbacks=[recorder],
        verbose=0,
    )
    fit_end = time.perf_counter()
    # `logs["loss"]` is the epoch's running mean (over both workers); the
    # loss of step k is k * mean_k - (k - 1) * mean_(k-1).
    losses, previous = [], 0.0
    for index, mean in enumerate(recorder.running):
        losses.append((index + 1) * mean - index * previous)
        previous = mean
    weights = model.get_weights()
    try:
        stats = hook.stats()
        sent = {"raw_bytes": stats.raw_bytes, "sent_bytes": stats.sent_bytes}
    except RuntimeError:
        sent = {}
    return {
        "start": start,
        "ends": recorder.ends,
        "losses": losses,
        "after_fit_seconds": fit_end - recorder.ends[-1],
        "held_out_loss": numpy_loss(np, weights, *held_out),
        "weights_checksum": float(
            sum(np.abs(w).astype("float64").sum() for w in weights)
        ),
        "hook_stats": sent,
        "parameters": int(model.count_params()),
    }


# --- Worker: PyTorch ---------------------------------------------------------------


def build_torch(torch, initial, key, job):
    """The MLP in PyTorch with `initial` (Keras's) weights, in DDP (gloo,
    4 MiB buckets); post-local SGD for `torch_local{H}`. Returns `(ddp,
    optimizer, averager)` (`averager` `None` for DDP)."""
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
    from torch.distributed.algorithms.model_averaging import averagers
    from torch.distributed.optim import PostLocalSGDOptimizer

    layers, previous = [], FEATURES
    for units in HIDDEN:
        layers += [torch.nn.Linear(previous, units), torch.nn.ReLU()]
        previous = units
    layers.append(torch.nn.Linear(previous, CLASSES))
    module = torch.nn.Sequential(*layers)
    linears = [m for m in module if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for layer, kernel, bias in zip(linears, initial[0::2], initial[1::2]):
            layer.weight.copy_(torch.from_numpy(kernel.T.copy()))
            layer.bias.copy_(torch.from_numpy(bias.copy()))
    ddp = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=BUCKET_MB)
    optimizer = torch.optim.AdamW(
        ddp.parameters(),
        lr=job["learning_rate"],
        weight_decay=WEIGHT_DECAY,
        eps=EPSILON,
    )
    family, h = split_key(key)
    if family != "torch_local":
        return ddp, optimizer, None
    warmup = job["warmup_steps"]
    state = post_localSGD_hook.PostLocalSGDState(
        process_group=None,
        subgroup=None,
        start_localSGD_iter=warmup,
        post_local_gradient_allreduce=False,
    )
    ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
    averager = averagers.PeriodicModelAverager(period=h, warmup_steps=warmup)
    return ddp, PostLocalSGDOptimizer(optim=optimizer, averager=averager), averager


def averaged_at(averager, step) -> bool:
    """Whether `PeriodicModelAverager` averages at its call number `step`."""
    warmup = averager.warmup_steps
    return step >= warmup and (step - warmup) % averager.period == 0


def run_torch(torch, np, initial, batches, key, job, held_out):
    from torch.distributed.algorithms.model_averaging import utils

    ddp, optimizer, averager = build_torch(torch, initial, key, job)
    ends, losses = [], []
    last_average = None
    start = time.perf_counter()
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        # On CPU backward returns after DDP has waited for every bucket.
        loss.backward()
        step = None if averager is None else averager.step
        optimizer.step()  # PostLocalSGDOptimizer: the update, then the averager
        if step is not None and averaged_at(averager, step):
            last_average = step
        losses.append(float(loss.item()))
        ends.append(time.perf_counter())
    final_average = False
    if averager is not None and last_average != len(ends) - 1:
        # The workers' models differ since the last average: one more, timed.
        utils.average_parameters(iter(ddp.parameters()), None)
        final_average = True
        ends[-1] = time.perf_counter()
    weights = []
    for layer in (m for m in ddp.module if isinstance(m, torch.nn.Linear)):
        weights += [layer.weight.detach().numpy().T, layer.bias.detach().numpy()]
    return {
        "start": start,
        "ends": ends,
        "losses": losses,  # this worker's own; the parent averages the two
        "final_average": final_average,
        "held_out_loss": numpy_loss(np, weights, *held_out),
        "weights_checksum": float(
            sum(np.abs(w).astype("float64").sum() for w in weights)
        ),
    }


# --- Worker: both frameworks in one process --------------------------------------


def first_batch_rows(tf, strategy, batch):
    """The rows of the first global batch this worker gets from a dataset
    built as the training one (the PyTorch side takes the same rows)."""
    rows = tf.data.Dataset.range(batch * 2)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    rows = rows.batch(batch, drop_remainder=True).with_options(options)
    first = next(iter(strategy.experimental_distribute_dataset(rows)))
    return [int(v) for v in strategy.experimental_local_results(first)[0].numpy()]


def worker_main(job):
    tf, keras, keras_dist = harness.import_stack()
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = harness.task_index()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{job['gloo_port']}",
        rank=rank,
        world_size=WORKERS,
    )
    steps, batch = job["steps"], job["batch_size"]
    x, y, x_held, y_held, bayes = make_data(np, steps, batch)
    held_out = (x_held, y_held)
    dataset = harness.sharded_dataset(tf, x, y, batch)
    local = batch // WORKERS
    own = [
        (
            torch.from_numpy(
                x[k * batch + rank * local : k * batch + (rank + 1) * local]
            ),
            torch.from_numpy(
                y[k * batch + rank * local : k * batch + (rank + 1) * local]
            ).long(),
        )
        for k in range(steps)
    ]
    with strategy.scope():
        initial = build_model(
            keras, keras_dist, None, adamw(keras, job["learning_rate"])
        ).get_weights()
    side = {
        "rank": rank,
        "bayes_loss": bayes,
        "first_batch_rows": first_batch_rows(tf, strategy, batch),
        "torch_rows": list(range(rank * local, (rank + 1) * local)),
        "threads": {
            "tf_intra_op_env": os.environ.get("TF_NUM_INTRAOP_THREADS"),
            "torch_intra_op": torch.get_num_threads(),
        },
        "runs": {},
    }
    path = os.path.join(job["side"], f"task{rank}.json")
    for key in job["keys"]:
        load = os.getloadavg()[0]
        try:
            if framework(key) == "pytorch":
                result = run_torch(torch, np, initial, own, key, job, held_out)
            else:
                result = run_keras(
                    keras, keras_dist, np, strategy, dataset, key, job, held_out
                )
        except Exception as error:  # recorded; the next method still runs
            result = {"error": f"{type(error).__name__}: {error}"}
        result["load_average_1m_before"] = load
        side["runs"][key] = result
        with open(path + ".tmp", "w") as handle:
            json.dump(side, handle)
        os.replace(path + ".tmp", path)
        print(f"{key}: done", flush=True)
    harness.finish_job(job, {"done": True})


# --- Parent: namespaces, workers, report ------------------------------------------


def rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for suffix, scale in units.items():
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * scale
    raise ValueError(f"A rate must end in kbit, mbit or gbit. Received: {rate!r}.")


def rate_label(rate: str) -> str:
    return rate.replace("gbit", " Gbit/s").replace("mbit", " Mbit/s")


def run_rate(args, rate, keys):
    """Both workers in a fresh namespace shaped to `rate`; returns the raw
    results of both tasks (and the error, when the processes failed)."""
    cluster = harness.import_stack()[2].cluster
    side = tempfile.mkdtemp(prefix="kd_bench_local_sgd_")
    job = harness.job_from(
        args,
        *("steps", "batch_size", "warmup_steps", "learning_rate"),
        keys=keys,
        side=side,
        gloo_port=cluster.free_ports(1)[0],
    )
    error = None
    try:
        harness.run_processes(
            __file__,
            job,
            workers=WORKERS,
            namespace=True,
            rate=rate,
            env=SPLIT_ENV,
            timeout=args.timeout,
            name=f"local_sgd_{rate}",
        )
    except RuntimeError as failure:
        error = str(failure)
        print(error, file=sys.stderr)
    tasks = []
    for index in range(WORKERS):
        task_path = os.path.join(side, f"task{index}.json")
        if os.path.exists(task_path):
            with open(task_path) as handle:
                tasks.append(json.load(handle))
    shutil.rmtree(side, ignore_errors=True)
    return {"tasks": tasks, "error": error, "keys": keys}


def trailing_mean(values, window):
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def payload_per_step(key, args, parameters, run) -> float:
    """Bytes one worker all-reduces per step, averaged over the run: the
    gradients every step, or the weights at every sync (plus the
    synchronous warm-up's gradients)."""
    full = 4 * parameters
    family = split_key(key)[0]
    steps, warmup = args["steps"], args["warmup_steps"]
    if family in ("sync", "torch_ddp"):
        return full
    if family == "fp16":
        return run.get("hook_stats", {}).get("sent_bytes") or full / 2
    if family == "powersgd":
        sent = run.get("hook_stats", {}).get("sent_bytes") or full
        return (warmup * full + (steps - warmup) * sent) / steps
    return (warmup * full + syncs(key, args, run) * full) / steps


def syncs(key, args, run) -> int | None:
    """All-reduces of the weights in a run (periodic methods)."""
    family, h = split_key(key)
    steps, warmup = args["steps"], args["warmup_steps"]
    if family in ("local", "diloco"):
        return (steps - warmup) // h
    if family == "torch_local":
        averaged = len(range(warmup, steps, h))
        return averaged + (1 if run.get("final_average") else 0)
    return None


def reference_key(key: str) -> str:
    """The synchronous run a method is compared with: its framework's."""
    return "torch_ddp" if framework(key) == "pytorch" else "sync"


def summarize(raw, args) -> dict:
    """Per method: the run's curve (both workers' losses averaged for
    PyTorch), wall time, payload and the comparisons."""
    tasks = raw["tasks"]
    if not tasks:
        return {}
    parameters = parameter_count()
    smooth = min(args["smooth"], args["steps"])
    every = args["record_every"]
    summary, curves = {}, {}
    for key, run in tasks[0]["runs"].items():
        if "error" in run:
            summary[key] = {"error": run["error"]}
            continue
        losses = run["losses"]
        others = [t["runs"].get(key, {}) for t in tasks[1:]]
        if framework(key) == "pytorch":
            per_task = [losses] + [o["losses"] for o in others if "losses" in o]
            losses = [sum(v) / len(v) for v in zip(*per_task)]
        ends = run["ends"]
        times = [t - ends[0] for t in ends]
        smoothed = trailing_mean(losses, smooth)
        curves[key] = (times, smoothed)
        held = [run["held_out_loss"]] + [
            o["held_out_loss"] for o in others if "held_out_loss" in o
        ]
        marks = list(range(every - 1, len(losses), every))
        summary[key] = {
            "label": label(key),
            "framework": framework(key),
            "steps": len(losses),
            "first_step_seconds": ends[0] - run["start"],
            "wall_seconds": times[-1],
            "steps_per_second": (len(times) - 1) / times[-1],
            "syncs": syncs(key, args, run),
            "payload_bytes_per_step": payload_per_step(key, args, parameters, run),
            "final_train_loss": sum(losses[-smooth:]) / len(losses[-smooth:]),
            "held_out_loss": run["held_out_loss"],
            "held_out_loss_per_worker": held,
            "workers_agree": max(held) - min(held) < 1e-6,
            "load_average_1m_before": run.get("load_average_1m_before"),
            # Every `record_every` steps: the step, its time after the first
            # step, the mean loss of the steps since the last point, and the
            # trailing mean over `smooth` steps (what the plot draws).
            "curve": {
                "step": [m + 1 for m in marks],
                "seconds": [round(times[m], 4) for m in marks],
                "loss": [
                    round(sum(losses[m - every + 1 : m + 1]) / every, 5) for m in marks
                ],
                "smoothed_loss": [round(smoothed[m], 5) for m in marks],
            },
        }
    for key, item in summary.items():
        reference = curves.get(reference_key(key))
        if key not in curves or reference is None:
            continue
        times, smoothed = curves[key]
        target = reference[1][-1]
        reached = next(
            (
                index
                for index, value in enumerate(smoothed)
                if index >= smooth - 1 and value <= target
            ),
            None,
        )
        item["target_loss"] = target
        item["steps_to_target"] = None if reached is None else reached + 1
        item["seconds_to_target"] = None if reached is None else times[reached]
    for key, item in summary.items():
        own = summary.get(reference_key(key), {}).get("seconds_to_target")
        if item.get("seconds_to_target") and own:
            item["speedup_to_target"] = own / item["seconds_to_target"]
    return summary


def format_table(summary, rate) -> str:
    rows = []
    for key, item in summary.items():
        if "error" in item:
            rows.append([label(key), "failed: " + item["error"][:120], *[""] * 9])
            continue
        reached = item.get("seconds_to_target")
        rows.append(
            [
                item["label"],
                item["steps"],
                f"{item['wall_seconds']:.1f}",
                f"{item['steps_per_second']:.2f}",
                f"{item['first_step_seconds']:.1f}",
                "-" if item["syncs"] is None else item["syncs"],
                f"{item['payload_bytes_per_step'] / 1e6:.3f}",
                "not reached"
                if reached is None
                else f"{reached:.1f} (step {item['steps_to_target']})",
                ""
                if not item.get("speedup_to_target")
                else f"{item['speedup_to_target']:.1f}x",
                f"{item['final_train_loss']:.4f}",
                f"{item['held_out_loss']:.4f}"
                + ("" if item["workers_agree"] else " (workers differ!)"),
            ]
        )
    header = [
        f"method ({rate_label(rate)})",
        "steps",
        "wall time (s)",
        "steps/s",
        "first step (s)",
        "weight syncs",
        "MB all-reduced per step",
        "time to sync's final loss (s)",
        "vs sync",
        "final training loss",
        "held-out loss",
    ]
    return harness.table(header, rows)


COLORS = {
    "sync": "black",
    "torch_ddp": "dimgray",
    "fp16": "tab:purple",
    "powersgd": "tab:brown",
    "local": "Blues",
    "diloco": "Greens",
    "torch_local": "Oranges",
}


def color(plt, key, sync_every):
    family, h = split_key(key)
    name = COLORS[family]
    if h is None:
        return name
    shade = 0.45 + 0.5 * sync_every.index(h) / max(1, len(sync_every) - 1)
    return plt.get_cmap(name)(shade)


def plot(plt, report, path):
    """Top: the training loss against wall time, a panel per rate. Bottom
    (from the first rate; the losses do not depend on the link): each
    method's loss minus its framework's synchronous loss at the same update
    (the same batches, so the data's noise cancels), and the held-out loss
    of each final model."""
    rates = [r for r in report["rates"] if report["summary"].get(r)]
    if not rates:
        return None
    setup = report["setup"]
    sync_every = setup["sync_every"]
    columns = max(2, len(rates))
    fig, axes = plt.subplots(2, columns, figsize=(6.8 * columns, 10), squeeze=False)
    style = {}
    for key, item in report["summary"][rates[0]].items():
        if "error" not in item:
            style[key] = {
                "label": item["label"],
                "color": color(plt, key, sync_every),
                "linestyle": "--" if item["framework"] == "pytorch" else "-",
                "linewidth": 1.2,
            }
    for column, rate in enumerate(rates):
        ax = axes[0][column]
        summary = report["summary"][rate]
        for key, item in summary.items():
            if key in style and "curve" in item:
                curve = item["curve"]
                ax.plot(curve["seconds"], curve["smoothed_loss"], **style[key])
        target = summary.get("sync", {}).get("target_loss")
        if target is not None:
            ax.axhline(target, color="black", linestyle=":", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("wall time after the first step (s, log scale)")
        ax.set_ylabel(f"training loss (trailing mean of {setup['smooth']} steps)")
        ax.set_title(f"training loss vs wall time, {rate_label(rate)}")
        ax.grid(alpha=0.3)
    for ax in axes[0][len(rates) :]:
        ax.axis("off")
    summary = report["summary"][rates[0]]
    ax = axes[1][0]
    for key, item in summary.items():
        reference = summary.get(reference_key(key), {})
        if key not in style or "curve" not in reference:
            continue
        gap = [
            a - b
            for a, b in zip(
                item["curve"]["smoothed_loss"], reference["curve"]["smoothed_loss"]
            )
        ]
        ax.plot(item["curve"]["step"], gap, **style[key])
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlabel("optimizer updates")
    ax.set_ylabel("training loss minus the synchronous run's, same update")
    ax.set_title(
        "cost per update (PyTorch against DDP, keras_dist against its own "
        "synchronous run)",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    ax = axes[1][1]
    keys = [k for k in summary if k in style]
    held = [summary[k]["held_out_loss"] for k in keys]
    bars = ax.barh(
        range(len(keys)), held, color=[style[k]["color"] for k in keys], height=0.7
    )
    for bar, key in zip(bars, keys):
        if summary[key]["framework"] == "pytorch":
            bar.set_hatch("//")
    ax.bar_label(bars, fmt="%.4f", fontsize=7, padding=2)
    ax.set_yticks(range(len(keys)), [style[k]["label"] for k in keys], fontsize=7)
    ax.invert_yaxis()
    low, high = min(held), max(held)
    ax.set_xlim(low - (high - low) * 0.6, high + (high - low) * 0.4)
    if "sync" in summary:
        ax.axvline(summary["sync"]["held_out_loss"], color="black", linestyle=":")
    ax.set_xlabel(f"held-out loss of the final model ({setup['held_out']:,} examples)")
    ax.set_title("after the last sync (hatched: PyTorch)", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    for ax in axes[1][2:]:
        ax.axis("off")
    fig.suptitle(
        f"2 workers, MLP {setup['parameters'] / 1e6:.2f}M parameters, global batch "
        f"{setup['global_batch_size']}, AdamW, {setup['steps']} updates each; "
        "dotted: keras_dist synchronous final loss; dashed: PyTorch",
        fontsize=10,
    )
    return harness.save_figure(fig, path)


def run(args, report):
    require_torch()
    harness.require_root("bench_local_sgd")
    import torch

    keys = method_keys(args.methods, args.sync_every)
    setup = {
        "workers": WORKERS,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "sync_every": args.sync_every,
        "global_batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "optimizer": f"AdamW(lr={args.learning_rate}, weight_decay={WEIGHT_DECAY}, "
        f"epsilon={EPSILON})",
        "diloco_outer": "SGD(0.7, momentum=0.9, nesterov=True) (the default)",
        "powersgd": f"PowerSGD(rank={POWERSGD_RANK}, start_step={args.warmup_steps})",
        "model": f"MLP {' -> '.join(map(str, [FEATURES, *HIDDEN, CLASSES]))}, ReLU",
        "parameters": parameter_count(),
        "smooth": args.smooth,
        "held_out": HELD_OUT,
        "bucket_mb": BUCKET_MB,
        "thread_env": SPLIT_ENV,
        "keys": keys,
    }
    raw, summary, tables = {}, {}, {}
    for rate in args.rates:
        print(f"Running {len(keys)} methods at {rate}...", flush=True)
        started = time.monotonic()
        raw[rate] = run_rate(args, rate, keys)
        raw[rate]["seconds"] = time.monotonic() - started
        summary[rate] = summarize(raw[rate], vars(args))
        for task in raw[rate]["tasks"]:
            for result in task["runs"].values():
                # Summarized into each method's curve (the JSON stays small).
                result.pop("ends", None)
                result.pop("losses", None)
        tables[rate] = format_table(summary[rate], rate)
        print(tables[rate], flush=True)
        print(f"({raw[rate]['seconds']:.0f} s)", flush=True)
    checks = {}
    for rate, entry in raw.items():
        for task in entry["tasks"]:
            checks[f"{rate}/task{task['rank']}"] = {
                "tf_rows_of_first_batch": task["first_batch_rows"],
                "torch_rows_of_first_batch": task["torch_rows"],
                "same_rows": task["first_batch_rows"] == task["torch_rows"],
                "bayes_loss": task["bayes_loss"],
                "threads": task["threads"],
            }
    bits = {rate: rate_bits(rate) for rate in args.rates}
    setup["ring_floor_seconds_per_full_all_reduce"] = {
        rate: 2 * (WORKERS - 1) * 4 * parameter_count() * 8 / b
        for rate, b in bits.items()
    }
    fields = {
        "setup": setup,
        "rates": args.rates,
        "checks": checks,
        "summary": summary,
        "tables": tables,
        "raw": raw,
    }
    report.write(fields, torch=torch.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot, job=worker_main))
