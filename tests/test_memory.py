"""Tests for keras_dist.memory.

This test process has already initialised TensorFlow (conftest creates logical
CPU devices), so real "configure before initialisation" checks run in fresh
subprocesses, and only on a GPU machine: without a GPU, TensorFlow has no GPU
setting to refuse, so the "already initialised" error cannot honestly happen on
CPU. Here that path is covered by `FakeGpuRuntime`, a stand-in that applies
the same rules as `tensorflow/python/eager/context.py` (refuse a change after
initialisation, no memory growth on a GPU with a logical configuration).
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf
from helpers import run_python

from keras_dist import memory

HAS_GPU = bool(tf.config.list_physical_devices("GPU"))
no_gpu_only = pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without GPU")

CALL_ORDER = r"import keras_dist\n    keras_dist.init_memory_growth\(\)\n    strategy ="


@pytest.fixture(autouse=True)
def fresh_record(monkeypatch):
    """Each test starts as if `init_memory_growth` was never called."""
    monkeypatch.setattr(memory, "_record", None)


class FakeGpuRuntime:
    """Fake GPUs with the configuration rules of TensorFlow's eager context."""

    def __init__(self, count, initialized=False):
        self.gpus = [
            tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU")
            for i in range(count)
        ]
        self.initialized = initialized
        self.growth = dict.fromkeys(self.gpus)
        self.logical = {}
        self.visible = list(self.gpus)

    def install(self, monkeypatch):
        real_list = tf.config.list_physical_devices

        def list_physical_devices(device_type=None):
            if device_type == "GPU":
                return list(self.gpus)
            return real_list(device_type)

        monkeypatch.setattr(tf.config, "list_physical_devices", list_physical_devices)
        monkeypatch.setattr(
            tf.config.experimental, "set_memory_growth", self.set_memory_growth
        )
        monkeypatch.setattr(
            tf.config.experimental, "get_memory_growth", self.growth.__getitem__
        )
        monkeypatch.setattr(
            tf.config, "set_logical_device_configuration", self.set_logical
        )
        monkeypatch.setattr(
            tf.config, "get_logical_device_configuration", self.logical.get
        )
        monkeypatch.setattr(tf.config, "set_visible_devices", self.set_visible)
        return self

    def _check_not_initialized(self, what):
        if self.initialized:
            raise RuntimeError(f"{what} cannot be modified after being initialized")

    def set_memory_growth(self, device, enable):
        if device in self.logical:
            raise ValueError(
                "Cannot set memory growth on device when virtual devices configured"
            )
        if self.growth[device] == enable:
            return
        self._check_not_initialized("Physical devices")
        self.growth[device] = enable

    def set_logical(self, device, configs):
        if self.logical.get(device) == configs:
            return
        self._check_not_initialized("Virtual devices")
        self.logical[device] = configs

    def set_visible(self, devices, device_type):
        assert device_type == "GPU"
        if self.visible == list(devices):
            return
        self._check_not_initialized("Visible devices")
        self.visible = list(devices)


@pytest.fixture
def no_allocator_env(monkeypatch):
    monkeypatch.delenv("TF_GPU_ALLOCATOR", raising=False)


# Without a GPU (the real runtime of this machine).


@no_gpu_only
def test_no_gpu_returns_empty_result():
    result = memory.init_memory_growth()
    assert result == memory.MemoryConfig()
    assert result.devices == ()
    assert result.memory_growth is False


@no_gpu_only
def test_no_gpu_leaves_allocator_environment_alone(no_allocator_env):
    result = memory.init_memory_growth(allocator="cuda_malloc_async")
    assert result.devices == ()
    assert "TF_GPU_ALLOCATOR" not in os.environ


@no_gpu_only
def test_no_gpu_memory_growth_state_is_empty():
    assert memory.memory_growth_state() == {}


def test_same_call_twice_is_a_no_op():
    first = memory.init_memory_growth(memory_limit_mb=2048)
    second = memory.init_memory_growth(memory_limit_mb=2048.0)
    assert second is first


def test_result_is_frozen():
    result = memory.init_memory_growth()
    with pytest.raises(AttributeError):
        result.memory_growth = True


def test_different_second_call_raises():
    memory.init_memory_growth()
    with pytest.raises(RuntimeError, match=r"already configured this process") as info:
        memory.init_memory_growth(memory_limit_mb=1024)
    assert "memory_limit_mb=None" in str(info.value)
    assert "memory_limit_mb=1024" in str(info.value)


@pytest.mark.parametrize("limit", ["1024", [1024], object()])
def test_memory_limit_must_be_a_number(limit):
    with pytest.raises(
        TypeError, match=r"`memory_limit_mb` must be a finite number > 0 or None\."
    ):
        memory.init_memory_growth(memory_limit_mb=limit)


