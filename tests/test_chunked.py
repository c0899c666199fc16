"""Large reduce-scatters and all-gathers in unordered chunks
(keras_dist/core/chunked.py). The chunks themselves are checked here on
logical CPU replicas, calling the module directly; between worker processes,
where `collectives` uses them, test_gloo.py's sharded fits on TensorFlow's
collectives equal gloo's to the bit."""

import numpy as np
import pytest
import tensorflow as tf

from keras_dist.core import chunked, collectives

# Not a multiple of the 16-element alignment: the last chunk is shorter.
COLUMNS = 1003


def _per_replica(strategy, fn, values):
    """`fn(this replica's value)` on every replica of `strategy`: the
    results and the traced graph."""
    collectives.own(strategy)

    @tf.function
    def step():
        def replica():
            ctx = tf.distribute.get_replica_context()
            return fn(tf.gather(values, ctx.replica_id_in_sync_group))

        return strategy.run(replica)

    results = strategy.experimental_local_results(step())
    return [r.numpy() for r in results], step.get_concrete_function().graph


def _ops(graph, op_type):
    """`graph`'s ops of `op_type`, of the first replica."""
    return [
        op
        for op in graph.get_operations()
        if op.type == op_type and not op.name.startswith("replica_")
    ]


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("sum_dtype", [None, tf.float32])
def test_chunks_sum_and_gather_what_one_collective_does(mirrored, replicas, sum_dtype):
    strategy = mirrored(replicas)
    rng = np.random.default_rng(0)
    dtype = tf.float32 if sum_dtype is None else tf.float16
    flats = tf.constant(rng.normal(size=(replicas, replicas * COLUMNS)), dtype=dtype)
    # 256 bytes over all rows: chunks of 16 or 32 columns, dozens of them.
    whole, _ = _per_replica(
        strategy, lambda f: chunked.sum_rows(strategy, f, sum_dtype), flats
    )
    pieces, graph = _per_replica(
        strategy,
        lambda f: chunked.sum_rows(strategy, f, sum_dtype, chunk_bytes=256),
        flats,
    )
    expected = np.sum(flats.numpy().astype(np.float32), axis=0).reshape(replicas, -1)
    for replica in range(replicas):
        np.testing.assert_array_equal(pieces[replica], whole[replica])
        np.testing.assert_allclose(pieces[replica], expected[replica], rtol=1e-3)
    assert len(_ops(graph, "CollectiveAllToAllV2")) > 10

    vectors = flats[:, :COLUMNS]
    whole, _ = _per_replica(
        strategy, lambda v: chunked.gather_rows(strategy, v), vectors
    )
    pieces, graph = _per_replica(
        strategy, lambda v: chunked.gather_rows(strategy, v, chunk_bytes=256), vectors
    )
    assert len(_ops(graph, "CollectiveGatherV2")) > 10
    for replica in range(replicas):
        np.testing.assert_array_equal(pieces[replica], whole[replica])
        np.testing.assert_array_equal(pieces[replica], vectors.numpy().reshape(-1))


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


def test_chunks_wait_for_no_other_collective(mirrored):
    # TensorFlow's automatic control dependencies chain a step's collectives
    # in program order (its ordering token); the chunks stay out of that
    # chain, so each runs as soon as its input exists.
    strategy = mirrored(2)
    flats = tf.ones([2, 2 * COLUMNS])

    def two(chunk_bytes):
        def fn(flat):
            first = chunked.sum_rows(strategy, flat, chunk_bytes=chunk_bytes)
            second = chunked.sum_rows(strategy, flat * 2, chunk_bytes=chunk_bytes)
            gathered = chunked.gather_rows(strategy, first, chunk_bytes=chunk_bytes)
            return gathered + tf.tile(second, [2])

        _, graph = _per_replica(strategy, fn, flats)
        return {
            op_type: [_collective_inputs(op) for op in _ops(graph, op_type)]
            for op_type in ("CollectiveAllToAllV2", "CollectiveGatherV2")
        }

    # One piece each: the second all-to-all waits for the first.
    ordered = two(None)
    assert [bool(waits) for waits in ordered["CollectiveAllToAllV2"]] == [False, True]
    unordered = two(256)
    assert len(unordered["CollectiveAllToAllV2"]) > 20
    assert not any(unordered["CollectiveAllToAllV2"])
    # A gathered chunk waits for the all-to-alls whose sum it sends only.
    for waits in unordered["CollectiveGatherV2"]:
        assert waits and all("AllToAll" in name for name in waits)


def test_replicas_of_one_process_keep_one_collective(mirrored):
    # Replicas of one process exchange by memory copies: `collectives`
    # issues one ordered collective whatever `chunk_bytes` says.
    strategy = mirrored(2)
    assert not chunked.applies(strategy)
    flats = tf.ones([2, 2 * COLUMNS])

    def fn(flat):
        local = collectives.reduce_scatter(flat, chunk_bytes=256)
        return collectives.all_gather(local[None], axis=0, chunk_bytes=256)

    values, graph = _per_replica(strategy, fn, flats)
    np.testing.assert_array_equal(values[0], 2 * np.ones([2, COLUMNS]))
    assert len(_ops(graph, "CollectiveAllToAllV2")) == 1
    # The strategy's own all-gather: in one process, not a collective op.
    assert len(_ops(graph, "CollectiveGatherV2")) <= 1
