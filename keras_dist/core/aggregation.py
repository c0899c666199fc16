"""The one gradient aggregation path of keras_dist, in pure TensorFlow.

    per-replica gradients -> weigh by batch share -> all-reduce hook (sum
        over replicas) -> the front end's optimizer apply

Both front ends call `reduce_gradients` and then apply the reduced
gradients with their optimizer: the Keras 3 one in `keras_dist._apply`
(`DistributedModel.train_step` and `GradientAccumulationOptimizer`), the
tf_keras one in `keras_dist.tf_keras`. Because the hook reduces *before*
the optimizer runs, clipping acts on the all-reduced gradient (stock Keras
clips each replica's gradient before its all-reduce).
"""

from __future__ import annotations

import logging
import re

import tensorflow as tf

from keras_dist.core.collectives import all_reduce, ready_order, replica_context
from keras_dist.core.hook_types import variable_name
from keras_dist.core.hooks import AllReduceHook

logger = logging.getLogger(__name__)


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


def reduce_gradients(gradients, variables, hook, batch_size=None, view=None):
    """The front-end-neutral half of the path: weigh, then sum through `hook`.

    Pure TensorFlow, shared by the Keras 3 pieces (`reduce_and_apply`) and
    the tf_keras ones (`keras_dist.tf_keras`). Runs in replica context.

    Args:
        gradients: List of this replica's gradients (`None` entries are
            dropped with their variables).
        variables: List of the matching trainable variables.
        hook: The built `AllReduceHook` that sums them over replicas.
        batch_size: Int, scalar tensor or `None`. The number of examples
            this replica's gradients come from: each replica's gradient is
            weighted by its share of the global batch (see
            `weight_by_batch_share`), which is exact for a last batch that
            does not split evenly. `None`: the batches are taken as equal.
        view: `OptimizerView` of the optimizer that applies the sums, or
            `None`. A hook that applies momentum itself (DGC) checks it.

    Returns:
        `(gradients, variables, reduced)`: the kept gradients (weighted by
        batch share), their variables and the summed gradients, in order.
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
        return [], [], []
    # Buckets follow the order the backward pass computes the gradients in,
    # read from the graph before anything else touches them.
    hook.set_ready_order(ready_order([g for g, _ in pairs]))
    grads = [as_gradient(g) for g, _ in pairs]
    trainable = [v for _, v in pairs]
    if batch_size is not None:
        grads = weight_by_batch_share(grads, batch_size)
    bind_optimizer = getattr(hook, "bind_optimizer", None)
    if bind_optimizer is not None and view is not None:
        # A hook that applies momentum itself (DGC) checks the optimizer that
        # applies its sums, and finds its loss scale.
        bind_optimizer(view)
    reduced = hook.reduce(grads, trainable)
    if len(reduced) != len(grads):
        raise ValueError(
            f"All-reduce hook {hook!r} returned {len(reduced)} gradients for "
            f"{len(grads)} inputs; `reduce` must return one summed gradient "
            "per input gradient, in order."
        )
    reduced = list(reduced)
    _check_reduced(hook, grads, reduced, trainable)
    return grads, trainable, reduced


def as_gradient(gradient):
    """`gradient` as a tensor, or a `tf.IndexedSlices` of tensors.

    Optimizers accept NumPy arrays and Python lists as gradients, and
    `tf.IndexedSlices` whose values are NumPy arrays; the hooks work on
    tensors.
    """
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.convert_to_tensor(gradient.values),
            tf.convert_to_tensor(gradient.indices),
            None
            if gradient.dense_shape is None
            else tf.convert_to_tensor(gradient.dense_shape),
        )
    return tf.convert_to_tensor(gradient)


def _check_reduced(hook, gradients, reduced, variables) -> None:
    """Raises if `hook.reduce` changed a gradient's shape or dtype."""
    for position, (gradient, summed, variable) in enumerate(
        zip(gradients, reduced, variables)
    ):
        name = variable_name(variable)
        if summed is None or not hasattr(summed, "dtype"):
            raise TypeError(
                f"All-reduce hook {hook!r} returned {summed!r} for gradient "
                f"{position} ({name}); `reduce` must return a tensor "
                "per input gradient."
            )
        if tf.as_dtype(summed.dtype) != tf.as_dtype(gradient.dtype):
            raise TypeError(
                f"All-reduce hook {hook!r} returned dtype "
                f"{tf.as_dtype(summed.dtype).name} for gradient {position} "
                f"({name}) of dtype {tf.as_dtype(gradient.dtype).name}; "
                "`reduce` must return each sum in its gradient's dtype (cast "
                "back after compressing)."
            )
        want = _dense_shape(gradient)
        got = _dense_shape(summed)
        if not got.is_compatible_with(want):
            raise ValueError(
                f"All-reduce hook {hook!r} returned shape {got} for gradient "
                f"{position} ({name}) of shape {want}; `reduce` must "
                "return each sum in its gradient's shape."
            )


