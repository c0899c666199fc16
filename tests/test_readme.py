"""The README's promises hold: its example runs and its links resolve."""

import os
import re
import subprocess
import sys

from helpers import REPO_ROOT

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


def test_the_fifteen_line_example_trains(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(fifteen_line_example())
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    accuracies = [float(a) for a in re.findall(r"accuracy: ([0-9.]+)", output)]
    assert accuracies and accuracies[-1] > 0.8, output[-2000:]
    assert "compression_ratio: 2.0000" in output


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme())
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local
    for link in local:
        assert os.path.exists(os.path.join(REPO_ROOT, link)), link
