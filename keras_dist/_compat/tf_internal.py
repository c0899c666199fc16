"""Private TensorFlow API keras_dist touches, with no Keras import.

The core (`keras_dist/core/`) and the tf_keras front end use these; the
Keras 3 touches are in `keras_src.py`. `tests/test_compat.py` pins each.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as _cross_device_ops
from tensorflow.python.distribute import cross_device_utils as _cross_device_utils
from tensorflow.python.distribute import device_util as _device_util
from tensorflow.python.ops import collective_ops as _collective_ops

# --- Collective keys -------------------------------------------------------
#
# `MirroredStrategy` and `MultiWorkerMirroredStrategy` number their collective
# groups from the class attribute `_collective_key_base` (0 unless a test
# changes it: tensorflow/python/distribute/strategy_combinations.py adds
# 100000 per strategy for exactly this reason), and every instance starts its
# instance keys at the same number. The runtime caches collective instances
# by (group, instance) key for the life of the process, so the replica-context
# collectives of a second strategy meet the cached instances of the first:
# "Shape mismatch in the collective instance 101". A strategy's keys live in
# `extended._collective_keys`, and the `CollectiveAllReduce` objects that
# issue its collectives hold that object and a group key taken from it when
# they were made; giving a strategy other keys means new ones of both.

_CROSS_DEVICE_OPS_ATTRIBUTES = (
    "_collective_ops",
    "_cross_device_ops",
    "_host_cross_device_ops",
)


def _collective_all_reduces(extended, attributes=_CROSS_DEVICE_OPS_ATTRIBUTES):
    """`(attribute, ops)` for each of `extended`'s `CollectiveAllReduce`s."""
    for attribute in attributes:
        ops = getattr(extended, attribute, None)
        if isinstance(ops, _cross_device_ops.CollectiveAllReduce):
            yield attribute, ops


def collective_group_base(strategy) -> int | None:
    """The first group key `strategy`'s collectives use, or `None` (none)."""
    keys = getattr(strategy.extended, "_collective_keys", None)
    if not isinstance(keys, _cross_device_utils.CollectiveKeys):
        return None
    return int(getattr(strategy.extended, "_collective_key_base", 0)) + 1


def rekey_collectives(strategy, base: int) -> bool:
    """Gives `strategy` collective group keys starting at `base + 1`.

    Replaces its `CollectiveKeys` and every `CollectiveAllReduce` made with
    the old keys (same devices, group size and options). Functions traced
    before keep the keys they captured; everything issued afterwards uses
    the new ones.

    Returns:
        Whether `strategy` has collective keys (`False`: the default
        strategy, `OneDeviceStrategy`, parameter servers, a strategy built
        with other cross-device ops only).
    """
    extended = strategy.extended
    old_keys = getattr(extended, "_collective_keys", None)
    if not isinstance(old_keys, _cross_device_utils.CollectiveKeys):
        return False
    new_keys = _cross_device_utils.CollectiveKeys(group_key_start=base + 1)
    replaced = {}
    for attribute, ops in _collective_all_reduces(extended):
        if ops._collective_keys is not old_keys:
            continue
        if id(ops) not in replaced:
            replaced[id(ops)] = _cross_device_ops.CollectiveAllReduce(
                devices=ops._devices,
                group_size=ops._group_size,
                options=ops._options,
                collective_keys=new_keys,
            )
        setattr(extended, attribute, replaced[id(ops)])
    extended._collective_keys = new_keys
    extended._collective_key_base = base
    return True


# --- The launchers of an owned strategy ---------------------------------------
#
# `CollectiveReplicaLauncher.all_reduce` issues `all_reduce_v2` without
# `max_subdivs_per_device`, whose default (-1) sends each tensor round the ring
# in one piece per step: on CPU workers every piece is one gRPC message, and
# the reduction of a piece waits for all of it. With subdivisions the ring
# splits a tensor into pieces the runtime pipelines (TensorFlow sizes them, a
# few MiB each). `CommunicationOptions` has no such field, so the strategy's
# launchers are given a subclass. Measured between 2 worker processes on one
# machine (unshaped loopback), 100 MB of float32: 0.38-0.40 s as the strategy
# issues it, 0.21-0.24 s with 8-64 subdivisions (docs/benchmarks/ddp.md).
#
# Instance keys. In a function, TensorFlow 2 gives every collective a new
# instance key on every call (`_next_instance_key`, a call-time capture, so
# that workers that trace at different times still agree), and the runtime
# keeps a record of every instance key it has seen for the life of the
# process (`CollectiveParamResolverLocal`'s instance table): about 1.5 KiB
# per collective call between worker processes, 6 MB per 1,000 steps of four
# all-reduces, without end (tensorflow/tensorflow#42616). While keras_dist
# traces its own step functions (`stable_instance_keys`), whose one argument
# is the iterator, so every worker traces them alike, an all-reduce of a
# static shape takes its key at the first call of its function, from the
# same counter, and keeps it: the records stop growing. Anything else (a
# shape known only at run time, a user's own function) keeps TensorFlow's
# keys.

