"""Which optimizers `ShardedOptimizer` can shard: those updating elementwise."""

from __future__ import annotations

import keras

from keras_dist._compat import keras_src as _compat
from keras_dist.core.optimizer_view import nested_optimizers

# Optimizers whose update of an element depends only on that element's
# gradient, state and the step: they give the same result on a slice.
ELEMENTWISE = (
    keras.optimizers.SGD,
    keras.optimizers.Adam,
    keras.optimizers.AdamW,
    keras.optimizers.Adamax,
    keras.optimizers.Nadam,
    keras.optimizers.RMSprop,
    keras.optimizers.Adagrad,
    keras.optimizers.Adadelta,
    keras.optimizers.Ftrl,
    keras.optimizers.Lion,
)


SHARD_BY = ("auto", "elements", "variables")


def check_inner(inner, shard_by="elements") -> str:
    """Raises unless `inner` can be sharded as `shard_by` says; returns how
    (`"elements"` or `"variables"`): `"auto"` shards an elementwise
    optimizer by elements, any other by whole variables."""
    if shard_by not in SHARD_BY:
        raise ValueError(
            f"`shard_by` must be one of {list(SHARD_BY)}. Received: "
            f"shard_by={shard_by!r}. 'elements' splits every variable over the "
            "replicas (elementwise optimizers), 'variables' gives each replica "
            "whole variables (any optimizer), 'auto' picks."
        )
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a `keras.optimizers.Optimizer` instance. "
            f"Received: inner_optimizer={inner!r}. Pass e.g. "
            "`keras.optimizers.Adam(1e-3)`."
        )
    nested = list(nested_optimizers(inner))
    base = nested[-1]
    for optimizer in nested[:-1]:
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "`inner_optimizer` may be an optimizer or a LossScaleOptimizer "
                f"around one. Received: {type(optimizer).__name__} around "
                f"{type(base).__name__}. Wrap accumulation around the "
                "ShardedOptimizer (`GradientAccumulationOptimizer("
                "ShardedOptimizer(inner), k)`), or use its "
                "`accumulation_steps`."
            )
    if base.use_ema:
        raise ValueError(
            "ShardedOptimizer does not keep an exponential moving average of "
            "the weights (it would be a whole copy of them on every replica). "
            "Received: inner_optimizer with use_ema=True. Use "
            "`keras.callbacks.SwapEMAWeights` with an unsharded optimizer."
        )
    if getattr(base, "gradient_accumulation_steps", None):
        raise ValueError(
            "`inner_optimizer` uses Keras's own `gradient_accumulation_steps`, "
            "which fails under tf.distribute (keras-team/keras#20582). Use "
            "`ShardedOptimizer(..., accumulation_steps=k)`."
        )
    if shard_by == "variables":
        return shard_by
    refusal = _not_elementwise(base)
    if shard_by == "auto":
        return "elements" if refusal is None else "variables"
    if refusal is not None:
        raise ValueError(refusal)
    return "elements"


def _not_elementwise(base) -> str | None:
    """Why `base`'s update of a slice could differ from its update of the
    whole variables (the refusal of `shard_by="elements"`), or `None`."""
    if not isinstance(base, ELEMENTWISE):
        return (
            f"ShardedOptimizer needs an optimizer whose update of an element "
            f"uses that element only; {type(base).__name__} needs a whole "
            "variable (factored moments, a per-variable trust ratio or "
            "norm), so its update of a slice would differ. Received: "
            f"inner_optimizer={type(base).__name__}. Use one of "
            f"{[cls.__name__ for cls in ELEMENTWISE]}, or shard it by whole "
            "variables: `shard_by='variables'` (or 'auto')."
        )
    if type(base) in ELEMENTWISE or getattr(type(base), "elementwise", False):
        return None
    known = next(c for c in type(base).__mro__ if c in ELEMENTWISE)
    replaced = _compat.update_rule_overridden(type(base), known)
    if not replaced:
        return None
    return (
        f"ShardedOptimizer cannot tell whether {type(base).__name__} "
        f"updates an element from that element alone: it is a "
        f"{known.__name__} with its own {' and '.join(replaced)}, "
        "which may read a whole variable (a norm, a trust ratio, as "
        "LARS does) and would then differ on a slice. Received: "
        f"inner_optimizer={type(base).__name__}. If its update is "
        "elementwise, say so with the class attribute "
        "`elementwise = True`; otherwise shard it by whole variables: "
        "`shard_by='variables'` (or 'auto')."
    )
