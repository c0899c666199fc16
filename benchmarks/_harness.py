"""The harness every benchmark script runs on.

Each script measures something different; what they share lives here:

- **the stack**: TensorFlow, Keras and this checkout's keras_dist, with
  logical CPU devices configured before TensorFlow initialises
  (`import_stack`);
- **the command line**: `--out`, `--replot` and the options several scripts
  share (`--steps`, `--rounds`, `--epochs`, `--seeds`, `--batch-size`), counts
  that must be >= 1 (`parser`, `positive_int`), and the flow (`main`);
- **the report**: a markdown table (`table`); the exact command, the
  machine's state (versions, core count, load average before and after,
  since this machine is shared and noisy) and the results as JSON, and a
  matplotlib plot beside it that `--replot` redraws from the JSON alone
  (`Report`, `replot`);
- **processes**: ONE launcher (`run_processes`) for a fresh child process per
  measurement or for the worker processes of a `MultiWorkerMirroredStrategy`
  cluster on free 127.0.0.1 ports (`keras_dist.cluster`), optionally inside a
  private network namespace whose loopback is shaped (`network_namespace`,
  root only), and the worker side of it (`finish_job`, `sharded_dataset`,
  `timed_fit`, `build_mlp`);
- **the private keras_dist module** the benchmarks use (`_backup`), in one
  place at the end of this file.

A script is `parse_args` (built on `parser`), `run(args, report)` (measures,
prints the table, `report.write(fields)`), `plot(plt, report, path)` (draws
from the report alone) and `sys.exit(harness.main(parse_args, run, plot))`.
A script that starts processes passes `jobs=True` to `parser` and
`job=worker_main` to `main`: `run_processes` starts it again with
`--job JSON`, and the job ends with `finish_job(job, result)`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join("docs", "benchmarks")
OUT_HELP = "JSON file for the raw results; the plot goes next to it (.png)."
DPI = 110
LOG_TAIL = 3000


# --- The stack -----------------------------------------------------------------


def import_stack(logical_cpus: int | None = None):
    """Imports TensorFlow, Keras and this checkout's keras_dist.

    Args:
        logical_cpus: Int or `None`. Splits the CPU into this many logical
            devices before TensorFlow initialises. Defaults to `None` (leave
            the devices alone).

    Returns:
        `(tf, keras, keras_dist)`.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    if logical_cpus:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * logical_cpus
        )
    import keras

    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    import keras_dist

    return tf, keras, keras_dist


def versions() -> dict:
    """Returns the versions of TensorFlow, Keras and keras_dist (imports them)."""
    tf, keras, keras_dist = import_stack()
    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "keras_dist": keras_dist.__version__,
    }


# --- The command line ------------------------------------------------------------


