"""Regression tests for four `ShardedOptimizer` defects found for issue 28.

1. `tf.train.Checkpoint` kept one replica's slice: the slices are
   replica-local variables, which TensorFlow writes as their first
   replica's value. They are now written whole and resharded on restore,
   on the same or another replica count.
2. A plain `keras.Model` under `mixed_float16` given
   `ShardedOptimizer(LossScaleOptimizer(inner))` trained silently wrong:
   Keras's `compile` wraps it in a second `LossScaleOptimizer` and the
   gradients were unscaled twice. It is now refused by name.
3. `BackupAndRestore` failed on one device without a strategy: the
   parameter slice is an ordinary variable there and was given the
   inventory's `"shard"` rule.
4. Building the optimizer made per-element NumPy arrays it did not need
   (a variable index for `clipnorm`, float64 zeros for the slice).
"""

import tracemalloc

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import compile_model, make_data, max_abs_diff, mlp

import keras_dist


def sharded_model(strategy, seed=1):
    with strategy.scope():
        optimizer = keras_dist.ShardedOptimizer(keras.optimizers.Adam(0.01))
        model = compile_model(mlp(keras_dist.DistributedModel, seed=seed), optimizer)
        optimizer.build(model.trainable_variables)
    return model, optimizer


def slot_slices(strategy, optimizer):
    """Every replica's slice of each of Adam's moments, joined."""
    return [
        np.concatenate(
            [c.numpy() for c in strategy.experimental_local_results(v.value)]
        )
        for v in optimizer.inner_optimizer.variables
        if tuple(v.shape) != ()
    ]


def trained_and_saved(tmp_path, strategy):
    x, y = make_data(n=64)
    model, optimizer = sharded_model(strategy)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
        str(tmp_path / "ckpt")
    )
    return model, optimizer, path


def test_checkpoint_restores_every_replicas_slice(tmp_path, mirrored):
    strategy = mirrored(2)
    model, optimizer, path = trained_and_saved(tmp_path, strategy)
    restored, restored_optimizer = sharded_model(strategy, seed=5)
    tf.train.Checkpoint(model=restored, optimizer=restored_optimizer).restore(path)
    assert max_abs_diff(model.get_weights(), restored.get_weights()) == 0
    for saved, loaded in zip(
        slot_slices(strategy, optimizer), slot_slices(strategy, restored_optimizer)
    ):
        # Replica 1's half of each moment was replica 0's after the restore.
        np.testing.assert_array_equal(loaded, saved)


def test_checkpoint_restored_before_the_optimizer_is_built(tmp_path, mirrored):
    # tf.train.Checkpoint restores a variable when it is created (deferred
    # restoration): the slices are resharded as they are built, on 4.
    x, y = make_data(n=64)
    model, _, path = trained_and_saved(tmp_path, mirrored(2))
    with mirrored(4).scope():
        optimizer = keras_dist.ShardedOptimizer(keras.optimizers.Adam(0.01))
        restored = compile_model(mlp(keras_dist.DistributedModel, seed=5), optimizer)
    tf.train.Checkpoint(model=restored, optimizer=optimizer).restore(path)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    restored.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_abs_diff(model.get_weights(), restored.get_weights()) < 1e-6


def test_checkpoint_saved_on_two_replicas_resumes_on_four(tmp_path, mirrored):
    x, y = make_data(n=64)
    model, _, path = trained_and_saved(tmp_path, mirrored(2))
    strategy = mirrored(4)
    restored, restored_optimizer = sharded_model(strategy, seed=5)
    tf.train.Checkpoint(model=restored, optimizer=restored_optimizer).restore(path)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    restored.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_abs_diff(model.get_weights(), restored.get_weights()) < 1e-6


def test_plain_model_under_mixed_float16_refuses_loss_scaling_inside(mirrored):
    strategy = mirrored(2)
    x, y = make_data(n=64)
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        with strategy.scope():
            model = compile_model(
                mlp(),
                keras_dist.ShardedOptimizer(
                    keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01))
                ),
            )
        # Keras's compile wrapped it in a second LossScaleOptimizer, whose
        # scale the loss gets: unscaling by the inner one too was wrong.
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        with pytest.raises(ValueError, match="a loss it did not scale"):
            model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


def test_plain_model_scaling_through_the_sharded_optimizer_trains_unsharded(
    mirrored,
):
    # Without Keras's own wrapping, the model's train_step scales the loss
    # through ShardedOptimizer.scale_loss: the inner scaler's scale.
    strategy = mirrored(2)
    x, y = make_data(n=64)
    with strategy.scope():
        reference = compile_model(mlp(), keras.optimizers.Adam(0.01))
        model = compile_model(
            mlp(),
            keras_dist.ShardedOptimizer(
                keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01))
            ),
        )
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5


def test_backup_and_restore_without_a_strategy(tmp_path):
    x, y = make_data(n=64)
    reference = compile_model(
        mlp(keras_dist.DistributedModel), keras.optimizers.Adam(0.01)
    )
    model = compile_model(
        mlp(keras_dist.DistributedModel),
        keras_dist.ShardedOptimizer(keras.optimizers.Adam(0.01)),
    )
    backup = keras_dist.callbacks.BackupAndRestore(str(tmp_path), save_freq=2)
    model.fit(
        x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[backup]
    )
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6


def test_building_keeps_no_per_element_numpy_arrays():
    inputs = keras.Input((1000,))
    model = keras.Model(inputs, keras.layers.Dense(1000)(inputs))
    parameters = model.count_params()
    optimizer = keras_dist.ShardedOptimizer(keras.optimizers.Adam())
    tracemalloc.start()
    try:
        optimizer.build(model.trainable_variables)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The slice and Adam's slots are TensorFlow's memory, not NumPy's: what
    # NumPy holds is overhead. A float64 array of zeros for the slice (8
    # bytes per element of it) is the most `build` should need at once.
    assert kept < parameters, kept / parameters  # was ~8 bytes per parameter
    assert peak < 9 * parameters, peak / parameters  # was ~24
