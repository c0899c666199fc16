"""Ray Train runs the README's script: `examples/ray_train.py` for real.

One local Ray cluster (2 CPUs, no dashboard) serves the module; each test
runs the example as its own driver process connected to it through
`RAY_ADDRESS`, as a user would on a running cluster. The Ray workers get
`TF_CONFIG` from Ray's `TensorflowTrainer`, `auto_strategy()` builds a
`MultiWorkerMirroredStrategy`, and the result is compared with the same
script on one device (`examples/train.py` without a cluster). The elastic
test brings up its own three-node cluster (`ray.cluster_utils.Cluster`) and
removes a node while the run trains.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
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


@pytest.mark.extended
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


@pytest.mark.extended
def test_an_elastic_group_shrinks_when_a_node_goes(
    three_node_cluster, one_device, tmp_path
):
    """`--workers 2:3`: a node removed in epoch 2 of 3; Ray goes on with 2.

    Ray Train's elastic policy (`ScalingConfig(num_workers=(2, 3))`) starts
    3 workers on the three 1-CPU nodes. Removing one node kills its worker;
    with `max_failures=1` Ray restarts the group with the workers the nodes
    left hold, 2, and `BackupAndRestore` resumes the 3-worker backup of
    epoch 1 elastically. The global batch (32) is the same on any number of
    workers, so the update batch (128) is held with no change, and the two
    workers left end equal to one device (uncompressed, so to float32
    precision).
    """
    cluster, nodes = three_node_cluster
    removed = []

    def remove_in_epoch_two(line):
        if not removed and re.search(r"RayTrainWorker pid=.*Epoch 2/3", line):
            removed.append(line)
            cluster.remove_node(nodes[-1])

    result = _run_example(
        cluster.address,
        tmp_path,
        "--epochs=3",
        "--hook=none",
        "--max-failures=1",
        f"--backup-dir={tmp_path / 'backups'}",
        workers="2:3",
        on_line=remove_in_epoch_two,
        # Ray's AutoscalingCoordinator sees the cluster anew every 20 s; a
        # restart decided before it saw the node go asks for 3 workers again
        # and waits for them this long (default 60 s) before it asks again.
        env={"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"},
    )
    assert removed, result.output[-6000:]
    assert result.returncode == 0, result.output[-6000:]
    assert "Started training worker group of size 3" in result.output
    assert "Started training worker group of size 2" in result.output
    assert (
        "BackupAndRestore: elastic resume: 3 worker(s) / 3 replica(s) -> 2 / 2; "
        "global batch per step 32 -> 32, per update 128 -> 128 "
        "(accumulation_steps=4)"
    ) in result.output, result.output[-6000:]
    reports = json.loads((tmp_path / "reports.json").read_text())
    assert int(reports[-1]["epoch"]) == 3
    # Only the group that finished writes weights: the two workers left.
    first, second = (
        example_weights(path) for path in sorted(tmp_path.glob("weights-*.npz"))
    )
    assert all(np.isfinite(w).all() for w in first)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    for got, want in zip(first, one_device("none", 3)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "workers", ["0", "3:2", "0:2", "2:", "a", "1:2:3", "-1"], ids=repr
)
def test_workers_takes_n_or_min_max_only(workers, monkeypatch, capsys):
    ray_train = _import_example(monkeypatch)
    with pytest.raises(SystemExit):
        ray_train.main([f"--workers={workers}"])
    error = capsys.readouterr().err
    assert "`--workers` must be a number of workers N >= 1, or MIN:MAX" in error
    assert f"Received: --workers={workers!r}" in error


def _import_example(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    import ray_train

    return ray_train


@pytest.fixture
def three_node_cluster(monkeypatch):
    """A Ray cluster of three nodes on this machine, 1 CPU each.

    Yields `(cluster, nodes)`; the head node stays (the driver connects to
    it), the other two (`nodes`) may be removed.
    """
    from ray.cluster_utils import Cluster

    # A short folder of its own: Ray's sockets live under it, and a Unix
    # socket path may not exceed 107 bytes (pytest's folders under xdist
    # come close). `Cluster` writes its address to
    # `$RAY_TMPDIR/ray/ray_current_cluster` (where `ray.init(address="auto")`
    # looks): there instead of the machine's /tmp/ray.
    temp = pathlib.Path(tempfile.mkdtemp(prefix="kdray-"))
    (temp / "ray").mkdir()
    monkeypatch.setenv("RAY_TMPDIR", str(temp))
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "temp_dir": str(temp),
        },
    )
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        yield cluster, nodes
    finally:
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


class _Result:
    def __init__(self, returncode, output):
        self.returncode = returncode
        self.output = output


def _run_example(
    ray_address, out, *args, workers="2", on_line=None, env=None, timeout=420
):
    """Runs examples/ray_train.py as a driver of the Ray cluster at `ray_address`."""
    command = [
        sys.executable,
        os.path.join(EXAMPLES, "ray_train.py"),
        f"--workers={workers}",
        f"--out={out}",
        f"--storage={out / 'ray_results'}",
        *args,
    ]
    process = subprocess.Popen(
        command,
        env=_env(RAY_ADDRESS=ray_address, RAY_DEDUP_LOGS="0", **(env or {})),
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
