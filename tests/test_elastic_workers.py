"""Elastic training with real worker processes (issue 29): a worker's
machine is lost, `keras-dist launch --workers MIN:MAX --discover` restarts
the job on the workers left, and `BackupAndRestore` goes on from the
backup of the larger job: the same weights, `iterations` and samples as
the uninterrupted run.

Global batch per update 96: per-replica 8 (one replica per worker) x 4
workers x 3 accumulation steps. The chief of every run writes its final
weights, `iterations` and how often each example was trained on
(tests/elastic_worker.py); the reference is the uninterrupted run on 4
replicas: 4 logical CPU replicas in the test's process, whose sums differ
from 4 workers' by rounding only (1e-5 allowed).
"""

import json
import os

import numpy as np
import pytest
from elastic_model import PER_REPLICA, data, make_model, seen, write_result
from helpers import REPO_ROOT, launch_workers

from keras_dist.callbacks import BackupAndRestore

WORKER = os.path.join(REPO_ROOT, "tests", "elastic_worker.py")
LAUNCH_TIMEOUT = 900

pytestmark = [pytest.mark.multiworker, pytest.mark.slow]


def launch(tmp, workers, *args, discover=None, max_restarts=0, out="out"):
    """Runs elastic_worker.py under `keras-dist launch`; returns (status, output)."""
    options = ["--workers", workers, "--max-restarts", str(max_restarts)]
    if discover is not None:
        options += ["--discover", discover]
    script = (WORKER, str(tmp / out), str(tmp / "b"), *args)
    return launch_workers(options, script, LAUNCH_TIMEOUT)


def result(folder):
    with np.load(os.path.join(folder, "weights.npz")) as archive:
        weights = [archive[name] for name in archive.files]
    with open(os.path.join(folder, "summary.json")) as handle:
        summary = json.load(handle)
    return weights, np.load(os.path.join(folder, "seen.npy")), summary


def assert_same_run(got, reference, atol=1e-5):
    weights, seen, summary = result(got)
    ref_weights, ref_seen, ref_summary = result(reference)
    for a, b in zip(weights, ref_weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)
    assert summary["iterations"] == ref_summary["iterations"]
    # Every example trained on exactly as often: 3 epochs, nothing skipped
    # or repeated across the resize.
    np.testing.assert_allclose(seen, ref_seen, rtol=0, atol=1e-5)
    np.testing.assert_allclose(seen, 3.0, rtol=0, atol=1e-5)
    return summary, ref_summary


@pytest.fixture(scope="module")
def reference(tmp_path_factory, mirrored):
    """The uninterrupted run on 4 replicas, in this process: 4 logical CPU
    replicas train what 4 worker processes of one replica each train (the
    same model, data, batches and accumulation; the sums' rounding aside),
    at a fraction of a 4-process launch's time. Written as elastic_worker.py
    writes it."""
    strategy = mirrored(4)
    model = make_model(strategy, 3)
    x, y = data()
    history = model.fit(
        x,
        y,
        batch_size=PER_REPLICA * 4,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[
            BackupAndRestore(str(tmp_path_factory.mktemp("backup")), save_freq=3)
        ],
    )
    out = tmp_path_factory.mktemp("reference") / "out"
    write_result(out, model, seen(model, strategy), 1, history)
    return out


# 4 -> 3: the update batch is held with an accumulation that is not a
# multiple of the old one (3 -> 4). 4 -> 2 was a case here too (3 -> 6,
# 100 s on 2 cores); shrinking by a factor is walked by the elastic
# example's test (3 -> 2 workers, test_examples.py) and in one process by
# test_elastic.py.
@pytest.mark.parametrize(("left", "steps"), [(3, 4)], ids=["4to3"])
def test_a_lost_worker_resumes_on_the_workers_left_exactly(
    tmp_path, reference, left, steps
):
    # Worker 3 is SIGKILLed in epoch 2 (after its 28th batch: the last
    # backup is after batch 27) and its machine does not come back: the
    # discovery file says `left` slots.
    slots = tmp_path / "slots"
    slots.write_text("4\n")
    status, output = launch(
        tmp_path,
        f"{left}:4",
        "--accumulation",
        "3",
        "--die",
        f"0:28:{left}:{slots}",
        discover=f"cat {slots}",
        max_restarts=1,
    )
    assert status == 0, output[-4000:]
    assert f"with {left} workers instead of 4" in output, output[-4000:]
    assert (
        f"elastic resume: 4 worker(s) / 4 replica(s) -> {left} / {left}; global "
        f"batch per step 32 -> {8 * left}, per update 96 -> 96 "
        f"(accumulation_steps={steps})"
    ) in output, output[-4000:]
    # A backup's gather is one traced function per strategy (TensorFlow
    # warned of excessive retracing from the fifth backup on).
    assert "triggered tf.function retracing" not in output
    summary, _ = assert_same_run(tmp_path / "out", reference)
    assert summary["workers"] == left
    assert summary["accumulation_steps"] == steps


@pytest.mark.extended
def test_a_larger_launch_resumes_a_smaller_jobs_backup_exactly(tmp_path, reference):
    # 2 workers (accumulation 6) crash in epoch 2; a new launch with 4
    # workers goes on with accumulation 3.
    slots = tmp_path / "slots"
    status, output = launch(
        tmp_path, "2", "--accumulation", "6", "--die", f"0:55:2:{slots}"
    )
    assert status != 0, output[-3000:]
    assert "losing my machine after batch 55" in output
    status, output = launch(tmp_path, "4", "--accumulation", "6")
    assert status == 0, output[-4000:]
    assert (
        "elastic resume: 2 worker(s) / 2 replica(s) -> 4 / 4; global batch per "
        "step 16 -> 32, per update 96 -> 96 (accumulation_steps=3)"
    ) in output, output[-4000:]
    summary, _ = assert_same_run(tmp_path / "out", reference)
    assert summary["accumulation_steps"] == 3


def test_a_resize_below_the_minimum_stops_with_a_clear_message(tmp_path):
    slots = tmp_path / "slots"
    slots.write_text("4\n")
    status, output = launch(
        tmp_path,
        "3:4",
        "--accumulation",
        "3",
        "--die",
        f"0:5:2:{slots}",
        discover=f"cat {slots}",
        max_restarts=2,
    )
    assert status != 0
    assert "fewer than the minimum 3" in output, output[-3000:]
    assert not (tmp_path / "out").exists()
