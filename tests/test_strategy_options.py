"""`auto_strategy(cross_device_ops=..., communication_options=...)`.

How the chosen strategy sums across devices: `cross_device_ops` for a
single-machine `MirroredStrategy` (tested on logical CPU devices), and
`communication_options` for `MultiWorkerMirroredStrategy` (tested in two real
worker processes). Each strategy ignores the other's option, with a log line,
so one script can carry both.
"""

import logging

import pytest
import tensorflow as tf
import workers

import keras_dist
from keras_dist import strategy
from keras_dist.testing import run_workers

RING = tf.distribute.experimental.CommunicationImplementation.RING


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("TF_CONFIG", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)


def _sum_of_ones(built):
    return float(built.reduce("SUM", built.run(lambda: tf.constant(1.0)), axis=None))


@pytest.mark.parametrize(
    "ops",
    [tf.distribute.HierarchicalCopyAllReduce(), tf.distribute.ReductionToOneDevice()],
    ids=type,
)
def test_cross_device_ops_reach_the_cpu_mirror(clean_env, ops):
    built = keras_dist.auto_strategy(cpu_replicas=2, cross_device_ops=ops)
    assert built.extended._cross_device_ops is ops
    assert _sum_of_ones(built) == 2.0


def test_cpu_mirror_defaults_to_reduction_to_one_device(clean_env):
    built = keras_dist.auto_strategy(cpu_replicas=2)
    assert isinstance(
        built.extended._cross_device_ops, tf.distribute.ReductionToOneDevice
    )


def test_nccl_on_cpu_replicas_is_refused(clean_env):
    with pytest.raises(ValueError, match=r"NcclAllReduce\(\)` sums only between GPUs"):
        keras_dist.auto_strategy(
            cpu_replicas=2, cross_device_ops=tf.distribute.NcclAllReduce()
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"cross_device_ops": tf.distribute.HierarchicalCopyAllReduce},
            r"`cross_device_ops` must be a `tf.distribute.CrossDeviceOps` "
            r"instance.*Received: cross_device_ops=<class",
        ),
        (
            {"cross_device_ops": "nccl"},
            r"Received: cross_device_ops='nccl'",
        ),
        (
            {"communication_options": RING},
            r"`communication_options` must be a .*CommunicationOptions`. "
            r"Received: communication_options=",
        ),
    ],
)
def test_wrong_types_are_refused(clean_env, kwargs, match):
    with pytest.raises(TypeError, match=match):
        keras_dist.auto_strategy(cpu_replicas=2, **kwargs)


def test_options_a_strategy_does_not_use_are_logged(clean_env, caplog):
    if tf.config.get_visible_devices("GPU"):
        pytest.skip("this machine has GPUs")
    options = tf.distribute.experimental.CommunicationOptions(implementation=RING)
    with caplog.at_level(logging.INFO, logger="keras_dist.strategy"):
        built = keras_dist.auto_strategy(
            cross_device_ops=tf.distribute.ReductionToOneDevice(),
            communication_options=options,
        )
    assert built is tf.distribute.get_strategy()
    assert "DefaultStrategy does not use cross_device_ops" in caplog.text
    assert "DefaultStrategy does not use communication_options" in caplog.text


def test_communication_options_reach_multi_worker_strategy(monkeypatch, clean_env):
    calls = []
    monkeypatch.setattr(strategy.cluster_lib, "wait_for_cluster", lambda *a: None)
    monkeypatch.setattr(
        tf.distribute,
        "MultiWorkerMirroredStrategy",
        lambda **kwargs: calls.append(kwargs) or "built",
    )
    monkeypatch.setenv(
        "TF_CONFIG",
        '{"cluster": {"worker": ["localhost:2001", "localhost:2002"]},'
        ' "task": {"type": "worker", "index": 0}}',
    )
    options = tf.distribute.experimental.CommunicationOptions(implementation=RING)
    assert keras_dist.auto_strategy(communication_options=options) == "built"
    assert calls[0]["communication_options"] is options


@pytest.mark.multiworker
def test_communication_options_in_two_real_workers():
    results = run_workers(
        workers.strategy_with_communication_options, num_workers=2, timeout=240
    )
    assert results == [(True, 2.0, "RING", None, 120.0, 120)] * 2


def test_cross_device_ops_reach_the_gpu_mirror(monkeypatch, clean_env):
    fake = [
        tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in (0, 1)
    ]
    monkeypatch.setattr(tf.config, "get_visible_devices", lambda device_type: fake)
    calls = []
    monkeypatch.setattr(
        tf.distribute,
        "MirroredStrategy",
        lambda *args, **kwargs: calls.append(kwargs) or "built",
    )
    ops = tf.distribute.HierarchicalCopyAllReduce()
    assert keras_dist.auto_strategy(cross_device_ops=ops) == "built"
    assert calls == [{"cross_device_ops": ops}]
