"""The fast CPU collective backend: gloo, through PyTorch's c10d.

TensorFlow's CPU all-reduce between worker processes is a ring over gRPC:
each piece of a tensor is a gRPC message, serialized, sent and parsed before
its reduction starts. Between 2 processes on one machine, 100 MB of float32
take 0.21-0.24 s that way (subdivided, `collectives.RING_SUBDIVS`) and 0.07-
0.09 s with gloo over plain TCP, the backend PyTorch's DDP uses on CPUs
(docs/benchmarks/ddp.md). Where PyTorch with gloo imports (`choose`:
`KERAS_DIST_COLLECTIVES` unset or `auto`; or `gloo`, which fails without
it), the sums of `collectives.all_reduce_sum` and
`all_reduce_flat` (every hook's dense buckets, and the step's metric sums),
and the all-to-all of `collectives.reduce_scatter` and the static-shaped
`collectives.all_gather` (the sharded optimizer's gradients and updated
slices) of a `MultiWorkerMirroredStrategy` with one device per worker
travel through a gloo process group instead, unless they are traced inside
a `tf.cond` or `tf.while_loop` (`GlooGroup.carries`); everything else (the
batch-size and norm reductions, sparse gradients, gathers of sizes known
only when the step runs) stays on TensorFlow's collectives.

Both the reduce-scatter and the all-gather are gloo all-to-alls: gloo's own
`reduce_scatter` and `allgather` took 2-3x as long as its all-to-all
between 2 processes here (100 MB: 183-236 and 163-187 ms against 38-55
ms), so the reduce-scatter receives every peer's rows and sums them in
TensorFlow (in the order TensorFlow's path sums them: the same bits), and
the all-gather sends its slice to every peer.

How: a bucket's tensors are handed to a `tf.numpy_function` that copies
them into one buffer of its own (TensorFlow shares the inputs' memory with
their other consumers) and starts a gloo all-reduce of it; a second one
waits for it and hands the buffer back to TensorFlow without a copy (it is
aligned as TensorFlow needs for that). A step starts all its buckets
before it waits for any, so their all-reduces overlap each other and the
backward pass, as DDP's do.
Every worker starts the same buckets in the same order (gloo matches
collectives by order): the starts are stateful and chained by control
dependencies, so they run in program order. The process group is made the
first time a strategy's gradients are summed: the first worker opens a
`TCPStore` on a free port of its host and publishes its address in
TensorFlow's coordination service, the others read it there.

Guarantees: the sums are those of TensorFlow's collective up to float
rounding (the same for 2 workers; gloo's ring adds in another order beyond).
A peer that dies closes its sockets, and the others' step fails at once with
an error naming the worker; a peer that hangs fails the step after the
strategy's collective timeout (`keras_dist.auto_strategy(collective_timeout=
...)` or `KERAS_DIST_COLLECTIVE_TIMEOUT`), or 30 minutes without one, gloo's
default. PyTorch is needed only in the workers that use the backend
(the tested version, CPU wheel: `pip install torch==2.13.0 --index-url
https://download.pytorch.org/whl/cpu`, or the extra `gloo`); without it,
`auto` keeps TensorFlow's collectives, and every worker must choose alike
(`_check_every_worker_agrees`).
"""

from __future__ import annotations

import datetime
import functools
import itertools
import os
import sys
import threading
import weakref
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_dist._compat import tf_internal
from keras_dist._versions import TESTED_TORCH as TORCH_VERSION
from keras_dist.cluster import COLLECTIVES_ENV_VAR, check_collectives
from keras_dist.core import watchdog
from keras_dist.core.topology import local_replicas

ENV_VAR = COLLECTIVES_ENV_VAR
# PyTorch's CPU wheel of the version the backend is tested with.
INSTALL = (
    f"pip install torch=={TORCH_VERSION} "
    "--index-url https://download.pytorch.org/whl/cpu"
)

