"""The `keras-dist` command line: `launch`, `env` and `demo`.

`keras-dist launch` simulates a multi-worker cluster on one machine: it gives
every task a free localhost port, starts one process per task with its own
`TF_CONFIG`, and merges their output with a `[worker:1]`-style prefix on every
line. It is the quickest way to run a `MultiWorkerMirroredStrategy` or
`ParameterServerStrategy` script for real before it goes to a cluster.

This module parses the arguments and dispatches: `launch` runs
`keras_dist.launcher.launch` (also importable as `keras_dist.cli.launch`),
the hidden `_ps-server` (a launcher's parameter-server task) runs
`keras_dist.parameter_server.serving.serve`.

Example:

```shell
keras-dist launch --workers 2 -- python train.py --epochs 3
keras-dist launch --workers 2 --ps 1 --chief -- python train.py
keras-dist launch --workers 2:4 --discover 'cat slots' -- python train.py
keras-dist env
keras-dist demo --help
```

This module imports TensorFlow only inside the commands that need it (`env`,
`demo` and the parameter-server tasks): launching needs none.

TensorFlow's native log lines (C++ INFO/WARNING/ERROR lines such as the
oneDNN notice or `failed call to cuInit`) are hidden, in the launched tasks'
output and in `env` and `demo`, unless `--tf-logs` is given,
`KERAS_DIST_TF_LOGS=1` is set, or `TF_CPP_MIN_LOG_LEVEL` is set (then
TensorFlow's own rules apply): see `keras_dist.launcher.tf_logs`.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence

from keras_dist import cluster as cluster_lib
from keras_dist.launcher import process as process_lib
from keras_dist.launcher import tf_logs as tf_logs_lib
from keras_dist.launcher.elastic import describe_discover
from keras_dist.launcher.supervisor import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    DEFAULT_GRACE_PERIOD,
    EXIT_DISCOVERY_FAILED,
    EXIT_TOO_FEW_WORKERS,
    PROG,
    PS_SERVER_COMMAND,
    WORKERS_ENV_VAR,
    WORKERS_RANGE_ENV_VAR,
    launch,
    say,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `keras-dist` command line.

    Args:
        argv: Sequence of strings or `None`. The arguments without the program
            name; `None` reads `sys.argv[1:]`. Defaults to `None`.

    Returns:
        The exit status. `0` on success, `2` for a usage error, `130` when
        interrupted, otherwise the status of what failed (for `launch`, the
        exit code of the first task that failed; `69` when an elastic
        launch finds fewer worker slots than its minimum, `1` when
        `--discover` fails: see `keras_dist.launcher.launch`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` belongs to the user's command, whatever
    # it looks like, so it is split off before argparse sees it.
    if "--" in argv:
        split = argv.index("--")
        argv, trailing = argv[:split], argv[split + 1 :]
    else:
        trailing = None
    argv = _attach_option_values(argv)
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
            _check_elastic(args)
            return launch(
                command,
                workers=args.workers,
                ps=args.ps,
                chief=args.chief,
                host=args.host,
                grace_period=args.grace_period,
                max_restarts=args.max_restarts,
                collective_timeout=args.collective_timeout,
                collectives=args.collectives,
                tf_logs=args.tf_logs,
                discover=args.discover,
                log_dir=args.log_dir,
                only_chief=args.only_chief,
            )
        if trailing is not None:
            args.subparser.error(
                f"`{args.command}` takes no command after `--`. "
                f"Received: -- {' '.join(trailing)}"
            )
        if args.command == "env":
            return _run_env(tf_logs=args.tf_logs)
        return _run_ps_server()
    except _UsageExit as usage_exit:
        return usage_exit.status
    except KeyboardInterrupt:
        return process_lib.EXIT_INTERRUPTED


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


def _check_elastic(args: argparse.Namespace) -> None:
    """Refuses `--workers MIN:MAX` or `--discover` with `--ps` or `--chief`."""
    elastic = isinstance(args.workers, tuple)
    if not (elastic or args.discover is not None) or not (args.ps or args.chief):
        return
    given = [f"--workers {':'.join(map(str, args.workers))}"] if elastic else []
    if args.discover is not None:
        given.append(describe_discover(args.discover))
    given += [f"--ps {args.ps}"] * bool(args.ps) + ["--chief"] * args.chief
    args.subparser.error(
        "an elastic launch (--workers MIN:MAX or --discover) runs worker tasks "
        "only: a chief or parameter servers cannot be resized. Received: "
        f"{' '.join(given)}. Drop --ps and --chief (worker:0 is then the "
        "chief), or give --workers N without --discover."
    )


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
            f"{PROG} launch --workers N|MIN:MAX [--discover COMMAND] [--ps M] "
            "[--chief] [--host HOST] [--grace-period SECONDS] [--max-restarts N] "
            "[--log-dir DIR] [--only-chief] "
            "[--collective-timeout SECONDS] [--collectives {auto,tensorflow,gloo}] "
            "[--tf-logs] -- COMMAND [ARG ...]"
        ),
    )
    launch_parser.add_argument(
        "--workers",
        type=_workers,
        required=True,
        metavar="N|MIN:MAX",
        help=(
            "number of worker tasks (>= 1), or MIN:MAX (1 <= MIN <= MAX) for "
            "an elastic launch: each attempt starts min(MAX, available slots) "
            "workers (see --discover), and stops with status "
            f"{EXIT_TOO_FEW_WORKERS} below MIN; tasks find the number in "
            f"{WORKERS_ENV_VAR} and the range in {WORKERS_RANGE_ENV_VAR}"
        ),
    )
    launch_parser.add_argument(
        "--discover",
        type=_discover,
        metavar="COMMAND",
        default=None,
        help=(
            "shell command (run with sh -c before the first attempt and "
            "before every restart, 30 s at most) that prints the number of "
            "worker slots available now, one integer; a failure stops the "
            f"launch with status {EXIT_DISCOVERY_FAILED} (default: MAX slots "
            "are always available). Workers only: not with --ps or --chief"
        ),
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
        default=None,
        metavar="N",
        help=(
            "start the whole job again when a task fails, up to N times; "
            "tasks find the attempt number in KERAS_DIST_RESTART; with --ps "
            "and --chief: restart a failed worker in place, up to N times in "
            "all (default: 0; 3 with --workers MIN:MAX, which resizes only "
            "when it restarts)"
        ),
    )
    launch_parser.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help=(
            "keep every task's whole output in DIR/attempt-N/TASK.log "
            "(default: a new folder in the temporary directory, named in the "
            "report of a failure)"
        ),
    )
    launch_parser.add_argument(
        "--only-chief",
        action="store_true",
        help=(
            "show only the chief's output (worker:0 without --chief); the "
            "others' lines go to their log files, their errors are shown"
        ),
    )
    launch_parser.add_argument(
        "--collective-timeout",
        type=_collective_timeout,
        default=None,
        metavar="SECONDS",
        help=(
            "seconds a collective may wait for a peer before it fails, given "
            "to the tasks as KERAS_DIST_COLLECTIVE_TIMEOUT (default: the "
            f"variable if set, else {DEFAULT_COLLECTIVE_TIMEOUT:g})"
        ),
    )
    launch_parser.add_argument(
        "--collectives",
        choices=cluster_lib.COLLECTIVE_BACKENDS,
        default=None,
        help=(
            "what carries the sums between CPU worker tasks: tensorflow (its "
            "collectives), gloo (PyTorch's gloo: faster on a fast network, "
            "see the cluster guide; needs PyTorch in every task) or auto "
            "(gloo where PyTorch is installed and each task has one CPU "
            "device, else tensorflow), given to the tasks as "
            f"{cluster_lib.COLLECTIVES_ENV_VAR} (default: the variable if set, "
            "else auto)"
        ),
    )
    _add_tf_logs_argument(launch_parser, "the tasks' output")
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
    _add_tf_logs_argument(env_parser, "this command's output")
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


def _add_tf_logs_argument(parser: argparse.ArgumentParser, where: str) -> None:
    parser.add_argument(
        "--tf-logs",
        action="store_true",
        help=(
            f"show TensorFlow's native log lines in {where} (oneDNN, CUDA, "
            "coordination service, ...), hidden by default; the same as "
            f"{tf_logs_lib.TF_LOGS_ENV_VAR}=1. When {tf_logs_lib.LOG_LEVEL_ENV_VAR} "
            "is set, TensorFlow's own rules apply and nothing is hidden"
        ),
    )


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


# Options whose value may start with "-" (`--workers -1:2` is a bad count,
# which `_workers` explains; argparse would take "-1:2" for an option and
# say only "expected one argument").
_VALUE_OPTIONS = ("--workers",)


def _attach_option_values(argv: list[str]) -> list[str]:
    """`--workers -1:2` as `--workers=-1:2`, so argparse hands the value on."""
    attached = []
    index = 0
    while index < len(argv):
        word = argv[index]
        following = argv[index + 1] if index + 1 < len(argv) else None
        if word in _VALUE_OPTIONS and following and following.startswith("-"):
            attached.append(f"{word}={following}")
            index += 2
            continue
        attached.append(word)
        index += 1
    return attached


def _workers(text: str) -> int | tuple[int, int]:
    """`--workers`: `N` (an int), or `MIN:MAX` (a pair) for an elastic launch."""
    parts = text.split(":")
    try:
        if len(parts) > 2:
            raise ValueError(text)
        counts = [int(part) for part in parts]
    except ValueError:
        counts = [0]
    if len(counts) == 1 and counts[0] >= 1:
        return counts[0]
    if len(counts) == 2 and 1 <= counts[0] <= counts[1]:
        return counts[0], counts[1]
    raise argparse.ArgumentTypeError(
        "must be an integer >= 1 (N workers) or MIN:MAX, two integers with "
        f"1 <= MIN <= MAX (MIN to MAX workers, elastic). Received: {text!r}. "
        "E.g. --workers 4 or --workers 2:4."
    )


def _discover(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "must be a shell command that prints the number of worker slots "
            f"available, e.g. --discover 'cat slots'. Received: {text!r}."
        )
    return text


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


def _collective_timeout(text: str) -> float:
    """`--collective-timeout`: the launcher's own check, as a usage error."""
    try:
        return cluster_lib.check_collective_timeout(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds > 0. Received: {text!r}. Omit "
            "it for the default."
        ) from None


