"""Start, watch and stop groups of task processes.

One implementation for the two places that run a local cluster: the
`keras-dist launch` command (`keras_dist.launcher.supervisor`) and
`keras_dist.testing.run_workers`.
Every task runs in its own process group (POSIX), so stopping a task stops
whatever it started too; stopping is SIGTERM, then SIGKILL after a grace
period. Popen reports death by signal N as -N; the exit statuses here follow
the shells' `128 + N`.

This module imports neither TensorFlow nor NumPy: the launcher starts its
tasks without paying for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from keras_dist.launcher import output as output_lib

# The folder that holds the `keras_dist` package (this file is
# keras_dist/launcher/process.py): put first on a child's PYTHONPATH, this very
# copy is importable there, installed or not.
PACKAGE_PARENT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)

EXIT_INTERRUPTED = 130
# A task that wrote a backup after SIGTERM (preemption) and asks to be
# restarted (BSD sysexits EX_TEMPFAIL: "try again later").
EXIT_PREEMPTED = 75
# This process (the launcher) received SIGTERM.
EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_CANNOT_START = 127
# Too few file descriptors (or processes) to start every task.
EXIT_NO_RESOURCES = 1
POLL_INTERVAL = 0.05
# Seconds a parameter-server coordinator gets to report a lost ps task
# (its `fit` raises) before the launcher stops it.
COORDINATOR_REPORT_SECONDS = 60.0
# Seconds to wait for a finished task's last output lines before moving on.
READER_JOIN_TIMEOUT = 2.0
SIGKILL = getattr(signal, "SIGKILL", signal.SIGTERM)
_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM)


class Terminated(Exception):
    """The supervising process itself received SIGTERM."""


@dataclasses.dataclass
class TaskSpec:
    """What to start for one task.

    Attributes:
        name: String. The task's name, e.g. `"worker:1"`; output lines are
            prefixed with `[name] `.
        command: List of strings. The program and its arguments.
        env: Dict. The task's whole environment.
        serves: Bool. The task serves the others (a parameter server) and
            runs until they are done; its exit before then is a failure.
    """

    name: str
    command: list[str]
    env: dict[str, str]
    serves: bool = False


@dataclasses.dataclass
class Task:
    """A started task: its spec, its process and the thread reading its output."""

    spec: TaskSpec
    process: subprocess.Popen
    reader: threading.Thread | None = None

    @property
    def name(self) -> str:
        return self.spec.name


def env_with_package(env: Mapping[str, str]) -> dict[str, str]:
    """Returns a copy of `env` whose PYTHONPATH starts with this keras_dist."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [PACKAGE_PARENT, env.get("PYTHONPATH")])
    )
    return env


def start(
    command: Sequence[str], env: Mapping[str, str], stdout=subprocess.PIPE
) -> subprocess.Popen:
    """Starts `command` in a process group of its own, stderr merged into stdout.

    Own process group: stopping the task stops everything it started, and a
    terminal's Ctrl-C reaches only the supervisor, which then stops the tasks
    in order.

    Raises:
        OSError: the program cannot be started (its message says why).
    """
    return subprocess.Popen(
        list(command),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        env=dict(env),
        start_new_session=os.name == "posix",
    )


def is_out_of_resources(error: OSError) -> bool:
    """Whether `error` means too few file descriptors or processes."""
    return error.errno in _RESOURCE_ERRNOS


def describe_start_error(command: Sequence[str], error: OSError, count: int) -> str:
    """The message for a task that could not be started."""
    if is_out_of_resources(error):
        return (
            f"cannot start {count} tasks: the system refused another process "
            f"or file descriptor ({error.strerror}). Each task needs a few "
            "file descriptors; raise the limit (e.g. `ulimit -n 4096`) or "
            "start fewer tasks."
        )
    return f"cannot start {' '.join(command)!r}: {error}."


def wait_any(
    processes: Sequence[subprocess.Popen], timeout: float | None = None
) -> subprocess.Popen | None:
    """Waits until one of `processes` has exited; returns it.

    When several have exited, returns the first in `processes` order.

    Args:
        processes: Sequence of Popen. The processes to watch; non-empty.
        timeout: Float or `None`. Seconds to wait at most; `None` waits as
            long as it takes.

    Returns:
        An exited process, or `None` when `timeout` passed first.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        for process in processes:
            if process.poll() is not None:
                return process
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(POLL_INTERVAL)


def exit_status(code: int) -> int:
    """Popen's return code as a shell reports it (`128 + N` for signal N)."""
    return 128 - code if code < 0 else code


