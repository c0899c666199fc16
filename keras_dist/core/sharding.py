"""Optimizer-state sharding (ZeRO stages 1 and 2): the layout and the collectives.

Every replica holds the whole model but owns one equal slice of its
parameters, flattened into one vector and padded to a multiple of the
replica count `N`: replica `i` owns elements `[i*S, (i+1)*S)`, `S =
ceil(P / N)`. An update (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC 2020; PyTorch's
`ZeroRedundancyOptimizer`):

1. the gradients, flattened the same way, are reduce-scattered: each
   replica gets the sum over replicas of its slice only;
2. each replica runs the optimizer on its slice, with optimizer state
   (slots, the float32 master copy) for its slice only: 1/N of it;
3. the updated slices are all-gathered into every replica's weights.

A reduce-scatter plus an all-gather move the bytes of one ring all-reduce.
Stage 2 also reduce-scatters each micro-step's gradients into slice-sized
accumulators. This module is pure TensorFlow; the Keras 3 front end is
`keras_dist.ShardedOptimizer`.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import tensorflow as tf

from keras_dist.core import collectives


@contextlib.contextmanager
def replica_local_variables(on_create=None):
    """Variables created inside are per replica (`ON_READ`), not mirrored.

    Each replica reads and writes its own copy with no communication: what
    the slices and their optimizer state need, since every replica holds a
    different slice. A cross-replica read returns the first replica's copy;
    saving gathers them (`ShardedOptimizer`). `tf.variable_creator_scope`
    sets the synchronization before the strategy's own creator runs.

    Args:
        on_create: Callable or `None`. Called with each TensorFlow variable
            created inside, before anything tracks it (a checkpoint restores
            a variable as soon as it is tracked).
    """

    def creator(next_creator, **kwargs):
        kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
        kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
        variable = next_creator(**kwargs)
        if on_create is not None:
            on_create(variable)
        return variable

    with tf.variable_creator_scope(creator):
        yield


class ShardLayout:
    """How variables map onto equal slices of one flat vector.

    Args:
        shapes: List of the variables' shapes (tuples of ints), in order.
        replicas: Int. The number of replicas `N` sharing the state.
    """

    def __init__(self, shapes, replicas: int):
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.offsets = list(np.cumsum([0, *self.sizes[:-1]]).astype(int))
        self.total = int(sum(self.sizes))
        self.replicas = int(replicas)
        self.slice_size = max(1, -(-self.total // self.replicas))
        self.padded = self.slice_size * self.replicas

    def flatten(self, tensors, dtype=None):
        """The tensors as one vector of `padded` elements (zeros at the end)."""
        flat = tf.concat(
            [tf.reshape(tf.cast(t, dtype) if dtype else t, [-1]) for t in tensors],
            axis=0,
        )
        return tf.pad(flat, [[0, self.padded - self.total]])

    def unflatten(self, flat) -> list:
        """The inverse of `flatten`: one tensor per variable, in its shape."""
        parts = tf.split(flat[: self.total], self.sizes)
        return [tf.reshape(part, shape) for part, shape in zip(parts, self.shapes)]

    def local(self, flat, replica_id):
        """Replica `replica_id`'s slice of a flat vector (or array).

        A NumPy array and a replica id known when tracing (every strategy's
        replica context gives a constant) make a slice-sized constant: the
        whole array never enters the graph.
        """
        static = tf.get_static_value(replica_id)
        if isinstance(flat, np.ndarray) and static is not None:
            start = int(static) * self.slice_size
            return tf.constant(flat[start : start + self.slice_size])
        return tf.slice(flat, [replica_id * self.slice_size], [self.slice_size])

    def local_of(self, tensors, replica_id, dtype=None):
        """`local(flatten(tensors, dtype), replica_id)`, read slice-sized.

        With a replica id known when tracing, only the parts of the
        variables the slice covers are read and concatenated (`S` elements
        where `flatten` makes `N*S`): what a replica's update needs of the
        model's weights every step.
        """
        static = tf.get_static_value(replica_id)
        if static is None:
            return self.local(self.flatten(tensors, dtype), replica_id)
        start = int(static) * self.slice_size
        end = start + self.slice_size
        parts = []
        for tensor, offset, size in zip(tensors, self.offsets, self.sizes):
            low, high = max(start, offset), min(end, offset + size)
            if low >= high:
                continue
            flat = tf.reshape(tensor, [-1])[low - offset : high - offset]
            parts.append(tf.cast(flat, dtype) if dtype else flat)
        covered = sum(int(part.shape[0]) for part in parts)
        if covered < self.slice_size:
            parts.append(
                tf.zeros([self.slice_size - covered], dtype or tensors[0].dtype)
            )
        return tf.concat(parts, axis=0) if len(parts) > 1 else parts[0]

    def segment_ids(self) -> np.ndarray:
        """The variable index of every flat element (`len(shapes)`: padding).

        Int32, 4 bytes per element: built only where needed (`clipnorm`).
        """
        return np.repeat(
            np.arange(len(self.sizes) + 1, dtype=np.int32),
            [*self.sizes, self.padded - self.total],
        )

    def element_mask(self, flags) -> np.ndarray:
        """Float32 1.0 where the element's variable has its flag set, else 0.0."""
        per_variable = np.asarray([*map(bool, flags), False], dtype=np.float32)
        return np.repeat(per_variable, [*self.sizes, self.padded - self.total])

    def reshard(self, slices: np.ndarray, replicas: int) -> np.ndarray:
        """Slices `[N, S]` saved on `N` replicas as slices for `replicas`."""
        flat = np.asarray(slices).reshape(-1)[: self.total]
        other = ShardLayout(self.shapes, replicas)
        flat = np.pad(flat, (0, other.padded - other.total))
        return flat.reshape(replicas, other.slice_size)


