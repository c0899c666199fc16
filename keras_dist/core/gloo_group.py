"""A worker's member of a gloo process group: the sums, all-to-alls and
all-gathers of one strategy's workers through PyTorch's c10d (`GlooGroup`).

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

Both the reduce-scatter and the all-gather are gloo all-to-alls: gloo's own
`reduce_scatter` and `allgather` took 2-3x as long as its all-to-all
between 2 processes here (100 MB: 183-236 and 163-187 ms against 38-55
ms), so the reduce-scatter receives every peer's rows and sums them in
TensorFlow (in the order TensorFlow's path sums them: the same bits), and
the all-gather sends its slice to every peer.

Half-precision sums (float16 and bfloat16: the FP16 and BF16 hooks'
buckets) are not gloo all-reduces either: gloo adds halves one element at
a time, so 21M float16 took longer to all-reduce between 2 processes here
than 21M float32, twice the bytes (72-82 against 56-64 ms). They are an
all-to-all (each worker receives its piece of everyone's bucket), a sum of
the pieces by PyTorch's vectorized kernels, and an all-to-all of the
summed pieces back: the bytes of gloo's ring, in 55-64 ms for 21M and
2.7-3.4 against 4.2-6.8 ms for one 1M-element bucket (`_HalfSums`).

Guarantees: the sums are those of TensorFlow's collective up to float
rounding (the same for 2 workers; gloo's ring adds in another order beyond,
and a half-precision piece is added in worker order). A peer that dies
closes its sockets, and the others' step fails at once with an error naming
the worker; a peer that hangs fails the step after the strategy's
collective timeout (`keras_dist.auto_strategy(collective_timeout=...)` or
`KERAS_DIST_COLLECTIVE_TIMEOUT`), or 30 minutes without one, gloo's default.
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
import threading
import weakref
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_dist._compat import tf_internal
from keras_dist._versions import TESTED_TORCH as TORCH_VERSION
from keras_dist.cluster import COLLECTIVES_ENV_VAR as ENV_VAR
from keras_dist.core import watchdog

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
KEY_PREFIX = "keras_dist/gloo/"
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
# Summed as an all-to-all, PyTorch's adds and an all-to-all (`_HalfSums`).
_HALF_DTYPES = frozenset(["float16", "bfloat16"])
# PyTorch adds this many elements on the calling thread (its GRAIN_SIZE);
# a longer add wakes its OpenMP threads, which then spin for the CPU the
# step and gloo need (a 1M-element sum took 8-12 ms that way, 2.7 without).
_ADD_CHUNK = 32768


def import_torch():
    """PyTorch and `torch.distributed`, or an `ImportError` with the install
    line (`NoGloo`: a PyTorch without gloo)."""
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
        raise NoGloo(
            f"{ENV_VAR}=gloo: this PyTorch build ({torch.__version__}) has no "
            "gloo backend. Install PyTorch's CPU wheel, or unset "
            f"{ENV_VAR} for TensorFlow's collectives."
        )
    return torch, dist


class NoGloo(ImportError):
    """PyTorch imports, but this build has no gloo (`import_torch`)."""


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
        torch, dist = import_torch()
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
        # The half-precision sums' second all-to-alls, issued in ticket
        # order by one thread while the first group goes on (`_HalfSums`).
        self._second = dist.ProcessGroupGloo(
            dist.PrefixStore("second/", store), rank, size, options
        )
        self._halves = _HalfSums(self)
        self._last: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Started collectives by ticket: (what `_finish` hands back, the gloo
        # work or `_HalfSum`, the sent buffer kept alive). A step that
        # fails between a start and its finish leaves its entries; the
        # failure (a lost peer) ends the group's use anyway.
        self._in_flight: dict = {}
        self._buffers = _Buffers()
        self._next_ticket = 0
        self._tickets_lock = threading.Lock()

    @classmethod
    def connect(cls, strategy) -> GlooGroup:
        """Meets `strategy`'s other workers and returns this worker's member."""
        _, dist = import_torch()
        rank = tf_internal.worker_rank(strategy)
        size = strategy.num_replicas_in_sync
        timeout = watchdog.timeout_of(strategy) or DEFAULT_TIMEOUT_SECONDS
        wait = datetime.timedelta(seconds=timeout)
        # One key per strategy: a process may connect several in turn.
        key = f"{KEY_PREFIX}{tf_internal.collective_group_base(strategy)}"
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
        # kept alive with the work until it is done), as a half-precision
        # sum does (padded to a multiple of the workers, `_HalfSums`).
        size = sum(a.size for a in arrays)
        dtype = arrays[0].dtype
        half = (
            op == "all_reduce"
            and dtype.name in _HALF_DTYPES
            and self.size > 1
            and size > 0
        )
        if op == "all_gather":
            # Every peer gets this worker's tensor: an all-to-all of it
            # repeated (gloo's allgather is the slower path, see above).
            sent = self._buffers.take(size * self.size, dtype)
            sent.reshape(self.size, size)[:] = arrays[0].reshape(1, -1)
        else:
            padded = -(-size // self.size) * self.size if half else size
            sent = self._buffers.take(padded, dtype)
            np.concatenate([a.reshape(-1) for a in arrays], out=sent[:size])
            sent[size:] = 0
        received = sent
        if op != "all_reduce" or half:
            received = self._buffers.take(sent.size, dtype)
        work = None
        if sent.size:
            try:
                if op == "all_reduce" and not half:
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
            if half:
                # Queued in ticket order: the second all-to-alls too.
                work = self._halves.submit(work, sent, received)
                received = received[:size]
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
        if isinstance(work, _HalfSum):
            work = work.second_work()
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
        self._second.abort()
        for held in (self, self._group, self._second, self._store, work):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(held))

    def _failed(self, error) -> RuntimeError:
        return RuntimeError(
            f"{FAILURE} on worker {self.rank} of {self.size}: a peer stopped, "
            f"or did not answer within {self.timeout:g} s. {error}"
        )


class _HalfSum:
    """One half-precision sum in `_HalfSums`' queue: its first all-to-all,
    then the second one (or the error that stopped it)."""

    def __init__(self, first, sent, received):
        self.first = first
        self.sent = sent
        self.received = received
        self.second = None
        self.error: BaseException | None = None
        self.issued = threading.Event()

    def second_work(self):
        """The second all-to-all, once issued (raises what stopped it)."""
        self.issued.wait()
        if self.error is not None:
            raise self.error
        return self.second


class _HalfSums:
    """A group's half-precision all-reduces: all-to-all, add, all-to-all.

    The first all-to-all is issued with the other collectives, in step
    order; a thread of this queue waits for it, adds the pieces this worker
    owns (every worker's `i`-th piece, in worker order, on the calling
    thread: `_ADD_CHUNK`), and issues the second all-to-all, which hands
    each worker's summed piece to all, on the group's second process group.
    One thread at a time, in the order the sums were started, so every
    worker issues the second all-to-alls in one order (gloo matches them by
    order); it ends when the queue is empty. `issued` counts the sums whose
    second all-to-all it issued.
    """

    def __init__(self, group: GlooGroup):
        self._group = group
        self.issued = 0
        self._queue: list = []
        self._lock = threading.Lock()
        self._running = False

    def submit(self, first, sent, received) -> _HalfSum:
        """Queues the sum whose first all-to-all `first` fills `received`."""
        item = _HalfSum(first, sent, received)
        with self._lock:
            self._queue.append(item)
            if not self._running:
                self._running = True
                threading.Thread(
                    target=self._drain, name="keras_dist-gloo-halves", daemon=True
                ).start()
        return item

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                item = self._queue.pop(0)
            try:
                item.second = self._complete(item)
                self.issued += 1
            except BaseException as error:  # re-raised by the step's wait
                item.error = error
            item.issued.set()

    def _complete(self, item: _HalfSum):
        group = self._group
        group._wait(item.first)
        size, rank = group.size, group.rank
        rows = group._tensor(item.received).view(size, -1)
        sent = group._tensor(item.sent).view(size, -1)
        mine = sent[rank]
        torch = group._torch
        for start in range(0, mine.numel(), _ADD_CHUNK):
            end = start + _ADD_CHUNK
            torch.add(rows[0, start:end], rows[1, start:end], out=mine[start:end])
            for row in rows[2:]:
                mine[start:end].add_(row[start:end])
        pieces = item.sent.reshape(size, -1)
        for peer in range(size):
            if peer != rank:
                pieces[peer] = pieces[rank]
        try:
            return group._second.alltoall_base(rows.view(-1), sent.view(-1), [], [])
        except RuntimeError as error:
            raise group._failed(error) from error


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
