"""Run a command as every task of a local cluster; restart a failed job.

`launch` is what `keras-dist launch` runs. It builds the tasks of a local
cluster (`keras_dist.cluster.local_cluster`: a free localhost port per task,
each task's own `TF_CONFIG`), starts and supervises them through
`keras_dist.launcher.process`, relays the exit status of the task that
failed, and with `max_restarts` starts a failed job again. With
`workers=(min, max)` (and `discover`) each attempt has its own number of
workers (`keras_dist.launcher.elastic`).

This module imports neither TensorFlow nor Keras: parameter-server tasks run
`python -m keras_dist _ps-server` (`keras_dist.parameter_server.serving`),
so the launcher itself starts its tasks without paying for a framework.

Example:

```python
from keras_dist.launcher import launch

status = launch(["python", "train.py"], workers=2)  # like the command line
```
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from keras_dist import cluster as cluster_lib
from keras_dist._validation import check_bool, check_int, check_real
from keras_dist.launcher import attempts as attempts_lib
from keras_dist.launcher import elastic as elastic_lib
from keras_dist.launcher import output as output_lib
from keras_dist.launcher import process as process_lib
from keras_dist.launcher import report as report_lib
from keras_dist.launcher import tf_logs as tf_logs_lib

PROG = "keras-dist"
TASK_ENV_VAR = attempts_lib.TASK_ENV_VAR
# The attempt number (0 for the first start) in every task's environment.
RESTART_ENV_VAR = "KERAS_DIST_RESTART"
WORKERS_ENV_VAR = elastic_lib.WORKERS_ENV_VAR
WORKERS_RANGE_ENV_VAR = elastic_lib.WORKERS_RANGE_ENV_VAR
EXIT_TOO_FEW_WORKERS = elastic_lib.EXIT_TOO_FEW_WORKERS
EXIT_DISCOVERY_FAILED = elastic_lib.EXIT_DISCOVERY_FAILED
DEFAULT_GRACE_PERIOD = 5.0
# Restarts of an elastic launch when none are asked for: a range of
# workers can only change size when the job restarts.
DEFAULT_ELASTIC_RESTARTS = 3
# Seconds a collective may wait for a peer, for tasks the launcher starts
# (`auto_strategy` reads it from KERAS_DIST_COLLECTIVE_TIMEOUT): generous,
# since one worker may validate or write a backup while the others wait.
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
COLLECTIVE_TIMEOUT_ENV_VAR = cluster_lib.COLLECTIVE_TIMEOUT_ENV_VAR
# Internal subcommand that runs a parameter-server task; hidden from `--help`.
PS_SERVER_COMMAND = "_ps-server"
# The cores split between the tasks (`split_threads`): on unless this
# variable is `0`, `false`, `no` or `off`.
SPLIT_THREADS_ENV_VAR = "KERAS_DIST_SPLIT_THREADS"
# TensorFlow sizes its intra-op pool from this variable when it starts.
INTRA_OP_ENV_VAR = "TF_NUM_INTRAOP_THREADS"
# Variables by which the user has chosen the threads already: then the
# launcher sets nothing.
USER_THREAD_ENV_VARS = (INTRA_OP_ENV_VAR, "OMP_NUM_THREADS")
_SPLIT_OFF = ("0", "false", "no", "off")

_PS_SERVER_ARGS = ("-m", "keras_dist", PS_SERVER_COMMAND)


def launch(
    command: Sequence[str],
    workers: int | tuple[int, int],
    ps: int = 0,
    chief: bool = False,
    host: str = "localhost",
    grace_period: float = DEFAULT_GRACE_PERIOD,
    max_restarts: int | None = None,
    collective_timeout: float | None = None,
    collectives: str | None = None,
    environ: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    tf_logs: bool = False,
    split_threads: bool | None = None,
    discover: str | None = None,
    log_dir: str | None = None,
    only_chief: bool = False,
) -> int:
    """Runs `command` as every chief and worker task of a local cluster.

    Each task is one process started with its own `TF_CONFIG` (and
    `KERAS_DIST_TASK`, e.g. `"worker:1"`; `KERAS_DIST_WORKERS`, the number of
    worker tasks of this attempt) and `PYTHONUNBUFFERED=1`. Its stdout
    and stderr are merged and every line is written to `stdout` as it comes,
    prefixed with the task name: `[worker:1] ...`; when the reader of
    `stdout` goes away (`keras-dist launch ... | head`), the output is dropped
    and the tasks run on. Parameter-server tasks do
    not run `command`: each runs a TensorFlow gRPC server until the training
    tasks are done, and is then stopped (the same server that
    `keras_dist.auto_strategy()` starts on a `ps` task where a cluster runs
    the script on every task). With parameter servers and a chief, the chief
    is the `ParameterServerStrategy` coordinator: when it exits with status
    0 the job is done, and workers still running (serving in
    `auto_strategy()`, which never returns there) are stopped.

    The first training task that fails stops all the others (SIGTERM, then
    SIGKILL after `grace_period` seconds). A parameter server that exits while
    training tasks still run is a failure too. Under parameter servers a
    worker is not: the coordinator retries its steps on the other workers,
    and the job goes on while one worker is left (or, with `max_restarts`,
    the failed worker is started again in place). Every task runs in its own
    process group, so whatever it starts is stopped with it.

    TensorFlow's native log lines (the oneDNN notice, `failed call to
    cuInit`, the coordination service's progress, ...) are quiet: the tasks
    get `TF_CPP_MIN_LOG_LEVEL=3`, and the lines TensorFlow writes before it
    reads that variable are dropped from their output. They are all shown
    with `tf_logs=True` (`--tf-logs`) or `KERAS_DIST_TF_LOGS=1`; when the
    environment sets `TF_CPP_MIN_LOG_LEVEL`, that level applies and nothing
    is dropped (`keras_dist.launcher.tf_logs`).

    With `max_restarts > 0`, a failed job is started again, whole (a
    `MultiWorkerMirroredStrategy`'s collectives cannot take a new process
    into a running group), on fresh ports, up to `max_restarts` times; each
    restart is announced with the task that failed, how, and the attempt
    number, and every task finds the attempt number (0 first) in
    `KERAS_DIST_RESTART`. With `keras_dist.callbacks.BackupAndRestore` in
    the script, a restarted job goes on from its last backup. A task that
    was preempted (`SIGTERM`, after writing its backup) exits with status
    75, and is restarted like any other failure.

    With `workers=(min, max)` the launch is elastic (as `horovodrun
    --min-np/--max-np` and torchrun's `--nnodes MIN:MAX`): before the first
    attempt and before every restart, the shell command `discover` is run
    (`sh -c`, 30 s at most) and prints how many worker slots are available
    now, one integer (Horovod's discovery script prints `host:slots` lines;
    every task of this launcher runs on this machine). Each attempt starts
    `min(max, available)` workers; without `discover`, `max` are always
    available. Fewer than `min` stop the launch with status 69, and a
    discovery command that fails, times out or prints anything but one
    integer >= 0 stops it with status 1; both are explained on `stderr`. A
    restart with another number of workers says so (`restart 1 of 3:
    worker:3 failed with ...; starting the whole job again with 3 workers
    instead of 4: --discover 'cat slots' reports 3 slot(s) ...`). Every
    task finds the range in `KERAS_DIST_WORKERS_RANGE` (`"2:4"`), and the
    cluster of its attempt in `TF_CONFIG` and `KERAS_DIST_WORKERS`; with
    `keras_dist.callbacks.BackupAndRestore` the training goes on from its
    last backup on the new number of workers (elastic resume). An int
    `workers` with `discover` needs that many slots. Elastic launches run
    worker tasks only: no parameter servers, no chief.

    The tasks share this machine's cores, and TensorFlow gives every
    process an intra-op thread pool as large as all of them, so N tasks
    oversubscribe the cores N times. The launcher splits them (as torchrun
    sets `OMP_NUM_THREADS=1`): with more than one task, each gets
    `TF_NUM_INTRAOP_THREADS = max(1, cores // tasks)`, where cores is the
    size of this process's CPU affinity mask (`os.cpu_count()` where there
    is none) and tasks counts every task started here (parameter servers,
    chief and workers). Nothing is set when the environment has
    `TF_NUM_INTRAOP_THREADS` or `OMP_NUM_THREADS` (the user chose), when
    `split_threads=False`, or when `KERAS_DIST_SPLIT_THREADS` is `0`,
    `false`, `no` or `off`. The inter-op pool is left to TensorFlow:
    `benchmarks/bench_ddp.py --threads-check` measured no gain from
    shrinking it (docs/benchmarks/ddp.md).

    `keras_dist.cli.launch` is this same function.

    Args:
        command: Sequence of strings. The program and its arguments, e.g.
            `["python", "train.py"]`.
        workers: Int or tuple of two ints. Number of `worker` tasks, >= 1;
            or `(min, max)`, `1 <= min <= max`, for an elastic launch of
            `min` to `max` workers (see above).
        ps: Int. Number of parameter-server tasks. Defaults to `0`.
        chief: Bool. Whether to add a `chief` task that also runs `command`.
            Defaults to `False`.
        host: String. Host name written into the cluster addresses. Defaults
            to `"localhost"`.
        grace_period: Float. Seconds between SIGTERM and SIGKILL when tasks
            are stopped. Defaults to `5.0`.
        max_restarts: Int >= 0 or `None`. How many times a failed job is
            started again. With parameter servers and a chief: how many
            times in all a failed worker is started again in place (the
            chief and the ps tasks are not restarted). `None`: 0, or
            `DEFAULT_ELASTIC_RESTARTS` (3) for an elastic launch, which can
            only resize when it restarts. Defaults to `None`.
        collective_timeout: Float or `None`. Seconds a collective may wait
            for a peer before it fails, given to the tasks as
            `KERAS_DIST_COLLECTIVE_TIMEOUT` (read by
            `keras_dist.auto_strategy`). `None` keeps the variable when the
            environment has it, else uses `DEFAULT_COLLECTIVE_TIMEOUT` (300
            s). Defaults to `None`.
        collectives: String or `None`. What carries the sums of the tasks'
            CPU multi-worker strategies: `"tensorflow"` (its collectives),
            `"gloo"` (PyTorch's gloo: faster on a fast network, needs
            PyTorch in every task; see the cluster guide) or `"auto"` (gloo
            where PyTorch is installed and a task has one CPU device),
            given to the tasks as `KERAS_DIST_COLLECTIVES`. `None` keeps the
            variable when the environment has it (each task chooses, `auto`,
            otherwise). Defaults to `None`.
        environ: Mapping or `None`. Base environment for the tasks; `None`
            uses `os.environ`. Defaults to `None`.
        stdout: Text stream or `None`. Where the prefixed task output goes;
            `None` means `sys.stdout`. Defaults to `None`.
        stderr: Text stream or `None`. Where the launcher's own messages go;
            `None` means `sys.stderr`. Defaults to `None`.
        tf_logs: Bool. Show TensorFlow's native log lines (the tasks also
            get `KERAS_DIST_TF_LOGS=1`). Defaults to `False`: quiet, unless
            the environment sets `KERAS_DIST_TF_LOGS` or
            `TF_CPP_MIN_LOG_LEVEL`.
        split_threads: Bool or `None`. Split the cores between the tasks
            (`TF_NUM_INTRAOP_THREADS`, see above). `None` splits them unless
            `KERAS_DIST_SPLIT_THREADS` turns it off. Defaults to `None`.
        discover: String or `None`. A shell command that prints the number
            of worker slots available (see above), run before every
            attempt. `None` means `max` slots (all of `workers`). Defaults
            to `None`.
        log_dir: String or `None`. The folder that keeps every task's whole
            output, one file per task and attempt
            (`attempt-1/worker-0.log`); `None` makes a new folder in the
            system's temporary directory. The launcher's report of a failure
            names the files. Defaults to `None`.
        only_chief: Bool. Show only the chief's output (`chief:0`, or
            `worker:0` without a chief); the other tasks' lines go to their
            log files, and their errors (a traceback, in one line) are
            still shown. Defaults to `False`.

    Returns:
        `0` when every chief and worker task exited with status 0 (with
        parameter servers and a chief: when the chief did); otherwise
        the exit status of the first task that failed (`128 + N` for a task
        killed by signal N), `127` when `command` could not be started, `1`
        when the system has too few file descriptors or processes for every
        task, or when `discover` failed, `69` when fewer worker slots than
        the minimum are available, `130` after Ctrl-C and `143` after
        SIGTERM.

    Raises:
        TypeError: a count is not an int (`workers` not an int or a pair of
            ints), `chief` not a bool, `grace_period` not a number, or
            `discover` not a string.
        ValueError: `command` is empty, a count is out of range (or
            `workers=(min, max)` has `min > max`), `grace_period` is
            negative or not finite, `discover` is empty, `max_restarts` is
            given with parameter servers but no chief, or an elastic launch
            (`workers=(min, max)` or `discover`) has parameter servers or a
            chief.

    Example:

    ```python
    from keras_dist.launcher import launch

    status = launch(["python", "train.py"], workers=2)  # like the CLI
    # 2 to 4 workers, as many as `cat slots` says, restarted up to 3 times:
    status = launch(
        ["python", "train.py"], workers=(2, 4), discover="cat slots", max_restarts=3
    )
    ```
    """
    command = list(command)
    if not command:
        raise ValueError("`command` must name a program to run. Received: command=[].")
    sizing = elastic_lib.check_workers(workers)
    discover = elastic_lib.check_discover(discover)
    ps = check_int("ps", ps, minimum=0)
    chief = check_bool("chief", chief)
    tf_logs = check_bool("tf_logs", tf_logs)
    if split_threads is not None:
        split_threads = check_bool("split_threads", split_threads)
    grace_period = check_real(
        "grace_period", grace_period, minimum=0, hint="It is in seconds."
    )
    only_chief = check_bool("only_chief", only_chief)
    elastic_default = max_restarts is None and sizing.elastic and not (ps or chief)
    if max_restarts is None:
        max_restarts = DEFAULT_ELASTIC_RESTARTS if elastic_default else 0
    max_restarts = check_int("max_restarts", max_restarts, minimum=0)
    collective_timeout = cluster_lib.check_collective_timeout(collective_timeout)
    collectives = cluster_lib.check_collectives(collectives)
    coordinated = bool(ps and chief)
    if max_restarts and ps and not chief:
        raise ValueError(
            "`max_restarts` with parameter servers needs `chief=True` (the "
            "chief coordinates; a failed worker is restarted in place while "
            f"it runs). Received: max_restarts={max_restarts}, ps={ps}, "
            "chief=False."
        )
    if (sizing.elastic or discover is not None) and (ps or chief):
        raise ValueError(
            "An elastic launch (`workers=(min, max)` or `discover`) runs "
            "worker tasks only: a chief or parameter servers cannot be "
            f"resized. Received: workers={workers!r}, discover={discover!r}, "
            f"ps={ps}, chief={chief}. Drop `ps` and `chief` (a worker-only "
            "job's worker:0 is its chief), or give `workers` as one int "
            "without `discover`."
        )
    if elastic_default:
        say(
            stderr if stderr is not None else sys.stderr,
            f"elastic launch (--workers {sizing}): a failed job is restarted "
            f"up to {max_restarts} times, on the workers available then "
            "(--max-restarts sets another number).",
        )
    env = dict(os.environ if environ is None else environ)
    if collectives is not None:
        env[cluster_lib.COLLECTIVES_ENV_VAR] = collectives
    else:
        # A bad value would fail every task the same way: say it once here.
        cluster_lib.check_collectives(
            env.get(cluster_lib.COLLECTIVES_ENV_VAR), cluster_lib.COLLECTIVES_ENV_VAR
        )
    if collective_timeout is not None:
        env[COLLECTIVE_TIMEOUT_ENV_VAR] = f"{collective_timeout:g}"
    else:
        env.setdefault(COLLECTIVE_TIMEOUT_ENV_VAR, f"{DEFAULT_COLLECTIVE_TIMEOUT:g}")
    if sizing.elastic:
        env[WORKERS_RANGE_ENV_VAR] = str(sizing)
    else:
        # Not inherited from a launch around this one: absent means not elastic.
        env.pop(WORKERS_RANGE_ENV_VAR, None)
    if split_threads is None:
        split_threads = env.get(SPLIT_THREADS_ENV_VAR, "").strip().lower() not in (
            _SPLIT_OFF
        )
    quiet = tf_logs_lib.prepare_environment(env, tf_logs)
    if tf_logs:
        # So that a `keras-dist` command run by a task shows them too.
        env[tf_logs_lib.TF_LOGS_ENV_VAR] = "1"
    err = stderr if stderr is not None else sys.stderr
    job = _Job(
        command=command,
        ps=ps,
        chief=chief,
        host=host,
        grace_period=grace_period,
        env=env,
        split_threads=split_threads,
        out=stdout if stdout is not None else sys.stdout,
        err=err,
        # With a coordinator, a failed worker is restarted in place and the
        # job goes on; a MultiWorkerMirroredStrategy job restarts whole.
        worker_restarts=max_restarts if coordinated else 0,
        keep_line=tf_logs_lib.keep_line if quiet else None,
        log_root=log_dir or tempfile.mkdtemp(prefix="keras-dist-logs-"),
        only_chief=only_chief,
    )
    max_restarts = 0 if coordinated else max_restarts
    attempt, size, failed, last = 0, None, None, None
    while True:
        previous = size
        try:
            # Asked once the failed attempt is stopped: its workers' slots
            # are free again, or gone for good. SIGTERM meanwhile stops the
            # discovery command before the launcher exits.
            with process_lib.sigterm_raises():
                size, reason = _size_of_attempt(sizing, discover, env, err, failed)
        except _Stop as stop:
            return stop.status
        except process_lib.Terminated:
            say(err, "received SIGTERM while asking for worker slots; stopping.")
            return process_lib.EXIT_TERMINATED
        if attempt:
            resized = (
                f" with {size} workers instead of {previous}: {reason}"
                if size != previous
                else ""
            )
            resume = attempts_lib.describe_backup(attempts_lib.last_backup(last.folder))
            say(
                err,
                f"restart {attempt} of {max_restarts}: {_describe_failure(failed)}; "
                f"starting the whole job again{resized} ({RESTART_ENV_VAR}="
                f"{attempt}), {resume}.",
            )
        elif discover is not None:
            say(err, f"starting {size} workers (--workers {sizing}): {reason}.")
        previous_attempt, last = last, job.run(attempt, size)
        status, failed = last.status, last.failed
        # Only a task's failure is worth a restart: not a launcher that was
        # interrupted or stopped, nor a command that could not start.
        if status == 0 or failed is None or attempt >= max_restarts:
            if failed is not None and max_restarts and attempt >= max_restarts:
                say(
                    err,
                    f"giving up after {attempt + 1} attempts (max restarts "
                    f"{max_restarts}); exit status {status}.",
                )
            return status
        if _fails_the_same_way(previous_attempt, last):
            say(
                err,
                f"{failed[0]} failed before its first step with the same error "
                f"as in attempt {attempt}: {last.error}. A restart would fail "
                f"the same way; not restarting (exit status {status}). Logs: "
                f"{last.folder}.",
            )
            return status
        attempt += 1


def _fails_the_same_way(previous, last) -> bool:
    """Two attempts whose script raised the same exception before any
    task trained a step: an error in the script's own set-up, which no
    restart mends. (An exit without a traceback is not compared: a task
    may exit with the same status for different reasons.)"""
    return (
        previous is not None
        and previous.kind == last.kind == "failed"
        and not previous.started
        and not last.started
        and last.error is not None
        and previous.error == last.error
    )


class _Stop(Exception):
    """The launch stops before an attempt, with this exit status."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


