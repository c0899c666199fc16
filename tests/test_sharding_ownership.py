"""`ShardedOptimizer(..., shard_by="variables")`: optimizers that need a whole
variable (Adafactor's factored moments, Lamb's trust ratio, Muon's
orthogonalized update), sharded by whole variables, train as unsharded.

Each is compared with the same training unsharded on the same replicas
(the same summed gradients: equal to 1e-6; it is 0 on this machine) and on
one device (the replicas' float32 sums differ from one device's by
rounding, which Muon's Newton-Schulz iteration grows to ~2e-6). Their run on
2 worker processes shares test_sharding.py's launch.
"""

import contextlib
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import Boom, compile_model, make_data, max_abs_diff, mlp
from sharding_workers import INNER, OWNED

import keras_dist
from keras_dist.backup import store as _backup
from keras_dist.callbacks import BackupAndRestore
from keras_dist.core.sharding import OwnerLayout

EXAMPLES = 192  # 12 updates of 16 per epoch
EPOCHS = 2
ONE_DEVICE_TOLERANCE = {"adafactor": 1e-6, "lamb": 1e-6, "muon": 5e-6}


def fit(strategy, make_optimizer, batch_size=16, epochs=EPOCHS, model=None):
    """Fits `mlp` (or `model`, further) under `strategy` (`None`: one device)."""
    x, y = make_data(n=EXAMPLES)
    if model is None:
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = compile_model(mlp(keras_dist.DistributedModel), make_optimizer())
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


@functools.cache
def one_device(name):
    """The weights of `OWNED[name]` trained unsharded on one device."""
    return fit(None, lambda: OWNED[name](keras)).get_weights()


@functools.cache
def uninterrupted(mirrored, replicas):
    """The weights of Adafactor by variables trained without a crash on
    `replicas` replicas (the resume tests' reference), once per count."""
    return fit(mirrored(replicas), by_variables("adafactor")).get_weights()


def by_variables(name):
    return lambda: keras_dist.ShardedOptimizer(OWNED[name](keras), shard_by="variables")


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("name", sorted(OWNED))
def test_whole_variable_optimizers_equal_unsharded(name, replicas, mirrored):
    strategy = mirrored(replicas)
    model = fit(strategy, by_variables(name))
    assert model.optimizer.shard_by == "variables"
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * 12
    same_replicas = fit(strategy, lambda: OWNED[name](keras))
    assert max_abs_diff(same_replicas.get_weights(), model.get_weights()) < 1e-6
    tolerance = ONE_DEVICE_TOLERANCE[name]
    assert max_abs_diff(one_device(name), model.get_weights()) < tolerance


@pytest.mark.parametrize("name", ["adamw", "global_clipnorm", "clipnorm"])
def test_weight_decay_and_clipping_act_as_unsharded_on_whole_variables(name, mirrored):
    # Elementwise optimizers sharded by variables on purpose: the owner's
    # weight decay, per-variable and global clipping are Keras's.
    strategy = mirrored(2)
    model = fit(
        strategy,
        lambda: keras_dist.ShardedOptimizer(INNER[name](keras), shard_by="variables"),
    )
    reference = fit(strategy, lambda: INNER[name](keras))
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6


@pytest.mark.parametrize("replicas", [2, 4])
def test_accumulation_around_whole_variables_equals_the_big_batch(replicas, mirrored):
    # 4 micro-steps of 4 examples: one update of 16, as the reference.
    reference = fit(mirrored(replicas), lambda: OWNED["adafactor"](keras))
    model = fit(
        mirrored(replicas),
        lambda: keras_dist.GradientAccumulationOptimizer(
            by_variables("adafactor")(), 4
        ),
        batch_size=4,
    )
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * 12
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6


def test_each_replica_keeps_the_state_of_its_own_variables(mirrored):
    strategy = mirrored(2)
    model = fit(strategy, by_variables("adafactor"), epochs=1)
    owned = model.optimizer._owned
    # mlp's kernels are 128 and 48 elements, its biases 16 and 3: the
    # largest first, each to the replica owning fewer elements so far.
    assert owned.layout.owners == [0, 1, 1, 1]
    assert owned.layout.slice_size == 128
    for index, optimizer in owned.optimizers.items():
        device = strategy.extended.worker_devices[owned.layout.owners[index]]
        assert all(v.value.device == device for v in optimizer.variables)
    # Together the replicas hold each variable's state once: Adafactor's
    # unsharded state, and no more.
    unsharded = OWNED["adafactor"](keras)
    unsharded.build(model.trainable_variables)
    size = sum(int(np.prod(v.shape)) for i in owned.optimizers for v in owned.slots(i))
    assert size == sum(
        int(np.prod(v.shape))
        for v in unsharded.variables
        if v is not unsharded.iterations and v is not unsharded._learning_rate
    )


