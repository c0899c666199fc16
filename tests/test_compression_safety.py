"""Hooks that fail loudly or not at all: FP16 range, non-finite residuals,
one hook per model, the state accessor, hook authors' mistakes, and
PowerSGD's P and Q in the paper's convention.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import Harness, exact_sum, random_grads

import keras_dist
from keras_dist.compression import (
    BF16,
    FP16,
    AllReduceHook,
    NoCompression,
    PowerSGD,
    TopK,
)

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


# --- Non-finite error-feedback residuals --------------------------------------


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


# --- One hook, one model ------------------------------------------------------


def _named_model(hook):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="hidden")(inputs)
    outputs = keras.layers.Dense(1, name="out")(hidden)
    return keras_dist.DistributedModel(inputs, outputs, all_reduce_hook=hook)


@pytest.mark.parametrize("hook", [TopK(ratio=0.5), PowerSGD(rank=1, start_step=0)])
def test_one_hook_on_two_models_with_the_same_layer_names_fails(hook, mirrored):
    x = np.ones((8, 4), "float32")
    y = np.ones((8, 1), "float32")
    strategy = mirrored(2)
    with strategy.scope():
        first = _named_model(hook)
        first.compile("sgd", "mse")
        second = _named_model(hook)
        second.compile("sgd", "mse")
    assert [v.path for v in first.trainable_variables] == [
        v.path for v in second.trainable_variables
    ]
    first.fit(x, y, batch_size=4, verbose=0)
    with pytest.raises(RuntimeError, match=r"(?i)give each model its own hook"):
        second.fit(x, y, batch_size=4, verbose=0)
    assert not any(hook.knows(v) for v in second.trainable_variables)
    with pytest.raises(ValueError, match="knows variables by object"):
        hook.variable_index(second.trainable_variables[0])


def test_same_name_variables_are_told_apart():
    hook = TopK(ratio=0.5)
    mine = [tf.Variable(tf.zeros((4,)), name="kernel")]
    other = [tf.Variable(tf.zeros((4,)), name="kernel")]
    hook.build(mine)
    assert hook.knows(mine[0]) and not hook.knows(other[0])
    with pytest.raises(RuntimeError, match=r"same names.*own hook instance"):
        hook.rebuild(other)


def test_custom_loop_and_checkpoint_restore_use_the_models_own_variables(
    tmp_path, mirrored
):
    """The variables `apply_gradients` sees in replica context are the ones
    the hook was built for (no name matching needed), and a restored model
    builds its own hook on its own variables."""
    x = np.random.default_rng(7).normal(size=(16, 4)).astype("float32")
    y = np.ones((16, 1), "float32")
    strategy = mirrored(2)

    def make():
        with strategy.scope():
            model = _named_model(TopK(ratio=0.5))
            model.compile(keras.optimizers.SGD(0.01), "mse")
            model.build_all_reduce_hook()
        return model

    model = make()

    @tf.function
    def step(xb, yb):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum((model(xb) - yb) ** 2) / 8
            variables = model.trainable_variables
            model.apply_gradients(tape.gradient(loss, variables), variables)

        strategy.run(replica_step, (xb, yb))

    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    for xb, yb in strategy.experimental_distribute_dataset(data):
        step(xb, yb)
    assert model.all_reduce_hook.state("residual_0").numpy().any()
    path = tf.train.Checkpoint(model=model, hook=model.all_reduce_hook).save(
        str(tmp_path / "ckpt")
    )
    restored = make()
    tf.train.Checkpoint(model=restored, hook=restored.all_reduce_hook).restore(
        path
    ).assert_consumed()
    np.testing.assert_allclose(
        restored.all_reduce_hook.state("residual_0").numpy(),
        model.all_reduce_hook.state("residual_0").numpy(),
    )
    restored.fit(x, y, batch_size=8, verbose=0)


def test_stateless_hook_rebuilds_and_keeps_its_counters():
    hook = FP16()
    first = [tf.Variable(tf.zeros((2,)))]
    hook.build(first)
    counter = hook.state("overflow_steps")
    counter.assign(3)
    grown = [*first, tf.Variable(tf.zeros((3,)))]
    hook.rebuild(grown)
    assert hook.knows(grown[1])
    assert hook.state("overflow_steps") is counter
    assert hook.overflow_steps == 3


# --- The state accessor and hook authors' mistakes ----------------------------


def test_state_accessor():
    hook = TopK(ratio=0.5)
    with pytest.raises(RuntimeError, match="no state before `build`"):
        hook.state("residual_0")
    hook.build([tf.Variable(tf.zeros((4,))), tf.Variable(tf.zeros((2,), "int32"))])
    assert hook.state_names == ("residual_0",)
    assert hook.state("residual_0") is hook.state_variables[0]
    with pytest.raises(KeyError, match=r"no state named 'residual_1'.*'residual_0'"):
        hook.state("residual_1")
    # The checkpoint keys are the state names.
    keys = [name for name, _ in tf.train.list_variables(_save(hook))]
    assert any(key.startswith("hook/_state/residual_0/") for key in keys)


def _save(hook):
    import tempfile

    directory = tempfile.mkdtemp()
    return tf.train.Checkpoint(hook=hook).save(f"{directory}/ckpt")


def test_add_state_per_variable_false_is_idempotent_only_when_it_matches():
    hook = AllReduceHook()
    counter = hook.add_state("calls", (), "int64", per_variable=False)
    assert hook.add_state("calls", (), "int64", per_variable=False) is counter
    with pytest.raises(ValueError, match="`name` must be unique"):
        hook.add_state("calls", (2,), "int64", per_variable=False)


class ForgetfulHook(AllReduceHook):
    def __init__(self, scale=1.0):
        self.scale = scale  # no super().__init__()

    def reduce(self, gradients, variables):
        return gradients


class EagerHook(AllReduceHook):
    def __init__(self):
        self.built_before_init = self.built  # uses the base before its init
        super().__init__()


def test_a_subclass_that_forgets_super_init_gets_a_clear_error():
    with pytest.raises(
        RuntimeError,
        match=r"`ForgetfulHook.__init__` must call `super\(\).__init__\(\)`",
    ):
        ForgetfulHook()
    with pytest.raises(AttributeError, match=r"must call `super\(\).__init__\(\)`"):
        EagerHook()


def test_subclass_of_a_builtin_hook_is_checked_at_its_own_level():
    class Good(TopK):
        def __init__(self, ratio=0.1, error_feedback=True):
            super().__init__(ratio=ratio, error_feedback=error_feedback)

    class Bad(TopK):
        def __init__(self, ratio=0.1, error_feedback=True):
            self.ratio = ratio

    assert Good().ratio == 0.1
    with pytest.raises(RuntimeError, match=r"`Bad\.__init__` must call"):
        Bad()


# --- PowerSGD in the paper's notation -----------------------------------------


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
