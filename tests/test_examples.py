"""Every example and the demo run (fast paths), so none of them rots."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def run(args, timeout=300, cwd=None):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    result = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def test_mirrored_cnn_example():
    out = run([os.path.join(EXAMPLES, "mirrored_cnn.py"), "--smoke"])
    assert "digits (smoke)" in out
    assert "| 1 device |" in out and "| 2 devices |" in out
    assert "speed-up:" in out


@pytest.mark.multiworker
def test_multi_worker_example_through_the_launcher():
    script = os.path.join(EXAMPLES, "multi_worker.py")
    launch = ["-m", "keras_dist", "launch", "--workers", "2", "--"]
    out = run([*launch, sys.executable, script, "--smoke"])
    for worker in (0, 1):
        assert (
            f"[worker:{worker}] all-reduce of (task index + 1) over workers: 3" in out
        )
    digests = {line.split()[3] for line in out.splitlines() if "weights sha256" in line}
    assert len(digests) == 1


def test_multi_worker_example_without_launcher_explains_itself():
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "multi_worker.py")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2
    assert "keras-dist launch --workers 2" in result.stderr


def test_demo_runs_and_writes_its_table(tmp_path):
    out = run(
        ["-m", "keras_dist", "demo", "--epochs", "2", "--out", str(tmp_path)],
        timeout=600,
    )
    assert "| configuration | test accuracy |" in out
    results = json.loads((tmp_path / "results.json").read_text())
    names = [r["name"] for r in results["results"]]
    assert names[0] == "1 replica"
    assert any("accumulation" in name for name in names)
    for result in results["results"]:
        assert result["test_accuracy"] > 0.5, result
    two = next(r for r in results["results"] if r["name"].endswith("replicas"))
    assert two["bytes_per_step"] > 0
    assert (tmp_path / "results.md").exists()
    assert (tmp_path / "results.png").exists()