def test_auto_shards_whole_variables_only_where_elements_cannot_be():
    assert keras_dist.ShardedOptimizer(keras.optimizers.Adam()).shard_by == "elements"
    for name in OWNED:
        assert keras_dist.ShardedOptimizer(OWNED[name](keras)).shard_by == "variables"
    forced = keras_dist.ShardedOptimizer(keras.optimizers.Adam(), shard_by="variables")
    assert forced.shard_by == "variables"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shard_by": "rows"}, "`shard_by` must be one of"),
        ({"shard_by": "variables", "accumulation_steps": 2}, "GradientAccumulation"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        keras_dist.ShardedOptimizer(keras.optimizers.Adafactor(), **kwargs)


def test_embeddings_and_mixed_precision_train_as_unsharded(mirrored):
    strategy = mirrored(2)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 20, size=(EXAMPLES, 4))
    labels = rng.integers(0, 3, size=(EXAMPLES,))

    def model(optimizer):
        keras.utils.set_random_seed(2)
        inputs = keras.Input((4,), dtype="int32")
        rows = keras.layers.Embedding(20, 8)(inputs)
        outputs = keras.layers.Dense(3)(keras.layers.Flatten()(rows))
        return compile_model(keras_dist.DistributedModel(inputs, outputs), optimizer)

    results = {}
    for policy in ("float32", "mixed_float16"):
        keras.mixed_precision.set_dtype_policy(policy)
        try:
            for sharded in (False, True):
                with strategy.scope():
                    inner = keras.optimizers.Lamb(0.01)
                    m = model(
                        keras_dist.ShardedOptimizer(inner, shard_by="variables")
                        if sharded
                        else inner
                    )
                m.fit(ids, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)
                results[policy, sharded] = m.get_weights()
        finally:
            keras.mixed_precision.set_dtype_policy("float32")
    for policy in ("float32", "mixed_float16"):
        diff = max_abs_diff(results[policy, False], results[policy, True])
        assert diff < 1e-6, policy


def test_the_fp16_hook_sends_the_blocks_in_16_bits(mirrored):
    strategy = mirrored(2)
    exact = fit(strategy, lambda: keras.optimizers.SGD(0.1), epochs=2)
    x, y = make_data(n=EXAMPLES)
    hook = keras_dist.compression.FP16()
    with strategy.scope():
        optimizer = keras_dist.ShardedOptimizer(
            keras.optimizers.SGD(0.1), shard_by="variables"
        )
        model = compile_model(mlp(keras_dist.DistributedModel), optimizer)
        model.register_all_reduce_hook(hook)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert hook.stats().ratio == pytest.approx(2.0)
    # Only each replica's cast rounds (plain SGD shows its size): close to
    # the exact run, not equal to it.
    assert 0 < max_abs_diff(exact.get_weights(), model.get_weights()) < 1e-4


def test_a_keras_file_saved_on_two_replicas_resumes_on_four_and_one(tmp_path, mirrored):
    reference = fit(mirrored(2), lambda: OWNED["lamb"](keras), epochs=1)
    model = fit(mirrored(2), by_variables("lamb"), epochs=1)
    model.save(tmp_path / "model.keras")
    fit(None, None, epochs=1, model=reference)
    for replicas in (4, 1):
        with mirrored(replicas).scope():
            loaded = keras.saving.load_model(tmp_path / "model.keras")
        assert loaded.optimizer.shard_by == "variables"
        fit(None, None, epochs=1, model=loaded)
        assert max_abs_diff(reference.get_weights(), loaded.get_weights()) < 1e-6


