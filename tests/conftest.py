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


def pytest_collection_modifyitems(config, items):
    if _GPUS:
        return
    skip_gpu = pytest.mark.skip(reason="needs a GPU; TensorFlow sees none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