# gloo sums these; a bucket of another dtype stays on TensorFlow's collective.
_GLOO_DTYPES = frozenset(
    [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64]
)
# Without a strategy timeout: gloo's (and `torch.distributed`'s) default.
DEFAULT_TIMEOUT_SECONDS = 1800.0
_KEY_PREFIX = "keras_dist/gloo/"
# Starts the error a failed gloo collective raises in its step (TensorFlow
# reports it as an `UnknownError` of the `tf.numpy_function`).
FAILURE = "keras_dist's gloo collective failed"
# TensorFlow takes an array returned by a `tf.numpy_function` without a copy
# only when its memory is aligned to EIGEN_MAX_ALIGN_BYTES (64 with AVX-512;
# `NdarrayToTensor`): for 100 MB, 0.2 ms against 17 ms here.
_ALIGNMENT = 64
# A wait for gloo asks every this often whether TensorFlow aborted the
# process's collectives (`GlooGroup._wait`); `Work.wait` raises this when a
# slice passes and can be called again.
_WAIT_SLICE = datetime.timedelta(seconds=1)
_SLICE_PASSED = "Operation timed out!"
# Sum buffers kept for reuse per size and dtype (`_Buffers`).
_POOLED_PER_SIZE = 4

_lock = threading.Lock()
_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Groups of strategies switched back to TensorFlow (`use(..., False)`), kept
# for a switch back: a process group is met once per strategy.
_disabled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def requested_backend() -> str:
    """The backend `KERAS_DIST_COLLECTIVES` names (`"auto"` if unset).

    Raises:
        ValueError: the variable names no backend.
    """
    return check_collectives(os.environ.get(ENV_VAR), ENV_VAR) or "auto"


class Choice(NamedTuple):
    """What carries a strategy's sums, and why (`choose`)."""

    backend: str  # "gloo" or "tensorflow"
    reason: str


def choose(strategy) -> Choice:
    """Resolves `KERAS_DIST_COLLECTIVES` for one multi-worker strategy.

    `auto` (the variable unset) picks gloo when PyTorch with gloo imports
    here and the strategy has one CPU device per worker, TensorFlow's
    collectives otherwise (GPUs: NCCL; several devices per worker: the
    local all-reduce gloo cannot do; no PyTorch). Imports PyTorch only for
    a strategy gloo could serve.

    Raises:
        ValueError: the variable names no backend.
    """
    backend = requested_backend()
    if backend != "auto":
        return Choice(backend, f"{ENV_VAR}={backend}")
    devices = list(strategy.extended.worker_devices)
    if any("GPU" in device.upper() for device in devices):
        return Choice("tensorflow", "auto: GPU workers (NCCL)")
    if len(devices) != 1:
        return Choice(
            "tensorflow", f"auto: {len(devices)} devices per worker, gloo serves 1"
        )
    missing = gloo_missing()
    if missing:
        return Choice("tensorflow", f"auto: {missing}")
    return Choice("gloo", "auto: PyTorch with gloo is installed")


@functools.cache
def gloo_missing() -> str | None:
    """Why gloo cannot run in this process, or `None` when it can.

    Imports PyTorch (about 2 s and 180 MiB here, once per process).
    """
    try:
        _import_torch()
    except _NoGloo:
        return "this PyTorch build has no gloo"
    except ImportError:
        return "PyTorch is not installed"
    except Exception as error:
        # A PyTorch that is there but does not load (a missing shared
        # library: OSError) must not stop a job that never asked for it.
        return f"PyTorch does not import here ({type(error).__name__}: {error})"
    return None


def enable_if_requested(strategy) -> Choice:
    """Sends `strategy`'s sums through gloo when `choose` picks it.

    Called by `collectives.own` for every multi-worker strategy, before
    anything is traced, so a strategy gloo cannot serve fails at once.
    The process group itself is made at the first gradient sum.

    Returns:
        The `Choice`: whether `strategy`'s gradient sums go through gloo,
        and why.

    Raises:
        ValueError: `KERAS_DIST_COLLECTIVES` is not a backend, or names
            gloo for a strategy with several devices per worker, or the
            workers chose differently.
        ImportError: gloo is asked for and PyTorch is not installed.
    """
    choice = choose(strategy)
    _check_every_worker_agrees(strategy, choice)
    if choice.backend != "gloo":
        return choice
    local = local_replicas(strategy)
    if local != 1:
        raise ValueError(
            f"{ENV_VAR}=gloo serves one device per worker (CPU workers); "
            f"this worker's strategy has {local} "
            f"({list(strategy.extended.worker_devices)}). Unset {ENV_VAR} "
            "for TensorFlow's collectives (NCCL on GPUs)."
        )
    use(strategy)
    return choice


_AGREEMENTS = itertools.count()
# Seconds a worker waits for the others' backend choice at start-up (they
# make it as they build the same strategy, right after the cluster met).
AGREE_TIMEOUT_SECONDS = 120.0


