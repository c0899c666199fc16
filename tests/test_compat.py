"""The private Keras/TensorFlow API keras_dist touches is still there.

Each test names one touch from `keras_dist/_compat.py`. When an upgrade moves
one, the failure says which, instead of training silently going wrong.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import run_python
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.losses import loss as loss_module
from keras.src.trainers.trainer import Trainer

import keras_dist
from keras_dist import state
from keras_dist._compat import keras_src as _compat
from keras_dist._compat import tf_internal
from keras_dist.core import collectives


def test_versions_are_the_tested_ones():
    keras_version = ".".join(keras.__version__.split(".")[:2])
    tf_version = ".".join(tf.__version__.split(".")[:2])
    assert _compat.TESTED_KERAS[0] <= keras_version <= _compat.TESTED_KERAS[1], (
        f"Keras {keras.__version__} is outside the tested range "
        f"{_compat.TESTED_KERAS}: re-check every touch in keras_dist/_compat.py "
        "and update the range."
    )
    assert _compat.TESTED_TENSORFLOW[0] <= tf_version <= _compat.TESTED_TENSORFLOW[1]


def test_optimizer_all_reduce_is_where_we_disable_it():
    assert callable(getattr(TFOptimizer, _compat._OPTIMIZER_ALL_REDUCE))
    optimizer = keras.optimizers.SGD()
    with _compat.optimizer_all_reduce_disabled(optimizer):
        grads_and_vars = [("g", "v")]
        assert optimizer._all_reduce_sum_gradients(grads_and_vars) == grads_and_vars
    assert "_all_reduce_sum_gradients" not in vars(optimizer)


def test_optimizer_patch_covers_loss_scale_inner_optimizer():
    inner = keras.optimizers.SGD()
    outer = keras.optimizers.LossScaleOptimizer(inner)
    with _compat.optimizer_all_reduce_disabled(outer):
        assert "_all_reduce_sum_gradients" in vars(inner)
        with _compat.optimizer_all_reduce_disabled(outer):
            pass
        # Still patched: the outer context has not exited.
        assert "_all_reduce_sum_gradients" in vars(inner)
    assert "_all_reduce_sum_gradients" not in vars(inner)


def test_trainer_private_members_exist():
    assert callable(TensorFlowTrainer._maybe_symbolic_build)
    for name in ("_symbolic_build", "_compute_loss"):
        assert callable(getattr(Trainer, name)), name
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    assert hasattr(model, "_loss_tracker")
    assert isinstance(model._call_has_training_arg, bool)
    assert hasattr(model, "_distribute_strategy")
    assert _compat._needs_symbolic_build(model)
    model.build((None, 2))
    model._symbolic_build(data_batch=(tf.zeros((1, 2)), tf.zeros((1, 1))))
    assert not _compat._needs_symbolic_build(model)
    assert callable(loss_module.unscale_loss_for_distribution)


def test_multi_worker_mode_probe_exists():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    assert not tf_internal.is_multi_worker(strategy)
    assert hasattr(
        tf.distribute.MultiWorkerMirroredStrategy, "extended"
    )  # the probe reads strategy.extended._in_multi_worker_mode
    from tensorflow.python.distribute.collective_all_reduce_strategy import (
        CollectiveAllReduceExtended,
    )

    assert callable(CollectiveAllReduceExtended._in_multi_worker_mode)


def test_functional_class_and_track_variable():
    assert issubclass(_compat.Functional, keras.Model)
    assert callable(keras.optimizers.SGD()._track_variable)


def test_untracked_attribute_stays_out_of_keras_tracking():
    layer = keras.layers.Dense(2)
    sublayer = keras.layers.Dense(3)
    _compat.set_untracked_attribute(layer, "helper", sublayer)
    assert layer.helper is sublayer
    assert sublayer not in layer._flatten_layers(include_self=False)
    # The ordinary assignment is what Keras tracks (the reason for the helper).
    layer.tracked = keras.layers.Dense(3)
    assert layer.tracked in layer._flatten_layers(include_self=False)


def test_attribute_of_type_finds_the_learning_rate_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    optimizer = keras.optimizers.SGD(schedule)
    found = _compat.find_attribute_of_type(
        optimizer, keras.optimizers.schedules.LearningRateSchedule
    )
    assert found is schedule
    plain = keras.optimizers.SGD(0.1)
    assert (
        _compat.find_attribute_of_type(
            plain, keras.optimizers.schedules.LearningRateSchedule
        )
        is None
    )


def test_fit_arguments_bind_to_keras_positional_order():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    values = _compat.bind_fit_arguments(model, ("x", "y", 8), {"epochs": 3})
    assert values == {"x": "x", "y": "y", "batch_size": 8, "epochs": 3}


def test_optimizer_variable_lists():
    variable = keras.Variable(tf.zeros((2,)))
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build([variable])
    own = _compat.optimizer_own_variables(optimizer)
    assert own and all(any(v is o for o in optimizer.variables) for v in own)
    assert _compat.optimizer_trainable_variables(optimizer) == [variable]


def test_state_saveable_is_walked_by_keras_saving(tmp_path):
    # Keras saves `save_own_variables` of KerasSaveable attributes (also
    # properties) under the attribute's name, and accepts "Loss" as the
    # saveable's type.
    from keras.src.saving import saving_lib

    class Counter(_compat.StateSaveable):
        def save_own_variables(self, store):
            store["0"] = tf.constant([7.0]).numpy()

        def load_own_variables(self, store):
            self.loaded = store["0"][...]

    counter = Counter()

    class WithState(keras.Sequential):
        @property
        def extra_state(self):
            return counter

    saving_lib.get_attr_skipset(counter._obj_type())
    model = WithState([keras.Input((2,)), keras.layers.Dense(1)])
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    model.load_weights(path)
    assert list(counter.loaded) == [7.0]


def test_import_builds_nothing_and_prints_nothing():
    # Devices can still be configured after the import: nothing initialised
    # TensorFlow's runtime, no strategy was built, no GPU was touched.
    code = (
        "import keras_dist, tensorflow as tf\n"
        "assert not tf.distribute.has_strategy()\n"
        "cpu = tf.config.list_physical_devices('CPU')[0]\n"
        "tf.config.set_logical_device_configuration(\n"
        "    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)\n"
        "assert len(tf.config.list_logical_devices('CPU')) == 2\n"
    )
    assert run_python(code).stdout == ""


def test_import_registers_serializable_classes():
    code = (
        "import keras_dist, keras\n"
        "for name in ('DistributedModel', 'GradientAccumulationOptimizer',"
        " 'NoCompression'):\n"
        "    assert keras.saving.get_registered_object('keras_dist>' + name)\n"
    )
    run_python(code)


def test_command_line_import_skips_tensorflow():
    code = (
        "import sys\n"
        "sys.argv = ['-m']\n"
        "import keras_dist, keras_dist.cli\n"
        "print('tf' if 'tensorflow' in sys.modules else 'no-tf')\n"
    )
    assert run_python(code).stdout == "no-tf\n"


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_other_backend_raises_import_error(backend):
    result = run_python(
        "import keras_dist", env={"KERAS_BACKEND": backend}, timeout=60, check=False
    )
    assert result.returncode != 0
    assert "ImportError" in result.stderr
    assert "KERAS_BACKEND=tensorflow" in result.stderr
    assert repr(backend) in result.stderr


class _SeesFit(keras.callbacks.Callback):
    """Records what `_compat` finds of the running `fit` at each hook."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_begin(self, logs=None):
        self.iterator = state.session(self.model).epoch_iterator
        assert self.iterator is not None, (
            "Keras's fit no longer hands its epoch iterator to "
            "`_maybe_symbolic_build(iterator=...)` first "
            "(keras/src/backend/tensorflow/trainer.py): BackupAndRestore cannot "
            "resume inside an epoch."
        )

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(_compat.epoch_iterator_position(self.iterator))

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(("fresh", _compat.next_epoch_starts_fresh(self.iterator)))


