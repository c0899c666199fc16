"""`ShardedOptimizer`'s bookkeeping: the layout's variables, clipping, decay
masks, the gathered weights' assignment and the sharded loss scaling.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_dist._compat import keras_src as _compat
from keras_dist._compat import tf_internal
from keras_dist.core import aggregation, collectives, sharding, topology
from keras_dist.core.plain import NoCompression


class Shards:
    """One built `ShardedOptimizer`'s layout and what it derives from it."""

    def __init__(self, layout, variables, base, strategy):
        self.layout = layout
        self.variables = list(variables)
        self.strategy = strategy
        self._index = {id(v): i for i, v in enumerate(self.variables)}
        # NumPy, made into constants where used: the optimizer can be built
        # inside one traced function and used in another. Per-element arrays
        # (4 bytes per parameter) only where needed, when tracing: a
        # variable index for `clipnorm`, a mask for weight decay with
        # exclusions (decaying everything needs none: padding stays zero).
        self._segments = None
        self._base = base
        decayed = [_compat.uses_weight_decay(base, v) for v in self.variables]
        if not any(decayed):
            self._decay = None
        elif all(decayed):
            self._decay = 1.0
        else:
            self._decay = decayed

    def in_order(self, grads, variables) -> list:
        """Gradients in the layout's order: `None` for a variable that got
        none (an unused weight, or one frozen since the build), a
        `tf.IndexedSlices` (an `Embedding`'s rows) as it is."""
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
        return [by_index.get(i) for i in range(len(self.variables))]

    def dense(self, grads) -> list:
        """`grads` as dense tensors, zeros where a gradient is absent or
        sparse (the sparse ones travel as rows: `local_sparse_update`)."""
        return [
            tf.zeros(v.shape, v.dtype)
            if g is None or isinstance(g, tf.IndexedSlices)
            else tf.convert_to_tensor(g)
            for g, v in zip(grads, self.variables)
        ]

    def local_positions(self, flags, replica):
        """Positions in replica `replica`'s slice of the elements of the
        variables whose flag is set (int64)."""
        mask = self.layout.local(self.layout.element_mask(flags), replica)
        static = tf.get_static_value(mask)
        if static is not None:
            return tf.constant(np.flatnonzero(static), tf.int64)
        return tf.reshape(tf.where(mask > 0), [-1])

    def local_sparse_update(self, local, rows, active, replica):
        """The slice's gradient as `tf.IndexedSlices`: each element of an
        active dense variable once, and each element of every row of the
        sparse gradients as often as its row occurs.

        An optimizer that squares or divides by the gradient (Adam,
        RMSprop, Adagrad) then updates a slice as stock Keras updates the
        whole variables: per occurrence of a repeated row.

        Args:
            local: This replica's summed dense slice.
            rows: Dict, layout index -> the gathered `tf.IndexedSlices` of
                that variable (every replica's rows).
            active: List of bools: the variables that got a gradient.
            replica: This replica's id.
        """
        size = self.layout.slice_size
        dense_flags = [a and i not in rows for i, a in enumerate(active)]
        positions = [self.local_positions(dense_flags, replica)]
        values = [tf.gather(local, positions[0])]
        for index, grad in rows.items():
            shape = self.layout.shapes[index]
            width = int(np.prod(shape[1:], dtype=np.int64))
            rows_at = tf.cast(grad.indices, tf.int64)[:, None] * width
            flat = (
                self.layout.offsets[index] + rows_at + tf.range(width, dtype=tf.int64)
            )
            flat = tf.reshape(flat, [-1])
            row_values = tf.reshape(tf.cast(grad.values, local.dtype), [-1])
            mine, at = self.layout.positions(flat, replica)
            positions.append(at)
            values.append(tf.boolean_mask(row_values, mine))
        return tf.IndexedSlices(
            tf.concat(values, axis=0),
            tf.concat(positions, axis=0),
            tf.constant([size], tf.int64),
        )

    def local_inactive(self, active, replica):
        """A boolean slice: `True` where the element's variable got no
        gradient (it must keep its value and its optimizer state), or
        `None` when every variable got one."""
        if all(active):
            return None
        mask = self.layout.local(
            self.layout.element_mask([not a for a in active]), replica
        )
        return tf.cast(mask, tf.bool)

    def local_decay_mask(self, replica, active=None):
        """Where weight decay applies in replica `replica`'s slice: `None`
        (nowhere), `1.0` (everywhere) or a float mask. Only variables that
        got a gradient decay, as Keras skips the others."""
        decay = self._decay
        if active is not None and not all(active):
            decayed = [_compat.uses_weight_decay(self._base, v) for v in self.variables]
            decay = [d and a for d, a in zip(decayed, active)]
            decay = decay if any(decay) else None
        if decay is None or isinstance(decay, float):
            return decay
        return self.layout.local(self.layout.element_mask(decay), replica)

    def weighted(self, grads, batch_size) -> list:
        """`grads` (`None` where absent) weighted by this replica's share of
        the global batch (`aggregation.weight_by_batch_share`); as they are
        when `batch_size` is `None`."""
        if batch_size is None:
            return list(grads)
        weighted = iter(
            aggregation.weight_by_batch_share(
                [g for g in grads if g is not None], batch_size
            )
        )
        return [None if g is None else next(weighted) for g in grads]

    def refuse_norm_clipping(self, rows) -> None:
        """Raises when the inner optimizer clips by norm and some gradients
        are sparse (`rows`: variable index -> `tf.IndexedSlices`)."""
        base = self._base
        if rows and (base.clipnorm or base.global_clipnorm):
            names = [self.variables[i].path for i in rows]
            raise ValueError(
                "ShardedOptimizer cannot clip by norm where gradients are "
                f"sparse: {names} get an Embedding's rows, whose norm Keras "
                "counts per occurrence of a row. Received: inner optimizer "
                f"with clipnorm={base.clipnorm}, global_clipnorm="
                f"{base.global_clipnorm}. Use `clipvalue`, or train "
                "unsharded (GradientAccumulationOptimizer or the model's "
                "own aggregation clip these exactly)."
            )

    def clipped(self, local, replica, rows=None):
        """The inner optimizer's clipping, on the summed gradient's slices
        (and the values of sparse rows, which only `clipvalue` may clip)."""
        base = self._base
        self.refuse_norm_clipping(rows)
        if base.clipvalue:
            local = tf.clip_by_value(local, -base.clipvalue, base.clipvalue)
        if base.clipnorm:
            if self._segments is None:
                self._segments = self.layout.segment_ids()
            segments = self.layout.local(
                self._segments, replica, fill=len(self.layout.sizes)
            )
            norms = sharding.per_variable_norms(self.layout, local, segments)
            factors = base.clipnorm / tf.maximum(norms, base.clipnorm)
            local = local * tf.cast(tf.gather(factors, segments), local.dtype)
        if base.global_clipnorm:
            norm = sharding.global_norm(local)
            factor = base.global_clipnorm / tf.maximum(norm, base.global_clipnorm)
            local = local * tf.cast(factor, local.dtype)
        return local

    def reduce(self, flats, hook):
        """This replica's summed slice (or block) of the gradient flattened as
        `layout.segment_flats` makes it; a cast hook's dtype on the wire."""
        if hook is None or type(hook) is NoCompression:
            local, _ = sharding.reduce_to_owners(self.layout, flats)
            return local
        dtype = flats[0].dtype
        local, overflowed = sharding.reduce_to_owners(
            self.layout,
            flats,
            wire_dtype=hook.wire_dtype_for(dtype),
            range_checked=hook.range_checked(dtype),
        )
        if overflowed is None:
            return local
        (local,) = hook.count_overflow(overflowed, [local])
        return local

    def checkpoint_whole(self, tf_variable) -> None:
        """`tf.train.Checkpoint` saves a slice variable whole, reshards it.

        A per-replica variable is otherwise written as its first replica's
        value: one slice of the state.
        """
        slice_shape = (self.layout.slice_size,)
        if tuple(tf_variable.shape) != slice_shape or not isinstance(
            tf_variable, tf.distribute.DistributedValues
        ):
            return
        tf_internal.checkpoint_through(
            tf_variable,
            lambda: tf.constant(self.gathered(tf_variable)),
            lambda value: self.assign_slices(tf_variable, value),
        )

    def gathered(self, tf_variable) -> np.ndarray:
        """Every replica's slice of a per-replica variable, joined into the
        vector of the variables' order (what is saved), unpadded."""
        strategy = self.strategy
        slices = strategy.experimental_local_results(tf_variable)
        if strategy.num_replicas_in_sync == len(slices):
            stack = np.stack([np.asarray(s.numpy()) for s in slices])
        else:
            stack = np.asarray(collectives.gather_across(strategy, tf_variable))
        return self.layout.to_whole(stack.reshape(strategy.num_replicas_in_sync, -1))

    def assign_slices(self, tf_variable, value) -> None:
        """A whole saved vector, resharded into this strategy's slices."""
        slices = self.layout.to_slices(np.asarray(value))
        first, _ = topology.worker_layout(self.strategy)
        for offset, component in enumerate(
            self.strategy.experimental_local_results(tf_variable)
        ):
            component.assign(slices[first + offset])

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


