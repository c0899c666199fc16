"""Deep Gradient Compression: the update against NumPy, state, training."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
import workers
from helpers import (
    Harness,
    assert_config_round_trip,
    compile_model,
    make_data,
    max_abs_diff,
    mlp,
    random_grads,
)

import keras_dist
from keras_dist.compression import DGC
from keras_dist.testing import run_workers

BATCH = 16


# --- The update against a NumPy reference ---------------------------------------


def reference_dgc(steps, densities, momentum, clipnorm=None, nesterov=False):
    """DGC in NumPy (float32), straight from the paper's Algorithm 1.

    `steps[t][r]` lists replica `r`'s gradients at step `t`. Returns each
    step's summed result and the final per-replica `(u, v)`.
    """
    replicas = len(steps[0])
    shapes = [g.shape for g in steps[0][0]]
    u = [[np.zeros(s, "float32") for s in shapes] for _ in range(replicas)]
    v = [[np.zeros(s, "float32") for s in shapes] for _ in range(replicas)]
    results = []
    for grads, density in zip(steps, densities):
        total = [np.zeros(s, "float32") for s in shapes]
        for r in range(replicas):
            g = [x.astype("float32") for x in grads[r]]
            if clipnorm is not None:
                threshold = np.float32(clipnorm / math.sqrt(replicas))
                norm = np.sqrt(sum(np.sum(np.square(x)) for x in g))
                g = [x * (threshold / max(norm, threshold)) for x in g]
            for t, gt in enumerate(g):
                if nesterov:
                    u[r][t] = np.float32(momentum) * (u[r][t] + gt)
                    v[r][t] = v[r][t] + u[r][t] + gt
                else:
                    u[r][t] = np.float32(momentum) * u[r][t] + gt
                    v[r][t] = v[r][t] + u[r][t]
                n = v[r][t].size
                k = min(n, max(1, math.ceil(density * n)))
                flat_v = v[r][t].reshape(-1)
                top = np.argsort(-np.abs(flat_v), kind="stable")[:k]
                total[t].reshape(-1)[top] += flat_v[top]
                flat_v[top] = 0
                u[r][t].reshape(-1)[top] = 0
        results.append(total)
    return results, u, v


SHAPES = [(10, 10), (7,)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ratio": 0.05, "momentum": 0.9, "warmup_steps": 0},
        {"ratio": 0.05, "momentum": 0.9, "warmup_steps": 0, "nesterov": True},
        {"ratio": 0.05, "momentum": 0.5, "warmup_steps": 0, "clipnorm": 1.0},
        {"ratio": 0.01, "momentum": 0.9, "warmup_steps": 4},
        {"ratio": 0.01, "momentum": 0.9, "warmup_steps": 4, "clipnorm": 2.0},
    ],
    ids=["momentum", "nesterov", "clipping", "warmup", "warmup-clipping"],
)
def test_update_matches_numpy_reference(kwargs, mirrored):
    """Six steps on 2 replicas: every step's sum and the final per-replica
    velocity and accumulation equal the NumPy reference (momentum
    correction, masking, clipping, warm-up, Nesterov)."""
    hook = DGC(**kwargs)
    harness = Harness(mirrored(2), hook, SHAPES)
    steps = [random_grads(SHAPES, 2, seed=100 + t) for t in range(6)]
    densities = [hook.density_at(t) for t in range(6)]
    expected, u, v = reference_dgc(
        steps,
        densities,
        kwargs["momentum"],
        kwargs.get("clipnorm"),
        kwargs.get("nesterov", False),
    )
    for t, grads in enumerate(steps):
        got = harness.reduce(grads)
        for tensor, want in zip(got, expected[t]):
            for replica_result in tensor:  # every replica gets the same sum
                np.testing.assert_allclose(replica_result, want, rtol=1e-5, atol=1e-6)
    for index in range(len(SHAPES)):
        velocities = harness.local(hook.state(f"velocity_{index}"))
        accumulations = harness.local(hook.state(f"accumulation_{index}"))
        for r in range(2):
            np.testing.assert_allclose(velocities[r], u[r][index], atol=1e-5)
            np.testing.assert_allclose(accumulations[r], v[r][index], atol=1e-5)
    assert hook.steps == 6


def test_clipping_and_masking_take_effect(mirrored):
    """The reference test's cases would pass with a no-op clip if no norm
    reached the threshold: here every norm does, and masking zeroes the sent
    entries of both u and v."""
    hook = DGC(ratio=0.1, momentum=0.9, clipnorm=0.5, warmup_steps=0)
    harness = Harness(mirrored(2), hook, [(20,)])
    grads = random_grads([(20,)], 2, seed=3)
    (got,) = harness.reduce(grads)
    threshold = 0.5 / math.sqrt(2)
    for r in range(2):
        assert np.linalg.norm(grads[r][0]) > threshold
    # 2 entries per replica, each at most the clipped norm.
    assert np.count_nonzero(got[0]) <= 4
    assert np.linalg.norm(got[0]) <= 2 * threshold + 1e-6
    u = harness.local(hook.state("velocity_0"))
    v = harness.local(hook.state("accumulation_0"))
    for r in range(2):
        assert np.count_nonzero(u[r]) == 18 and np.count_nonzero(v[r]) == 18
        np.testing.assert_array_equal(u[r] == 0, v[r] == 0)
        # The first step's u is the clipped gradient: norm at the threshold.
        sent = grads[r][0] * threshold / np.linalg.norm(grads[r][0])
        np.testing.assert_allclose(u[r], np.where(u[r] == 0, 0, sent), atol=1e-6)


def test_a_step_that_is_not_finite_leaves_the_state_unchanged(mirrored):
    """A loss-scale overflow on one replica makes the sum non-finite on
    every replica (the LossScaleOptimizer skips that step): both replicas
    keep their state as it was, so nothing is lost or applied twice."""
    hook = DGC(ratio=0.2, warmup_steps=0)
    harness = Harness(mirrored(2), hook, [(10,)])
    harness.reduce(random_grads([(10,)], 2, seed=50))
    names = ("velocity_0", "accumulation_0")
    before = {name: harness.local(hook.state(name)) for name in names}
    grads = random_grads([(10,)], 2, seed=51)
    grads[0][0][3] = np.inf
    (got,) = harness.reduce(grads)
    assert not np.all(np.isfinite(got[1]))
    for name in names:
        for now, then in zip(harness.local(hook.state(name)), before[name]):
            np.testing.assert_array_equal(now, then)
    assert hook.steps == 2


def test_warmup_schedule_is_the_papers():
    hook = DGC(ratio=0.001, warmup_steps=400)
    assert hook.warmup_schedule == (
        (0, 0.25),
        (100, 0.0625),
        (200, 0.015625),
        (300, 0.00390625),
        (400, 0.001),
    )
    assert [hook.density_at(s) for s in (0, 99, 100, 399, 400, 10**6)] == [
        0.25,
        0.25,
        0.0625,
        0.00390625,
        0.001,
        0.001,
    ]
    assert DGC(ratio=0.5, warmup_steps=400).warmup_schedule == ((0, 0.5),)
    assert DGC(ratio=0.001, warmup_steps=0).warmup_schedule == ((0, 0.001),)
    # Fewer steps than stages: stages of no length are dropped.
    assert DGC(ratio=0.001, warmup_steps=2).warmup_schedule == (
        (0, 0.0625),
        (1, 0.00390625),
        (2, 0.001),
    )


def test_bytes_follow_the_warmup(mirrored):
    hook = DGC(ratio=0.01, warmup_steps=4)
    harness = Harness(mirrored(2), hook, [(100, 100)])
    raw = 100 * 100 * 4
    ratios = []
    for t in range(6):
        harness.reduce(random_grads([(100, 100)], 2, seed=t))
        ratios.append(hook.stats().ratio)
        assert float(hook.compression_ratio()) == pytest.approx(ratios[-1])
    # Densities 0.25, 0.0625, 0.015625, 0.015625, 0.01, 0.01; 8 bytes an entry.
    expected = [
        raw / (math.ceil(d * 10_000) * 8)
        for d in (0.25, 0.0625, 0.015625, 0.015625, 0.01, 0.01)
    ]
    assert ratios == pytest.approx(expected)
    assert hook.sent_bytes([0]) == 100 * 8


def test_16_and_64_bit_gradients_in_the_warmup(mirrored):
    """The warm-up's `k` is known only when the step runs: an odd number of
    bfloat16 entries (padded to int32 words) and float64 ones travel in the
    same all-gather. Integer-valued gradients keep bfloat16 exact."""
    hook = DGC(ratio=0.2, momentum=0.5, warmup_steps=2)
    assert hook.warmup_schedule == ((0, 0.25), (2, 0.2))
    shapes = [(9,), (5,)]
    harness = Harness(mirrored(2), hook, shapes, ["bfloat16", "float64"])
    rng = np.random.default_rng(9)
    grads = [
        [
            (rng.permutation(9) + 1) * rng.choice([-1, 1], 9),
            (rng.permutation(5) + 1) * rng.choice([-1, 1], 5),
        ]
        for _ in range(2)
    ]
    grads = [[g[0].astype("float32"), g[1].astype("float64")] for g in grads]
    expected, _, _ = reference_dgc(
        [[[g.astype("float64") for g in r] for r in grads]], [0.25], 0.5
    )
    bf16 = tf.bfloat16.as_numpy_dtype
    got = harness.reduce([[g[0].astype(bf16), g[1]] for g in grads])
    for tensor, want in zip(got, expected[0]):
        for replica_result in tensor:
            np.testing.assert_array_equal(replica_result.astype("float64"), want)
    # k = 3 of 9 and 2 of 5 per replica (the replicas' entries may overlap).
    for tensor, k in zip(got, (3, 2)):
        assert k <= np.count_nonzero(tensor[0]) <= 2 * k


def test_state_is_per_replica_and_not_trainable(mirrored):
    hook = DGC(ratio=0.1, warmup_steps=0)
    harness = Harness(mirrored(2), hook, [(10, 10)], ["float32"])
    harness.reduce(random_grads([(10, 10)], 2, seed=5))
    assert hook.state_names == ("step", "velocity_0", "accumulation_0")
    for name in ("velocity_0", "accumulation_0"):
        state = hook.state(name)
        assert not state.trainable
        assert state.synchronization == tf.VariableSynchronization.ON_READ
        first, second = harness.local(state)
        assert not np.allclose(first, second)


def test_integer_gradients_are_summed_exactly(mirrored):
    hook = DGC(ratio=0.1, warmup_steps=0)
    shapes = [(4,), (3,)]
    harness = Harness(mirrored(2), hook, shapes, ["float32", "int32"])
    grads = [
        [np.ones(4, "float32"), np.array([1, 2, 3], "int32")],
        [np.ones(4, "float32"), np.array([10, 20, 30], "int32")],
    ]
    _, ints = harness.reduce(grads)
    np.testing.assert_array_equal(ints[0], [11, 22, 33])
    assert hook.state_names == ("step", "velocity_0", "accumulation_0")


# --- Checkpoints ------------------------------------------------------------------


def test_checkpoint_keeps_the_state_totals_and_the_step(tmp_path, mirrored):
    shapes = [(8, 6)]
    hook = DGC(ratio=0.1, warmup_steps=10)
    harness = Harness(mirrored(2), hook, shapes)
    for t in range(3):
        harness.reduce(random_grads(shapes, 2, seed=30 + t))
    before = {
        name: harness.local(hook.state(name))
        for name in ("velocity_0", "accumulation_0")
    }
    path = tf.train.Checkpoint(hook=hook).save(str(tmp_path / "ckpt"))
    harness.reduce(random_grads(shapes, 2, seed=40))  # move the state on
    tf.train.Checkpoint(hook=hook).restore(path).assert_consumed()
    for name, (first, second) in before.items():
        restored = harness.local(hook.state(name))
        np.testing.assert_allclose(restored[0], restored[1])
        np.testing.assert_allclose(restored[0] + restored[1], first + second, atol=1e-6)
    assert hook.steps == 3  # the warm-up goes on where it was


def _dgc_model(strategy, hook=None, optimizer=None):
    """A compiled MLP with `hook`; `optimizer` is a factory (called under
    the strategy's scope), SGD(0.1) by default."""
    with strategy.scope():
        model = compile_model(
            mlp(keras_dist.DistributedModel),
            optimizer() if optimizer else keras.optimizers.SGD(0.1),
        )
        model.register_all_reduce_hook(hook or DGC(ratio=0.1, warmup_steps=4))
    return model


def test_state_is_saved_with_the_model_file_and_weights(tmp_path, mirrored):
    x, y = make_data()
    model = _dgc_model(mirrored(2))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    hook = model.all_reduce_hook
    saved = [v.numpy() for v in hook.state_variables]  # sums over replicas
    assert int(saved[0]) == 4 and all(np.any(s) for s in saved[1:])

    path = tmp_path / "dgc.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.all_reduce_hook, DGC)
    assert loaded.all_reduce_hook.get_config() == hook.get_config()
    for a, b in zip(saved, loaded.all_reduce_hook.state_variables):
        np.testing.assert_allclose(a, b.numpy(), atol=1e-6)

    weights = tmp_path / "dgc.weights.h5"
    model.save_weights(weights)
    fresh = _dgc_model(mirrored(2))
    fresh.build_all_reduce_hook()
    fresh.load_weights(weights)
    strategy = fresh.distribute_strategy
    restored = fresh.all_reduce_hook.state_variables
    assert fresh.all_reduce_hook.steps == 4
    for total, variable in zip(saved[1:], restored[1:]):
        shares = [v.numpy() for v in strategy.experimental_local_results(variable)]
        np.testing.assert_allclose(shares[0], total / 2, atol=1e-6)
        np.testing.assert_allclose(shares[1], total / 2, atol=1e-6)
    # Training resumes (past the warm-up) from the restored state.
    history = fresh.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert fresh.all_reduce_hook.steps == 8
    assert np.isfinite(history.history["loss"][0])


# --- Training ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: keras.optimizers.SGD(0.1, momentum=0.5, nesterov=True),
        lambda: keras.optimizers.Adam(0.01),
        lambda: keras.optimizers.RMSprop(0.01, momentum=0.9),
    ],
    ids=["sgd-momentum", "sgd-nesterov", "adam", "rmsprop-momentum"],
)
def test_an_optimizer_with_momentum_is_refused(optimizer, mirrored):
    x, y = make_data()
    model = _dgc_model(mirrored(2), optimizer=optimizer)
    with pytest.raises(ValueError, match=r"`optimizer` must not apply momentum"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def test_momentum_is_refused_through_wrappers(mirrored):
    x, y = make_data()

    def optimizer():
        inner = keras.optimizers.SGD(0.1, momentum=0.9)
        return keras_dist.GradientAccumulationOptimizer(
            keras.optimizers.LossScaleOptimizer(inner), accumulation_steps=2
        )

    model = _dgc_model(mirrored(2), optimizer=optimizer)
    with pytest.raises(ValueError, match=r"Received: optimizer=SGD with momentum=0.9"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: keras.optimizers.Adagrad(0.1),
        lambda: keras.optimizers.Adadelta(0.1),
        lambda: keras.optimizers.RMSprop(0.01),
        lambda: keras.optimizers.Ftrl(0.1),
    ],
    ids=["adagrad", "adadelta", "rmsprop", "ftrl"],
)
def test_an_adaptive_optimizer_is_refused(optimizer, mirrored):
    # Issue 31 W8: Adagrad was accepted without a word.
    x, y = make_data()
    model = _dgc_model(mirrored(2), optimizer=optimizer)
    with pytest.raises(
        ValueError,
        match=r"`optimizer` must be plain SGD with `DGC`.*Received: optimizer="
        r"\w+\. Use `keras.optimizers.SGD\(learning_rate\)`",
    ):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