def _tiny_model(distributed=True):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    if distributed:
        model = keras_dist.DistributedModel.from_model(model)
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_fit_epoch_iterator_counts_batches_and_knows_fresh_epochs():
    x, y = tf.zeros((8, 2)), tf.zeros((8, 1))
    seer = _SeesFit()
    _tiny_model().fit(x, y, batch_size=4, epochs=2, callbacks=[seer], verbose=0)
    # Read whole each epoch: the count starts again, a new iterator each epoch.
    assert seer.seen == [1, 2, ("fresh", True)] * 2
    stream = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
    seer = _SeesFit()
    _tiny_model().fit(stream, steps_per_epoch=2, epochs=2, callbacks=[seer], verbose=0)
    # One stream: the count goes on, the next epoch reads on.
    assert seer.seen == [1, 2, ("fresh", False), 3, 4, ("fresh", False)]
    # A plain keras.Model hands its iterator to no one.
    plain = _tiny_model(distributed=False)
    plain.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert state.session(plain).epoch_iterator is None
    _compat.set_epoch_iterator_position(seer.iterator, 7)
    assert seer.iterator._steps_seen == 7


def test_initial_epoch_is_what_fit_reads():
    model = _tiny_model()
    _compat.set_initial_epoch(model, 1)
    history = model.fit(tf.zeros((4, 2)), tf.zeros((4, 1)), epochs=2, verbose=0)
    assert history.epoch == [1]
    _compat.set_initial_epoch(model, None)
    assert model._initial_epoch is None