def apply_as_decided(scaler, finite, update, parts, non_finite, base, log_skips):
    """Runs `update(parts)` on every replica as the loss scaler (when there
    is one) or `non_finite_gradients` decides, `finite` being the
    all-reduced verdict on the step's gradients (replica context)."""
    if scaler is not None:
        update_loss_scale(scaler, finite, update, parts)
        return
    aggregation.apply_reduced(
        parts,
        update,
        non_finite,
        base.iterations,
        loss_scaled=False,
        how_to_raise=(
            "compile(..., non_finite_gradients='raise')" if log_skips else None
        ),
        finite=finite,
    )


def tf_variable(variable):
    """The TensorFlow variable of a Keras variable (or the variable itself)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def whole_value(sharded, variable):
    """A variable's value to save: a slice variable gathered whole."""
    component = tf_variable(variable)
    if id(component) not in sharded.shard_rules:
        return np.asarray(variable.numpy())
    return sharded._shards.gathered(component)


def load_value(sharded, variable, value):
    """Assigns a saved value; a whole vector is resharded into slices."""
    component = tf_variable(variable)
    if id(component) not in sharded.shard_rules:
        variable.assign(value)
        return
    sharded._shards.assign_slices(component, value)


def save_whole(sharded, variables, store, owned=None):
    """Writes `variables` whole into a Keras saving `store` (slices gathered),
    then an `_owned.Owned`'s state after them."""
    for index, variable in enumerate(variables):
        store[str(index)] = whole_value(sharded, variable)
    if owned is not None:
        owned.save(store, len(variables))


def load_whole(sharded, variables, store, owned=None):
    """Reads what `save_whole` wrote, resharded for this strategy."""
    if owned is not None:
        owned.load_saved(store, len(variables))
    elif len(store.keys()) != len(variables):
        raise ValueError(
            f"The saved optimizer has {len(store.keys())} variables; this one "
            f"has {len(variables)}. Load it into the same optimizer and model."
        )
    for index, variable in enumerate(variables):
        load_value(sharded, variable, np.asarray(store[str(index)]))
