"""DistributedModel: forms, equivalence with one device, clipping, hooks, saving."""

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
from keras_dist.compression import AllReduceHook, NoCompression, all_reduce_sum
from keras_dist.testing import WorkerError, run_workers

EPOCHS = 2
BATCH = 16


def single_device_run(optimizer_name, batch_size=BATCH, epochs=EPOCHS, optimizer=None):
    x, y = make_data()
    model = compile_model(mlp(), optimizer or OPTIMIZERS[optimizer_name]())
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0
    )
    return model, history


class RecordingHook(AllReduceHook):
    """Sums like NoCompression and records what it saw, per replica."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.shapes = None
        self.built_with = None

    def build(self, variables):
        super().build(variables)
        self.built_with = [tuple(v.shape) for v in variables]

    def reduce(self, gradients, variables):
        self.calls += 1  # counted at trace time: once per replica per trace
        self.shapes = [tuple(g.shape) for g in gradients]
        return all_reduce_sum(gradients)


# --- Forms ---


def test_functional_form_returns_functional_subclass():
    model = mlp(keras_dist.DistributedModel)
    assert isinstance(model, keras_dist.DistributedModel)
    assert isinstance(model, keras.Model)
    assert type(model).__name__ == "FunctionalDistributedModel"
    # Keras would rewrite the bases of a subclass used functionally; ours stay.
    assert keras.Model in keras_dist.DistributedModel.__mro__
    assert keras_dist.DistributedModel.__bases__[-1] is keras.Model


def subclass_net(base):
    """A subclassed two-layer MLP on `base`: one body for both model classes."""

    class SubclassNet(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(16, activation="relu")
            self.out = keras.layers.Dense(3)

        def call(self, x):
            return self.out(self.hidden(x))

    return SubclassNet


SubclassNet = keras.saving.register_keras_serializable(package="keras_dist_tests")(
    subclass_net(keras_dist.DistributedModel)
)
KerasSubclassNet = subclass_net(keras.Model)


@pytest.mark.parametrize("form", ["subclass", "sequential", "functional", "subclassed"])
def test_forms_train_like_keras_model_on_two_replicas(form, mirrored):
    x, y = make_data()

    def build():
        keras.utils.set_random_seed(3)
        if form == "subclass":
            return SubclassNet()
        if form == "sequential":
            model = keras.Sequential(
                [
                    keras.Input((8,)),
                    keras.layers.Dense(16, activation="relu"),
                    keras.layers.Dense(3),
                ]
            )
        elif form == "functional":
            model = mlp(seed=3)
        else:
            model = _built_plain_subclass()
        return keras_dist.DistributedModel.from_model(model)

    keras.utils.set_random_seed(3)
    reference = {
        "subclass": lambda: _seeded(KerasSubclassNet),
        "sequential": lambda: _seeded(
            lambda: keras.Sequential(
                [
                    keras.Input((8,)),
                    keras.layers.Dense(16, activation="relu"),
                    keras.layers.Dense(3),
                ]
            )
        ),
        "functional": lambda: mlp(seed=3),
        "subclassed": lambda: _seeded(_built_plain_subclass),
    }[form]()
    compile_model(reference, keras.optimizers.Adam(0.01))
    reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)

    strategy = mirrored(2)
    with strategy.scope():
        model = compile_model(build(), keras.optimizers.Adam(0.01))
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert isinstance(model, keras_dist.DistributedModel)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5


def _built_plain_subclass():
    model = KerasSubclassNet()
    model(np.zeros((1, 8), "float32"))
    return model


def _seeded(factory):
    keras.utils.set_random_seed(3)
    return factory()


def test_from_model_shares_layers_and_weights(mirrored):
    strategy = mirrored(2)
    with strategy.scope():
        base = mlp()
        model = keras_dist.DistributedModel.from_model(base)
    assert model.trainable_weights == base.trainable_weights
    assert model.model is base


def test_from_model_keras_application_trains_on_two_replicas(mirrored):
    strategy = mirrored(2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(8,))
    with strategy.scope():
        base = keras.applications.MobileNetV2(
            input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10
        )
        model = keras_dist.DistributedModel.from_model(base)
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    before = [w.copy() for w in base.get_weights()]
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert max_abs_diff(before, base.get_weights()) > 0


# --- Equivalence ---


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_one_replica_equals_keras_model(optimizer_name):
    reference, ref_history = single_device_run(optimizer_name)
    x, y = make_data()
    model = compile_model(
        mlp(keras_dist.DistributedModel), OPTIMIZERS[optimizer_name]()
    )
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6
    np.testing.assert_allclose(
        history.history["loss"], ref_history.history["loss"], rtol=1e-6
    )


def test_one_device_strategy_equals_keras_model():
    reference, _ = single_device_run("adam")
    x, y = make_data()
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        model = compile_model(mlp(keras_dist.DistributedModel), OPTIMIZERS["adam"]())
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6


@pytest.mark.parametrize(
    ("replicas", "optimizer_name"),
    [(2, "sgd"), (2, "momentum"), (2, "adam"), (4, "adam")],
)
def test_mirrored_equals_single_device(replicas, optimizer_name, mirrored):
    reference, ref_history = single_device_run(optimizer_name)
    x, y = make_data()
    with mirrored(replicas).scope():
        model = compile_model(
            mlp(keras_dist.DistributedModel), OPTIMIZERS[optimizer_name]()
        )
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5
    # Logs are computed from the metric state of all replicas.
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(
            history.history[key], ref_history.history[key], rtol=1e-5
        )
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=BATCH, verbose=0),
        reference.evaluate(x, y, batch_size=BATCH, verbose=0),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        model.predict(x, batch_size=BATCH, verbose=0),
        reference.predict(x, batch_size=BATCH, verbose=0),
        atol=1e-5,
    )


def test_steps_per_execution_matches_single_device(mirrored):
    reference, _ = single_device_run("adam")
    x, y = make_data()
    with mirrored(2).scope():
        model = mlp(keras_dist.DistributedModel)
        model.compile(
            optimizer=OPTIMIZERS["adam"](),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=3,
        )
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5


@pytest.mark.parametrize(
    "clip", [{"global_clipnorm": 0.05}, {"clipnorm": 0.02}], ids=["global", "per_var"]
)
def test_clipping_acts_on_all_reduced_gradient(clip, mirrored):
    def optimizer():
        return keras.optimizers.SGD(0.5, **clip)

    reference, _ = single_device_run(None, optimizer=optimizer())
    x, y = make_data()
    with mirrored(2).scope():
        model = compile_model(mlp(keras_dist.DistributedModel), optimizer())
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5

    # Stock Keras clips each replica's gradient before its all-reduce, so it
    # does not match one device. When this fails, upstream fixed it.
    with mirrored(2).scope():
        stock = compile_model(mlp(), optimizer())
    stock.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), stock.get_weights()) > 1e-4


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_on_two_replicas(policy, mirrored):
    x, y = make_data()
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        reference = compile_model(mlp(), OPTIMIZERS["sgd"]())
        reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        with mirrored(2).scope():
            model = compile_model(mlp(keras_dist.DistributedModel), OPTIMIZERS["sgd"]())
        history = model.fit(
            x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0
        )
    finally:
        keras.config.set_dtype_policy(previous)
    if policy == "mixed_float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert all(np.isfinite(history.history["loss"]))
    # Half-precision compute differs per batch split; the float32 master
    # weights stay close to one-device mixed-precision training.
    tolerance = 1e-3 if policy == "mixed_float16" else 2e-2
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < tolerance


def test_custom_training_loop_with_strategy_run(mirrored):
    """The seeds' loop: strategy.run(train_step) + strategy.reduce."""
    reference, _ = single_device_run("momentum", epochs=1)
    x, y = make_data()
    strategy = mirrored(2)
    with strategy.scope():
        model = mlp(keras_dist.DistributedModel)
        model.compile(optimizer=OPTIMIZERS["momentum"]())
        model.build_all_reduce_hook()
        loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum"
        )
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    )

    def train_step(batch):
        features, labels = batch
        with tf.GradientTape() as tape:
            logits = model(features, training=True)
            loss = loss_fn(labels, logits) / BATCH
        grads = tape.gradient(loss, model.trainable_variables)
        model.apply_gradients(grads, model.trainable_variables)
        return loss

    @tf.function
    def distributed_step(batch):
        per_replica = strategy.run(train_step, args=(batch,))
        return strategy.reduce("SUM", per_replica, axis=None)

    losses = [float(distributed_step(batch)) for batch in dataset]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5