def test_stock_backup_paths_are_where_we_redirect_them(tmp_path):
    callback = keras.callbacks.BackupAndRestore(str(tmp_path / "shared"))
    previous = _compat.redirect_stock_backup(callback, str(tmp_path / "mine"))
    assert callback.backup_dir == str(tmp_path / "mine")
    assert callback._weights_path == str(tmp_path / "mine" / "latest.weights.h5")
    assert set(previous) == set(_compat._STOCK_BACKUP_PATHS)
    assert all(str(tmp_path / "shared") in str(value) for value in previous.values())
    _compat.restore_attributes(callback, previous)
    assert callback._training_metadata_path == str(
        tmp_path / "shared" / "training_metadata.json"
    )


def test_build_from_epoch_iterator_builds_metrics_and_keeps_every_batch():
    class Build(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            assert not self.model._compile_metrics.built
            _compat.build_from_epoch_iterator(
                self.model, state.session(self.model).epoch_iterator
            )
            self.built = self.model._compile_metrics.built

    model = keras_dist.DistributedModel.from_model(
        keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    )
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    build = Build()
    history = model.fit(
        tf.zeros((12, 2)), tf.zeros((12, 1)), batch_size=4, callbacks=[build], verbose=0
    )
    assert build.built
    assert int(model.optimizer.iterations.numpy()) == 3  # no batch lost
    assert history.history["mae"] == [0.0]


def test_collective_keys_live_where_we_replace_them():
    # `keras_dist/_compat/tf_internal.py`: a strategy's collective keys and
    # the `CollectiveAllReduce` objects made with them.
    from tensorflow.python.distribute import cross_device_ops, cross_device_utils

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    extended = strategy.extended
    assert isinstance(extended._collective_keys, cross_device_utils.CollectiveKeys)
    ops = extended._collective_ops
    assert isinstance(ops, cross_device_ops.CollectiveAllReduce)
    assert ops._collective_keys is extended._collective_keys
    for name in ("_devices", "_group_size", "_options"):
        assert hasattr(ops, name), name
    assert tf_internal.rekey_collectives(strategy, 700_000)
    assert extended._collective_ops._launchers[0]._group_key == 700_001


def test_all_reduces_take_subdivisions_through_the_launchers():
    # `keras_dist/_compat/tf_internal.py::own_launchers`: the launcher class
    # whose `all_reduce` we re-state, and the op attribute it sets.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert tf_internal.own_launchers(strategy, 8) == 2
    launcher = strategy.extended._collective_ops._launchers[0]
    assert isinstance(launcher, tf_internal._OwnedLauncher)
    source = tf.ones([1000])

    @tf.function
    def step():
        def replica():
            context = tf.distribute.get_replica_context()
            mine = source * tf.cast(context.replica_id_in_sync_group + 1, tf.float32)
            return context.all_reduce(tf.distribute.ReduceOp.SUM, mine)

        return strategy.run(replica)

    graph = step.get_concrete_function().graph
    reduces = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    assert reduces
    assert {op.get_attr("max_subdivs_per_device") for op in reduces} == {8}
    values = strategy.experimental_local_results(step())
    for value in values:
        np.testing.assert_array_equal(value.numpy(), 3 * np.ones(1000))


def test_unordered_collectives_leave_the_automatic_control_dependencies():
    # `tf_internal.all_to_all(..., ordered=False)`: a function being traced
    # keeps its `AutomaticControlDependencies` as `experimental_acd_manager`,
    # whose `run_independently` keeps an op out of the program-order chain
    # of stateful ops (tensorflow/python/framework/auto_control_deps.py).
    from tensorflow.python.framework import auto_control_deps

    assert callable(auto_control_deps.AutomaticControlDependencies.run_independently)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert tf_internal.rekey_collectives(strategy, 720_000)  # keys of its own
    seen = {}

    @tf.function
    def step():
        def replica():
            graph = tf.compat.v1.get_default_graph()
            seen["manager"] = graph.experimental_acd_manager
            rows = tf.ones([2, 8])
            first = tf_internal.all_to_all(strategy, rows, ordered=False)
            second = tf_internal.all_to_all(strategy, rows * 2, ordered=False)
            return first + second

        return strategy.run(replica)

    graph = step.get_concrete_function().graph
    assert isinstance(seen["manager"], auto_control_deps.AutomaticControlDependencies)
    ops = [op for op in graph.get_operations() if op.type == "CollectiveAllToAllV2"]
    assert len(ops) == 4
    for op in ops:
        assert not [c for c in op.control_inputs if c.type.startswith("Collective")]
        assert all(t.dtype != tf.resource for t in op.inputs)  # no ordering token
    for value in strategy.experimental_local_results(step()):
        np.testing.assert_array_equal(value.numpy(), 3 * np.ones([2, 8]))


def test_stable_instance_keys_stop_drawing_keys_after_the_first_call():
    # `tf_internal.stable_instance_keys`: TensorFlow draws a new instance
    # key per collective per call (`CollectiveKeys._instance_key_table`, a
    # counter per group and device, read through the launcher's
    # `_next_instance_key` in a call-time capture); a static-shape
    # all-reduce traced inside the context draws one at its first call and
    # keeps it. An all-reduce whose shape is known only at run time keeps
    # TensorFlow's keys.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    # Keys of its own (another strategy of this process used the same).
    collectives.own(strategy)
    tf_internal.own_launchers(strategy, 8)
    launcher = strategy.extended._collective_ops._launchers[0]
    keys = strategy.extended._collective_keys

    def drawn():
        return keys._instance_key_table[launcher._group_key][launcher._device]

    def make_step(stable, dynamic=False):
        spec = [tf.TensorSpec([None] if dynamic else [3], tf.float32)]

        @tf.function(input_signature=spec)
        def step(x):
            def replica():
                context = tf.distribute.get_replica_context()
                mine = x * tf.cast(context.replica_id_in_sync_group + 1, tf.float32)
                return context.all_reduce(tf.distribute.ReduceOp.SUM, mine)

            if stable:
                with tf_internal.stable_instance_keys():
                    return strategy.run(replica)
            return strategy.run(replica)

        return step

    cases = [(True, False, 0), (False, False, 1), (True, True, 1)]
    for stable, dynamic, per_call in cases:
        step = make_step(stable, dynamic)
        step(tf.ones(3))
        before = drawn()
        for _ in range(3):
            values = strategy.experimental_local_results(step(tf.ones(3)))
            np.testing.assert_array_equal(values[0].numpy(), [3.0, 3.0, 3.0])
        assert drawn() - before == 3 * per_call, (stable, dynamic)


def test_tf_keras_registered_names_are_where_we_extend_them():
    # `keras_dist/_compat/tf_keras_src.py`.
    import tf_keras
    from tf_keras.src.saving import object_registration

    from keras_dist._compat import tf_keras_src

    assert isinstance(object_registration._GLOBAL_CUSTOM_NAMES, dict)
    base = tf_keras.optimizers.Adafactor
    subclass = type("Adafactor", (base,), {})
    tf_keras_src.save_under_the_name_of(subclass, base)
    assert object_registration.get_registered_name(subclass) == "Custom>Adafactor"


def test_checkpoint_writes_what_an_instance_serializes(tmp_path):
    # tf.train.Checkpoint honours a variable's own _serialize_to_tensors and
    # _restore_from_tensors, also through a Keras variable that delegates.
    variable = keras.Variable(tf.zeros([2]))
    tf_internal.checkpoint_through(
        variable.value, lambda: tf.constant([1.0, 2.0, 3.0]), lambda value: None
    )
    path = tf.train.Checkpoint(v=variable).save(str(tmp_path / "ckpt"))
    saved = tf.train.load_checkpoint(path)
    names = [n for n in saved.get_variable_to_shape_map() if n.startswith("v/")]
    assert names == ["v/.ATTRIBUTES/" + tf_internal.CHECKPOINT_TENSOR_KEY]
    assert saved.get_tensor(names[0]).tolist() == [1.0, 2.0, 3.0]
    restored = []
    other = keras.Variable(tf.zeros([2]))
    tf_internal.checkpoint_through(other.value, lambda: other.value, restored.append)
    tf.train.Checkpoint(v=other).restore(path)
    assert restored[0].numpy().tolist() == [1.0, 2.0, 3.0]


def test_a_closure_outputs_are_where_we_read_their_devices():
    # `parameter_server.training` tells a worker lost with a completed step's
    # outputs from a lost ps task by where the outputs live.
    from tensorflow.python.distribute.coordinator import values

    from keras_dist._compat import tf_internal

    remote = values.RemoteValueImpl(None, None)
    assert tf_internal.remote_value_devices(remote) == set()
    loss = tf.constant(1.0)
    remote._set_values({"loss": loss, "steps": 3})
    assert tf_internal.remote_value_devices(remote) == {loss.device}


def test_the_global_batch_of_fit_input_is_read_without_reading_data():
    # Elastic resume needs the new run's global batch; reading an element
    # would move a reshuffling dataset's seed generator on.
    from keras_dist._compat import tf_internal

    base = tf.data.Dataset.range(100)
    assert tf_internal.dataset_batch_size(base.batch(24, drop_remainder=True)) == 24
    shuffled = base.shuffle(10, seed=1, reshuffle_each_iteration=True)
    assert tf_internal.dataset_batch_size(shuffled.repeat().batch(24).prefetch(2)) == 24
    mapped = base.batch(16).map(lambda i: i * 2).with_options(tf.data.Options())
    assert tf_internal.dataset_batch_size(mapped) == 16
    assert tf_internal.dataset_batch_size(base.batch(16).unbatch().batch(8)) == 8
    assert tf_internal.dataset_batch_size(base.batch(16).unbatch()) is None
    assert tf_internal.dataset_batch_size(base) is None
    x, y = tf.zeros((8, 2)), tf.zeros((8, 1))
    seer = _SeesFit()
    _tiny_model().fit(x, y, batch_size=4, epochs=1, callbacks=[seer], verbose=0)
    assert _compat.epoch_iterator_input(seer.iterator) == ("arrays", 4)
    seer = _SeesFit()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(2)
    _tiny_model().fit(dataset, epochs=1, callbacks=[seer], verbose=0)
    assert _compat.epoch_iterator_input(seer.iterator) == ("tf.data", 2)


def test_variables_outside_the_strategy_are_plain_and_decay_in_a_replica(mirrored):
    # `tf_internal.outside_strategy` empties the graph's creator and strategy
    # stacks; `keras_src.update_whole` calls `_apply_weight_decay` and
    # `update_step` (TFOptimizer's weight decay goes through the strategy,
    # so the backend-free one of BaseOptimizer is used instead).
    strategy = mirrored(2)
    with strategy.scope():
        with tf_internal.outside_strategy("/cpu:1"):
            plain = keras.Variable(tf.ones((2,)), name="plain")
            optimizer = keras.optimizers.AdamW(0.1, weight_decay=0.5)
            optimizer.build([plain])
        assert tf.distribute.has_strategy()
    assert not isinstance(plain.value, tf.distribute.DistributedValues)
    assert plain.value.device.endswith("CPU:1")
    assert optimizer._distribution_strategy is not strategy
    assert "_apply_weight_decay" in vars(TFOptimizer)

    @tf.function
    def step():
        def replica():
            if tf.distribute.get_replica_context().replica_id_in_sync_group == 1:
                _compat.update_whole(
                    optimizer, [tf.zeros((2,))], [plain], [plain], tf.constant(0.1)
                )

        strategy.run(replica)

    step()
    np.testing.assert_allclose(plain.numpy(), [0.95, 0.95])
