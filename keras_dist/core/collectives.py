"""The collective layer: every all-reduce and all-gather of keras_dist.

Hooks, the aggregation path, accumulation, gradient statistics and backups
issue their collectives through these functions, never through a replica
context directly. That gives the collectives one owner, which matters
because TensorFlow does not keep strategies apart: every `MirroredStrategy`
of a process numbers its collectives from the same keys, so a second
strategy's collectives meet the first one's cached instances and abort
("Shape mismatch in the collective instance 101"). `own(strategy)` gives
each strategy keys of its own the first time keras_dist sees it; every
function here calls it.

In replica context (inside `strategy.run`): `all_reduce`,
`all_reduce_sum`, `all_reduce_flat` (buckets packed into one buffer),
`all_gather`, `all_gather_pairs` (index/value pairs bit-packed into one
int32 collective), `reduce_scatter` (for sharded optimizer state). In
cross-replica context: `reduce_across`,
`gather_across`. Buckets: `plan_buckets`, `ready_order`.

Every replica must issue the same collectives in the same order, or the job
deadlocks: never call these inside a `tf.cond` or loop that runs in replica
context (branch through `merge_call`, as `PowerSGD` does).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import weakref

import tensorflow as tf

from keras_dist._compat import tf_internal
from keras_dist._validation import check_int
from keras_dist.core import chunked, gloo, watchdog

logger = logging.getLogger(__name__)

# --- Keys ------------------------------------------------------------------

# Group keys of the strategies keras_dist re-keys: each gets a block of
# `_KEY_BLOCK` keys (a strategy uses one group per set of devices: one or
# two). MultiWorkerMirroredStrategy has its own range and keeps the first
# instance's keys: its group keys must agree across worker processes, which
# may create other (local) strategies in different orders.
_KEY_BLOCK = 100_000
_LOCAL_FIRST_BLOCK = 1
_MULTI_WORKER_FIRST_BLOCK = 10_000
_BLOCKS_PER_RANGE = 9_999

_lock = threading.Lock()
_owned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_counts = {"local": 0, "multi_worker": 0}


def own(strategy=None) -> None:
    """Gives `strategy` collective keys no other strategy of the process uses.

    A multi-worker strategy's collective timeout moves to the process's
    watchdog (`keras_dist.core.watchdog`), and the gloo backend connects
    when it is requested. Idempotent and cheap after the first call for a
    strategy. Called by every collective of this module, and by
    `DistributedModel` and `auto_strategy` before anything is traced, so a
    strategy is re-keyed before its first collective where keras_dist can
    arrange it.

    Args:
        strategy: A `tf.distribute.Strategy`, or `None` for the current one.
    """
    strategy = strategy or tf.distribute.get_strategy()
    extended = strategy.extended
    if extended in _owned:
        return
    if tf_internal.is_multi_worker(strategy):
        # A timeout on the collectives costs a thread per collective; one
        # watchdog thread bounds the waits instead (`core/watchdog.py`).
        watchdog.watch(strategy, tf_internal.take_collective_timeout(strategy))
        # Before the keys: a backend that cannot serve the strategy fails
        # here, and the strategy stays unowned until it is fixed.
        _log_backend(strategy, gloo.enable_if_requested(strategy))
    with _lock:
        if extended in _owned:
            return
        if tf_internal.collective_group_base(strategy) is None:
            _owned[extended] = None
            return
        if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            count = _counts["multi_worker"]
            _counts["multi_worker"] += 1
            if count == 0:
                # The first keeps TensorFlow's keys: nothing of this process
                # can have used them for another group of these workers.
                _subdivide(strategy)
                _owned[extended] = tf_internal.collective_group_base(strategy)
                return
            block = _MULTI_WORKER_FIRST_BLOCK + (count - 1) % _BLOCKS_PER_RANGE
        else:
            count = _counts["local"]
            _counts["local"] += 1
            block = _LOCAL_FIRST_BLOCK + count % _BLOCKS_PER_RANGE
        tf_internal.rekey_collectives(strategy, block * _KEY_BLOCK)
        _subdivide(strategy)
        _owned[extended] = block * _KEY_BLOCK + 1


def _log_backend(strategy, choice) -> None:
    """Says once per strategy, on the chief, what carries its sums and why."""
    if tf_internal.worker_rank(strategy) != 0:
        return
    if choice.backend == "gloo":
        logger.warning(
            "keras_dist: gradients sum through gloo (%s; %s=tensorflow for "
            "TensorFlow's collectives).",
            choice.reason,
            gloo.ENV_VAR,
        )
    else:
        logger.info(
            "keras_dist: this job sums its gradients through TensorFlow's "
            "collectives (%s).",
            choice.reason,
        )


# Pieces a CPU worker's ring all-reduce may split a tensor into (TensorFlow's
# strategies send each tensor whole): see `tf_internal.own_launchers`.
# Between 2 worker processes 100 MB took 0.38-0.40 s whole, 0.23 s with 8
# pieces and 0.21 s with 16 to 64 (docs/benchmarks/ddp.md). Environment
# variable `KERAS_DIST_RING_SUBDIVS`: another maximum, or -1 for TensorFlow's
# behaviour.
RING_SUBDIVS = 16


def _subdivide(strategy) -> None:
    if not tf_internal.is_multi_worker(strategy):
        return
    value = os.environ.get("KERAS_DIST_RING_SUBDIVS", "").strip()
    subdivs = RING_SUBDIVS
    if value:
        try:
            subdivs = int(value)
        except ValueError:
            subdivs = 0
        if subdivs == 0 or subdivs < -1:
            raise ValueError(
                "KERAS_DIST_RING_SUBDIVS must be a positive int (the most "
                "pieces a CPU all-reduce splits a tensor into) or -1 "
                f"(TensorFlow's behaviour, one piece). Received: {value!r}. "
                f"Unset it for keras_dist's default, {RING_SUBDIVS}."
            )
    tf_internal.own_launchers(strategy, subdivs)


def stable_instance_keys():
    """A context: the all-reduces traced inside keep their instance keys.

    TensorFlow gives a collective in a function a new instance key on every
    call, and its runtime remembers every key it has seen: between worker
    processes about 1.5 KiB a collective, without end
    (tensorflow/tensorflow#42616). Inside this context an all-reduce of a
    static shape takes its key at its function's first call and keeps it
    (`tf_internal.stable_instance_keys`). Only for functions every worker
    traces alike, in the same order: a step function over an iterator, not
    one traced by the shapes of the batches handed to it.
    """
    return tf_internal.stable_instance_keys()


def group_base(strategy) -> int | None:
    """The first collective group key of `strategy` (after `own`), or `None`."""
    own(strategy)
    return _owned[strategy.extended]


def replica_context() -> tf.distribute.ReplicaContext:
    """Returns the current replica context; raises RuntimeError outside one."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError(
            "keras_dist's collectives must run in a replica context (inside "
            "`strategy.run`), not in cross-replica context."
        )
    own(ctx.strategy)
    return ctx


