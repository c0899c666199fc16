"""FP16 and BF16 (`keras_dist.core.casts`): sums within half precision, one
replica, byte accounting, and sums beyond float16's range.

What every hook shares (bad input, sparse gradients, the config) is in
`test_hooks.py`; training with the casts in `test_compression_training.py`.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    LAYER_SHAPES,
    Harness,
    assert_same_on_replicas,
    exact_sum,
    random_grads,
    record_payload,
)

import keras_dist
from keras_dist.compression import BF16, FP16, NoCompression
from keras_dist.core import casts as casts_module

# --- Sums ---------------------------------------------------------------------


@pytest.mark.parametrize("hook_class, rtol", [(FP16, 1e-3), (BF16, 8e-3)])
def test_casts_sum_within_half_precision_tolerance(mirrored, hook_class, rtol):
    shapes = [*LAYER_SHAPES, (5,)]
    dtypes = ["float32"] * len(LAYER_SHAPES) + ["int32"]
    grads = random_grads(shapes[:-1], 2)
    grads[0].append(np.arange(5, dtype="int32"))
    grads[1].append(np.arange(5, dtype="int32") * 1000)
    results = Harness(mirrored(2), hook_class(), shapes, dtypes).reduce(grads)
    assert_same_on_replicas(results)
    want = exact_sum(grads)
    for got, expected in zip(results[:-1], want[:-1]):
        assert got[0].dtype == np.float32
        # Relative to the largest entry: float16/bfloat16 rounding of each
        # replica's half of the sum.
        scale = np.max(np.abs(expected))
        assert np.max(np.abs(got[0] - expected)) <= rtol * scale
    # Integer gradients pass through uncompressed, exactly.
    assert results[-1][0].dtype == np.int32
    np.testing.assert_array_equal(results[-1][0], want[-1])


@pytest.mark.parametrize("hook_class", [FP16, BF16])
def test_casts_on_one_replica_pass_through_with_ratio_one(mirrored, hook_class):
    # Nothing crosses a wire with one replica: no cast, no precision lost,
    # and no claim of bytes saved (issue 18).
    grads = [[np.full((4,), 1.0 + 2.0**-20, "float32")]]
    hook = hook_class()
    (got,) = Harness(mirrored(1), hook, [(4,)]).reduce(grads)
    np.testing.assert_array_equal(got[0], grads[0][0])
    assert hook.stats().ratio == 1.0
    assert float(hook.compression_ratio()) == 1.0
    # With two replicas the same hook class halves the bytes.
    two = hook_class()
    Harness(mirrored(2), two, [(4,)]).reduce(random_grads([(4,)], 2))
    assert two.stats().ratio == 2.0


def test_fp16_divides_before_the_sum_so_it_cannot_overflow(mirrored):
    # Each replica's 60000 fits in float16 (max 65504), their sum does not.
    grads = [[np.full((4,), 60000.0, "float32")] for _ in range(2)]
    (got,) = Harness(mirrored(2), FP16(), [(4,)]).reduce(grads)
    np.testing.assert_allclose(got[0], 120000.0, rtol=1e-3)


@pytest.mark.parametrize("hook_class", [FP16, BF16])
def test_cast_stats_count_what_reduce_sends(monkeypatch, mirrored, hook_class):
    # On two replicas: with one, a cast hook sends nothing (ratio 1.0).
    shapes = [(3, 3, 4, 16), (16,), (64, 48), (5,)]
    dtypes = ["float32", "float32", "float32", "int32"]
    sent = []
    record_payload(monkeypatch, casts_module, "all_reduce_sum", sent)
    hook = hook_class()
    harness = Harness(mirrored(2), hook, shapes, dtypes)
    harness.reduce([[np.ones(s, d) for s, d in zip(shapes, dtypes)]] * 2)
    stats = hook.stats()
    assert stats.raw_bytes == sum(int(np.prod(s)) * 4 for s in shapes)
    # Each of the two replicas traced its payload first; the full-size resend
    # of an overflowed step is traced after it (a `tf.cond` branch).
    assert sent[:2] == [stats.sent_bytes] * 2
    assert stats.ratio == stats.raw_bytes / stats.sent_bytes


# --- FP16: sums beyond float16's range ----------------------------------------


def test_fp16_sum_beyond_float16_range_is_sent_again_in_float32(mirrored):
    shapes = [(4, 3), (3,)]
    hook = FP16()
    harness = Harness(mirrored(2), hook, shapes)
    grads = random_grads(shapes, 2, seed=1)
    results = harness.reduce(grads)
    assert hook.overflow_steps == 0
    assert hook.stats().ratio == 2.0
    # Each replica's gradient fits float32 but not float16 (after / 2).
    grads = [[g * 1e6 for g in replica] for replica in random_grads(shapes, 2, seed=2)]
    results = harness.reduce(grads)
    for got, want in zip(results, exact_sum(grads)):
        for replica in got:  # the float32 sum, not float16's inf
            np.testing.assert_array_equal(replica, want)
    assert hook.overflow_steps == 1
    raw = (12 + 3) * 4
    assert hook.stats().raw_bytes == raw
    assert hook.stats().sent_bytes == raw // 2 + raw  # the half sum, then all
    assert float(hook.compression_ratio()) == pytest.approx(raw / (raw // 2 + raw))
    # The next ordinary step is back to float16.
    grads = random_grads(shapes, 2, seed=3)
    results = harness.reduce(grads)
    for got, want in zip(results, exact_sum(grads)):
        np.testing.assert_allclose(got[0], want, rtol=1e-3, atol=1e-3)
    assert hook.overflow_steps == 1
    assert hook.stats().ratio == 2.0
    assert float(hook.compression_ratio()) == 2.0
    assert hook.state_names == ("overflow_steps", "overflowed")


def test_fp16_keeps_non_finite_gradients_non_finite(mirrored):
    """A loss-scale overflow must still reach the LossScaleOptimizer."""
    hook = FP16()
    harness = Harness(mirrored(2), hook, [(3,)])
    grads = [[np.array([1.0, np.inf, 2.0], "float32")], [np.ones(3, "float32")]]
    (got,) = harness.reduce(grads)
    assert np.isinf(got[0][1])
    np.testing.assert_array_equal(got[0][[0, 2]], [2.0, 3.0])


def test_bf16_and_16_bit_gradients_need_no_range_check():
    """bfloat16 has float32's exponent range; float16 gradients travel as
    they are: neither hook keeps overflow state for them."""
    variables = [tf.Variable(tf.zeros((2,))), tf.Variable(tf.zeros((2,), "float16"))]
    bf16 = BF16()
    bf16.build(variables)
    assert bf16.state_names == () and bf16.overflow_steps == 0
    fp16 = FP16()
    fp16.build(variables[1:])
    assert fp16.state_names == ()
    bf16_64 = BF16()
    bf16_64.build([tf.Variable(tf.zeros((2,), "float64"))])
    assert bf16_64.state_names == ("overflow_steps", "overflowed")


def _fit_on_huge_targets(strategy, hook):
    """A DistributedModel under `strategy` whose gradients exceed float16's range."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(64, 8)).astype("float32")
    y = np.full((64, 1), 1e6, "float32")
    with strategy.scope():
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16)(inputs)
        model = keras_dist.DistributedModel(
            inputs, keras.layers.Dense(1)(hidden), all_reduce_hook=hook
        )
        model.compile(keras.optimizers.SGD(1e-8), "mse")
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model, history


def test_fp16_training_on_targets_of_1e6_stays_finite(mirrored):
    """Gradients near 1e7: float16 alone overflowed to inf and NaN weights."""
    reference, _ = _fit_on_huge_targets(mirrored(2), NoCompression())
    assert all(np.all(np.isfinite(w)) for w in reference.get_weights())
    hook = FP16()
    model, history = _fit_on_huge_targets(mirrored(2), hook)
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert np.all(np.isfinite(history.history["loss"]))
    assert hook.overflow_steps == 8  # every step was sent again in float32
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert history.history["compression_ratio"][-1] == pytest.approx(2 / 3)