def positive_int(text: str) -> int:
    """An argparse `type`: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1. Received: {text!r}.")
    return value


# The options several scripts share: `parser(..., name=(default, help))`.
COMMON_OPTIONS = {
    "steps": {"type": positive_int},
    "rounds": {"type": positive_int},
    "epochs": {"type": positive_int},
    "batch_size": {"type": positive_int},
    "seeds": {"type": int, "nargs": "+"},
}


def parser(
    description: str,
    out: str | None,
    *,
    out_help: str = OUT_HELP,
    jobs: bool = False,
    **common,
) -> argparse.ArgumentParser:
    """Returns an argument parser with the options every benchmark shares.

    Args:
        description: String. What the script measures, for `--help`.
        out: String or `None`. File name of the JSON report under
            `docs/benchmarks/` (the default of `--out`); `None` leaves the
            default to the script.
        out_help: String. Help of `--out`. Defaults to the common one.
        jobs: Bool. Adds the hidden `--job JSON` that `run_processes` passes
            to the processes it starts. Defaults to `False`.
        **common: `name=(default, help)` for each option of
            `COMMON_OPTIONS` the script takes (`steps=(8, "Timed steps.")`
            adds `--steps`, an int >= 1, default 8).

    Returns:
        An `argparse.ArgumentParser`; the script adds its own options.

    Raises:
        TypeError: a keyword names no common option.
    """
    unknown = sorted(set(common) - set(COMMON_OPTIONS))
    if unknown:
        raise TypeError(
            f"parser() takes the common options {sorted(COMMON_OPTIONS)}. "
            f"Received: {unknown}."
        )
    result = argparse.ArgumentParser(description=description)
    for name, (default, text) in common.items():
        result.add_argument(
            "--" + name.replace("_", "-"),
            default=default,
            help=text,
            **COMMON_OPTIONS[name],
        )
    default = None if out is None else os.path.join(RESULTS, out)
    result.add_argument("--out", default=default, help=out_help)
    result.add_argument(
        "--replot",
        metavar="JSON",
        help="Redraw the plot of an earlier report next to it (no run).",
    )
    if jobs:
        result.add_argument("--job", type=json.loads, help=argparse.SUPPRESS)
    return result


def main(parse_args, run, plot=None, job=None, argv=None) -> int:
    """The flow every script shares; returns the exit status.

    `--job` (a process `run_processes` started) runs `job(args.job)`;
    `--replot` redraws the plot of a report with `plot`; anything else runs
    `run(args, report)`, which measures and calls `report.write(fields)`.

    Args:
        parse_args: Callable `parse_args(argv)` returning the options.
        run: Callable `run(args, report)`.
        plot: Callable `plot(plt, report, path)` or `None` (no plot).
        job: Callable `job(job_dict)` or `None` (the script starts no jobs).
        argv: List of strings or `None` (`sys.argv[1:]`).
    """
    args = parse_args(argv)
    if job is not None and args.job is not None:
        job(args.job)
        return 0
    if args.replot:
        return replot(args.replot, plot)
    return run(args, Report(args.out, plot)) or 0


# --- Measuring -------------------------------------------------------------------


def alternate(items, round_index: int) -> list:
    """`items` in round `round_index`: reversed every other round, so that the
    machine's drifts hit the configurations alike."""
    items = list(items)
    return items if round_index % 2 == 0 else items[::-1]


def quartiles(values) -> tuple[float, float, float]:
    """`(q1, median, q3)` of `values` (inclusive method); one value: thrice."""
    values = list(values)
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def paired_ratio_cell(row: dict) -> str:
    """`"median [q1, q3]"` of a row's `paired_ratio_median`/`_q1`/`_q3`."""
    return (
        f"{row['paired_ratio_median']:.3f} "
        f"[{row['paired_ratio_q1']:.3f}, {row['paired_ratio_q3']:.3f}]"
    )


# --- The report ------------------------------------------------------------------


def command() -> str:
    """Returns the command line that ran this script."""
    return " ".join(["python", *sys.argv])


def plot_path(out: str) -> str:
    """Returns the PNG path beside the JSON report `out`."""
    return os.path.splitext(out)[0] + ".png"


def _make_folder_of(path: str) -> None:
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)


