"""The tf_keras front end (`keras_dist.tf_keras`) and tfmot under distribution.

Equality with one device for `DistributedOptimizer` (the same core as the
Keras 3 pieces), on 2 logical CPU replicas and on 2 worker processes;
tfmot's pruning with compression and accumulation; import isolation.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
import tf_keras_workers as tkw
from helpers import max_abs_diff

import keras_dist
from keras_dist.testing import run_workers
from keras_dist.tf_keras import DistributedOptimizer, import_tfmot

NAMES = sorted(tkw.optimizers())


@pytest.mark.parametrize("accumulation_steps", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_two_replicas_equal_one_device(mirrored, name, accumulation_steps):
    # 2 replicas x micro-batch 16 (x 2 micro-steps) = one device's batch.
    reference = tkw.one_device(name, batch_size=32 * accumulation_steps, epochs=3)
    model = tkw.distributed_fit(
        mirrored(2), name, accumulation_steps, 32, epochs=3, hook=None
    )
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5
    # `iterations` counts updates, as on one device.
    assert int(model.optimizer.iterations.numpy()) == int(
        reference.optimizer.iterations.numpy()
    )
    assert type(model.optimizer).__name__ == type(reference.optimizer).__name__
    assert isinstance(model.optimizer, type(reference.optimizer))


def test_clipping_acts_on_the_reduced_gradient(mirrored):
    # With a tight global_clipnorm, clipping each replica's gradient before
    # the sum (stock tf_keras with aggregation) would differ from one device.
    reference = tkw.one_device("adam_clip", batch_size=32, epochs=2)
    model = tkw.distributed_fit(mirrored(2), "adam_clip", 1, 32, epochs=2, hook=None)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5


def test_legacy_optimizer_without_accumulation(mirrored):
    x, y = tkw.data()
    reference = tkw.mlp(tf_keras.optimizers.legacy.Adam(0.01, clipnorm=0.1))
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    with mirrored(2).scope():
        model = tkw.mlp(
            DistributedOptimizer(tf_keras.optimizers.legacy.Adam(0.01, clipnorm=0.1))
        )
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5


def test_a_compression_hook_compresses_and_still_trains(mirrored):
    with mirrored(2).scope():
        hook = keras_dist.compression.FP16()
        model = tkw.mlp(
            DistributedOptimizer(
                tf_keras.optimizers.SGD(0.1), all_reduce_hook=hook, accumulation_steps=2
            )
        )
    x, y = tkw.data()
    before = model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=16, epochs=5, shuffle=False, verbose=0)
    assert model.evaluate(x, y, verbose=0) < before
    assert hook.stats().ratio == pytest.approx(2.0)
    reference = tkw.one_device("sgd", batch_size=32, epochs=5)
    # FP16 rounds each replica's gradient: close to one device, not equal.
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-3


def test_checkpoint_mid_accumulation_resumes_exactly(mirrored, tmp_path):
    """Saved after 3 micro-steps (one update and one pending), restored into
    a new model, 1 more micro-step: equal to 4 micro-steps without a stop."""
    x, y = tkw.data()
    strategy = mirrored(2)

    def fresh():
        with strategy.scope():
            return tkw.mlp(
                DistributedOptimizer(
                    tf_keras.optimizers.Adam(0.01), accumulation_steps=2
                )
            )

    straight = fresh()
    straight.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    first = fresh()
    first.fit(x[:48], y[:48], batch_size=16, epochs=1, shuffle=False, verbose=0)
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(
        str(tmp_path / "ckpt")
    )
    second = fresh()
    # Creates the optimizer's variables; the restore overwrites all of them.
    second.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)
    tf.train.Checkpoint(model=second, optimizer=second.optimizer).restore(
        path
    ).assert_existing_objects_matched()
    assert int(second.optimizer.keras_dist_pending.numpy()) == 1
    assert int(second.optimizer.iterations.numpy()) == 1
    second.fit(x[48:], y[48:], batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert int(second.optimizer.iterations.numpy()) == 2
    assert max_abs_diff(straight.get_weights(), second.get_weights()) < 1e-6


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: DistributedOptimizer(__import__("keras").optimizers.Adam()),
            TypeError,
            r"must be a tf_keras optimizer.*Keras 3 optimizer trains Keras 3",
        ),
        (
            lambda: DistributedOptimizer(
                tf_keras.optimizers.legacy.SGD(), accumulation_steps=2
            ),
            ValueError,
            r"needs a current tf_keras optimizer.*tf_keras.optimizers.SGD",
        ),
        (
            lambda: DistributedOptimizer(
                tf_keras.optimizers.SGD(), accumulation_steps=0
            ),
            ValueError,
            r"accumulation_steps",
        ),
        (
            lambda: DistributedOptimizer(
                tf_keras.optimizers.SGD(), all_reduce_hook=keras_dist.compression.FP16
            ),
            TypeError,
            r"Pass an instance: `FP16\(\)`",
        ),
        (
            lambda: DistributedOptimizer(
                DistributedOptimizer(tf_keras.optimizers.SGD())
            ),
            ValueError,
            r"already a DistributedOptimizer",
        ),
    ],
)
def test_bad_arguments_are_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_pruning_on_two_replicas_with_fp16_and_accumulation(mirrored):
    result = tkw.pruned_fit(mirrored(2))
    # Within 1 percentage point of the 80% target, every pruned layer.
    for name, sparsity in result["sparsity"].items():
        assert abs(sparsity - 0.8) <= 0.01, (name, sparsity)
    # Masks identical on both replicas.
    for replicas in result["masks"]:
        np.testing.assert_array_equal(replicas[0], replicas[1])
    # The schedule counted updates, not micro-steps: the pruning step ends at
    # the number of updates (+1 from the last batch's own increment).
    assert result["updates"] == result["expected_updates"]
    assert set(result["pruning_steps"]) == {result["updates"]}
    assert result["accuracy"] >= 0.85


def stock_pruning_fit(accumulation_steps):
    tfmot = import_tfmot()
    model = tfmot.sparsity.keras.prune_low_magnitude(
        tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(3)]),
        pruning_schedule=tfmot.sparsity.keras.ConstantSparsity(0.5, 0),
    )
    model.compile(
        optimizer=DistributedOptimizer(
            tf_keras.optimizers.SGD(0.1), accumulation_steps=accumulation_steps
        ),
        loss="mse",
    )
    x = np.ones((8, 4), np.float32)
    model.fit(
        x,
        np.zeros((8, 3), np.float32),
        batch_size=4,
        callbacks=[tfmot.sparsity.keras.UpdatePruningStep()],
        verbose=0,
    )
    return model


def test_stock_pruning_callback_refuses_accumulation():
    # tfmot's callback would advance the schedule per micro-step (issue 27).
    with pytest.raises(ValueError, match=r"keras_dist\.tf_keras\.UpdatePruningStep"):
        stock_pruning_fit(accumulation_steps=2)
    # Without accumulation a batch is an update: tfmot's callback is right.
    model = stock_pruning_fit(accumulation_steps=1)
    assert int(model.optimizer.iterations.numpy()) == 2


@pytest.mark.multiworker
@pytest.mark.slow
def test_two_worker_processes_equal_one_device_and_prune_alike():
    results = run_workers(
        tkw.multi_worker_all, num_workers=2, args=(NAMES,), timeout=400
    )
    for name in NAMES:
        reference = tkw.one_device(name, batch_size=32, epochs=2)
        for worker in results:
            got = worker["equality"][name]
            assert max_abs_diff(reference.get_weights(), got["weights"]) < 1e-5, name
            assert got["iterations"] == 4
    first, second = (worker["pruning"] for worker in results)
    assert max_abs_diff(first["weights"], second["weights"]) == 0
    for sparsity in first["sparsity"].values():
        assert abs(sparsity - 0.8) <= 0.01
    assert first["updates"] == first["expected_updates"]


ISOLATION = r"""
import json, os, sys
import keras_dist
report = {"after_keras_dist": sorted(
    m for m in ("tf_keras", "tensorflow_model_optimization") if m in sys.modules)}
