"""A worker killed mid-epoch under `keras-dist launch --max-restarts 1` with
sharded Adam, accumulation and `BackupAndRestore`: the restarted job ends
with the uninterrupted run's weights (issue 28, "Resume").

`tests/sharding_fault_worker.py` trains on 2 worker processes: one launch
trains the uninterrupted references of both accumulation forms (stage 2:
`ShardedOptimizer(Adam, accumulation_steps=2)`; stage 1:
`GradientAccumulationOptimizer(ShardedOptimizer(Adam), 2)`; whole
variables: the same with `shard_by="variables"`, each worker keeping its
own variables' Adam state); the others
SIGKILL worker 1 after its 7th batch, between two backups (every 4 batches)
and in the middle of an accumulation cycle. The chief's final weights must
equal the reference's to 1e-6 (the same arithmetic in the same order), and
the one-device unsharded run's to 1e-6 too.
"""

import json
import os

import numpy as np
import pytest
import sharding_fault_worker as worker
from helpers import REPO_ROOT, launch_workers, max_abs_diff

WORKER = os.path.join(REPO_ROOT, "tests", "sharding_fault_worker.py")
LAUNCH_TIMEOUT = 600


def launch(tmp, *args, max_restarts=0):
    """Runs the worker script on 2 workers; returns (status, output)."""
    return launch_workers(
        ("--workers", "2", "--max-restarts", str(max_restarts)),
        (WORKER, str(tmp / "out"), str(tmp / "b"), *args),
        LAUNCH_TIMEOUT,
    )


def weights(folder):
    with np.load(os.path.join(folder, "weights.npz")) as archive:
        return [archive[f"arr_{i}"] for i in range(len(archive.files))]


def summary(folder):
    with open(os.path.join(folder, "summary.json")) as handle:
        return json.load(handle)


@pytest.fixture(scope="module")
def references(tmp_path_factory, request):
    """The uninterrupted 2-worker runs of the configurations, one launch
    (stage 1's only where its kill runs: `make test-all`)."""
    tmp = tmp_path_factory.mktemp("references")
    configs = ("stage2", "owned")
    if request.config.getoption("extended"):
        configs += ("stage1",)
    status, output = launch(tmp, *(a for c in configs for a in ("--config", c)))
    assert status == 0, output[-3000:]
    # Training ended normally: the backups were deleted.
    assert not os.path.exists(tmp / "b" / "stage2")
    return tmp / "out"


def one_device(config):
    """The same training unsharded on one device (this process)."""
    model = worker.build(config, sharded=False)
    x, y = worker.data()
    model.fit(
        x,
        y,
        batch_size=worker.GLOBAL_BATCH,
        epochs=worker.EPOCHS,
        shuffle=False,
        verbose=0,
    )
    return model


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.parametrize(
    "config", ["stage2", pytest.param("stage1", marks=pytest.mark.extended), "owned"]
)
def test_sigkill_mid_accumulation_resumes_sharded_adam_exactly(
    tmp_path, references, config
):
    status, output = launch(
        tmp_path, "--config", config, "--hurt", "0:kill:7", max_restarts=1
    )
    assert status == 0, output[-3000:]
    assert "hurting myself: kill" in output
    assert "restart 1 of 1: worker:1 failed with exit code 137" in output
    # Attempt 1 resumed from the backup after batch 4 (of 7 run).
    assert f"{config}/backup-00000001 in epoch 1, after 4 batches" in output
    got, reference = tmp_path / "out" / config, references / config
    assert max_abs_diff(weights(got), weights(reference)) <= 1e-6
    resumed, uninterrupted = summary(got), summary(reference)
    updates = worker.EPOCHS * worker.EXAMPLES // worker.GLOBAL_BATCH
    assert resumed["iterations"] == uninterrupted["iterations"] == updates // 2
    assert resumed["replicas"] == 2
    if config == "owned":
        # The kernels and biases went to both workers; the chief (replica
        # 0) kept its own variables' state only.
        assert sorted(set(resumed["owners"])) == [0, 1]
        assert resumed["owned_here"] == [
            i for i, owner in enumerate(resumed["owners"]) if owner == 0
        ]
    else:
        # Each worker's one replica kept half of Adam's slots.
        parameters = sum(int(np.prod(w.shape)) for w in weights(got))
        assert resumed["slot_shape"] == [[-(-parameters // 2)]]
    for key, values in resumed["history"].items():
        assert values == pytest.approx(
            uninterrupted["history"][key][-len(values) :], rel=1e-6
        ), key
    # And the sharded run is the unsharded one-device training.
    assert max_abs_diff(weights(got), one_device(config).get_weights()) <= 1e-6