def _dense_shape(tensor) -> tf.TensorShape:
    if isinstance(tensor, tf.IndexedSlices):
        static = tf.get_static_value(tensor.dense_shape)
        if static is None:
            return tf.TensorShape([None] * tensor.values.shape.rank)
        return tf.TensorShape(static)
    return tf.TensorShape(tensor.shape)


NON_FINITE_GRADIENTS = ("skip", "raise", "apply")
"""What an update does when the all-reduced gradient holds NaN or inf:

- `"skip"`: no update (weights, slots and `iterations` stay as they were),
  a warning names the update, and training goes on; the step's logs carry
  its loss as computed, so `keras.callbacks.TerminateOnNaN` stops a run
  whose loss is not finite, as with stock Keras.
- `"raise"`: the step fails with an error naming the update, before any
  weight changes.
- `"apply"`: the update is applied, NaN included (stock Keras).
"""


def check_non_finite_gradients(value, argument="non_finite_gradients") -> str:
    """Returns `value` if it is one of `NON_FINITE_GRADIENTS`, else raises."""
    if value not in NON_FINITE_GRADIENTS:
        raise ValueError(
            f"`{argument}` must be one of {list(NON_FINITE_GRADIENTS)}. "
            f'Received: {argument}={value!r}. "skip" (the default) keeps '
            'the weights and goes on, "raise" stops training, "apply" '
            "applies the update as stock Keras does."
        )
    return value


def all_finite(gradients):
    """A boolean scalar: every entry of every gradient is finite.

    One pair of shared constants for all the gradients: one per gradient
    would be duplicate ops in the graph (tf_keras's optimizer tests count
    them: `test_duplicate_ops_*`).
    """
    flat_shape = tf.constant([-1])
    first_axis = tf.constant(0)
    checks = []
    for gradient in gradients:
        if isinstance(gradient, tf.IndexedSlices):
            gradient = gradient.values
        if gradient.dtype.is_complex:
            gradient = tf.math.abs(gradient)
        finite = tf.math.is_finite(tf.reshape(gradient, flat_shape))
        checks.append(tf.reduce_all(finite, axis=first_axis))
    return tf.reduce_all(tf.stack(checks), axis=first_axis)


def apply_if_finite(reduced, apply, on_skip=None, finite=None):
    """Runs `apply(reduced)` only where every reduced gradient is finite.

    Runs in replica context. The decision is a `tf.cond` in cross-replica
    context, reached through one unconditional `merge_call` (a cond in
    replica context cannot hold the optimizer's own `merge_call`), as
    Keras's `LossScaleOptimizer` does. The reduced gradients are the same on
    every replica and worker, so all of them decide alike.

    Args:
        reduced: List of the all-reduced gradients.
        apply: Callable `apply(reduced)`, run in replica context when they
            are all finite.
        on_skip: Callable or `None`. Run (cross-replica context) instead of
            `apply` otherwise.
        finite: Boolean scalar or `None`: the decision, when it is not
            `all_finite(reduced)` (it must be the same on every replica:
            sharded updates all-reduce it over the slices).

    Returns:
        A boolean scalar: whether `apply` ran.
    """

    if finite is None:
        finite = all_finite(reduced)

    def cross_replica(strategy, reduced, finite):
        finite = strategy.experimental_local_results(finite)[0]

        def update():
            strategy.extended.call_for_each_replica(apply, args=(reduced,))
            return tf.constant(True)

        def skip():
            if on_skip is not None:
                on_skip()
            return tf.constant(False)

        return tf.cond(finite, update, skip)

    return tf.distribute.get_replica_context().merge_call(
        cross_replica, args=(reduced, finite)
    )


