"""Moving a `StateInventory`'s values between the replicas and NumPy arrays.

Variables that every replica holds alike (mirrored) are read once.
Variables that each replica keeps for itself (per replica: accumulators,
residuals, metric sums) are read per replica: on several workers their
local copies are gathered to every worker with one all-gather, so the chief
alone can write the backup, and each replica gets its own copy back on
restore. Restoring them as a sum split in equal shares (what a Keras
checkpoint does) would change every compressed all-reduce after the
restart. Owned state (one replica holds it whole: the optimizer state under
`ShardedOptimizer(..., shard_by="variables")`) is read where it lives; on
several workers every replica's owned values travel in the same all-gather.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_dist.core import collectives
from keras_dist.core.topology import worker_layout


def read_values(inventory, strategy) -> list[np.ndarray]:
    """Returns each entry's value; per-replica entries as `[replicas, ...]`.

    On several workers this is a collective (one all-gather): every worker
    must call it at the same point.
    """
    return materialize(snapshot_values(inventory, strategy))


class _Stacked(tuple):
    """One replica's tensors of a per-replica entry, stacked by `materialize`."""


def snapshot_values(inventory, strategy) -> list:
    """`read_values` without the copies: what each entry holds now.

    A variable read gives a tensor that the training steps after it do not
    change (TensorFlow copies a variable's buffer on its next update while
    a read of it is alive), in time independent of its size. `materialize`
    turns the snapshot into NumPy arrays later, on another thread if need
    be. Per-replica entries on several workers are gathered here (a
    collective every worker must call at the same point).

    Returns:
        A list, one item per entry, for `materialize`.
    """
    values: list = [None] * len(inventory)
    several_workers = strategy.num_replicas_in_sync != worker_layout(strategy)[1]
    local_parts = []  # (index, [array per local replica])
    owned = []  # indices of owned entries, read from their owners
    for index, entry in enumerate(inventory):
        if entry.owned:
            if several_workers:
                owned.append(index)
            else:
                values[index] = entry.variable.read()
            continue
        if not entry.per_replica:
            values[index] = _read(entry.variable)
            continue
        components = strategy.experimental_local_results(entry.variable)
        if several_workers:
            local_parts.append((index, [np.asarray(c.numpy()) for c in components]))
        else:
            values[index] = _Stacked(_read(c) for c in components)
    if local_parts:
        for index, stacked in zip(
            (i for i, _ in local_parts),
            gather_per_replica([p for _, p in local_parts], strategy),
        ):
            values[index] = stacked
    if owned:
        for index, value in zip(owned, _gather_owned(inventory, owned, strategy)):
            values[index] = value
    return values


def _gather_owned(inventory, indices, strategy) -> list[np.ndarray]:
    """The owned entries' values from their owners, on every worker: each
    replica's owned values as one buffer (padded to the longest), one
    all-gather."""
    base, local = worker_layout(strategy)
    entries = [inventory.entries[i] for i in indices]
    mine = [[] for _ in range(local)]
    for entry in entries:
        if base <= entry.variable.owner < base + local:
            value = np.asarray(entry.variable.read().numpy())
            mine[entry.variable.owner - base].append(value.tobytes())
    buffers = [b"".join(parts) for parts in mine]
    gathered = _gather_bytes(buffers, strategy)
    offsets = [0] * len(gathered)
    values = []
    for entry in entries:
        owner = entry.variable.owner
        size = entry.dtype.size * int(np.prod(entry.shape, dtype=np.int64))
        raw = gathered[owner][offsets[owner] : offsets[owner] + size]
        offsets[owner] += size
        values.append(
            np.frombuffer(raw, dtype=entry.dtype.as_numpy_dtype)
            .reshape(entry.shape)
            .copy()
        )
    return values


def materialize(snapshot: list) -> list[np.ndarray]:
    """The NumPy arrays of a `snapshot_values` result (copies)."""
    return [
        np.stack([np.asarray(part) for part in value])
        if isinstance(value, _Stacked)
        else np.asarray(value)
        for value in snapshot
    ]


def _read(variable):
    # `read_value` of a mirrored variable in cross-replica context reads
    # the first replica's copy, as `numpy()` does.
    return variable.read_value()


def gather_per_replica(parts: list[list[np.ndarray]], strategy) -> list[np.ndarray]:
    """All-gathers per-replica arrays: returns one `[replicas, ...]` each."""
    replicas = strategy.num_replicas_in_sync
    _, local = worker_layout(strategy)
    if replicas == local:
        return [np.stack(arrays) for arrays in parts]
    buffers = [b"".join(arrays[j].tobytes() for arrays in parts) for j in range(local)]
    gathered = _gather_bytes(buffers, strategy, size=len(buffers[0]))
    result = [[] for _ in parts]
    for replica in range(replicas):
        raw = gathered[replica]
        offset = 0
        for k, arrays in enumerate(parts):
            reference = arrays[0]
            length = reference.nbytes
            result[k].append(
                np.frombuffer(raw[offset : offset + length], dtype=reference.dtype)
                .reshape(reference.shape)
                .copy()
            )
            offset += length
    return [np.stack(arrays) for arrays in result]


def _gather_bytes(buffers: list[bytes], strategy, size=None) -> list[bytes]:
    """All-gathers one byte string per local replica; returns every
    replica's, each as long as the longest (zero-padded at its end).

    The strings travel padded to whole float64 words (a gather moves bits;
    it does no arithmetic), after a gather of their lengths unless `size`
    gives the length of every replica's (the same on every worker).
    """
    base, _ = worker_layout(strategy)

    def gather(local_rows):
        def value_fn(context):
            return tf.constant(local_rows[context.replica_id_in_sync_group - base])[
                None
            ]

        distributed = strategy.experimental_distribute_values_from_function(value_fn)
        return collectives.gather_across(strategy, distributed).numpy()

    if size is None:
        size = int(gather([np.array([len(b)], np.int64) for b in buffers]).max())
    words = -(-size // 8)
    rows = [
        np.frombuffer(b + b"\0" * (words * 8 - len(b)), dtype=np.float64)
        for b in buffers
    ]
    return [row.tobytes() for row in gather(rows)]


def assign_values(inventory, values: list, strategy) -> None:
    """Gives every entry its saved value; each replica its own copy.

    An entry whose value is `None` is left as it is.
    """
    base, _ = worker_layout(strategy)
    for entry, value in zip(inventory, values):
        if value is None:
            continue
        if entry.per_replica:
            components = strategy.experimental_local_results(entry.variable)
            for offset, component in enumerate(components):
                component.assign(value[base + offset])
        else:
            # Owned state: its handle assigns where this process holds it.
            entry.variable.assign(value)