def _describe_failure(failed: tuple[str, int]) -> str:
    """`"worker:1 failed with exit code 3"`, or that it was preempted."""
    name, code = failed
    if code == process_lib.EXIT_PREEMPTED:
        return f"{name} was preempted (status 75, after writing its backup)"
    return f"{name} failed with {process_lib.describe_exit(code)}"


def _size_of_attempt(
    sizing: elastic_lib.WorkerRange,
    discover: str | None,
    env: Mapping[str, str],
    err: IO[str],
    failed: tuple[str, int] | None,
) -> tuple[int, str]:
    """The workers of the next attempt, and why that many.

    Asks `discover` for the slots available (`sizing.maximum` without it).

    Raises:
        _Stop: the discovery failed or reported fewer slots than
            `sizing.minimum`; the reason is written to `err`.
    """
    if discover is None:
        return sizing.maximum, f"--workers {sizing}"
    after = f"{_describe_failure(failed)}; " if failed is not None else ""
    try:
        slots = elastic_lib.discover_slots(discover, env)
    except elastic_lib.DiscoveryError as error:
        say(err, f"{after}{error} Stopping (exit status {EXIT_DISCOVERY_FAILED}).")
        raise _Stop(EXIT_DISCOVERY_FAILED) from None
    named = elastic_lib.describe_discover(discover)
    if slots < sizing.minimum:
        needed = (
            f"the minimum {sizing.minimum} of --workers {sizing}"
            if sizing.elastic
            else f"the {sizing.minimum} of --workers {sizing}"
        )
        say(
            err,
            f"{after}{slots} worker slot(s) available ({named} printed {slots}), "
            f"fewer than {needed}; stopping (exit status {EXIT_TOO_FEW_WORKERS}).",
        )
        raise _Stop(EXIT_TOO_FEW_WORKERS)
    reason = f"{named} reports {slots} slot(s)"
    if slots > sizing.maximum:
        return sizing.maximum, f"{reason}, more than the maximum {sizing.maximum}"
    return slots, reason


