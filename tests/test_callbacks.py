"""AutoScaleBatch: learning-rate schedule values, the noise-scale estimator
on real gradients, adaptive growth, batching by DistributedModel, logs,
reuse, errors. The noise-scale arithmetic alone (formulas, moving averages,
target batch) is tested without TensorFlow in tests/test_noise_scale.py."""

import itertools
import logging
import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    assert_config_round_trip,
    compile_model,
    make_data,
    max_abs_diff,
    mlp,
)

import keras_dist
from keras_dist import noise_scale
from keras_dist._fit_data import prepare_fit_arguments
from keras_dist.callbacks import AutoScaleBatch, ScaledLearningRate
from keras_dist.core import statistics as _gradient_statistics


class RecordRate(keras.callbacks.Callback):
    """Records the learning rate each micro-step runs with."""

    def on_train_begin(self, logs=None):
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(self.model.optimizer.learning_rate.numpy()))


class SetRates(keras.callbacks.Callback):
    """Sets a given learning rate before each step (the reference run)."""

    def __init__(self, rates):
        super().__init__()
        self.rates = list(rates)

    def on_train_batch_begin(self, batch, logs=None):
        self.model.optimizer.learning_rate = self.rates.pop(0)


def distributed(strategy, make_optimizer, accumulation_steps=None):
    # The optimizer is made inside the scope: its `iterations` must be mirrored.
    with strategy.scope():
        optimizer = make_optimizer()
        if accumulation_steps is not None:
            optimizer = keras_dist.GradientAccumulationOptimizer(
                optimizer, accumulation_steps=accumulation_steps
            )
        return compile_model(mlp(keras_dist.DistributedModel), optimizer)


# --- Learning rate: exact schedule values ---


def test_linear_warmup_steps_values_and_the_updates_use_them(mirrored):
    # 2 replicas x 8 = global 16, tuned for 8: linear factor 2, reached over 4
    # updates from the unscaled 0.1.
    x, y = make_data()
    model = distributed(mirrored(2), lambda: keras.optimizers.SGD(0.1))
    autoscale = AutoScaleBatch(8, base_batch_size=8, warmup_steps=4)
    record = RecordRate()
    history = model.fit(
        x, y, epochs=2, shuffle=False, callbacks=[autoscale, record], verbose=0
    )
    expected = [0.1, 0.125, 0.15, 0.175, 0.2, 0.2, 0.2, 0.2]
    np.testing.assert_allclose(record.rates, expected, rtol=1e-6)
    assert history.history["batch_size"] == [16, 16]
    np.testing.assert_allclose(history.history["learning_rate"], [0.175, 0.2])
    assert autoscale.batch_size == 16
    # The same rates, set by hand on one device with batch 16, give the same
    # weights: the callback's rates are the ones the updates used.
    reference = compile_model(mlp(), keras.optimizers.SGD(0.1))
    reference.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        shuffle=False,
        callbacks=[SetRates(expected)],
        verbose=0,
    )
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5


def test_sqrt_scaling_with_accumulation_and_warmup_epochs(mirrored):
    # Global batch 4 x 2 replicas x 2 steps = 16, base 4: sqrt factor 2. One
    # warmup epoch of 64 / 8 = 8 micro-steps; the k-th update's cycle starts
    # at micro-step 2k, so its progress is 2k / 8.
    x, y = make_data()
    model = distributed(
        mirrored(2), lambda: keras.optimizers.SGD(0.1), accumulation_steps=2
    )
    autoscale = AutoScaleBatch(4, base_batch_size=4, lr_scaling="sqrt", warmup_epochs=1)
    record = RecordRate()
    history = model.fit(
        x, y, epochs=2, shuffle=False, callbacks=[autoscale, record], verbose=0
    )
    update_rates = record.rates[1::2]  # rates of the micro-steps that update
    expected = [0.1, 0.125, 0.15, 0.175, 0.2, 0.2, 0.2, 0.2]
    np.testing.assert_allclose(update_rates, expected, rtol=1e-6)
    assert history.history["batch_size"] == [16, 16]
    assert int(model.optimizer.iterations.numpy()) == 8
    # Gradient statistics are only measured in adaptive mode.
    assert _gradient_statistics.gradient_statistics(model.optimizer) is None


