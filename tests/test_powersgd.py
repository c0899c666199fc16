"""PowerSGD (`keras_dist.core.powersgd`): low-rank sums, P and Q as in the
paper, per-replica state, the paper's byte ratios, bad arguments.

Bucketed PowerSGD and its plain steps are tested with the other bucketed
hooks (`test_compression_buckets.py`), the hook protocol in `test_hooks.py`.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    Harness,
    assert_same_on_replicas,
    exact_sum,
    random_grads,
    record_payload,
)

from keras_dist.compression import PowerSGD
from keras_dist.core import powersgd as powersgd_module

# --- Sums on 2 replicas -------------------------------------------------------


def low_rank(rows, cols, rank, rng):
    return (rng.normal(size=(rows, rank)) @ rng.normal(size=(rank, cols))).astype(
        "float32"
    )


def test_powersgd_is_exact_on_low_rank_sums_and_raw_tensors(mirrored):
    rng = np.random.default_rng(5)
    shapes = [(3, 3, 4, 16), (16,), (64, 48), (4, 3)]
    hook = PowerSGD(rank=2, start_step=0, min_compression_rate=1)
    harness = Harness(mirrored(2), hook, shapes)
    # Compressed: the conv kernel (36 x 16) and the (64, 48) kernel. The
    # (4, 3) kernel at rank 2 would not shrink, so it is sent raw.
    assert [p.index for p in hook.matrix_plans] == [0, 2]
    shared_rows = [rng.normal(size=(36, 2)), rng.normal(size=(64, 2))]
    grads = []
    for _ in range(2):
        grads.append(
            [
                (shared_rows[0] @ rng.normal(size=(2, 16)))
                .astype("float32")
                .reshape(3, 3, 4, 16),
                rng.normal(size=16).astype("float32"),
                (shared_rows[1] @ rng.normal(size=(2, 48))).astype("float32"),
                rng.normal(size=(4, 3)).astype("float32"),
            ]
        )
    for _ in range(2):  # also from the warm-started Q of the first step
        results = harness.reduce(grads)
        assert_same_on_replicas(results)
        want = exact_sum(grads)
        for position in (0, 2):  # rank <= 2 sums: exact up to float32 rounding
            np.testing.assert_allclose(
                results[position][0], want[position], rtol=1e-4, atol=1e-4
            )
        for position in (1, 3):  # sent raw: bit-exact
            np.testing.assert_array_equal(results[position][0], want[position])


def test_powersgd_full_rank_request_sends_raw_and_is_exact(mirrored):
    # rank >= min(rows, cols): the factors could not be smaller than the
    # matrix, so PowerSGD sends it raw.
    hook = PowerSGD(rank=8, start_step=0, min_compression_rate=1)
    harness = Harness(mirrored(2), hook, [(8, 6), (3, 3, 2, 4)])
    assert hook.matrix_plans == []
    grads = random_grads([(8, 6), (3, 3, 2, 4)], 2, seed=6)
    for got, want in zip(harness.reduce(grads), exact_sum(grads)):
        np.testing.assert_array_equal(got[0], want)
    assert hook.stats().ratio == 1.0


def test_powersgd_before_start_step_is_the_plain_sum(mirrored):
    shapes = [(64, 48), (48,)]
    hook = PowerSGD(rank=1, start_step=2)
    harness = Harness(mirrored(2), hook, shapes)
    assert hook.stats().ratio == 1.0  # the first step will send raw
    for step in range(3):
        grads = random_grads(shapes, 2, seed=10 + step)
        results = harness.reduce(grads)
        assert_same_on_replicas(results)
        want = exact_sum(grads)
        if step < 2:
            for got, expected in zip(results, want):
                np.testing.assert_array_equal(got[0], expected)
            assert hook.stats().ratio == 1.0
            assert float(hook.compression_ratio()) == 1.0
            # Nothing was approximated: no error to feed back.
            for value in harness.local(hook.state("error_0")):
                assert not value.any()
        else:
            # Rank 1 of a random 64 x 48 matrix: far from the exact sum.
            assert not np.allclose(results[0][0], want[0], atol=0.1)
            np.testing.assert_array_equal(results[1][0], want[1])
            assert hook.stats().sent_bytes == (64 + 48) * 4 + 48 * 4
            assert hook.stats().ratio == pytest.approx((64 * 48 + 48) / (64 + 48 + 48))
            assert float(hook.compression_ratio()) == pytest.approx(
                hook.stats().ratio, rel=1e-6
            )
    assert hook.steps == 3


def test_powersgd_recovers_after_a_zero_gradient(mirrored):
    """A zero step must not leave a zero warm-start Q behind (which would
    make every later approximation zero)."""
    shapes = [(32, 24)]
    hook = PowerSGD(rank=2, start_step=0, error_feedback=False)
    harness = Harness(mirrored(2), hook, shapes)
    harness.reduce([[np.zeros((32, 24), "float32")] for _ in range(2)])
    assert np.any(harness.local(hook.state("q_0"))[0])
    rng = np.random.default_rng(30)
    grads = [[low_rank(32, 24, 1, rng)] for _ in range(2)]
    (got,) = harness.reduce(grads)
    np.testing.assert_allclose(got[0], exact_sum(grads)[0], rtol=1e-4, atol=1e-4)


# --- P and Q in the paper's notation ------------------------------------------


def test_powersgd_p_and_q_follow_the_paper(mirrored):
    """Algorithm 1 of Vogels et al. (2019) and PyTorch's `powerSGD_hook`,
    written out in NumPy with the paper's `n x m` matrix M (`n` the output
    units): P = M Q (n x r), orthogonalise P, Q = M^T P (m x r), the sum is
    approximated by P Q^T, and the warm start keeps Q. A Dense kernel is
    `(in, out)` in Keras, so M is its transpose."""
    fan_in, units, rank = 20, 6, 2
    hook = PowerSGD(rank=rank, start_step=0, error_feedback=False)
    harness = Harness(mirrored(2), hook, [(fan_in, units)])
    (plan,) = hook.matrix_plans
    assert (plan.rows, plan.cols) == (fan_in, units)  # m, n
    q = harness.local(hook.state("q_0"))[0]
    assert q.shape == (fan_in, rank)  # Q is m x r
    grads = random_grads([(fan_in, units)], 2, seed=8)
    matrices = [replica[0].T.astype("float64") for replica in grads]  # n x m
    p = sum(m @ q for m in matrices)  # n x r
    p, _ = np.linalg.qr(p)
    new_q = sum(m.T @ p for m in matrices)  # m x r
    approximation = p @ new_q.T  # n x m
    (got,) = harness.reduce(grads)
    np.testing.assert_allclose(got[0], approximation.T, rtol=1e-4, atol=1e-5)
    kept = harness.local(hook.state("q_0"))[0]
    # QR is unique up to the signs of P's columns, which flip Q's.
    np.testing.assert_allclose(np.abs(kept), np.abs(new_q), rtol=1e-4, atol=1e-5)


# --- Per-replica state --------------------------------------------------------


def test_powersgd_state_is_per_replica_and_accounts_for_what_was_not_sent(mirrored):
    shapes = [(32, 24), (24,)]
    hook = PowerSGD(rank=1, start_step=0)
    harness = Harness(mirrored(2), hook, shapes)
    grads = random_grads(shapes, 2, seed=20)
    results = harness.reduce(grads)
    error = hook.state("error_0")
    q = hook.state("q_0")
    for variable in hook.state_variables:
        assert not variable.trainable
        assert variable.synchronization == tf.VariableSynchronization.ON_READ
    first, second = harness.local(error)
    assert not np.allclose(first, second)
    # Nothing is lost: what the replicas kept is exactly what the sum missed.
    np.testing.assert_allclose(
        first + second, exact_sum(grads)[0] - results[0][0], atol=1e-5
    )
    # The warm-start Q is the same on every replica (shared seed, reduced Q).
    q_first, q_second = harness.local(q)
    np.testing.assert_array_equal(q_first, q_second)
    assert [int(s) for s in harness.local(hook.state("step"))] == [1, 1]


def test_state_checkpoint_keeps_the_residual_total_and_the_shared_q(tmp_path, mirrored):
    shapes = [(32, 24)]
    hook = PowerSGD(rank=1, start_step=0)
    harness = Harness(mirrored(2), hook, shapes)
    harness.reduce(random_grads(shapes, 2, seed=22))
    error, q = hook.state("error_0"), hook.state("q_0")
    errors, q_before = harness.local(error), harness.local(q)[0]
    path = tf.train.Checkpoint(hook=hook).save(str(tmp_path / "ckpt"))

    harness.reduce(random_grads(shapes, 2, seed=23))  # move the state on
    tf.train.Checkpoint(hook=hook).restore(path).assert_consumed()
    # Errors: the sum over replicas is saved and split evenly on restore.
    restored = harness.local(error)
    np.testing.assert_allclose(restored[0], restored[1])
    np.testing.assert_allclose(
        restored[0] + restored[1], errors[0] + errors[1], atol=1e-6
    )
    # Q and the step counter: identical on all replicas, restored as they were.
    for value in harness.local(q):
        np.testing.assert_array_equal(value, q_before)
    assert hook.steps == 1


def test_powersgd_error_that_becomes_non_finite_is_reset(mirrored):
    hook = PowerSGD(rank=1, start_step=0)
    harness = Harness(mirrored(2), hook, [(16, 12)])
    grads = random_grads([(16, 12)], 2, seed=5)
    grads[0][0][3, 4] = np.inf
    harness.reduce(grads)
    for error in harness.local(hook.state("error_0")):
        assert not error.any()
    q = harness.local(hook.state("q_0"))[0]
    assert np.all(np.isfinite(q)) and q.any()  # the previous Q was kept
    grads = random_grads([(16, 12)], 2, seed=6)
    (got,) = harness.reduce(grads)
    assert np.all(np.isfinite(got[0]))


# --- Byte accounting ----------------------------------------------------------


def resnet18_cifar():
    """ResNet-18 for CIFAR-10 as in the PowerSGD paper: 11,173,962 parameters."""
    layers = keras.layers
    inputs = keras.Input((32, 32, 3))
    x = layers.Conv2D(64, 3, padding="same", use_bias=False)(inputs)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    channels = 64
    for stage, filters in enumerate([64, 128, 256, 512]):
        for block in range(2):
            stride = 2 if stage > 0 and block == 0 else 1
            y = layers.Conv2D(
                filters, 3, strides=stride, padding="same", use_bias=False
            )(x)
            y = layers.ReLU()(layers.BatchNormalization()(y))
            y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
            y = layers.BatchNormalization()(y)
            shortcut = x
            if stride != 1 or channels != filters:
                shortcut = layers.Conv2D(filters, 1, strides=stride, use_bias=False)(x)
                shortcut = layers.BatchNormalization()(shortcut)
            x = layers.ReLU()(layers.Add()([y, shortcut]))
            channels = filters
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(10)(x))


def test_powersgd_resnet18_ratios_match_the_paper(monkeypatch):
    model = resnet18_cifar()
    variables = model.trainable_variables
    assert sum(int(np.prod(v.shape)) for v in variables) == 11_173_962
    paper = {1: 243, 2: 136, 4: 72}
    for rank, ratio in paper.items():
        hook = PowerSGD(rank=rank, start_step=0, min_compression_rate=1)
        hook.build(variables)
        stats = hook.stats()
        assert stats.raw_bytes == 11_173_962 * 4
        assert stats.ratio == pytest.approx(ratio, rel=0.02), rank
    # The accounting is what `reduce` hands to the collectives (rank 4, one
    # replica: the payloads still go through the same helpers).
    sent = []
    record_payload(monkeypatch, powersgd_module, "all_reduce_flat", sent)
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=v.shape).astype("float32") * 1e-2 for v in variables]
    reduced = hook.reduce(grads, variables)
    assert sum(sent) == hook.stats().sent_bytes
    assert [tuple(r.shape) for r in reduced] == [tuple(v.shape) for v in variables]
    assert all(bool(tf.reduce_all(tf.math.is_finite(r))) for r in reduced)


# --- Bad input ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"rank": 0}, "rank"),
        ({"rank": -1}, "rank"),
        ({"start_step": -1}, "start_step"),
        ({"min_compression_rate": 0.5}, "min_compression_rate"),
        ({"min_compression_rate": 0}, "min_compression_rate"),
        ({"min_compression_rate": float("inf")}, "min_compression_rate"),
        ({"min_compression_rate": float("nan")}, "min_compression_rate"),
        ({"seed": 2**70}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
    ],
)
def test_powersgd_rejects_bad_arguments(kwargs, argument):
    with pytest.raises(
        ValueError, match=rf"`{argument}` must be .*Received: {argument}="
    ):
        PowerSGD(**kwargs)


def test_powersgd_messages_keep_their_hints():
    with pytest.raises(ValueError, match=r"`rank` must be an int >= 1\..*`rank=2`"):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match=r"`start_step=0` to compress from the first"):
        PowerSGD(start_step=-1)
    # An infinite rate compressed nothing, silently.
    with pytest.raises(
        ValueError,
        match=r"`min_compression_rate` must be a finite number >= 1\. .*Use `1`",
    ):
        PowerSGD(min_compression_rate=float("inf"))
    # A seed beyond int64 used to fail only in `build`, converting it.
    with pytest.raises(
        ValueError, match=r"`seed` must be an int >= -9223372036854775808"
    ):
        PowerSGD(seed=2**70)
    assert PowerSGD(seed=2**63 - 1).seed == 2**63 - 1
