"""Optimizer-state sharding (ZeRO stages 1 and 2): the layout and the collectives.

Every replica holds the whole model but owns one equal slice of its
parameters: the parameters, flattened in order, are cut into segments of
about 4 MiB (whole variables), and each segment is split into `N` equal
pieces, one per replica (`ShardLayout`). An update (Rajbhandari et al.,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC
2020; DeepSpeed's stage 2 reduce-scatters per bucket the same way):

1. each segment's gradients are reduce-scattered as soon as the backward
   pass has computed them: each replica gets the sum over replicas of its
   piece only;
2. each replica runs the optimizer on its slice (its pieces), with
   optimizer state (slots, the float32 master copy) for its slice only:
   1/N of it;
3. the updated pieces are all-gathered, segment by segment, into every
   replica's weights.

A reduce-scatter plus an all-gather move the bytes of one ring all-reduce,
and no step makes a vector of the whole model. Stage 2 also
reduce-scatters each micro-step's gradients into slice-sized accumulators.
This module is pure TensorFlow; the Keras 3 front end is
`keras_dist.ShardedOptimizer`.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import tensorflow as tf

from keras_dist.core import collectives, inventory


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
    """How variables map onto equal slices, segment by segment.

    The variables, flattened in order, make one vector of `total` elements.
    It is cut into segments of whole variables, about `bucket_bytes` each,
    planned as the all-reduce buckets are (`collectives.plan_buckets`: from
    the last variable back, since the backward pass computes the last
    layers' gradients first). Each segment is padded to a multiple of the
    replica count `N` and split into `N` equal pieces; replica `i`'s slice
    is its piece of every segment, in the variables' order
    (`inventory.shard_stack`). So each segment's gradients are
    reduce-scattered as soon as the backward pass has computed them, while
    it computes the rest, and no step flattens the whole model. With
    `bucket_bytes=None` the whole vector is one segment: replica `i` owns
    elements `[i*S, (i+1)*S)` of it. Between worker processes on
    TensorFlow's CPU collectives a segment's reduce-scatter and all-gather
    go in unordered chunks of about `bucket_bytes`
    (`collectives.reduce_scatter`'s `chunk_bytes`), so one large variable
    does not travel as one message.

    Args:
        shapes: List of the variables' shapes (tuples of ints), in order.
        replicas: Int. The number of replicas `N` sharing the state.
        bucket_bytes: Int or `None`. The size of a segment in bytes; `None`
            for one segment.
        dtype: `tf.DType`. The variables' dtype, for `bucket_bytes`.
            Defaults to float32.
    """

    def __init__(self, shapes, replicas: int, bucket_bytes=None, dtype=tf.float32):
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]
        # A segment larger than this (one large variable) travels in chunks
        # of about this size between worker processes on TensorFlow's CPU
        # collectives (`chunked.applies`).
        self.chunk_bytes = bucket_bytes
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.offsets = [int(o) for o in np.cumsum([0, *self.sizes[:-1]])]
        self.total = int(sum(self.sizes))
        self.replicas = int(replicas)
        buckets = collectives.plan_buckets(
            [tf.TensorSpec(shape, dtype) for shape in self.shapes], bucket_bytes
        )
        # Buckets come in the order the backward pass readies them (the last
        # variables first), each of consecutive variables: reversed, they are
        # the segments in the variables' order.
        ranges = [sorted(bucket) for bucket in reversed(buckets)] or [[]]
        self.segment_variables = ranges
        self.segments = [sum(self.sizes[i] for i in r) for r in ranges]
        self.issue_order = list(reversed(range(len(ranges))))
        self.segment_starts = [int(o) for o in np.cumsum([0, *self.segments[:-1]])]
        self.pieces = inventory.shard_pieces(self.segments, self.replicas)
        self.piece_offsets = [int(o) for o in np.cumsum([0, *self.pieces[:-1]])]
        self.slice_size = int(sum(self.pieces))

    def flatten(self, tensors, dtype=None):
        """The tensors as one vector of `total` elements, in order."""
        flat = [tf.reshape(tf.cast(t, dtype) if dtype else t, [-1]) for t in tensors]
        return tf.concat(flat, axis=0) if len(flat) != 1 else flat[0]

    def segment_flats(self, tensors, dtype=None) -> list:
        """Each segment's tensors as one vector padded to `N` pieces.

        Args:
            tensors: List of tensors, one per variable, in order.
            dtype: `tf.DType` or `None`. Cast to it first.

        Returns:
            A list, in segment order, of vectors of `pieces[s] * N` elements.
        """
        flats = []
        for positions, length, piece in zip(
            self.segment_variables, self.segments, self.pieces
        ):
            flat = self.flatten([tensors[i] for i in positions], dtype)
            pad = piece * self.replicas - length
            flats.append(tf.pad(flat, [[0, pad]]) if pad else flat)
        return flats

    def join_pieces(self, pieces):
        """This replica's slice from its piece of each segment (in order)."""
        return tf.concat(list(pieces), axis=0) if len(pieces) > 1 else pieces[0]

    def split_slice(self, local_slice) -> list:
        """A slice's pieces, one per segment (the inverse of `join_pieces`)."""
        if len(self.pieces) == 1:
            return [local_slice]
        return tf.split(local_slice, self.pieces)

    def unflatten_segment(self, segment: int, flat) -> list:
        """A segment's gathered vector as its variables' tensors."""
        positions = self.segment_variables[segment]
        sizes = [self.sizes[i] for i in positions]
        flat = flat[: self.segments[segment]]
        parts = tf.split(flat, sizes) if len(sizes) > 1 else [flat]
        return [tf.reshape(part, self.shapes[i]) for i, part in zip(positions, parts)]

    def local(self, whole, replica_id, fill=0):
        """Replica `replica_id`'s slice of a vector in the variables' order.

        A NumPy array and a replica id known when tracing (every strategy's
        replica context gives a constant) make a slice-sized constant: the
        whole array never enters the graph.

        Args:
            whole: Vector (tensor or NumPy array) of `total` elements.
            replica_id: Int or scalar tensor.
            fill: The value of the padding. Defaults to `0`.
        """
        static = tf.get_static_value(replica_id)
        if isinstance(whole, np.ndarray) and static is not None:
            return tf.constant(self._local_array(whole, int(static), fill))
        whole = tf.convert_to_tensor(whole)
        pieces = []
        for start, length, piece in zip(
            self.segment_starts, self.segments, self.pieces
        ):
            part = tf.pad(
                whole[start : start + length],
                [[0, piece * self.replicas - length]],
                constant_values=tf.cast(fill, whole.dtype),
            )
            pieces.append(tf.reshape(part, [self.replicas, piece])[replica_id])
        return self.join_pieces(pieces)

    def _local_array(self, whole, replica: int, fill) -> np.ndarray:
        out = np.full(self.slice_size, fill, whole.dtype)
        for start, length, piece, column in zip(
            self.segment_starts, self.segments, self.pieces, self.piece_offsets
        ):
            low = replica * piece
            high = min(length, low + piece)
            if low < high:
                out[column : column + high - low] = whole[start + low : start + high]
        return out

    def local_of(self, tensors, replica_id, dtype=None):
        """`local(flatten(tensors, dtype), replica_id)`, read slice-sized.

        With a replica id known when tracing, only the parts of the
        variables the slice covers are read and concatenated (`S` elements
        where `flatten` makes `P`): what a replica's update needs of the
        model's weights every step.
        """
        static = tf.get_static_value(replica_id)
        if static is None:
            return self.local(self.flatten(tensors, dtype), replica_id)
        parts = []
        for start, length, piece in zip(
            self.segment_starts, self.segments, self.pieces
        ):
            low = start + int(static) * piece
            high = min(start + length, low + piece)
            covered = 0
            for tensor, offset, size in zip(tensors, self.offsets, self.sizes):
                first, last = max(low, offset), min(high, offset + size)
                if first >= last:
                    continue
                flat = tf.reshape(tensor, [-1])[first - offset : last - offset]
                parts.append(tf.cast(flat, dtype) if dtype else flat)
                covered += last - first
            if covered < piece:
                parts.append(tf.zeros([piece - covered], dtype or tensors[0].dtype))
        return tf.concat(parts, axis=0) if len(parts) > 1 else parts[0]

    def positions(self, flat_indices, replica_id):
        """Where elements of the variables' vector sit in a replica's slice.

        Args:
            flat_indices: Int64 tensor of indices into the vector of `total`
                elements (the variables flattened in order).
            replica_id: Int or scalar tensor.

        Returns:
            `(mine, positions)`: a boolean tensor, whether replica
            `replica_id` owns each element, and the positions in its slice
            of those it owns.
        """
        flat_indices = tf.cast(flat_indices, tf.int64)
        starts = tf.constant(self.segment_starts, tf.int64)
        segment = tf.searchsorted(starts, flat_indices, side="right") - 1
        piece = tf.gather(tf.constant(self.pieces, tf.int64), segment)
        within = flat_indices - tf.gather(starts, segment)
        mine = tf.equal(within // piece, tf.cast(replica_id, tf.int64))
        column = tf.gather(tf.constant(self.piece_offsets, tf.int64), segment)
        return mine, tf.boolean_mask(column + within % piece, mine)

    def segment_ids(self) -> np.ndarray:
        """The variable index of every element (int32, 4 bytes per element:
        built only where needed, `clipnorm`); pad slices with `len(shapes)`."""
        return np.repeat(np.arange(len(self.sizes), dtype=np.int32), self.sizes)

    def element_mask(self, flags) -> np.ndarray:
        """Float32 1.0 where the element's variable has its flag set, else 0.0."""
        per_variable = np.asarray(list(map(bool, flags)), dtype=np.float32)
        return np.repeat(per_variable, self.sizes)

    def to_slices(self, whole) -> np.ndarray:
        """A vector in the variables' order as slices `[N, S]`."""
        return inventory.shard_stack(whole, self.segments, self.replicas)

    def to_whole(self, slices) -> np.ndarray:
        """Slices `[N, S]` (any `N`) joined into the vector, unpadded."""
        return inventory.join_shards(slices, self.segments)


def reduce_to_owners(layout: ShardLayout, flats, wire_dtype=None, range_checked=False):
    """Reduce-scatter of a gradient, segment by segment: this replica's slice.

    The segments' reduce-scatters are issued in `layout.issue_order` (the
    order the backward pass computes them), each as soon as its gradients
    are there: they run while the rest of the backward pass does.

    Args:
        layout: The `ShardLayout`.
        flats: This replica's gradient as `layout.segment_flats` makes it.
        wire_dtype: `tf.DType` or `None`. The dtype the rows travel in (a
            16-bit cast halves the bytes); they are summed in the flats'
            dtype on arrival, so only the cast rounds. `None`: theirs.
        range_checked: Bool. Whether the wire dtype can overflow where the
            flats' cannot (float16 for float32). Then, when any replica's
            cast of a finite entry is not finite, every replica sends again
            at full precision in the same step.

    Returns:
        `(local, overflowed)`: this replica's summed slice, and a boolean
        scalar tensor (the same on every replica) saying whether the step
        was sent again, or `None` without a range check.
    """
    flats = list(flats)
    dtype = flats[0].dtype
    if wire_dtype is None or tf.as_dtype(wire_dtype) == dtype:
        return _scatter(layout, flats), None
    sent = [tf.cast(flat, wire_dtype) for flat in flats]
    local = _scatter(layout, sent, sum_dtype=dtype)
    if not range_checked or collectives.replica_context().num_replicas_in_sync == 1:
        return local, None
    lost = tf.add_n(
        [
            tf.reduce_sum(
                tf.cast(tf.math.is_finite(flat) & ~tf.math.is_finite(cast), tf.int32)
            )
            for flat, cast in zip(flats, sent)
        ]
    )
    overflowed = collectives.all_reduce(lost) > 0
    local = collectives.branch_across(
        overflowed,
        lambda *args: _scatter(layout, list(args[:-1])),
        lambda *args: tf.identity(args[-1]),
        (*flats, local),
    )
    return local, overflowed


def _scatter(layout, flats, sum_dtype=None):
    pieces = [None] * len(flats)
    for segment in layout.issue_order:
        pieces[segment] = collectives.reduce_scatter(
            flats[segment], sum_dtype, layout.chunk_bytes
        )
    return layout.join_pieces(pieces)


def gather_slices(layout: ShardLayout, local_slice) -> list:
    """All-gathers every replica's slice, segment by segment; returns the
    variables' tensors, in order."""
    values = [None] * len(layout.sizes)
    pieces = layout.split_slice(local_slice)
    for segment, piece in enumerate(pieces):
        gathered = collectives.all_gather(
            piece[None], axis=0, chunk_bytes=layout.chunk_bytes
        )
        flat = tf.reshape(gathered, [-1])
        for position, value in zip(
            layout.segment_variables[segment],
            layout.unflatten_segment(segment, flat),
        ):
            values[position] = value
    return values


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


class OwnerLayout:
    """Whole variables owned by replicas, balanced by size.

    The partition of PyTorch's `ZeroRedundancyOptimizer`: the variables,
    largest first, each go to the replica that owns the fewest elements so
    far. A replica keeps the optimizer state of its own variables only, so
    an optimizer that needs a whole variable (factored moments, a trust
    ratio, an orthogonalized update) updates it exactly as unsharded.

    The gradients travel as one vector of `N` blocks of `slice_size`
    elements: block `r` holds replica `r`'s variables in order, then zeros.
    A reduce-scatter of that vector gives each replica the summed gradients
    of its variables, an all-gather of the updated blocks every replica's
    weights: the collectives of `ShardLayout`, in one segment. Its
    `segment_flats`, `segments`, `pieces`, `issue_order` and `join_pieces`
    are what `reduce_to_owners` reads.

    Args:
        shapes: List of the variables' shapes (tuples of ints), in order.
        replicas: Int. The number of replicas `N`.
        chunk_bytes: Int or `None`. Between worker processes on
            TensorFlow's CPU collectives, the vector travels in unordered
            chunks of about this many bytes (`ShardLayout`'s). Defaults to
            `None` (one piece).
    """

    def __init__(self, shapes, replicas: int, chunk_bytes=None):
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]
        self.chunk_bytes = chunk_bytes
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.replicas = int(replicas)
        loads = [0] * self.replicas
        self.owners = [0] * len(self.sizes)
        for index in sorted(range(len(self.sizes)), key=lambda i: -self.sizes[i]):
            owner = min(range(self.replicas), key=lambda r: loads[r])
            self.owners[index] = owner
            loads[owner] += self.sizes[index]
        self.owned = [
            [i for i, o in enumerate(self.owners) if o == replica]
            for replica in range(self.replicas)
        ]
        self.loads = loads
        # A replica may own nothing (more replicas than variables): its block
        # is padding. At least one element, so that every block exists.
        self.slice_size = max(1, max(loads))
        self.segments = [self.slice_size * self.replicas]
        self.pieces = [self.slice_size]
        self.issue_order = [0]

    def segment_flats(self, tensors, dtype=None) -> list:
        """The tensors (one per variable, in order) as the one vector of `N`
        blocks, each replica's variables in its block."""
        blocks = [
            self.pack(replica, [tensors[i] for i in self.owned[replica]], dtype)
            for replica in range(self.replicas)
        ]
        return [tf.concat(blocks, axis=0)]

    def join_pieces(self, pieces):
        """This replica's block (one segment, one piece)."""
        (block,) = pieces
        return block

    def pack(self, replica: int, tensors, dtype=None):
        """Replica `replica`'s variables' tensors as its block."""
        flat = [tf.reshape(tf.cast(t, dtype) if dtype else t, [-1]) for t in tensors]
        pad = self.slice_size - self.loads[replica]
        if pad or not flat:
            flat.append(
                tf.zeros([pad], dtype or (tensors[0].dtype if tensors else tf.float32))
            )
        return tf.concat(flat, axis=0) if len(flat) > 1 else flat[0]

    def unpack(self, replica: int, block) -> list:
        """Replica `replica`'s block as its variables' tensors (in order)."""
        owned = self.owned[replica]
        if not owned:
            return []
        sizes = [self.sizes[i] for i in owned]
        parts = (
            tf.split(block[: sum(sizes)], sizes)
            if len(sizes) > 1
            else [block[: sizes[0]]]
        )
        return [tf.reshape(p, self.shapes[i]) for i, p in zip(owned, parts)]

    def unpack_all(self, blocks) -> list:
        """Every replica's block (`[N, slice_size]`) as the variables'
        tensors, in the variables' order."""
        values = [None] * len(self.sizes)
        for replica in range(self.replicas):
            for index, value in zip(
                self.owned[replica], self.unpack(replica, blocks[replica])
            ):
                values[index] = value
        return values


def gather_blocks(layout: OwnerLayout, block) -> list:
    """All-gathers every replica's block; returns the variables' tensors."""
    return layout.unpack_all(
        collectives.all_gather(block[None], axis=0, chunk_bytes=layout.chunk_bytes)
    )
