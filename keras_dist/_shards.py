"""`ShardedOptimizer`'s bookkeeping: the layout's variables, clipping, decay
masks, the gathered weights' assignment and the sharded loss scaling.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_dist._compat import keras_src as _compat
from keras_dist.core import aggregation, sharding


class Shards:
    """One built `ShardedOptimizer`'s layout and what it derives from it."""

    def __init__(self, layout, variables, base, strategy):
        self.layout = layout
        self.variables = list(variables)
        self.strategy = strategy
        self._index = {id(v): i for i, v in enumerate(self.variables)}
        # NumPy, made into constants where used: the optimizer can be built
        # inside one traced function and used in another. Per-element arrays
        # (4 bytes per parameter) only where needed: a variable index for
        # `clipnorm` (made on first use), a mask for weight decay with
        # exclusions (decaying everything needs none: padding stays zero).
        self._segments = None
        self._base = base
        decayed = [_compat.uses_weight_decay(base, v) for v in self.variables]
        if not any(decayed):
            self._decay = None
        elif all(decayed):
            self._decay = 1.0
        else:
            self._decay = layout.element_mask(decayed)

    def in_order(self, grads, variables) -> list:
        """Gradients in the layout's order; `None` and missing ones as zeros."""
        by_index = {}
        for grad, variable in zip(grads, variables):
            index = self._index.get(id(variable))
            if index is None:
                raise ValueError(
                    f"Variable {getattr(variable, 'path', variable.name)!r} was "
                    "not known to the ShardedOptimizer when it was built. Build "
                    "it on all trainable variables (compile the model, or "
                    "`optimizer.build(model.trainable_variables)`)."
                )
            if grad is not None:
                by_index[index] = aggregation.as_gradient(grad)
        if not by_index:
            raise ValueError("No gradients provided for any variable.")
        return [
            tf.convert_to_tensor(by_index[i])
            if i in by_index
            else tf.zeros(v.shape, v.dtype)
            for i, v in enumerate(self.variables)
        ]

    def local_decay_mask(self, replica):
        if self._decay is None or isinstance(self._decay, float):
            return self._decay
        return self.layout.local(self._decay, replica)

    def clipped(self, local, replica):
        """The inner optimizer's clipping, on the summed gradient's slices."""
        base = self._base
        if base.clipvalue:
            local = tf.clip_by_value(local, -base.clipvalue, base.clipvalue)
        if base.clipnorm:
            if self._segments is None:
                self._segments = self.layout.segment_ids()
            segments = self.layout.local(self._segments, replica)
            norms = sharding.per_variable_norms(self.layout, local, segments)
            factors = base.clipnorm / tf.maximum(norms, base.clipnorm)
            local = local * tf.cast(tf.gather(factors, segments), local.dtype)
        if base.global_clipnorm:
            norm = sharding.global_norm(local)
            factor = base.global_clipnorm / tf.maximum(norm, base.global_clipnorm)
            local = local * tf.cast(factor, local.dtype)
        return local

    def assign(self, values) -> None:
        """Every model variable its gathered value (cross-replica update)."""

        def update_all(strategy, values):
            for variable, value in zip(self.variables, values):
                strategy.extended.update(
                    tf_variable(variable), _assign, args=(value,), group=False
                )
                if getattr(variable, "constraint", None) is not None:
                    strategy.extended.update(
                        tf_variable(variable),
                        lambda v, c=variable.constraint: v.assign(c(v)),
                        group=False,
                    )

        tf.distribute.get_replica_context().merge_call(update_all, args=(values,))


def _assign(variable, value):
    return variable.assign(tf.cast(value, variable.dtype))


def update_loss_scale(scaler, finite, update, local):
    """`LossScaleOptimizer`'s dynamic loss scaling, on the global decision.

    The scaler's own `apply` decides from the first replica's gradients
    before any reduction; here the decision is the all-reduced count of
    non-finite entries of every slice. The same rule as
    keras/src/optimizers/loss_scale_optimizer.py: a finite step updates and
    doubles the scale every `dynamic_growth_steps` finite steps; a
    non-finite one skips the update and halves the scale.
    """

    def cross_replica(strategy, finite, local):
        finite = strategy.experimental_local_results(finite)[0]

        def on_finite():
            strategy.extended.call_for_each_replica(update, args=(local,))
            count = scaler.step_counter + 1
            grow = count >= scaler.dynamic_growth_steps
            scaler.step_counter.assign(tf.where(grow, tf.zeros_like(count), count))
            scaler.dynamic_scale.assign(
                tf.where(grow, scaler.dynamic_scale * 2.0, scaler.dynamic_scale)
            )
            return tf.constant(True)

        def on_non_finite():
            scaler.step_counter.assign(0)
            scaler.dynamic_scale.assign(scaler.dynamic_scale / 2.0)
            return tf.constant(False)

        return tf.cond(finite, on_finite, on_non_finite)

    tf.distribute.get_replica_context().merge_call(cross_replica, args=(finite, local))


def tf_variable(variable):
    """The TensorFlow variable of a Keras variable (or the variable itself)."""
    return variable.value if isinstance(variable, keras.Variable) else variable