def num_replicas() -> int:
    """Replicas in sync in the current replica context (1 without a strategy)."""
    return tf.distribute.get_replica_context().num_replicas_in_sync


# --- Sizes -----------------------------------------------------------------


def num_elements(shape) -> int:
    """Returns the number of elements of a fully defined `shape`."""
    return math.prod(int(d) for d in tuple(shape))


def tensor_bytes(tensor) -> int:
    """Returns the size in bytes of `tensor` (a tensor, variable or spec)."""
    return num_elements(tensor.shape) * tf.as_dtype(tensor.dtype).size


def is_sparse(tensor) -> bool:
    """Whether `tensor` is a `tf.IndexedSlices` (a sparse gradient)."""
    return isinstance(tensor, tf.IndexedSlices)


# --- Replica context -------------------------------------------------------


def all_reduce(value, op="sum"):
    """Reduces `value` (a tensor, `tf.IndexedSlices` or a list) over replicas.

    One collective per dtype. A `tf.IndexedSlices` is all-gathered (its rows
    and indices), not densified. With one replica `value` comes back as is.

    Args:
        value: A tensor, `tf.IndexedSlices`, or a (nested) list of them.
        op: String, `"sum"` or `"mean"`. Defaults to `"sum"`.

    Returns:
        The reduced value, in the structure of `value`.
    """
    ctx = replica_context()
    if ctx.num_replicas_in_sync == 1:
        return value
    reduce_op = {
        "sum": tf.distribute.ReduceOp.SUM,
        "mean": tf.distribute.ReduceOp.MEAN,
    }[op]
    return ctx.all_reduce(reduce_op, value)


