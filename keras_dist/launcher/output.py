"""What the launcher shows of its tasks' output, and what it keeps.

Every task's output goes, whole, to a log file of its own, and line by
line, prefixed with the task's name (`[worker:1] ...`), to the launcher's
own output:

- a line redrawn with carriage returns and backspaces (a progress bar, as
  Keras's `verbose=1` draws it) is shown as it ends, once;
- a Python traceback is shown as one line: its exception, and the log file
  that holds the whole of it. A worker whose peer is lost ends with pages
  of TensorFlow's traceback; the operator needs the one line;
- `shown` (`--only-chief`) limits the lines shown to some tasks; the
  others' one-line tracebacks are shown all the same.

What the launcher's failure report needs of a task (its last lines, its
exception, its log file) is kept too (`TaskRecord`). When the reader of the
launcher's output goes away (`keras-dist launch ... | head`), nothing more
is shown, while every task's output is still read and logged: the tasks
never block on a full pipe.

Like the rest of the launcher, this module imports neither TensorFlow nor
Keras.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import select
import sys
import threading
import time
from collections.abc import Callable, Collection
from typing import IO

# Seconds of silence after a traceback's exception line that end it (a
# traceback that does not end its process: a library printed one).
TRACEBACK_IDLE_SECONDS = 2.0
# Lines of a task's output its record keeps (for the failure report).
LAST_LINES = 20
# The longest exception line shown (a message of pages is cut).
EXCEPTION_CHARACTERS = 400
_READ_BYTES = 65536
_TRACEBACK = "Traceback (most recent call last):"
# Lines between two chained tracebacks.
_CHAINED = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?::\s|:$|$)")


@dataclasses.dataclass
class TaskRecord:
    """What the launcher keeps of one task's output.

    Attributes:
        name: String. The task, e.g. `"worker:1"`.
        log_path: String or `None`. The file that holds all its output.
        last_lines: Deque of strings: its last lines, as shown.
        exception: String or `None`. The exception line of its last
            traceback.
        last_output: Float or `None`. When it last wrote (`time.monotonic`).
    """

    name: str
    log_path: str | None
    last_lines: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=LAST_LINES)
    )
    exception: str | None = None
    last_output: float | None = None


# Terminal escape sequences (colours, cursor moves) a progress bar writes.
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def render(line: str) -> str:
    """A line as a terminal shows it once it is written: backspaces erase
    the character before them, a carriage return starts over, and colour
    codes go."""
    line = _ESCAPES.sub("", line)
    if "\r" not in line and "\b" not in line:
        return line
    shown: list[str] = []
    for character in line.rstrip("\r"):
        if character == "\r":
            shown.clear()
        elif character == "\b":
            if shown:
                shown.pop()
        else:
            shown.append(character)
    return "".join(shown)


class TaskOutput:
    """Copies tasks' output to one text stream and to a log file per task.

    Args:
        stream: Text stream. Where the lines are shown.
        keep: Callable or `None`. Called with each line; a line it returns
            `False` for is not shown (the launcher's quiet mode drops
            TensorFlow's native log lines this way), but still logged.
            Defaults to `None` (show every line).
        log_dir: String or `None`. The folder of the tasks' log files;
            `None` keeps no files. Defaults to `None`.
        shown: Collection of task names, or `None`: only these tasks'
            lines are shown (their tracebacks' one-line summaries are shown
            for every task). Defaults to `None` (all).
    """

    def __init__(
        self,
        stream: IO[str],
        keep: Callable[[str], bool] | None = None,
        log_dir: str | None = None,
        shown: Collection[str] | None = None,
    ):
        self.stream = stream
        self.keep = keep
        self.log_dir = log_dir
        self.shown = None if shown is None else set(shown)
        self.broken = False
        self.records: dict[str, TaskRecord] = {}
        self._lock = threading.Lock()

    # --- Showing --------------------------------------------------------------

    def write_line(self, prefix: str, line: str) -> None:
        """Shows one line, prefixed (unless `keep` drops it)."""
        if self.keep is not None and not self.keep(line):
            return
        with self._lock:
            if self.broken:
                return
            try:
                self.stream.write(prefix + line + "\n")
                self.stream.flush()
            except BrokenPipeError:
                self.broken = True
                self._silence_stream()

    def follow(self, task) -> threading.Thread:
        """Starts (and returns) the daemon thread copying `task`'s output."""
        record = TaskRecord(task.name, self._log_path(task.name))
        self.records[task.name] = record
        thread = threading.Thread(
            target=self._pump,
            args=(task.process.stdout, record),
            name=f"keras-dist-{task.name}",
            daemon=True,
        )
        thread.start()
        return thread

    def _log_path(self, name: str) -> str | None:
        if self.log_dir is None:
            return None
        os.makedirs(self.log_dir, exist_ok=True)
        return os.path.join(self.log_dir, name.replace(":", "-") + ".log")

    def _pump(self, pipe, record: TaskRecord) -> None:
        reader = _TaskReader(self, record)
        log = open(record.log_path, "a") if record.log_path else None  # noqa: SIM115
        try:
            descriptor = pipe.fileno()
            pending = b""
            while True:
                wait = TRACEBACK_IDLE_SECONDS if reader.in_traceback else None
                ready, _, _ = select.select([descriptor], [], [], wait)
                if not ready:
                    reader.end_traceback()
                    continue
                chunk = os.read(descriptor, _READ_BYTES)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    text = raw.decode("utf-8", errors="replace")
                    if log is not None:
                        log.write(text + "\n")
                    reader.line(render(text.rstrip("\r\n")))
                if log is not None:
                    log.flush()
            if pending:
                text = pending.decode("utf-8", errors="replace")
                if log is not None:
                    log.write(text + "\n")
                reader.line(render(text))
            reader.end_traceback()
        finally:
            if log is not None:
                log.close()
            pipe.close()

    def _silence_stream(self) -> None:
        # The unwritten rest stays buffered in `sys.stdout`, and flushing it
        # at interpreter exit would raise again ("Exception ignored ...
        # BrokenPipeError"). Python's documented fix: point the descriptor
        # at /dev/null.
        if self.stream is not sys.stdout:
            return
        try:
            descriptor = self.stream.fileno()
        except (AttributeError, OSError, ValueError):
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, descriptor)
        finally:
            os.close(devnull)


