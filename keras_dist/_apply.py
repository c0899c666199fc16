"""The Keras 3 end of the aggregation path: the reduced gradient applied once.

`keras_dist.core.aggregation.reduce_gradients` weighs and sums the
gradients through the all-reduce hook; `reduce_and_apply` then applies them
with the Keras optimizer, whose own cross-replica sum is switched off
(`keras_dist._compat.keras_src.optimizer_all_reduce_disabled`). Both
`DistributedModel` and `GradientAccumulationOptimizer` end here.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

from keras_dist._compat import keras_src
from keras_dist.core.aggregation import apply_reduced, reduce_gradients
from keras_dist.core.hooks import AllReduceHook
from keras_dist.core.optimizer_view import OptimizerView, nested_optimizers, view_of
from keras_dist.core.statistics import gradient_statistics


def optimizer_view(optimizer) -> OptimizerView:
    """What the hooks may know of a Keras 3 optimizer (`OptimizerView`)."""
    return view_of(
        optimizer,
        keras.optimizers.LossScaleOptimizer,
        _current_scale,
        sgd="keras.optimizers.SGD",
        sgd_types=(keras.optimizers.SGD,),
    )


def _current_scale(loss_scaler):
    # The same choice as `LossScaleOptimizer.scale_loss`.
    if loss_scaler.built:
        return tf.convert_to_tensor(loss_scaler.dynamic_scale)
    return tf.constant(loss_scaler.initial_scale, tf.float32)


def filter_empty_gradients(gradients, variables):
    """Drops `None` gradients with their variables, as Keras's optimizers do.

    Raises Keras's `ValueError` when no gradient is left, and gives Keras's
    warning naming the variables without one.

    Returns:
        `(gradients, variables)`, the kept pairs in order.
    """
    pairs = [(g, v) for g, v in zip(gradients, variables) if g is not None]
    if not pairs:
        raise ValueError("No gradients provided for any variable.")
    if len(pairs) < len(list(variables)):
        missing = [
            getattr(v, "path", None) or v.name
            for g, v in zip(gradients, variables)
            if g is None
        ]
        warnings.warn(
            f"Gradients do not exist for variables {missing} when minimizing "
            "the loss. If using `model.compile()`, did you forget to provide "
            "a `loss` argument?",
            stacklevel=3,
        )
    return [g for g, _ in pairs], [v for _, v in pairs]


def build_optimizer(optimizer, variables) -> None:
    """Builds `optimizer` on all of `variables`, as Keras's `apply` does.

    Before the `None` gradients are dropped: an optimizer built on the
    variables that got a gradient would save fewer variables than a model
    trained with stock Keras, and skip its own state on load.
    """
    if not optimizer.built:
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(list(variables))
        optimizer.built = True


def reduce_and_apply(
    optimizer,
    gradients,
    variables,
    hook: AllReduceHook,
    batch_size=None,
    non_finite_gradients="apply",
    log_skips=True,
):
    """Sums `gradients` over replicas through `hook`, then applies them once.

    `reduce_gradients` (the core's path), then the Keras optimizer's
    `apply` (which clips the reduced gradient) with its own all-reduce
    disabled. Must run in replica context (inside `strategy.run`, or
    anywhere under the default strategy). `None` gradients are dropped
    together with their variables, as Keras does (with its error when none
    is left and its warning naming the others).

    Args:
        optimizer: The Keras optimizer (possibly a `LossScaleOptimizer`).
        gradients: List of this replica's gradients.
        variables: List of the matching trainable variables.
        hook: The `AllReduceHook` that sums the gradients.
        batch_size: Int, scalar tensor or `None`. The number of examples
            this replica's gradients come from: each replica's gradient is
            weighted by its share of the global batch (see
            `weight_by_batch_share`), which is exact for a last batch that
            does not split evenly. `None`: the batches are taken as equal.
        non_finite_gradients: String, one of
            `keras_dist.core.aggregation.NON_FINITE_GRADIENTS`: what an
            update with a NaN or inf in the reduced gradient does (a
            `LossScaleOptimizer` decides itself). Defaults to `"apply"`
            (stock Keras).
        log_skips: Bool. Log a skipped update (`False` under XLA, which
            compiles no Python callback). Defaults to `True`.

    Returns:
        The list of summed gradients (`None` for a sharded optimizer, which
        keeps only its slice of them).

    When `GradientStatistics` are attached to `optimizer`, their squared
    gradient norms are recorded too (see `GradientStatistics.record`).
    """
    variables = list(variables)
    build_optimizer(optimizer, variables)
    for nested in nested_optimizers(optimizer):
        # An optimizer that sums the gradients its own way: a periodic one
        # (local SGD, DiLoCo) applies each replica's own gradient and syncs
        # every H updates (keras_dist.local_sgd); a sharded one
        # reduce-scatters them (keras_dist.ShardedOptimizer). They refuse
        # each other, so at most one is in the chain.
        own_apply = getattr(nested, "apply_locally", None) or getattr(
            nested, "shard_and_apply", None
        )
        if own_apply is not None:
            if hasattr(nested, "apply_locally"):
                _refuse_loss_scaling_around(optimizer, nested)
            own_apply(
                gradients,
                variables,
                hook=hook,
                batch_size=batch_size,
                non_finite_gradients=non_finite_gradients,
                log_skips=log_skips,
            )
            return None
    gradients, variables = filter_empty_gradients(gradients, variables)
    view = optimizer_view(optimizer)
    grads, trainable, reduced = reduce_gradients(
        gradients, variables, hook, batch_size=batch_size, view=view
    )
    statistics = gradient_statistics(optimizer)
    if statistics is not None:
        statistics.record(grads, reduced)

    def apply(reduced):
        with keras_src.optimizer_all_reduce_disabled(optimizer):
            optimizer.apply(reduced, trainable)

    apply_reduced(
        reduced,
        apply,
        non_finite_gradients,
        optimizer.iterations,
        loss_scaled=view.loss_scale is not None,
        how_to_raise=(
            "compile(..., non_finite_gradients='raise')" if log_skips else None
        ),
        names=[getattr(v, "path", None) or v.name for v in trainable],
    )
    return reduced


def _refuse_loss_scaling_around(optimizer, periodic) -> None:
    for nested in nested_optimizers(optimizer):
        if nested is periodic:
            return
        if isinstance(nested, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                f"{type(periodic).__name__} does not support loss scaling (the "
                "mixed_float16 policy): each replica would skip its own "
                "updates and the replicas' update counts, which decide when "
                "they sync, would part. Received: a LossScaleOptimizer around "
                f"{type(periodic).__name__}. Use the mixed_bfloat16 policy."
            )


# Optimizers whose update of a sparse gradient equals that of its dense sum:
# their update is linear in the gradient, or its sign of a dense sum.
_SPARSE_AS_DENSE = (keras.optimizers.SGD, keras.optimizers.Lion)


def warn_of_summed_rows(optimizer, gradients, variables, steps) -> None:
    """Warns once (at trace time) that a window sums sparse rows densely.

    With `steps > 1` an accumulation window adds each micro-step's sparse
    gradient (an `Embedding`'s rows) into a dense accumulator, so the inner
    optimizer gets each row's sum over the window. Keras's Adam, RMSprop,
    Adagrad and the like square each occurrence of a repeated row of a
    sparse gradient (keras-team/keras#19992): one batch `steps` times
    larger gives them other second moments. SGD and Lion agree either way.
    """
    if steps <= 1 or getattr(optimizer, "_warned_of_summed_rows", False):
        return
    base = list(nested_optimizers(optimizer))[-1]
    if type(base) in _SPARSE_AS_DENSE:
        return
    sparse = [
        getattr(v, "path", None) or v.name
        for g, v in zip(gradients, variables)
        if isinstance(g, tf.IndexedSlices)
    ]
    if not sparse:
        return
    keras_src.set_untracked_attribute(optimizer, "_warned_of_summed_rows", True)
    warnings.warn(
        f"keras_dist: the gradients of {sparse} are sparse (rows of an "
        f"Embedding or another gather). With accumulation_steps={steps} a "
        "window's rows are summed into a dense accumulator, so "
        f"{type(base).__name__} updates a row that repeats within the window "
        "with the square of its summed gradient, where stock Keras on one "
        f"batch {steps} times larger squares each occurrence "
        "(keras-team/keras#19992): the weights differ from that run's. SGD "
        "and Lion are not affected; accumulation_steps=1 keeps the rows.",
        stacklevel=2,
    )


def pending_updater(optimizer):
    """The optimizer (or one it wraps) that accumulates micro-steps, which
    `apply_pending` applies at the end of an epoch; `None` without one."""
    for nested in nested_optimizers(optimizer):
        if callable(getattr(nested, "apply_pending", None)):
            return nested
    return None


def periodic_syncer(optimizer):
    """The periodic optimizer (local SGD, DiLoCo) that `fit` syncs when an
    epoch's steps end (its `sync_at_epoch_end`); `None` without one."""
    for nested in nested_optimizers(optimizer):
        if callable(getattr(nested, "sync_pending", None)):
            return nested if nested.sync_at_epoch_end else None
    return None
