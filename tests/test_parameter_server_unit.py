"""The private pieces of parameter-server training that run in one process.

The real-cluster behaviour is in `test_parameter_server.py`; these pin the
Keras and TensorFlow internals `_compat` relies on, so an upgrade that moves
them fails here, loudly.
"""

import io
import sys
import textwrap

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import parameter_server_strategy
from tensorflow.python.distribute.sharded_variable import ShardedVariable

from keras_dist import _compat, _process, models


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
    joined = models._join_shard_gradients(tape.gradient(sparse_loss, shards), shards)
    assert isinstance(joined, tf.IndexedSlices)
    np.testing.assert_allclose(
        tf.convert_to_tensor(joined),
        tf.convert_to_tensor(tape.gradient(full_sparse, full)),
    )
    joined = models._join_shard_gradients(tape.gradient(dense_loss, shards), shards)
    np.testing.assert_allclose(joined, tape.gradient(full_dense, full))
    assert models._join_shard_gradients([None, None], shards) is None


def _task(name, code):
    return _process.TaskSpec(name, [sys.executable, "-c", textwrap.dedent(code)], {})


def test_launcher_restarts_a_lost_worker_in_place_then_goes_on_without_it(tmp_path):
    """The launcher's part of a parameter-server job surviving its workers."""
    out, messages = io.StringIO(), []
    chief_may_exit = tmp_path / "done"
    runs = tmp_path / "runs"
    specs = [
        _task(
            "chief:0",
            f"""
            import os, time
            while not os.path.exists({str(chief_may_exit)!r}):
                time.sleep(0.02)
            time.sleep(1.5)  # the launcher sees worker:1's exit first
            """,
        ),
        _task("worker:0", "import time; time.sleep(60)"),
        # worker:1 fails at once, every time; the second failure, with no
        # restart left, lets the chief finish.
        _task(
            "worker:1",
            f"""
            import os, sys
            with open({str(runs)!r}, "a") as file:
                file.write("run\\n")
            if open({str(runs)!r}).read().count("run") == 2:
                open({str(chief_may_exit)!r}, "w").close()
            sys.exit(9)
            """,
        ),
    ]

    status = _process.run_tasks(
        specs,
        out,
        messages.append,
        grace_period=1.0,
        coordinator="chief:0",
        replaceable=["worker:0", "worker:1"],
        restarts=1,
    )

    assert status == 0, messages
    assert runs.read_text().count("run") == 2
    assert messages[:2] == [
        "task worker:1 failed with exit code 9; started it again in place (the "
        "coordinator retries its steps); 0 restart(s) left.",
        "task worker:1 failed with exit code 9; the coordinator retries its "
        "steps on worker:0.",
    ]
    assert messages[2:] == [
        "chief:0 (the coordinator) finished; stopping the 1 worker task(s) still "
        "serving."
    ]


def test_launcher_stops_when_no_worker_is_left():
    messages = []
    specs = [
        _task("chief:0", "import time; time.sleep(60)"),
        _task("worker:0", "import sys; sys.exit(4)"),
    ]
    status = _process.run_tasks(
        specs,
        io.StringIO(),
        messages.append,
        grace_period=1.0,
        coordinator="chief:0",
        replaceable=["worker:0"],
    )
    assert status == 4
    assert messages == [
        "task worker:0 failed with exit code 4 and no worker is left; stopping "
        "the other tasks."
    ]
