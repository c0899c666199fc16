"""The `keras-dist` command line: `launch`, `env` and `demo`.

`keras-dist launch` simulates a multi-worker cluster on one machine: it gives
every task a free localhost port, starts one process per task with its own
`TF_CONFIG`, and merges their output with a `[worker:1]`-style prefix on every
line. It is the quickest way to run a `MultiWorkerMirroredStrategy` or
`ParameterServerStrategy` script for real before it goes to a cluster.

Example:

```shell
keras-dist launch --workers 2 -- python train.py --epochs 3
keras-dist launch --workers 2 --ps 1 --chief -- python train.py
keras-dist env
keras-dist demo --help
```

This module imports TensorFlow only inside the commands that need it (`env`,
`demo` and the parameter-server tasks): launching needs none.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from typing import IO

from keras_dist import _process
from keras_dist import cluster as cluster_lib
from keras_dist._validation import check_int, check_real

PROG = "keras-dist"
TASK_ENV_VAR = "KERAS_DIST_TASK"
# The attempt number (0 for the first start) in every task's environment.
RESTART_ENV_VAR = "KERAS_DIST_RESTART"
DEFAULT_GRACE_PERIOD = 5.0
# Seconds a collective may wait for a peer, for tasks the launcher starts
# (`auto_strategy` reads it from KERAS_DIST_COLLECTIVE_TIMEOUT): generous,
# since one worker may validate or write a backup while the others wait.
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
COLLECTIVE_TIMEOUT_ENV_VAR = "KERAS_DIST_COLLECTIVE_TIMEOUT"
# Internal subcommand that runs a parameter-server task; hidden from `--help`.
PS_SERVER_COMMAND = "_ps-server"

_PS_SERVER_ARGS = ("-m", "keras_dist", PS_SERVER_COMMAND)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `keras-dist` command line.

    Args:
        argv: Sequence of strings or `None`. The arguments without the program
            name; `None` reads `sys.argv[1:]`. Defaults to `None`.

    Returns:
        The exit status. `0` on success, `2` for a usage error, `130` when
        interrupted, otherwise the status of what failed (for `launch`, the
        exit code of the first task that failed).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` belongs to the user's command, whatever
    # it looks like, so it is split off before argparse sees it.
    if "--" in argv:
        split = argv.index("--")
        argv, trailing = argv[:split], argv[split + 1 :]
    else:
        trailing = None
    parser = _build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if args.command == "demo":
            passthrough = extra + (["--", *trailing] if trailing is not None else [])
            return _run_demo(passthrough)
        if extra:
            (getattr(args, "subparser", None) or parser).error(
                f"unrecognized arguments: {' '.join(extra)}"
            )
        if args.command is None:
            parser.error(
                f"a command is required: launch, env or demo (see `{PROG} --help`)."
            )
        if args.command == "launch":
            command = list(args.user_command)
            if trailing is not None:
                if command:
                    args.subparser.error(
                        "give the command after `--` only. Received: "
                        f"{' '.join(command)} -- {' '.join(trailing)}"
                    )
                command = trailing
            if not command:
                args.subparser.error(
                    "no command to launch. Put it after `--`, e.g. "
                    f"`{PROG} launch --workers 2 -- python train.py`."
                )
            return launch(
                command,
                workers=args.workers,
                ps=args.ps,
                chief=args.chief,
                host=args.host,
                grace_period=args.grace_period,
                max_restarts=args.max_restarts,
                collective_timeout=args.collective_timeout,
            )
        if trailing is not None:
            args.subparser.error(
                f"`{args.command}` takes no command after `--`. "
                f"Received: -- {' '.join(trailing)}"
            )
        if args.command == "env":
            return _run_env()
        return _run_ps_server()
    except _UsageExit as usage_exit:
        return usage_exit.status
    except KeyboardInterrupt:
        return _process.EXIT_INTERRUPTED


def launch(
    command: Sequence[str],
    workers: int,
    ps: int = 0,
    chief: bool = False,
    host: str = "localhost",
    grace_period: float = DEFAULT_GRACE_PERIOD,
    max_restarts: int = 0,
    collective_timeout: float | None = None,
    environ: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Runs `command` as every chief and worker task of a local cluster.

    Each task is one process started with its own `TF_CONFIG` (and
    `KERAS_DIST_TASK`, e.g. `"worker:1"`) and `PYTHONUNBUFFERED=1`. Its stdout
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

    With `max_restarts > 0`, a failed job is started again, whole (a
    `MultiWorkerMirroredStrategy`'s collectives cannot take a new process
    into a running group), on fresh ports, up to `max_restarts` times; each
    restart is announced with the task that failed, how, and the attempt
    number, and every task finds the attempt number (0 first) in
    `KERAS_DIST_RESTART`. With `keras_dist.callbacks.BackupAndRestore` in
    the script, a restarted job goes on from its last backup. A task that
    was preempted (`SIGTERM`, after writing its backup) exits with status
    75, and is restarted like any other failure.

    Args:
        command: Sequence of strings. The program and its arguments, e.g.
            `["python", "train.py"]`.
        workers: Int. Number of `worker` tasks, >= 1.
        ps: Int. Number of parameter-server tasks. Defaults to `0`.
        chief: Bool. Whether to add a `chief` task that also runs `command`.
            Defaults to `False`.
        host: String. Host name written into the cluster addresses. Defaults
            to `"localhost"`.
        grace_period: Float. Seconds between SIGTERM and SIGKILL when tasks
            are stopped. Defaults to `5.0`.
        max_restarts: Int >= 0. How many times a failed job is started
            again. With parameter servers and a chief: how many times in all
            a failed worker is started again in place (the chief and the
            ps tasks are not restarted). Defaults to `0`.
        collective_timeout: Float or `None`. Seconds a collective may wait
            for a peer before it fails, given to the tasks as
            `KERAS_DIST_COLLECTIVE_TIMEOUT` (read by
            `keras_dist.auto_strategy`). `None` keeps the variable when the
            environment has it, else uses `DEFAULT_COLLECTIVE_TIMEOUT` (300
            s). Defaults to `None`.
        environ: Mapping or `None`. Base environment for the tasks; `None`
            uses `os.environ`. Defaults to `None`.
        stdout: Text stream or `None`. Where the prefixed task output goes;
            `None` means `sys.stdout`. Defaults to `None`.
        stderr: Text stream or `None`. Where the launcher's own messages go;
            `None` means `sys.stderr`. Defaults to `None`.

    Returns:
        `0` when every chief and worker task exited with status 0 (with
        parameter servers and a chief: when the chief did); otherwise
        the exit status of the first task that failed (`128 + N` for a task
        killed by signal N), `127` when `command` could not be started, `1`
        when the system has too few file descriptors or processes for every
        task, `130` after Ctrl-C and `143` after SIGTERM.

    Raises:
        TypeError: a count is not an int, or `grace_period` not a number.
        ValueError: `command` is empty, a count is out of range, or
            `grace_period` is negative or not finite.

    Example:

    ```python
    from keras_dist.cli import launch

    status = launch(["python", "train.py"], workers=2)  # like the CLI
    ```
    """
    command = list(command)
    if not command:
        raise ValueError("`command` must name a program to run. Received: command=[].")
    workers = check_int("workers", workers, minimum=1)
    grace_period = check_real(
        "grace_period", grace_period, minimum=0, hint="It is in seconds."
    )
    max_restarts = check_int("max_restarts", max_restarts, minimum=0)
    collective_timeout = check_real(
        "collective_timeout",
        collective_timeout,
        minimum=0,
        low_open=True,
        allow_none=True,
        hint="It is in seconds.",
    )
    coordinated = bool(ps and chief)
    if max_restarts and ps and not chief:
        raise ValueError(
            "`max_restarts` with parameter servers needs `chief=True` (the "
            "chief coordinates; a failed worker is restarted in place while "
            f"it runs). Received: max_restarts={max_restarts}, ps={ps}, "
            "chief=False."
        )
    # With a coordinator, a failed worker is restarted in place and the job
    # goes on; a MultiWorkerMirroredStrategy job restarts whole.
    worker_restarts = max_restarts if coordinated else 0
    max_restarts = 0 if coordinated else max_restarts
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    base_env = dict(os.environ if environ is None else environ)
    if collective_timeout is not None:
        base_env[COLLECTIVE_TIMEOUT_ENV_VAR] = f"{collective_timeout:g}"
    else:
        base_env.setdefault(
            COLLECTIVE_TIMEOUT_ENV_VAR, f"{DEFAULT_COLLECTIVE_TIMEOUT:g}"
        )
    launch_attempt = functools.partial(
        _launch_once,
        command,
        workers,
        ps,
        chief,
        host,
        grace_period,
        base_env,
        out,
        err,
        worker_restarts,
    )
    attempt = 0
    while True:
        failure: list = []
        status = launch_attempt(attempt, failure)
        # Only a task's failure is worth a restart: not a launcher that was
        # interrupted or stopped, nor a command that could not start.
        if status == 0 or not failure or attempt >= max_restarts:
            if failure and max_restarts and attempt >= max_restarts:
                _say(
                    err,
                    f"giving up after {attempt + 1} attempts (max restarts "
                    f"{max_restarts}); exit status {status}.",
                )
            return status
        attempt += 1
        name, code = failure[0]
        how = (
            "was preempted (status 75, after writing its backup)"
            if code == _process.EXIT_PREEMPTED
            else f"failed with {_process.describe_exit(code)}"
        )
        _say(
            err,
            f"restart {attempt} of {max_restarts}: {name} {how}; starting the "
            f"whole job again ({RESTART_ENV_VAR}={attempt}).",
        )


