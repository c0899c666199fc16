"""The launcher's failure report: which task, how it ended, why, what next.

When a task of a job fails, the launcher says it in one block (as
torchrun's elastic agent reports a root cause), before it stops the other
tasks, while their state still tells what happened:

- **lost**: a task's process is gone (killed by a signal) or stopped
  (SIGSTOP, a frozen node): it no longer answers;
- **hung**: a worker waited longer than the collective timeout in a
  collective while its peers still run (keras_dist's watchdog aborted it):
  a peer is alive but stopped taking part;
- **failed**: a task's script raised: its exception, in one line.

The other tasks' errors (a survivor's collective aborted for a lost peer)
are one line each; every task's whole output is in its log file, whose
path the block gives.

Like the rest of the launcher, this module imports neither TensorFlow nor
Keras.
"""

from __future__ import annotations

import dataclasses
import re
import signal

# Lines of the culprit's output the block quotes.
QUOTED_LINES = 4
# The most of another task's error the block quotes.
QUOTED_CHARACTERS = 200

# keras_dist's own messages of a lost or hung peer (`core/watchdog.py`,
# `trainer/fit.py`) and TensorFlow's coordination service's.
_WATCHDOG = "longer than the collective timeout"
_LOST = re.compile(r"lost ((?:chief|worker|ps):\d+)")
_UNHEALTHY = "stopped sending heartbeats"


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """Why a job stopped.

    Attributes:
        kind: String: `"lost"`, `"hung"` or `"failed"`.
        culprit: String. The task at the root of it.
        cause: String. One line: how it ended, or its exception.
    """

    kind: str
    culprit: str
    cause: str


def process_state(pid: int) -> str | None:
    """The process's state letter from `/proc` (`"T"`: stopped), or `None`."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def describe_code(code: int) -> str:
    """`"killed by SIGKILL"`, or `"exit code 1"`."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def diagnose(failed, tasks, code: int, records: dict) -> Diagnosis:
    """Says why `failed` (a `Task` that exited with `code`) stopped the job.

    Args:
        failed: The task that exited first with a failure.
        tasks: Every task of the job (the others may still run).
        code: Its return code (negative: the signal that killed it).
        records: `TaskOutput.records`, by task name.
    """
    running = [t for t in tasks if t is not failed and t.process.poll() is None]
    stopped = [t for t in running if process_state(t.process.pid) in ("T", "t")]
    if stopped:
        names = ", ".join(t.name for t in stopped)
        return Diagnosis("lost", stopped[0].name, f"{names} is stopped (SIGSTOP)")
    if code < 0:
        return Diagnosis(
            "lost", failed.name, f"{failed.name} was {describe_code(code)}"
        )
    record = records.get(failed.name)
    exception = record.exception if record is not None else None
    if exception and _WATCHDOG in exception:
        others = [t.name for t in running]
        culprit = others[0] if len(others) == 1 else ", ".join(others) or "a peer"
        return Diagnosis(
            "hung",
            culprit,
            f"{failed.name} waited for a peer longer than the collective "
            f"timeout; still running: {culprit}",
        )
    if exception:
        named = _LOST.search(exception)
        if named or _UNHEALTHY in exception:
            culprit = named.group(1) if named else "a peer"
            return Diagnosis("lost", culprit, f"{failed.name} lost {culprit}")
        return Diagnosis("failed", failed.name, exception)
    return Diagnosis("failed", failed.name, f"failed with {describe_code(code)}")


def failure_block(failed, tasks, code: int, records: dict, since: float | None) -> list:
    """The report's lines (without the launcher's `keras-dist: ` prefix):
    the culprit, how it ended and why; its last lines (lost or hung); the
    task that failed with it. What happens next is the launcher's line.

    Args:
        failed: The task that exited first with a failure.
        tasks: Every task of the job.
        code: `failed`'s return code.
        records: `TaskOutput.records`, by task name.
        since: Float or `None`. Seconds since the attempt started.
    """
    diagnosis = diagnose(failed, tasks, code, records)
    when = f" after {since:.0f} s" if since is not None else ""
    record = records.get(failed.name)
    early = [t.name for t in tasks if t is not failed and t.process.poll() == 0]
    note = (
        [
            f"  {', '.join(early)} had already exited with status 0: a task that "
            "leaves early can make its peers' collectives fail."
        ]
        if early
        else []
    )
    if diagnosis.kind == "failed":
        log = record.log_path if record is not None else None
        if record is not None and record.exception:
            where = f" (traceback: {log})" if log else ""
            return [f"{failed.name} failed{when}: {diagnosis.cause}{where}.", *note]
        last = [line for line in record.last_lines if line.strip()] if record else []
        said = f"; its last line: {last[-1]}" if last else ""
        where = f" (its output: {log})" if log else ""
        return [f"{failed.name} {diagnosis.cause}{when}{said}{where}.", *note]
    lines = [f"{diagnosis.culprit} {diagnosis.kind}{when}: {diagnosis.cause}."]
    culprit = records.get(diagnosis.culprit)
    if culprit is not None:
        quoted = [line for line in culprit.last_lines if line.strip()]
        where = f" (all of them: {culprit.log_path})" if culprit.log_path else ""
        if quoted:
            lines.append(f"  its last lines{where}:")
            lines += [f"    {line}" for line in quoted[-QUOTED_LINES:]]
    if failed.name != diagnosis.culprit and record is not None:
        why = record.exception or describe_code(code)
        if len(why) > QUOTED_CHARACTERS:
            why = why[:QUOTED_CHARACTERS] + " ..."
        lines.append(f"  {failed.name} stopped with it: {why}")
    return lines + note
