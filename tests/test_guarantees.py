"""No silent wrong answers: what DistributedModel checks for you.

Non-finite gradients change no weight (skipped, or an error on request)
while Keras's callbacks still see the loss; a Python
generator on several replicas (which tf.distribute cannot split) is refused;
a hook that returns the wrong shapes or dtypes is named.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist.compression import AllReduceHook, all_reduce_sum


def regression_data(n=64, nan_at=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    if nan_at is not None:
        x[nan_at, 2] = np.nan
    return x, y


def small_model(base=keras_dist.DistributedModel, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return base(inputs, keras.layers.Dense(1)(hidden), **kwargs)


# --- NaN in the data -------------------------------------------------------------


def nan_model(strategy, accumulation_steps, **compile_kwargs):
    with strategy.scope():
        model = small_model()
        optimizer = keras.optimizers.SGD(0.1)
        if accumulation_steps > 1:
            optimizer = keras_dist.GradientAccumulationOptimizer(
                optimizer, accumulation_steps=accumulation_steps
            )
        model.compile(optimizer, "mse", **compile_kwargs)
    return model


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_nan_input_skips_that_update_and_says_so(
    replicas, accumulation_steps, mirrored, caplog
):
    # relu maps NaN to 0 on CPU, so the logged loss can stay finite while
    # the gradient (and stock Keras's weights) turn NaN.
    x, y = regression_data(nan_at=37)  # in the third batch of 16
    model = nan_model(mirrored(replicas), accumulation_steps)
    with caplog.at_level("WARNING", logger="keras_dist"):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    # Four batches: every update but the one holding the bad batch.
    assert int(model.optimizer.iterations.numpy()) == 4 // accumulation_steps - 1
    skipped = 2 // accumulation_steps
    assert f"skipped optimizer update {skipped} (0-based)" in caplog.text


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_nan_input_can_stop_training_before_the_weights_change(
    replicas, accumulation_steps, mirrored
):
    x, y = regression_data(nan_at=37)
    model = nan_model(
        mirrored(replicas), accumulation_steps, non_finite_gradients="raise"
    )
    with pytest.raises(FloatingPointError) as raised:
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    # One short error (TensorFlow's assert was 156 lines of graph context,
    # with this sentence cut), naming the update and the variables.
    message = str(raised.value)
    update = 2 // accumulation_steps
    assert message.startswith(
        f"keras_dist: the all-reduced gradient of optimizer update {update} "
        "(0-based) is not finite (NaN or inf) in "
    )
    # Where relu maps NaN to 0 (most x86 builds) only the first kernel's
    # gradient is not finite; where it keeps NaN (seen on an AMD EPYC host)
    # every gradient is.
    reached = 4 if np.isnan(tf.nn.relu([np.nan]).numpy()[0]) else 1
    named = "/kernel" if reached == 1 else "/kernel, "
    assert named in message and f" ({reached} of 4 variables)" in message
    assert "non_finite_gradients='skip'" in message
    assert len(message) < 600
    assert raised.value.__cause__ is None
    assert all(np.isfinite(w).all() for w in model.get_weights())
    # Updates before the bad batch were applied; the bad one was not.
    assert int(model.optimizer.iterations.numpy()) == 2 // accumulation_steps


def test_terminate_on_nan_stops_a_diverging_run_on_two_replicas(mirrored):
    # Keras's TerminateOnNaN contract (keras/src/callbacks/terminate_on_nan_
    # test.py): the step's logs carry the non-finite loss and training stops;
    # and here no weight is changed by the non-finite step.
    with mirrored(2).scope():
        model = keras_dist.DistributedModel.from_model(
            keras.Sequential(
                [
                    keras.Input((1,)),
                    keras.layers.Dense(
                        1,
                        kernel_initializer=keras.initializers.Constant(1e20),
                        bias_initializer=keras.initializers.Constant(1e20),
                    ),
                ]
            )
        )
        model.compile(keras.optimizers.SGD(0.1), "mse")
    before = model.get_weights()
    x = np.full((8, 1), 1e20, "float32")
    history = model.fit(
        x,
        x,
        batch_size=4,
        epochs=3,
        verbose=0,
        callbacks=[keras.callbacks.TerminateOnNaN()],
    )
    losses = history.history["loss"]
    assert len(losses) == 1
    assert np.isnan(losses[0]) or np.isinf(losses[0])
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_stock_keras_turns_the_weights_nan_silently():
    # The defect the check exists for; if stock Keras ever catches it,
    # revisit the default.
    x, y = regression_data(nan_at=37)
    model = small_model(keras.Model)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert not all(np.isfinite(w).all() for w in model.get_weights())


def test_non_finite_updates_can_be_applied_as_stock_keras_does():
    x, y = regression_data(nan_at=37)
    model = small_model()
    model.compile(keras.optimizers.SGD(0.1), "mse", non_finite_gradients="apply")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert not all(np.isfinite(w).all() for w in model.get_weights())
    with pytest.raises(ValueError, match="`non_finite_gradients` must be one of"):
        model.compile("sgd", "mse", non_finite_gradients=True)


def test_finite_check_leaves_loss_scaling_alone():
    # Under mixed_float16 the LossScaleOptimizer skips overflowing steps
    # itself; the first steps overflow on purpose while the scale settles.
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        x, y = regression_data()
        model = small_model()
        model.compile(keras.optimizers.SGD(0.1), "mse")
        model.fit(x, y * 1e4, batch_size=16, epochs=1, verbose=0)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    assert all(np.isfinite(w).all() for w in model.get_weights())


# --- Generators on several replicas ------------------------------------------


def test_python_generator_on_replicas_is_refused(mirrored):
    x, y = regression_data()

    def batches():
        for start in range(0, 64, 16):
            yield x[start : start + 16], y[start : start + 16]

    with mirrored(2).scope():
        model = small_model()
        model.compile(keras.optimizers.SGD(0.1), "mse")
    with pytest.raises(ValueError, match=r"`x` must not be a Python generator"):
        model.fit(batches(), epochs=1, verbose=0)
    # One replica: a generator is fine.
    single = small_model()
    single.compile(keras.optimizers.SGD(0.1), "mse")
    single.fit(batches(), epochs=1, verbose=0)


def test_py_dataset_on_replicas_equals_one_device(mirrored):
    x, y = regression_data()

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return x[index * 16 : (index + 1) * 16], y[index * 16 : (index + 1) * 16]

    reference = small_model()
    reference.compile(keras.optimizers.SGD(0.1), "mse")
    reference.fit(Batches(), epochs=1, shuffle=False, verbose=0)
    with mirrored(2).scope():
        model = small_model()
        model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(Batches(), epochs=1, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)


# --- Hooks that return the wrong thing -----------------------------------------


class CastingHook(AllReduceHook):
    """Forgets to cast the sum back to the gradient's dtype."""

    def reduce(self, gradients, variables):
        gradients, _ = self.prepare(gradients, variables)
        return all_reduce_sum([tf.cast(g, "float16") for g in gradients])


