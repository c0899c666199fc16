"""The all-reduce hook protocol (`keras_dist.core.hooks`), across the hooks:
byte accounting, bad input, one hook per model, the state accessor, hook
authors' mistakes, the config.

Each built-in hook's own behaviour is in its module's test file
(`test_plain.py`, `test_casts.py`, `test_topk.py`, `test_powersgd.py`,
`test_dgc.py`); training with the hooks in `test_compression_training.py`;
buckets in `test_buckets.py` and `test_compression_buckets.py`.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import Harness, assert_config_round_trip, record_payload

import keras_dist
from keras_dist.compression import (
    BF16,
    FP16,
    AllReduceHook,
    CompressionStats,
    NoCompression,
    PowerSGD,
    TopK,
)
from keras_dist.core import plain as plain_module
from keras_dist.core import powersgd as powersgd_module
from keras_dist.core import topk as topk_module


def all_hooks():
    return [
        NoCompression(),
        FP16(),
        BF16(),
        TopK(),
        TopK(ratio=0.5, error_feedback=False),
        PowerSGD(),
        PowerSGD(
            rank=4,
            start_step=0,
            min_compression_rate=1.5,
            error_feedback=False,
            warm_start=False,
            seed=7,
        ),
    ]


def hook_id(hook):
    return repr(hook)


# --- Byte accounting ----------------------------------------------------------


@pytest.mark.parametrize(
    "hook, module, helpers",
    [
        (NoCompression(), plain_module, ["all_reduce_sum"]),
        (TopK(ratio=0.1), topk_module, ["all_gather_pairs", "all_reduce_sum"]),
        (PowerSGD(rank=2, start_step=0), powersgd_module, ["all_reduce_flat"]),
    ],
    ids=hook_id,
)
def test_stats_count_what_reduce_sends(monkeypatch, hook, module, helpers):
    shapes = [(3, 3, 4, 16), (16,), (64, 48), (5,)]
    dtypes = ["float32", "float32", "float32", "int32"]
    with tf.device("/cpu:0"):
        variables = [tf.Variable(tf.zeros(s, d)) for s, d in zip(shapes, dtypes)]
    hook.build(variables)
    sent = []
    for helper in helpers:
        record_payload(monkeypatch, module, helper, sent)
    grads = [tf.ones(s, d) for s, d in zip(shapes, dtypes)]
    hook.reduce(grads, variables)
    stats = hook.stats()
    assert isinstance(stats, CompressionStats)
    assert stats.raw_bytes == sum(int(np.prod(s)) * 4 for s in shapes)
    assert sum(sent) == stats.sent_bytes
    assert stats.ratio == stats.raw_bytes / stats.sent_bytes
    # The hook can report on a subset (Keras drops `None` gradients).
    hook.reduce(grads[2:], variables[2:])
    assert hook.stats().raw_bytes == (64 * 48 + 5) * 4


def test_stats_of_known_ratios():
    variables = [tf.Variable(tf.zeros((100, 100)))]
    expected = [
        (NoCompression(), 1.0),
        (FP16(), 2.0),
        (BF16(), 2.0),
        (TopK(ratio=0.01), 50.0),  # 100 of 10,000 entries, each value + index
        (PowerSGD(rank=2, start_step=0), 10_000 / 400),
    ]
    for hook, ratio in expected:
        hook.build(variables)
        assert hook.stats().ratio == pytest.approx(ratio)
        assert float(hook.compression_ratio()) == pytest.approx(ratio)


# --- Bad input ----------------------------------------------------------------


def test_hooks_accept_numpy_scalars():
    top_k = TopK(ratio=np.float32(0.01), error_feedback=np.bool_(False))
    assert type(top_k.ratio) is float and top_k.ratio == pytest.approx(0.01)
    assert top_k.error_feedback is False
    power = PowerSGD(
        rank=np.int64(2),
        start_step=np.int32(0),
        min_compression_rate=np.float64(1.5),
        seed=np.int64(7),
    )
    assert (power.rank, power.start_step, power.seed) == (2, 0, 7)
    assert type(power.rank) is int and type(power.seed) is int
    assert power.get_config()["min_compression_rate"] == 1.5


@pytest.mark.parametrize(
    "factory, argument",
    [
        (lambda: TopK(error_feedback="yes"), "error_feedback"),
        (lambda: PowerSGD(error_feedback=1), "error_feedback"),
        (lambda: PowerSGD(warm_start=None), "warm_start"),
        (lambda: PowerSGD(seed=1.5), "seed"),
        (lambda: PowerSGD(rank=1.5), "rank"),
        (lambda: PowerSGD(rank=True), "rank"),
        (lambda: PowerSGD(start_step=0.5), "start_step"),
        (lambda: PowerSGD(min_compression_rate="2"), "min_compression_rate"),
    ],
)
def test_type_errors_name_the_argument(factory, argument):
    with pytest.raises(
        TypeError, match=rf"`{argument}` must be .*Received: {argument}="
    ):
        factory()


@pytest.mark.parametrize("hook", all_hooks(), ids=hook_id)
@pytest.mark.parametrize("dtype", ["complex64", "int8", "bool"])
def test_unsupported_variable_dtypes_are_refused_at_build(mirrored, hook, dtype):
    # A fresh instance per case: the parametrized one is shared by the dtypes.
    hook = type(hook).from_config(hook.get_config())
    with mirrored(2).scope():
        variables = [
            tf.Variable(tf.zeros((4, 4))),
            tf.Variable(tf.zeros((3,), dtype)),
        ]
        with pytest.raises(
            ValueError, match=rf"`variables` must have one of the dtypes.*{dtype}"
        ):
            hook.build(variables)


@pytest.mark.parametrize("hook", all_hooks(), ids=hook_id)
def test_any_variable_dtype_builds_on_one_replica(hook):
    # Nothing is summed over a wire with one replica (Keras's own optimizer
    # tests train complex variables): the dtype check waits for a second one.
    hook = type(hook).from_config(hook.get_config())
    variables = [
        tf.Variable(tf.zeros((4, 4))),
        tf.Variable(tf.zeros((3,), "complex64")),
    ]
    hook.build(variables)
    assert hook.built


@pytest.mark.parametrize("hook", all_hooks(), ids=hook_id)
def test_unsupported_gradient_dtypes_fail_before_any_collective(mirrored, hook):
    harness = Harness(mirrored(2), hook, [(4, 4)])
    grads = [[np.zeros((4, 4), "complex64")] for _ in range(2)]
    with pytest.raises(
        ValueError, match=r"`gradients` must have one of the dtypes.*complex64"
    ):
        harness.reduce(grads)


def test_reduce_checks_shapes_and_variables():
    hook = NoCompression()
    variables = [tf.Variable(tf.zeros((2, 2)))]
    with pytest.raises(RuntimeError, match="must be built before `reduce`"):
        hook.reduce([tf.zeros((2, 2))], variables)
    with pytest.raises(RuntimeError, match="no statistics before `build`"):
        hook.stats()
    hook.build(variables)
    with pytest.raises(ValueError, match=r"must have the shape of its variable"):
        hook.reduce([tf.zeros((2, 3))], variables)
    with pytest.raises(ValueError, match="same length"):
        hook.reduce([tf.zeros((2, 2))], [])
    with pytest.raises(ValueError, match="must be among the 1 variables"):
        hook.reduce([tf.zeros((3,))], [tf.Variable(tf.zeros((3,)), name="other")])
    with pytest.raises(RuntimeError, match="already built"):
        hook.build(variables)


@pytest.mark.parametrize("hook", all_hooks(), ids=hook_id)
def test_indexed_slices_gradients(hook):
    # NoCompression and the casts keep sparse gradients sparse (as stock
    # Keras does); the other compressing hooks densify them.
    with tf.device("/cpu:0"):
        variables = [tf.Variable(tf.zeros((6, 4)))]
    hook.build(variables)
    values = tf.constant(np.arange(8, dtype="float32").reshape(2, 4))
    sparse = tf.IndexedSlices(values, tf.constant([1, 4]), tf.constant([6, 4]))
    (reduced,) = hook.reduce([sparse], variables)
    assert isinstance(reduced, tf.IndexedSlices) == isinstance(
        hook, (NoCompression, FP16, BF16)
    )
    dense = tf.convert_to_tensor(reduced)
    assert tuple(dense.shape) == (6, 4)
    if isinstance(hook, (NoCompression, FP16, BF16)):
        np.testing.assert_allclose(dense.numpy(), tf.convert_to_tensor(sparse))


def test_gradient_dtype_must_match_its_variable():
    hook = NoCompression()
    variables = [tf.Variable(tf.zeros((2,)))]
    hook.build(variables)
    with pytest.raises(ValueError, match="must have the dtype of its variable"):
        hook.reduce([tf.zeros((2,), "float64")], variables)


def test_add_state_checks_its_arguments():
    hook = AllReduceHook()
    hook.add_state("a", (2,), "float32")
    with pytest.raises(ValueError, match="`name` must be unique"):
        hook.add_state("a", (2,), "float32")
    with pytest.raises(ValueError, match="`aggregation` must be one of"):
        hook.add_state("b", (2,), "float32", aggregation="mean")


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


def test_state_accessor(tmp_path):
    hook = TopK(ratio=0.5)
    with pytest.raises(RuntimeError, match="no state before `build`"):
        hook.state("residual_0")
    hook.build([tf.Variable(tf.zeros((4,))), tf.Variable(tf.zeros((2,), "int32"))])
    assert hook.state_names == ("residual_0",)
    assert hook.state("residual_0") is hook.state_variables[0]
    with pytest.raises(KeyError, match=r"no state named 'residual_1'.*'residual_0'"):
        hook.state("residual_1")
    # The checkpoint keys are the state names.
    path = tf.train.Checkpoint(hook=hook).save(str(tmp_path / "ckpt"))
    keys = [name for name, _ in tf.train.list_variables(path)]
    assert any(key.startswith("hook/_state/residual_0/") for key in keys)


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


# --- Config -------------------------------------------------------------------


@pytest.mark.parametrize("hook", all_hooks(), ids=hook_id)
def test_config_round_trip(hook):
    # get_config returns exactly the constructor's arguments; the registered
    # name is `keras_dist>ClassName`.
    restored = assert_config_round_trip(hook)
    assert repr(restored) == repr(hook)


def test_public_names():
    for name in ["AllReduceHook", "NoCompression", "FP16", "BF16", "TopK", "PowerSGD"]:
        assert hasattr(keras_dist.compression, name)
        assert name in keras_dist.compression.__all__
