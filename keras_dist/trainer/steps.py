"""The training step of `DistributedModel`: forward, loss, one aggregation path.

`train_step` computes the loss and gradients as Keras's does, then
`apply_gradients` sends them through the all-reduce hook (or a
`GradientAccumulationOptimizer`'s accumulation) and applies them once.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

from keras_dist import _apply
from keras_dist._compat import keras_src as _compat
from keras_dist._compat import parameter_servers as _ps_compat
from keras_dist.core import aggregation
from keras_dist.core.hooks import AllReduceHook
from keras_dist.core.plain import NoCompression
from keras_dist.optimizers import find_accumulator


class StepMixin:
    """`train_step`, `apply_gradients` and the building of what they use."""

    def train_step(self, data):
        """One training step: forward, loss, then the keras_dist aggregation path.

        Same as `keras.Model.train_step`, except that the gradients go through
        `apply_gradients` (hook, then clipping, then one update).
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            if _compat.call_has_training_arg(self):
                y_pred = self(x, training=True)
            else:
                y_pred = self(x)
            loss = _compat.compute_loss(
                self, x, y, y_pred, sample_weight, training=True
            )
            batch_size = _batch_size(x)
            _compat.update_loss_tracker(self, loss, batch_size)
            if self.optimizer is not None:
                loss = self.optimizer.scale_loss(loss)
        if self.trainable_weights:
            trainable_weights = self.trainable_weights
            gradients = _gradients(tape, loss, trainable_weights)
            self.apply_gradients(gradients, trainable_weights, batch_size=batch_size)
        else:
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=2
            )
        metrics = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if not isinstance(self.all_reduce_hook, NoCompression):
            # Shown by fit's progress bar and recorded in History.
            metrics = {
                **metrics,
                "compression_ratio": self.all_reduce_hook.compression_ratio(),
            }
        return metrics

    def apply_gradients(self, gradients, variables, batch_size=None):
        """Sums `gradients` over replicas with the hook, then applies them once.

        Call it from a custom `train_step` or from a custom training loop
        inside `strategy.run` (replica context). The gradients are this
        replica's gradients of a loss scaled by `1 / num_replicas_in_sync`
        (what Keras losses do under a strategy).

        The arguments are two parallel lists, as `tape.gradient` returns
        them, not Keras's `Optimizer.apply_gradients(grads_and_vars)` list
        of pairs: the model's method takes what the tape gives.

        Args:
            gradients: List of gradients (`None` entries are skipped).
                `tf.IndexedSlices` (embedding gradients) stay sparse with
                the default hook.
            variables: List of the matching trainable variables.
            batch_size: Int, scalar tensor or `None`. The number of examples
                in this replica's batch. Give it when the replicas' batches
                can differ (the last, partial batch of a dataset): each
                replica's gradient is then weighted by its share of the
                global batch, so the update equals one device's (one
                all-reduced scalar per step). `train_step` passes it.
                Defaults to `None` (batches taken as equal).

        Raises:
            RuntimeError: no optimizer (call `compile` first), or the hook
                or the accumulation optimizer is not built and cannot be
                built here (a custom loop under a strategy: call
                `build_all_reduce_hook()` first).
        """
        if getattr(self, "optimizer", None) is None:
            raise RuntimeError(
                "`apply_gradients` needs an optimizer: call `model.compile("
                "optimizer=...)` first."
            )
        variables = list(variables)
        hook = self._training_hook()
        # XLA compiles neither an assert nor a Python callback: under
        # `jit_compile`, "raise" applies and "skip" skips without a log line.
        non_finite = self._keras_dist.non_finite
        if non_finite == "raise" and self.jit_compile:
            non_finite = "apply"
        log_skips = not self.jit_compile
        self._ensure_built(hook, variables)
        accumulator = find_accumulator(self.optimizer)
        if accumulator is not None:
            # Accumulate locally; reduce with the hook only on update steps.
            accumulator.accumulate_and_apply(
                gradients,
                variables,
                hook,
                batch_size,
                non_finite_gradients=non_finite,
                log_skips=log_skips,
            )
        else:
            _apply.reduce_and_apply(
                self.optimizer,
                gradients,
                variables,
                hook,
                batch_size,
                non_finite_gradients=non_finite,
                log_skips=log_skips,
            )

    def _training_hook(self) -> AllReduceHook:
        """The one hook that sums this model's gradients.

        The model's hook, unless the model kept the default and its
        `GradientAccumulationOptimizer` was given one (the optimizer's hook
        is how a plain `keras.Model` gets compression).
        """
        accumulator = find_accumulator(self.optimizer)
        optimizer_hook = None if accumulator is None else accumulator.all_reduce_hook
        if optimizer_hook is None or optimizer_hook is self.all_reduce_hook:
            return self.all_reduce_hook
        if self._keras_dist.user_hook is None:
            return optimizer_hook
        raise ValueError(
            "Both the model and its GradientAccumulationOptimizer have an "
            f"all-reduce hook ({self.all_reduce_hook!r} and {optimizer_hook!r}). "
            "Set the hook in one place: on the model (recommended) or on the "
            "optimizer."
        )

    def _ensure_built(self, hook, variables):
        """Builds `hook` and an accumulation optimizer for `variables`.

        Under a real strategy this must happen in cross-replica context,
        which `fit` provides before tracing (`make_train_function`). Without
        one (default strategy) Keras creates the weights in the first trace
        of the step, so the hook is built there, lifted out of the graph.
        """
        accumulator = find_accumulator(self.optimizer)
        unbuilt_accumulator = accumulator is not None and not accumulator.built
        if aggregation.hook_covers(hook, variables) and not unbuilt_accumulator:
            return
        in_replica_step = not tf.distribute.in_cross_replica_context()
        if tf.distribute.has_strategy() and in_replica_step:
            missing = (
                "The GradientAccumulationOptimizer"
                if aggregation.hook_covers(hook, variables)
                else "The all-reduce hook"
            )
            raise RuntimeError(
                f"{missing} must be built before the first replica step. Call "
                "`model.build_all_reduce_hook()` after `model.compile(...)` and "
                "before `strategy.run` (fit does it)."
            )
        # Under the default strategy an unbuilt accumulation optimizer
        # builds itself in `accumulate_and_apply`, as Keras optimizers do.
        aggregation.build_hook(hook, variables, self.distribute_strategy)

    def build_all_reduce_hook(self) -> None:
        """Builds the hook's state and the optimizer for the trainable variables.

        `fit` builds what it needs itself. Call this after `compile` and
        before a custom training loop that calls `apply_gradients` inside
        `strategy.run`: the hook (even the stateless default) and a
        `GradientAccumulationOptimizer` must be built in cross-replica
        context. It enters the model's strategy scope itself and does nothing
        for what is already built.
        """
        variables = self.trainable_variables
        optimizer = getattr(self, "optimizer", None)
        hook = self.all_reduce_hook if optimizer is None else self._training_hook()
        aggregation.build_hook(hook, variables, self.distribute_strategy)
        if optimizer is not None and not optimizer.built:
            with self.distribute_strategy.scope():
                optimizer.build(variables)