def apply_reduced(
    reduced,
    apply,
    non_finite,
    iterations,
    loss_scaled,
    how_to_raise,
    finite=None,
    names=None,
):
    """Applies the reduced gradients as `non_finite` says (replica context).

    Args:
        reduced: List of the all-reduced gradients.
        apply: Callable `apply(reduced)`: the front end's optimizer update.
        non_finite: String, one of `NON_FINITE_GRADIENTS`.
        iterations: The optimizer's update counter (named in messages), or
            a callable returning it: read only when a message needs it (a
            legacy tf_keras optimizer creates it on first access, and
            should within its own name scope).
        loss_scaled: Bool. A loss-scaling optimizer decides itself: apply.
        how_to_raise: String or `None`. How this front end asks for
            `"raise"`, for the warning of a skipped update; `None` skips
            without a warning (XLA compiles no Python callback).
        finite: Boolean scalar or `None`: see `apply_if_finite`.
        names: List of strings or `None`: the variables of `reduced`, named
            by `"raise"`'s error (see `non_finite_error`).

    Returns:
        What `apply` returned, or (`"skip"`) whether it ran.
    """
    if loss_scaled or non_finite == "apply":
        return apply(reduced)
    if non_finite == "raise":
        # The assert runs before any update (tf.function also orders
        # stateful ops in program order), so a failing step leaves the
        # weights as they were.
        check = assert_finite(reduced, _counter(iterations), finite=finite, names=names)
        with tf.control_dependencies([check]):
            return apply(reduced)
    on_skip = None
    if how_to_raise is not None:

        def on_skip():
            _warn_skipped(_counter(iterations), how_to_raise)

    return apply_if_finite(reduced, apply, on_skip=on_skip, finite=finite)


def _counter(iterations):
    return iterations() if callable(iterations) else iterations


def _warn_skipped(iterations, how_to_raise) -> None:
    """Logs, when the step runs, that the update `iterations` was skipped."""

    def warn(update):
        logger.warning(
            "keras_dist: skipped optimizer update %d (0-based): the all-reduced "
            "gradient is not finite (NaN or inf). The weights were not changed. "
            "Usual causes: NaN or inf in the input data, a learning rate that "
            "diverged, a loss that overflows. %s stops training instead.",
            int(update),
            how_to_raise,
        )

    tf.py_function(warn, [tf.convert_to_tensor(iterations)], [])


# What "raise" asserts, found again in TensorFlow's error by `non_finite_error`.
NON_FINITE_MARKER = "keras_dist:non-finite-gradient"
_NON_FINITE = re.compile(
    re.escape(NON_FINITE_MARKER) + r"\] \[(-?\d+)\] \[([0-9 ]*)\] \[names:([^\]]*)\]"
)


def assert_finite(gradients, iterations, finite=None, names=None):
    """An op that fails when any reduced gradient is NaN or infinite.

    The reduced gradients are identical on every replica and worker, so all
    of them stop at the same step. The failure is TensorFlow's
    `InvalidArgumentError` (an assert in the graph); `non_finite_error`
    turns it into one short `FloatingPointError` naming the update and the
    variables.

    Args:
        gradients: List of the reduced gradients.
        iterations: The optimizer's update counter.
        finite: Boolean scalar or `None`: the decision, when the gradients
            alone do not tell it (a sharded update holds slices).
        names: List of strings or `None`: the gradients' variables.
    """
    if finite is None:
        flags = tf.stack(
            [tf.cast(all_finite([gradient]), tf.int32) for gradient in gradients]
        )
        finite = tf.reduce_all(tf.cast(flags, tf.bool))
    else:
        flags = tf.zeros([0], tf.int32)
    return tf.debugging.Assert(
        finite,
        [
            NON_FINITE_MARKER,
            iterations,
            flags,
            "names:" + "|".join(names or []),
        ],
        summarize=max(16, len(gradients)),
    )