class _TaskReader:
    """One task's lines: shown, recorded, tracebacks folded into one line."""

    def __init__(self, output: TaskOutput, record: TaskRecord):
        self.output = output
        self.record = record
        self.prefix = f"[{record.name}] "
        self.visible = output.shown is None or record.name in output.shown
        self.in_traceback = False
        self._exception = None
        self._frames = False

    def line(self, text: str) -> None:
        self.record.last_output = time.monotonic()
        if text == _TRACEBACK:
            self.in_traceback, self._frames = True, True
            return
        if self.in_traceback:
            self._traceback_line(text)
            return
        keep = self.output.keep
        if keep is None or keep(text):
            self.record.last_lines.append(text)
        if self.visible:
            self.output.write_line(self.prefix, text)

    def _traceback_line(self, text: str) -> None:
        if text in _CHAINED or not text.strip():
            return
        indented = text[:1].isspace()
        if indented:
            self._frames = True
            return
        if self._frames and _EXCEPTION.match(text):
            # The exception after a stack of frames: the last one wins.
            self._exception = text
            self._frames = False

    def end_traceback(self) -> None:
        """Shows a traceback that ended as one line (and records it)."""
        if not self.in_traceback:
            return
        self.in_traceback = False
        exception = self._exception or "a traceback"
        self._exception = None
        if len(exception) > EXCEPTION_CHARACTERS:
            exception = exception[:EXCEPTION_CHARACTERS] + " ..."
        self.record.exception = exception
        where = self.record.log_path
        text = exception + (f" (traceback: {where})" if where else "")
        self.record.last_lines.append(text)
        # Shown for every task: the errors of the tasks `--only-chief` hides
        # are what an operator must see.
        self.output.write_line(self.prefix, text)
