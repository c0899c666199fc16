"""The Keras 3 end of the aggregation path: the reduced gradient applied once.

`keras_dist.core.aggregation.reduce_gradients` weighs and sums the
gradients through the all-reduce hook; `reduce_and_apply` then applies them
with the Keras optimizer, whose own cross-replica sum is switched off
(`keras_dist._compat.keras_src.optimizer_all_reduce_disabled`). Both
`DistributedModel` and `GradientAccumulationOptimizer` end here.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_dist._compat import keras_src
from keras_dist.core.aggregation import assert_finite, reduce_gradients
from keras_dist.core.hooks import AllReduceHook
from keras_dist.core.optimizer_view import OptimizerView, nested_optimizers
from keras_dist.core.statistics import gradient_statistics


def optimizer_view(optimizer) -> OptimizerView:
    """What the hooks may know of a Keras 3 optimizer (`OptimizerView`)."""
    optimizers = tuple(nested_optimizers(optimizer))
    loss_scaler = next(
        (
            nested
            for nested in optimizers
            if isinstance(nested, keras.optimizers.LossScaleOptimizer)
        ),
        None,
    )
    loss_scale = None
    if loss_scaler is not None:

        def loss_scale():
            # The same choice as `LossScaleOptimizer.scale_loss`.
            if loss_scaler.built:
                return tf.convert_to_tensor(loss_scaler.dynamic_scale)
            return tf.constant(loss_scaler.initial_scale, tf.float32)

    return OptimizerView(
        optimizers=optimizers, loss_scale=loss_scale, sgd="keras.optimizers.SGD"
    )


def reduce_and_apply(
    optimizer,
    gradients,
    variables,
    hook: AllReduceHook,
    batch_size=None,
    check_finite=False,
):
    """Sums `gradients` over replicas through `hook`, then applies them once.

    `reduce_gradients` (the core's path), then the Keras optimizer's
    `apply` (which clips the reduced gradient) with its own all-reduce
    disabled. Must run in replica context (inside `strategy.run`, or
    anywhere under the default strategy). `None` gradients are dropped
    together with their variables, as Keras does.

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
        check_finite: Bool. Fail the step, before any weight changes, when
            the reduced gradient holds NaN or inf (unless a
            `LossScaleOptimizer` handles that). Defaults to `False`.

    Returns:
        The list of summed gradients that were applied.

    When `GradientStatistics` are attached to `optimizer`, their squared
    gradient norms are recorded too (see `GradientStatistics.record`).
    """
    view = optimizer_view(optimizer)
    grads, trainable, reduced = reduce_gradients(
        gradients, variables, hook, batch_size=batch_size, view=view
    )
    if not reduced:
        return []
    statistics = gradient_statistics(optimizer)
    if statistics is not None:
        statistics.record(grads, reduced)
    control = []
    if check_finite and view.loss_scale is None:
        control = [assert_finite(reduced, optimizer.iterations)]
    # The assert runs before any update (tf.function also orders stateful
    # ops in program order), so a failing step leaves the weights as they
    # were.
    with (
        tf.control_dependencies(control),
        keras_src.optimizer_all_reduce_disabled(optimizer),
    ):
        optimizer.apply(reduced, trainable)
    return reduced
