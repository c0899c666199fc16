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


def mirrored(num_replicas):
    """Returns a MirroredStrategy over `num_replicas` logical CPU devices."""
    devices = [f"/cpu:{i}" for i in range(num_replicas)]
    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


@pytest.fixture
def mirrored2():
    return mirrored(2)


@pytest.fixture
def mirrored4():
    return mirrored(4)


def pytest_collection_modifyitems(config, items):
    if _GPUS:
        return
    skip_gpu = pytest.mark.skip(reason="needs a GPU; TensorFlow sees none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