@pytest.mark.parametrize(
    "attribute, fix",
    [
        ("clipnorm", r"`DGC\(clipnorm=0.5\)` clips each replica's gradient"),
        ("global_clipnorm", r"`DGC\(clipnorm=0.5\)` clips each replica's"),
        ("clipvalue", r"`DGC` has no element-wise clipping: use `DGC\(clipnorm"),
    ],
)
def test_the_optimizers_own_clipping_is_refused_naming_the_hooks(
    attribute, fix, mirrored
):
    # Issue 31 W9: the optimizer's clipnorm clipped the sparse sum silently.
    x, y = make_data()

    def optimizer():
        inner = keras.optimizers.SGD(0.1, **{attribute: 0.5})
        return keras_dist.GradientAccumulationOptimizer(inner, accumulation_steps=2)

    model = _dgc_model(mirrored(2), optimizer=optimizer)
    with pytest.raises(
        ValueError,
        match=rf"`optimizer` must not clip with `DGC`: its `{attribute}`.*"
        rf"Received: optimizer=SGD with {attribute}=0.5\. .*{fix}",
    ):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def test_a_subclass_of_sgd_is_plain_sgd(mirrored):
    class MySGD(keras.optimizers.SGD):
        pass

    x, y = make_data()
    model = _dgc_model(mirrored(2), optimizer=lambda: MySGD(0.1))
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_loss_scaling_is_divided_out(mirrored):
    """A float32 model under a LossScaleOptimizer trains exactly as without
    it: the hook accumulates unscaled gradients (the scale is a power of 2),
    and its clipping threshold applies to them."""
    x, y = make_data()
    hook_kwargs = {"ratio": 0.1, "warmup_steps": 2, "clipnorm": 0.5}
    plain = _dgc_model(mirrored(2), DGC(**hook_kwargs))
    scaled = _dgc_model(
        mirrored(2),
        DGC(**hook_kwargs),
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
    )
    for model in (plain, scaled):
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert max_abs_diff(plain.get_weights(), mlp().get_weights()) > 1e-3
    assert max_abs_diff(plain.get_weights(), scaled.get_weights()) < 1e-6
    for a, b in zip(
        plain.all_reduce_hook.state_variables, scaled.all_reduce_hook.state_variables
    ):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


