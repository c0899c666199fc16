"""A step's global logs under several workers in one collective.

Under `MultiWorkerMirroredStrategy` reading a metric's state across
replicas is a collective per variable (`SyncOnReadVariable`'s cross-replica
read), and averaging each other log value is another: 5 small all-reduces
for loss and accuracy, each a round trip between the workers. Here every
replica sums its local metric variables and log values into one flat
vector per dtype (`core.collectives.all_reduce_flat`), once, and the
metrics' results are computed from the sums with Keras's public
`Metric.stateless_result`: the values of a cross-replica read, from one
all-reduce.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_dist.core import collectives

# The aggregations a sum over replicas reproduces: "sum" as is, "mean" divided
# by the replica count. ("only_first_replica" and "none" keep the reads.)
_PACKABLE = ("sum", "mean")


def one_collective(model, outputs):
    """The metrics' global results and the log values' means, in one sum.

    Args:
        model: The `DistributedModel` (cross-replica context, its strategy's
            scope).
        outputs: The step's per-replica outputs (a structure of tensors).

    Returns:
        `(metrics, means)`: the flattened results of `model.metrics` as a
        cross-replica read gives them, and a dict from `id(value)` to the
        mean over replicas of every floating tensor of a static shape in
        `outputs` (the caller reduces any other itself); or `None`
        when some state cannot be read this way (the caller reads it as
        Keras does): a metric variable that is not per replica, not
        floating, or aggregated otherwise than by sum or mean, or a
        `get_metrics_result` of the user's own.
    """
    if type(model).get_metrics_result is not keras.Model.get_metrics_result:
        return None
    metrics = list(model.metrics)
    variables = [variable for metric in metrics for variable in metric.variables]
    if not all(_packable(variable) for variable in variables):
        return None
    strategy = model.distribute_strategy
    leaves = [value for value in tf.nest.flatten(outputs) if _packable_value(value)]
    collectives.own(strategy)

    def local_sums(leaves):
        # Replica context: a per-replica variable reads its own copy here.
        values = [tf.convert_to_tensor(variable.value) for variable in variables]
        return collectives.all_reduce_flat([*values, *leaves])

    summed = strategy.run(local_sums, args=(leaves,))
    summed = [strategy.experimental_local_results(value)[0] for value in summed]
    replicas = strategy.num_replicas_in_sync
    states = [
        _mean(value, replicas) if variable.aggregation == "mean" else value
        for variable, value in zip(variables, summed)
    ]
    means = {
        id(leaf): _mean(value, replicas)
        for leaf, value in zip(leaves, summed[len(variables) :])
    }
    results = {}
    start = 0
    for metric in metrics:
        count = len(metric.variables)
        result = metric.stateless_result(states[start : start + count])
        start += count
        if isinstance(result, dict):
            results.update(result)
        else:
            results[metric.name] = result
    return flatten_logs(results), means


def _packable_value(value) -> bool:
    """A floating tensor of a static shape (or per-replica ones)."""
    if isinstance(value, tf.distribute.DistributedValues):
        value = value.values[0]
    return (
        tf.is_tensor(value)
        and value.dtype.is_floating
        and value.shape.is_fully_defined()
    )


def _mean(total, replicas):
    return total / tf.cast(replicas, total.dtype)


def _packable(variable) -> bool:
    value = getattr(variable, "value", variable)
    return (
        getattr(value, "synchronization", None) == tf.VariableSynchronization.ON_READ
        and isinstance(value, tf.distribute.DistributedValues)
        and tf.as_dtype(variable.dtype).is_floating
        and variable.aggregation in _PACKABLE
    )


def flatten_logs(logs) -> dict:
    """Nested dicts of logs as one flat dict (as Keras flattens them)."""
    flat = {}
    for key, value in logs.items():
        if isinstance(value, dict):
            flat.update(flatten_logs(value))
        else:
            flat[key] = value
    return flat
