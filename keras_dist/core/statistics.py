"""`GradientStatistics`: the squared gradient norms behind the noise scale.

The aggregation path (`keras_dist.core.aggregation`) holds both
a replica's own gradient and the all-reduced one. When `GradientStatistics`
are attached to the optimizer (`attach_statistics`, done by
`keras_dist.callbacks.AutoScaleBatch` in adaptive mode), the path records
their squared norms here; `keras_dist.noise_scale` turns them into the
gradient noise scale of McCandlish et al. (2018). This is the TensorFlow
side of that measurement; the arithmetic is framework-free.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from keras_dist.core.collectives import all_reduce
from keras_dist.core.optimizer_view import nested_optimizers

# Optimizer -> its statistics. Kept here, not on the optimizer: an attribute
# would be tracked (and checkpointed) by Keras and tf.Module.
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class GradientStatistics:
    """Running sums of the squared gradient norms behind the noise scale.

    With `R` replicas, each replica's gradient `g_i` comes from a loss that
    Keras scales by `1 / R`, so `R * g_i` estimates the gradient of the mean
    loss over that replica's batch `b` (`b * k` with `k` accumulation
    steps), and the reduced gradient `sum_i g_i` estimates it over the global
    batch `R * b`. After every update `record` adds

    - `mean_i |R g_i|^2`, all-reduced as one scalar (the "small batch"
      squared norm of McCandlish et al., 2018), and
    - `|sum_i g_i|^2`, computed from the reduced gradient every replica
      already holds (the "big batch" squared norm),

    to running sums, in float64, together with the number of updates. The
    sums only grow; readers take differences between two `read()`s. Updates
    whose norms are not finite (a skipped mixed-precision step) are not
    counted.

    The values are reduced values, identical on every replica and worker, so
    decisions taken from them agree everywhere. The variables are
    replica-local (`synchronization=ON_READ`, first-replica aggregation):
    recording costs no communication besides the one scalar, and reading them
    is local.

    Create it under the strategy scope of the model it measures.

    Reference:
        McCandlish, Kaplan, Amodei et al., 2018. "An Empirical Model of
        Large-Batch Training". https://arxiv.org/abs/1812.06162 (appendix A.1).
    """

    def __init__(self):
        def variable(name, dtype):
            return tf.Variable(
                tf.zeros((), dtype),
                trainable=False,
                name=name,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )

        self.local_sq_norm_sum = variable("local_sq_norm_sum", tf.float64)
        self.reduced_sq_norm_sum = variable("reduced_sq_norm_sum", tf.float64)
        self.count = variable("count", tf.int64)

    @property
    def variables(self) -> list:
        """The running sums, for `BackupAndRestore`."""
        return [self.local_sq_norm_sum, self.reduced_sq_norm_sum, self.count]

    def record(self, local_gradients, reduced_gradients):
        """Adds one update's squared norms to the sums (replica context).

        Args:
            local_gradients: List of this replica's gradients, of a loss
                scaled by `1 / num_replicas_in_sync`.
            reduced_gradients: List of the gradients summed over replicas.
        """
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync
        local = _squared_norm(local_gradients) * float(replicas) ** 2
        local = all_reduce(local, op="mean")
        reduced = _squared_norm(reduced_gradients)
        finite = tf.logical_and(tf.math.is_finite(local), tf.math.is_finite(reduced))
        zero = tf.zeros((), tf.float64)
        self.local_sq_norm_sum.assign_add(
            tf.where(finite, tf.cast(local, tf.float64), zero)
        )
        self.reduced_sq_norm_sum.assign_add(
            tf.where(finite, tf.cast(reduced, tf.float64), zero)
        )
        self.count.assign_add(tf.cast(finite, tf.int64))

    def read(self):
        """Returns `(local_sq_norm_sum, reduced_sq_norm_sum, count)` as Python
        numbers (call it eagerly, outside the train step)."""
        return (
            float(self.local_sq_norm_sum.numpy()),
            float(self.reduced_sq_norm_sum.numpy()),
            int(self.count.numpy()),
        )


def _squared_norm(gradients):
    return tf.add_n(
        [
            tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(g), tf.float32)))
            for g in gradients
        ]
    )


def attach_statistics(optimizer, statistics: GradientStatistics) -> None:
    """Makes `reduce_and_apply` record `statistics` for `optimizer`.

    Attached to `optimizer` and every optimizer it wraps, since the path
    receives the inner optimizer of a `GradientAccumulationOptimizer`. Takes
    effect in train functions traced afterwards.
    """
    for nested in nested_optimizers(optimizer):
        _ATTACHED[nested] = statistics


def gradient_statistics(optimizer):
    """Returns the `GradientStatistics` attached to `optimizer`, or `None`."""
    return _ATTACHED.get(optimizer)