def test_trains_under_mixed_precision(mirrored):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        x, y = make_data()
        model = _dgc_model(mirrored(2), DGC(ratio=0.1, warmup_steps=4, clipnorm=1.0))
        history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    finally:
        keras.config.set_dtype_policy(previous)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    # The state is in gradient units, not multiplied by the loss scale (32768).
    accumulation = model.all_reduce_hook.state("accumulation_0").numpy()
    assert np.all(np.isfinite(accumulation)) and np.max(np.abs(accumulation)) < 10


def test_gradient_accumulation_matches_one_large_batch(mirrored):
    """2 micro-batches of 8 accumulated, then one DGC reduction, equal one
    batch of 16 through DGC: the hook runs once per update.

    DGC's top-k is per replica, so each replica must accumulate the examples
    it has in the large batch: replica 0 gets examples 0-7 of each 16 there,
    and the first 4 of each micro-batch of 8 here, hence the reordering.
    """
    x, y = make_data()
    within = np.array([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])
    order = np.concatenate([start + within for start in range(0, len(x), 16)])

    def run(accumulation_steps):
        def optimizer():
            if accumulation_steps == 1:
                return keras.optimizers.SGD(0.1)
            return keras_dist.GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.1), accumulation_steps=accumulation_steps
            )

        model = _dgc_model(mirrored(2), DGC(ratio=0.1, warmup_steps=2), optimizer)
        data = (x, y) if accumulation_steps == 1 else (x[order], y[order])
        model.fit(
            *data,
            batch_size=BATCH // accumulation_steps,
            epochs=2,
            shuffle=False,
            verbose=0,
        )
        return model

    large = run(1)
    accumulated = run(2)
    assert large.all_reduce_hook.steps == accumulated.all_reduce_hook.steps == 8
    assert max_abs_diff(large.get_weights(), mlp().get_weights()) > 1e-3
    assert max_abs_diff(large.get_weights(), accumulated.get_weights()) < 1e-5