# --- Hooks ---


def test_hook_sees_per_replica_gradients_and_is_used(mirrored):
    hook = RecordingHook()
    x, y = make_data()
    reference, _ = single_device_run("sgd", epochs=1)
    with mirrored(2).scope():
        model = compile_model(mlp(keras_dist.DistributedModel), OPTIMIZERS["sgd"]())
        model.register_all_reduce_hook(hook)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert model.all_reduce_hook is hook
    assert hook.built_with == [(8, 16), (16,), (16, 3), (3,)]
    assert hook.shapes == hook.built_with
    assert hook.calls == 2  # traced once, in each of the two replicas
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5


def test_register_hook_between_fits_rebuilds_train_function(mirrored):
    x, y = make_data()
    with mirrored(2).scope():
        model = compile_model(mlp(keras_dist.DistributedModel), OPTIMIZERS["sgd"]())
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    hook = RecordingHook()
    model.register_all_reduce_hook(hook)
    assert model.train_function is None
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert hook.calls == 2


def test_hook_returning_wrong_count_is_reported():
    class DropsOne(AllReduceHook):
        def reduce(self, gradients, variables):
            return all_reduce_sum(gradients)[:-1]

    x, y = make_data()
    model = compile_model(
        keras_dist.DistributedModel(*_io(), all_reduce_hook=DropsOne()),
        "sgd",
    )
    with pytest.raises(ValueError, match="returned 3 gradients for 4 inputs"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def _io():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16)(inputs)
    return inputs, keras.layers.Dense(3)(hidden)