def available_cores() -> int:
    """The cores this process may run on: its affinity mask, else the count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity mask (macOS, Windows)
        return os.cpu_count() or 1


def split_cores(
    env: dict[str, str], tasks: int, cores: int | None = None
) -> int | None:
    """Gives each of `tasks` processes its share of the cores, in `env`.

    Sets `TF_NUM_INTRAOP_THREADS` to `max(1, cores // tasks)` when more than
    one task shares the machine and `env` has neither
    `TF_NUM_INTRAOP_THREADS` nor `OMP_NUM_THREADS` (a value the user chose
    is kept). One task already gets every core from TensorFlow.

    Args:
        env: Dict. The tasks' base environment, changed in place.
        tasks: Int. The processes started on this machine.
        cores: Int or `None`. The cores to split; `None` reads
            `available_cores()`. Defaults to `None`.

    Returns:
        The intra-op threads set, or `None` when nothing was set.
    """
    if tasks <= 1 or any(env.get(name, "").strip() for name in USER_THREAD_ENV_VARS):
        return None
    threads = max(1, (available_cores() if cores is None else cores) // tasks)
    env[INTRA_OP_ENV_VAR] = str(threads)
    return threads


def cluster_tasks(
    command: Sequence[str],
    cluster_spec: Mapping[str, Sequence[str]],
    env: Mapping[str, str],
    attempt: int = 0,
) -> list[process_lib.TaskSpec]:
    """Returns what to start for every task of `cluster_spec`, in start order.

    Parameter servers come first (the training tasks connect to them) and run
    `python -m keras_dist _ps-server` with this copy of keras_dist on their
    `PYTHONPATH`; the chief and worker tasks run `command`. Every task's
    environment is `env` plus its `TF_CONFIG`, `KERAS_DIST_TASK` (e.g.
    `"worker:1"`), `KERAS_DIST_RESTART` (`attempt`), `KERAS_DIST_WORKERS`
    (the number of `worker` tasks in `cluster_spec`) and
    `PYTHONUNBUFFERED=1`.

    Args:
        command: Sequence of strings. The program and its arguments.
        cluster_spec: Dict. Task type -> addresses, as
            `keras_dist.cluster.local_cluster` returns it.
        env: Mapping. The base environment of every task.
        attempt: Int. The attempt number, 0 for the first start. Defaults to
            `0`.

    Returns:
        A list of `keras_dist.launcher.process.TaskSpec`.
    """
    specs = []
    for task_type in ("ps", "chief", "worker"):
        for index in range(len(cluster_spec.get(task_type, []))):
            if task_type == "ps":
                task_command = [sys.executable, *_PS_SERVER_ARGS]
                task_env = process_lib.env_with_package(env)
            else:
                task_command, task_env = list(command), dict(env)
            name = f"{task_type}:{index}"
            task_env["TF_CONFIG"] = cluster_lib.make_tf_config(
                cluster_spec, task_type, index
            )
            task_env[TASK_ENV_VAR] = name
            task_env[RESTART_ENV_VAR] = str(attempt)
            task_env[WORKERS_ENV_VAR] = str(len(cluster_spec.get("worker", [])))
            task_env["PYTHONUNBUFFERED"] = "1"
            specs.append(
                process_lib.TaskSpec(
                    name, task_command, task_env, serves=task_type == "ps"
                )
            )
    return specs


def say(stream: IO[str], message: str) -> None:
    """Writes one of the launcher's own messages, `keras-dist: ...`."""
    print(f"{PROG}: {message}", file=stream, flush=True)