class ReshapingHook(AllReduceHook):
    """Returns flattened sums."""

    def reduce(self, gradients, variables):
        gradients, _ = self.prepare(gradients, variables)
        return [tf.reshape(g, [-1]) for g in all_reduce_sum(gradients)]


@pytest.mark.parametrize(
    ("hook", "error", "message"),
    [
        (CastingHook(), TypeError, r"returned dtype float16 for gradient 0"),
        (ReshapingHook(), ValueError, r"returned shape \(32,\) for gradient 0"),
    ],
)
def test_hook_output_is_checked(hook, error, message):
    x, y = regression_data()
    model = small_model(all_reduce_hook=hook)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    with pytest.raises(error, match=message):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


# --- Clear errors instead of opaque ones -----------------------------------------


def test_empty_data_is_a_clear_error(mirrored):
    with mirrored(2).scope():
        model = small_model()
        model.compile(keras.optimizers.SGD(0.1), "mse")
    empty = np.zeros((0, 4), "float32"), np.zeros((0, 1), "float32")
    with pytest.raises(ValueError, match=r"is empty: it yielded no batch"):
        model.fit(*empty, verbose=0)
    with pytest.raises(ValueError, match=r"is empty: it yielded no batch"):
        model.evaluate(*empty, verbose=0)


def test_unbatched_dataset_is_a_clear_error():
    x, y = regression_data()
    model = small_model()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    with pytest.raises(ValueError, match=r"must be a batched `tf\.data\.Dataset`"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)), verbose=0)


def test_hook_cannot_change_while_fit_runs():
    x, y = regression_data()
    model = small_model()
    model.compile(keras.optimizers.SGD(0.1), "mse")

    class SwapHook(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.register_all_reduce_hook(keras_dist.compression.FP16())

    with pytest.raises(RuntimeError, match=r"cannot be called while `fit` runs"):
        model.fit(x, y, batch_size=16, callbacks=[SwapHook()], verbose=0)
    model.register_all_reduce_hook(keras_dist.compression.FP16())  # after: fine
    model.fit(x, y, batch_size=16, verbose=0)