def non_finite_error(error) -> FloatingPointError | None:
    """The short error for TensorFlow's error of a failed `assert_finite`,
    or `None` when `error` is another one."""
    found = _NON_FINITE.search(str(getattr(error, "message", error)))
    if found is None:
        return None
    update, flags, names = found.groups()
    flags = [int(flag) for flag in flags.split()]
    names = names.split("|") if names else []
    bad = [name for name, ok in zip(names, flags) if not ok]
    where = ""
    if bad:
        shown = ", ".join(bad[:5]) + (
            f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        )
        where = f" in {shown} ({len(bad)} of {len(names)} variables)"
    return FloatingPointError(
        f"keras_dist: the all-reduced gradient of optimizer update {update} "
        f"(0-based) is not finite (NaN or inf){where}. The weights were not "
        "updated. Usual causes: NaN or inf in the input data, a learning rate "
        "that diverged, a loss that overflows. compile(..., "
        "non_finite_gradients='skip') skips such updates and goes on (the "
        "default); 'apply' applies them, as stock Keras does."
    )


def weight_by_batch_share(gradients, batch_size):
    """Weights this replica's gradients by its share of the global batch.

    Keras scales each replica's mean loss by `1 / R`, so the summed gradient
    is the mean of the replicas' means: right when the replicas' batches are
    equal, wrong otherwise (a global batch of 3 on 2 replicas is split 2 + 1,
    and the lone example would weigh as much as the other two). Multiplying
    replica `i`'s gradient by `R * n_i / N` (`n_i` its examples, `N` their
    sum over replicas) makes the sum the gradient of the global-batch mean,
    as on one device. It costs one all-reduced scalar per step, always
    issued: every replica must make the same collectives, and replicas (and
    workers) trace their steps separately, with static shapes that can
    differ. A replica with no examples contributes zero.

    Equal batches (every step but an uneven last one) give every replica
    the weight 1 exactly, and `gradient * 1` is `gradient` bit for bit: a
    `tf.cond` then passes each gradient through untouched. Two passes over
    every gradient (the product and the `where`) were otherwise on the path
    from the backward pass to the gradient's all-reduce: on a 2-core
    worker they took 30-40 ms of a 21M-parameter MLP's 175 ms step and
    held the largest bucket's all-reduce back until after the backward
    pass (docs/benchmarks/ddp.md, "A traced step").

    Args:
        gradients: List of this replica's gradients (dense or
            `tf.IndexedSlices`).
        batch_size: Scalar tensor, this replica's number of examples.

    Returns:
        The weighted gradients, in order.
    """
    replicas = replica_context().num_replicas_in_sync
    if replicas == 1:
        return list(gradients)
    local = tf.cast(batch_size, tf.float32)
    total = all_reduce(local)
    weight = tf.math.divide_no_nan(local * float(replicas), total)
    equal = tf.equal(weight, 1.0)
    return [
        tf.cond(
            equal,
            lambda gradient=gradient: gradient,
            lambda gradient=gradient: scale_gradient(gradient, weight),
        )
        for gradient in gradients
    ]


def scale_gradient(gradient, weight):
    """`gradient * weight`, a sparse one as its rows; 0 where `weight` is not
    positive."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            scale_gradient(gradient.values, weight),
            gradient.indices,
            gradient.dense_shape,
        )
    gradient = tf.convert_to_tensor(gradient)
    # `where`, not a product alone: an empty replica's gradient can be NaN
    # (a mean over no examples), and NaN * 0 is still NaN.
    return tf.where(weight > 0, gradient * tf.cast(weight, gradient.dtype), 0)
