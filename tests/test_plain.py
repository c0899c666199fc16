"""NoCompression (`keras_dist.core.plain`): the exact sum, dense and sparse.

What every hook shares (byte accounting, bad input, sparse gradients, the
config) is in `test_hooks.py`.
"""

import numpy as np
import tensorflow as tf
from helpers import (
    LAYER_SHAPES,
    Harness,
    assert_same_on_replicas,
    exact_sum,
    random_grads,
)

from keras_dist.compression import NoCompression


def test_no_compression_is_the_exact_sum(mirrored):
    grads = random_grads(LAYER_SHAPES, 2)
    results = Harness(mirrored(2), NoCompression(), LAYER_SHAPES).reduce(grads)
    assert_same_on_replicas(results)
    for got, want in zip(results, exact_sum(grads)):
        np.testing.assert_array_equal(got[0], want)


def test_no_compression_sums_sparse_gradients_over_replicas(mirrored):
    strategy = mirrored(2)
    with strategy.scope():
        variables = [tf.Variable(tf.zeros((6, 4)))]
        hook = NoCompression()
        hook.build(variables)

    def step():
        ctx = tf.distribute.get_replica_context()
        row = tf.cast(ctx.replica_id_in_sync_group, tf.int64)
        sparse = tf.IndexedSlices(tf.ones((1, 4)), tf.reshape(row, [1]), [6, 4])
        (reduced,) = hook.reduce([sparse], variables)
        assert isinstance(reduced, tf.IndexedSlices)
        return tf.convert_to_tensor(reduced)

    result = strategy.experimental_local_results(strategy.run(tf.function(step)))
    expected = np.zeros((6, 4), "float32")
    expected[:2] = 1.0
    for value in result:
        np.testing.assert_allclose(value.numpy(), expected)