def describe_exit(code: int) -> str:
    """`"exit code 3"`, or `"exit code 137 (killed by SIGKILL)"`."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"exit code {exit_status(code)} (killed by {name})"
    return f"exit code {code}"


def send_signal(process: subprocess.Popen, signum: int) -> None:
    """Sends `signum` to `process`'s whole process group (POSIX)."""
    # Only called while `process` is unreaped, so its pid (= its process
    # group id) cannot have been reused.
    try:
        if os.name == "posix":
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
    except ProcessLookupError:
        pass


def stop(processes: Sequence[subprocess.Popen], grace_period: float) -> None:
    """Stops the running `processes`: SIGTERM, then SIGKILL after `grace_period`.

    Returns once every one of them has exited. A Ctrl-C while waiting kills
    the rest at once and is re-raised.
    """
    running = [process for process in processes if process.poll() is None]
    try:
        for process in running:
            send_signal(process, signal.SIGTERM)
        deadline = time.monotonic() + grace_period
        for process in running:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                send_signal(process, SIGKILL)
                process.wait()
    except KeyboardInterrupt:
        # A second Ctrl-C while stopping: do not wait any longer.
        kill(running)
        raise


def kill(processes: Sequence[subprocess.Popen]) -> None:
    """SIGKILLs the running `processes` (and their groups) and reaps them."""
    for process in processes:
        if process.poll() is None:
            send_signal(process, SIGKILL)
            process.wait()


def run_tasks(
    specs: Sequence[TaskSpec],
    out: IO[str] | output_lib.TaskOutput,
    say: Callable[[str], None],
    grace_period: float,
    coordinator: str | None = None,
    failure: list | None = None,
    replaceable: Sequence[str] = (),
    restarts: int = 0,
    keep_line: Callable[[str], bool] | None = None,
    report: Callable | None = None,
) -> int:
    """Starts every task, streams its prefixed output, and supervises them.

    Tasks start in `specs` order. The job is done when every task that does
    not serve has exited with status 0, or as soon as the `coordinator` task
    has. The first task that fails, or a serving task that exits while
    others still run, stops all the others (`stop` with `grace_period`).
    SIGTERM to this process (main thread only) and Ctrl-C stop them too.

    Args:
        specs: Sequence of `TaskSpec`. The tasks.
        out: Text stream (where the prefixed task output goes), or a
            `keras_dist.launcher.output.TaskOutput` (which also keeps log
            files and records).
        say: Callable. Reports a line about the tasks (to the user).
        grace_period: Float. Seconds between SIGTERM and SIGKILL.
        coordinator: String or `None`. Name of the task whose success ends
            the job. Defaults to `None`.
        failure: List or `None`. When given, the `(name, returncode)` of the
            task that failed is appended to it. Defaults to `None`.
        replaceable: Names of tasks the job survives losing (the workers of a
            parameter-server job, whose steps the coordinator retries on the
            others): such a task that fails is started again in place while
            `restarts` last, else the job goes on without it, until none of
            them is left. Defaults to none.
        restarts: Int. How many in-place restarts of `replaceable` tasks the
            job may use in all. Defaults to `0`.
        keep_line: Callable or `None`. Which output lines to write (see
            `TaskOutput`) when `out` is a stream; `None` writes every line.
            Defaults to `None`.
        report: Callable or `None`. Called as `report(failed, tasks, code)`
            when a task fails and the job stops, before the others are
            stopped (their state still tells why): it says what happened,
            instead of the one line "task ... failed". Defaults to `None`.

    Returns:
        `0` on success; else the exit status of the first task that failed,
        `127` when a command could not be started, `1` when the system had
        no resources for another task, `130` after Ctrl-C, `143` after
        SIGTERM.
    """
    output = (
        out
        if isinstance(out, output_lib.TaskOutput)
        else output_lib.TaskOutput(out, keep=keep_line)
    )
    tasks: list[Task] = []
    previous_sigterm = _install_sigterm_handler()
    try:
        for spec in specs:
            try:
                process = start(spec.command, spec.env)
            except OSError as error:
                say(describe_start_error(spec.command, error, len(specs)))
                if is_out_of_resources(error):
                    return EXIT_NO_RESOURCES
                return EXIT_CANNOT_START
            task = Task(spec, process)
            tasks.append(task)
            task.reader = output.follow(task)

        def restart(task: Task) -> Task:
            new = Task(task.spec, start(task.spec.command, task.spec.env))
            new.reader = output.follow(new)
            tasks.append(new)
            return new

        return _supervise(
            tasks,
            say,
            coordinator,
            failure,
            replaceable=set(replaceable),
            restarts=restarts,
            restart=restart,
            report=report,
        )
    except KeyboardInterrupt:
        say("interrupted; stopping all tasks.")
        return EXIT_INTERRUPTED
    except Terminated:
        say("received SIGTERM; stopping all tasks.")
        return EXIT_TERMINATED
    finally:
        # Stopping is bounded by `grace_period`; a SIGTERM now must not cut
        # it short and leave tasks behind.
        _ignore_sigterm_if_installed(previous_sigterm)
        stop([task.process for task in tasks], grace_period)
        for task in tasks:
            task.reader.join(timeout=READER_JOIN_TIMEOUT)
        _restore_sigterm_handler(previous_sigterm)