# --- Saving ---


@pytest.mark.parametrize("form", ["functional", "subclass", "wrapped"])
def test_keras_file_round_trip(tmp_path, form, mirrored):
    x, y = make_data()
    with mirrored(2).scope():
        if form == "functional":
            model = mlp(keras_dist.DistributedModel)
        elif form == "subclass":
            model = SubclassNet()
        else:
            model = keras_dist.DistributedModel.from_model(mlp())
        compile_model(model, OPTIMIZERS["adam"]())
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is type(model)
    assert isinstance(loaded.all_reduce_hook, NoCompression)
    assert max_abs_diff(model.get_weights(), loaded.get_weights()) == 0
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )
    # Compile state: the optimizer and its slots come back.
    assert loaded.optimizer.__class__ is model.optimizer.__class__
    assert int(loaded.optimizer.iterations.numpy()) == int(
        model.optimizer.iterations.numpy()
    )
    assert (
        max_abs_diff(
            [v.numpy() for v in model.optimizer.variables],
            [v.numpy() for v in loaded.optimizer.variables],
        )
        == 0
    )
    # Training continues identically after loading.
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert max_abs_diff(model.get_weights(), loaded.get_weights()) < 1e-6


def test_config_keeps_custom_hook():
    @keras.saving.register_keras_serializable(package="keras_dist_tests")
    class Named(AllReduceHook):
        def __init__(self, label="x"):
            super().__init__()
            self.label = label

        def reduce(self, gradients, variables):
            return all_reduce_sum(gradients)

        def get_config(self):
            return {"label": self.label}

    model = keras_dist.DistributedModel(*_io(), all_reduce_hook=Named("abc"))
    clone = assert_config_round_trip(model, exact_arguments=False)
    assert isinstance(clone.all_reduce_hook, Named)
    assert clone.all_reduce_hook.label == "abc"


# --- Multi-worker ---


@pytest.mark.multiworker
def test_stock_keras_fit_fails_under_multi_worker():
    """Upstream bug this library covers; when it starts passing, revisit."""
    with pytest.raises(WorkerError, match="Attempt to convert a value"):
        run_workers(workers.stock_keras_fit, num_workers=2, timeout=240)