def all_reduce_sum(tensors, bucket_bytes=None):
    """Sums `tensors` over replicas, one collective per bucket.

    TensorFlow cannot all-reduce a list of mixed dtypes in one call, so the
    tensors are grouped by dtype (and, with `bucket_bytes`, by size, see
    `plan_buckets`) and the results put back in input order. Must be
    called in replica context.

    Args:
        tensors: List of tensors (`tf.IndexedSlices` are densified).
        bucket_bytes: Int or `None`. `None` (the default): one collective
            per dtype. An int: buckets of about that many bytes, issued in
            reverse order of `tensors`.

    Returns:
        List of summed tensors in the input order.

    Raises:
        RuntimeError: called in cross-replica context.
    """
    return _sum_by_bucket(
        tensors,
        lambda ctx, group: ctx.all_reduce(tf.distribute.ReduceOp.SUM, group),
        bucket_bytes,
    )


def all_reduce_flat(tensors, bucket_bytes=None):
    """Sums `tensors` over replicas, each bucket packed into one flat buffer.

    Like `all_reduce_sum`, but the tensors of each bucket are concatenated
    into one vector first, so many small tensors (PowerSGD's factors, bias
    vectors) cost one collective launch instead of one each.

    Args:
        tensors: List of tensors with static shapes.
        bucket_bytes: Int or `None`. As in `all_reduce_sum`.

    Returns:
        List of summed tensors in the input order.

    Raises:
        RuntimeError: called in cross-replica context.
    """
    return _sum_by_bucket(tensors, _sum_flat, bucket_bytes)


def _sum_flat(ctx, group):
    if len(group) == 1:
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, group)
    flat = tf.concat([tf.reshape(t, [-1]) for t in group], axis=0)
    (summed,) = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [flat])
    sizes = [num_elements(t.shape) for t in group]
    return [
        tf.reshape(part, tensor.shape)
        for tensor, part in zip(group, tf.split(summed, sizes))
    ]


def _sum_by_bucket(tensors, sum_group, bucket_bytes):
    """Applies `sum_group(ctx, tensors_of_one_bucket)` per bucket, in order."""
    ctx = replica_context()
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if ctx.num_replicas_in_sync == 1 or not tensors:
        return tensors
    result = [None] * len(tensors)
    # Where gloo carries a strategy's sums (core/gloo.py), the dense buckets
    # go through it: all are started before any is waited for, so their
    # all-reduces overlap, as DDP's do.
    started = []
    for bucket in plan_buckets(tensors, bucket_bytes):
        group = [tensors[i] for i in bucket]
        backend = _gloo_carrying(ctx, group)
        if backend is not None:
            started.append((bucket, backend, backend.start(group)))
            continue
        for i, value in zip(bucket, sum_group(ctx, group)):
            result[i] = value
    for bucket, backend, pending in started:
        for i, value in zip(bucket, backend.finish(pending)):
            result[i] = value
    return result


def _gloo_carrying(ctx, tensors):
    """The gloo group that carries this collective of `tensors`, or `None`
    (TensorFlow's): where the strategy's sums go through gloo and gloo can
    take these tensors here (`GlooGroup.carries`)."""
    backend = gloo.group_for(ctx.strategy)
    if backend is None or not backend.carries(tensors):
        return None
    return backend


def all_gather(tensor, axis=0, chunk_bytes=None):
    """Concatenates every replica's `tensor` along `axis`, in replica order.

    Along the first axis, with shapes known when tracing, through gloo where
    the strategy's sums go through it (`core/gloo.py`). `chunk_bytes` (an
    int, along the first axis, static shapes): between worker processes on
    TensorFlow's CPU collectives, gathered in unordered chunks of about
    that many bytes (`core/chunked.py`).
    """
    ctx = replica_context()
    if ctx.num_replicas_in_sync == 1:
        return tensor
    backend = _gloo_carrying(ctx, [tensor]) if axis == 0 else None
    if backend is not None:
        (gathered,) = backend.finish(backend.start_all_gather(tensor))
        return gathered
    if chunk_bytes is None or axis != 0 or not chunked.applies(ctx.strategy):
        return ctx.all_gather(tensor, axis=axis)
    gathered = chunked.gather_rows(ctx.strategy, tf.reshape(tensor, [-1]), chunk_bytes)
    return tf.reshape(gathered, [-1, *tensor.shape[1:]])