def test_no_scaling_keeps_the_rate_and_default_base_is_the_start_batch():
    x, y = make_data()
    one_device = tf.distribute.get_strategy()
    model = distributed(one_device, lambda: keras.optimizers.SGD(0.05))
    record = RecordRate()
    model.fit(
        x,
        y,
        epochs=1,
        callbacks=[AutoScaleBatch(16, lr_scaling=None), record],
        verbose=0,
    )
    np.testing.assert_allclose(record.rates, [0.05] * 4, rtol=1e-6)
    # base_batch_size=None: the starting batch is the base, factor 1.
    model = distributed(one_device, lambda: keras.optimizers.SGD(0.05))
    model.fit(x, y, epochs=1, callbacks=[AutoScaleBatch(16), record], verbose=0)
    np.testing.assert_allclose(record.rates, [0.05] * 4, rtol=1e-6)


def test_schedule_wrapped_in_scaled_learning_rate():
    x, y = make_data()
    schedule = ScaledLearningRate(
        keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    )
    model = distributed(
        tf.distribute.get_strategy(), lambda: keras.optimizers.SGD(schedule)
    )
    autoscale = AutoScaleBatch(16, base_batch_size=8, warmup_steps=2)
    record = RecordRate()
    model.fit(x, y, epochs=1, shuffle=False, callbacks=[autoscale, record], verbose=0)
    # schedule(t) x (1 + (2 - 1) x min(1, t / 2))
    expected = [0.1 * 0.5**t * (1 + min(1.0, t / 2)) for t in range(4)]
    np.testing.assert_allclose(record.rates, expected, rtol=1e-6)
    assert float(schedule.multiplier.numpy()) == 2.0


def test_plain_schedule_is_refused_with_the_fix():
    x, y = make_data()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    model = distributed(
        tf.distribute.get_strategy(), lambda: keras.optimizers.SGD(schedule)
    )
    with pytest.raises(TypeError, match="ScaledLearningRate"):
        model.fit(x, y, epochs=1, callbacks=[AutoScaleBatch(16)], verbose=0)
    # Nothing to rescale without lr_scaling: accepted.
    model.fit(
        x, y, epochs=1, callbacks=[AutoScaleBatch(16, lr_scaling=None)], verbose=0
    )


def test_scaled_learning_rate_config_round_trip():
    schedule = ScaledLearningRate(keras.optimizers.schedules.CosineDecay(0.1, 100))
    revived = assert_config_round_trip(schedule)
    assert float(revived(0)) == pytest.approx(0.1)
    with pytest.raises(TypeError, match=r"schedule=0\.1"):
        ScaledLearningRate(0.1)


def test_one_instance_serves_several_fits():
    x, y = make_data()
    autoscale = AutoScaleBatch(16, base_batch_size=8, warmup_steps=4)
    record = RecordRate()
    one_device = tf.distribute.get_strategy()
    model = distributed(one_device, lambda: keras.optimizers.SGD(0.1))
    model.fit(x, y, epochs=1, shuffle=False, callbacks=[autoscale, record], verbose=0)
    # Same optimizer: no second scaling, warmup continues where it stopped.
    model.fit(x, y, epochs=1, shuffle=False, callbacks=[autoscale, record], verbose=0)
    np.testing.assert_allclose(record.rates, [0.2] * 4, rtol=1e-6)
    # A new model and optimizer start afresh.
    other = distributed(one_device, lambda: keras.optimizers.SGD(0.1))
    other.fit(x, y, epochs=1, shuffle=False, callbacks=[autoscale, record], verbose=0)
    np.testing.assert_allclose(record.rates, [0.1, 0.125, 0.15, 0.175], rtol=1e-6)


# --- The noise-scale estimator on real gradients ---
# (test_estimate_noise_formulas moved to tests/test_noise_scale.py.)


def linear_regression(num_examples, features=8, noise_variance=1.0, seed=0):
    """Data with a known gradient noise, and the weights to measure it at.

    For `y = x . w* + e`, `x ~ N(0, I)`, `e ~ N(0, s^2)`, and the mean squared
    error at `w = w* + d`, the per-example gradient is `2 x (x . d - e)`, so
    `G = 2 d` and (Isserlis) `tr(Sigma) = 4 ((n + 1) |d|^2 + n s^2)`.
    """
    rng = np.random.default_rng(seed)
    w_star = rng.normal(size=(features, 1))
    direction = rng.normal(size=(features, 1))
    direction /= np.linalg.norm(direction)
    x = rng.normal(size=(num_examples, features))
    noise = rng.normal(scale=math.sqrt(noise_variance), size=(num_examples, 1))
    y = x @ w_star + noise
    truth = {
        "gradient_sq_norm": 4.0,
        "trace_covariance": 4.0 * ((features + 1) + features * noise_variance),
    }
    return x.astype("float32"), y.astype("float32"), (w_star + direction), truth