@dataclasses.dataclass(frozen=True)
class _Job:
    """What every attempt of one `launch` starts the same way."""

    command: list[str]
    ps: int
    chief: bool
    host: str
    grace_period: float
    env: dict[str, str]
    split_threads: bool
    out: IO[str]
    err: IO[str]
    worker_restarts: int
    keep_line: Callable[[str], bool] | None
    log_root: str
    only_chief: bool

    def run(self, attempt: int, workers: int) -> _Attempt:
        """Starts every task of one attempt, with `workers` workers, to the end."""
        env = dict(self.env)
        if self.split_threads:
            # Per attempt: an elastic job's size, and so each task's share,
            # can change from one attempt to the next.
            split_cores(env, workers + self.ps + int(self.chief))
        try:
            spec = cluster_lib.local_cluster(
                workers=workers, ps=self.ps, chief=self.chief, host=self.host
            )
        except OSError as error:
            # Too many tasks for the descriptor limit: say so, as for a task
            # that cannot start.
            say(self.err, str(error))
            return _Attempt(process_lib.EXIT_NO_RESOURCES)
        folder = os.path.join(self.log_root, f"attempt-{attempt + 1}")
        os.makedirs(folder, exist_ok=True)
        env[attempts_lib.RUN_DIR_ENV_VAR] = folder
        specs = cluster_tasks(self.command, spec, env, attempt)
        # With parameter servers the chief is the coordinator: the job is
        # done when it is, and the workers, which only serve, are stopped then.
        coordinated = bool(self.ps and self.chief)
        chief = "chief:0" if self.chief else "worker:0"
        output = output_lib.TaskOutput(
            self.out,
            keep=self.keep_line,
            log_dir=folder,
            shown={chief} if self.only_chief else None,
        )
        started = time.monotonic()
        result = _Attempt(0, folder=folder)

        def report(failed, tasks, code):
            lines = report_lib.failure_block(
                failed, tasks, code, output.records, time.monotonic() - started
            )
            for line in lines:
                say(self.err, line)
            diagnosis = report_lib.diagnose(failed, tasks, code, output.records)
            result.kind, result.cause = diagnosis.kind, diagnosis.cause
            record = output.records.get(failed.name)
            result.error = None if record is None else record.exception

        failure = []
        result.status = process_lib.run_tasks(
            specs,
            output,
            lambda message: say(self.err, message),
            self.grace_period,
            coordinator="chief:0" if coordinated else None,
            failure=failure,
            # A parameter-server job survives its workers: the coordinator
            # retries a lost worker's steps on the others.
            replaceable=[s.name for s in specs if s.name.startswith("worker:")]
            if coordinated
            else (),
            restarts=self.worker_restarts,
            report=None if coordinated else report,
        )
        result.failed = failure[0] if failure else None
        result.started = bool(attempts_lib.started_tasks(folder))
        return result


@dataclasses.dataclass
class _Attempt:
    """How one attempt ended.

    Attributes:
        status: Int. Its exit status.
        failed: `(name, returncode)` of the task that failed, or `None`.
        folder: String or `None`. Its folder (logs, the tasks' notes).
        kind: String or `None`: `"lost"`, `"hung"` or `"failed"` (the
            report's diagnosis).
        cause: String or `None`: the diagnosis's one line.
        error: String or `None`: the failed task's exception line.
        started: Bool. Whether any task trained a step.
    """

    status: int
    failed: tuple | None = None
    folder: str | None = None
    kind: str | None = None
    cause: str | None = None
    error: str | None = None
    started: bool = False