import tensorflow as tf
import keras
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
model.fit(tf.zeros((8, 3)), tf.zeros((8, 1)), verbose=0)
if sys.argv[1] == "keras_dist":
    import keras_dist.tf_keras
    import tensorflow_model_optimization as tfmot
else:
    import tensorflow_model_optimization as tfmot
report["tf_keras_is"] = tf.keras.__name__
report["variable"] = os.environ.get("TF_USE_LEGACY_KERAS")
# Keras 3 code that uses tf.keras keeps working (or not) after the import.
try:
    mixed = keras.Sequential([keras.Input((3,)), tf.keras.layers.Dense(1)])
    mixed.compile("sgd", "mse")
    mixed.fit(tf.zeros((8, 3)), tf.zeros((8, 1)), verbose=0)
    report["keras3_with_tf_keras_layers"] = "ok"
except Exception as error:
    report["keras3_with_tf_keras_layers"] = type(error).__name__
model.fit(tf.zeros((8, 3)), tf.zeros((8, 1)), verbose=0)
pruned = tfmot.sparsity.keras.prune_low_magnitude(
    sys.modules["tf_keras"].Sequential([sys.modules["tf_keras"].layers.Dense(
        2, input_shape=(3,))]))
report["tfmot_works"] = type(pruned.layers[0]).__name__
print(json.dumps(report))
"""


def _isolation(how):
    completed = subprocess.run(
        [sys.executable, "-c", ISOLATION, how],
        capture_output=True,
        text=True,
        timeout=180,
        env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_import_keras_dist_imports_neither_tf_keras_nor_tfmot():
    report = _isolation("keras_dist")
    assert report["after_keras_dist"] == []


def test_keras_dist_tf_keras_imports_tfmot_without_switching_tf_keras():
    report = _isolation("keras_dist")
    assert report["tf_keras_is"].startswith("keras")
    assert not report["tf_keras_is"].startswith("tf_keras")
    assert report["variable"] is None
    assert report["keras3_with_tf_keras_layers"] == "ok"
    assert report["tfmot_works"] == "PruneLowMagnitude"


def test_plain_tfmot_import_switches_tf_keras_to_keras_2():
    # What keras_dist.tf_keras guards against: tfmot 0.8.1 alone sets
    # TF_USE_LEGACY_KERAS=1 and binds tf.keras to tf_keras for the process.
    # If this starts failing, tfmot stopped doing it.
    report = _isolation("tfmot")
    assert report["tf_keras_is"].startswith("tf_keras")
    assert report["variable"] == "1"
    assert report["keras3_with_tf_keras_layers"] != "ok"


def test_import_tfmot_is_the_same_module():
    import tensorflow_model_optimization

    assert import_tfmot() is tensorflow_model_optimization


@pytest.mark.parametrize("file_name", ["model.keras", "model.h5"])
def test_model_save_keeps_weights_and_optimizer_state(mirrored, tmp_path, file_name):
    x, y = tkw.data()
    with mirrored(2).scope():
        model = tkw.mlp(DistributedOptimizer(tf_keras.optimizers.Adam(0.01)))
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / file_name)
    loaded = tf_keras.models.load_model(tmp_path / file_name)
    assert max_abs_diff(model.get_weights(), loaded.get_weights()) == 0
    # It loads as the plain optimizer (same class name and module), with
    # its slots and iteration count.
    assert type(loaded.optimizer) is tf_keras.optimizers.Adam
    saved = [v.numpy() for v in model.optimizer.variables]
    assert max_abs_diff(saved, [v.numpy() for v in loaded.optimizer.variables]) == 0


def test_without_tf_keras_the_error_says_what_to_install():
    completed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['tf_keras'] = None\nimport keras_dist.tf_keras",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode != 0
    assert 'pip install ".[tfmot]"' in completed.stderr


# --- What tf_keras's optimizer tests expect of any optimizer (issue 26 G-K) ---


def test_the_instance_is_wrapped_with_what_no_config_carries():
    class Warmup(tf_keras.optimizers.schedules.LearningRateSchedule):
        # Not registered: a config round trip could not rebuild it.
        def __call__(self, step):
            return 0.1 * tf.cast(step + 1, tf.float32)

        def get_config(self):
            return {}

    x, y = tkw.data()
    for make in (
        lambda: tf_keras.optimizers.SGD(Warmup(), momentum=0.5),
        # A callable hyperparameter (legacy optimizers read it every step).
        lambda: tf_keras.optimizers.legacy.SGD(lambda: 0.05, momentum=lambda: 0.5),
    ):
        plain = make()
        wrapped = DistributedOptimizer(plain, accumulation_steps=1)
        assert wrapped is plain
        model = tkw.mlp(wrapped)
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        reference = tkw.mlp(make())
        reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6
    # tf_keras's clone_and_build_model rebuilds the optimizer from its
    # config: the clone is whole and trains like the plain optimizer.
    clone = type(DistributedOptimizer(tf_keras.optimizers.Adam(0.01))).from_config(
        tf_keras.optimizers.Adam(0.01).get_config()
    )
    clone_model = tkw.mlp(clone)
    clone_model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert clone.accumulation_steps == 1
    assert isinstance(clone.all_reduce_hook, keras_dist.compression.NoCompression)


def test_a_legacy_optimizer_trains_on_batch_under_mirrored_collectives():
    # TensorFlow's default cross-device ops for MirroredStrategy (not the
    # fixture's ReductionToOneDevice).
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    x, y = tkw.data()
    with strategy.scope():
        model = tkw.mlp(DistributedOptimizer(tf_keras.optimizers.legacy.Adam(0.01)))
    model.train_on_batch(x[:32], y[:32])
    assert int(model.optimizer.iterations.numpy()) == 1


def test_it_can_be_made_in_a_tf1_graph():
    with tf.Graph().as_default():
        optimizer = DistributedOptimizer(tf_keras.optimizers.SGD(0.1))
        assert optimizer.accumulation_steps == 1


@pytest.mark.parametrize("name", ["Adafactor", "Lion"])
def test_an_h5_model_with_a_wrapped_optimizer_loads(tmp_path, name):
    x, y = tkw.data()
    model = tkw.mlp(DistributedOptimizer(getattr(tf_keras.optimizers, name)()))
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / "model.h5")
    loaded = tf_keras.models.load_model(tmp_path / "model.h5")
    assert type(loaded.optimizer).__name__ == name


def test_numpy_gradients_and_no_gradients_behave_as_in_tf_keras():
    variable = tf.Variable([[1.0, 2.0], [3.0, 4.0]])
    optimizer = DistributedOptimizer(tf_keras.optimizers.SGD(0.5))
    sparse = tf.IndexedSlices(
        np.array([[1.0, 1.0]], "float32"), np.array([1]), np.array([2, 2])
    )
    optimizer.apply_gradients([(sparse, variable)])
    optimizer.apply_gradients([([[1.0, 1.0], [1.0, 1.0]], variable)])
    np.testing.assert_allclose(variable.numpy(), [[0.5, 1.5], [2.0, 3.0]])
    with pytest.raises(ValueError, match="No gradients provided for any variable"):
        optimizer.apply_gradients([(None, variable)])


def test_a_non_finite_update_is_skipped_by_default(mirrored):
    x, y = tkw.data()
    x = x.copy()
    x[40] = np.inf
    with mirrored(2).scope():
        model = tkw.mlp(DistributedOptimizer(tf_keras.optimizers.SGD(0.1)))
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert int(model.optimizer.iterations.numpy()) == len(x) // 32 - 1


# --- Misuse (issue 31 W5-W8) ------------------------------------------------------


def test_wrapping_after_compile_is_the_same_as_before(mirrored):
    # W5: the model holds the instance, and the instance is what is wrapped:
    # accumulation counts updates (2 for 4 micro-batches), the hook is built.
    x, y = tkw.data()

    def fit(wrap_after_compile):
        with mirrored(2).scope():
            optimizer = tf_keras.optimizers.Adam(0.01)
            hook = keras_dist.compression.FP16()
            if not wrap_after_compile:
                optimizer = DistributedOptimizer(
                    optimizer, all_reduce_hook=hook, accumulation_steps=2
                )
            model = tkw.mlp(optimizer)
            if wrap_after_compile:
                DistributedOptimizer(
                    optimizer, all_reduce_hook=hook, accumulation_steps=2
                )
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return model, hook

    after, hook = fit(wrap_after_compile=True)
    before, _ = fit(wrap_after_compile=False)
    assert int(after.optimizer.iterations.numpy()) == 2
    assert int(after.optimizer.micro_steps.numpy()) == 4
    assert hook.built and hook.stats().ratio == pytest.approx(2.0)
    assert max_abs_diff(before.get_weights(), after.get_weights()) == 0


def test_a_tf_keras_optimizer_in_a_keras_3_model_says_what_was_mixed():
    # W6: Keras's own refusal, now with what to use instead.
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = DistributedOptimizer(tf_keras.optimizers.SGD(0.1))
    with pytest.raises(
        ValueError,
        match=r"Could not interpret optimizer identifier: <tf_keras.optimizers.SGD "
        r"made distributed by keras_dist.tf_keras.DistributedOptimizer\. .*"
        r"tf_keras and Keras 3 were mixed: a Keras 3 model takes a Keras 3 "
        r"optimizer, keras.optimizers.SGD\(...\), wrapped for accumulation in "
        r"keras_dist.GradientAccumulationOptimizer",
    ):
        model.compile(optimizer=optimizer, loss="mse")


@pytest.mark.parametrize(
    "make, message",
    [
        # W7: the refusal names this front end's SGD, not Keras 3's.
        (
            lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9),
            r"must not apply momentum.*Use `tf_keras.optimizers.SGD\(learning_rate\)`",
        ),
        # W8, W9 through the tf_keras front end.
        (
            lambda: tf_keras.optimizers.Adagrad(0.1),
            r"must be plain SGD.*Received: optimizer=Adagrad\. Use "
            r"`tf_keras.optimizers.SGD\(learning_rate\)`",
        ),
        (
            lambda: tf_keras.optimizers.SGD(0.1, clipnorm=1.0),
            r"must not clip with `DGC`: its `clipnorm`.*`DGC\(clipnorm=1.0\)`",
        ),
    ],
    ids=["momentum", "adagrad", "clipnorm"],
)
def test_dgc_refusals_name_the_tf_keras_classes(mirrored, make, message):
    with mirrored(2).scope():
        model = tkw.mlp(
            DistributedOptimizer(
                make(), all_reduce_hook=keras_dist.compression.DGC(0.1, warmup_steps=0)
            )
        )
    x, y = tkw.data()
    with pytest.raises(ValueError, match=message):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_dgc_trains_with_tf_keras_sgd(mirrored):
    with mirrored(2).scope():
        model = tkw.mlp(
            DistributedOptimizer(
                tf_keras.optimizers.SGD(0.1),
                all_reduce_hook=keras_dist.compression.DGC(0.5, warmup_steps=0),
            )
        )
    x, y = tkw.data()
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
