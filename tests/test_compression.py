"""All-reduce hooks: sums on 2 replicas, per-replica state, bytes, bad input, config.

Training with the hooks (DistributedModel, accuracy, multi-worker) is in
`test_compression_training.py`.
"""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import Harness, exact_sum, random_grads

from keras_dist.compression import (
    BF16,
    FP16,
    AllReduceHook,
    CompressionStats,
    NoCompression,
    PowerSGD,
    TopK,
    tensor_bytes,
)
from keras_dist.core import casts as casts_module
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


def assert_same_on_replicas(results):
    for per_replica in results:
        for other in per_replica[1:]:
            np.testing.assert_array_equal(other, per_replica[0])


SHAPES = [(3, 3, 4, 16), (16,), (64, 48), (48,)]


# --- Sums on 2 replicas -------------------------------------------------------


def test_no_compression_is_the_exact_sum(mirrored):
    grads = random_grads(SHAPES, 2)
    results = Harness(mirrored(2), NoCompression(), SHAPES).reduce(grads)
    assert_same_on_replicas(results)
    for got, want in zip(results, exact_sum(grads)):
        np.testing.assert_array_equal(got[0], want)


@pytest.mark.parametrize("hook_class, rtol", [(FP16, 1e-3), (BF16, 8e-3)])
def test_casts_sum_within_half_precision_tolerance(mirrored, hook_class, rtol):
    shapes = [*SHAPES, (5,)]
    dtypes = ["float32"] * len(SHAPES) + ["int32"]
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


def test_topk_ratio_one_is_exact(mirrored):
    grads = random_grads(SHAPES, 2, seed=3)
    hook = TopK(ratio=1.0)
    harness = Harness(mirrored(2), hook, SHAPES)
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


def record_payload(monkeypatch, module, name, sizes):
    """Wraps `module.name` (a collective helper) to add its payload bytes."""
    original = getattr(module, name)

    def recording(*args):
        tensors = [t for arg in args if isinstance(arg, list) for t in arg]
        sizes.append(sum(tensor_bytes(t) for t in tensors))
        return original(*args)

    monkeypatch.setattr(module, name, recording)


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
def test_unsupported_variable_dtypes_are_refused_at_build(hook, dtype):
    variables = [tf.Variable(tf.zeros((4, 4))), tf.Variable(tf.zeros((3,), dtype))]
    with pytest.raises(
        ValueError, match=rf"`variables` must have one of the dtypes.*{dtype}"
    ):
        hook.build(variables)


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
    # NoCompression keeps sparse gradients sparse (as stock Keras does); the
    # compressing hooks densify them.
    with tf.device("/cpu:0"):
        variables = [tf.Variable(tf.zeros((6, 4)))]
    hook.build(variables)
    values = tf.constant(np.arange(8, dtype="float32").reshape(2, 4))
    sparse = tf.IndexedSlices(values, tf.constant([1, 4]), tf.constant([6, 4]))
    (reduced,) = hook.reduce([sparse], variables)
    assert isinstance(reduced, tf.IndexedSlices) == isinstance(hook, NoCompression)
    dense = tf.convert_to_tensor(reduced)
    assert tuple(dense.shape) == (6, 4)
    if isinstance(hook, (NoCompression, FP16, BF16)):
        np.testing.assert_allclose(dense.numpy(), tf.convert_to_tensor(sparse))


def test_no_compression_sums_sparse_gradients_over_replicas(mirrored):
    strategy = mirrored(2)
    with strategy.scope():
        variables = [tf.Variable(tf.zeros((6, 4)))]
        hook = NoCompression()
        hook.build(variables)

    def step():
        ctx = tf.distribute.get_replica_context()
        row = tf.cast(ctx.replica_id_in_sync_group, tf.int64)
        sparse = tf.IndexedSlices(tf.ones((1, 4)), tf.reshape(row, [1]), [6, 4])
        (reduced,) = hook.reduce([sparse], variables)
        assert isinstance(reduced, tf.IndexedSlices)
        return tf.convert_to_tensor(reduced)

    result = strategy.experimental_local_results(strategy.run(tf.function(step)))
    expected = np.zeros((6, 4), "float32")
    expected[:2] = 1.0
    for value in result:
        np.testing.assert_allclose(value.numpy(), expected)


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


# --- Config -------------------------------------------------------------------


@pytest.mark.parametrize("hook", all_hooks(), ids=hook_id)
def test_config_round_trip(hook):
    config = hook.get_config()
    # get_config returns exactly the constructor's arguments.
    assert set(config) == set(inspect.signature(type(hook)).parameters)
    clone = type(hook).from_config(config)
    assert type(clone) is type(hook)
    assert clone.get_config() == config
    serialized = keras.saving.serialize_keras_object(hook)
    assert serialized["registered_name"] == f"keras_dist>{type(hook).__name__}"
    restored = keras.saving.deserialize_keras_object(serialized)
    assert type(restored) is type(hook)
    assert restored.get_config() == config
    assert repr(restored) == repr(hook)


def test_public_names():
    import keras_dist

    for name in ["AllReduceHook", "NoCompression", "FP16", "BF16", "TopK", "PowerSGD"]:
        assert hasattr(keras_dist.compression, name)
        assert name in keras_dist.compression.__all__
