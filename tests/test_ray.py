"""Ray Train runs the README's script: `examples/ray_train.py` for real.

One local Ray cluster (2 CPUs, no dashboard) serves the module; each test
runs the example as its own driver process connected to it through
`RAY_ADDRESS`, as a user would on a running cluster. The Ray workers get
`TF_CONFIG` from Ray's `TensorflowTrainer`, `auto_strategy()` builds a
`MultiWorkerMirroredStrategy`, and the result is compared with the same
script on one device (`examples/train.py` without a cluster).
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from helpers import REPO_ROOT, example_weights, train_example

ray = pytest.importorskip("ray", reason="the ray extra (ray[train]) is not installed")

pytestmark = [pytest.mark.ray, pytest.mark.multiworker, pytest.mark.slow]

EXAMPLES = os.path.join(REPO_ROOT, "examples")


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    """A local Ray cluster for the module; its GCS address."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """`examples/train.py` on one device: its weights by (hook, epochs)."""
    cache = {}

    def run(hook, epochs):
        if (hook, epochs) not in cache:
            out = tmp_path_factory.mktemp(f"one-device-{hook}-{epochs}")
            cache[hook, epochs] = train_example(
                out, f"--epochs={epochs}", f"--hook={hook}"
            )
        return cache[hook, epochs]

    return run


def test_two_ray_workers_train_the_readme_script(ray_address, one_device, tmp_path):
    """The README's script as is (FP16): identical workers, reports carry logs."""
    result = _run_example(ray_address, tmp_path, "--epochs=2", "--hook=fp16")
    assert result.returncode == 0, result.output[-6000:]
    assert "auto_strategy chose MultiWorkerMirroredStrategy" in result.output
    first = example_weights(tmp_path / "weights-worker-0.npz")
    second = example_weights(tmp_path / "weights-worker-1.npz")
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    # FP16 rounds each worker's half of the gradient; one device does not
    # (measured: 1.3e-4 after 2 epochs).
    for got, want in zip(first, one_device("none", 2)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3)
    # ray.train.report carried every epoch's logs to the driver.
    reports = json.loads((tmp_path / "reports.json").read_text())
    assert [row["epoch"] for row in reports] == [1, 2]
    assert all(row["compression_ratio"] == 2.0 for row in reports)
    history = json.loads((tmp_path / "history-worker-0.json").read_text())
    np.testing.assert_allclose(
        [row["loss"] for row in reports], history["loss"], rtol=1e-6
    )


def test_a_killed_ray_worker_resumes_from_the_backup(ray_address, one_device, tmp_path):
    """FailureConfig(max_failures=1) + BackupAndRestore: SIGKILL in epoch 2.

    Ray replaces the whole worker group; the new group finds the backup of
    epoch 1 and trains epochs 2 and 3 only. The result equals one device
    (uncompressed, so to float32 precision): nothing is lost but the part
    of epoch 2 done before the kill.
    """
    killed = []

    def kill_in_epoch_two(line):
        match = re.search(r"RayTrainWorker pid=(\d+)[,)].*Epoch 2/3", line)
        if match and not killed:
            killed.append(int(match.group(1)))
            os.kill(killed[0], signal.SIGKILL)

    result = _run_example(
        ray_address,
        tmp_path,
        "--epochs=3",
        "--hook=none",
        "--max-failures=1",
        f"--backup-dir={tmp_path / 'backups'}",
        on_line=kill_in_epoch_two,
    )
    assert killed, result.output[-6000:]
    assert result.returncode == 0, result.output[-6000:]
    assert "[FailurePolicy] RETRY" in result.output, result.output[-6000:]
    assert result.output.count("Started training worker group of size 2") == 2
    assert "BackupAndRestore: resumed from" in result.output
    # Ray's Result keeps the reports of the group that finished (epochs 2
    # and 3: it resumed after epoch 1), preceded by the killed group's epoch-1
    # report when Ray's controller collected it before it saw the failure (a
    # race inside Ray: a fresh-clone CI run got [1, 2, 3], the others [2, 3]).
    reports = json.loads((tmp_path / "reports.json").read_text())
    assert [int(row["epoch"]) for row in reports] in ([2, 3], [1, 2, 3])
    assert "loss" in reports[-1]
    first = example_weights(tmp_path / "weights-worker-0.npz")
    second = example_weights(tmp_path / "weights-worker-1.npz")
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    for got, want in zip(first, one_device("none", 3)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


class _Result:
    def __init__(self, returncode, output):
        self.returncode = returncode
        self.output = output


def _run_example(ray_address, out, *args, on_line=None, timeout=420):
    """Runs examples/ray_train.py as a driver of the module's Ray cluster."""
    command = [
        sys.executable,
        os.path.join(EXAMPLES, "ray_train.py"),
        "--workers=2",
        f"--out={out}",
        f"--storage={out / 'ray_results'}",
        *args,
    ]
    env = _env(RAY_ADDRESS=ray_address, RAY_DEDUP_LOGS="0")
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []

    def read():
        for line in process.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    reader.join(timeout=10)
    return _Result(process.returncode, "".join(lines))


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO_ROOT), **extra)
    return env
