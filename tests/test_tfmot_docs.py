"""The pruning example (`examples/prune_distributed.py`) runs and prunes as it says."""

import os
import re
import subprocess
import sys

from helpers import REPO_ROOT


def test_prune_distributed_example_smoke():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "examples", "prune_distributed.py"),
            "--smoke",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out = result.stdout
    assert "digits CNN (smoke), 2 replicas" in out
    # The schedule counted updates: 46 micro-steps x 3 epochs / 2.
    assert "69 updates (expected 69)" in out
    sparsities = [float(s) for s in re.findall(r"^sparsity \S+: ([\d.]+)$", out, re.M)]
    assert len(sparsities) == 3
    for sparsity in sparsities:
        assert abs(sparsity - 0.8) <= 0.01, out
    accuracy = float(re.search(r"test accuracy \(stripped model\): ([\d.]+)", out)[1])
    assert accuracy >= 0.7, out
    assert (
        "bytes sent per update per replica: 75,476 (uncompressed 150,952, 2.0x)" in out
    )
    stripped, dense = (
        int(n.replace(",", ""))
        for n in re.search(
            r"stripped ([\d,]+) bytes, dense ([\d,]+) bytes", out
        ).groups()
    )
    assert stripped < dense