def pyplot():
    """Returns `matplotlib.pyplot` on the Agg backend, or `None` without it."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot.", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    return plt


def save_figure(figure, path: str, dpi: int = DPI) -> str:
    """Lays out, writes and closes `figure`; returns `path`."""
    from matplotlib import pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path


def draw(plot, report: dict, path: str):
    """Calls `plot(plt, report, path)`; returns what it wrote, or `None`.

    A script's plot function reads everything it draws from the report, so
    that `--replot` can draw it again from the JSON file alone. It returns
    the path(s) it wrote (a string) or `None`.
    """
    plt = pyplot()
    if plt is None:
        return None
    _make_folder_of(path)
    return plot(plt, report, path)


def replot(path: str, plot) -> int:
    """Redraws the plot of the JSON report at `path` next to it; returns 0."""
    with open(path) as handle:
        report = json.load(handle)
    written = draw(plot, report, plot_path(path))
    print(f"Wrote {written}" if written else "No plot written.")
    return 0


def table(header, rows, align: str | None = None) -> str:
    """A markdown table.

    Args:
        header: Sequence of strings. The column titles.
        rows: Iterable of sequences. The cells of each row (`str()` each).
        align: String or `None`. `"l"` or `"r"` per column; `None`: the first
            column left, the others right. Defaults to `None`.

    Returns:
        The table's lines, joined.
    """
    align = align or "l" + "r" * (len(header) - 1)
    rules = ["---" if side == "l" else "---:" for side in align]

    def line(cells):
        return "|" + "|".join(f" {cell} " for cell in cells) + "|"

    return "\n".join([line(header), line(rules), *(line(map(str, r)) for r in rows)])


class Report:
    """One benchmark run's record: command, environment, results and plot.

    Created when the run starts (it starts the clock and reads the load
    average), written with `write` when it ends.

    Args:
        out: String. Path of the JSON report.
        plot: Callable `plot(plt, report, path)` or `None` (no plot). See
            `draw`. Defaults to `None`.
        png: String or `None`. Where the plot goes. Defaults to `None`
            (beside the JSON file).
    """

    def __init__(self, out: str, plot=None, png: str | None = None):
        self.out = out
        self.plot = plot
        self.png = png
        self.load_average_start = os.getloadavg()
        self.started = time.perf_counter()

    def environment(self, stack_versions: dict | None = None, **extra) -> dict:
        """Returns the report's `environment` entry.

        Args:
            stack_versions: Dict or `None`. Library versions; `None` imports
                the stack and reads them (`versions()`). Defaults to `None`.
            **extra: More entries (e.g. `logical_cpu_devices=2`).
        """
        if stack_versions is None:
            stack_versions = versions()
        return {
            "python": platform.python_version(),
            **stack_versions,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            **extra,
            # Other work on the machine shifts absolute times; the scripts
            # compare configurations side by side to resist it.
            "load_average_start": self.load_average_start,
            "load_average_end": os.getloadavg(),
            "wall_seconds": time.perf_counter() - self.started,
        }

    def write(
        self, fields: dict, *, stack_versions: dict | None = None, **environment
    ) -> dict:
        """Writes the JSON report (and the plot) and says what was written.

        Args:
            fields: Dict. The script's entries (`setup`, `results`, ...),
                after `command` and `environment`.
            stack_versions: Dict or `None`. See `environment`.
            **environment: More `environment` entries.

        Returns:
            The report.
        """
        report = {
            "command": command(),
            "environment": self.environment(stack_versions, **environment),
            **fields,
        }
        report["plot"] = (
            None
            if self.plot is None
            else draw(self.plot, report, self.png or plot_path(self.out))
        )
        _make_folder_of(self.out)
        with open(self.out, "w") as handle:
            json.dump(report, handle, indent=2)
        written = report["plot"]
        print(f"\nWrote {self.out}" + (f" and {written}" if written else " (no plot)"))
        return report


# --- Processes -------------------------------------------------------------------


def job_from(args, *names: str, **more) -> dict:
    """A job for `run_processes`: the options `names` of `args`, and `more`."""
    return {**{name: getattr(args, name) for name in names}, **more}


def run_processes(
    script: str,
    job: dict,
    *,
    workers: int = 0,
    namespace: bool = False,
    rate: str | None = None,
    env: dict | None = None,
    timeout: float | None = None,
    name: str = "job",
) -> dict:
    """Runs `script --job JOB` in fresh processes; returns what task 0 wrote.

    With `workers=0`, one process without `TF_CONFIG` (a fresh process per
    measurement, e.g. for its peak memory). With `workers=N`, N processes,
    each with the `TF_CONFIG` of worker `i` of a cluster on free 127.0.0.1
    ports (`keras_dist.cluster.free_ports`, `make_tf_config`). Each process
    writes its output to a log file; when one fails the others are killed.

    Args:
        script: String. The script to run (its `__file__`); it must accept
            `--job` (`parser(..., jobs=True)`) and end the job with
            `finish_job`.
        job: Dict. JSON-serialisable; the process gets it as `args.job`,
            with `"result"` (the file `finish_job` writes) added.
        workers: Int. Worker processes of a cluster; 0 for one plain
            process. Defaults to `0`.
        namespace: Bool. Runs the processes inside a private network
            namespace of their own (`network_namespace`; needs root).
            Defaults to `False`.
        rate: String or `None`. With `namespace`, shapes its loopback to
            this `tc` rate (e.g. `"1gbit"`). Defaults to `None` (unshaped).
        env: Dict or `None`. Environment variables to add. Defaults to
            `None`.
        timeout: Float or `None`. Seconds to wait at most. Defaults to
            `None` (no limit).
        name: String. Names the run in messages and its log folder.

    Returns:
        The JSON the job's task 0 passed to `finish_job`.

    Raises:
        RuntimeError: a process failed, timed out or wrote no result; the
            message holds the end of its log and the folder the logs are
            kept in.
    """
    if namespace:
        namespace_name = f"kd_bench_{name}_{os.getpid()}"
        with network_namespace(namespace_name, rate):
            return _run_processes(
                script, job, workers, namespace_name, env, timeout, name
            )
    return _run_processes(script, job, workers, None, env, timeout, name)


def _run_processes(script, job, workers, namespace, env, timeout, name) -> dict:
    folder = tempfile.mkdtemp(prefix=f"kd_bench_{name}_")
    result_path = os.path.join(folder, "result.json")
    argv = [sys.executable, os.path.abspath(script)]
    argv += ["--job", json.dumps({**job, "result": result_path})]
    if namespace is not None:
        argv = ["ip", "netns", "exec", namespace, *argv]
    tasks = []
    try:
        for index, task_env in enumerate(_task_environments(workers, env)):
            log = open(os.path.join(folder, f"task{index}.log"), "w")  # noqa: SIM115
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=task_env,
            )
            tasks.append((process, log))
        failure = _wait([process for process, _ in tasks], timeout)
        if failure is None and not os.path.exists(result_path):
            failure = 0, "exited without writing a result"
    finally:
        for process, log in tasks:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
    if failure is not None:
        index, why = failure
        with open(tasks[index][1].name) as handle:
            tail = handle.read()[-LOG_TAIL:]
        raise RuntimeError(
            f"{name}: task {index} {why}. Logs kept in {folder}; the end of "
            f"task {index}'s:\n{tail}"
        )
    with open(result_path) as handle:
        result = json.load(handle)
    shutil.rmtree(folder, ignore_errors=True)
    return result


def _task_environments(workers: int, extra: dict | None) -> list[dict]:
    base = {**os.environ, **(extra or {}), "PYTHONPATH": REPO_ROOT}
    base.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    base.pop("TF_CONFIG", None)
    if not workers:
        return [base]
    cluster = import_stack()[2].cluster
    spec = {"worker": [f"127.0.0.1:{port}" for port in cluster.free_ports(workers)]}
    return [
        {**base, "TF_CONFIG": cluster.make_tf_config(spec, "worker", index)}
        for index in range(workers)
    ]


def _wait(processes, timeout):
    """Waits for all; returns `(index, why)` of the first failure, or `None`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while any(process.poll() is None for process in processes):
        for index, process in enumerate(processes):
            if process.poll() not in (None, 0):
                return index, f"failed (exit code {process.returncode})"
        if deadline is not None and time.monotonic() > deadline:
            running = [i for i, p in enumerate(processes) if p.poll() is None]
            return running[0], f"timed out after {timeout:g} s"
        time.sleep(0.2)
    for index, process in enumerate(processes):
        if process.returncode != 0:
            return index, f"failed (exit code {process.returncode})"
    return None


