"""The gradient-accumulation cycle, in pure TensorFlow, for both front ends.

`keras_dist.GradientAccumulationOptimizer` (Keras 3) and
`keras_dist.tf_keras.DistributedOptimizer` (tf_keras) create their variables
their own way and run the same cycle here:

- each micro-step adds this replica's gradient into **replica-local**
  accumulators (`synchronization=ON_READ`): no communication;
- every micro-step makes exactly one, unconditional `merge_call`; the
  decision to update is a `tf.cond` in cross-replica context, because a cond
  in replica context cannot contain the all-reduce's `merge_call`
  (keras-team/keras#20582, tf-keras#107);
- on the k-th micro-step every replica computes the mean over the
  accumulated examples and calls the front end's `apply` (which sums through
  the all-reduce hook, clips and updates once), then zeroes its
  accumulators.
"""

from __future__ import annotations

import tensorflow as tf

from keras_dist.core.aggregation import as_gradient
from keras_dist.core.collectives import all_reduce


def read(variable):
    """A variable's value as a tensor (Keras variables and tf.Variables)."""
    value = variable.value
    return value() if callable(value) else value


class AccumulationCycle:
    """One optimizer's accumulation state and its update rule.

    Args:
        accumulators: List of replica-local variables, one per trainable
            variable, in `variables` order.
        examples: Replica-local float32 scalar variable: the examples
            accumulated on this replica.
        pending: Int64 scalar variable (one value for all replicas): the
            micro-steps accumulated since the last update.
        micro_steps: Int64 scalar variable: every micro-step so far.
        steps: Int64 scalar variable: the micro-steps per update (can be
            assigned while training runs).
        variables: List of the trainable variables the accumulators match.
    """

    def __init__(self, accumulators, examples, pending, micro_steps, steps, variables):
        self.accumulators = list(accumulators)
        self.examples = examples
        self.pending = pending
        self.micro_steps = micro_steps
        self.steps = steps
        self._index = {id(v): i for i, v in enumerate(variables)}
        # Local: the optimizer applied to the window applies each replica's
        # own mean (local SGD); it gets the replica's examples, and the
        # window's mean needs no collective.
        self.local = False

    def index(self, variable) -> int:
        """The position of `variable`'s accumulator; `KeyError` if unknown."""
        return self._index[id(variable)]

    def accumulate(self, grads, variables, apply, batch_size=None, weighted=False):
        """Adds this replica's `grads`; on every k-th call runs `apply`.

        Runs in replica context.

        Sparse gradients (`tf.IndexedSlices`, an `Embedding`'s) are added
        into dense accumulators: a window of several micro-steps applies
        each row's sum, which is what a dense gradient gives. A window of
        one micro-step (`k = 1`, or the first of a window that a change of
        `k` closes at once) hands its rows to `apply` as they are, so the
        optimizer's sparse update sees them as stock Keras does (Adam,
        RMSprop and Adagrad square each occurrence of a repeated row
        separately, keras-team/keras#19992).

        Args:
            grads: List of this replica's gradients (no `None`).
            variables: List of the matching variables (all known).
            apply: Callable `apply(mean_gradients, variables)`, run in replica
                context on update steps with the mean over every accumulated
                example of every replica (it must sum over replicas).
            batch_size: Int, scalar tensor or `None`. This replica's number of
                examples in the micro-batch; `None` counts each micro-step as
                one.
            weighted: Bool. `grads` are already sums over this micro-step's
                examples of every replica (a sharded optimizer reduce-scatters
                `gradient * examples * replicas`): they are added as they are.
                Defaults to `False`.
        """
        variables = list(variables)
        self.last_variables = variables
        accumulators = [self.accumulators[self.index(v)] for v in variables]
        # Accumulate the gradient of the *sum* of this replica's example
        # losses (the front ends scale the mean loss by 1 / R), and count the
        # examples: on update, sum / examples is the mean over every example
        # of every replica and micro-step, on any number of replicas (also
        # after a restore on another count).
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        examples = tf.cast(1 if batch_size is None else batch_size, tf.float32)
        for accumulator, grad in zip(accumulators, grads):
            weight = tf.cast(
                1.0 if weighted else examples * replicas, accumulator.dtype
            )
            accumulator.assign_add(
                tf.cast(tf.convert_to_tensor(as_gradient(grad)), accumulator.dtype)
                * weight
            )
        self.examples.assign_add(examples)
        # This micro-step's sparse rows, for a window of one: their values
        # and indices pass `merge_call` as tensors (one per replica).
        sparse = {
            position: (grad.values, grad.indices, grad.dense_shape)
            for position, grad in enumerate(grads)
            if isinstance(grad, tf.IndexedSlices) and not weighted
        }

        def cross_replica_update(strategy, sparse):
            self.micro_steps.assign_add(1)
            pending = self.pending + 1

            def accumulated():
                strategy.extended.call_for_each_replica(
                    self._apply_mean, args=(accumulators, variables, apply)
                )
                return tf.constant(True)

            def alone():
                strategy.extended.call_for_each_replica(
                    self._apply_with_rows,
                    args=(accumulators, variables, apply, sparse),
                )
                return tf.constant(True)

            def update():
                if sparse:
                    done = tf.cond(tf.equal(pending, 1), alone, accumulated)
                else:
                    done = accumulated()
                with tf.control_dependencies([done]):
                    self.pending.assign(0)
                return tf.constant(True)

            def wait():
                self.pending.assign(pending)
                return tf.constant(False)

            return tf.cond(pending >= self.steps, update, wait)

        tf.distribute.get_replica_context().merge_call(
            cross_replica_update, args=(sparse,)
        )

    def apply_pending(self, apply) -> None:
        """Applies what was accumulated since the last update, if anything.

        The mean over the accumulated examples, as a full window does:
        `DistributedModel` calls it when an epoch's steps end, so that an
        epoch whose micro-steps are not a multiple of `k` ends with an
        update on its last, shorter window, as one batch `k` times larger
        would end it with a shorter batch. Runs in replica context; the
        decision (are micro-steps pending?) is the same on every replica.

        Args:
            apply: As in `accumulate`.
        """
        variables = getattr(self, "last_variables", None)
        if variables is None:
            return
        accumulators = [self.accumulators[self.index(v)] for v in variables]

        def cross_replica(strategy):
            def update():
                strategy.extended.call_for_each_replica(
                    self._apply_mean, args=(accumulators, variables, apply)
                )
                self.pending.assign(0)
                return tf.constant(True)

            return tf.cond(self.pending > 0, update, lambda: tf.constant(False))

        tf.distribute.get_replica_context().merge_call(cross_replica)

    def _total(self, examples):
        """The examples the window's mean is over: every replica's, or
        (local) this replica's as a share of a replica count of them, which
        gives its own mean scaled as the front ends scale a gradient."""
        if self.local:
            replicas = tf.distribute.get_replica_context().num_replicas_in_sync
            return examples * replicas
        return all_reduce(examples)

    def _apply(self, apply, grads, variables, examples):
        if self.local:
            apply(grads, variables, batch_size=examples)
        else:
            apply(grads, variables)

    def _apply_mean(self, accumulators, variables, apply):
        examples = tf.identity(read(self.examples))
        total = self._total(examples)
        grads = [
            tf.math.divide_no_nan(tf.identity(read(a)), tf.cast(total, a.dtype))
            for a in accumulators
        ]
        self._apply(apply, grads, variables, examples)
        self._clear(accumulators)

    def _apply_with_rows(self, accumulators, variables, apply, sparse):
        """A window of one micro-step: its sparse gradients as rows."""
        examples = tf.identity(read(self.examples))
        total = self._total(examples)
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        grads = []
        for position, accumulator in enumerate(accumulators):
            if position in sparse:
                values, indices, dense_shape = sparse[position]
                # The weight a dense accumulator gives this replica's
                # gradient: its share of the examples, times the replicas.
                share = tf.math.divide_no_nan(examples * replicas, total)
                grads.append(
                    tf.IndexedSlices(
                        values * tf.cast(share, values.dtype), indices, dense_shape
                    )
                )
                continue
            grads.append(
                tf.math.divide_no_nan(
                    tf.identity(read(accumulator)), tf.cast(total, accumulator.dtype)
                )
            )
        self._apply(apply, grads, variables, examples)
        self._clear(accumulators)

    def _clear(self, accumulators):
        for accumulator in accumulators:
            accumulator.assign(tf.zeros_like(read(accumulator)))
        self.examples.assign(tf.zeros_like(read(self.examples)))

    def reset(self) -> None:
        """Discards what was accumulated since the last update."""
        for accumulator in self.accumulators:
            accumulator.assign(tf.zeros_like(read(accumulator)))
        self.examples.assign(0.0)
        self.pending.assign(0)