def _version_text() -> str:
    from keras_dist._versions import VERSION as __version__

    return f"{PROG} {__version__}"


def _run_ps_server() -> int:
    """Runs this process's parameter-server task from `TF_CONFIG` until killed."""
    try:
        config = cluster_lib.parse_tf_config()
    except ValueError as error:
        say(sys.stderr, str(error))
        return 2
    task = (config or {}).get("task") or {}
    if task.get("type") != "ps":
        say(
            sys.stderr,
            f"`{PS_SERVER_COMMAND}` runs a parameter-server task and needs "
            "TF_CONFIG with task type 'ps'. Received: "
            f"TF_CONFIG={os.environ.get('TF_CONFIG', '')!r}. It is started by "
            f"`{PROG} launch --ps M`.",
        )
        return 2
    from keras_dist.parameter_server import serving

    serving.serve(config["cluster"], "ps", task.get("index", 0), announce=_listening)
    return 0


def _listening(name: str, address: str) -> None:
    print(
        f"parameter server {name} listening on {address} (pid {os.getpid()})",
        flush=True,
    )


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


def _collectives_lines() -> list[str]:
    """What carries a multi-worker strategy's sums here, and a tip."""
    from keras_dist._versions import installed_version
    from keras_dist.core import gloo

    torch = installed_version("torch")
    try:
        backend = gloo.requested_backend()
    except ValueError as error:
        return [f"Collectives:   cannot decide: {error}"]
    install = f"`{gloo.INSTALL}`"
    if backend == "tensorflow":
        return [
            "Collectives:   TensorFlow's (ring on CPU workers, NCCL on GPUs; "
            f"{gloo.ENV_VAR}=tensorflow)"
        ]
    missing = gloo.gloo_missing()
    if backend == "gloo":
        if missing:
            return [
                f"Collectives:   gloo ({gloo.ENV_VAR}=gloo), but {missing}: {install}"
            ]
        return [f"Collectives:   gloo ({gloo.ENV_VAR}=gloo; PyTorch {torch})"]
    if missing:
        return [
            f"Collectives:   TensorFlow's (auto: {missing}; ring on CPU "
            "workers, NCCL on GPUs)",
            f"  tip:         with PyTorch's CPU wheel ({install}) CPU workers "
            "sum through gloo: a 21M-parameter MLP's step 1.05x PyTorch "
            "DDP's, against 1.74x with TensorFlow's collectives (2 workers, "
            "docs/benchmarks/ddp.md)",
        ]
    return [
        f"Collectives:   gloo for workers with one CPU device (auto: PyTorch "
        f"{torch} with gloo is installed), TensorFlow's otherwise (NCCL on "
        f"GPUs); {gloo.ENV_VAR}=tensorflow to keep TensorFlow's"
    ]


