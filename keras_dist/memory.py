"""Configure GPU memory once, before TensorFlow initialises its GPUs.

By default TensorFlow reserves almost all memory of every visible GPU as soon as
it creates its first tensor, so a second process on the same GPU (another
worker, an evaluator, a notebook) fails with out-of-memory errors. TensorFlow
fixes its GPU settings when it initialises, and refuses changes afterwards with
`RuntimeError: Physical devices cannot be modified after being initialized`,
far from the line that caused it. `init_memory_growth` applies the usual
settings in one call, must come first, and says so clearly when it comes late.

Example:

```python
import keras_dist

keras_dist.init_memory_growth()          # before any model, tensor or strategy
strategy = keras_dist.auto_strategy()
with strategy.scope():
    model = ...
```
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import os
from collections.abc import Sequence

import tensorflow as tf

from keras_dist._validation import check_choice, check_real

logger = logging.getLogger(__name__)

ALLOCATORS = ("bfc", "cuda_malloc_async")

_ALLOCATOR_ENV = "TF_GPU_ALLOCATOR"
_FORCE_GROWTH_ENV = "TF_FORCE_GPU_ALLOW_GROWTH"

_CALL_ORDER = (
    "    import keras_dist\n"
    "    keras_dist.init_memory_growth()\n"
    "    strategy = keras_dist.auto_strategy()\n"
    "    with strategy.scope():\n"
    "        model = ..."
)


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """What `init_memory_growth` configured.

    Attributes:
        devices: Tuple of strings. Names of the physical GPUs that were
            configured, e.g. `("/physical_device:GPU:0",)`. Empty when
            TensorFlow sees no GPU, in which case nothing was configured.
        memory_growth: Bool. Whether memory growth was enabled on `devices`.
        memory_limit_mb: Int or `None`. The per-GPU memory cap in megabytes, or
            `None` for no cap.
        allocator: String or `None`. The allocator selected through
            `TF_GPU_ALLOCATOR`, or `None` when it was left alone.
    """

    devices: tuple[str, ...] = ()
    memory_growth: bool = False
    memory_limit_mb: int | None = None
    allocator: str | None = None


# The request and result of the first successful call in this process: GPU
# memory settings are fixed once per process, so later calls are checked
# against it instead of being applied again.
_record: tuple[tuple, MemoryConfig] | None = None


def init_memory_growth(
    memory_limit_mb: int | None = None,
    allocator: str | None = None,
    gpus: Sequence[int] | None = None,
) -> MemoryConfig:
    """Enables memory growth (or a memory cap) on the GPUs of this process.

    Call it first, before any model, tensor or strategy is created: TensorFlow
    reads these settings once, when it initialises its GPUs.

    Without arguments, every visible GPU gets memory growth: TensorFlow
    allocates GPU memory as it needs it instead of reserving all of it up
    front, so several processes can share a GPU.

    With `memory_limit_mb`, each configured GPU instead becomes one logical
    device capped at that many megabytes. TensorFlow does not allow memory
    growth on a GPU that has a logical device configuration, so the two are
    mutually exclusive: a limit replaces growth (the returned
    `MemoryConfig.memory_growth` is then `False`).

    `allocator="cuda_malloc_async"` sets `TF_GPU_ALLOCATOR=cuda_malloc_async`,
    which replaces TensorFlow's BFC allocator with CUDA's stream-ordered
    allocator (less fragmentation, memory returned to the driver's pool).
    `allocator="bfc"` removes the variable so the default BFC allocator is
    used even when the variable was inherited from the environment.

    The settings are fixed for the life of the process. A second call with the
    same arguments returns the first result and changes nothing; a second
    call with different arguments raises `RuntimeError`. On a machine where
    TensorFlow sees no GPU, nothing is configured and an empty `MemoryConfig`
    (no devices) is returned.

    Args:
        memory_limit_mb: Int or `None`. Memory cap per GPU in megabytes (a
            whole number > 0). `None` enables memory growth instead. Defaults
            to `None`.
        allocator: String or `None`. One of `"bfc"` or `"cuda_malloc_async"`;
            `None` leaves `TF_GPU_ALLOCATOR` as it is. Defaults to `None`.
        gpus: Sequence of ints or `None`. Indices (into
            `tf.config.list_physical_devices("GPU")`) of the GPUs this process
            uses. The other GPUs are hidden from TensorFlow, because TensorFlow
            requires the same memory-growth setting on every GPU it
            initialises. `None` uses every GPU. Defaults to `None`.

    Returns:
        A frozen `MemoryConfig` describing what was configured.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: `memory_limit_mb` is not a whole number > 0, `allocator`
            is not a known allocator, or `gpus` names a GPU that does not
            exist.
        RuntimeError: TensorFlow has already initialised its GPUs with other
            settings (call this function earlier), a GPU already has a
            conflicting logical device configuration, or this function was
            already called in this process with different arguments.

    Example:

    ```python
    import keras_dist

    keras_dist.init_memory_growth()                        # growth on all GPUs
    # or: keras_dist.init_memory_growth(memory_limit_mb=8192)
    # or: keras_dist.init_memory_growth(allocator="cuda_malloc_async")
    strategy = keras_dist.auto_strategy()
    with strategy.scope():
        model = ...
    ```
    """
    global _record
    memory_limit_mb = _check_memory_limit(memory_limit_mb)
    _check_allocator(allocator)
    gpus = _check_gpus(gpus)
    request = (memory_limit_mb, allocator, gpus)

    if _record is not None:
        previous_request, previous_result = _record
        if previous_request == request:
            logger.debug("GPU memory already configured: %s", previous_result)
            return previous_result
        raise RuntimeError(
            "`init_memory_growth` already configured this process with "
            f"{_format_request(previous_request)}; GPU memory settings are "
            "fixed once per process and cannot change to "
            f"{_format_request(request)}. Call it once, first, with the "
            f"settings you want:\n\n{_CALL_ORDER}"
        )

    physical_gpus = tf.config.list_physical_devices("GPU")
    if not physical_gpus:
        logger.info("TensorFlow sees no GPU: no GPU memory settings to apply.")
        result = MemoryConfig()
        _record = (request, result)
        return result

    if gpus is None:
        selected = list(physical_gpus)
    else:
        for index in gpus:
            if index >= len(physical_gpus):
                raise ValueError(
                    f"`gpus` names GPU {index}, but TensorFlow sees "
                    f"{len(physical_gpus)} GPU(s) (valid indices: "
                    f"0..{len(physical_gpus) - 1}). Received: gpus={list(gpus)!r}."
                )
        selected = [physical_gpus[index] for index in gpus]

    if memory_limit_mb is None:
        _check_no_logical_configuration(selected)
    try:
        if gpus is not None:
            tf.config.set_visible_devices(selected, "GPU")
        for device in selected:
            if memory_limit_mb is None:
                tf.config.experimental.set_memory_growth(device, True)
            else:
                _cap_memory(device, memory_limit_mb)
    except RuntimeError as error:
        raise RuntimeError(
            "TensorFlow has already initialised its GPUs, so their memory "
            f"settings can no longer change (TensorFlow said: {error}). "
            "`keras_dist.init_memory_growth()` must run before any model, "
            "tensor or strategy is created, right after the imports:\n\n"
            f"{_CALL_ORDER}"
        ) from error

    # TensorFlow reads the variable when it creates its GPU devices. Set it
    # only once the device settings went through: had the devices already
    # been created, changing those settings would have raised above.
    if allocator == "cuda_malloc_async":
        os.environ[_ALLOCATOR_ENV] = allocator
    elif allocator == "bfc":
        os.environ.pop(_ALLOCATOR_ENV, None)

    result = MemoryConfig(
        devices=tuple(device.name for device in selected),
        memory_growth=memory_limit_mb is None,
        memory_limit_mb=memory_limit_mb,
        allocator=allocator,
    )
    _record = (request, result)
    logger.info("Configured GPU memory: %s", result)
    return result


def memory_growth_state() -> dict[str, bool]:
    """Returns whether memory growth is in effect on each physical GPU.

    It reflects `tf.config.experimental.get_memory_growth` and the
    `TF_FORCE_GPU_ALLOW_GROWTH` environment variable, which TensorFlow lets
    override it (`"true"` or `"false"`). Nothing is initialised.

    Returns:
        A dict from each physical GPU's name to a bool, for example
        `{"/physical_device:GPU:0": True}`; empty when TensorFlow sees no GPU.

    Example:

    ```python
    >>> keras_dist.memory.memory_growth_state()
    {'/physical_device:GPU:0': True}
    ```
    """
    forced = os.environ.get(_FORCE_GROWTH_ENV)
    state = {}
    for device in tf.config.list_physical_devices("GPU"):
        if forced in ("true", "false"):
            state[device.name] = forced == "true"
        else:
            state[device.name] = bool(tf.config.experimental.get_memory_growth(device))
    return state


def _check_no_logical_configuration(devices) -> None:
    for device in devices:
        if tf.config.get_logical_device_configuration(device):
            raise RuntimeError(
                f"{device.name} already has a logical device configuration "
                "(set with `tf.config.set_logical_device_configuration`), and "
                "TensorFlow allows no memory growth on such a GPU. Remove that "
                "call, or cap the memory instead with "
                "`keras_dist.init_memory_growth(memory_limit_mb=...)`."
            )


def _cap_memory(device, memory_limit_mb: int) -> None:
    if tf.config.experimental.get_memory_growth(device):
        # Growth and a logical device configuration are mutually exclusive.
        tf.config.experimental.set_memory_growth(device, False)
    tf.config.set_logical_device_configuration(
        device, [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)]
    )


def _check_memory_limit(memory_limit_mb):
    hint = "Give a whole number of megabytes, e.g. `8192`."
    value = check_real(
        "memory_limit_mb",
        memory_limit_mb,
        minimum=0,
        low_open=True,
        allow_none=True,
        hint=hint,
    )
    if value is not None and value != int(value):
        raise ValueError(
            "`memory_limit_mb` must be a whole number of megabytes > 0. "
            f"Received: memory_limit_mb={memory_limit_mb!r}. {hint}"
        )
    return None if value is None else int(value)


def _check_allocator(allocator) -> None:
    if allocator is None:
        return
    if not isinstance(allocator, str):
        raise TypeError(
            "`allocator` must be a string or `None`. "
            f"Received: allocator={allocator!r}."
        )
    check_choice(
        "allocator", allocator, ALLOCATORS, hint="Or `None` for TensorFlow's default."
    )


def _check_gpus(gpus):
    if gpus is None:
        return None
    if isinstance(gpus, (str, bytes)) or not isinstance(gpus, Sequence):
        raise TypeError(
            "`gpus` must be a sequence of GPU indices, e.g. `[0, 1]`, or "
            f"`None`. Received: gpus={gpus!r}."
        )
    for index in gpus:
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise TypeError(
                f"`gpus` must hold integer GPU indices. Received: gpus={gpus!r}."
            )
    if not gpus or any(index < 0 for index in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(
            "`gpus` must be a non-empty list of distinct GPU indices >= 0, or "
            f"`None` for every GPU. Received: gpus={gpus!r}."
        )
    return tuple(int(index) for index in gpus)


def _format_request(request) -> str:
    memory_limit_mb, allocator, gpus = request
    gpus = None if gpus is None else list(gpus)
    return (
        f"memory_limit_mb={memory_limit_mb!r}, allocator={allocator!r}, gpus={gpus!r}"
    )