def _launch_once(
    command,
    workers,
    ps,
    chief,
    host,
    grace_period,
    base_env,
    out,
    err,
    worker_restarts,
    attempt,
    failure,
) -> int:
    """Starts every task of one attempt and supervises them to the end.

    The failed task's `(name, returncode)` is appended to `failure`.
    """
    try:
        spec = cluster_lib.local_cluster(workers=workers, ps=ps, chief=chief, host=host)
    except OSError as error:
        # Too many tasks for the descriptor limit: say so, as for a task
        # that cannot start.
        _say(err, str(error))
        return _process.EXIT_NO_RESOURCES
    specs = []
    # Parameter servers first: the training tasks connect to them.
    for task_type in ("ps", "chief", "worker"):
        for index in range(len(spec.get(task_type, []))):
            if task_type == "ps":
                task_command = [sys.executable, *_PS_SERVER_ARGS]
                env = _process.env_with_package(base_env)
            else:
                task_command, env = command, dict(base_env)
            name = f"{task_type}:{index}"
            env["TF_CONFIG"] = cluster_lib.make_tf_config(spec, task_type, index)
            env[TASK_ENV_VAR] = name
            env[RESTART_ENV_VAR] = str(attempt)
            env["PYTHONUNBUFFERED"] = "1"
            specs.append(
                _process.TaskSpec(name, task_command, env, serves=task_type == "ps")
            )
    # With parameter servers the chief is the coordinator: the job is done
    # when it is, and the workers, which only serve, are stopped then.
    coordinated = bool(ps and chief)
    return _process.run_tasks(
        specs,
        out,
        lambda message: _say(err, message),
        grace_period,
        coordinator="chief:0" if coordinated else None,
        failure=failure,
        # A parameter-server job survives its workers: the coordinator
        # retries a lost worker's steps on the others.
        replaceable=[s.name for s in specs if s.name.startswith("worker:")]
        if coordinated
        else (),
        restarts=worker_restarts,
    )