def test_compression_ratio_is_logged(mirrored):
    x, y = make_data()
    model = _dgc_model(mirrored(2), DGC(ratio=0.1, warmup_steps=4))
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    hook = model.all_reduce_hook
    # 4 steps an epoch: epoch 1 sends 25%, epoch 2 10%.
    assert hook.warmup_schedule == ((0, 0.25), (4, 0.1))
    assert history.history["compression_ratio"][-1] == pytest.approx(hook.stats().ratio)
    assert history.history["compression_ratio"][0] < hook.stats().ratio


@pytest.mark.multiworker
def test_two_worker_processes_equal_two_logical_replicas(mirrored):
    """Under MultiWorkerMirroredStrategy the warm-up's all-gather has sizes
    known only when the step runs: both workers end with the same weights,
    equal to 2 logical replicas."""
    hooks = [
        DGC(ratio=0.1, warmup_steps=4),
        DGC(ratio=0.05, warmup_steps=3, clipnorm=1.0, nesterov=True),
    ]
    results = run_workers(
        workers.compressed_fit,
        num_workers=2,
        args=([keras.saving.serialize_keras_object(h) for h in hooks],),
        timeout=300,
    )
    x, y = make_data()
    for index, hook in enumerate(hooks):
        first, second = (results[w][index] for w in range(2))
        assert max_abs_diff(first["weights"], second["weights"]) == 0
        assert int(first["state"]["step"]) == 8
        model = _dgc_model(mirrored(2), DGC.from_config(hook.get_config()))
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        assert max_abs_diff(first["weights"], model.get_weights()) < 1e-6


