"""Ordinary variations users meet in their first week, each as it was
found: an `Embedding`, a frozen layer, an unused weight, a dataset that does
not divide by the batch, a batch-then-shuffle pipeline, an elastic resume
with accumulation. Each gave a wrong result (most of them silently) before
keras_dist handled it; the differential matrix (`test_matrix.py`) covers
the same ground in general, these pin the reproductions.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import SEGMENT_BYTES, Boom, max_abs_diff

import keras_dist
from keras_dist.backup.store import BackupError

# --- Sparse gradients ------------------------------------------------------------


def embedding_model(base=keras.Model):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Flatten()(keras.layers.Embedding(10, 4)(inputs))
    return base(inputs, keras.layers.Dense(3)(hidden))


def embedding_data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 10, size=(64, 6)).astype("int32")
    y = rng.normal(size=(64, 3)).astype("float32")
    return x, y


def trained(model, optimizer, batch_size=32, epochs=3):
    model.compile(optimizer, "mse")
    x, y = embedding_data()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.fixture(scope="module")
def stock_adam():
    return trained(embedding_model(), keras.optimizers.Adam(0.01))


@pytest.mark.parametrize(
    "piece",
    ["sharded", "accumulate_1", "fp16", "bf16", "accumulate_sharded_1"],
)
@pytest.mark.parametrize("replicas", [1, 2])
def test_an_embedding_trains_as_stock_adam(piece, replicas, mirrored, stock_adam):
    # An Embedding fed ids that repeat within a batch: Keras's Adam squares
    # each occurrence of a row; a densified gradient squares the row's sum
    # (4.3e-2 apart after 3 epochs before the pieces kept the rows).
    strategy = mirrored(replicas)
    with strategy.scope():
        hook = {"fp16": keras_dist.compression.FP16(), "bf16": None}.get(piece)
        if piece == "bf16":
            hook = keras_dist.compression.BF16()
        model = embedding_model(keras_dist.DistributedModel)
        if hook is not None:
            model.register_all_reduce_hook(hook)
        adam = keras.optimizers.Adam(0.01)
        optimizer = {
            "sharded": lambda: keras_dist.ShardedOptimizer(
                adam, bucket_bytes=SEGMENT_BYTES
            ),
            "accumulate_1": lambda: keras_dist.GradientAccumulationOptimizer(adam, 1),
            "accumulate_sharded_1": lambda: keras_dist.GradientAccumulationOptimizer(
                keras_dist.ShardedOptimizer(adam, bucket_bytes=SEGMENT_BYTES), 1
            ),
        }.get(piece, lambda: adam)()
    # The casts send the embedding's rows at full precision; on 2 replicas
    # the dense layer's gradient is rounded to 16 bits on the wire.
    tolerance = {"fp16": 1e-3, "bf16": 2e-2}.get(piece) if replicas > 1 else None
    assert max_abs_diff(trained(model, optimizer), stock_adam) < (tolerance or 1e-6)


@pytest.mark.parametrize("sharded", [False, True])
def test_summed_rows_under_accumulation_are_named(sharded, mirrored):
    with mirrored(2).scope():
        model = embedding_model(keras_dist.DistributedModel)
        adam = keras.optimizers.Adam(0.01)
        optimizer = (
            keras_dist.ShardedOptimizer(adam, accumulation_steps=2)
            if sharded
            else keras_dist.GradientAccumulationOptimizer(adam, 2)
        )
    with pytest.warns(UserWarning, match=r"are sparse \(rows of an Embedding"):
        trained(model, optimizer, batch_size=16, epochs=1)


# --- A frozen layer, an unused weight (ShardedOptimizer) ------------------------


def two_layers(base=keras_dist.DistributedModel):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu", name="backbone")(inputs)
    return base(inputs, keras.layers.Dense(1, name="head")(hidden))


def regression():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def test_a_layer_frozen_after_fitting_stays_frozen(mirrored):
    x, y = regression()
    with mirrored(2).scope():
        model = two_layers()
        optimizer = keras_dist.ShardedOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9)
        )
        model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    backbone = model.get_layer("backbone")
    before = [np.array(w) for w in backbone.get_weights()]
    backbone.trainable = False
    model.compile(optimizer, "mse")  # the same optimizer object
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    # Momentum used to keep moving it (0.23 after one epoch).
    assert max_abs_diff(backbone.get_weights(), before) == 0.0


class WithUnusedHead(keras_dist.DistributedModel):
    def __init__(self):
        super().__init__()
        self.body = keras.layers.Dense(1)
        self.unused = keras.layers.Dense(1)

    def build(self, shape):
        self.body.build(shape)
        self.unused.build(shape)

    def call(self, x):
        return self.body(x)


def test_a_weight_without_a_gradient_is_left_alone(mirrored):
    x, y = regression()
    keras.utils.set_random_seed(0)
    with mirrored(2).scope():
        model = WithUnusedHead()
        model.build((None, 4))
        model.compile(
            keras_dist.ShardedOptimizer(keras.optimizers.AdamW(0.01, weight_decay=0.5)),
            "mse",
        )
    before = [np.array(w) for w in model.unused.get_weights()]
    with pytest.warns(UserWarning, match="Gradients do not exist for variables"):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    # Weight decay used to shrink it (0.079), as if it had a gradient.
    assert max_abs_diff(model.unused.get_weights(), before) == 0.0


# --- Backups at a short last batch ------------------------------------------------


def backed_up_run(strategy, folder, crash_at=None, accumulate=False, x=None):
    """100 examples in batches of 32 (the 4th of each epoch has 4), a
    backup every 4 batches: at the end of each epoch, on its short batch."""
    keras.utils.set_random_seed(0)
    if x is None:
        x, y = regression()
        x, y = np.concatenate([x, x[:36]]), np.concatenate([y, y[:36]])
    else:
        x, y = x
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = two_layers()
        optimizer = keras.optimizers.Adam(0.01)
        if accumulate:
            optimizer = keras_dist.GradientAccumulationOptimizer(
                keras_dist.ShardedOptimizer(optimizer), 2
            )
        model.compile(optimizer, "mse")
    callbacks = [keras_dist.callbacks.BackupAndRestore(folder, save_freq=4)]
    if crash_at is not None:
        callbacks.append(Boom(crash_at))
    with contextlib.suppress(KeyboardInterrupt):
        model.fit(
            x, y, batch_size=32, epochs=3, shuffle=False, verbose=0, callbacks=callbacks
        )
    return model


@pytest.mark.parametrize("resume_on", ["same", "one_device", "two_replicas"])
def test_a_backup_on_an_epochs_short_batch_resumes(resume_on, mirrored, tmp_path):
    # The backup after batch 4 of epoch 1 (4 examples) once recorded a batch
    # size of 25 (100 / 4) and could not be resumed with batches of 32; on
    # another replica count the input "ran out" (4 batches of 32).
    first = mirrored(2) if resume_on == "one_device" else None
    reference = backed_up_run(first, str(tmp_path / "r"))
    folder = str(tmp_path / "b")
    backed_up_run(first, folder, crash_at=6)
    then = {"same": first, "one_device": None, "two_replicas": mirrored(2)}[resume_on]
    resumed = backed_up_run(then, folder)
    assert max_abs_diff(resumed.get_weights(), reference.get_weights()) < 1e-6
    assert int(resumed.optimizer.iterations.numpy()) == int(
        reference.optimizer.iterations.numpy()
    )


def test_elastic_accumulation_over_an_uneven_dataset_is_exact(mirrored, tmp_path):
    # GradientAccumulationOptimizer(ShardedOptimizer(Adam), 2), 2 replicas
    # -> 1 device, 100 samples: 9 updates against 10 and 3.6e-2 off, before
    # an epoch's last, shorter window was applied at its end.
    reference = backed_up_run(mirrored(2), str(tmp_path / "r"), accumulate=True)
    folder = str(tmp_path / "b")
    backed_up_run(mirrored(2), folder, crash_at=6, accumulate=True)
    resumed = backed_up_run(None, folder, accumulate=True)
    assert int(resumed.optimizer.iterations.numpy()) == int(
        reference.optimizer.iterations.numpy()
    )
    assert max_abs_diff(resumed.get_weights(), reference.get_weights()) < 1e-6


# --- A pipeline that shuffles its batches -----------------------------------------


def test_a_resize_of_a_batch_then_shuffle_pipeline_is_refused(mirrored, tmp_path):
    # `ds.batch(B).shuffle(...)`: on another replica count (the per-replica
    # batch held, so another global batch) the resumed run trained on
    # other samples (5.3e-2 off), silently.
    x, y = regression()

    def run(replicas, crash_at=None):
        strategy = mirrored(replicas)
        with strategy.scope():
            model = two_layers()
            model.compile(keras.optimizers.SGD(0.05), "mse")
        dataset = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .batch(4 * replicas)
            .shuffle(8, seed=1)
            .repeat()
        )
        callbacks = [keras_dist.callbacks.BackupAndRestore(str(tmp_path), save_freq=2)]
        if crash_at:
            callbacks.append(Boom(crash_at))
        with contextlib.suppress(KeyboardInterrupt):
            model.fit(
                dataset,
                steps_per_epoch=4,
                epochs=2,
                verbose=0,
                callbacks=callbacks,
            )

    run(4, crash_at=5)
    with pytest.raises(BackupError, match=r"shuffles after\s+it batches"):
        run(2)