def _supervise(
    tasks: list[Task],
    say,
    coordinator: str | None,
    failure=None,
    replaceable=frozenset(),
    restarts=0,
    restart=None,
    report=None,
) -> int:
    """Waits for the tasks that do not serve; returns the exit status."""
    pending = [task for task in tasks if not task.spec.serves]
    servers = [task for task in tasks if task.spec.serves]
    finished_early = []
    while pending:
        watched = pending + servers
        exited = wait_any([task.process for task in watched])
        task = next(task for task in watched if task.process is exited)
        code = exited.returncode
        # Let its last lines out before any message about it.
        task.reader.join(timeout=READER_JOIN_TIMEOUT)
        if code != 0 and failure is not None:
            failure.append((task.name, code))
        if task.spec.serves:
            lead = next((t for t in pending if t.name == coordinator), None)
            if lead is not None:
                # The coordinator's `fit` fails with the error that names
                # the lost ps task; let it say so before stopping it.
                say(
                    f"parameter server {task.name} stopped with "
                    f"{describe_exit(code)}; waiting up to "
                    f"{COORDINATOR_REPORT_SECONDS:g} s for {lead.name} (the "
                    "coordinator) to report it, then stopping the other tasks."
                )
                if wait_any([lead.process], COORDINATOR_REPORT_SECONDS):
                    lead.reader.join(timeout=READER_JOIN_TIMEOUT)
                return exit_status(code) or 1
            say(
                f"parameter server {task.name} stopped with "
                f"{describe_exit(code)} while training tasks were still "
                "running; stopping the other tasks."
            )
            return exit_status(code) or 1
        pending.remove(task)
        if code != 0 and task.name in replaceable:
            if restarts > 0 and restart is not None:
                restarts -= 1
                pending.append(restart(task))
                say(
                    f"task {task.name} failed with {describe_exit(code)}; "
                    "started it again in place (the coordinator retries its "
                    f"steps); {restarts} restart(s) left."
                )
                continue
            left = [other.name for other in pending if other.name in replaceable]
            if left:
                say(
                    f"task {task.name} failed with {describe_exit(code)}; the "
                    f"coordinator retries its steps on {', '.join(left)}."
                )
                continue
            say(
                f"task {task.name} failed with {describe_exit(code)} and no "
                "worker is left; stopping the other tasks."
            )
            return exit_status(code)
        if code != 0 and report is not None:
            report(task, tasks, code)
            return exit_status(code)
        if code != 0:
            note = ""
            if finished_early:
                names = ", ".join(finished_early)
                note = (
                    f" ({names} had already exited with status 0: a task that "
                    "leaves early can make its peers' collectives fail)"
                )
            say(
                f"task {task.name} failed with {describe_exit(code)}{note}; "
                "stopping the other tasks."
            )
            return exit_status(code)
        if task.name == coordinator:
            if pending:
                say(
                    f"{task.name} (the coordinator) finished; stopping the "
                    f"{len(pending)} worker task(s) still serving."
                )
            return 0
        finished_early.append(task.name)
    return 0


_NOT_INSTALLED = object()


@contextlib.contextmanager
def sigterm_raises():
    """Inside, SIGTERM to this process (main thread) raises `Terminated`, so
    that what it is waiting for can be stopped first."""
    previous = _install_sigterm_handler()
    try:
        yield
    finally:
        _restore_sigterm_handler(previous)


def _install_sigterm_handler():
    """Turns SIGTERM into `Terminated`; returns the handler it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return _NOT_INSTALLED

    def handler(signum, frame):
        raise Terminated()

    return signal.signal(signal.SIGTERM, handler)


def _ignore_sigterm_if_installed(previous) -> None:
    if previous is not _NOT_INSTALLED:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _restore_sigterm_handler(previous) -> None:
    if previous is not _NOT_INSTALLED:
        # `None` means a handler not installed from Python; the default is
        # the closest thing to put back.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
