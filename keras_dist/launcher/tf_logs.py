"""TensorFlow's native log lines: hidden by `keras-dist` unless asked for.

TensorFlow's C++ runtime writes its own lines to standard error: the oneDNN
notice, "Could not find cuda drivers", `failed call to cuInit` on a machine
without a GPU, the coordination service's progress, "Type inference
failed", ... Under `keras-dist launch --workers 2` they were most of the
output. `TF_CPP_MIN_LOG_LEVEL=3` hides the ones TensorFlow writes once it
has read the variable (so it must be set before TensorFlow loads), but with
TensorFlow 2.19 and later a few are written before that, through absl
("WARNING: All log messages before absl::InitializeLog() is called are
written to STDERR", then absl-formatted lines), and no variable hides them.

The rule, the same for every `keras-dist` command: TensorFlow's logs are
quiet unless the user said something about them, that is unless
`TF_CPP_MIN_LOG_LEVEL` is set (then TensorFlow's own rules apply, untouched),
`KERAS_DIST_TF_LOGS` is set to anything but `0`/`false`/`no`/`off`/empty, or
the command got `--tf-logs`. Quiet means `TF_CPP_MIN_LOG_LEVEL=3` before
TensorFlow loads, and the lines written before TensorFlow reads it dropped
from the output by their format (`is_native_log_line`): the launcher drops
them from its tasks' output, and `keras-dist env` / `demo` from their own
import of TensorFlow (`quiet_import`). Fatal lines (`F...`) are kept: they
say why a process aborts.

This module imports neither TensorFlow nor Keras.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping, MutableMapping

TF_LOGS_ENV_VAR = "KERAS_DIST_TF_LOGS"
LOG_LEVEL_ENV_VAR = "TF_CPP_MIN_LOG_LEVEL"
# 3 hides INFO, WARNING and ERROR lines (`failed call to cuInit` is an ERROR
# on every machine without a GPU); a Python exception still says what failed.
QUIET_LEVEL = "3"

_OFF = ("", "0", "false", "no", "off")
_ABSL_BANNER = "WARNING: All log messages before absl::InitializeLog() is called"
# A native source file and line, as both log formats name it: `port.cc:153]`.
_SOURCE = r"\S+\.(?:cc|cpp|cxx|c|h|hpp):\d+\] "
# absl / glog: `I0623 14:05:07.450448    1393 port.cc:153] ...`; before
# absl is initialised the date is zeros and the seconds count from 1970:
# `I0000 00:00:1796356644.450448    1393 port.cc:153] ...`.
_ABSL_LINE = re.compile(r"[IWE]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ " + _SOURCE)
# TensorFlow's older own format: `2025-09-17 14:44:05.157831: I external/...`.
_TSL_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWE] " + _SOURCE)


def tf_logs_requested(environ: Mapping[str, str], flag: bool = False) -> bool:
    """Whether the user asked for TensorFlow's logs (`--tf-logs` or the variable).

    Args:
        environ: Mapping. The environment to read `KERAS_DIST_TF_LOGS` from.
        flag: Bool. Whether the command got `--tf-logs`. Defaults to `False`.
    """
    value = environ.get(TF_LOGS_ENV_VAR, "")
    return flag or value.strip().lower() not in _OFF


def is_quiet(environ: Mapping[str, str], flag: bool = False) -> bool:
    """Whether `keras-dist` quiets TensorFlow's logs in this environment.

    Quiet unless TensorFlow's logs were asked for (`tf_logs_requested`) or
    `TF_CPP_MIN_LOG_LEVEL` is set (the user chose a level: it is kept, and
    nothing is filtered).

    Args:
        environ: Mapping. The environment the command runs in.
        flag: Bool. Whether the command got `--tf-logs`. Defaults to `False`.
    """
    return not tf_logs_requested(environ, flag) and LOG_LEVEL_ENV_VAR not in environ


def prepare_environment(environ: MutableMapping[str, str], flag: bool = False) -> bool:
    """Sets up `environ` for a process that will load TensorFlow; returns `is_quiet`.

    Quiet: sets `TF_CPP_MIN_LOG_LEVEL=3`. Otherwise leaves `environ` as it
    is.

    Args:
        environ: Mutable mapping. `os.environ`, or a task's environment.
        flag: Bool. Whether the command got `--tf-logs`. Defaults to `False`.

    Returns:
        Whether TensorFlow's logs are quiet there (then lines that match
        `is_native_log_line` are to be dropped from their output).
    """
    quiet = is_quiet(environ, flag)
    if quiet:
        environ[LOG_LEVEL_ENV_VAR] = QUIET_LEVEL
    return quiet


def is_native_log_line(line: str) -> bool:
    """Whether `line` is an INFO, WARNING or ERROR line of TensorFlow's C++ code.

    Matches absl's banner and lines in absl's or TensorFlow's log format that
    name a C++ source file (`port.cc:153] ...`); Python logging in absl's
    format names a `.py` file and is kept, as are fatal (`F`) lines.
    """
    return (
        line.startswith(_ABSL_BANNER)
        or _ABSL_LINE.match(line) is not None
        or _TSL_LINE.match(line) is not None
    )


def keep_line(line: str) -> bool:
    """The launcher's filter in quiet mode: every line but TensorFlow's own."""
    return not is_native_log_line(line)


@contextlib.contextmanager
def quiet_import(quiet: bool) -> Iterator[None]:
    """Drops TensorFlow's native log lines from this process's stderr meanwhile.

    For `import tensorflow` in the `keras-dist` process itself: absl writes
    its first lines to file descriptor 2 before TensorFlow reads
    `TF_CPP_MIN_LOG_LEVEL`. While the block runs, descriptor 2 goes to a
    temporary file; afterwards every line but those is written to
    `sys.stderr`, in order (a warning or traceback printed meanwhile still
    shows). Does nothing unless `quiet`.

    Args:
        quiet: Bool. Whether to filter (`is_quiet`).
    """
    if not quiet:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode("utf-8", errors="replace")
            kept = [
                line
                for line in text.splitlines(keepends=True)
                if not is_native_log_line(line)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
