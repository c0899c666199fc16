"""TopK (`keras_dist.core.topk`): each replica's largest entries, error
feedback, the exact top-k, per-replica residuals, bad ratios.

TopK in buckets: `test_compression_buckets.py`; the protocol every hook
follows: `test_hooks.py`.
"""

import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    LAYER_SHAPES,
    Harness,
    assert_same_on_replicas,
    exact_sum,
    random_grads,
)

from keras_dist.compression import TopK
from keras_dist.core import topk as topk_module

# --- Sums on 2 replicas -------------------------------------------------------


def test_topk_ratio_one_is_exact(mirrored):
    grads = random_grads(LAYER_SHAPES, 2, seed=3)
    hook = TopK(ratio=1.0)
    harness = Harness(mirrored(2), hook, LAYER_SHAPES)
    results = harness.reduce(grads)
    assert_same_on_replicas(results)
    for got, want in zip(results, exact_sum(grads)):
        np.testing.assert_array_equal(got[0], want)
    # Everything was sent: the residuals stay zero.
    for residual in hook.state_variables:
        for value in harness.local(residual):
            assert not value.any()


def test_topk_sends_each_replicas_largest_entries_and_keeps_the_rest(mirrored):
    hook = TopK(ratio=0.25)  # k = 2 of 8
    harness = Harness(mirrored(2), hook, [(8,)])
    grads = [
        [np.array([1, -5, 2, 0.5, 3, 0, 0, 0], "float32")],
        [np.array([0, 0, 4, 0, -1, 0, 6, 0.1], "float32")],
    ]
    (got,) = harness.reduce(grads)
    np.testing.assert_array_equal(got[0], [0, -5, 4, 0, 3, 0, 6, 0])
    (residual,) = hook.state_variables
    first, second = harness.local(residual)
    np.testing.assert_array_equal(first, [1, 0, 2, 0.5, 0, 0, 0, 0])
    np.testing.assert_allclose(second, [0, 0, 0, 0, -1, 0, 0, 0.1])
    # Error feedback: the residual is sent in later steps.
    zeros = [[np.zeros(8, "float32")] for _ in range(2)]
    (got,) = harness.reduce(zeros)
    np.testing.assert_allclose(got[0], [1, 0, 2, 0, -1, 0, 0, 0.1])


def test_topk_on_half_precision_and_float64_gradients(mirrored):
    shapes = [(7,), (9,), (6,)]
    dtypes = ["float16", "bfloat16", "float64"]
    rng = np.random.default_rng(4)
    grads = [
        [
            rng.normal(size=s).astype(d)
            for s, d in zip(shapes, ["float16", "float32", "float64"])
        ]
        for _ in range(2)
    ]
    for replica in grads:
        replica[1] = tf.constant(replica[1], "bfloat16").numpy()
    results = Harness(mirrored(2), TopK(ratio=1.0), shapes, dtypes).reduce(grads)
    for got, want in zip(results, exact_sum(grads)):
        assert got[0].dtype == want.dtype
        np.testing.assert_allclose(
            got[0].astype("float64"), want.astype("float64"), rtol=1e-2
        )


@pytest.mark.parametrize("layout", ["random", "sample_misses"])
def test_top_k_indices_is_exact_on_large_tensors(layout):
    size, k = 1 << 18, 1 << 12
    rng = np.random.default_rng(7)
    magnitudes = np.abs(rng.normal(size=size)).astype("float32")
    if layout == "sample_misses":
        # Every sampled entry is huge, so the estimated threshold lets only
        # 2k / stride entries through, fewer than k: the exact fallback runs.
        stride = size // topk_module._SAMPLE_SIZE
        magnitudes[::stride] = 1e6 + np.arange(size // stride)
    got = topk_module.top_k_indices(tf.constant(magnitudes), k).numpy()
    want = tf.math.top_k(magnitudes, k).indices.numpy()
    assert len(got) == k
    assert set(got.tolist()) == set(want.tolist())


# --- Residuals: per replica, reset when not finite ----------------------------


def test_topk_residuals_are_per_replica_and_not_trainable(mirrored):
    hook = TopK(ratio=0.1)
    harness = Harness(mirrored(2), hook, [(10, 10)])
    harness.reduce(random_grads([(10, 10)], 2, seed=21))
    (residual,) = hook.state_variables
    assert not residual.trainable
    assert residual.synchronization == tf.VariableSynchronization.ON_READ
    first, second = harness.local(residual)
    assert not np.allclose(first, second)
    assert np.count_nonzero(first) == 90 and np.count_nonzero(second) == 90


def test_topk_residual_that_becomes_non_finite_is_reset(mirrored):
    hook = TopK(ratio=0.25)
    harness = Harness(mirrored(2), hook, [(8,)])
    poisoned = np.arange(1, 9, dtype="float32")
    # top-k sends NaN first; with more NaNs than k = 2, one stays unsent.
    poisoned[:3] = np.nan
    harness.reduce([[poisoned], [np.ones(8, "float32")]])
    first, second = harness.local(hook.state("residual_0"))
    assert not first.any()  # reset, not NaN
    assert np.all(np.isfinite(second)) and second.any()
    grads = random_grads([(8,)], 2, seed=4)
    (got,) = harness.reduce(grads)
    assert np.all(np.isfinite(got[0]))


# --- Bad input ----------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0, 0.0, -0.5, 1.5, float("nan"), float("inf")])
def test_topk_rejects_bad_ratio(ratio):
    with pytest.raises(
        ValueError,
        match=r"`ratio` must be a finite number > 0 and <= 1\. Received: ratio=.*"
        r"fraction of each gradient's entries to send\. Try `ratio=0\.01`",
    ):
        TopK(ratio=ratio)


@pytest.mark.parametrize("ratio", [True, "0.1", None])
def test_topk_rejects_non_number_ratio(ratio):
    with pytest.raises(
        TypeError, match=r"`ratio` must be a finite number > 0 and <= 1\. Received"
    ):
        TopK(ratio=ratio)
