"""find_max_batch_size: the power-then-binary search, the safety margin, state
restored after every trial, agreement across replicas, errors; GPU: a real
out-of-memory search."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import compile_model, make_data, mlp

import keras_dist
from keras_dist import batch_size as batch_size_lib


def sample_batch(batch_size, features=8, classes=3):
    rng = np.random.default_rng(batch_size)
    x = rng.normal(size=(batch_size, features)).astype("float32")
    y = rng.integers(0, classes, size=(batch_size,)).astype("int32")
    return x, y


def optimizer_state(model):
    return [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]


def assert_same_state(before_weights, before_optimizer, model):
    for a, b in zip(before_weights, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(before_optimizer, optimizer_state(model)):
        np.testing.assert_array_equal(a, b)


class OutOfMemoryAbove:
    """A train step that changes the weights and the optimizer state, then
    raises ResourceExhaustedError above a threshold, as a step that fails
    midway would. Records the per-replica sizes tried."""

    def __init__(self, model, threshold, replicas):
        self.model = model
        self.threshold = threshold
        self.replicas = replicas
        self.tried = []

    def __call__(self, batch):
        x, _ = batch
        per_replica = len(x) // self.replicas
        self.tried.append(per_replica)
        for variable in self.model.trainable_variables:
            variable.assign(variable + 1.0)
        for variable in self.model.optimizer.variables:
            variable.assign(variable + tf.ones_like(variable))
        if per_replica > self.threshold:
            raise tf.errors.ResourceExhaustedError(
                None, None, f"OOM when allocating a batch of {per_replica}"
            )


def trained_model(strategy):
    x, y = make_data()
    with strategy.scope():
        model = compile_model(
            mlp(keras_dist.DistributedModel), keras.optimizers.Adam(0.01)
        )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return model


def test_power_then_binary_search_with_margin_restores_state(mirrored):
    strategy = mirrored(2)
    model = trained_model(strategy)
    weights, optimizer = model.get_weights(), optimizer_state(model)
    step = OutOfMemoryAbove(model, threshold=37, replicas=2)
    result = keras_dist.find_max_batch_size(
        model, sample_batch, train_step_fn=step, safety_margin=0.1
    )
    assert step.tried == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    assert result == int(37 * 0.9)  # 33
    assert_same_state(weights, optimizer, model)


def test_search_stops_at_max_batch_size_and_margin_zero():
    model = compile_model(mlp(), keras.optimizers.SGD(0.1))
    step = OutOfMemoryAbove(model, threshold=10**9, replicas=1)
    result = keras_dist.find_max_batch_size(
        model,
        sample_batch,
        train_step_fn=step,
        initial_batch_size=3,
        max_batch_size=20,
        safety_margin=0,
    )
    assert step.tried == [3, 6, 12, 20]
    assert result == 20


def test_numpy_sizes_and_margin_are_accepted():
    model = compile_model(mlp(), keras.optimizers.SGD(0.1))
    step = OutOfMemoryAbove(model, threshold=10**9, replicas=1)
    result = keras_dist.find_max_batch_size(
        model,
        sample_batch,
        train_step_fn=step,
        initial_batch_size=np.int64(3),
        max_batch_size=np.int32(20),
        safety_margin=np.float32(0.0),
        steps=np.int64(1),
    )
    assert step.tried == [3, 6, 12, 20]
    assert result == 20 and type(result) is int


def test_default_step_trains_with_fit_and_leaves_no_trace(mirrored):
    # The real step (fit on the model's strategy) with Adam and accumulation:
    # weights, Adam moments, iterations and accumulators come back as they were.
    strategy = mirrored(2)
    x, y = make_data()
    with strategy.scope():
        model = compile_model(
            mlp(keras_dist.DistributedModel),
            keras_dist.GradientAccumulationOptimizer(
                keras.optimizers.Adam(0.01), accumulation_steps=2
            ),
        )
    model.fit(x[:32], y[:32], batch_size=16, epochs=1, verbose=0)
    # `fit` applies an epoch's partial window at its end: one micro-step
    # outside `fit` leaves one pending.
    model.train_on_batch(x[:16], y[:16])
    weights, optimizer = model.get_weights(), optimizer_state(model)
    history = model.history
    result = keras_dist.find_max_batch_size(
        model, sample_batch, initial_batch_size=2, max_batch_size=8
    )
    assert result == 7  # nothing runs out of memory on CPU: the cap, less 10%
    assert_same_state(weights, optimizer, model)
    assert int(model.optimizer.pending_micro_steps.numpy()) == 1
    assert model.history is history


def test_unbuilt_model_is_built_before_the_search():
    model = compile_model(mlp(), keras.optimizers.Adam(0.01))
    assert not model.optimizer.built
    step = OutOfMemoryAbove(model, threshold=5, replicas=1)
    assert keras_dist.find_max_batch_size(model, sample_batch, train_step_fn=step) == 4
    assert int(model.optimizer.iterations.numpy()) == 0


def test_agreement_counts_every_replica(mirrored):
    strategy = mirrored(2)
    assert batch_size_lib._all_workers_ok(strategy, True) is True
    assert batch_size_lib._all_workers_ok(strategy, False) is False


def test_nothing_fits_is_a_clear_error():
    model = compile_model(mlp(), keras.optimizers.SGD(0.1))
    step = OutOfMemoryAbove(model, threshold=0, replicas=1)
    with pytest.raises(RuntimeError, match="initial_batch_size=1"):
        keras_dist.find_max_batch_size(model, sample_batch, train_step_fn=step)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"initial_batch_size": 0}, ValueError, "initial_batch_size=0"),
        ({"initial_batch_size": 1.5}, TypeError, "initial_batch_size=1.5"),
        (
            {"max_batch_size": 2, "initial_batch_size": 4},
            ValueError,
            "max_batch_size=2",
        ),
        ({"safety_margin": 1.0}, ValueError, "safety_margin=1.0"),
        ({"safety_margin": -0.1}, ValueError, "safety_margin=-0.1"),
        ({"steps": 0}, ValueError, "steps=0"),
        ({"steps": True}, TypeError, r"`steps` must be an int >= 1 or None"),
        (
            {"safety_margin": float("nan")},
            ValueError,
            r"`safety_margin` must be a finite number >= 0 and < 1\. .* 0\.1 for 10%",
        ),
        ({"safety_margin": "0.1"}, TypeError, "safety_margin='0.1'"),
        ({"train_step_fn": "fit"}, TypeError, "train_step_fn='fit'"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    model = compile_model(mlp(), keras.optimizers.SGD(0.1))
    with pytest.raises(error, match=match):
        keras_dist.find_max_batch_size(model, sample_batch, **kwargs)


def test_bad_model_and_sampler():
    with pytest.raises(TypeError, match="model=str"):
        keras_dist.find_max_batch_size("model", sample_batch)
    with pytest.raises(TypeError, match="sample_batch_fn=None"):
        keras_dist.find_max_batch_size(mlp(), None)
    with pytest.raises(RuntimeError, match="compile the model"):
        keras_dist.find_max_batch_size(mlp(), sample_batch)


@pytest.mark.gpu
def test_real_out_of_memory_search_on_gpu():
    # Convolutions on 128x128 images keep ~50 MB of activations per example:
    # the search meets a real ResourceExhaustedError within a few thousand
    # examples on any current GPU, and the model is left untouched.
    def conv_batch(batch_size):
        x = tf.random.uniform((batch_size, 128, 128, 3))
        y = tf.zeros((batch_size,), tf.int32)
        return x, y

    keras.utils.set_random_seed(0)
    inputs = keras.Input((128, 128, 3))
    hidden = inputs
    for _ in range(6):
        hidden = keras.layers.Conv2D(128, 3, padding="same", activation="relu")(hidden)
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(hidden))
    model = keras_dist.DistributedModel(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(*conv_batch(8), epochs=1, verbose=0)
    weights, optimizer = model.get_weights(), optimizer_state(model)
    result = keras_dist.find_max_batch_size(
        model, conv_batch, initial_batch_size=64, max_batch_size=1 << 16
    )
    assert 64 <= result < 1 << 16
    assert_same_state(weights, optimizer, model)
    model.fit(*conv_batch(result), epochs=1, verbose=0)  # the result trains


def fixed_size_batch(batch_size):
    """Ignores its argument: the bug `find_max_batch_size` must catch."""
    return sample_batch(32)


def test_sampler_must_return_the_batch_size_asked_for():
    model = compile_model(mlp(), keras.optimizers.SGD(0.1))
    step = OutOfMemoryAbove(model, threshold=1000, replicas=1)
    with pytest.raises(
        ValueError,
        match=r"Called with batch_size=1, it returned a batch whose "
        r"element\[0\] has shape \(32, 8\)\. Received: sample_batch_fn=",
    ):
        keras_dist.find_max_batch_size(model, fixed_size_batch, train_step_fn=step)
    assert step.tried == []


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ((np.zeros((4, 8)), np.zeros(3)), r"element\[1\] has shape \(3,\)"),
        ({"x": np.zeros((4, 8)), "y": 1.0}, r"element\['y'\] is a float"),
        (np.float32(1.0), r"element itself has shape \(\)"),
    ],
)
def test_every_array_of_the_batch_is_checked(batch, match):
    with pytest.raises(ValueError, match=match):
        batch_size_lib._sample(lambda batch_size: batch, 4)


def test_a_batch_of_the_right_size_passes_unchanged():
    batch = (tf.zeros((4, 8)), np.zeros(4), None)
    assert batch_size_lib._sample(lambda batch_size: batch, 4) is batch