def all_gather_pairs(indices, values):
    """All-gathers (indices, values) pairs in one int32 collective.

    The sparsifying hooks (`TopK`, `DGC`) send, per gradient, the positions
    and values of the entries they keep. Values are bit-cast to int32 words
    (16-bit values padded to an even count): the gather moves bits, so
    every dtype (bfloat16 too, which TensorFlow's gather rejects) travels in
    one collective. Sizes may be known only when the step runs (DGC's
    warm-up), but every replica must send the same sizes.

    Args:
        indices: List of int32 vectors.
        values: List of floating-point vectors, one per index vector.

    Returns:
        A list of `(indices, values)`: per pair, every replica's entries
        concatenated in replica order.
    """
    pieces = [*indices, *(_to_words(v) for v in values)]
    sizes = tf.stack([tf.shape(p)[0] for p in pieces])
    row = tf.concat(pieces, axis=0)
    replicas = replica_context().num_replicas_in_sync
    rows = tf.reshape(all_gather(row, axis=0), [replicas, -1])
    columns = tf.split(rows, sizes, axis=1, num=len(pieces))
    n = len(indices)
    return [
        (
            tf.reshape(columns[i], [-1]),
            _from_words(columns[n + i], values[i].dtype, tf.shape(values[i])[0]),
        )
        for i in range(n)
    ]


def _to_words(values):
    """Bit-casts a float vector to int32 words (16-bit: padded to even)."""
    size = values.dtype.size
    if size == 4:
        return tf.bitcast(values, tf.int32)
    if size == 8:
        return tf.reshape(tf.bitcast(values, tf.int32), [-1])
    values = tf.pad(values, [[0, tf.shape(values)[0] % 2]])
    return tf.bitcast(tf.reshape(values, [-1, 2]), tf.int32)


def _from_words(words, dtype, count):
    """Inverse of `_to_words` for gathered rows `[replicas, words]`."""
    replicas = tf.shape(words)[0]
    size = dtype.size
    if size == 4:
        values = tf.bitcast(words, dtype)
    elif size == 8:
        values = tf.bitcast(tf.reshape(words, [replicas, -1, 2]), dtype)
    else:
        values = tf.reshape(tf.bitcast(words, dtype), [replicas, -1])
    return tf.reshape(values[:, :count], [-1])


def reduce_scatter(flat, sum_dtype=None, chunk_bytes=None):
    """Sums a flat vector over replicas; each replica keeps its own slice.

    Replica `i` of `N` gets `sum over replicas of flat[i*S:(i+1)*S]` (`S =
    len(flat) / N`): what an all-reduce computes, in 1/N of the memory and
    the bytes of half a ring all-reduce. Built from an all-to-all and a local
    sum (TensorFlow's own reduce-scatter resolves only on NCCL), on every
    device kind; the all-to-all goes through gloo where the strategy's sums
    do (`core/gloo.py`), and the rows are summed here either way.

    Args:
        flat: A vector whose length is a multiple of the replica count.
        sum_dtype: `tf.DType` or `None`. The dtype the received rows are
            cast to before the local sum (a 16-bit wire summed in float32).
            `None`: `flat`'s.
        chunk_bytes: Int or `None`. Between worker processes on
            TensorFlow's CPU collectives, the all-to-all goes in unordered
            chunks of about this many bytes (`core/chunked.py`). `None`:
            one all-to-all.

    Returns:
        This replica's slice of the sum, of length `len(flat) / N`.
    """
    ctx = replica_context()
    replicas = ctx.num_replicas_in_sync
    if replicas == 1:
        return flat if sum_dtype is None else tf.cast(flat, sum_dtype)
    backend = _gloo_carrying(ctx, [flat])
    if backend is None:
        if not chunked.applies(ctx.strategy):
            chunk_bytes = None
        return chunked.sum_rows(ctx.strategy, flat, sum_dtype, chunk_bytes)
    (received,) = backend.finish(backend.start_all_to_all(flat))
    return chunked.add_rows(received, replicas, sum_dtype)