def reduce_to_owners(layout: ShardLayout, flat, wire_dtype=None, range_checked=False):
    """Reduce-scatter of a flattened gradient: this replica's summed slice.

    Args:
        layout: The `ShardLayout`.
        flat: This replica's flattened gradient (`layout.padded` elements).
        wire_dtype: `tf.DType` or `None`. The dtype the rows travel in (a
            16-bit cast halves the bytes); they are summed in `flat`'s
            dtype on arrival, so only the cast rounds. `None`: `flat`'s.
        range_checked: Bool. Whether the wire dtype can overflow where
            `flat`'s cannot (float16 for float32). Then, when any replica's
            cast of a finite entry is not finite, every replica sends again
            at full precision in the same step.

    Returns:
        `(local, overflowed)`: this replica's summed slice, and a boolean
        scalar tensor (the same on every replica) saying whether the step
        was sent again, or `None` without a range check.
    """
    if wire_dtype is None or tf.as_dtype(wire_dtype) == flat.dtype:
        return collectives.reduce_scatter(flat), None
    sent = tf.cast(flat, wire_dtype)
    local = collectives.reduce_scatter(sent, sum_dtype=flat.dtype)
    if not range_checked or collectives.replica_context().num_replicas_in_sync == 1:
        return local, None
    lost = tf.math.is_finite(flat) & ~tf.math.is_finite(sent)
    overflowed = collectives.all_reduce(tf.reduce_sum(tf.cast(lost, tf.int32))) > 0
    local = collectives.branch_across(
        overflowed,
        lambda flat, _: collectives.reduce_scatter(flat),
        lambda _, local: tf.identity(local),
        (flat, local),
    )
    return local, overflowed


def gather_slices(layout: ShardLayout, local_slice) -> list:
    """All-gathers every replica's slice; returns the tensors, unflattened."""
    flat = tf.reshape(collectives.all_gather(local_slice[None], axis=0), [-1])
    return layout.unflatten(flat)


def global_norm(local_slice):
    """The norm of the whole (sliced) vector: an all-reduced scalar."""
    local = tf.reduce_sum(tf.square(tf.cast(local_slice, tf.float32)))
    return tf.sqrt(collectives.all_reduce(local))


def per_variable_norms(layout: ShardLayout, local_slice, local_segments):
    """Each variable's norm from the slices: one all-reduced vector."""
    local = tf.math.unsorted_segment_sum(
        tf.square(tf.cast(local_slice, tf.float32)),
        local_segments,
        len(layout.sizes) + 1,
    )
    return tf.sqrt(collectives.all_reduce(local))


def count_non_finite(local_slice, others=()):
    """Non-finite entries over every replica's slice (and `others`, tensors
    this replica checks too): an all-reduced int."""
    local = tf.add_n(
        [
            tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(t)), tf.int32))
            for t in (local_slice, *others)
        ]
    )
    return collectives.all_reduce(local)