def backed_up_fit(strategy, folder, crash_at=None, extra=()):
    """`fit` of Adafactor by variables with `BackupAndRestore` (a backup
    every 5 batches) and `extra` callbacks after it, stopped by `Boom` after
    `crash_at` batches; returns the model."""
    x, y = make_data(n=EXAMPLES)
    with strategy.scope():
        model = compile_model(
            mlp(keras_dist.DistributedModel), by_variables("adafactor")()
        )
    callbacks = [BackupAndRestore(folder, save_freq=5), *extra]
    if crash_at:
        callbacks.append(Boom(crash_at))
    with contextlib.suppress(KeyboardInterrupt):
        model.fit(
            x,
            y,
            batch_size=16,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
    return model


@pytest.mark.parametrize(("before", "after"), [(2, 2), (2, 4), (2, 1)])
def test_backup_and_restore_resumes_the_owned_state_exactly(
    tmp_path, mirrored, before, after
):
    # Each replica's variables' state is saved whole and restored onto
    # whichever replica owns the variable on the new count (none: one
    # device without a strategy owns everything).
    folder = str(tmp_path / "backup")
    crashed = backed_up_fit(mirrored(before), folder, crash_at=17)
    assert int(crashed.optimizer.iterations.numpy()) == 17
    _, manifest, _ = _backup.read_latest(folder)
    owned = [e for e in manifest["variables"] if e["rule"] == "owned"]
    assert len(owned) == len(crashed.optimizer._owned.state_handles()) > 0
    strategy = mirrored(after) if after > 1 else tf.distribute.get_strategy()
    resumed = backed_up_fit(strategy, folder)
    assert int(resumed.optimizer.iterations.numpy()) == EPOCHS * 12
    # The same replicas sum the same gradients: equal; another count sums
    # them in another order (float32 rounding, as the elastic tests allow).
    tolerance = 1e-6 if after == before else 1e-5
    reference = uninterrupted(mirrored, before)
    assert max_abs_diff(reference, resumed.get_weights()) < tolerance


def test_a_fresh_owned_state_would_differ(tmp_path, mirrored):
    # What the resume test guards: the same resume with the owners' state
    # reset (what a backup without it would give) does not match.
    folder = str(tmp_path / "backup")
    backed_up_fit(mirrored(2), folder, crash_at=17)

    class ResetOwned(keras.callbacks.Callback):
        done = False

        # Once, after BackupAndRestore restored (callbacks run in order).
        def on_train_batch_begin(self, batch, logs=None):
            if self.done or self.model.optimizer.iterations.numpy() != 15:
                return
            self.done = True
            for _, handle in self.model.optimizer.owned_state:
                if handle.local:
                    handle.assign(np.zeros(handle.shape, handle.dtype.as_numpy_dtype))

    reset = ResetOwned()
    model = backed_up_fit(mirrored(2), folder, extra=[reset])
    assert reset.done  # it resumed at the backup of step 15
    assert max_abs_diff(uninterrupted(mirrored, 2), model.get_weights()) > 1e-4


def test_the_layout_balances_whole_variables_and_packs_blocks():
    layout = OwnerLayout([(10, 4), (3,), (7, 2), (5,), ()], replicas=3)
    # 40, 3, 14, 5 and 1 elements: the largest first, each to the replica
    # owning the fewest elements so far.
    assert layout.owners == [0, 2, 1, 2, 2]
    assert layout.loads == [40, 14, 9]
    assert layout.slice_size == 40
    tensors = [np.full(s, i + 1.0, np.float32) for i, s in enumerate(layout.shapes)]
    (flat,) = layout.segment_flats(tensors)
    blocks = np.asarray(flat).reshape(3, 40)
    for replica in range(3):
        unpacked = layout.unpack(replica, blocks[replica])
        for index, value in zip(layout.owned[replica], unpacked):
            np.testing.assert_array_equal(value, tensors[index])
    for index, value in enumerate(layout.unpack_all(blocks)):
        np.testing.assert_array_equal(value, tensors[index])
    # More replicas than variables: a replica may own nothing.
    assert OwnerLayout([(4,)], replicas=2).owned == [[0], []]


def test_a_checkpoint_restores_the_owned_state_on_another_replica_count(
    tmp_path, mirrored
):
    model = fit(mirrored(2), by_variables("adafactor"), epochs=1)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        str(tmp_path / "checkpoint")
    )
    with mirrored(4).scope():
        restored = compile_model(
            mlp(keras_dist.DistributedModel), by_variables("adafactor")()
        )
        restored.optimizer.build(restored.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=restored, optimizer=restored.optimizer)
    checkpoint.read(path).assert_consumed()
    saved, loaded = model.optimizer._owned, restored.optimizer._owned
    assert loaded.layout.owners != saved.layout.owners
    for index in range(len(saved.variables)):
        assert (
            max_abs_diff(
                [v.numpy() for v in saved.slots(index)],
                [v.numpy() for v in loaded.slots(index)],
            )
            == 0
        )


@pytest.mark.parametrize("replicas", [2, None], ids=["mirrored", "no_strategy"])
def test_a_plain_keras_model_trains_sharded_by_variables(replicas, mirrored):
    # keras.Model's own train_step calls `apply`; without a strategy there
    # is one replica, which owns everything.
    x, y = make_data(n=64)
    results = []
    for optimizer in (by_variables("adafactor"), lambda: OWNED["adafactor"](keras)):
        scope = mirrored(replicas).scope() if replicas else contextlib.nullcontext()
        with scope:
            model = compile_model(mlp(), optimizer())
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        results.append(model.get_weights())
    assert max_abs_diff(*results) < 1e-6


def test_clipping_an_embeddings_rows_by_norm_is_refused(mirrored):
    # Keras counts a repeated row's norm per occurrence; the owner gets the
    # rows as they are, so norm clipping is refused by name (clipvalue acts).
    keras.utils.set_random_seed(2)
    inputs = keras.Input((4,), dtype="int32")
    rows = keras.layers.Flatten()(keras.layers.Embedding(20, 8)(inputs))
    with mirrored(2).scope():
        model = compile_model(
            keras_dist.DistributedModel(inputs, keras.layers.Dense(3)(rows)),
            keras_dist.ShardedOptimizer(keras.optimizers.Lamb(global_clipnorm=1.0)),
        )
    ids = np.random.default_rng(0).integers(0, 20, size=(32, 4))
    with pytest.raises(ValueError, match=r"cannot clip by norm.*embedding"):
        model.fit(ids, ids[:, 0] % 3, batch_size=16, epochs=1, verbose=0)
