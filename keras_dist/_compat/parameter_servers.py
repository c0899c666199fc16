"""Private Keras 3 and TensorFlow touches that a parameter-server `fit` needs.

Split from `keras_src.py` (the rest of the Keras 3 front end's touches):
these two fixes patch Keras's variable class and TensorFlow's
`ParameterServerStrategyExtended` while a parameter-server step function is
traced, and nothing else uses them. `tests/test_parameter_server_unit.py`
tests them, and `tests/test_parameter_server.py` trains through them.
"""

from __future__ import annotations

import contextlib
import threading

import keras
import tensorflow as tf
from keras.src.backend.common.stateless_scope import (
    in_stateless_scope as _in_stateless_scope,
)
from tensorflow.python.distribute import (
    distribute_lib as _distribute_lib,
)
from tensorflow.python.distribute import (
    parameter_server_strategy as _ps_strategy,
)
from tensorflow.python.distribute.sharded_variable import (
    ShardedVariable as _ShardedVariable,
)

# Both replacements are installed and removed under this lock.
_patch_lock = threading.Lock()

# Keras 3's `Variable.assign_add`/`assign_sub` are `assign(self + value)`
# (keras/src/backend/common/variables.py): a read, then a write. Under
# ParameterServerStrategy several workers update the same ps variable at once,
# so that loses updates: measured here, 2 workers x 100 steps left the
# optimizer's `iterations` at 83 and the metric sums short. tf_keras used the
# variable's own atomic `assign_add`. While the step functions of a
# parameter-server `fit` are traced, Keras variables do the same.
_KerasVariable = keras.Variable
_keras_assign_add = _KerasVariable.assign_add
_keras_assign_sub = _KerasVariable.assign_sub


def _atomic_assign_add(self, value):
    if _in_stateless_scope() or not isinstance(self._value, tf.Variable):
        return _keras_assign_add(self, value)
    value = self._convert_to_tensor(value, dtype=self._dtype)
    return self._value.assign_add(value)


def _atomic_assign_sub(self, value):
    if _in_stateless_scope() or not isinstance(self._value, tf.Variable):
        return _keras_assign_sub(self, value)
    value = self._convert_to_tensor(value, dtype=self._dtype)
    return self._value.assign_sub(value)


# Keras's TF optimizer applies each gradient through
# `strategy.extended.update(variable, ...)`, which under parameter servers
# colocates the update with the variable; a `ShardedVariable` (split by a
# `variable_partitioner`) "doesn't support being used as a reference", so
# Keras 3 cannot update one. Its update runs without colocation instead: each
# shard's assignment still runs on that shard's ps task.

_PSExtended = _ps_strategy.ParameterServerStrategyExtended
_ps_update = _PSExtended._update


def _update_sharded_too(self, var, fn, args, kwargs, group):
    shards = variable_shards(var)
    if shards is None:
        return _ps_update(self, var, fn, args, kwargs, group)
    with _distribute_lib.UpdateContext(shards[0].device):
        result = fn(
            var,
            *self._select_single_value(args),
            **self._select_single_value(kwargs),
        )
    if group:
        return result
    return tf.nest.map_structure(self._local_results, result)


# The graphs of the parameter-server step functions being traced: the
# replacements below are installed while any is, and act only on ops added to
# those graphs (or to a graph nested in one: a loop body, a cond branch). The
# graph, not the thread: `strategy.run` traces the step in replica threads of
# its own, while another thread tracing a plain Keras model at the same time
# builds another graph and gets Keras's own methods. Eagerly (no graph being
# built), the thread that entered decides.
_tracing_graphs: set = set()
_tracing_eagerly = threading.local()
_tracing_count = [0]


def _in_parameter_server_step() -> bool:
    if tf.executing_eagerly():
        return getattr(_tracing_eagerly, "depth", 0) > 0
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if id(graph) in _tracing_graphs:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def _in_step_only(replacement, original):
    def method(self, *args, **kwargs):
        if _in_parameter_server_step():
            return replacement(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return method


@contextlib.contextmanager
def parameter_server_tracing():
    """Traces parameter-server step functions with the two fixes above.

    Keras variables' `assign_add`/`assign_sub` become single atomic ops, and
    partitioned variables can be updated, **in the function being traced
    only** (its graph and the graphs nested in it, whichever thread adds to
    them): a plain Keras model traced meanwhile in another thread gets
    Keras's own methods. Used inside the step functions; the traced graph
    keeps the ops.
    """
    eager = tf.executing_eagerly()
    graph = None if eager else tf.compat.v1.get_default_graph()
    with _patch_lock:
        if _tracing_count[0] == 0:
            _KerasVariable.assign_add = _in_step_only(
                _atomic_assign_add, _keras_assign_add
            )
            _KerasVariable.assign_sub = _in_step_only(
                _atomic_assign_sub, _keras_assign_sub
            )
            _PSExtended._update = _in_step_only(_update_sharded_too, _ps_update)
        _tracing_count[0] += 1
        if eager:
            _tracing_eagerly.depth = getattr(_tracing_eagerly, "depth", 0) + 1
            added = False
        else:
            added = id(graph) not in _tracing_graphs
            _tracing_graphs.add(id(graph))
    try:
        yield
    finally:
        with _patch_lock:
            if eager:
                _tracing_eagerly.depth -= 1
            elif added:
                _tracing_graphs.discard(id(graph))
            _tracing_count[0] -= 1
            if _tracing_count[0] == 0:
                _KerasVariable.assign_add = _keras_assign_add
                _KerasVariable.assign_sub = _keras_assign_sub
                _PSExtended._update = _ps_update


def parameter_server_workers(strategy) -> int:
    """Number of workers of a `ParameterServerStrategy`.

    Its `cluster_resolver` property is `None`; the count is kept in
    `extended._num_workers`.
    """
    return int(strategy.extended._num_workers)


def variable_shards(variable) -> list | None:
    """The shards of a Keras variable that a partitioner split, else `None`.

    Under `ParameterServerStrategy(variable_partitioner=...)` a Keras variable
    wraps a TensorFlow `ShardedVariable` (split along axis 0 across the ps
    tasks). Keras 3 does not know it: `tape.gradient` asks it for a `handle`
    it has not. Gradients are taken with respect to the shards instead.
    """
    value = variable._value if isinstance(variable, _KerasVariable) else variable
    if isinstance(value, _ShardedVariable):
        return list(value.variables)
    return None
