"""The private Keras/TensorFlow API keras_dist touches is still there.

Each test names one touch from `keras_dist/_compat.py`. When an upgrade moves
one, the failure says which, instead of training silently going wrong.
"""

import os
import subprocess
import sys

import keras
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.losses import loss as loss_module
from keras.src.trainers.trainer import Trainer

from keras_dist import _compat


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
    assert not _compat.is_multi_worker(strategy)
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


def _python(code, **env):
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env},
    )
    assert result.returncode == 0, result.stderr
    return result


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
    assert _python(code).stdout == ""


def test_import_registers_serializable_classes():
    code = (
        "import keras_dist, keras\n"
        "for name in ('DistributedModel', 'GradientAccumulationOptimizer',"
        " 'NoCompression'):\n"
        "    assert keras.saving.get_registered_object('keras_dist>' + name)\n"
    )
    _python(code)


def test_command_line_import_skips_tensorflow():
    code = (
        "import sys\n"
        "sys.argv = ['-m']\n"
        "import keras_dist, keras_dist.cli\n"
        "print('tf' if 'tensorflow' in sys.modules else 'no-tf')\n"
    )
    assert _python(code).stdout == "no-tf\n"


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_other_backend_raises_import_error(backend):
    env = dict(os.environ, KERAS_BACKEND=backend)
    result = subprocess.run(
        [sys.executable, "-c", "import keras_dist"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode != 0
    assert "ImportError" in result.stderr
    assert "KERAS_BACKEND=tensorflow" in result.stderr
    assert repr(backend) in result.stderr
