"""GradientAccumulationOptimizer: equivalence with the big batch, communication
only on update steps, schedules, carry-over, mixed precision, saving, errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf
import workers
from helpers import (
    OPTIMIZERS,
    assert_config_round_trip,
    compile_model,
    make_data,
    max_abs_diff,
    mlp,
)

import keras_dist
from keras_dist.compression import AllReduceHook, all_reduce_sum
from keras_dist.testing import run_workers

ACCUMULATION_OPTIMIZERS = {
    **OPTIMIZERS,
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "adam_clip": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.1),
    "adamw_clip": lambda: keras.optimizers.AdamW(
        0.01, weight_decay=0.1, global_clipnorm=0.1
    ),
}


class CountingHook(AllReduceHook):
    """Plain sum that counts, at run time, how often each replica reduces."""

    def build(self, variables):
        super().build(variables)
        self.reductions = tf.Variable(
            0,
            dtype=tf.int64,
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )
        self.traces = 0

    def reduce(self, gradients, variables):
        self.traces += 1
        self.reductions.assign_add(1)
        return all_reduce_sum(gradients)


def big_batch_reference(optimizer_name, batch_size, epochs=2, steps=None):
    x, y = make_data()
    if steps is not None:
        x, y = x[: steps * batch_size], y[: steps * batch_size]
    model = compile_model(mlp(), ACCUMULATION_OPTIMIZERS[optimizer_name]())
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


def accumulated_model(strategy, optimizer_name, steps, cls=keras_dist.DistributedModel):
    with strategy.scope():
        optimizer = keras_dist.GradientAccumulationOptimizer(
            ACCUMULATION_OPTIMIZERS[optimizer_name](), accumulation_steps=steps
        )
        return compile_model(mlp(cls), optimizer)


# --- Equivalence ---


@pytest.mark.parametrize("optimizer_name", sorted(ACCUMULATION_OPTIMIZERS))
def test_mirrored_accumulation_equals_big_batch(optimizer_name, mirrored):
    # k=2 micro-steps of 8 per replica on 2 replicas == one step of 32.
    reference = big_batch_reference(optimizer_name, batch_size=32)
    x, y = make_data()
    model = accumulated_model(mirrored(2), optimizer_name, steps=2)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5
    assert int(model.optimizer.iterations.numpy()) == 4
    assert int(model.optimizer.micro_steps.numpy()) == 8


@pytest.mark.parametrize("optimizer_name", ["momentum", "adamw_clip"])
def test_custom_loop_accumulation_equals_big_batch(optimizer_name, mirrored):
    # The seeds' loop (strategy.run + strategy.reduce) through
    # model.apply_gradients: build_all_reduce_hook builds the accumulation
    # optimizer too, which cannot build inside strategy.run.
    reference = big_batch_reference(optimizer_name, batch_size=32, epochs=1)
    x, y = make_data()
    strategy = mirrored(2)
    model = accumulated_model(strategy, optimizer_name, steps=2)
    assert not model.optimizer.built
    model.build_all_reduce_hook()
    assert model.optimizer.built and model.all_reduce_hook.built
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum"
    )
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    )

    def train_step(batch):
        features, labels = batch
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(features, training=True)) / 16
        grads = tape.gradient(loss, model.trainable_variables)
        model.apply_gradients(grads, model.trainable_variables)
        return loss

    @tf.function
    def distributed_step(batch):
        return strategy.reduce("SUM", strategy.run(train_step, args=(batch,)), None)

    for batch in dataset:
        distributed_step(batch)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5


def test_custom_loop_without_build_says_what_to_call(mirrored):
    strategy = mirrored(2)
    model = accumulated_model(strategy, "sgd", steps=2)
    x, _ = make_data(n=16)

    def train_step(features):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(features)) / 16
        grads = tape.gradient(loss, model.trainable_variables)
        model.apply_gradients(grads, model.trainable_variables)

    with pytest.raises(RuntimeError, match=r"model\.build_all_reduce_hook\(\)"):
        strategy.run(tf.function(train_step), args=(tf.constant(x),))


@pytest.mark.parametrize("optimizer_name", ["momentum", "adamw_clip"])
def test_plain_keras_model_accumulation_equals_big_batch(optimizer_name, mirrored):
    reference = big_batch_reference(optimizer_name, batch_size=32)
    x, y = make_data()
    model = accumulated_model(mirrored(2), optimizer_name, steps=2, cls=keras.Model)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5


def test_default_strategy_accumulation_equals_big_batch():
    reference = big_batch_reference("adam", batch_size=32)
    x, y = make_data()
    model = accumulated_model(tf.distribute.get_strategy(), "adam", steps=4)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5


@pytest.mark.multiworker
def test_multi_worker_accumulation_equals_big_batch():
    names = sorted(ACCUMULATION_OPTIMIZERS)
    results = run_workers(
        workers.accumulated_fit, num_workers=2, args=(names, 2, 8), timeout=400
    )
    for name in names:
        reference = big_batch_reference(name, batch_size=32)
        for worker in results:
            got = worker[name]
            assert max_abs_diff(reference.get_weights(), got["weights"]) < 1e-5, name
            assert got["iterations"] == 4
            assert got["micro_steps"] == 8


# --- Communication ---


def test_exactly_one_reduction_per_update(mirrored):
    x, y = make_data()
    hook = CountingHook()
    strategy = mirrored(2)
    with strategy.scope():
        model = mlp(keras_dist.DistributedModel, seed=1)
        model.register_all_reduce_hook(hook)
        optimizer = keras_dist.GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.1), accumulation_steps=4
        )
        compile_model(model, optimizer)
    # 64 samples / 16 per step = 4 micro-steps per epoch, 3 epochs.
    model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert int(optimizer.micro_steps.numpy()) == 12
    assert int(optimizer.iterations.numpy()) == 3
    # Summed over the 2 replicas: one reduction per replica per update.
    assert int(hook.reductions.numpy()) == 2 * 3


# --- Schedules, carry-over, changing k ---


def test_schedule_advances_per_update():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    x, y = make_data()
    reference = compile_model(mlp(), keras.optimizers.SGD(schedule))
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    model = compile_model(
        mlp(),
        keras_dist.GradientAccumulationOptimizer(
            keras.optimizers.SGD(schedule), accumulation_steps=4
        ),
    )
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
    # The schedule was evaluated at update 0 and 1, as with the big batch.
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.025)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6


def test_an_epochs_partial_window_is_applied_at_its_end(mirrored):
    # 3 micro-steps of 8 with k=4: DistributedModel.fit applies them when
    # the epoch's steps end, as one batch of 32 would end an epoch of 24
    # examples with one (short) batch.
    x, y = make_data()
    reference = compile_model(mlp(), OPTIMIZERS["sgd"]())
    reference.fit(x[:24], y[:24], batch_size=32, epochs=1, shuffle=False, verbose=0)
    model = accumulated_model(mirrored(2), "sgd", steps=4)
    model.fit(x[:24], y[:24], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.pending_micro_steps.numpy()) == 0
    assert int(model.optimizer.iterations.numpy()) == 1
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6


def test_a_plain_keras_model_carries_a_partial_window_over(mirrored):
    # A plain keras.Model's fit does not tell the optimizer where an epoch
    # ends: the window completes with the next fit's first micro-step.
    x, y = make_data()
    reference = compile_model(mlp(), OPTIMIZERS["sgd"]())
    reference.fit(x[:32], y[:32], batch_size=32, epochs=1, shuffle=False, verbose=0)
    model = accumulated_model(mirrored(2), "sgd", steps=4, cls=keras.Model)
    initial = model.get_weights()
    model.fit(x[:24], y[:24], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.pending_micro_steps.numpy()) == 3
    assert int(model.optimizer.iterations.numpy()) == 0
    assert max_abs_diff(initial, model.get_weights()) == 0
    model.fit(x[24:32], y[24:32], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert int(model.optimizer.pending_micro_steps.numpy()) == 0
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6


def test_reset_accumulation_discards_pending_gradients(mirrored):
    x, y = make_data()
    # A plain keras.Model keeps the window pending after fit.
    model = accumulated_model(mirrored(2), "sgd", steps=4, cls=keras.Model)
    model.fit(x[:16], y[:16], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.pending_micro_steps.numpy()) == 2
    model.optimizer.reset_accumulation()
    assert int(model.optimizer.pending_micro_steps.numpy()) == 0
    reference = compile_model(mlp(), OPTIMIZERS["sgd"]())
    reference.fit(x[16:48], y[16:48], batch_size=32, epochs=1, shuffle=False, verbose=0)
    model.fit(x[16:48], y[16:48], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6


def test_changing_steps_during_fit_does_not_retrace(mirrored):
    x, y = make_data(n=96)
    hook = CountingHook()
    strategy = mirrored(2)
    with strategy.scope():
        model = mlp(keras_dist.DistributedModel)
        model.register_all_reduce_hook(hook)
        optimizer = keras_dist.GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.1), accumulation_steps=1
        )
        compile_model(model, optimizer)

    class GrowSteps(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.optimizer.accumulation_steps = 3

    # Epoch 1: 6 micro-steps with k=1 -> 6 updates. Epoch 2: k=3 -> 2 updates.
    model.fit(x, y, batch_size=16, epochs=2, callbacks=[GrowSteps()], verbose=0)
    assert int(optimizer.iterations.numpy()) == 8
    assert optimizer.accumulation_steps == 3
    # One trace per replica of the train step and one of the function that
    # applies a partial window at an epoch's end: no retrace.
    assert hook.traces == 4
    assert optimizer.get_config()["accumulation_steps"] == 3


# --- Mixed precision ---


def test_mixed_float16_puts_loss_scaling_inside_accumulation(mirrored):
    x, y = make_data()
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        reference = compile_model(mlp(), OPTIMIZERS["sgd"]())
        reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        model = accumulated_model(mirrored(2), "sgd", steps=2)
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        plain = accumulated_model(mirrored(2), "sgd", steps=2, cls=keras.Model)
        plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    finally:
        keras.config.set_dtype_policy(previous)
    optimizer = model.optimizer
    assert isinstance(optimizer, keras_dist.GradientAccumulationOptimizer)
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.LossScaleOptimizer)
    assert all(np.isfinite(history.history["loss"]))
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-3
    # A plain keras.Model keeps Keras's order: LossScaleOptimizer outside.
    assert isinstance(plain.optimizer, keras.optimizers.LossScaleOptimizer)
    assert max_abs_diff(reference.get_weights(), plain.get_weights()) < 1e-3


# --- What the inner optimizer owns: weight-decay exclusions, loss scale ---


def _decaying_sgd(wrap=None):
    """SGD with weight decay but not on the biases, and a loss scale factor.

    `wrap(optimizer)` wraps it before the exclusion is set (on the wrapper)
    and before a `LossScaleOptimizer` (which clears the factor) goes around.
    """
    optimizer = keras.optimizers.SGD(
        0.1, momentum=0.9, weight_decay=0.05, loss_scale_factor=8.0
    )
    if wrap is not None:
        optimizer = wrap(optimizer)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return keras.optimizers.LossScaleOptimizer(optimizer)


def test_exclude_from_weight_decay_reaches_the_inner_optimizer():
    # Keras's `test_weight_decay` in every optimizer test file: the excluded
    # variable keeps its value (it used to decay to 1.8).
    results = []
    for wrap in (False, True):
        optimizer = keras.optimizers.SGD(1.0, weight_decay=0.1)
        if wrap:
            optimizer = keras_dist.GradientAccumulationOptimizer(optimizer, 1)
        kept = keras.Variable([[2.0]], name="exclude")
        decayed = keras.Variable([[2.0]], name="decay")
        optimizer.exclude_from_weight_decay(var_names=["exclude"])
        optimizer.apply([tf.zeros((1, 1)), tf.zeros((1, 1))], [kept, decayed])
        results.append((kept.numpy(), decayed.numpy()))
    assert results[1][0] == pytest.approx(2.0)
    assert results[1][1] == pytest.approx(1.8)
    np.testing.assert_allclose(results[0], results[1], atol=1e-7)


@pytest.mark.parametrize("outer", ["loss_scale_optimizer", "set_by_wrapper"])
def test_inner_loss_scale_factor_unscales_once(outer):
    # Keras's `test_finite_step_with_inner_loss_scale_stateful` and
    # `MultiOptimizer`'s `test_gradient_unscaling`: a wrapper that sets the
    # factor on our optimizer sets it on the inner one, which unscales.
    def run(wrap):
        inner = keras.optimizers.SGD(0.5, loss_scale_factor=100)
        optimizer = (
            keras_dist.GradientAccumulationOptimizer(inner, 1) if wrap else inner
        )
        if outer == "loss_scale_optimizer":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
            scale = optimizer.initial_scale
        else:
            optimizer.loss_scale_factor = 5.0
            scale = 5.0
        assert inner.loss_scale_factor == (None if scale != 5.0 else 5.0)
        variable = keras.Variable([1.0, 2.0, 3.0, 4.0])
        optimizer.build([variable])
        optimizer.apply([tf.constant([1.0, 6.0, 7.0, 2.0]) * scale], [variable])
        return variable.numpy()

    np.testing.assert_allclose(run(wrap=True), run(wrap=False), atol=1e-7)
    if outer == "loss_scale_optimizer":
        np.testing.assert_allclose(run(wrap=True), [0.5, -1.0, -0.5, 3.0])


def test_loss_scale_factor_is_refused_on_the_wrapper():
    with pytest.raises(ValueError, match="on the `inner_optimizer`"):
        keras_dist.GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.1), 2, loss_scale_factor=10.0
        )


@pytest.mark.parametrize("steps", [1, 4])
def test_decay_exclusion_and_inner_loss_scale_on_two_replicas(steps, mirrored):
    # Under a real 2-replica `fit`, with accumulation 1 and 4: the stock
    # optimizer's weights on one device with the big batch.
    x, y = make_data(n=128)
    reference = compile_model(mlp(), _decaying_sgd())
    reference.fit(x, y, batch_size=16 * steps, epochs=2, shuffle=False, verbose=0)
    strategy = mirrored(2)
    with strategy.scope():
        optimizer = _decaying_sgd(
            lambda inner: keras_dist.GradientAccumulationOptimizer(inner, steps)
        )
        model = compile_model(mlp(keras_dist.DistributedModel), optimizer)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 16 // steps
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6
    # The exclusion mattered: without it the biases end elsewhere.
    undecayed = compile_model(
        mlp(),
        keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.05),
    )
    undecayed.fit(x, y, batch_size=16 * steps, epochs=2, shuffle=False, verbose=0)
    assert max_abs_diff(undecayed.get_weights(), model.get_weights()) > 1e-4


# --- Serialization ---


def test_config_round_trip():
    optimizer = keras_dist.GradientAccumulationOptimizer(
        keras.optimizers.AdamW(0.01, weight_decay=0.2),
        accumulation_steps=3,
        all_reduce_hook=keras_dist.compression.NoCompression(),
        name="acc",
    )
    config = optimizer.get_config()
    assert set(config) == {
        "name",
        "inner_optimizer",
        "accumulation_steps",
        "all_reduce_hook",
    }
    # from_config and keras.saving give an equal config (the helper).
    clone = assert_config_round_trip(optimizer)
    assert clone.accumulation_steps == 3
    assert clone.name == "acc"
    assert isinstance(clone.inner_optimizer, keras.optimizers.AdamW)
    assert clone.inner_optimizer.weight_decay == pytest.approx(0.2)
    assert isinstance(clone.all_reduce_hook, keras_dist.compression.NoCompression)


def test_keras_file_mid_accumulation_resumes_the_cycle(tmp_path):
    x, y = make_data()
    reference = compile_model(mlp(), OPTIMIZERS["adam"]())
    reference.fit(x[:32], y[:32], batch_size=32, epochs=1, shuffle=False, verbose=0)
    # A plain keras.Model: its fit leaves the window pending.
    model = accumulated_model(
        tf.distribute.get_strategy(), "adam", steps=4, cls=keras.Model
    )
    model.fit(x[:16], y[:16], batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "mid.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.optimizer, keras_dist.GradientAccumulationOptimizer)
    assert int(loaded.optimizer.pending_micro_steps.numpy()) == 2
    loaded.fit(x[16:32], y[16:32], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == 1
    assert max_abs_diff(reference.get_weights(), loaded.get_weights()) < 1e-6


def test_checkpoint_mid_accumulation_restores_on_two_replicas(tmp_path, mirrored):
    x, y = make_data()
    reference = compile_model(mlp(), OPTIMIZERS["momentum"]())
    reference.fit(x[:32], y[:32], batch_size=32, epochs=1, shuffle=False, verbose=0)
    # A plain keras.Model: its fit leaves the window pending.
    first = accumulated_model(mirrored(2), "momentum", steps=2, cls=keras.Model)
    first.fit(x[:16], y[:16], batch_size=16, epochs=1, shuffle=False, verbose=0)
    accumulators = first.optimizer._accumulators
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(
        str(tmp_path / "ckpt")
    )
    strategy = mirrored(2)
    second = accumulated_model(strategy, "momentum", steps=2, cls=keras.Model)
    with strategy.scope():
        second.optimizer.build(second.trainable_variables)
    tf.train.Checkpoint(model=second, optimizer=second.optimizer).restore(
        path
    ).assert_existing_objects_matched()
    assert int(second.optimizer.pending_micro_steps.numpy()) == 1
    np.testing.assert_allclose(
        accumulators[0].numpy(), second.optimizer._accumulators[0].numpy(), atol=1e-7
    )
    second.fit(x[16:32], y[16:32], batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), second.get_weights()) < 1e-6


# --- Hooks and bad input ---


def test_hook_given_to_optimizer_is_used_by_plain_model(mirrored):
    x, y = make_data()
    hook = CountingHook()
    with mirrored(2).scope():
        optimizer = keras_dist.GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.1), accumulation_steps=2, all_reduce_hook=hook
        )
        model = compile_model(mlp(), optimizer)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert int(hook.reductions.numpy()) == 2 * 2


def test_hooks_on_model_and_optimizer_conflict(mirrored):
    x, y = make_data()
    with mirrored(2).scope():
        model = mlp(keras_dist.DistributedModel)
        model.register_all_reduce_hook(CountingHook())
        compile_model(
            model,
            keras_dist.GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.1), all_reduce_hook=CountingHook()
            ),
        )
    with pytest.raises(ValueError, match="Set the hook in one place"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"accumulation_steps": 0}, ValueError, "accumulation_steps=0"),
        ({"accumulation_steps": 2.5}, TypeError, "accumulation_steps=2.5"),
        ({"accumulation_steps": True}, TypeError, "accumulation_steps=True"),
        ({"accumulation_steps": 2**63}, ValueError, r"must be an int >= 1 and <="),
        ({"clipnorm": 1.0}, ValueError, "Set `clipnorm` on the `inner_optimizer`"),
        ({"unknown": 1}, ValueError, "does not support arguments: `unknown`"),
        ({"all_reduce_hook": "fp16"}, TypeError, "all_reduce_hook='fp16'"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        keras_dist.GradientAccumulationOptimizer(keras.optimizers.SGD(), **kwargs)


def test_numpy_accumulation_steps_are_accepted():
    optimizer = keras_dist.GradientAccumulationOptimizer(
        keras.optimizers.SGD(), accumulation_steps=np.int64(4)
    )
    assert optimizer.accumulation_steps == 4
    assert type(optimizer.get_config()["accumulation_steps"]) is int


def test_bad_inner_optimizer():
    with pytest.raises(TypeError, match="inner_optimizer='adam'"):
        keras_dist.GradientAccumulationOptimizer("adam")
    once = keras_dist.GradientAccumulationOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="already accumulates"):
        keras_dist.GradientAccumulationOptimizer(once)
    with pytest.raises(ValueError, match="keras-team/keras#20582"):
        keras_dist.GradientAccumulationOptimizer(
            keras.optimizers.SGD(gradient_accumulation_steps=2)
        )


def test_state_before_build_is_a_clear_error():
    optimizer = keras_dist.GradientAccumulationOptimizer(keras.optimizers.SGD())
    with pytest.raises(RuntimeError, match="needs a built optimizer"):
        optimizer.micro_steps  # noqa: B018
    with pytest.raises(TypeError, match="accumulation_steps='4'"):
        optimizer.accumulation_steps = "4"


def test_inner_optimizer_created_outside_the_scope_is_refused(mirrored):
    x, y = make_data()
    inner = keras.optimizers.SGD(0.1)
    with mirrored(2).scope():
        model = compile_model(
            mlp(keras_dist.DistributedModel),
            keras_dist.GradientAccumulationOptimizer(inner, accumulation_steps=2),
        )
    with pytest.raises(ValueError, match="created outside the strategy scope"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


# --- What Keras's optimizer tests expect of any optimizer ---


def test_set_weights_sets_the_inner_optimizers_state_too():
    # Keras's optimizer_test.py::test_set_weights: `variables` lists the
    # wrapper's and the inner optimizer's; `set_weights` sets all of them.
    variable = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
    optimizer = keras_dist.GradientAccumulationOptimizer(
        keras.optimizers.Adam(0.1), accumulation_steps=1
    )
    optimizer.apply([tf.ones((2, 2))], [variable])
    saved = [np.array(v.numpy()) for v in optimizer.variables]
    optimizer.apply([tf.ones((2, 2))], [variable])
    optimizer.set_weights(saved)
    for value, restored in zip(saved, optimizer.variables):
        np.testing.assert_array_equal(value, restored.numpy())
    assert int(optimizer.iterations.numpy()) == 1
    with pytest.raises(ValueError, match="one value per variable"):
        optimizer.set_weights(saved[:-1])


def test_no_gradient_at_all_is_keras_error_and_a_missing_one_its_warning():
    # Keras's test_empty_gradients and test_mixed_with_tf_variables.
    variable = keras.Variable([[3.0, 4.0]])
    optimizer = keras_dist.GradientAccumulationOptimizer(keras.optimizers.SGD(1.0), 1)
    with pytest.raises(ValueError, match=r"No gradients provided for any variable\."):
        optimizer.apply_gradients([(None, variable)])
    tf_variable = tf.Variable([[1.0, 2.0]])
    with pytest.warns(UserWarning, match="Gradients do not exist for variables"):
        optimizer.apply_gradients([(tf.ones((1, 2)), variable), (None, tf_variable)])
    np.testing.assert_allclose(variable.numpy(), [[2.0, 3.0]])
    np.testing.assert_allclose(tf_variable.numpy(), [[1.0, 2.0]])


def test_numpy_and_list_gradients_are_accepted_as_by_keras():
    # A plain optimizer takes NumPy arrays, Python lists and IndexedSlices
    # of NumPy values; so does the wrapper (the hook works on tensors).
    results = []
    for wrap in (False, True):
        dense = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
        rows = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
        optimizer = keras.optimizers.SGD(0.5)
        if wrap:
            optimizer = keras_dist.GradientAccumulationOptimizer(optimizer, 1)
        sparse = tf.IndexedSlices(
            np.array([[1.0, 1.0]], "float32"), np.array([1]), np.array([2, 2])
        )
        optimizer.apply_gradients([([[1.0, 1.0], [2.0, 2.0]], dense), (sparse, rows)])
        results.append((dense.numpy(), rows.numpy()))
    np.testing.assert_allclose(results[0], results[1])


def test_the_optimizer_is_built_on_every_trainable_variable(tmp_path):
    # A weight without a gradient: the optimizer still holds state for it
    # (as stock Keras's does), so a saved model's optimizer loads whole.
    class Unused(keras.layers.Layer):
        def build(self, input_shape):
            self.unused = self.add_weight(shape=(2,), initializer="ones")
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = keras_dist.DistributedModel(inputs, Unused()(inputs))
    model.compile(keras.optimizers.Adam(0.1), "mse")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    with pytest.warns(UserWarning, match="Gradients do not exist for variables"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    stock = keras.Model(inputs, model.outputs)
    stock.compile(keras.optimizers.Adam(0.1), "mse")
    stock.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert len(model.optimizer.variables) == len(stock.optimizer.variables)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, custom_objects={"Unused": Unused})
    assert int(loaded.optimizer.iterations.numpy()) == 1