# The graphs traced under `stable_instance_keys` carry this attribute: a
# mark on the graph, not on the thread, since `MirroredStrategy` traces
# each replica's ops into the same graph from a thread of its own.
_STABLE_KEYS_MARK = "_keras_dist_stable_instance_keys"


@contextlib.contextmanager
def stable_instance_keys():
    """All-reduces traced inside reuse one instance key per call site.

    For functions every worker traces the same way, in the same order (not
    for one whose tracing follows the shape of its input, which can differ
    between workers at a short last batch). Only what is traced into the
    current function graph (and functions and control flow inside it) is
    affected; eagerly, nothing is.
    """
    graph = _function_graph()
    if graph is None:
        yield
        return
    previous = getattr(graph, _STABLE_KEYS_MARK, False)
    setattr(graph, _STABLE_KEYS_MARK, True)
    try:
        yield
    finally:
        setattr(graph, _STABLE_KEYS_MARK, previous)


class _FirstCallKey:
    """An instance key taken from the launcher's counter at the first call."""

    def __init__(self, launcher):
        self._launcher = launcher
        self._key = None

    def __call__(self):
        if self._key is None:
            launcher = self._launcher
            self._key = launcher._collective_keys.get_instance_key(
                launcher._group_key, launcher._device
            )
        with tf.device("CPU:0"):
            return tf.constant(self._key, dtype=tf.int32)


def _function_graph():
    """The function graph a call-time capture goes into, or `None` (eager)."""
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        graph = graph.outer_graph
    return graph if getattr(graph, "building_function", False) else None


def _keeps_key(tensor) -> bool:
    """Whether a collective of `tensor` traced now keeps its instance key."""
    if not tensor.shape.is_fully_defined():
        return False
    graph = _function_graph()
    while graph is not None:
        if getattr(graph, _STABLE_KEYS_MARK, False):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def _instance_key(launcher, tensor):
    """`tensor`'s collective instance key: kept (see above) or TensorFlow's."""
    from tensorflow.python.framework import tensor_spec

    if not _keeps_key(tensor):
        return launcher._next_instance_key()
    graph = _function_graph()
    with graph.as_default():
        return graph.capture_call_time_value(
            _FirstCallKey(launcher), tensor_spec.TensorSpec([], tf.int32)
        )


class _OwnedLauncher(_cross_device_utils.CollectiveReplicaLauncher):
    """TensorFlow's launcher, with subdivided all-reduces and kept keys."""

    max_subdivs = -1  # Set on each instance by `own_launchers`.

    def all_reduce(self, input_tensor, control_input=None, options=None):
        # `CollectiveReplicaLauncher.all_reduce` of TensorFlow 2.21, plus the
        # subdivisions and the instance key.
        input_tensor = tf.convert_to_tensor(input_tensor)
        instance_key = _instance_key(self, input_tensor)
        options = self._options.merge(options)
        ordering_token = self._get_ordering_token()
        with tf.device(self._device), self._control_input(control_input):
            return _collective_ops.all_reduce_v2(
                input_tensor,
                self._group_size,
                self._group_key,
                instance_key,
                communication_hint=options.implementation.value,
                timeout=options.timeout_seconds,
                ordering_token=ordering_token,
                max_subdivs_per_device=self.max_subdivs,
            )

    def _all_gather(self, input_tensor, options):
        # `CollectiveReplicaLauncher._all_gather` of TensorFlow 2.21, plus
        # the instance key.
        input_tensor = tf.convert_to_tensor(input_tensor)
        instance_key = _instance_key(self, input_tensor)
        options = self._options.merge(options)
        ordering_token = self._get_ordering_token()
        with tf.device(self._device):
            return _collective_ops.all_gather_v2(
                input_tensor,
                self._group_size,
                self._group_key,
                instance_key,
                communication_hint=options.implementation.value,
                timeout=options.timeout_seconds,
                ordering_token=ordering_token,
            )

    def all_gather(self, input_tensor, axis, options=None):
        # TensorFlow's gathers the shapes first and pads every member to the
        # longest, with a key per call for the padded gather (its shape is
        # known only at run time). A static shape in a function every worker
        # traces alike is every member's shape: one gather, with a kept key.
        input_tensor = tf.convert_to_tensor(input_tensor)
        static_axis = tf.get_static_value(axis)
        if static_axis is None or not _keeps_key(input_tensor):
            return super().all_gather(input_tensor, axis, options)
        rank = input_tensor.shape.rank
        axis = int(static_axis) % rank
        to_front = [axis, *range(axis), *range(axis + 1, rank)]
        back = [*range(1, axis + 1), 0, *range(axis + 1, rank)]
        with tf.device(self._device):
            gathered = self._all_gather(tf.transpose(input_tensor, to_front), options)
            return tf.transpose(gathered, back)


