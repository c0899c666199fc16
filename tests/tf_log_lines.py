"""Counting TensorFlow's native log lines in a command's output, for the tests.

Independent of `keras_dist.launcher.tf_logs` on purpose: the tests that say
"no TensorFlow log line by default" count with broader patterns than the
filter matches, so a line the filter misses is counted.
"""

import re

# A `[worker:1] ` prefix from the launcher.
_TASK_PREFIX = re.compile(r"^\[[a-z]+:\d+\] ")
_PATTERNS = [
    # absl / glog, any severity and any source file: `I0000 00:00:17.4 1 x.cc:1]`.
    re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\]"),
    # TensorFlow's own older format: `2025-09-17 14:44:05.157831: I x.cc:32]`.
    re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] "),
    # absl's banner, and the continuation lines of multi-line native logs
    # seen on this machine (cpu_feature_guard, the coordination service).
    re.compile(r"absl::InitializeLog"),
    re.compile(r"rebuild TensorFlow with the appropriate compiler flags"),
    re.compile(r"^/job:\w+/replica:\d+/task:\d+$"),
]


def native_log_lines(output):
    """The lines of `output` that TensorFlow's C++ runtime wrote."""
    lines = []
    for line in output.splitlines():
        line = _TASK_PREFIX.sub("", line)
        if any(pattern.search(line) for pattern in _PATTERNS):
            lines.append(line)
    return lines
