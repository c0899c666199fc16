"""`LocalSGDOptimizer` and `DiLoCoOptimizer` against what they must equal.

- With one update per window they are synchronous training (SGD with
  momentum; DiLoCo with the outer `SGD(1.0)`), to 1e-6.
- With more, they equal stock Keras models trained apart, one per replica
  on that replica's rows, whose weights are averaged (local SGD) or moved
  by the outer optimizer (DiLoCo) every `sync_every` updates and when an
  epoch ends: the replicas' examples weigh in, BatchNormalization's
  statistics are averaged, the inner state stays apart.
- `sync_every` counts updates under accumulation; warm-up is synchronous;
  backups resume inside a window exactly; another replica count averages.
- The refusals, and the traced step's collectives (`local_sgd_workers.py`).
"""

import math

import keras
import numpy as np
import pytest
from helpers import Boom, assert_config_round_trip, max_abs_diff

import keras_dist
from keras_dist.callbacks import BackupAndRestore
from keras_dist.compression import FP16, TopK

BATCH = 20


def data(n=90, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype("float32")
    y = rng.integers(0, 3, size=(n,)).astype("int32")
    return x, y


def network(cls=keras.Model, batch_norm=False):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    if batch_norm:
        hidden = keras.layers.BatchNormalization()(hidden)
    return cls(inputs, keras.layers.Dense(3)(hidden))


def compiled(strategy, optimizer, cls=None, batch_norm=False):
    with strategy.scope():
        model = network(cls or keras_dist.DistributedModel, batch_norm)
        model.compile(
            optimizer=optimizer(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def momentum():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def local_sgd(sync_every, **kwargs):
    return lambda: keras_dist.LocalSGDOptimizer(momentum(), sync_every, **kwargs)


def diloco(sync_every, outer=None, **kwargs):
    return lambda: keras_dist.DiLoCoOptimizer(
        momentum(), sync_every, outer_optimizer=outer() if outer else None, **kwargs
    )


def fit(model, x, y, epochs=2, **kwargs):
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, **kwargs)
    return model


def replica_values(strategy, variable):
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return [t.numpy() for t in strategy.experimental_local_results(value)]


def replica_spread(strategy, model):
    return max(
        float(np.max(np.abs(values[0] - values[-1])))
        for values in (replica_values(strategy, v) for v in model.weights)
    )


# --- One update per window: synchronous training -----------------------------


@pytest.mark.parametrize("examples", [100, 90])  # 90: a short last batch
@pytest.mark.parametrize(
    "optimizer",
    [local_sgd(1), diloco(1, outer=lambda: keras.optimizers.SGD(1.0))],
    ids=["local_sgd", "diloco"],
)
def test_one_update_per_window_is_synchronous_training(mirrored, optimizer, examples):
    strategy = mirrored(2)
    x, y = data(examples)
    reference = fit(compiled(strategy, momentum), x, y)
    model = fit(compiled(strategy, optimizer), x, y)
    assert max_abs_diff(model.get_weights(), reference.get_weights()) < 1e-6
    assert int(model.optimizer.iterations.numpy()) == 2 * math.ceil(examples / BATCH)


# --- Longer windows: replicas trained apart, then averaged --------------------


def split(rows, replicas=2):
    """How `MirroredStrategy` splits a global batch's rows over replicas."""
    sizes = [
        len(rows) // replicas + (r < len(rows) % replicas) for r in range(replicas)
    ]
    starts = np.cumsum([0, *sizes])
    return [rows[starts[r] : starts[r + 1]] for r in range(replicas)]


def simulate(x, y, sync_every, epochs=2, outer=None, batch_norm=False, warmup=0):
    """Two stock Keras models, one per replica, synced by hand."""
    replicas = [network(batch_norm=batch_norm) for _ in range(2)]
    for model in replicas:
        model.compile(
            optimizer=momentum(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    anchors = [keras.Variable(w) for w in replicas[0].get_weights()]
    trainable = [w.trainable for w in replicas[0].weights]
    outer_anchors = [a for a, t in zip(anchors, trainable) if t]
    if outer is not None:
        outer = outer()
        outer.build(outer_anchors)
    since, examples = 0, np.zeros(2)
    updates = 0

    def sync():
        nonlocal since, examples
        share = examples / examples.sum()
        weights = [r.get_weights() for r in replicas]
        mean = [share[0] * a + share[1] * b for a, b in zip(*weights)]
        if outer is None:
            new = mean
        else:
            # The pseudo-gradient of the trainable weights; the model's
            # state (BatchNormalization's statistics) is averaged.
            deltas = [a.numpy() - m for a, m, t in zip(anchors, mean, trainable) if t]
            outer.apply(deltas, outer_anchors)
            for anchor, m, t in zip(anchors, mean, trainable):
                if not t:
                    anchor.assign(m)
            new = [anchor.numpy() for anchor in anchors]
        for anchor, value in zip(anchors, new):
            anchor.assign(value)
        for model in replicas:
            model.set_weights(new)
        since, examples = 0, np.zeros(2)

    for _ in range(epochs):
        for start in range(0, len(x), BATCH):
            rows = np.arange(start, min(start + BATCH, len(x)))
            if updates < warmup:
                raise NotImplementedError  # warm-up is tested against sync
            for r, (model, part) in enumerate(zip(replicas, split(rows))):
                model.train_on_batch(x[part], y[part])
                examples[r] += len(part)
            since += 1
            updates += 1
            if since == sync_every:
                sync()
        if since:
            sync()
    return replicas[0]


@pytest.mark.parametrize("examples", [90, 85])  # 85: a last batch of 3 + 2
@pytest.mark.parametrize("kind", ["local_sgd", "diloco"])
def test_a_window_equals_replicas_trained_apart_then_averaged(mirrored, kind, examples):
    strategy = mirrored(2)
    x, y = data(examples)
    outer = None
    if kind == "diloco":

        def outer():
            return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)

        optimizer = diloco(3, outer=outer)
    else:
        optimizer = local_sgd(3)
    model = fit(compiled(strategy, optimizer, batch_norm=True), x, y)
    expected = simulate(x, y, 3, outer=outer, batch_norm=True)
    assert replica_spread(strategy, model) == 0.0  # fit ends with a sync
    assert max_abs_diff(model.get_weights(), expected.get_weights()) < 1e-5
    # Adam-like state stays per replica: the momentum slots differ.
    slots = model.optimizer.inner_optimizer.variables[2:]
    assert any(
        np.any(v[0] != v[1]) for v in (replica_values(strategy, s) for s in slots)
    )


def test_replicas_differ_inside_a_window_and_evaluate_on_their_own(mirrored):
    strategy = mirrored(2)
    x, y = data(100)
    model = compiled(strategy, local_sgd(4, sync_at_epoch_end=False))
    fit(model, x, y, epochs=1)  # 5 updates: a sync after 4, 1 more
    assert int(model.optimizer.updates_since_sync.numpy()) == 1
    assert replica_spread(strategy, model) > 0
    model.optimizer.sync_every = 6
    fit(model, x, y, epochs=1)  # 6 in the window at its last update
    assert int(model.optimizer.updates_since_sync.numpy()) == 0
    assert replica_spread(strategy, model) == 0.0


def test_warm_up_is_synchronous(mirrored):
    strategy = mirrored(2)
    x, y = data(100)
    reference = fit(compiled(strategy, momentum), x, y, epochs=1)
    optimizer = local_sgd(1000, warmup_steps=5, sync_at_epoch_end=False)
    model = fit(compiled(strategy, optimizer), x, y, epochs=1)
    assert max_abs_diff(model.get_weights(), reference.get_weights()) < 1e-6
    assert replica_spread(strategy, model) == 0.0
    fit(model, x, y, epochs=1)  # past the warm-up: local updates
    assert replica_spread(strategy, model) > 0
    assert int(model.optimizer.updates_since_sync.numpy()) == 5


def test_sync_every_counts_updates_under_accumulation(mirrored):
    strategy = mirrored(2)
    x, y = data(80)

    def accumulated(inner):
        return lambda: keras_dist.GradientAccumulationOptimizer(inner(), 2)

    reference = fit(compiled(strategy, accumulated(momentum)), x, y)
    model = fit(compiled(strategy, accumulated(local_sgd(1))), x, y)
    assert max_abs_diff(model.get_weights(), reference.get_weights()) < 1e-6
    # 4 micro-batches an epoch: 2 updates; a sync every 3 updates.
    model = compiled(strategy, accumulated(local_sgd(3, sync_at_epoch_end=False)))
    periodic = model.optimizer.inner_optimizer
    fit(model, x, y, epochs=1)
    assert int(periodic.updates_since_sync.numpy()) == 2
    assert replica_spread(strategy, model) > 0
    fit(model, x, y, epochs=1)  # updates 3 (a sync) and 4
    assert int(periodic.updates_since_sync.numpy()) == 1
    assert int(periodic.iterations.numpy()) == 4


def test_a_plain_keras_model_warns_until_its_state_is_synchronized(mirrored):
    strategy = mirrored(2)
    x, y = data(100)
    reference = fit(compiled(strategy, momentum, cls=keras.Model), x, y)
    model = compiled(strategy, local_sgd(1), cls=keras.Model)
    with pytest.warns(UserWarning, match="synchronize_model_state"):
        fit(model, x, y)
    assert max_abs_diff(model.get_weights(), reference.get_weights()) < 1e-6
    model = compiled(strategy, local_sgd(1), cls=keras.Model, batch_norm=True)
    model.optimizer.synchronize_model_state(model)
    with warnings_as_errors():
        fit(model, x, y, epochs=1)


@pytest.mark.parametrize(
    ("replicas", "frozen", "warned"),
    [(2, False, True), (1, False, False), (2, True, False)],
    ids=["two_replicas", "one_replica", "frozen"],
)
def test_batch_normalization_on_replicas_is_said_to_differ_from_stock(
    mirrored, caplog, replicas, frozen, warned
):
    # Stock Keras keeps each replica's copy of the moving statistics (and
    # reads the first); local SGD averages them at a sync: said once, where
    # there are several replicas and statistics that training moves.
    x, y = data(40)
    model = compiled(mirrored(replicas), local_sgd(1), batch_norm=True)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = not frozen
    with caplog.at_level("WARNING", logger="keras_dist"):
        fit(model, x, y, epochs=1)
        fit(model, x, y, epochs=1)
    said = [r for r in caplog.records if "averages the moving statistics" in r.message]
    assert len(said) == (1 if warned else 0)
    if warned:
        assert "batch_normalization" in said[0].message
        assert "over the 2 replicas" in said[0].message


def warnings_as_errors():
    import warnings

    class Context:
        def __enter__(self):
            self._catch = warnings.catch_warnings()
            self._catch.__enter__()
            warnings.filterwarnings("error", message=".*keras_dist.*")

        def __exit__(self, *exc):
            return self._catch.__exit__(*exc)

    return Context()


def test_sync_hook_fp16_stays_close(mirrored):
    strategy = mirrored(2)
    x, y = data(100)
    reference = fit(compiled(strategy, local_sgd(3)), x, y)
    model = fit(compiled(strategy, local_sgd(3, sync_hook=FP16())), x, y)
    difference = max_abs_diff(model.get_weights(), reference.get_weights())
    assert 0 < difference < 1e-2
    assert replica_spread(strategy, model) == 0.0


def test_sparse_gradients_of_an_embedding_train_locally(mirrored):
    strategy = mirrored(2)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=(80, 4))
    labels = rng.integers(0, 2, size=(80,))

    def model(optimizer):
        with strategy.scope():
            keras.utils.set_random_seed(2)
            inputs = keras.Input((4,), dtype="int32")
            hidden = keras.layers.Embedding(50, 6)(inputs)
            outputs = keras.layers.Dense(2)(keras.layers.Flatten()(hidden))
            net = keras_dist.DistributedModel(inputs, outputs)
            net.compile(
                optimizer=optimizer(),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        return net

    reference = fit(model(momentum), tokens, labels)
    local = fit(model(local_sgd(1)), tokens, labels)
    assert max_abs_diff(local.get_weights(), reference.get_weights()) < 1e-6
    adam = model(lambda: keras_dist.DiLoCoOptimizer(keras.optimizers.Adam(0.01), 2))
    fit(adam, tokens, labels)
    assert replica_spread(strategy, adam) == 0.0
    assert all(np.all(np.isfinite(w)) for w in adam.get_weights())


# --- State: backups, another replica count, saving -----------------------------


def test_a_backup_inside_a_window_resumes_exactly(mirrored, tmp_path):
    strategy = mirrored(2)
    x, y = data(100)

    def run(folder, crash_at=None):
        model = compiled(strategy, diloco(4, outer=None))
        callbacks = [BackupAndRestore(str(folder), save_freq=3)]
        if crash_at:
            callbacks.append(Boom(crash_at))
        try:
            fit(model, x, y, epochs=3, callbacks=callbacks)
        except KeyboardInterrupt:
            return None
        return model

    reference = run(tmp_path / "reference")
    # Saved after batch 6 (2 updates into the second window), crashed at 8.
    assert run(tmp_path / "b", crash_at=8) is None
    resumed = run(tmp_path / "b")
    assert max_abs_diff(resumed.get_weights(), reference.get_weights()) < 1e-6
    for a, b in zip(resumed.optimizer.variables, reference.optimizer.variables):
        for u, v in zip(replica_values(strategy, a), replica_values(strategy, b)):
            np.testing.assert_allclose(u, v, rtol=0, atol=1e-6)


class Record(keras.callbacks.Callback):
    """The weights of every replica after each batch."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy, self.weights = strategy, []

    def on_train_batch_end(self, batch, logs=None):
        weights = [replica_values(self.strategy, v) for v in self.model.weights]
        self.weights.append(weights)


class Capture(keras.callbacks.Callback):
    """The weights of every replica at the first step (after the restore,
    which waits for the model and optimizer to be built)."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy, self.weights = strategy, None

    def on_train_batch_begin(self, batch, logs=None):
        self.weights = [replica_values(self.strategy, v) for v in self.model.weights]
        raise KeyboardInterrupt("seen")


def test_another_replica_count_averages_the_replicas(mirrored, tmp_path):
    x, y = data(96)
    folder = str(tmp_path / "b")

    def fit_with(model, *callbacks):
        with pytest.raises(KeyboardInterrupt):
            model.fit(
                x,
                y,
                batch_size=24,
                epochs=2,
                shuffle=False,
                verbose=0,
                callbacks=[BackupAndRestore(folder, save_freq=2), *callbacks],
            )

    four = mirrored(4)
    model = compiled(four, local_sgd(100, sync_at_epoch_end=False))
    record = Record(four)
    fit_with(model, record, Boom(3))  # saved after batch 2, stopped at 3
    saved = record.weights[1]
    assert max(np.ptp(values, axis=0).max() for values in saved) > 0
    two = mirrored(2)
    capture = Capture(two)
    fit_with(compiled(two, local_sgd(100, sync_at_epoch_end=False)), capture)
    for values, before in zip(capture.weights, saved, strict=True):
        for value in values:
            np.testing.assert_allclose(value, np.mean(before, axis=0), atol=1e-6)


def test_config_round_trip_and_keras_file(mirrored, tmp_path):
    optimizer = keras_dist.LocalSGDOptimizer(
        keras.optimizers.Adam(0.01), 8, warmup_steps=3, sync_hook=FP16()
    )
    assert_config_round_trip(optimizer)
    optimizer = keras_dist.DiLoCoOptimizer(
        keras.optimizers.AdamW(0.001), 16, sync_at_epoch_end=False
    )
    assert_config_round_trip(optimizer)
    strategy = mirrored(2)
    x, y = data(100)
    model = fit(compiled(strategy, diloco(2)), x, y, epochs=1)
    path = str(tmp_path / "m.keras")
    model.save(path)
    with strategy.scope():
        loaded = keras.saving.load_model(path)
    assert type(loaded.optimizer) is keras_dist.DiLoCoOptimizer
    assert loaded.optimizer.sync_every == 2
    assert max_abs_diff(loaded.get_weights(), model.get_weights()) == 0.0


# --- Refusals ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: keras_dist.LocalSGDOptimizer(momentum(), 0), ValueError, "sync_every"),
        (
            lambda: keras_dist.LocalSGDOptimizer(momentum(), "8"),
            TypeError,
            "sync_every",
        ),
        (lambda: keras_dist.LocalSGDOptimizer("sgd", 8), TypeError, "inner_optimizer"),
        (
            lambda: keras_dist.LocalSGDOptimizer(momentum(), 8, warmup_steps=-1),
            ValueError,
            "warmup_steps",
        ),
        (
            lambda: keras_dist.LocalSGDOptimizer(momentum(), 8, sync_at_epoch_end=1),
            TypeError,
            "sync_at_epoch_end",
        ),
        (
            lambda: keras_dist.LocalSGDOptimizer(
                keras_dist.GradientAccumulationOptimizer(momentum(), 2), 8
            ),
            ValueError,
            "Wrap accumulation around",
        ),
        (
            lambda: keras_dist.LocalSGDOptimizer(
                keras.optimizers.LossScaleOptimizer(momentum()), 8
            ),
            ValueError,
            "loss scaling",
        ),
        (
            lambda: keras_dist.LocalSGDOptimizer(
                keras_dist.ShardedOptimizer(keras.optimizers.Adam()), 8
            ),
            ValueError,
            "ShardedOptimizer",
        ),
        (
            lambda: keras_dist.LocalSGDOptimizer(
                keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), 8
            ),
            ValueError,
            "gradient_accumulation_steps",
        ),
        (
            lambda: keras_dist.LocalSGDOptimizer(local_sgd(2)(), 8),
            ValueError,
            "already synchronizes",
        ),
        (
            lambda: keras_dist.DiLoCoOptimizer(momentum(), 8, outer_optimizer="sgd"),
            TypeError,
            "outer_optimizer",
        ),
        (
            lambda: keras_dist.LocalSGDOptimizer(momentum(), 8, learning_rate=0.1),
            ValueError,
            "learning_rate",
        ),
    ],
)
def test_bad_arguments_are_refused(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_refusals_when_built(mirrored):
    strategy = mirrored(2)
    x, y = data(40)
    with pytest.raises(ValueError, match="sync_hook` without state"):
        fit(compiled(strategy, local_sgd(2, sync_hook=TopK(0.5))), x, y)
    outside = momentum()
    with pytest.raises(ValueError, match="created outside the strategy scope"):
        fit(compiled(strategy, lambda: keras_dist.LocalSGDOptimizer(outside, 2)), x, y)
    with pytest.raises(ValueError, match=r"ShardedOptimizer|shard"):
        fit(
            compiled(strategy, lambda: keras_dist.ShardedOptimizer(local_sgd(2)())),
            x,
            y,
        )
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        with pytest.raises(ValueError, match="loss scaling"):
            fit(compiled(strategy, local_sgd(2)), x, y)
    finally:
        keras.config.set_dtype_policy(policy)