def linear_model(strategy, weights, accumulation_steps, learning_rate=0.0):
    with strategy.scope():
        inputs = keras.Input((weights.shape[0],))
        outputs = keras.layers.Dense(1, use_bias=False)(inputs)
        model = keras_dist.DistributedModel(inputs, outputs)
        model.compile(
            optimizer=keras_dist.GradientAccumulationOptimizer(
                keras.optimizers.SGD(learning_rate),
                accumulation_steps=accumulation_steps,
            ),
            loss="mse",
        )
    model.set_weights([weights.astype("float32")])
    return model


@pytest.mark.parametrize(
    ("per_replica", "accumulation_steps", "updates"), [(128, 1, 200), (64, 2, 150)]
)
def test_noise_scale_estimator_is_unbiased(
    per_replica, accumulation_steps, updates, mirrored
):
    # Learning rate 0 keeps the weights, so every update samples the same
    # known |G|^2 and tr(Sigma). The per-window estimates must average to the
    # truth within 4 standard errors (and 10%).
    replicas = 2
    examples = updates * per_replica * replicas * accumulation_steps
    x, y, weights, truth = linear_regression(examples)
    model = linear_model(mirrored(replicas), weights, accumulation_steps)
    autoscale = AutoScaleBatch(
        per_replica,
        lr_scaling=None,
        adaptive=True,
        max_batch_size=per_replica * replicas * accumulation_steps,
        adapt_every=10,
    )
    model.fit(x, y, epochs=1, shuffle=False, callbacks=[autoscale], verbose=0)
    assert len(autoscale.measurements) == updates // 10
    for name in ("gradient_sq_norm", "trace_covariance"):
        values = np.array([getattr(m, name) for m in autoscale.measurements])
        mean, error = values.mean(), values.std(ddof=1) / math.sqrt(len(values))
        assert abs(mean - truth[name]) < 4 * error, (name, mean, error, truth[name])
        assert abs(mean - truth[name]) < 0.1 * truth[name], (name, mean, truth[name])
    b_simple = truth["trace_covariance"] / truth["gradient_sq_norm"]
    assert autoscale.noise_scale == pytest.approx(b_simple, rel=0.25)


def test_adaptive_grows_the_batch_toward_the_noise_scale(mirrored):
    # B_simple = (n + 1) + n s^2 = 33 + 32 x 4 = 161 examples: with 16 x 2 =
    # 32 per micro-step, accumulation grows (1 -> 2 -> 4 -> ...) toward
    # floor(161 / 32) = 5. Decisions start after 10 windows of 10 updates.
    x, y, weights, _ = linear_regression(32 * 300, features=32, noise_variance=4.0)
    model = linear_model(mirrored(2), weights, accumulation_steps=1)
    autoscale = AutoScaleBatch(16, adaptive=True, max_batch_size=1024, adapt_every=10)
    history = model.fit(x, y, epochs=1, shuffle=False, callbacks=[autoscale], verbose=0)
    steps = model.optimizer.accumulation_steps
    assert 4 <= steps <= 6
    assert autoscale.batch_size == 32 * steps
    sizes = [m.batch_size for m in autoscale.measurements]
    assert sizes[:9] == [32] * 9  # averages not warm yet: no decision
    assert sizes == sorted(sizes)
    assert all(b <= 2 * a for a, b in itertools.pairwise(sizes))  # max_growth=2
    assert history.history["batch_size"] == [autoscale.batch_size]
    assert history.history["noise_scale"][0] == pytest.approx(161, rel=0.25)
    # lr 0 scaled by any factor stays 0.
    assert history.history["learning_rate"] == [0.0]