def own_launchers(strategy, max_subdivs: int) -> int:
    """Gives `strategy`'s launchers keras_dist's all-reduce; returns how many.

    CPU launchers split a tensor into up to `max_subdivs` pipelined pieces
    (NCCL ignores the subdivisions); every launcher keeps its instance keys
    under `stable_instance_keys`. Call it after `rekey_collectives` (which
    makes new launchers).
    """
    changed = 0
    seen = set()
    for _, ops in _collective_all_reduces(strategy.extended):
        if id(ops) in seen:
            continue
        seen.add(id(ops))
        for launcher in ops._launchers:
            if type(launcher) is _cross_device_utils.CollectiveReplicaLauncher:
                launcher.__class__ = _OwnedLauncher
            if not isinstance(launcher, _OwnedLauncher):
                continue
            device = tf.DeviceSpec.from_string(launcher._device)
            cpu = (device.device_type or "CPU").upper() == "CPU"
            launcher.max_subdivs = int(max_subdivs) if cpu else -1
            changed += 1
    return changed


def is_multi_worker(strategy) -> bool:
    """Whether `strategy` is a MultiWorkerMirroredStrategy spanning workers."""
    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.extended._in_multi_worker_mode()
    )


# --- All-to-all and unordered collectives -------------------------------------
#
# TensorFlow has an all-to-all collective on CPUs and GPUs
# (`collective_ops.all_to_all_v2`) but no replica-context API for it, and its
# reduce-scatter resolves only on NCCL. keras_dist builds reduce-scatter from
# it (`keras_dist.core.collectives.reduce_scatter`), issued through the same
# per-device launcher as the strategy's own collectives: its group, the next
# instance key of that group and its ordering token, so it is ordered with
# them and keyed like them.
#
# Unordered (`ordered=False`): no ordering token, and the op is left out of
# the automatic control dependencies, which chain stateful ops in program
# order (`run_independently` of the `AutomaticControlDependencies` that
# TensorFlow 2.21 keeps on the traced graph as `experimental_acd_manager`):
# it runs as soon as its input exists (`keras_dist.core.chunked`).


def _collective_all_reduce(strategy):
    attributes = ("_collective_ops", "_cross_device_ops")
    for _, ops in _collective_all_reduces(strategy.extended, attributes):
        return ops
    raise ValueError(
        f"{type(strategy).__name__} has no collective ops for an all-to-all "
        "(keras_dist's reduce-scatter). Use MirroredStrategy or "
        "MultiWorkerMirroredStrategy with their default cross-device ops."
    )


def _launcher_here(strategy, what: str):
    device = _device_util.canonicalize(_device_util.current())
    for launcher in _collective_all_reduce(strategy)._launchers:
        if launcher._device == device:
            return launcher
    raise RuntimeError(
        f"No collective launcher for device {device}: call {what} in "
        "the replica context of the strategy that owns the replica."
    )


def collective_device_type(strategy) -> str:
    """`"CPU"` or `"GPU"`: where `strategy`'s (first) collectives run."""
    launcher = _collective_all_reduce(strategy)._launchers[0]
    return tf.DeviceSpec.from_string(launcher._device).device_type or "CPU"


def _issue(strategy, what, collective, tensor, ordered):
    tensor = tf.convert_to_tensor(tensor)
    launcher = _launcher_here(strategy, what)
    options = launcher._options
    with tf.device(launcher._device):
        result = collective(
            tensor,
            launcher._group_size,
            launcher._group_key,
            _instance_key(launcher, tensor),
            communication_hint=options.implementation.value,
            timeout=options.timeout_seconds or 0,
            ordering_token=launcher._get_ordering_token() if ordered else None,
        )
    if not ordered:
        manager = getattr(result.graph, "experimental_acd_manager", None)
        if manager is not None:
            manager.run_independently(result.op)
    return result


