"""The README's promises hold: its example is short and its links resolve.

The example itself runs with every other code block of the README and the
docs (conftest.py, "Code blocks in the docs" in CONTRIBUTING.md).
"""

import os
import re
import subprocess
import sys

import transcripts
from helpers import REPO_ROOT
from tf_log_lines import native_log_lines

README = os.path.join(REPO_ROOT, "README.md")


def readme():
    with open(README) as handle:
        return handle.read()


def fifteen_line_example():
    section = readme().split("## In fifteen lines", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_fifteen_line_example_is_short():
    lines = [line for line in fifteen_line_example().splitlines() if line.strip()]
    assert len(lines) <= 18, len(lines)


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme())
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local
    for link in local:
        assert os.path.exists(os.path.join(REPO_ROOT, link)), link


def test_the_example_under_the_launcher_prints_a_line_per_epoch(tmp_path):
    # The README's two-worker command, as copied: `fit`'s default verbosity
    # under the launcher is one line per epoch (a progress bar redrawn with
    # \r and \b once erased the task names), and TensorFlow's C++ lines (the
    # oneDNN notice, "Could not find cuda drivers", the coordination
    # service) are hidden unless `--tf-logs` asks for them (test_cli.py).
    (tmp_path / "train.py").write_text(fifteen_line_example())
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("TF_CPP_MIN_LOG_LEVEL", "KERAS_DIST_TF_LOGS", "TF_CONFIG")
    }
    env["PYTHONPATH"] = REPO_ROOT
    # `keras-dist launch --workers 2 -- python train.py`, with this Python.
    done = subprocess.run(
        [
            *(sys.executable, "-m", "keras_dist", "launch", "--workers", "2"),
            *("--", sys.executable, "train.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    out = done.stdout
    assert native_log_lines(done.stdout + done.stderr) == []
    assert "\r" not in out and "\x08" not in out and "\x1b" not in out
    epoch_line = re.compile(
        r"^\[worker:[01]\] \d+/\d+ - \d+s - \d+ms/step - accuracy: [0-9.]+ - "
        r"compression_ratio: 2\.0000 - loss: [0-9.]+$"
    )
    for worker in (0, 1):
        lines = [
            line for line in out.splitlines() if line.startswith(f"[worker:{worker}]")
        ]
        assert [line for line in lines if "Epoch " in line] == [
            f"[worker:{worker}] Epoch {epoch}/10" for epoch in range(1, 11)
        ]
        assert sum(bool(epoch_line.match(line)) for line in lines) == 10, lines
    transcripts.check("readme_launch", out)
