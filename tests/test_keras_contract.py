"""Regression tests for the defects Keras's own tests found (D1-D6).

Each compares `DistributedModel` with stock `keras.Model` on the same seed:
where both train, the weights agree to 1e-6.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist._compat import keras_src

TOLERANCE = 1e-6


def lazy_net(base, units=3, seed=3):
    """A subclassed model whose Dense builds on its first call."""

    class Net(base):
        traces = 0

        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(units)

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            type(self).traces += 1
            return super().train_step(data)

    keras.utils.set_random_seed(seed)
    return Net()


def data(n=32, features=4, units=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.normal(size=(n, units)).astype("float32")
    return x, y


def train(model, **compile_kwargs):
    x, y = data()
    model.compile(keras.optimizers.SGD(0.1), "mse", **compile_kwargs)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model


def assert_same_weights(a, b, tolerance=TOLERANCE):
    for wa, wb in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_allclose(wa, wb, atol=tolerance, rtol=0)


# --- D1: lazily built weights ------------------------------------------------


@pytest.mark.parametrize("strategy_name", ["default", "one_device", "mirrored"])
def test_d1_lazy_weights_train_like_stock(strategy_name, mirrored):
    expected = train(lazy_net(keras.Model))
    if strategy_name == "default":
        model = train(lazy_net(keras_dist.DistributedModel))
    else:
        strategy = (
            tf.distribute.OneDeviceStrategy("/cpu:0")
            if strategy_name == "one_device"
            else mirrored(2)
        )
        with strategy.scope():
            model = lazy_net(keras_dist.DistributedModel)
            train(model)
    assert_same_weights(model, expected)


def test_d1_from_model_of_unbuilt_sequential():
    keras.utils.set_random_seed(5)
    expected = train(keras.Sequential([keras.layers.Dense(3)]))
    keras.utils.set_random_seed(5)
    model = keras_dist.DistributedModel.from_model(
        keras.Sequential([keras.layers.Dense(3)])
    )
    assert_same_weights(train(model), expected)


def test_d1_lazy_weights_in_a_custom_loop_without_strategy():
    x, y = data()
    models = []
    for base in (keras.Model, keras_dist.DistributedModel):
        model = lazy_net(base)
        model.compile(keras.optimizers.SGD(0.1), "mse")

        @tf.function
        def step(x, y, model=model):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            if isinstance(model, keras_dist.DistributedModel):
                model.apply_gradients(grads, model.trainable_variables)
            else:
                model.optimizer.apply_gradients(zip(grads, model.trainable_variables))

        for _ in range(3):
            step(x, y)
        models.append(model)
    assert_same_weights(*models)


# --- D2: functional-style subclasses -------------------------------------------


def test_d2_functional_subclass_leaves_distributed_model_alone():
    bases = keras_dist.DistributedModel.__bases__
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(3)(inputs)

    class CalledFunctionally(keras_dist.DistributedModel):
        pass

    class InitPassesInputs(keras_dist.DistributedModel):
        def __init__(self):
            inputs = keras.Input((4,))
            super().__init__(inputs=inputs, outputs=keras.layers.Dense(3)(inputs))

    functional = CalledFunctionally(inputs=inputs, outputs=outputs)
    passes_inputs = InitPassesInputs()
    assert keras_dist.DistributedModel.__bases__ == bases
    for model in (functional, passes_inputs):
        assert isinstance(model, keras_dist.DistributedModel)
        assert isinstance(model, keras_dist.models.FunctionalDistributedModel)
        train(model)
    # An ordinary subclass still constructs and trains afterwards.
    assert_same_weights(
        train(lazy_net(keras_dist.DistributedModel)), train(lazy_net(keras.Model))
    )


# --- D3: jit_compile -----------------------------------------------------------


def test_d3_jit_compile_fit_and_evaluate_without_strategy():
    x, y = data()
    results = []
    for base in (keras.Model, keras_dist.DistributedModel):
        model = train(lazy_net(base), jit_compile=True)
        assert model.jit_compile is True
        results.append((model, model.evaluate(x, y, verbose=0)))
    assert_same_weights(results[0][0], results[1][0])
    assert results[0][1] == pytest.approx(results[1][1], abs=TOLERANCE)


def test_d3_jit_compile_with_replicas_is_a_clear_error(mirrored):
    # Stock Keras fails here too, with an opaque XLA graph error.
    with mirrored(2).scope():
        model = lazy_net(keras_dist.DistributedModel)
    with pytest.raises(ValueError, match=r"`jit_compile=True` does not work"):
        train(model, jit_compile=True)


# --- D4: optional inputs fed as None -------------------------------------------


def optional_input_model(base):
    keras.utils.set_random_seed(7)
    x1 = keras.Input((4,), name="x1")
    x2 = keras.Input((4,), name="x2", optional=True)

    class AddIfPresent(keras.layers.Layer):
        def call(self, a, b=None):
            return a if b is None else a + b

    hidden = AddIfPresent()(x1, x2)
    return base({"x1": x1, "x2": x2}, keras.layers.Dense(3)(hidden))


def test_d4_optional_input_none_from_generator():
    x, y = data()

    def generator():
        for start in range(0, 32, 8):
            yield {"x1": x[start : start + 8], "x2": None}, y[start : start + 8]

    models = []
    for base in (keras.Model, keras_dist.DistributedModel):
        model = optional_input_model(base)
        model.compile(keras.optimizers.SGD(0.1), "mse")
        model.fit(generator(), epochs=1, verbose=0)
        models.append(model)
    assert_same_weights(*models)


# --- D5: sparse gradients stay sparse ------------------------------------------


class RecordingSGD(keras.optimizers.SGD):
    """SGD that records the type of every gradient it applies (at trace)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        keras_src.set_untracked_attribute(self, "gradient_types", set())

    def update_step(self, gradient, variable, learning_rate):
        self.gradient_types.add(type(gradient).__name__)
        return super().update_step(gradient, variable, learning_rate)


def embedding_model(base, vocabulary=100_000):
    keras.utils.set_random_seed(11)
    inputs = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Embedding(vocabulary, 8)(inputs)
    outputs = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(hidden))
    return base(inputs, outputs)


@pytest.mark.parametrize("replicas", [1, 2])
def test_d5_embedding_gradients_stay_indexed_slices(replicas, mirrored):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 100_000, size=(32, 5)).astype("int32")
    y = rng.normal(size=(32, 1)).astype("float32")
    expected = embedding_model(keras.Model)
    expected.compile(keras.optimizers.SGD(0.5), "mse")
    expected.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    with mirrored(replicas).scope():
        model = embedding_model(keras_dist.DistributedModel)
        optimizer = RecordingSGD(learning_rate=0.5)
        model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert "IndexedSlices" in optimizer.gradient_types
    assert_same_weights(model, expected)


# --- D6: one trace of the step per function -------------------------------------


def test_d6_steps_per_execution_traces_like_stock():
    x, y = data()
    traces = []
    for base in (keras.Model, keras_dist.DistributedModel):
        model = lazy_net(base)
        model.compile(keras.optimizers.SGD(0.1), "mse", steps_per_execution=3)
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
        traces.append(type(model).traces)
    assert traces[1] == traces[0]