def all_to_all(strategy, tensor, ordered=True):
    """Replica context: row `i` of `tensor` goes to replica `i`.

    Args:
        strategy: The strategy whose replica context this is.
        tensor: A tensor whose first dimension is the number of replicas.
        ordered: Bool. `False`: not ordered with the step's other
            collectives (see above); only where collectives are matched by
            their keys, not their order (not NCCL). Defaults to `True`.

    Returns:
        The rows every replica sent to this one, in replica order.
    """
    return _issue(
        strategy, "all_to_all", _collective_ops.all_to_all_v2, tensor, ordered
    )


def all_gather(strategy, tensor, ordered=True):
    """Replica context: every replica's `tensor` (static shape) concatenated
    along the first axis, in replica order; `ordered` as `all_to_all`'s."""
    gather = _collective_ops.all_gather_v2
    return _issue(strategy, "all_gather", gather, tensor, ordered)


# --- Checkpoint serialization -------------------------------------------------
#
# `tf.train.Checkpoint` saves an object through its `_serialize_to_tensors`
# and restores it through `_restore_from_tensors` (the `Trackable` protocol,
# tensorflow/python/trackable/base.py); an instance's own attributes take
# precedence (`saveable_object_util.trackable_has_serialize_to_tensor`
# checks the instance `__dict__` first). A Keras 3 variable delegates both
# to its TensorFlow variable (keras/src/backend/tensorflow/core.py).

CHECKPOINT_TENSOR_KEY = "VARIABLE_VALUE"
"""The key a variable's value has in a checkpoint (`trackable.VARIABLE_VALUE_KEY`)."""


def checkpoint_through(variable, serialize, restore) -> None:
    """Makes `tf.train.Checkpoint` save `variable` as `serialize()` returns.

    Args:
        variable: The TensorFlow variable (distributed or not).
        serialize: Callable `() -> tensor`: the value to write.
        restore: Callable `(tensor) -> None`: assigns a written value.
    """

    def serialize_to_tensors():
        return {CHECKPOINT_TENSOR_KEY: serialize()}

    def restore_from_tensors(restored_tensors):
        restore(restored_tensors[CHECKPOINT_TENSOR_KEY])
        return tf.no_op()

    variable._serialize_to_tensors = serialize_to_tensors
    variable._restore_from_tensors = restore_from_tensors


# --- The batch size of a `tf.data` pipeline --------------------------------
#
# An elastic resume (`keras_dist.backup.elastic`) counts the samples of the
# global stream; it must know how many one batch of the new run's dataset
# holds. The element spec says so only with `drop_remainder=True`, and
# reading an element would move a reshuffling dataset's seed generator on
# (the real run would then see another order). The pipeline's Python
# objects name their input (`_input_dataset`) and a batching step its size
# (`_batch_size`), as tensorflow/python/data/ops/batch_op.py keeps them.

_BATCHING_DATASETS = (
    "_BatchDataset",
    "_ParallelBatchDataset",
    "_PaddedBatchDataset",
)
_UNBATCHING_DATASETS = ("_UnbatchDataset", "_RebatchDataset", "_LegacyRebatchDataset")


def shuffles_batches(dataset) -> bool:
    """Whether `dataset` shuffles after its batching step (`.batch(n)
    .shuffle(...)`): then which samples make a batch, and so the order of
    the samples, depends on `n`."""
    node, shuffled = dataset, False
    while node is not None:
        name = type(node).__name__
        if name == "_ShuffleDataset":
            shuffled = True
        if name in _BATCHING_DATASETS:
            return shuffled
        node = getattr(node, "_input_dataset", None)
    return False


def dataset_batch_size(dataset) -> int | None:
    """The size of `dataset`'s outermost batching step, or `None`.

    `None` when there is none, when it is not a constant, or when a step
    after it unbatches or rebatches.
    """
    static = tf.nest.flatten(dataset.element_spec)[0].shape
    if static.rank and static[0] is not None:
        return int(static[0])
    node = dataset
    while node is not None:
        name = type(node).__name__
        if name in _UNBATCHING_DATASETS:
            return None
        if name in _BATCHING_DATASETS:
            size = tf.get_static_value(getattr(node, "_batch_size", None))
            return None if size is None else int(size)
        node = getattr(node, "_input_dataset", None)
    return None