# --- Arguments and config -------------------------------------------------------


def test_config_round_trip():
    hook = DGC(
        ratio=0.01,
        momentum=0.8,
        clipnorm=2.0,
        warmup_steps=50,
        nesterov=True,
        bucket_bytes=1024,
    )
    config = hook.get_config()
    assert config == {
        "ratio": 0.01,
        "momentum": 0.8,
        "clipnorm": 2.0,
        "warmup_steps": 50,
        "nesterov": True,
        "bucket_bytes": 1024,
    }
    clone = assert_config_round_trip(hook)
    assert repr(clone) == repr(hook)
    assert DGC().get_config() == {
        "ratio": 0.001,
        "momentum": 0.9,
        "clipnorm": None,
        "warmup_steps": 1000,
        "nesterov": False,
        "bucket_bytes": 4 * 2**20,
    }


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"ratio": 0}, ValueError, r"`ratio` must be .*Received: ratio=0"),
        ({"ratio": 1.5}, ValueError, r"`ratio` must be .*Try `ratio=0.001`"),
        ({"ratio": "0.1"}, TypeError, r"`ratio` must be"),
        ({"momentum": 1.0}, ValueError, r"`momentum` must be .* < 1"),
        ({"momentum": -0.1}, ValueError, r"Received: momentum=-0.1"),
        ({"clipnorm": 0}, ValueError, r"`clipnorm` must be .*or None"),
        ({"warmup_steps": -1}, ValueError, r"`warmup_steps` must be an int >= 0"),
        ({"warmup_steps": 2.5}, TypeError, r"Received: warmup_steps=2.5"),
        ({"nesterov": 1}, TypeError, r"`nesterov` must be a bool"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        DGC(**kwargs)


def test_numpy_scalars_are_accepted():
    hook = DGC(
        ratio=np.float32(0.01), warmup_steps=np.int64(10), nesterov=np.bool_(True)
    )
    assert hook.ratio == pytest.approx(0.01) and type(hook.ratio) is float
    assert hook.warmup_steps == 10 and type(hook.warmup_steps) is int
    assert hook.nesterov is True
