"""The rows of docs/guides/horovod.md ("Coming from Horovod") that no other test covers.

One 2-worker job through `keras-dist launch` (Horovod's `horovodrun -np 2`)
runs `tests/horovod_workers.py` on both workers and checks the `hvd.init()`,
`BroadcastGlobalVariablesCallback` and `MetricAverageCallback` rows, for a
Keras 3 `DistributedModel` and a tf_keras model; the warmup row is a
schedule on 2 logical replicas. The `DistributedOptimizer` row is covered by
tests/test_tf_keras.py and tests/test_compression_training.py (cited on the
page).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tf_keras
import tf_keras_workers as tkw
from helpers import REPO_ROOT, max_abs_diff

import keras_dist
from keras_dist.tf_keras import DistributedOptimizer

WORKERS = 2


@pytest.fixture(scope="module")
def cluster():
    """Each worker's report from one `keras-dist launch --workers 2` job."""
    script = os.path.join(REPO_ROOT, "tests", "horovod_workers.py")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO_ROOT))
    env.pop("TF_CONFIG", None)
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_dist",
            "launch",
            "--workers",
            str(WORKERS),
            "--",
            sys.executable,
            script,
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO_ROOT,
        env=env,
    )
    out = completed.stdout
    assert completed.returncode == 0, out[-4000:] + completed.stderr[-4000:]
    reports = {}
    for line in out.splitlines():
        task, _, rest = line.partition("] ")
        if rest.startswith("HOROVOD_MIGRATION "):
            reports[task] = json.loads(rest.split(" ", 1)[1])
    assert sorted(reports) == [f"[worker:{i}" for i in range(WORKERS)], out[-4000:]
    return [reports[f"[worker:{i}"] for i in range(WORKERS)]


@pytest.mark.multiworker
def test_horovodrun_is_keras_dist_launch_and_hvd_init_is_auto_strategy(cluster):
    # horovodrun -np 2 python train.py -> keras-dist launch --workers 2 -- python
    # train.py; hvd.init(), hvd.rank(), hvd.size() -> auto_strategy(),
    # strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync.
    assert [r["rank"] for r in cluster] == list(range(WORKERS))
    for report in cluster:
        assert report["strategy"] == "CollectiveAllReduceStrategy"  # MWMS
        assert report["size"] == WORKERS


@pytest.mark.multiworker
@pytest.mark.parametrize("front_end", ["keras3", "tf_keras"])
def test_broadcast_global_variables_is_built_in(cluster, front_end):
    first, second = cluster
    # The seeds differ per worker: outside the scope the models differ...
    assert first["outside_scope"][front_end] != second["outside_scope"][front_end]
    # ...inside it every variable starts from worker 0's value.
    assert first["in_scope"][front_end] == second["in_scope"][front_end]
    assert first[front_end]["weights"] == second[front_end]["weights"]


@pytest.mark.multiworker
@pytest.mark.parametrize("front_end", ["keras3", "tf_keras"])
def test_metric_average_is_built_in(cluster, front_end):
    first, second = (report[front_end] for report in cluster)
    # Each worker trained and evaluated on its own shard only...
    assert abs(first["own_shard_loss"] - second["own_shard_loss"]) > 1e-3
    # ...yet both log the same History and evaluate the same numbers,
    assert first["history"] == second["history"]
    assert first["evaluate"] == second["evaluate"]
    # which are the mean over both shards, not either worker's own.
    mean = (first["own_shard_loss"] + second["own_shard_loss"]) / 2
    assert first["evaluate"][0] == pytest.approx(mean, abs=1e-5)


def horovod_warmup(base_lr, size, warmup_steps, step):
    """Horovod's LearningRateWarmupCallback, in updates: initial_lr = base_lr x
    size, multiplier 1 / size x (progress x (size - 1) + 1)."""
    progress = min(step / warmup_steps, 1.0)
    return base_lr * size / size * (progress * (size - 1) + 1)


@pytest.mark.parametrize("front_end", ["keras3", "tf_keras"])
def test_warmup_schedule_gives_horovods_rates(front_end):
    import keras

    module = keras if front_end == "keras3" else tf_keras
    base_lr, size, warmup = 0.1, 2, 4
    schedule = module.optimizers.schedules.CosineDecay(
        base_lr,
        decay_steps=1000,
        alpha=1.0,  # constant after the warmup, as with Horovod's callback
        warmup_target=base_lr * size,
        warmup_steps=warmup,
    )
    got = [float(schedule(step)) for step in range(8)]
    expected = [horovod_warmup(base_lr, size, warmup, step) for step in range(8)]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert expected[:5] == pytest.approx([0.1, 0.125, 0.15, 0.175, 0.2])


def test_warmup_schedule_advances_per_update_with_accumulation(mirrored):
    """tf_keras: the schedule in `DistributedOptimizer` with 2 accumulation
    steps on 2 replicas equals the same schedule on one device with the
    whole batch, update for update."""

    def schedule():
        return tf_keras.optimizers.schedules.CosineDecay(
            0.05, decay_steps=1000, alpha=1.0, warmup_target=0.1, warmup_steps=4
        )

    x, y = tkw.data()
    reference = tkw.mlp(tf_keras.optimizers.SGD(schedule()))
    reference.fit(x, y, batch_size=64, epochs=8, shuffle=False, verbose=0)
    with mirrored(2).scope():
        model = tkw.mlp(
            DistributedOptimizer(
                tf_keras.optimizers.SGD(schedule()),
                all_reduce_hook=keras_dist.compression.NoCompression(),
                accumulation_steps=2,
            )
        )
    model.fit(x, y, batch_size=32, epochs=8, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 8
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5