# --- Cross-replica context -------------------------------------------------


def branch_across(flag, if_true, if_false, args):
    """`tf.cond(flag, ...)` whose branches issue collectives, per replica.

    A collective inside a replica-context `tf.cond` cannot be traced under
    `MirroredStrategy`, so the branch is taken in cross-replica context
    through one `merge_call`, and the chosen branch runs on every replica.
    Replica context.

    Args:
        flag: Boolean scalar tensor, the same on every replica (replica 0's
            decides).
        if_true: Callable, `if_true(*args)` on each replica when `flag`.
        if_false: Callable, `if_false(*args)` on each replica otherwise.
            Both return the same structure.
        args: Tuple of tensors the branches take. They go through
            `merge_call`'s arguments, not the branches' closures: the
            cross-replica function runs once, with one replica's closure.

    Returns:
        This replica's result of the chosen branch.
    """

    def choose(strategy, flag, *args):
        def run(branch):
            return lambda: strategy.extended.call_for_each_replica(branch, args=args)

        flag = strategy.experimental_local_results(flag)[0]
        return tf.cond(flag, run(if_true), run(if_false))

    return replica_context().merge_call(choose, args=(flag, *args))


def reduce_across(strategy, value, op="sum"):
    """`strategy.reduce(op, value, axis=None)` with the keys owned.

    Cross-replica context; on several workers a collective every worker
    must call at the same point. Called eagerly, it runs in one
    `tf.function` per strategy and op (`_eagerly`).
    """
    own(strategy)
    reduce_op = {
        "sum": tf.distribute.ReduceOp.SUM,
        "mean": tf.distribute.ReduceOp.MEAN,
    }[op]
    if not tf.executing_eagerly():
        return strategy.reduce(reduce_op, value, axis=None)
    return _eagerly(
        strategy,
        ("reduce", op),
        lambda owner, value: owner.reduce(reduce_op, value, axis=None),
    )(value)


def gather_across(strategy, value, axis=0):
    """`strategy.gather(value, axis)` with the keys owned (cross-replica).

    Called eagerly (a backup's gather), it runs in one `tf.function` per
    strategy and axis (`_eagerly`).
    """
    own(strategy)
    if not tf.executing_eagerly():
        return strategy.gather(value, axis=axis)
    return _eagerly(
        strategy,
        ("gather", axis),
        lambda owner, value: owner.gather(value, axis=axis),
    )(value)


def _eagerly(strategy, name, collective):
    """`collective(strategy, value)` as a `tf.function`, one per name.

    A collective run eagerly gets a new instance key each time, and the
    runtime keeps every key it has seen (`stable_instance_keys`); under
    `MultiWorkerMirroredStrategy` an eager gather also traces a new function
    each time (TensorFlow warns of "excessive retracing" from the fifth
    backup on). In a function traced under `stable_instance_keys` the keys
    are kept: every worker makes these calls at the same points, with
    values of the same shapes.
    """
    functions = _EAGER_FUNCTIONS.setdefault(strategy, {})
    function = functions.get(name)
    if function is None:
        # A weak reference: the function must not keep its key alive.
        owner = weakref.ref(strategy)

        def run(value):
            with stable_instance_keys():
                return collective(owner(), value)

        # One trace per shape (no `reduce_retracing`): a relaxed shape
        # would take a new key on every call again.
        function = tf.function(run)
        functions[name] = function
    return function


_EAGER_FUNCTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# --- Buckets ---------------------------------------------------------------


def check_bucket_bytes(bucket_bytes, argument="bucket_bytes"):
    """Returns `bucket_bytes` (a positive int or `None`) after checking it."""
    return check_int(
        argument,
        bucket_bytes,
        minimum=1,
        allow_none=True,
        hint=(
            "Pass a size in bytes (for example 4 * 2**20), or None for one "
            "collective per dtype."
        ),
    )


