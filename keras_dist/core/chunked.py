"""Large all-to-alls and all-gathers on TensorFlow's CPU collectives, in
concurrent chunks.

TensorFlow's CPU collectives send a replica's share for each peer as one
message, and run a step's collectives one after another: each waits for the
previous one through its launcher's ordering token. Its ring all-reduce
pipelines its pieces (subdivisions); its all-to-all and all-gather do not,
so copying, sending and parsing a large share follow each other, and a
reduce-scatter plus an all-gather of a vector took 2.2x as long as an
all-reduce of it between 2 worker processes here (1.3x on a link shaped to
1 Gbit/s), though they move the same bytes. Cut into chunks of about
`chunk_bytes`, issued unordered (`tf_internal.all_to_all(...,
ordered=False)`), the chunks overlap each other and the computation still
going on. Measured on 25.2M float32 between 2 worker processes on one
machine (2 cores, 2026-12-07), with chunks of 1/16 of the vector: the
all-to-all 0.52 -> 0.33 s and the all-gather 0.53 -> 0.32 s unshaped (the
all-reduce 0.46 s); 1.14 -> 0.96 and 1.15 -> 0.97 s at 1 Gbit/s (the
all-reduce 1.77 s).

Only between worker processes, and only on CPUs. There TensorFlow matches
a collective's pieces by its instance key, whatever order the replicas
issue them in; NCCL matches them by launch order (why TensorFlow orders
them at all), so on GPUs these functions issue one ordered collective, as
before. Replicas of one process (logical CPU replicas) exchange by memory
copies, which chunks only multiply: they keep one ordered collective too.
"""

from __future__ import annotations

import tensorflow as tf

from keras_dist._compat import tf_internal

# Chunks are cut at multiples of this many bytes: at such boundaries
# TensorFlow slices and splits along the first axis without copying
# (`IsDim0SliceAligned`, EIGEN_MAX_ALIGN_BYTES with AVX-512).
_ALIGN_BYTES = 64


def applies(strategy) -> bool:
    """Whether this replica's large collectives should go in chunks: the
    strategy's workers are processes, on CPUs (see above). Replicas of one
    process exchange by memory copies, which chunks only multiply (4
    logical replicas on 2 cores: the sharded step went from 1.02x to 1.46x
    of Adam's)."""
    return (
        tf_internal.is_multi_worker(strategy)
        and tf_internal.collective_device_type(strategy) == "CPU"
    )


def _sizes(length: int, chunk_bytes: int, row_bytes: int, dtype) -> list[int]:
    """`length` elements cut into parts of about `chunk_bytes` over all rows
    (`row_bytes` a column), a multiple of `_ALIGN_BYTES` each but the last."""
    align = max(1, _ALIGN_BYTES // dtype.size)
    per = max(align, chunk_bytes // row_bytes // align * align)
    count = max(1, -(-length // per))
    return [per] * (count - 1) + [length - per * (count - 1)]


def add_rows(received, replicas: int, sum_dtype=None):
    """The sum of the `replicas` equal rows of `received` (any shape; its
    elements in row order), cast to `sum_dtype` first, added in row order:
    one pass, where a reduction over the first axis of a short matrix is
    slow on CPUs. Every reduce-scatter sums its rows here (gloo's too: the
    same bits)."""
    # Split along the first axis of a matrix, whose rows TensorFlow hands
    # out without a copy where they are aligned (not of a vector).
    rows = tf.split(tf.reshape(received, [replicas, -1]), replicas)
    if sum_dtype is not None:
        rows = [tf.cast(row, sum_dtype) for row in rows]
    return tf.reshape(tf.add_n(rows) if len(rows) > 1 else rows[0], [-1])


def sum_rows(strategy, flat, sum_dtype=None, chunk_bytes=None):
    """Reduce-scatter of `flat` (replica context): its `i`-th of `N` equal
    rows goes to replica `i`, which sums the rows it receives.

    Args:
        strategy: The strategy whose replica context this is.
        flat: A vector of `N * S` elements, `N` the replica count, static
            shape.
        sum_dtype: `tf.DType` or `None`. The received rows are cast to it
            before the sum. `None`: `flat`'s dtype.
        chunk_bytes: Int or `None`. Cut the rows into chunks of about this
            many bytes (over all rows), issued unordered (only where
            `applies`). `None`: one ordered all-to-all.

    Returns:
        This replica's `[S]` sum, the same whatever the chunking.
    """
    replicas = strategy.num_replicas_in_sync
    columns = int(flat.shape[0]) // replicas

    def summed(part, size, ordered):
        rows = tf.reshape(part, [replicas, size])
        received = tf_internal.all_to_all(strategy, rows, ordered=ordered)
        return add_rows(received, replicas, sum_dtype)

    if chunk_bytes is None:
        return summed(flat, columns, True)
    sizes = _sizes(columns, chunk_bytes, replicas * flat.dtype.size, flat.dtype)
    if len(sizes) == 1:
        return summed(flat, columns, False)
    rows = tf.reshape(flat, [replicas, columns])
    sums = []
    start = 0
    for size in sizes:
        # The chunk's columns of every row: one copy, a block per row.
        part = tf.slice(rows, [0, start], [replicas, size])
        sums.append(summed(part, size, False))
        start += size
    return tf.concat(sums, axis=0)


def gather_rows(strategy, vector, chunk_bytes=None):
    """All-gather of a vector (replica context): every replica's `vector`
    concatenated in replica order.

    Args:
        strategy: The strategy whose replica context this is.
        vector: A `[S]` tensor, static shape.
        chunk_bytes: Int or `None`. Cut it into chunks of about this many
            bytes (over all replicas' copies), gathered unordered (only
            where `applies`). `None`: one ordered all-gather.

    Returns:
        A `[N * S]` tensor, the same whatever the chunking.
    """
    replicas = strategy.num_replicas_in_sync
    if chunk_bytes is None:
        return tf_internal.all_gather(strategy, vector, ordered=True)
    length = int(vector.shape[0])
    sizes = _sizes(length, chunk_bytes, replicas * vector.dtype.size, vector.dtype)
    if len(sizes) == 1:
        return tf_internal.all_gather(strategy, vector, ordered=False)
    gathered = [
        tf_internal.all_gather(strategy, part, ordered=False)
        for part in tf.split(vector, sizes)
    ]
    # Replica by replica, its piece of each chunk: contiguous slices, one copy.
    return tf.concat(
        [
            tf.slice(chunk, [row * size], [size])
            for row in range(replicas)
            for chunk, size in zip(gathered, sizes)
        ],
        axis=0,
    )