def _check_every_worker_agrees(strategy, choice: Choice) -> None:
    """Refuses a cluster whose workers chose different backends.

    A worker that sums through gloo while its peer sums through TensorFlow
    would wait for a peer that never comes, and fail only after the
    collective timeout with gloo's raw `DistStoreError`. Each worker
    publishes its choice and the reason in TensorFlow's coordination
    service and reads the others'.

    Raises:
        ValueError: another worker chose another backend; names both and
            why each chose as it did.
    """
    workers = strategy.num_replicas_in_sync // local_replicas(strategy)
    if workers == 1:
        return  # nobody to disagree with (and no coordination service)
    rank = tf_internal.worker_rank(strategy)
    # One key per multi-worker strategy of this process (every worker
    # builds its strategies in the same order; keys are set only once).
    key = f"{_KEY_PREFIX}backend/{next(_AGREEMENTS)}/"
    tf_internal.publish_key(f"{key}{rank}", f"{choice.backend}|{choice.reason}")
    for peer in range(workers):
        if peer == rank:
            continue
        try:
            published = tf_internal.read_key(
                f"{key}{peer}", timeout_seconds=AGREE_TIMEOUT_SECONDS
            )
        except tf.errors.OpError:
            # It did not say (an older keras_dist, or slow): the first
            # collective will tell.
            continue
        theirs, _, their_reason = published.partition("|")
        if theirs != choice.backend:
            raise ValueError(
                f"The workers disagree on what carries their sums: worker "
                f"{rank} (this one) sums through {choice.backend!r} "
                f"({choice.reason}), worker {peer} through {theirs!r} "
                f"({their_reason or 'no reason given'}). Received: "
                f"{ENV_VAR}={os.environ.get(ENV_VAR, '')!r} here. Install the "
                "same packages in every task, or set the same "
                f"{ENV_VAR} (tensorflow or gloo) for all of them "
                "(`keras-dist launch --collectives` passes it to every task)."
            )


def use(strategy, enabled: bool = True) -> None:
    """Sends `strategy`'s gradient sums through gloo, or back to TensorFlow.

    For what is traced afterwards: a function traced before keeps its
    collectives. `KERAS_DIST_COLLECTIVES=gloo` calls it for every
    multi-worker strategy; this is the switch for one strategy (a benchmark
    times both in the same processes). Every worker must make the same
    choice before tracing the same step.

    Raises:
        ImportError: `enabled` and PyTorch (with gloo) is not installed.
    """
    with _lock:
        if not enabled:
            if strategy.extended in _groups:
                _disabled[strategy.extended] = _groups.pop(strategy.extended)
            return
        _import_torch()
        if strategy.extended not in _groups:
            _groups[strategy.extended] = _disabled.pop(strategy.extended, None)


def group_for(strategy) -> GlooGroup | None:
    """The gloo group summing `strategy`'s gradients, or `None` (TensorFlow).

    Makes the group (a rendezvous with every worker) the first time.
    """
    extended = strategy.extended
    if extended not in _groups:
        return None
    with _lock:
        group = _groups[extended]
        if group is None:
            group = GlooGroup.connect(strategy)
            _groups[extended] = group
    return group


def torch_version() -> str:
    """The installed PyTorch's version (`"not installed"` without one)."""
    from keras_dist._versions import installed_version

    return installed_version("torch") or "not installed"


def _import_torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError as error:
        raise ImportError(
            f"{ENV_VAR}=gloo needs PyTorch (its gloo process group) in every "
            f"worker: `{INSTALL}` (the CPU wheel, the version keras_dist is "
            f"tested with), or unset {ENV_VAR} for TensorFlow's collectives."
        ) from error
    if not dist.is_available() or not dist.is_gloo_available():
        raise _NoGloo(
            f"{ENV_VAR}=gloo: this PyTorch build ({torch.__version__}) has no "
            "gloo backend. Install PyTorch's CPU wheel, or unset "
            f"{ENV_VAR} for TensorFlow's collectives."
        )
    return torch, dist


class _NoGloo(ImportError):
    """PyTorch imports, but this build has no gloo (`_import_torch`)."""


