"""A last batch that does not split evenly over replicas trains exactly.

Keras scales each replica's mean loss by `1 / R`: with unequal per-replica
batches (the last batch of almost every dataset) the update is the mean of
the replicas' means, not the mean over the global batch, and stock Keras
drifts from one device. `DistributedModel` weights each replica by its share
of the batch (and counts examples when accumulating), so the weights equal
one device's.
"""

import keras
import pytest
import workers
from helpers import max_abs_diff, uneven_data, uneven_model

from keras_dist.testing import run_workers

TOLERANCE = 1e-6
EPOCHS = 2
CASES = [(3, 3), (5, 4), (1001, 64)]


def one_device(examples, batch, accumulation_steps=1):
    x, y = uneven_data(examples)
    model = uneven_model(accumulation_steps)
    model.fit(x, y, batch_size=batch, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


def on_replicas(strategy, examples, batch, accumulation_steps=1):
    x, y = uneven_data(examples)
    with strategy.scope():
        model = uneven_model(accumulation_steps)
    model.fit(x, y, batch_size=batch, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.mark.parametrize("accumulation_steps", [1, 2])
@pytest.mark.parametrize(("examples", "batch"), CASES)
def test_uneven_last_batch_equals_one_device(
    examples, batch, accumulation_steps, mirrored
):
    expected = one_device(examples, batch, accumulation_steps)
    got = on_replicas(mirrored(2), examples, batch, accumulation_steps)
    assert max_abs_diff(expected, got) <= TOLERANCE


def test_stock_keras_drifts_where_distributed_model_does_not(mirrored):
    # The defect being fixed, measured on stock Keras: 1001 examples in
    # batches of 64 on 2 replicas; the last batch (41) splits 21 + 20.
    x, y = uneven_data(1001)
    reference = uneven_model(cls=keras.Model)
    reference.fit(x, y, batch_size=64, epochs=EPOCHS, shuffle=False, verbose=0)
    with mirrored(2).scope():
        stock = uneven_model(cls=keras.Model)
    stock.fit(x, y, batch_size=64, epochs=EPOCHS, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), stock.get_weights()) > 1e-5
    got = on_replicas(mirrored(2), 1001, 64)
    assert max_abs_diff(reference.get_weights(), got) <= TOLERANCE


def test_accumulation_is_the_mean_over_examples():
    # 1001 examples in micro-batches of 64 (the 16th holds 41), 2 per
    # update: each update is one big batch of the same examples.
    x, y = uneven_data(1001)
    big = uneven_model(cls=keras.Model)
    big.fit(x, y, batch_size=128, epochs=EPOCHS, shuffle=False, verbose=0)
    accumulated = one_device(1001, 64, accumulation_steps=2)
    assert max_abs_diff(big.get_weights(), accumulated) <= TOLERANCE


def test_four_replicas_with_an_empty_replica(mirrored):
    # A global batch of 3 on 4 replicas leaves one replica without examples.
    expected = one_device(7, 4)
    got = on_replicas(mirrored(4), 7, 4)
    assert max_abs_diff(expected, got) <= TOLERANCE


@pytest.mark.multiworker
def test_uneven_last_batch_in_two_worker_processes():
    cases = [(3, 3, 1), (5, 4, 1), (1001, 64, 1), (3, 3, 2), (5, 4, 2), (1001, 64, 2)]
    results = run_workers(workers.uneven_fit, num_workers=2, args=(cases,), timeout=400)
    for index, (examples, batch, steps) in enumerate(cases):
        expected = one_device(examples, batch, steps)
        for worker in results:
            assert max_abs_diff(expected, worker[index]) <= TOLERANCE, (
                examples,
                batch,
                steps,
            )


def test_equal_batches_pass_gradients_through_bit_for_bit(mirrored):
    # Weight 1 (equal batches): the gradient itself, NaN and -0.0 included,
    # with no product on the way to the all-reduce; unequal batches: the
    # weighted product, and zeros for an empty replica.
    import numpy as np
    import tensorflow as tf

    from keras_dist.core import aggregation

    strategy = mirrored(2)
    gradient = tf.constant([1.5, -0.0, np.nan, 3.0])

    @tf.function
    def weighted(sizes):
        def step():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            (out,) = aggregation.weight_by_batch_share([gradient], sizes[replica])
            return out

        return strategy.run(step)

    def per_replica(sizes):
        result = weighted(tf.constant(sizes))
        return [t.numpy() for t in strategy.experimental_local_results(result)]

    for got in per_replica([4, 4]):
        assert got.tobytes() == gradient.numpy().tobytes()
    first, second = per_replica([3, 1])
    np.testing.assert_array_equal(first[[0, 1, 3]], [2.25, 0.0, 4.5])
    np.testing.assert_array_equal(second[[0, 1, 3]], [0.75, 0.0, 1.5])
    first, second = per_replica([2, 0])
    assert np.isnan(first[2])
    np.testing.assert_array_equal(second, [0.0, 0.0, 0.0, 0.0])