# --- The coordination service's key-value store -------------------------------
#
# `MultiWorkerMirroredStrategy` starts TensorFlow's coordination service
# (hosted by the first task, tensorflow/python/distribute/
# collective_all_reduce_strategy.py) and every worker's context is a client
# of its key-value store. keras_dist's gloo backend (`core/gloo.py`) meets
# its peers through it: the first worker publishes the address of its
# rendezvous store, the others wait for it.


def publish_key(key: str, value: str) -> None:
    """Sets `key` to `value` in the coordination service's store."""
    from tensorflow.python.eager import context

    context.context().set_config_key_value(key, value)


def read_key(key: str, timeout_seconds: float | None = None) -> str:
    """Waits until `key` is set in the coordination service's store; its value.

    Raises:
        tf.errors.DeadlineExceededError: `timeout_seconds` passed first.
    """
    from tensorflow.python.eager import context

    timeout_ms = 0 if timeout_seconds is None else int(timeout_seconds * 1000)
    return context.context().get_config_key_value(key, timeout_ms)


def worker_rank(strategy) -> int:
    """This worker's index among `strategy`'s workers (the chief's is 0).

    The order of the strategy's replicas (`multi_worker_util.id_in_cluster`);
    0 for a strategy of one worker (`MirroredStrategy`, `OneDeviceStrategy`,
    the default strategy), which has no cluster.
    """
    return int(getattr(strategy.extended, "_id_in_cluster", 0))


# --- Collective timeouts ------------------------------------------------------
#
# A collective issued with `timeout_seconds` costs a thread that sleeps out
# the whole timeout (`BaseCollectiveExecutor::ExecuteAsync` in
# tensorflow/core/common_runtime/base_collective_executor.cc schedules its
# check with `SchedNonBlockingClosureAfter`, a new thread on POSIX), so a
# fast loop runs out of threads. keras_dist takes the timeout out of a
# strategy's options (`extended._communication_options`, shared by its
# `CollectiveAllReduce` objects and their launchers) and bounds the wait with
# one watchdog thread (`keras_dist/core/watchdog.py`), which recognises a
# thread waiting in the executor by its Python frame and aborts the
# collectives as TensorFlow's peer health check does
# (`context.abort_collective_ops`, collective_all_reduce_strategy.py).


def take_collective_timeout(strategy) -> float | None:
    """Removes the timeout from `strategy`'s collectives; returns it, or `None`.

    The options object is replaced, not changed: a user's
    `CommunicationOptions` may serve another strategy too. Functions traced
    before keep the timeout they captured.
    """
    from tensorflow.python.distribute import collective_util

    extended = strategy.extended
    options = getattr(extended, "_communication_options", None)
    timeout = getattr(options, "timeout_seconds", None)
    if not timeout:
        return None
    untimed = collective_util.Options(
        bytes_per_pack=options.bytes_per_pack,
        timeout_seconds=None,
        implementation=options.implementation,
    )
    extended._communication_options = untimed
    for _, ops in _collective_all_reduces(extended):
        if ops._options is options:
            ops._options = untimed
        for launcher in ops._launchers:
            if launcher._options is options:
                launcher._options = untimed
    return float(timeout)


def _executor_codes() -> frozenset:
    import inspect

    from tensorflow.python.eager import execute
    from tensorflow.python.ops import gen_collective_ops

    # A function call or an op through the slow path waits in
    # `quick_execute`; an eager collective on the fast path in its generated
    # wrapper.
    codes = {execute.quick_execute.__code__}
    codes.update(
        value.__code__
        for value in vars(gen_collective_ops).values()
        if inspect.isfunction(value)
    )
    return frozenset(codes)


_EXECUTOR_CODES = None


def executing_in_tensorflow(frame) -> bool:
    """Whether `frame` (a thread's innermost) waits in TensorFlow's executor."""
    global _EXECUTOR_CODES
    if _EXECUTOR_CODES is None:
        _EXECUTOR_CODES = _executor_codes()
    return frame.f_code in _EXECUTOR_CODES


def abort_collectives(message: str) -> None:
    """Fails every pending and later collective of this process with
    `DeadlineExceededError: Collective ops is aborted by: {message}`."""
    from tensorflow.python.eager import context

    context.context().abort_collective_ops(tf.errors.DEADLINE_EXCEEDED, message)