class GlooGroup:
    """One worker's member of a gloo process group of a strategy's workers.

    Made by `connect`. `calls` and `bytes` count the collectives it ran and
    the bytes it was given; `ops` counts them by kind (`"all_reduce"`,
    `"all_to_all"`, `"all_gather"`).

    Args:
        rank: Int, this worker's index (the strategy's replica order).
        size: Int, the number of workers.
        store: The `torch.distributed` store the group met through.
        timeout: Float, seconds a collective waits for its peers.
        host: String, this worker's host name (its sockets bind there).
        device: String, this worker's CPU device: where `_wait` probes
            whether TensorFlow aborted the process's collectives.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        store,
        timeout: float,
        host: str,
        device: str,
    ):
        torch, dist = _import_torch()
        self._device = device
        self._torch = torch
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.calls = 0
        self.bytes = 0
        self.ops: dict = {}
        self._store = store
        # gloo's sockets bind where TensorFlow's server of this task listens,
        # or to the interface `GLOO_SOCKET_IFNAME` names, as in PyTorch.
        interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=timeout)
        options._devices = [
            dist.ProcessGroupGloo.create_device(interface=interface)
            if interface
            else dist.ProcessGroupGloo.create_device(hostname=host)
        ]
        self._group = dist.ProcessGroupGloo(store, rank, size, options)
        self._last: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Started all-reduces by ticket: (buffer, gloo work). A step that
        # fails between a start and its finish leaves its entries; the
        # failure (a lost peer) ends the group's use anyway.
        self._in_flight: dict = {}
        self._buffers = _Buffers()
        self._next_ticket = 0
        self._tickets_lock = threading.Lock()

    @classmethod
    def connect(cls, strategy) -> GlooGroup:
        """Meets `strategy`'s other workers and returns this worker's member."""
        _, dist = _import_torch()
        rank = tf_internal.worker_rank(strategy)
        size = strategy.num_replicas_in_sync
        timeout = watchdog.timeout_of(strategy) or DEFAULT_TIMEOUT_SECONDS
        wait = datetime.timedelta(seconds=timeout)
        # One key per strategy: a process may connect several in turn.
        key = f"{_KEY_PREFIX}{tf_internal.collective_group_base(strategy)}"
        host = _own_host(strategy)
        if rank == 0:
            store = dist.TCPStore(
                host, 0, size, True, timeout=wait, wait_for_workers=False
            )
            tf_internal.publish_key(key, f"{host}:{store.port}")
        else:
            first, port = tf_internal.read_key(key).rsplit(":", 1)
            store = dist.TCPStore(first, int(port), size, False, timeout=wait)
        device = strategy.extended.worker_devices[0]
        # The abort probe's group meets the first worker now, while every
        # worker is up: later probes stay in this process (`_wait`).
        aborted = tf_internal.collectives_aborted(device)
        if aborted is not None:
            raise _aborted(rank, size, aborted)
        return cls(rank, size, store, timeout, host, device)

    def carries(self, tensors) -> bool:
        """Whether gloo sums `tensors` (one bucket), else TensorFlow does.

        gloo takes the dtypes PyTorch has, shapes known when tracing, and
        sums outside `tf.cond` and `tf.while_loop`: TensorFlow does not
        order a cond that captures variables (PowerSGD's switch to
        compression, FP16's resend, gradient accumulation's update) with
        the ops around it, so its sums could reach gloo in another order on
        another worker (`tf_internal.in_control_flow`). Those stay on
        TensorFlow's collectives.
        """
        return (
            tf.as_dtype(tensors[0].dtype) in _GLOO_DTYPES
            and all(t.shape.is_fully_defined() for t in tensors)
            and not tf_internal.in_control_flow()
        )

    def sum(self, tensors):
        """Sums `tensors` (one dtype, static shapes) over the workers.

        `finish(start(tensors))`: one gloo all-reduce of their concatenation.
        Replica context of the strategy this group belongs to.
        """
        return self.finish(self.start(tensors))

    def start(self, tensors) -> _Pending:
        """Starts the sum of one bucket; `finish` waits for it.

        The buckets' all-reduces are issued in the order of the `start`
        calls (chained by control dependencies: every worker issues them in
        that order, as gloo matches them) and run while the step goes on, as
        DDP's do.
        """
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        return self._issue("all_reduce", tensors, [t.shape for t in tensors])

    def start_all_to_all(self, flat) -> _Pending:
        """Starts an all-to-all of a vector of `size * k` elements.

        Worker `i` receives the `i`-th of the `size` equal pieces of every
        worker's `flat`, in worker order: `finish` returns one vector of
        `flat`'s length, whose `j`-th piece came from worker `j` (what
        TensorFlow's all-to-all returns). Ordered with the other starts.
        """
        flat = tf.convert_to_tensor(flat)
        return self._issue("all_to_all", [flat], [flat.shape])

    def start_all_gather(self, tensor) -> _Pending:
        """Starts an all-gather of `tensor` along its first axis.

        `finish` returns every worker's `tensor` concatenated in worker
        order (shape `[size * d0, ...]`). Ordered with the other starts.
        """
        tensor = tf.convert_to_tensor(tensor)
        shape = tf.TensorShape([self.size * tensor.shape[0], *tensor.shape[1:]])
        return self._issue("all_gather", [tensor], [shape])

    def _issue(self, op, tensors, out_shapes) -> _Pending:
        graph = tf.compat.v1.get_default_graph()
        previous = self._last.get(graph)
        with tf.control_dependencies([] if previous is None else [previous]):
            ticket = tf.numpy_function(
                functools.partial(self._start, op),
                tensors,
                tf.int64,
                stateful=True,
                name=f"gloo_{op}_start",
            )
        self._last[graph] = ticket
        size = sum(shape.num_elements() for shape in out_shapes)
        return _Pending(ticket, out_shapes, tensors[0].dtype, tf.TensorShape([size]))

    def finish(self, pending: _Pending) -> list:
        """Waits for a bucket's sum; its tensors, in the order given to `start`.

        The wait is stateless: it depends on its `start` only, not on the
        stateful ops created between (TensorFlow orders those in program
        order). So the next bucket's `start` does not wait for this sum, even
        when a hook sums its buckets one call at a time, as `NoCompression`
        does. A wait holds one of TensorFlow's inter-op threads until gloo's
        own threads finish the sum.
        """
        summed = tf.numpy_function(
            self._finish,
            [pending.ticket],
            pending.dtype,
            stateful=False,
            name="gloo_finish",
        )
        summed.set_shape(pending.flat_shape)
        sizes = [int(np.prod(shape)) for shape in pending.shapes]
        return [
            tf.reshape(part, shape)
            for shape, part in zip(pending.shapes, tf.split(summed, sizes), strict=True)
        ]

    def _start(self, op, *arrays):
        # TensorFlow hands over memory other ops may still read: the sum is
        # made in a buffer of its own, which `_finish` hands back. An all-
        # to-all and an all-gather write into a second one (their input is
        # kept alive with the work until it is done).
        size = sum(a.size for a in arrays)
        dtype = arrays[0].dtype
        if op == "all_gather":
            # Every peer gets this worker's tensor: an all-to-all of it
            # repeated (gloo's allgather is the slower path, see above).
            sent = self._buffers.take(size * self.size, dtype)
            sent.reshape(self.size, size)[:] = arrays[0].reshape(1, -1)
        else:
            sent = self._buffers.take(size, dtype)
            np.concatenate([a.reshape(-1) for a in arrays], out=sent)
        received = sent
        if op != "all_reduce":
            received = self._buffers.take(sent.size, dtype)
        work = None
        if sent.size:
            try:
                if op == "all_reduce":
                    work = self._group.allreduce([self._tensor(sent)])
                else:
                    work = self._group.alltoall_base(
                        self._tensor(received), self._tensor(sent), [], []
                    )
            except RuntimeError as error:
                raise self._failed(error) from error
        with self._tickets_lock:
            self.calls += 1
            self.bytes += size * dtype.itemsize
            self.ops[op] = self.ops.get(op, 0) + 1
            ticket = self._next_ticket
            self._next_ticket += 1
            self._in_flight[ticket] = (received, work, sent)
        return np.int64(ticket)

    def _tensor(self, buffer):
        """A torch tensor sharing `buffer`'s memory (bfloat16 included)."""
        torch = self._torch
        if buffer.dtype.name == "bfloat16":
            return torch.from_numpy(buffer.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(buffer)

    def _finish(self, ticket):
        with self._tickets_lock:
            received, work, _ = self._in_flight.pop(int(ticket))
        if work is not None:
            self._wait(work)
        return received

    def _wait(self, work) -> None:
        """Waits for `work`; fails as soon as TensorFlow's collectives of
        this process are aborted, not only after gloo's timeout.

        TensorFlow aborts them when its coordination service misses a
        peer's heartbeats (a stopped or frozen peer, about 10 s) and when
        the watchdog's collective timeout passes: a gloo wait would sit out
        gloo's own timeout instead (`collective_timeout`, 300 s under
        `keras-dist launch`). So a wait longer than `_WAIT_SLICE` asks
        between slices (`tf_internal.collectives_aborted`).
        """
        while True:
            try:
                work.wait(_WAIT_SLICE)
                return
            except RuntimeError as error:
                if str(error) != _SLICE_PASSED:
                    raise self._failed(error) from error
            aborted = tf_internal.collectives_aborted(self._device)
            if aborted is not None:
                self._abandon(work)
                raise _aborted(self.rank, self.size, aborted)

    def _abandon(self, work) -> None:
        """Gives up this group for good, without waiting for its peers.

        A gloo process group with an operation pending on a peer that no
        longer answers (stopped, frozen) cannot be destroyed before gloo's
        timeout: its destructor joins gloo's threads, which wait in a
        receive. Garbage collection or the interpreter's exit would then
        hang the worker for up to `collective_timeout` after its step
        failed. So the group, its store and the pending work are kept alive
        past the exit (the process ends with the threads still waiting).
        """
        import ctypes

        self._group.abort()
        for held in (self, self._group, self._store, work):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(held))

    def _failed(self, error) -> RuntimeError:
        return RuntimeError(
            f"{FAILURE} on worker {self.rank} of {self.size}: a peer stopped, "
            f"or did not answer within {self.timeout:g} s. {error}"
        )