def test_adaptive_stops_at_max_batch_size_and_scales_the_rate(mirrored):
    x, y, weights, _ = linear_regression(32 * 160, features=32, noise_variance=4.0)
    model = linear_model(mirrored(2), weights, 1, learning_rate=1e-4)
    autoscale = AutoScaleBatch(16, adaptive=True, max_batch_size=100, adapt_every=5)
    history = model.fit(x, y, epochs=1, shuffle=False, callbacks=[autoscale], verbose=0)
    # floor(100 / 32) = 3 accumulation steps at most, reached by 1 -> 2 -> 3;
    # linear rule from the starting batch 32.
    assert model.optimizer.accumulation_steps == 3
    assert history.history["batch_size"] == [96]
    assert history.history["learning_rate"][0] == pytest.approx(3e-4)
    assert set(history.history) >= {
        "loss",
        "batch_size",
        "learning_rate",
        "noise_scale",
    }
    # A second fit on the same optimizer: fresh measurements that continue
    # the update count, the grown batch kept, the rate not scaled twice.
    first = autoscale.measurements
    history = model.fit(x, y, epochs=1, shuffle=False, callbacks=[autoscale], verbose=0)
    second = autoscale.measurements
    assert second is not first and 0 < len(second) <= 160 // 3 // 5 + 1
    assert second[0].update > first[-1].update
    assert history.history["batch_size"] == [96]
    assert history.history["learning_rate"][0] == pytest.approx(3e-4)


# --- Batching ---


def test_distributed_model_batches_arrays_and_unbatched_datasets(mirrored):
    x, y = make_data()
    reference = distributed(mirrored(2), lambda: keras.optimizers.SGD(0.1))
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    unbatched = tf.data.Dataset.from_tensor_slices((x, y))
    for data in [(x, y), (unbatched,)]:
        model = distributed(mirrored(2), lambda: keras.optimizers.SGD(0.1))
        autoscale = AutoScaleBatch(8, lr_scaling=None)
        model.fit(*data, epochs=2, shuffle=False, callbacks=[autoscale], verbose=0)
        assert autoscale.params["steps"] == 64 // 16
        assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6


def test_distributed_model_batching_keeps_validation_split_and_shuffles(mirrored):
    x, y = make_data()
    model = distributed(mirrored(2), lambda: keras.optimizers.SGD(0.1))
    autoscale = AutoScaleBatch(4, lr_scaling=None)
    history = model.fit(
        x, y, epochs=1, validation_split=0.25, callbacks=[autoscale], verbose=0
    )
    assert autoscale.params["steps"] == 48 // 8
    assert "val_loss" in history.history
    _, kwargs = prepare_fit_arguments(model, (x, y), {"callbacks": [autoscale]})
    first = np.concatenate([batch[1] for batch in kwargs["x"]])
    second = np.concatenate([batch[1] for batch in kwargs["x"]])
    assert sorted(first) == sorted(y)
    assert not np.array_equal(first, second)  # reshuffled every epoch


def test_distributed_model_batching_errors(mirrored):
    x, y = make_data()
    model = distributed(mirrored(2), lambda: keras.optimizers.SGD(0.1))
    callbacks = [AutoScaleBatch(8)]
    with pytest.raises(ValueError, match="batch_size=32"):
        model.fit(x, y, batch_size=32, callbacks=callbacks, verbose=0)
    batched = tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True)
    with pytest.raises(ValueError, match="batched at 32"):
        model.fit(batched, callbacks=callbacks, verbose=0)
    with pytest.raises(ValueError, match="at most one AutoScaleBatch"):
        model.fit(x, y, callbacks=[AutoScaleBatch(8), AutoScaleBatch(8)], verbose=0)


def test_plain_model_is_told_once_how_to_batch(caplog):
    x, y = make_data()
    model = compile_model(mlp(), keras.optimizers.SGD(0.1))
    autoscale = AutoScaleBatch(16, lr_scaling=None)
    with caplog.at_level(logging.WARNING, logger="keras_dist.callbacks"):
        model.fit(x, y, batch_size=16, callbacks=[autoscale], verbose=0)
        model.fit(x, y, batch_size=16, callbacks=[autoscale], verbose=0)
    told = [r for r in caplog.records if "batch_size=16" in r.getMessage()]
    assert len(told) == 1
    assert "16 x 1" in told[0].getMessage()


def test_public_names():
    assert keras_dist.callbacks.AutoScaleBatch is AutoScaleBatch
    # Moved to keras_dist.noise_scale; still importable from callbacks.
    assert keras_dist.callbacks.estimate_noise is noise_scale.estimate_noise
    assert (
        keras_dist.callbacks.NoiseScaleMeasurement is noise_scale.NoiseScaleMeasurement
    )
    assert "callbacks" in keras_dist.__all__
    assert "find_max_batch_size" in keras_dist.__all__


