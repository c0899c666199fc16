"""The private pieces of parameter-server training that run in one process.

The real-cluster behaviour is in `test_parameter_server.py`; these pin the
Keras and TensorFlow internals `_compat` relies on, so an upgrade that moves
them fails here, loudly.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import parameter_server_strategy
from tensorflow.python.distribute.sharded_variable import ShardedVariable

from keras_dist._compat import parameter_servers as _compat
from keras_dist.trainer import steps


def _op_types(function, *args):
    graph = function.get_concrete_function(*args).graph
    return {op.type for op in graph.get_operations()}


def test_keras_assign_add_is_still_a_read_and_a_write():
    # The reason for the fix: if Keras makes assign_add atomic itself, the
    # fix is no longer needed (and this test says so).
    variable = keras.Variable(0.0)

    @tf.function
    def add():
        variable.assign_add(1.0)

    assert "AssignAddVariableOp" not in _op_types(add)


def test_traced_with_the_fix_keras_assign_add_and_sub_are_atomic():
    variable = keras.Variable(np.zeros(3, "float32"))

    @tf.function
    def update():
        with _compat.parameter_server_tracing():
            variable.assign_add([1.0, 2.0, 3.0])
            variable.assign_sub([0.5, 0.5, 0.5])

    types = _op_types(update)
    assert {"AssignAddVariableOp", "AssignSubVariableOp"} <= types
    update()
    np.testing.assert_allclose(variable.numpy(), [0.5, 1.5, 2.5])
    # Outside the context Keras's methods are back.
    assert keras.Variable.assign_add is _compat._keras_assign_add
    assert (
        parameter_server_strategy.ParameterServerStrategyExtended._update
        is _compat._ps_update
    )


def test_the_fix_acts_only_on_the_traced_step():
    # A plain Keras model traced in another thread while a parameter-server
    # step traces keeps Keras's read-then-write `assign_add`.
    import threading

    ps_variable = keras.Variable(0.0)
    plain_variable = keras.Variable(0.0)
    inside, traced = threading.Event(), threading.Event()
    seen = {}

    @tf.function
    def ps_step():
        with _compat.parameter_server_tracing():
            ps_variable.assign_add(1.0)
            inside.set()
            # Stay inside while the other thread traces.
            assert traced.wait(60)

    @tf.function
    def plain_step():
        plain_variable.assign_add(1.0)

    def trace_plain():
        assert inside.wait(60)
        seen["plain"] = _op_types(plain_step)
        traced.set()

    other = threading.Thread(target=trace_plain)
    other.start()
    seen["ps"] = _op_types(ps_step)
    other.join(60)
    assert "AssignAddVariableOp" in seen["ps"]
    assert "AssignAddVariableOp" not in seen["plain"]
    assert keras.Variable.assign_add is _compat._keras_assign_add


def test_the_fix_keeps_stateless_scopes_and_integer_variables():
    counter = keras.Variable(0, dtype="int64", trainable=False)
    with _compat.parameter_server_tracing():
        counter.assign_add(2)
        with keras.StatelessScope() as scope:
            counter.assign_add(5)
    assert int(counter.numpy()) == 2
    assert int(scope.get_current_value(counter)) == 7


def test_the_ps_strategy_internals_used_are_there():
    extended = parameter_server_strategy.ParameterServerStrategyExtended
    for name in ("_update", "_select_single_value", "_local_results"):
        assert hasattr(extended, name), name


def test_shards_are_found_and_their_gradients_joined():
    shards = [
        tf.Variable(np.arange(6, dtype="float32").reshape(3, 2)),
        tf.Variable(np.arange(6, 10, dtype="float32").reshape(2, 2)),
    ]
    sharded = ShardedVariable(shards)
    assert _compat.variable_shards(sharded) == shards
    assert _compat.variable_shards(keras.Variable(np.zeros(2))) is None
    full = tf.Variable(tf.concat(shards, axis=0))
    ids = tf.constant([0, 4, 4, 2])
    with tf.GradientTape(persistent=True) as tape:
        sparse_loss = tf.reduce_sum(tf.gather(tf.concat(shards, 0), ids) ** 2)
        dense_loss = tf.reduce_sum(tf.concat(shards, 0) ** 3)
        full_sparse = tf.reduce_sum(tf.gather(full, ids) ** 2)
        full_dense = tf.reduce_sum(full**3)
    joined = steps._join_shard_gradients(tape.gradient(sparse_loss, shards), shards)
    assert isinstance(joined, tf.IndexedSlices)
    np.testing.assert_allclose(
        tf.convert_to_tensor(joined),
        tf.convert_to_tensor(tape.gradient(full_sparse, full)),
    )
    joined = steps._join_shard_gradients(tape.gradient(dense_loss, shards), shards)
    np.testing.assert_allclose(joined, tape.gradient(full_dense, full))
    assert steps._join_shard_gradients([None, None], shards) is None


@pytest.mark.parametrize("steps", [0, -3])
def test_fit_refuses_fewer_than_one_step_per_epoch(steps):
    # Issue 31 B3: checked before the model or the cluster is touched (the
    # multi-process refusal is in test_parameter_server.py).
    from keras_dist.parameter_server import training

    with pytest.raises(
        ValueError,
        match=rf"`steps_per_epoch` must be an int >= 1 or None\. Received: "
        rf"steps_per_epoch={steps} ",
    ):
        training.fit(object(), steps_per_epoch=steps)
