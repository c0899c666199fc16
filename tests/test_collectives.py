"""The collective layer (`keras_dist/core/collectives.py`): owned keys,
helpers, and many strategies in one process."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from helpers import REPO_ROOT

from keras_dist.core import collectives

SEQUENCE = pathlib.Path(__file__).with_name("strategy_sequence.py")
CONFIGS = ["none", "fp16", "topk", "powersgd", "dgc", "accumulation"]


def _start(out, names):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow"}
    return subprocess.Popen(
        [sys.executable, str(SEQUENCE), str(out), *names],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_six_strategies_in_one_process_train_as_in_fresh_processes(tmp_path):
    # The notebook / sweep pattern: a new MirroredStrategy per model, each
    # with another hook and model size. TensorFlow numbers every strategy's
    # collectives from the same keys; without keras_dist owning them the
    # second model aborts ("Shape mismatch in the collective instance
    # 101"). Each model must end as it does alone in a fresh process.
    jobs = {"sequence": _start(tmp_path / "sequence.npz", CONFIGS)}
    for name in CONFIGS:
        jobs[name] = _start(tmp_path / f"{name}.npz", [name])
    for name, job in jobs.items():
        _, stderr = job.communicate(timeout=600)
        assert job.returncode == 0, f"{name}: {stderr[-3000:]}"
    sequence = np.load(tmp_path / "sequence.npz")
    for name in CONFIGS:
        alone = np.load(tmp_path / f"{name}.npz")
        assert alone.files, name
        for key in alone.files:
            difference = float(np.max(np.abs(sequence[key] - alone[key])))
            assert difference <= 1e-6, (name, key, difference)


def test_every_strategy_gets_keys_of_its_own():
    devices = ["/cpu:0", "/cpu:1"]
    first = tf.distribute.MirroredStrategy(devices)
    second = tf.distribute.MirroredStrategy(devices)
    # Both start from TensorFlow's one base.
    assert first.extended._collective_keys.get_group_key(
        ["/cpu:9"]
    ) == second.extended._collective_keys.get_group_key(["/cpu:9"])
    bases = {collectives.group_base(first), collectives.group_base(second)}
    assert len(bases) == 2
    assert collectives.group_base(first) == collectives.group_base(first)
    # The collectives of the re-keyed strategy use its new keys.
    ops = second.extended._cross_device_ops
    assert ops._collective_keys is second.extended._collective_keys
    assert ops._launchers[0]._group_key == collectives.group_base(second)


def test_a_strategy_without_collectives_is_left_alone():
    assert collectives.group_base(tf.distribute.get_strategy()) is None
    one = tf.distribute.OneDeviceStrategy("/cpu:0")
    assert collectives.group_base(one) is None


@pytest.mark.parametrize("replicas", [1, 2])
def test_all_gather_pairs_round_trips_every_float_dtype(mirrored, replicas):
    strategy = mirrored(replicas)
    dtypes = [tf.float16, tf.bfloat16, tf.float32, tf.float64]

    def step():
        ctx = tf.distribute.get_replica_context()
        offset = tf.cast(ctx.replica_id_in_sync_group, tf.int32)
        indices = [tf.range(3, dtype=tf.int32) + offset * 10 for _ in dtypes]
        values = [tf.cast(tf.range(3) + 100 * (offset + 1), dtype) for dtype in dtypes]
        return collectives.all_gather_pairs(indices, values)

    results = strategy.run(tf.function(step))
    for (indices, values), dtype in zip(results, dtypes):
        indices = strategy.experimental_local_results(indices)[0].numpy()
        values = strategy.experimental_local_results(values)[0]
        assert values.dtype == dtype
        expected_indices = np.concatenate(
            [np.arange(3) + 10 * r for r in range(replicas)]
        )
        expected_values = np.concatenate(
            [np.arange(3) + 100 * (r + 1) for r in range(replicas)]
        )
        np.testing.assert_array_equal(indices, expected_indices)
        np.testing.assert_array_equal(
            tf.cast(values, tf.float64).numpy(), expected_values
        )


def test_collectives_refuse_cross_replica_context(mirrored):
    with (
        mirrored(2).scope(),
        pytest.raises(RuntimeError, match="replica context"),
    ):
        collectives.all_reduce_sum([tf.ones(2)])


def test_ring_subdivisions_are_read_from_the_environment(monkeypatch):
    # Only multi-worker strategies are subdivided (here a local strategy
    # stands in for one); the variable is checked when keras_dist first owns
    # one. tests/test_models.py's and the other multi-worker tests train
    # through the subdivided ring.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    monkeypatch.setenv("KERAS_DIST_RING_SUBDIVS", "many")
    collectives._subdivide(strategy)  # one process: nothing to do
    launchers = strategy.extended._collective_ops._launchers
    assert not any(hasattr(launcher, "max_subdivs") for launcher in launchers)
    monkeypatch.setattr(
        collectives.tf_internal, "is_multi_worker", lambda strategy: True
    )
    with pytest.raises(ValueError, match=r"KERAS_DIST_RING_SUBDIVS.*'many'"):
        collectives._subdivide(strategy)
    monkeypatch.setenv("KERAS_DIST_RING_SUBDIVS", "4")
    collectives._subdivide(strategy)
    assert {launcher.max_subdivs for launcher in launchers} == {4}
    monkeypatch.delenv("KERAS_DIST_RING_SUBDIVS")
    collectives._subdivide(strategy)
    assert {launcher.max_subdivs for launcher in launchers} == {
        collectives.RING_SUBDIVS
    }