def _aborted(rank: int, size: int, reason: str) -> RuntimeError:
    """The error of a gloo collective given up because TensorFlow aborted
    this process's collectives (`tf_internal.collectives_aborted`)."""
    return RuntimeError(
        f"{FAILURE} on worker {rank} of {size}: this process's collectives "
        f"were aborted: {reason}"
    )


class _Pending(NamedTuple):
    """A started bucket sum: its ticket tensor and what `finish` rebuilds."""

    ticket: tf.Tensor
    shapes: list
    dtype: tf.DType
    flat_shape: tf.TensorShape


class _Buffers:
    """Aligned sum buffers, each reused once nothing but this pool holds it.

    A fresh large array pays for its pages at the first write: copying 100
    MB into a new one took 35-85 ms here, into one written before 18 ms.
    TensorFlow keeps a returned buffer as its tensor's memory and lets go of
    it when the tensor is freed; a buffer no one else refers to is taken
    again. At most `_POOLED_PER_SIZE` are kept per size and dtype (a step's
    buckets of one size, and the previous step's still held), beyond that
    fresh ones: in between steps, the pool holds about one to four times
    the bytes of the gradients it sums, as DDP holds its buckets.
    """

    def __init__(self):
        self._pools: dict = {}
        self._lock = threading.Lock()

    def take(self, size: int, dtype) -> np.ndarray:
        """A vector of `size` elements of `dtype` that no one else holds."""
        with self._lock:
            pool = self._pools.setdefault((int(size), np.dtype(dtype)), [])
            for buffer in pool:
                if sys.getrefcount(buffer) <= _IDLE_REFCOUNT:
                    return buffer
            buffer = _aligned_empty(size, dtype)
            if len(pool) < _POOLED_PER_SIZE:
                pool.append(buffer)
            return buffer


def _idle_refcount() -> int:
    # The references `_Buffers.take` sees to a buffer only its pool holds:
    # the list, the loop variable and `getrefcount`'s argument.
    pool = [np.empty(1)]
    for buffer in pool:
        return sys.getrefcount(buffer)
    raise AssertionError("unreachable")


_IDLE_REFCOUNT = _idle_refcount()


def _aligned_empty(size: int, dtype) -> np.ndarray:
    """An uninitialized vector whose memory TensorFlow can take as it is."""
    dtype = np.dtype(dtype)
    raw = np.empty(size * dtype.itemsize + _ALIGNMENT, np.uint8)
    offset = -raw.ctypes.data % _ALIGNMENT
    return raw[offset : offset + size * dtype.itemsize].view(dtype)


def is_failure(error) -> bool:
    """Whether `error` (a `tf.errors.OpError`) is a failed gloo collective."""
    return isinstance(error, tf.errors.UnknownError) and FAILURE in str(error.message)


def _own_host(strategy) -> str:
    """The host name of this worker, as the cluster spec has it."""
    resolver = strategy.cluster_resolver
    address = resolver.cluster_spec().task_address(resolver.task_type, resolver.task_id)
    host = address.rsplit(":", 1)[0]
    return host.strip("[]")
