"""Elastic sizing for the launcher: `--workers MIN:MAX` and `--discover`.

An elastic launch runs between MIN and MAX workers, as many as there are
slots for (the way `horovodrun --min-np/--max-np --host-discovery-script`
and torchrun's `--nnodes MIN:MAX` do). Before the first attempt and before
every restart, the launcher asks a discovery command how many worker slots
are available now (`discover_slots`), and starts `min(MAX, available)`
workers; below MIN it stops instead (`EXIT_TOO_FEW_WORKERS`). Without a
discovery command, MAX slots are always available.

Horovod's discovery script prints `host:slots` lines; this launcher starts
every task on one machine, so the discovery command prints one integer.

Resuming the training on the new number of workers is
`keras_dist.callbacks.BackupAndRestore`'s part (elastic resume); the
launcher only picks the size and tells the tasks (`KERAS_DIST_WORKERS`,
`KERAS_DIST_WORKERS_RANGE`).

Like the rest of the launcher, this module imports neither TensorFlow nor
Keras.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping

from keras_dist._validation import check_int
from keras_dist.launcher import process as process_lib

# The number of `worker` tasks of this attempt, in every task's environment.
WORKERS_ENV_VAR = "KERAS_DIST_WORKERS"
# `MIN:MAX` of an elastic launch (`workers=(MIN, MAX)`), in every task's
# environment; absent otherwise.
WORKERS_RANGE_ENV_VAR = "KERAS_DIST_WORKERS_RANGE"
# Seconds the discovery command may take before it is stopped.
DISCOVER_TIMEOUT = 30.0
# Fewer worker slots available than the minimum (BSD sysexits
# EX_UNAVAILABLE: "a service is unavailable").
EXIT_TOO_FEW_WORKERS = 69
# The discovery command failed, timed out or printed no count.
EXIT_DISCOVERY_FAILED = 1
# How much of a failing discovery command's stderr goes into the message.
_STDERR_TAIL = 500


class DiscoveryError(Exception):
    """The discovery command failed, timed out or printed no slot count."""


@dataclasses.dataclass(frozen=True)
class WorkerRange:
    """How many workers a launch may run: `minimum` to `maximum`.

    Attributes:
        minimum: Int >= 1. Fewer slots than this stop the launch.
        maximum: Int >= `minimum`. Never more workers than this.
        elastic: Bool. Whether it was given as a range (`(MIN, MAX)`, or
            `MIN:MAX` on the command line), not as one count.
    """

    minimum: int
    maximum: int
    elastic: bool

    def __str__(self) -> str:
        """`"2:4"` for a range, `"4"` for one count: as `--workers` takes it."""
        if self.elastic:
            return f"{self.minimum}:{self.maximum}"
        return str(self.maximum)


def check_workers(workers) -> WorkerRange:
    """Returns `launch`'s `workers` argument as a `WorkerRange`.

    Args:
        workers: An int >= 1 (that many workers), or a `(min, max)` tuple
            (or list) of ints with `1 <= min <= max` (elastic).

    Returns:
        A `WorkerRange`.

    Raises:
        TypeError: `workers` is neither an int nor a pair of ints.
        ValueError: a count is below 1, or `min > max`.
    """
    if not isinstance(workers, (tuple, list)):
        count = check_int(
            "workers",
            workers,
            minimum=1,
            hint="Or give a `(min, max)` tuple for an elastic launch.",
        )
        return WorkerRange(count, count, elastic=False)
    hint = "Give an int, or `(min, max)` with 1 <= min <= max, e.g. `(2, 4)`."
    received = f"Received: workers={workers!r}."
    if len(workers) != 2:
        raise ValueError(
            f"`workers` as a range must be a `(min, max)` pair. {received} {hint}"
        )
    minimum, maximum = (
        check_int(f"workers[{index}]", value, minimum=1, hint=hint)
        for index, value in enumerate(workers)
    )
    if minimum > maximum:
        raise ValueError(
            "`workers` as a range must have min <= max. "
            f"{received} {hint.replace(', e.g.', ': swap them, e.g.')}"
        )
    return WorkerRange(minimum, maximum, elastic=True)


def check_discover(discover) -> str | None:
    """Returns `launch`'s `discover` argument: a non-empty string or `None`.

    Raises:
        TypeError: `discover` is not a string.
        ValueError: `discover` is empty.
    """
    if discover is None:
        return None
    hint = (
        "It is a shell command that prints the number of worker slots "
        "available, e.g. `'cat /etc/slots'`."
    )
    if not isinstance(discover, str):
        raise TypeError(
            "`discover` must be a string or None. Received: "
            f"discover={discover!r} (type {type(discover).__name__}). {hint}"
        )
    if not discover.strip():
        raise ValueError(
            f"`discover` must not be empty. Received: {discover!r}. {hint}"
        )
    return discover


def describe_discover(command: str) -> str:
    """`--discover 'cat slots'`: the command as a shell would take it back."""
    return f"--discover {shlex.quote(command)}"


def discover_slots(
    command: str,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> int:
    """Runs the discovery command and returns the worker slots it reports.

    The command runs with `sh -c`, in a process group of its own (so that
    whatever it starts is stopped with it on a timeout), with stdin closed.
    It must exit with status 0 and print one integer >= 0 on stdout
    (surrounding white space is ignored); its stderr is shown only when it
    fails.

    Args:
        command: String. The shell command.
        env: Mapping or `None`. Its environment; `None` uses `os.environ`.
            Defaults to `None`.
        timeout: Float or `None`. Seconds it may take; `None` uses
            `DISCOVER_TIMEOUT` (30 s). Defaults to `None`.

    Returns:
        The number of worker slots, an int >= 0.

    Raises:
        DiscoveryError: the command cannot start, fails, takes longer than
            `timeout`, or prints anything but one integer >= 0. The message
            names the command and what it printed.
    """
    timeout = DISCOVER_TIMEOUT if timeout is None else timeout
    name = describe_discover(command)
    # Files, not pipes: a background child the command leaves behind keeps
    # a pipe open, and reading to its end would wait for that child.
    with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
        try:
            process = subprocess.Popen(
                ["sh", "-c", command],
                stdin=subprocess.DEVNULL,
                stdout=out_file,
                stderr=err_file,
                env=dict(os.environ if env is None else env),
                start_new_session=os.name == "posix",
            )
        except OSError as error:
            raise DiscoveryError(f"{name} could not be started: {error}.") from None
        try:
            _wait_unreaped(process, timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            process.wait()
            raise DiscoveryError(
                f"{name} did not finish within {timeout:g} s and was stopped "
                f"(it printed {_shown(_read(out_file).strip())}). It must print the "
                "number of worker slots available and exit."
            ) from None
        except BaseException:
            # Ctrl-C or SIGTERM while it runs: it must not outlive the launcher.
            _kill_group(process)
            process.wait()
            raise
        # What it left running in its group must not outlive it either
        # (killed before the command is reaped: its group id is still its).
        _kill_group(process)
        process.wait()
        out, err = _read(out_file), _read(err_file)
    if process.returncode != 0:
        raise DiscoveryError(
            f"{name} failed with {process_lib.describe_exit(process.returncode)} "
            f"(stdout {_shown(out.strip())}, stderr "
            f"{_shown(err.strip()[-_STDERR_TAIL:])}). It must exit with status 0 "
            "after printing the number of worker slots available."
        )
    text = out.strip()
    if not re.fullmatch(r"[0-9]+", text):
        raise DiscoveryError(
            f"{name} must print one integer >= 0, the number of worker slots "
            f"available (e.g. `echo 4`). It printed: {_shown(out)}."
        )
    return int(text)


# The most of a discovery command's output a message quotes.
_SHOWN_CHARACTERS = 200


def _read(handle) -> str:
    handle.seek(0)
    return handle.read().decode(errors="replace")


def _shown(text: str) -> str:
    """`text` quoted, cut to `_SHOWN_CHARACTERS` (saying how long it was)."""
    if len(text) <= _SHOWN_CHARACTERS:
        return repr(text)
    return f"{text[:_SHOWN_CHARACTERS]!r}... ({len(text)} characters in all)"


def _wait_unreaped(process: subprocess.Popen, timeout: float) -> None:
    """Waits for `process` to exit without reaping it (POSIX), so that its
    process id, which names its group, is not given to another process.

    Raises:
        subprocess.TimeoutExpired: it still runs after `timeout` seconds.
    """
    if os.name != "posix":
        process.wait(timeout=timeout)
        return
    deadline = time.monotonic() + timeout
    flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
    while os.waitid(os.P_PID, process.pid, flags) is None:
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(process.args, timeout)
        time.sleep(0.02)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        if os.name == "posix":
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
    except (ProcessLookupError, PermissionError):
        pass