class _UsageExit(Exception):
    """argparse wants to exit; `main` returns the status instead."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


class _ArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose exits become `_UsageExit`, so `main` returns."""

    def exit(self, status=0, message=None):
        if message:
            self._print_message(message, sys.stderr)
        raise _UsageExit(status)


def _build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog=PROG,
        description="Distributed training for Keras 3 on TensorFlow.",
    )
    parser.add_argument("--version", action="version", version=_version_text())
    subparsers = parser.add_subparsers(
        dest="command", metavar="{launch,env,demo}", parser_class=_ArgumentParser
    )

    launch_parser = subparsers.add_parser(
        "launch",
        help="run a command as every task of a local multi-worker cluster",
        description=(
            "Simulate a multi-worker cluster on this machine: run COMMAND once "
            "per chief/worker task, each with its own TF_CONFIG on a free "
            "localhost port, and prefix every output line with the task name. "
            "Parameter-server tasks run a TensorFlow server instead."
        ),
        usage=(
            f"{PROG} launch --workers N [--ps M] [--chief] [--host HOST] "
            "[--grace-period SECONDS] [--max-restarts N] "
            "[--collective-timeout SECONDS] -- COMMAND [ARG ...]"
        ),
    )
    launch_parser.add_argument(
        "--workers",
        type=_int_at_least(1),
        required=True,
        metavar="N",
        help="number of worker tasks (>= 1)",
    )
    launch_parser.add_argument(
        "--ps",
        type=_int_at_least(0),
        default=0,
        metavar="M",
        help="number of parameter-server tasks (default: 0)",
    )
    launch_parser.add_argument(
        "--chief",
        action="store_true",
        help=(
            "add a chief task, which also runs COMMAND; with --ps it is the "
            "coordinator, and the launch ends when it does"
        ),
    )
    launch_parser.add_argument(
        "--host",
        default="localhost",
        help="host name written into the cluster addresses (default: localhost)",
    )
    launch_parser.add_argument(
        "--grace-period",
        type=_seconds,
        default=DEFAULT_GRACE_PERIOD,
        metavar="SECONDS",
        help=(
            "seconds between SIGTERM and SIGKILL when stopping tasks "
            f"(default: {DEFAULT_GRACE_PERIOD:g})"
        ),
    )
    launch_parser.add_argument(
        "--max-restarts",
        type=_int_at_least(0),
        default=0,
        metavar="N",
        help=(
            "start the whole job again when a task fails, up to N times; "
            "tasks find the attempt number in KERAS_DIST_RESTART; with --ps "
            "and --chief: restart a failed worker in place, up to N times in "
            "all (default: 0)"
        ),
    )
    launch_parser.add_argument(
        "--collective-timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help=(
            "seconds a collective may wait for a peer before it fails, given "
            "to the tasks as KERAS_DIST_COLLECTIVE_TIMEOUT (default: the "
            f"variable if set, else {DEFAULT_COLLECTIVE_TIMEOUT:g})"
        ),
    )
    launch_parser.add_argument(
        "user_command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS
    )
    launch_parser.set_defaults(subparser=launch_parser)

    env_parser = subparsers.add_parser(
        "env",
        help="print versions, devices and the strategy keras_dist would pick",
        description=(
            "Print the Python, TensorFlow and Keras versions, the visible "
            "devices, the strategy `keras_dist.auto_strategy` would pick here "
            "and why, and the GPU memory-growth state."
        ),
    )
    env_parser.set_defaults(subparser=env_parser)

    demo_parser = subparsers.add_parser(
        "demo",
        help="run the keras_dist demo (arguments go to the demo)",
        add_help=False,
    )
    demo_parser.set_defaults(subparser=demo_parser)

    ps_parser = subparsers.add_parser(PS_SERVER_COMMAND)
    ps_parser.set_defaults(subparser=ps_parser)
    return parser


