"""Large reduce-scatters and all-gathers in unordered chunks on CPUs
(keras_dist/core/chunked.py), on logical CPU replicas."""

import numpy as np
import pytest
import tensorflow as tf

from keras_dist.core import collectives

# Not a multiple of the 16-element alignment: the last chunk is shorter.
COLUMNS = 1003


def _per_replica(strategy, fn, values):
    """`fn(this replica's value)` on every replica of `strategy`."""

    @tf.function
    def step():
        def replica():
            ctx = tf.distribute.get_replica_context()
            return fn(tf.gather(values, ctx.replica_id_in_sync_group))

        return strategy.run(replica)

    results = strategy.experimental_local_results(step())
    return [r.numpy() for r in results], step.get_concrete_function().graph


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("sum_dtype", [None, tf.float32])
def test_chunks_sum_and_gather_what_one_collective_does(mirrored, replicas, sum_dtype):
    strategy = mirrored(replicas)
    rng = np.random.default_rng(0)
    dtype = tf.float32 if sum_dtype is None else tf.float16
    flats = tf.constant(rng.normal(size=(replicas, replicas * COLUMNS)), dtype=dtype)
    # 256 bytes over all rows: chunks of 16 or 32 columns, dozens of them.
    whole, _ = _per_replica(
        strategy, lambda f: collectives.reduce_scatter(f, sum_dtype), flats
    )
    chunked, graph = _per_replica(
        strategy,
        lambda f: collectives.reduce_scatter(f, sum_dtype, chunk_bytes=256),
        flats,
    )
    expected = np.sum(flats.numpy().astype(np.float32), axis=0).reshape(replicas, -1)
    for replica in range(replicas):
        np.testing.assert_array_equal(chunked[replica], whole[replica])
        np.testing.assert_allclose(chunked[replica], expected[replica], rtol=1e-3)
    all_to_alls = [
        op for op in graph.get_operations() if op.type == "CollectiveAllToAllV2"
    ]
    assert len(all_to_alls) > 10 * replicas

    pieces = flats[:, :COLUMNS]
    whole, _ = _per_replica(
        strategy, lambda p: collectives.all_gather(p[None], axis=0), pieces
    )
    chunked, _ = _per_replica(
        strategy,
        lambda p: collectives.all_gather(p[None], axis=0, chunk_bytes=256),
        pieces,
    )
    for replica in range(replicas):
        np.testing.assert_array_equal(chunked[replica], whole[replica])
        np.testing.assert_array_equal(chunked[replica], pieces.numpy())


def _collective_inputs(op):
    """The collectives `op` waits for, by data or control edge, transitively."""
    seen, stack, found = set(), [op], set()
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent in seen:
                continue
            seen.add(parent)
            if parent.type.startswith("Collective"):
                found.add(parent.name)
            stack.append(parent)
    return found


def test_chunks_wait_for_no_other_collective_on_cpus(mirrored):
    # TensorFlow's automatic control dependencies chain a step's collectives
    # in program order (its ordering token); the chunks stay out of that
    # chain, so each runs as soon as its input exists.
    strategy = mirrored(2)
    flats = tf.ones([2, 2 * COLUMNS])

    def both(flat):
        local = collectives.reduce_scatter(flat, chunk_bytes=256)
        return collectives.all_gather(local[None], axis=0, chunk_bytes=256)

    _, graph = _per_replica(strategy, both, flats)
    chunks = [
        op
        for op in graph.get_operations()
        if op.type in ("CollectiveAllToAllV2", "CollectiveGatherV2")
        and not op.name.startswith("replica_1")
    ]
    assert len(chunks) > 20
    for op in chunks:
        if op.type == "CollectiveAllToAllV2":
            assert _collective_inputs(op) == set(), op.name
        else:
            # An all-gather waits for the all-to-alls whose sums it sends.
            assert {
                name for name in _collective_inputs(op) if "Gather" in name
            } == set(), op.name

    # Two reduce-scatters: without chunks the second waits for the first
    # (program order); in chunks neither waits for the other.
    def two(chunk_bytes):
        def fn(flat):
            first = collectives.reduce_scatter(flat, chunk_bytes=chunk_bytes)
            second = collectives.reduce_scatter(flat * 2, chunk_bytes=chunk_bytes)
            return first + second

        _, graph = _per_replica(strategy, fn, flats)
        return [
            _collective_inputs(op)
            for op in graph.get_operations()
            if op.type == "CollectiveAllToAllV2" and not op.name.startswith("replica_1")
        ]

    assert [bool(waits) for waits in two(None)] == [False, True]
    waits = two(256)
    assert len(waits) > 20 and not any(waits)