def _gradients(tape, loss, variables):
    """`tape.gradient(loss, variables)`, also for partitioned variables.

    A variable split across ps tasks (`variable_partitioner`) gets the
    gradients of its shards joined along axis 0: an `IndexedSlices` when
    every shard's is one (embeddings), else a dense tensor.
    """
    shards = [_ps_compat.variable_shards(variable) for variable in variables]
    if not any(shards):
        return tape.gradient(loss, variables)
    sources = [[v] if parts is None else parts for v, parts in zip(variables, shards)]
    gradients = tape.gradient(loss, sources)
    return [
        grads[0] if parts is None else _join_shard_gradients(grads, parts)
        for grads, parts in zip(gradients, shards)
    ]


def _join_shard_gradients(gradients, shards):
    if all(gradient is None for gradient in gradients):
        return None
    if all(isinstance(gradient, tf.IndexedSlices) for gradient in gradients):
        offsets, offset = [], 0
        for shard in shards:
            offsets.append(offset)
            offset += int(shard.shape[0])
        return tf.IndexedSlices(
            values=tf.concat([g.values for g in gradients], axis=0),
            indices=tf.concat(
                [
                    tf.cast(g.indices, tf.int64) + start
                    for g, start in zip(gradients, offsets)
                ],
                axis=0,
            ),
            dense_shape=tf.constant([offset, *shards[0].shape[1:]], tf.int64),
        )
    return tf.concat(
        [
            tf.zeros(shard.shape, shard.dtype)
            if gradient is None
            else tf.convert_to_tensor(gradient)
            for gradient, shard in zip(gradients, shards)
        ],
        axis=0,
    )


def _batch_size(x):
    """The batch dimension of `x` (a tensor; `x` may hold numpy arrays)."""
    first = next(t for t in keras.tree.flatten(x) if t is not None)
    return tf.shape(first)[0]
