"""The one gradient aggregation path of keras_dist.

    per-replica gradients -> all-reduce hook (sum over replicas)
        -> optimizer.apply: loss-scale check, clipping, weight decay, update

`DistributedModel.train_step` and `GradientAccumulationOptimizer` both end in
`reduce_and_apply`; the accumulation optimizer adds replica-local
accumulation in front of it. Because the hook reduces *before* the optimizer
runs, Keras's `clipnorm` / `global_clipnorm` act on the all-reduced gradient
(stock Keras clips each replica's gradient before its all-reduce).
"""

from __future__ import annotations

import tensorflow as tf

from keras_dist import _compat
from keras_dist.compression.base import AllReduceHook


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


def build_hook(hook: AllReduceHook, variables, strategy) -> None:
    """Builds `hook` for `variables` in cross-replica context, once."""
    if hook.built:
        return
    with strategy.scope():
        hook.build(list(variables))


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
            "when `model.build_all_reduce_hook()` is called under the "
            "strategy scope)."
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
    with _compat.optimizer_all_reduce_disabled(optimizer):
        optimizer.apply(reduced, trainable)
    return reduced