def plan_buckets(tensors, bucket_bytes, order=None) -> list:
    """Groups gradients into the buckets that hooks reduce one at a time.

    The backward pass computes the last layers' gradients first. Reducing
    them in buckets, in reverse order of the model's variables, lets each
    bucket's collective run while earlier layers' gradients are still being
    computed. TensorFlow launches a step's collectives in program order (each
    waits for the previous one through the launcher's ordering token), so
    the first bucket issued must hold the first gradients computed: a
    collective issued first for the first layer, computed last, would hold
    back every other. This is the order PyTorch DDP starts from
    (`bucket_cap_mb`).

    Walking `tensors` from last to first, each dtype fills its own bucket
    until it holds at least `bucket_bytes`; a tensor larger than that is a
    bucket of its own, and a sparse `tf.IndexedSlices` is always alone (it is
    all-gathered, not summed). Buckets come out in the order their first
    tensor was reached, so the plan depends only on shapes and dtypes: the
    same on every replica and worker, as the collectives require.

    The backward pass does not always produce the gradients in the reverse
    order of the list: a subclassed model lists its variables in the order
    its layers were created, not called. `order` gives the real one; the
    aggregation path reads it from the traced graph (`ready_order`), the
    order DDP measures in its first iteration and rebuilds its buckets by.

    Args:
        tensors: List of tensors, `tf.IndexedSlices` or `VariableSpec`s, in
            the order of the model's variables (forward order).
        bucket_bytes: Int or `None`. `None`: one bucket per dtype, in input
            order (one collective per dtype after the whole backward pass).
        order: List of the positions of `tensors` in the order they become
            ready (computed first first), or `None` for the reverse of the
            list. Must be the same on every replica and worker.

    Returns:
        A list of buckets, each a non-empty list of positions into
        `tensors`; every position appears once.
    """
    bucket_bytes = check_bucket_bytes(bucket_bytes)
    if bucket_bytes is None:
        groups: dict = {}
        for position, tensor in enumerate(tensors):
            if is_sparse(tensor):
                groups[("sparse", position)] = [position]
            else:
                groups.setdefault(tf.as_dtype(tensor.dtype), []).append(position)
        return list(groups.values())
    if order is None:
        order = reversed(range(len(tensors)))
    elif sorted(order) != list(range(len(tensors))):
        raise ValueError(
            "`order` must list every position of `tensors` once. Received: "
            f"order={list(order)} for {len(tensors)} tensors."
        )
    closed = []
    open_buckets: dict = {}
    sizes: dict = {}
    for position in order:
        tensor = tensors[position]
        if is_sparse(tensor):
            closed.append([position])
            continue
        dtype = tf.as_dtype(tensor.dtype)
        bucket = open_buckets.setdefault(dtype, [])
        if not bucket:
            # The bucket takes its place in the order now, when its first
            # (earliest computed) gradient is reached.
            closed.append(bucket)
        bucket.append(position)
        sizes[dtype] = sizes.get(dtype, 0) + _nbytes(tensor)
        if sizes[dtype] >= bucket_bytes:
            del open_buckets[dtype]
            sizes[dtype] = 0
    return closed


def ready_order(tensors) -> list | None:
    """The positions of `tensors` in the order a traced graph computes them.

    The order in which their ops were added to the graph being traced: a
    gradient tape adds the backward pass's ops as it walks back from the
    loss, so a gradient created earlier is ready earlier. Identical on every
    replica and worker that traces the same step. Ties (outputs of one op)
    keep the list order.

    Args:
        tensors: List of tensors or `tf.IndexedSlices` (gradients).

    Returns:
        A list of positions for `plan_buckets(..., order=...)`, or `None`
        when the tensors are not all in one graph (eager execution).
    """
    ops = []
    for tensor in tensors:
        if is_sparse(tensor):
            tensor = tensor.values
        if not tf.is_symbolic_tensor(tensor):
            return None
        ops.append(tensor.op)
    if not ops or any(op.graph is not ops[0].graph for op in ops):
        return None
    created = {op.name: index for index, op in enumerate(ops[0].graph.get_operations())}
    ranks = [created[op.name] for op in ops]
    return sorted(range(len(ranks)), key=lambda position: (ranks[position], position))


def _nbytes(tensor) -> int:
    shape = tf.TensorShape(tensor.shape)
    # Planned with static shapes; an unknown dimension counts as one (the
    # bucket boundary moves, the sums do not).
    dims = [] if shape.rank is None else shape.as_list()
    return math.prod(d or 1 for d in dims) * tf.as_dtype(tensor.dtype).size
