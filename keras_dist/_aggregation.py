"""The one gradient aggregation path of keras_dist.

    per-replica gradients -> all-reduce hook (sum over replicas)
        -> optimizer.apply: loss-scale check, clipping, weight decay, update

`DistributedModel.train_step` and `GradientAccumulationOptimizer` both end in
`reduce_and_apply`; the accumulation optimizer adds replica-local
accumulation in front of it. Because the hook reduces *before* the optimizer
runs, Keras's `clipnorm` / `global_clipnorm` act on the all-reduced gradient
(stock Keras clips each replica's gradient before its all-reduce).

The path holds both a replica's own gradient and the reduced one, which is
what the gradient noise scale needs: when `GradientStatistics` are attached
to the optimizer (`attach_statistics`, done by
`keras_dist.callbacks.AutoScaleBatch`), `reduce_and_apply` also records their
squared norms, at the cost of one extra all-reduced scalar per update.
Without statistics the path is unchanged.
"""

from __future__ import annotations

import tensorflow as tf

from keras_dist import _compat
from keras_dist.compression.base import AllReduceHook

# Instance attribute, set untracked so that Keras's attribute tracking does
# not make the statistics part of the optimizer's checkpoints.
_STATISTICS_ATTRIBUTE = "_keras_dist_gradient_statistics"


def check_hook(hook, argument="all_reduce_hook") -> AllReduceHook:
    """Returns `hook` if it is an `AllReduceHook`, else raises TypeError."""
    if not isinstance(hook, AllReduceHook):
        hint = ""
        if isinstance(hook, type) and issubclass(hook, AllReduceHook):
            hint = f" Pass an instance: `{hook.__name__}()`."
        raise TypeError(
            f"`{argument}` must be an instance of "
            "`keras_dist.compression.AllReduceHook` (for example "
            f"`keras_dist.compression.FP16()`). Received: {argument}={hook!r}."
            f"{hint}"
        )
    return hook


def hook_covers(hook: AllReduceHook, variables) -> bool:
    """Whether `hook` is built and knows every one of `variables`."""
    return hook.built and all(hook.knows(v) for v in variables)


def build_hook(hook: AllReduceHook, variables, strategy) -> None:
    """Builds `hook` for `variables` in cross-replica context.

    Does nothing when the hook already knows all of them. A stateless hook
    built for other variables (the model gained weights, or `trainable`
    changed) is rebuilt; a hook with state raises, since its state belongs
    to the variables it was built for.
    """
    variables = list(variables)
    if hook_covers(hook, variables):
        return
    # Out of any graph being traced: under the default strategy Keras builds
    # lazily inside the first trace, and the hook's state must be created
    # once, eagerly, not as a variable of one traced function.
    with tf.init_scope(), strategy.scope():
        if hook.built:
            hook.rebuild(variables)
        else:
            hook.build(variables)


def reduce_and_apply(optimizer, gradients, variables, hook: AllReduceHook):
    """Sums `gradients` over replicas through `hook`, then applies them once.

    Must run in replica context (inside `strategy.run`, or anywhere under the
    default strategy). `None` gradients are dropped together with their
    variables, as Keras does.

    Args:
        optimizer: The Keras optimizer (possibly a `LossScaleOptimizer`).
        gradients: List of this replica's gradients.
        variables: List of the matching trainable variables.
        hook: The `AllReduceHook` that sums the gradients.

    Returns:
        The list of summed gradients that were applied.

    When `GradientStatistics` are attached to `optimizer`, their squared
    gradient norms are recorded too (see `GradientStatistics.record`).
    """
    if tf.distribute.in_cross_replica_context():
        raise RuntimeError(
            "keras_dist's gradient aggregation must run in a replica context "
            "(inside `strategy.run(...)`), not in cross-replica context."
        )
    if not hook.built:
        raise RuntimeError(
            f"The all-reduce hook {hook!r} was not built. Build the model "
            "before training (keras_dist builds hooks when `fit` starts or "
            "when `model.build_all_reduce_hook()` is called)."
        )
    pairs = [(g, v) for g, v in zip(gradients, variables) if g is not None]
    if not pairs:
        return []
    grads = [g for g, _ in pairs]
    trainable = [v for _, v in pairs]
    reduced = hook.reduce(grads, trainable)
    if len(reduced) != len(grads):
        raise ValueError(
            f"All-reduce hook {hook!r} returned {len(reduced)} gradients for "
            f"{len(grads)} inputs; `reduce` must return one summed gradient "
            "per input gradient, in order."
        )
    statistics = gradient_statistics(optimizer)
    if statistics is not None:
        statistics.record(grads, reduced)
    with _compat.optimizer_all_reduce_disabled(optimizer):
        optimizer.apply(reduced, trainable)
    return reduced


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
        local = context.all_reduce(tf.distribute.ReduceOp.MEAN, local)
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
    for nested in _compat.nested_optimizers(optimizer):
        _compat.set_untracked_attribute(nested, _STATISTICS_ATTRIBUTE, statistics)


def gradient_statistics(optimizer):
    """Returns the `GradientStatistics` attached to `optimizer`, or `None`."""
    return getattr(optimizer, _STATISTICS_ATTRIBUTE, None)
