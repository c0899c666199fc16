"""Shared test setup: logical CPU replicas, strategy fixtures, GPU marker.

TensorFlow fixes its device list when it first initialises, so the logical CPU
devices are created here, at import time of the test session, before any test
module builds a tensor.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest
import tensorflow as tf

NUM_CPU_REPLICAS = 4

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_CPU_REPLICAS
)
_GPUS = tf.config.list_physical_devices("GPU")


def _no_tf_data_autotuning():
    """Every `tf.data` iterator of the test processes runs without autotuning.

    Deleting an autotuned iterator can wait out its tuning thread's sleep,
    up to 60 s, holding the GIL, when the machine is busy: a TensorFlow race
    (docs/troubleshooting.md, "Pauses between fit, evaluate and predict")
    that made tests of a few seconds take 80-400 s in CI. Users avoid it
    with `options.autotune.enabled = False` on their datasets; Keras's own
    pipelines (arrays, `PyDataset`) take no options, so the suite applies it
    where TensorFlow makes every iterator (`_apply_debug_options`, which
    `tf.data.experimental.enable_debug_mode` uses the same way). Autotuning
    picks parallelism and buffer sizes only; what a pipeline yields, and in
    which order, is the same. Worker processes keep it.
    """
    from tensorflow.python.data.ops import dataset_ops

    options = tf.data.Options()
    options.autotune.enabled = False
    apply_debug_options = dataset_ops.DatasetV2._apply_debug_options

    def without_autotuning(dataset):
        return apply_debug_options(dataset).with_options(options)

    dataset_ops.DatasetV2._apply_debug_options = without_autotuning


_no_tf_data_autotuning()


@pytest.fixture(scope="session")
def mirrored():
    """The factory `mirrored(num_replicas)` of MirroredStrategy on logical CPUs.

    A test calls it for each strategy it needs (`mirrored(2)`); helpers take
    the strategy as an argument.
    """

    def make(num_replicas):
        devices = [f"/cpu:{i}" for i in range(num_replicas)]
        return tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
        )

    return make


def _cluster_environment():
    return {
        name: value
        for name, value in os.environ.items()
        if name == "TF_CONFIG" or name.startswith(("KERAS_DIST_", "SLURM_"))
    }


@pytest.fixture(autouse=True)
def _no_cluster_environment_leak():
    """Fails the test that leaves TF_CONFIG, KERAS_DIST_* or SLURM_* changed.

    These variables make `auto_strategy` build a multi-worker strategy. A test
    that leaks one breaks whichever test runs next in its process, and under
    pytest-xdist that is a different test than in a serial run; failing the
    leaking test itself names the culprit. The variables are restored, so the
    next test still starts clean.
    """
    before = _cluster_environment()
    yield
    after = _cluster_environment()
    if after != before:
        for name in after.keys() - before.keys():
            del os.environ[name]
        os.environ.update(before)
        changed = sorted(
            name
            for name in before.keys() | after.keys()
            if before.get(name) != after.get(name)
        )
        pytest.fail(f"the test left these variables changed: {changed}")


def pytest_collection_modifyitems(config, items):
    if _GPUS:
        return
    skip_gpu = pytest.mark.skip(reason="needs a GPU; TensorFlow sees none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