# Group keys of `collectives_aborted`'s one-member groups: above every key
# keras_dist gives strategies (core/collectives.py: blocks of 100,000 up to
# 1,999,900,000), within int32. One per task of the cluster, from its job and
# index: a multi-worker group is registered with the first worker (its
# leader), so two tasks must never use the same key.
_PROBE_FIRST_KEY = 2_147_400_001
_PROBE_JOBS = {"worker": 0, "chief": 1}
_PROBE_TASKS_PER_JOB = 20_000
_probe_lock = threading.Lock()


def _probe_key(device: str) -> int:
    import re

    found = re.search(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)", device)
    job, task = (found.group(1), int(found.group(2))) if found else ("", 0)
    slot = _PROBE_JOBS.get(job, len(_PROBE_JOBS))
    return _PROBE_FIRST_KEY + slot * _PROBE_TASKS_PER_JOB + task % _PROBE_TASKS_PER_JOB


def collectives_aborted(device: str) -> str | None:
    """Why this process's collectives were aborted, or `None` if they were not.

    TensorFlow aborts them when its coordination service misses a peer's
    heartbeats, and `abort_collectives` does (the watchdog); a wait outside
    TensorFlow's collectives (the gloo backend's) learns of it here. The
    probe is an all-reduce of one member on `device` (this task's CPU): it
    completes at once (1-2 ms here) unless the collectives are aborted, and
    then it fails at once with the reason. The first call registers its
    group with the cluster's first worker (call it while every worker is
    up); later ones stay in the process. One group and instance key per
    task, reused: nothing accumulates.
    """
    key = _probe_key(device)
    with _probe_lock:
        try:
            # Eagerly, also when the first call comes while a step is traced.
            with tf.init_scope(), tf.device(device):
                _collective_ops.all_reduce_v2(
                    tf.zeros([1]), group_size=1, group_key=key, instance_key=key
                )
        except tf.errors.OpError as error:
            return error.message
    return None


# --- Control flow graphs -------------------------------------------------------
#
# A `tf.cond` branch and a `tf.while_loop` body are function graphs of their
# own (`control_flow_v2_func_graphs.ControlFlowFuncGraph`). TensorFlow's
# automatic control dependencies chain the stateful ops of a function in
# program order only while they have no resource inputs: an `If` or `While`
# op that captures a variable is ordered by its resources alone, so ops in
# its branches can run before or after the stateful ops around it. The gloo
# backend needs one order on every worker, and keeps such sums on
# TensorFlow's collectives (ordered by their own tokens).


@contextlib.contextmanager
def outside_strategy(device=None):
    """Plain variables on `device`, inside a strategy's scope or step.

    What is created inside sees the default strategy: a variable is an
    ordinary `tf.Variable` (not mirrored, not per replica) and an optimizer
    records the default strategy as its own. Sharding by whole variables
    (`ShardedOptimizer(..., shard_by="variables")`) keeps each replica's
    optimizer state this way, on that replica's device only: a strategy's
    variables have the same shape on every replica. Runs outside any traced
    function (`tf.init_scope`), with the graph's variable creators and
    strategy stack (private, `ops.Graph`) emptied and restored.
    """
    with tf.init_scope():
        graph = tf.compat.v1.get_default_graph()
        creators = graph._variable_creator_stack
        strategies = graph._distribution_strategy_stack
        graph._variable_creator_stack = []
        graph._distribution_strategy_stack = []
        try:
            with tf.device(device) if device else contextlib.nullcontext():
                yield
        finally:
            graph._variable_creator_stack = creators
            graph._distribution_strategy_stack = strategies


def in_control_flow() -> bool:
    """Whether ops are being added inside a `tf.cond` or `tf.while_loop`,
    directly or in a function called from one."""
    from tensorflow.python.ops import control_flow_v2_func_graphs

    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if isinstance(graph, control_flow_v2_func_graphs.ControlFlowFuncGraph):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def remote_value_devices(remote_value) -> set[str]:
    """The devices that hold a completed closure's outputs (`RemoteValue`).

    `ClusterCoordinator` leaves a closure's outputs on the worker that ran
    it (`RemoteValueImpl._values`) until they are fetched; they are lost with
    that worker.
    """
    values = getattr(remote_value, "_values", None)
    if values is None:
        return set()
    return {
        value.device
        for value in tf.nest.flatten(values, expand_composites=True)
        if isinstance(getattr(value, "device", None), str) and value.device
    }