def task_index() -> int:
    """This process's task index in `TF_CONFIG`; 0 without one.

    Reads the variable itself: a worker may run another checkout's
    keras_dist (`bench_model_overhead.py --baseline`).
    """
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    return int(config.get("task", {}).get("index", 0))


def finish_job(job: dict, result) -> None:
    """Ends a job started by `run_processes`: task 0 writes `result`.

    Exits the process at once (`os._exit(0)`): a worker of a multi-worker
    strategy can hang at interpreter exit while its peers shut down.
    """
    if task_index() == 0:
        with open(job["result"], "w") as handle:
            json.dump(result, handle)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def require_root(script: str) -> None:
    """Exits with status 2 unless this process can make network namespaces.

    Raises:
        SystemExit: not root, or `ip`/`tc` (iproute2) missing; says so.
    """
    if os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc"):
        return
    print(
        f"{script} needs root and iproute2 (`ip`, `tc`) to create and shape a "
        "private network namespace. Run it with sudo.",
        file=sys.stderr,
    )
    raise SystemExit(2)


def _ip(*argv: str, check: bool = True) -> None:
    completed = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and completed.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(argv)}` failed (exit code {completed.returncode}): "
            f"{completed.stderr.strip()}"
        )


@contextlib.contextmanager
def network_namespace(name: str, rate: str | None = None):
    """A private network namespace with only its loopback, for its lifetime.

    Creates the namespace `name`, brings its loopback up and, with `rate`,
    shapes it with a token-bucket filter; deletes the namespace on exit. The
    processes run in it (`run_processes(namespace=True)`) reach each other
    on 127.0.0.1 only: nothing leaves the namespace. Needs root
    (`require_root`):

        ip netns add NAME; ip -n NAME link set lo up
        ip netns exec NAME tc qdisc add dev lo root tbf rate RATE \\
            burst 512kb latency 100ms
        ...
        ip netns del NAME

    Args:
        name: String. The namespace's name; make it unique (e.g. with the
            process id).
        rate: String or `None`. A `tc` rate such as `"1gbit"`; `None`
            leaves the loopback unshaped. Defaults to `None`.

    Yields:
        `name`.
    """
    _ip("ip", "netns", "add", name)
    try:
        _ip("ip", "-n", name, "link", "set", "lo", "up")
        if rate:
            _ip(
                *("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo"),
                *("root", "tbf", "rate", rate, "burst", "512kb", "latency", "100ms"),
            )
        yield name
    finally:
        _ip("ip", "netns", "del", name, check=False)


# --- Inside a worker -------------------------------------------------------------


def sharded_dataset(tf, x, y, batch_size: int):
    """`(x, y)` in batches of `batch_size`, repeated, sharded by data.

    The global batch of a multi-worker strategy: each worker takes its
    share of every batch (`AutoShardPolicy.DATA`).
    """
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(batch_size, drop_remainder=True)
        .repeat()
        .with_options(options)
    )


def timed_fit(keras, model, dataset, steps: int) -> list[float]:
    """Runs one `fit` of `steps` steps; returns the wall time of each step."""

    class StepTimer(keras.callbacks.Callback):
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

    timer = StepTimer()
    model.fit(dataset, epochs=1, steps_per_epoch=steps, callbacks=[timer], verbose=0)
    return timer.durations


def build_mlp(keras, keras_dist, width, hidden, hook, learning_rate):
    """The multi-worker benchmarks' MLP: `width` inputs, Dense(relu) layers of
    `hidden` units, 10 logits; a compiled `DistributedModel` with `hook` and
    SGD(`learning_rate`), seeded 0. Call it inside the strategy's scope."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((width,))
    h = inputs
    for units in hidden:
        h = keras.layers.Dense(units, activation="relu")(h)
    outputs = keras.layers.Dense(10)(h)
    model = keras_dist.DistributedModel(inputs, outputs, all_reduce_hook=hook)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


# --- Private keras_dist names ------------------------------------------------------
# The only private keras_dist modules the benchmarks touch; when they move,
# repoint these imports.


def ring_subdivisions():
    """`(set_subdivisions, default)`: `set_subdivisions(strategy, n)` sets the
    most pieces `strategy`'s CPU all-reduces split a tensor into, for what
    is traced afterwards (-1: TensorFlow's own, whole tensors); `default` is
    keras_dist's (`bench_ddp.py` times both in the same processes)."""
    from keras_dist._compat import tf_internal
    from keras_dist.core import collectives

    return tf_internal.own_launchers, collectives.RING_SUBDIVS


def gloo_switch():
    """`use(strategy, enabled)`: sends `strategy`'s gradient sums through
    keras_dist's gloo backend (`KERAS_DIST_COLLECTIVES=gloo`) or TensorFlow's
    collectives, for what is traced afterwards (`bench_ddp.py` times both in
    the same processes)."""
    from keras_dist.core import gloo

    return gloo.use


def default_collectives(strategy) -> list:
    """`[backend, reason]`: what keras_dist's collective layer picks for
    `strategy` with this process's environment (`KERAS_DIST_COLLECTIVES`,
    unset: `auto`), as `collectives.own` does before its first sum."""
    from keras_dist.core import gloo

    return list(gloo.choose(strategy))


def private_backup_modules():
    """`keras_dist.backup.transfer` and `keras_dist.backup.store`:
    `bench_backup.py` times `transfer.snapshot_values` (the gather),
    `transfer.materialize` and
    `store.write` / `store.remove_all` (the write and the cleanup of a save)
    by wrapping them in these modules."""
    from keras_dist.backup import store, transfer

    return transfer, store