def test_memory_limit_rejects_bool():
    with pytest.raises(TypeError, match=r"Received: memory_limit_mb=True"):
        memory.init_memory_growth(memory_limit_mb=True)


@pytest.mark.parametrize("limit", [0, -512, float("nan"), float("inf")])
def test_memory_limit_must_be_positive_and_finite(limit):
    with pytest.raises(
        ValueError,
        match=r"`memory_limit_mb` must be a finite number > 0 or None\. .*"
        r"whole number of megabytes, e\.g\. `8192`",
    ):
        memory.init_memory_growth(memory_limit_mb=limit)


@pytest.mark.parametrize("limit", [0.5, 1024.5])
def test_memory_limit_must_be_whole_megabytes(limit):
    with pytest.raises(
        ValueError, match=r"`memory_limit_mb` must be a whole number.*`8192`"
    ):
        memory.init_memory_growth(memory_limit_mb=limit)


def test_memory_limit_accepts_numpy_numbers():
    assert memory._check_memory_limit(np.int64(2048)) == 2048
    assert memory._check_memory_limit(np.float32(1024.0)) == 1024


def test_unknown_allocator():
    with pytest.raises(
        ValueError, match=r"`allocator` must be one of \['bfc', 'cuda_malloc_async'\]"
    ):
        memory.init_memory_growth(allocator="cuda_malloc")


def test_allocator_must_be_a_string():
    with pytest.raises(TypeError, match=r"Received: allocator=1"):
        memory.init_memory_growth(allocator=1)


@pytest.mark.parametrize("gpus", ["0", 0, [0, "1"], [True]])
def test_gpus_type(gpus):
    with pytest.raises(TypeError, match=r"`gpus` must"):
        memory.init_memory_growth(gpus=gpus)


@pytest.mark.parametrize("gpus", [[], [-1], [0, 0]])
def test_gpus_values(gpus):
    with pytest.raises(ValueError, match=r"`gpus` must be a non-empty list"):
        memory.init_memory_growth(gpus=gpus)


def test_bad_arguments_configure_nothing():
    with pytest.raises(ValueError):
        memory.init_memory_growth(memory_limit_mb=0)
    # The failed call left no record behind, so other settings still apply.
    memory.init_memory_growth(memory_limit_mb=512)


# GPU logic on fake GPUs (see the module docstring).


def test_fake_gpus_get_memory_growth(monkeypatch):
    runtime = FakeGpuRuntime(2).install(monkeypatch)
    result = memory.init_memory_growth()
    assert result == memory.MemoryConfig(
        devices=("/physical_device:GPU:0", "/physical_device:GPU:1"),
        memory_growth=True,
    )
    assert all(runtime.growth[gpu] for gpu in runtime.gpus)
    assert runtime.logical == {}
    assert memory.memory_growth_state() == {
        "/physical_device:GPU:0": True,
        "/physical_device:GPU:1": True,
    }


def test_fake_gpus_memory_limit_replaces_growth(monkeypatch):
    runtime = FakeGpuRuntime(2).install(monkeypatch)
    runtime.growth[runtime.gpus[1]] = True  # enabled earlier by hand
    result = memory.init_memory_growth(memory_limit_mb=4096)
    assert result.memory_growth is False
    assert result.memory_limit_mb == 4096
    for gpu in runtime.gpus:
        assert runtime.logical[gpu] == [
            tf.config.LogicalDeviceConfiguration(memory_limit=4096)
        ]
        assert not runtime.growth[gpu]


def test_fake_gpus_subset_hides_the_others(monkeypatch):
    runtime = FakeGpuRuntime(3).install(monkeypatch)
    result = memory.init_memory_growth(gpus=[2, 0])
    assert result.devices == ("/physical_device:GPU:2", "/physical_device:GPU:0")
    assert runtime.visible == [runtime.gpus[2], runtime.gpus[0]]
    assert runtime.growth[runtime.gpus[1]] is None


def test_fake_gpus_index_out_of_range(monkeypatch):
    FakeGpuRuntime(2).install(monkeypatch)
    with pytest.raises(ValueError, match=r"names GPU 2, but TensorFlow sees 2 GPU"):
        memory.init_memory_growth(gpus=[0, 2])


def test_fake_gpus_allocator(monkeypatch, no_allocator_env):
    FakeGpuRuntime(1).install(monkeypatch)
    result = memory.init_memory_growth(allocator="cuda_malloc_async")
    assert result.allocator == "cuda_malloc_async"
    assert os.environ["TF_GPU_ALLOCATOR"] == "cuda_malloc_async"