# --- Bad input ---


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"per_replica_batch_size": 0}, ValueError, "per_replica_batch_size=0"),
        ({"per_replica_batch_size": 2.5}, TypeError, "per_replica_batch_size=2.5"),
        ({"per_replica_batch_size": True}, TypeError, "per_replica_batch_size=True"),
        ({"base_batch_size": -8}, ValueError, "base_batch_size=-8"),
        ({"lr_scaling": "cubic"}, ValueError, "lr_scaling='cubic'"),
        ({"warmup_epochs": -1}, ValueError, "warmup_epochs=-1"),
        ({"warmup_epochs": 1, "warmup_steps": 5}, ValueError, "not both"),
        ({"lr_scaling": None, "warmup_steps": 5}, ValueError, "needs `lr_scaling`"),
        ({"max_batch_size": 64}, ValueError, "adaptive=False"),
        ({"adaptive": True}, ValueError, "max_batch_size=None"),
        ({"adaptive": True, "max_batch_size": 4}, ValueError, "max_batch_size=4"),
        ({"adapt_every": 0}, ValueError, "adapt_every=0"),
        ({"ema_decay": 1.0}, ValueError, "ema_decay=1.0"),
        ({"max_growth": 1}, ValueError, "max_growth=1"),
        ({"adaptive": "yes"}, TypeError, "adaptive='yes'"),
        ({"warmup_steps": -1}, ValueError, "warmup_steps=-1"),
        ({"warmup_epochs": "1"}, TypeError, "warmup_epochs='1'"),
        ({"ema_decay": None}, TypeError, "ema_decay=None"),
        ({"max_growth": math.inf}, ValueError, "max_growth=inf"),
        ({"verbose": 2}, ValueError, "verbose=2"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    kwargs = {"per_replica_batch_size": 8, **kwargs}
    with pytest.raises(error, match=match):
        AutoScaleBatch(**kwargs)


def test_numpy_scalars_are_accepted_as_python_numbers():
    autoscale = AutoScaleBatch(
        np.int64(8),
        base_batch_size=np.int32(16),
        warmup_epochs=np.float32(0.5),
        adaptive=np.bool_(True),
        max_batch_size=np.int64(64),
        adapt_every=np.int16(5),
        ema_decay=np.float64(0.5),
        max_growth=np.float32(1.5),
    )
    assert type(autoscale.per_replica_batch_size) is int
    assert autoscale.adaptive is True
    assert type(autoscale.max_growth) is float
    assert autoscale.warmup_epochs == 0.5
    # No fit yet: no state.
    assert autoscale.batch_size is None
    assert math.isnan(autoscale.noise_scale)
    assert autoscale.measurements == []


def test_bad_setups_are_reported_when_fit_starts(mirrored):
    x, y = make_data()
    adaptive = AutoScaleBatch(8, adaptive=True, max_batch_size=64)
    model = distributed(mirrored(2), lambda: keras.optimizers.SGD(0.1))
    with pytest.raises(TypeError, match="GradientAccumulationOptimizer"):
        model.fit(x, y, callbacks=[adaptive], verbose=0)
    # Starting global batch 8 x 2 x 4 = 64 > 32.
    model = distributed(
        mirrored(2), lambda: keras.optimizers.SGD(0.1), accumulation_steps=4
    )
    with pytest.raises(ValueError, match="8 x 2 x 4 = 64"):
        model.fit(
            x,
            y,
            callbacks=[AutoScaleBatch(8, adaptive=True, max_batch_size=32)],
            verbose=0,
        )
    one_replica = distributed(
        tf.distribute.get_strategy(),
        lambda: keras.optimizers.SGD(0.1),
        accumulation_steps=1,
    )
    with pytest.raises(ValueError, match="num_replicas_in_sync=1"):
        one_replica.fit(x, y, callbacks=[adaptive], verbose=0)
    unknown = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        model.fit(
            unknown,
            shuffle=False,
            callbacks=[AutoScaleBatch(8, warmup_epochs=1)],
            verbose=0,
        )


@pytest.mark.multiworker
def test_workers_agree_on_adaptive_batch_and_learning_rate():
    import numpy as np
    import workers

    from keras_dist.testing import run_workers

    first, second = run_workers(
        workers.adaptive_autoscale_fit, num_workers=2, timeout=300
    )
    assert first["history"] == second["history"]
    # Logged at each epoch's end: the first change (from 8 per replica x 2
    # replicas = 16) may come within the first epoch (every 2 updates).
    batch_sizes = first["history"]["batch_size"]
    assert batch_sizes == sorted(batch_sizes)
    assert batch_sizes[-1] > 16  # it did adapt, identically
    for a, b in zip(first["weights"], second["weights"]):
        np.testing.assert_array_equal(a, b)
