"""Periodic synchronization (local SGD, DiLoCo), in pure TensorFlow.

Between syncs every replica updates its own copy of the weights with its
own gradient and its own optimizer state: no communication. Every `H`
updates the replicas meet:

    delta_r = anchor - weights_r                  (what replica r moved)
    delta   = sum_r share_r * delta_r             (through the sync hook)
    anchor  = outer_apply(anchor, delta)          (local SGD: anchor - delta,
                                                   the replicas' mean;
                                                   DiLoCo: an outer optimizer
                                                   step on the pseudo-gradient)
    weights_r = anchor                            (on every replica)

`share_r` is replica r's share of the examples trained on since the last
sync, so a replica that saw a short last batch weighs what its examples
weigh (with one update per window this is exactly the synchronous update
of SGD). Floating-point state outside the gradient path (BatchNormalization's
moving statistics) is averaged with the same shares at every sync.

The weights, the anchors and the inner optimizer's slots are ordinary
mirrored variables: in replica context a variable with no aggregation is
read and written on the replica's own copy, so they diverge between syncs
and are made equal again by the sync. The decision to sync is a `tf.cond` in
cross-replica context, reached through one unconditional `merge_call` per
update (a cond in replica context cannot hold the collectives'
`merge_call`, as in `keras_dist.core.accumulation`).
"""

from __future__ import annotations

import tensorflow as tf

from keras_dist.core.accumulation import read
from keras_dist.core.aggregation import (
    all_finite,
    apply_if_finite,
    assert_finite,
    reduce_gradients,
    scale_gradient,
)
from keras_dist.core.collectives import all_reduce, all_reduce_sum, replica_context


class SyncWindow:
    """The state of one periodic optimizer's window, and its rules.

    Args:
        variables: List of the trainable variables (mirrored), in the
            optimizer's order.
        anchors: List of mirrored variables, one per trainable variable: the
            weights at the last sync (DiLoCo's global model).
        since_sync: Int64 scalar variable (one value for all replicas):
            updates since the last sync.
        sync_every: Int64 scalar variable: updates per window (`H`).
        examples: Replica-local float32 scalar variable: the examples this
            replica trained on since the last sync.
    """

    def __init__(self, variables, anchors, since_sync, sync_every, examples):
        self.variables = list(variables)
        self.anchors = list(anchors)
        self.since_sync = since_sync
        self.sync_every = sync_every
        self.examples = examples
        # Floating-point variables outside the gradient path, averaged at a
        # sync (set by the optimizer that owns the window).
        self.model_state = []

    def local_update(
        self,
        gradients,
        variables,
        apply,
        non_finite,
        iterations,
        how_to_raise,
        names,
        batch_size=None,
    ):
        """One replica's update with its own gradient, then the window's step.

        Runs in replica context.

        Args:
            gradients: List of this replica's gradients (no `None`), scaled
                as the front ends scale them (the gradient of the replica's
                mean loss over `num_replicas_in_sync`).
            variables: List of the matching trainable variables.
            apply: Callable `apply(gradients, variables)`: the inner
                optimizer's update of this replica's copy (no all-reduce).
            non_finite: String, what a non-finite gradient does: `"apply"`,
                `"raise"` (this replica raises, naming the variables) or
                `"skip"` (every replica skips the update when any replica's
                gradient is not finite: one scalar all-reduce per update, so
                that the replicas' update counts stay equal).
            iterations: The inner optimizer's update counter (for messages).
            how_to_raise: String or `None`: see `apply_reduced`.
            names: List of strings: the variables, for messages.
            batch_size: Int, scalar tensor or `None`: this replica's examples
                in the batch (`None` counts the update as one).
        """
        replicas = replica_context().num_replicas_in_sync
        local = [scale_gradient(g, float(replicas)) for g in gradients]

        def update(local):
            apply(local, variables)

        if non_finite == "apply":
            update(local)
        elif non_finite == "raise":
            check = assert_finite(local, iterations, names=names)
            with tf.control_dependencies([check]):
                update(local)
        else:
            not_finite = 1.0 - tf.cast(all_finite(local), tf.float32)
            agreed = tf.equal(all_reduce(not_finite), 0.0)
            apply_if_finite(local, update, finite=agreed)
        examples = 1.0 if batch_size is None else batch_size
        self.examples.assign_add(tf.cast(examples, tf.float32))
        self.after_update()

    def after_update(self):
        """Counts an update; syncs on the window's last one (replica context)."""

        def cross_replica(strategy):
            since = self.since_sync + 1

            def wait():
                self.since_sync.assign(since)
                return tf.constant(False)

            return tf.cond(since >= self.sync_every, self._sync_on(strategy), wait)

        tf.distribute.get_replica_context().merge_call(cross_replica)

    def sync_pending(self):
        """Syncs now if the window holds updates (replica context).

        `DistributedModel.fit` calls it when an epoch's steps end.
        """

        def cross_replica(strategy):
            return tf.cond(
                self.since_sync > 0,
                self._sync_on(strategy),
                lambda: tf.constant(False),
            )

        tf.distribute.get_replica_context().merge_call(cross_replica)

    def _sync_on(self, strategy):
        """The branch of a cross-replica cond that syncs every replica and
        starts a new window."""

        def sync():
            strategy.extended.call_for_each_replica(self._synchronize)
            self.since_sync.assign(0)
            return tf.constant(True)

        return sync

    def start_window(self):
        """Before a window's first update the anchors take the weights.

        Runs in replica context, before every local update; acts when no
        update is in the window, when the weights are the same on every
        replica (after a sync, the synchronous warm-up, a restore or a
        `set_weights`): what the window's changes are measured from.
        """

        def start():
            for variable, anchor in zip(self.variables, self.anchors):
                anchor.assign(read(variable))
            return tf.constant(True)

        tf.cond(tf.equal(self.since_sync, 0), start, lambda: tf.constant(False))

    def bind(self, hook, outer_apply):
        """Sets how the deltas are summed and the anchors moved.

        Args:
            hook: The built `AllReduceHook` that sums the weighted deltas.
            outer_apply: Callable `outer_apply(mean_delta, anchors)`, run in
                replica context at a sync: moves the anchors (local SGD
                subtracts the delta; DiLoCo applies its outer optimizer).
        """
        self._hook = hook
        self._outer_apply = outer_apply

    def _synchronize(self):
        """One sync, in replica context (see the module docstring)."""
        examples = tf.identity(read(self.examples))
        total = all_reduce(examples)
        share = tf.math.divide_no_nan(examples, total)
        deltas = [
            (read(anchor) - read(variable)) * tf.cast(share, variable.dtype)
            for variable, anchor in zip(self.variables, self.anchors)
        ]
        _, _, mean_delta = reduce_gradients(deltas, self.variables, self._hook)
        state = self.model_state
        averaged = []
        if state:
            averaged = all_reduce_sum(
                [read(v) * tf.cast(share, v.dtype) for v in state]
            )
        self._outer_apply(list(mean_delta), self.anchors)
        for variable, anchor in zip(self.variables, self.anchors):
            variable.assign(read(anchor))
        for variable, value in zip(state, averaged):
            variable.assign(value)
        self.examples.assign(tf.zeros_like(examples))