def _run_env(tf_logs: bool = False) -> int:
    # What needs no TensorFlow is printed first: importing TensorFlow is
    # nearly all of this command's time (`import tensorflow` also imports
    # Keras 3, and Keras whatever optional integrations are installed:
    # scikit-learn, SciPy, JAX, pandas), and nothing else here is slow.
    start = time.perf_counter()
    from keras_dist._backend import configured_backend
    from keras_dist._versions import VERSION as __version__
    from keras_dist._versions import installed_version

    print(f"keras_dist:    {__version__}")
    print(
        f"Python:        {platform.python_version()} "
        f"({platform.python_implementation()}, {platform.platform()})"
    )
    print(f"TensorFlow:    {installed_version('tensorflow') or 'not installed'}")
    print(
        f"Keras:         {installed_version('keras') or 'not installed'} "
        f"(backend: {configured_backend()})"
    )
    tf_config = os.environ.get("TF_CONFIG", "").strip()
    print(f"TF_CONFIG:     {tf_config or 'not set'}")
    engine = cluster_lib.detect_engine()
    print(f"Engine:        {engine.name} ({engine.detail})", flush=True)

    quiet = tf_logs_lib.prepare_environment(os.environ, tf_logs)
    import_start = time.perf_counter()
    with tf_logs_lib.quiet_import(quiet):
        import tensorflow as tf

        from keras_dist import memory as memory_lib
        from keras_dist import strategy as strategy_lib
    import_seconds = time.perf_counter() - import_start

    for kind in ("CPU", "GPU"):
        devices = tf.config.list_physical_devices(kind)
        names = ", ".join(device.name for device in devices) or "none"
        print(f"{kind} devices:   {len(devices)} ({names})")
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
    for line in _collectives_lines():
        print(line)
    growth = memory_lib.memory_growth_state()
    if growth:
        states = ", ".join(
            f"{name}: {'on' if enabled else 'off'}" for name, enabled in growth.items()
        )
    else:
        states = "n/a (no GPU visible)"
    print(f"Memory growth: {states}")
    print(
        f"Took:          {time.perf_counter() - start:.1f} s ({import_seconds:.1f} s "
        "of it importing TensorFlow, which imports Keras)"
    )
    return status