def test_fake_gpus_bfc_clears_inherited_allocator(monkeypatch):
    FakeGpuRuntime(1).install(monkeypatch)
    monkeypatch.setenv("TF_GPU_ALLOCATOR", "cuda_malloc_async")
    memory.init_memory_growth(allocator="bfc")
    assert "TF_GPU_ALLOCATOR" not in os.environ


def test_fake_gpus_already_initialised(monkeypatch, no_allocator_env):
    FakeGpuRuntime(1, initialized=True).install(monkeypatch)
    with pytest.raises(RuntimeError, match=CALL_ORDER) as info:
        memory.init_memory_growth(allocator="cuda_malloc_async")
    message = str(info.value)
    assert "must run before any model, tensor or strategy is created" in message
    assert "cannot be modified after being initialized" in message
    assert isinstance(info.value.__cause__, RuntimeError)
    # Nothing was recorded or half-applied.
    assert "TF_GPU_ALLOCATOR" not in os.environ
    assert memory._record is None


def test_fake_gpus_already_initialised_with_same_settings(monkeypatch):
    runtime = FakeGpuRuntime(1, initialized=True).install(monkeypatch)
    runtime.growth[runtime.gpus[0]] = True
    assert memory.init_memory_growth().memory_growth is True


def test_fake_gpus_limit_after_initialisation(monkeypatch):
    FakeGpuRuntime(1, initialized=True).install(monkeypatch)
    with pytest.raises(RuntimeError, match=r"Virtual devices cannot be modified"):
        memory.init_memory_growth(memory_limit_mb=1024)


def test_fake_gpus_growth_on_gpu_with_logical_configuration(monkeypatch):
    runtime = FakeGpuRuntime(1).install(monkeypatch)
    runtime.logical[runtime.gpus[0]] = [
        tf.config.LogicalDeviceConfiguration(memory_limit=100)
    ]
    with pytest.raises(RuntimeError, match=r"already has a logical device config"):
        memory.init_memory_growth()


@pytest.mark.parametrize(("forced", "expected"), [("true", True), ("false", False)])
def test_fake_gpus_growth_state_honours_force_variable(monkeypatch, forced, expected):
    runtime = FakeGpuRuntime(1).install(monkeypatch)
    runtime.growth[runtime.gpus[0]] = not expected
    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", forced)
    assert memory.memory_growth_state() == {"/physical_device:GPU:0": expected}


# Real GPUs, in fresh processes (TensorFlow must not be initialised yet).


def _run_fresh(code):
    env = dict.fromkeys(["TF_GPU_ALLOCATOR", "TF_FORCE_GPU_ALLOW_GROWTH"])
    proc = run_python(code, env=env, timeout=180)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_gpu_memory_growth_in_fresh_process():
    out = _run_fresh(
        "import json, keras_dist, tensorflow as tf\n"
        "from keras_dist import memory\n"
        "first = keras_dist.init_memory_growth()\n"
        "tf.constant(1.0) + 1.0\n"
        "again = keras_dist.init_memory_growth()\n"
        "print(json.dumps({'devices': list(first.devices), 'same': again is first,\n"
        "    'state': memory.memory_growth_state(),\n"
        "    'physical': [d.name for d in tf.config.list_physical_devices('GPU')]}))\n"
    )
    assert out["devices"] == out["physical"]
    assert out["same"] is True
    assert all(out["state"].values())


@pytest.mark.gpu
def test_gpu_memory_limit_in_fresh_process():
    out = _run_fresh(
        "import json, keras_dist, tensorflow as tf\n"
        "result = keras_dist.init_memory_growth(memory_limit_mb=1024,\n"
        "                                       allocator='cuda_malloc_async')\n"
        "tf.constant(1.0) + 1.0\n"
        "print(json.dumps({'growth': result.memory_growth,\n"
        "    'logical': len(tf.config.list_logical_devices('GPU')),\n"
        "    'physical': len(tf.config.list_physical_devices('GPU'))}))\n"
    )
    assert out["growth"] is False
    assert out["logical"] == out["physical"]


@pytest.mark.gpu
def test_gpu_too_late_in_fresh_process():
    out = _run_fresh(
        "import json, keras_dist, tensorflow as tf\n"
        "tf.constant(1.0) + 1.0\n"
        "try:\n"
        "    keras_dist.init_memory_growth()\n"
        "    message = None\n"
        "except RuntimeError as error:\n"
        "    message = str(error)\n"
        "print(json.dumps({'message': message}))\n"
    )
    assert out["message"] is not None
    assert "must run before any model, tensor or strategy" in out["message"]