@pytest.mark.multiworker
def test_multi_worker_equals_single_device():
    results = run_workers(
        workers.distributed_fit,
        num_workers=2,
        args=(sorted(OPTIMIZERS),),
        timeout=400,
    )
    x, y = make_data()
    for name in sorted(OPTIMIZERS):
        reference, ref_history = single_device_run(name)
        for worker in results:
            got = worker[name]
            assert max_abs_diff(reference.get_weights(), got["weights"]) < 1e-5, name
            for key in ("loss", "accuracy"):
                np.testing.assert_allclose(
                    got["history"][key], ref_history.history[key], rtol=1e-5
                )
            np.testing.assert_allclose(
                got["evaluate"],
                reference.evaluate(x, y, batch_size=BATCH, verbose=0),
                rtol=1e-5,
            )
            np.testing.assert_allclose(
                got["predict"], reference.predict(x, verbose=0), atol=1e-5
            )


@pytest.mark.multiworker
def test_multi_worker_clipping_equals_single_device():
    results = run_workers(
        workers.distributed_fit,
        num_workers=2,
        args=(["sgd"],),
        kwargs={"clip": True},
        timeout=300,
    )
    reference, _ = single_device_run(
        None, optimizer=keras.optimizers.SGD(0.5, global_clipnorm=0.05)
    )
    for worker in results:
        assert max_abs_diff(reference.get_weights(), worker["sgd"]["weights"]) < 1e-5


# --- Bad input ---


def test_hook_must_be_a_hook_instance():
    with pytest.raises(TypeError, match="Received: all_reduce_hook='fp16'"):
        keras_dist.DistributedModel(*_io(), all_reduce_hook="fp16")
    with pytest.raises(TypeError, match=r"Pass an instance: `NoCompression\(\)`"):
        keras_dist.DistributedModel(*_io(), all_reduce_hook=NoCompression)
    model = keras_dist.DistributedModel(*_io())
    with pytest.raises(TypeError, match="AllReduceHook"):
        model.register_all_reduce_hook(object())


def test_from_model_errors(mirrored):
    with pytest.raises(TypeError, match=r"must be a `keras\.Model`"):
        keras_dist.DistributedModel.from_model(keras.layers.Dense(3))
    with pytest.raises(ValueError, match="already a DistributedModel"):
        keras_dist.DistributedModel.from_model(mlp(keras_dist.DistributedModel))
    outside = mlp()
    with (
        mirrored(2).scope(),
        pytest.raises(ValueError, match="created outside the current strategy"),
    ):
        keras_dist.DistributedModel.from_model(outside)


def test_apply_gradients_needs_compile():
    model = mlp(keras_dist.DistributedModel)
    with pytest.raises(RuntimeError, match=r"call `model\.compile"):
        model.apply_gradients([], [])


def test_compression_ratio_is_in_the_logs(mirrored):
    x, y = make_data()
    with mirrored(2).scope():
        model = compile_model(
            keras_dist.DistributedModel(
                *_io(), all_reduce_hook=keras_dist.compression.FP16()
            ),
            OPTIMIZERS["sgd"](),
        )
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    assert history.history["compression_ratio"] == [2.0, 2.0]


def test_hook_state_is_saved_and_restored(tmp_path):
    x, y = make_data()
    hook = keras_dist.compression.PowerSGD(rank=1, start_step=0, min_compression_rate=1)
    model = compile_model(
        keras_dist.DistributedModel(*_io(), all_reduce_hook=hook), OPTIMIZERS["sgd"]()
    )
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    saved = [v.numpy() for v in hook.state_variables]
    assert any(np.any(s != 0) for s in saved)

    path = tmp_path / "powersgd.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    restored = [v.numpy() for v in loaded.all_reduce_hook.state_variables]
    assert len(restored) == len(saved)
    for a, b in zip(saved, restored):
        np.testing.assert_array_equal(a, b)

    checkpoint = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    fresh_hook = keras_dist.compression.PowerSGD(
        rank=1, start_step=0, min_compression_rate=1
    )
    fresh = compile_model(
        keras_dist.DistributedModel(*_io(), all_reduce_hook=fresh_hook),
        OPTIMIZERS["sgd"](),
    )
    fresh.build_all_reduce_hook()
    tf.train.Checkpoint(model=fresh).restore(checkpoint).expect_partial()
    for a, v in zip(saved, fresh_hook.state_variables):
        np.testing.assert_array_equal(a, v.numpy())