def _int_at_least(minimum: int):
    """An argparse `type` for an integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer. Received: {text!r}."
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {minimum}. Received: {text!r}."
            )
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds. Received: {text!r}."
        ) from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a finite number >= 0. Received: {text!r}."
        )
    return value


def _version_text() -> str:
    from keras_dist import __version__

    return f"{PROG} {__version__}"


def _say(stream: IO[str], message: str) -> None:
    print(f"{PROG}: {message}", file=stream, flush=True)


def _run_ps_server() -> int:
    """Runs this process's parameter-server task from `TF_CONFIG` until killed."""
    try:
        config = cluster_lib.parse_tf_config()
    except ValueError as error:
        _say(sys.stderr, str(error))
        return 2
    task = (config or {}).get("task") or {}
    if task.get("type") != "ps":
        _say(
            sys.stderr,
            f"`{PS_SERVER_COMMAND}` runs a parameter-server task and needs "
            "TF_CONFIG with task type 'ps'. Received: "
            f"TF_CONFIG={os.environ.get('TF_CONFIG', '')!r}. It is started by "
            f"`{PROG} launch --ps M`.",
        )
        return 2
    import tensorflow as tf

    index = task.get("index", 0)
    server = tf.distribute.Server(
        tf.train.ClusterSpec(config["cluster"]),
        job_name="ps",
        task_index=index,
        protocol="grpc",
        start=True,
    )
    address = config["cluster"]["ps"][index]
    print(
        f"parameter server ps:{index} listening on {address} (pid {os.getpid()})",
        flush=True,
    )
    server.join()
    return 0


def _run_demo(argv: list[str]) -> int:
    from keras_dist import demo

    try:
        status = demo.main(argv)
    except SystemExit as exit_request:
        # The demo parses its own arguments; its exits become return values.
        status = exit_request.code
    if status is None or isinstance(status, int):
        return status or 0
    print(status, file=sys.stderr)
    return 1


def _run_env() -> int:
    import keras
    import tensorflow as tf

    from keras_dist import __version__
    from keras_dist import memory as memory_lib
    from keras_dist import strategy as strategy_lib

    print(f"keras_dist:    {__version__}")
    print(
        f"Python:        {platform.python_version()} "
        f"({platform.python_implementation()}, {platform.platform()})"
    )
    print(f"TensorFlow:    {tf.__version__}")
    print(f"Keras:         {keras.__version__} (backend: {keras.backend.backend()})")
    for kind in ("CPU", "GPU"):
        devices = tf.config.list_physical_devices(kind)
        names = ", ".join(device.name for device in devices) or "none"
        print(f"{kind} devices:   {len(devices)} ({names})")
    tf_config = os.environ.get("TF_CONFIG", "").strip()
    print(f"TF_CONFIG:     {tf_config or 'not set'}")
    engine = cluster_lib.detect_engine()
    print(f"Engine:        {engine.name} ({engine.detail})")
    status = 0
    try:
        choice = strategy_lib.describe_choice()
    except ValueError as error:
        print(f"Strategy:      cannot decide: {error}")
        status = 1
    else:
        resolver = f" (resolver: {choice.resolver})" if choice.resolver else ""
        print(f"Strategy:      {choice.name}{resolver}")
        print(f"  because:     {choice.reason}")
    growth = memory_lib.memory_growth_state()
    if growth:
        states = ", ".join(
            f"{name}: {'on' if enabled else 'off'}" for name, enabled in growth.items()
        )
    else:
        states = "n/a (no GPU visible)"
    print(f"Memory growth: {states}")
    return status
