"""Moving a `StateInventory`'s values between the replicas and NumPy arrays.

Variables that every replica holds alike (mirrored) are read once.
Variables that each replica keeps for itself (per replica: accumulators,
residuals, metric sums) are read per replica: on several workers their
local copies are gathered to every worker with one all-gather, so the chief
alone can write the backup, and each replica gets its own copy back on
restore. Restoring them as a sum split in equal shares (what a Keras
checkpoint does) would change every compressed all-reduce after the
restart.
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
    for index, entry in enumerate(inventory):
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
    base, local = worker_layout(strategy)
    if replicas == local:
        return [np.stack(arrays) for arrays in parts]
    # One collective for everything: each replica's arrays as bytes, padded
    # to whole float64 words (a gather moves bits; it does no arithmetic).
    buffers = [b"".join(arrays[j].tobytes() for arrays in parts) for j in range(local)]
    size = len(buffers[0])
    words = -(-size // 8)
    local_words = [
        np.frombuffer(buffer + b"\0" * (words * 8 - size), dtype=np.float64)
        for buffer in buffers
    ]

    def value_fn(context):
        return tf.constant(local_words[context.replica_id_in_sync_group - base])[None]

    distributed = strategy.experimental_distribute_values_from_function(value_fn)
    gathered = collectives.gather_across(strategy, distributed).numpy()
    result = [[] for _ in parts]
    for replica in range(replicas):
        raw = gathered[replica].tobytes()[:size]
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
            entry.variable.assign(value)
