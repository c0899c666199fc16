"""`GradientAccumulationOptimizer`: big-batch training in small micro-batches."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_dist import _apply, _registration  # noqa: F401 (registers the hooks)
from keras_dist._compat import keras_src as _compat
from keras_dist._validation import check_int
from keras_dist._wrapper import InnerOptimizerWrapper, check_base_kwargs
from keras_dist.core import accumulation, aggregation
from keras_dist.core.optimizer_view import nested_optimizers
from keras_dist.core.plain import NoCompression


@keras.saving.register_keras_serializable(package="keras_dist")
class GradientAccumulationOptimizer(InnerOptimizerWrapper):
    """Accumulates gradients over micro-batches, then applies them once.

    Use it when the batch you want does not fit in memory: `k` micro-steps of
    per-replica batch `b` on `R` replicas give the same update as one step of
    batch `k * b * R` on one device (to float rounding), for any inner
    optimizer. It works where Keras 3's own `gradient_accumulation_steps`
    fails (inside `fit` under `MirroredStrategy`, keras-team/keras#20582):

    - micro-steps add each replica's gradient into replica-local accumulators,
      with **no cross-replica communication**;
    - every `accumulation_steps`-th micro-step reduces the accumulated
      gradients once, through the all-reduce hook, then clips (the inner
      optimizer's `clipnorm` / `global_clipnorm`, on the reduced gradient),
      applies weight decay and updates, all in the inner optimizer, once.

    The design follows optax's `MultiSteps` (a wrapper with the same protocol
    as what it wraps) and Keras's `LossScaleOptimizer`.

    Semantics:

    - `iterations` is the inner optimizer's: the number of **updates**.
      Learning-rate schedules therefore advance once per update.
      `micro_steps` counts micro-batches.
    - The applied gradient is the mean over the accumulated **examples**:
      with `DistributedModel`, each micro-step's gradient counts with its
      number of examples, so a short last batch weighs what its examples
      weigh and the update equals one device's step on the same examples.
      With a plain `keras.Model` (no batch size reaches the optimizer) it is
      the mean of the micro-step gradients.
    - `accumulation_steps` can be assigned while training runs; the train
      function is not retraced. A cycle in progress completes when it has
      the new number of micro-steps.
    - An epoch's last, partial window: `DistributedModel.fit` applies it
      when the epoch's steps end (`apply_pending`), so every epoch equals
      one of batch `k * b * R`, whose last batch is short the same way.
      With a plain `keras.Model` (whose `fit` does not tell the optimizer
      where an epoch ends) it is **carried over** and completes with the
      next micro-steps (next epoch or next `fit`). `reset_accumulation()`
      discards it instead.
    - Sparse gradients (an `Embedding`'s rows): with `accumulation_steps=1`
      the rows reach the inner optimizer as they are, as in stock Keras.
      With more, a window's rows are summed into a dense accumulator: Adam,
      RMSprop, Adagrad and the like then update a row repeated within the
      window with the square of its summed gradient, where stock Keras on
      one batch `k` times larger squares each occurrence; a warning names
      the variable (SGD and Lion agree either way).
    - Checkpoints (`.keras` files, `tf.train.Checkpoint`) save the
      accumulators and the examples they hold (summed over replicas) and
      the count of pending micro-steps; restoring resumes the cycle where
      it stopped, on any number of replicas (each replica gets an equal
      share of the sums).
    - BatchNormalization layers update their moving statistics on every
      micro-batch (batch `b`), not once per effective batch.
    - Mixed precision: with `mixed_float16`, Keras wraps the optimizer as
      `LossScaleOptimizer(GradientAccumulationOptimizer(inner))`.
      `DistributedModel.compile` reorders this to
      `GradientAccumulationOptimizer(LossScaleOptimizer(inner))`, so the loss
      scale is checked on the all-reduced, accumulated gradient and a
      non-finite update is skipped on every replica alike. With a plain
      `keras.Model` the Keras order stays (a micro-batch with non-finite
      gradients on the first replica is dropped, as stock Keras drops a step).

    Args:
        inner_optimizer: `keras.optimizers.Optimizer`. The optimizer that
            applies the accumulated gradients.
        accumulation_steps: Int >= 1. Micro-steps per update. Defaults to `4`.
        all_reduce_hook: `keras_dist.compression.AllReduceHook` or `None`. How
            the accumulated gradients are summed over replicas on update
            steps. With `DistributedModel`, leave it `None` and set the hook on
            the model. Defaults to `None` (plain sum).
        name: String or `None`. Name of the optimizer.
        **kwargs: Base optimizer arguments, accepted only at their Keras
            default values: `clipnorm`, `global_clipnorm`, `clipvalue`,
            `weight_decay`, `use_ema`, `ema_momentum`,
            `ema_overwrite_frequency`, `loss_scale_factor` and
            `gradient_accumulation_steps` belong on the `inner_optimizer`.
            Any other value, or any other argument, raises `ValueError`.

    Raises:
        TypeError: `inner_optimizer` is not a Keras optimizer instance, or
            `accumulation_steps` is not an int.
        ValueError: `accumulation_steps` < 1, `inner_optimizer` already
            accumulates (a wrapped `GradientAccumulationOptimizer` or Keras's
            `gradient_accumulation_steps`), or a refused argument. When the
            optimizer is built: `inner_optimizer` was created outside the
            strategy scope the model trains under.

    Example:

    ```python
    with strategy.scope():
        model = keras_dist.DistributedModel(inputs, outputs)
        model.compile(
            optimizer=keras_dist.GradientAccumulationOptimizer(
                keras.optimizers.Adam(1e-3), accumulation_steps=8
            ),
            loss="sparse_categorical_crossentropy",
        )
    model.fit(dataset.batch(micro_batch * strategy.num_replicas_in_sync))
    ```
    """

    def __init__(
        self,
        inner_optimizer,
        accumulation_steps=4,
        all_reduce_hook=None,
        name=None,
        **kwargs,
    ):
        check_base_kwargs("GradientAccumulationOptimizer", kwargs)
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "`inner_optimizer` must be a `keras.optimizers.Optimizer` "
                f"instance. Received: inner_optimizer={inner_optimizer!r}. "
                'Pass e.g. `keras.optimizers.Adam(1e-3)` (strings like "adam" '
                "are not accepted here)."
            )
        if find_accumulator(inner_optimizer) is not None:
            raise ValueError(
                "`inner_optimizer` already accumulates gradients (a "
                "GradientAccumulationOptimizer is inside it). Wrap the plain "
                "optimizer once and set `accumulation_steps` to the product. "
                f"Received: inner_optimizer={inner_optimizer!r}."
            )
        if getattr(inner_optimizer, "gradient_accumulation_steps", None):
            raise ValueError(
                "`inner_optimizer` uses Keras's own `gradient_accumulation_steps`"
                f"={inner_optimizer.gradient_accumulation_steps}, which fails under "
                "tf.distribute (keras-team/keras#20582). Remove it and use "
                "`accumulation_steps` here."
            )
        accumulation_steps = _check_steps(accumulation_steps)
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self._initial_accumulation_steps = int(accumulation_steps)
        self._hook = (
            None if all_reduce_hook is None else aggregation.check_hook(all_reduce_hook)
        )
        _compat.set_untracked_attribute(self, "_default_hook", None)

    # --- State ----------------------------------------------------------------

    def build(self, var_list):
        var_list = list(var_list)
        strategy = tf.distribute.get_strategy()
        if _compat.optimizer_strategy(self.inner_optimizer) is not strategy:
            # Its variables (iterations, slots) would not be mirrored: every
            # replica would advance its iteration counter separately.
            raise ValueError(
                "The `inner_optimizer` was created outside the strategy scope "
                "the model trains under. Received: inner_optimizer="
                f"{self.inner_optimizer!r}. Create it inside "
                "`with strategy.scope():`, together with the model."
            )
        self._steps_variable = self.add_variable(
            shape=(),
            dtype="int64",
            initializer=keras.initializers.Constant(self._initial_accumulation_steps),
            aggregation="only_first_replica",
            name="accumulation_steps",
        )
        self._pending = self.add_variable(
            shape=(),
            dtype="int64",
            initializer="zeros",
            aggregation="only_first_replica",
            name="pending_micro_steps",
        )
        self._micro_steps = self.add_variable(
            shape=(),
            dtype="int64",
            initializer="zeros",
            aggregation="only_first_replica",
            name="micro_steps",
        )
        self._accumulators = [
            _compat.add_replica_local_variable(self, reference, name=f"accumulator_{i}")
            for i, reference in enumerate(var_list)
        ]
        # Examples accumulated on this replica (see `accumulate_and_apply`).
        self._examples = _compat.add_replica_local_variable(
            self, tf.zeros((), tf.float32), name="accumulated_examples"
        )
        _compat.set_untracked_attribute(
            self,
            "_cycle",
            accumulation.AccumulationCycle(
                self._accumulators,
                self._examples,
                self._pending,
                self._micro_steps,
                self._steps_variable,
                var_list,
            ),
        )
        # Under a periodic optimizer (local SGD) a window's mean is each
        # replica's own.
        self._cycle.local = any(
            callable(getattr(nested, "apply_locally", None))
            for nested in nested_optimizers(self.inner_optimizer)
        )
        self.inner_optimizer.build(var_list)
        # Built here, in cross-replica context: a hook's state cannot be
        # created inside a replica step. `DistributedModel` passes the hook
        # it trains with to `accumulate_and_apply` and builds it itself.
        aggregation.build_hook(
            self._plain_hook(), var_list, tf.distribute.get_strategy()
        )
        super().build(var_list)

    def set_weights(self, weights):
        """Sets every variable of `variables`: this wrapper's and the inner
        optimizer's, in that order (Keras's base method sets only the
        wrapper's own)."""
        if not self.built:
            raise ValueError(
                "You are calling `set_weights()` on an optimizer that has not "
                "yet been built. Please call "
                "`optimizer.build(trainable_variables)` to create the "
                "optimizer weights before calling `set_weights()`."
            )
        variables = self.variables
        weights = list(weights)
        if len(weights) != len(variables):
            raise ValueError(
                f"`weights` must hold one value per variable of `variables` "
                f"({len(variables)}: this optimizer's, then the inner "
                f"optimizer's). Received: {len(weights)} values."
            )
        for variable, weight in zip(variables, weights):
            if tuple(variable.shape) != tuple(weight.shape):
                raise ValueError(
                    f"Optimizer variable {variable.path} has shape "
                    f"{tuple(variable.shape)} not compatible with provided "
                    f"weight shape {tuple(weight.shape)}."
                )
            variable.assign(weight)

    @property
    def micro_steps(self):
        """Number of micro-steps (gradient batches) seen so far."""
        self._check_built("micro_steps")
        return self._micro_steps

    @property
    def pending_micro_steps(self):
        """Micro-steps accumulated since the last update."""
        self._check_built("pending_micro_steps")
        return self._pending

    @property
    def all_reduce_hook(self):
        """The hook given to the constructor, or `None`."""
        return self._hook

    def _plain_hook(self):
        """The hook `apply` uses: the constructor's, or a plain sum.

        `apply` is what a plain `keras.Model` calls; `DistributedModel`
        calls `accumulate_and_apply` with its own hook instead.
        """
        if self._hook is None:
            if self._default_hook is None:
                _compat.set_untracked_attribute(self, "_default_hook", NoCompression())
            return self._default_hook
        return self._hook

    @property
    def accumulation_steps(self) -> int:
        """Micro-steps per update. Assignable while training runs."""
        if not self.built:
            return self._initial_accumulation_steps
        return int(self._steps_variable.numpy())

    @accumulation_steps.setter
    def accumulation_steps(self, value):
        value = _check_steps(value)
        self._initial_accumulation_steps = int(value)
        if self.built:
            self._steps_variable.assign(int(value))

    def reset_accumulation(self):
        """Discards the gradients accumulated since the last update."""
        self._check_built("reset_accumulation")
        self._cycle.reset()

    def _check_built(self, what):
        if not self.built:
            raise RuntimeError(
                f"`{what}` needs a built optimizer: compile the model and train "
                "(or call `optimizer.build(model.trainable_variables)`) first."
            )

    # --- Update -----------------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        """Accumulates `grads`; applies the mean on every k-th call.

        Called in replica context by `apply_gradients` (stock Keras
        `train_step`). Uses the constructor's hook, or a plain sum, and
        applies an update as the inner optimizer would, NaN included (a
        `DistributedModel` skips it by default: see its `compile`).
        """
        if trainable_variables is None:
            trainable_variables = _compat.optimizer_trainable_variables(self)
        self.accumulate_and_apply(grads, trainable_variables, self._plain_hook())

    def accumulate_and_apply(
        self,
        grads,
        trainable_variables,
        hook,
        batch_size=None,
        non_finite_gradients="apply",
        log_skips=True,
    ):
        """Accumulates `grads`; on every k-th call reduces them with `hook`
        and applies their mean with the inner optimizer.

        The mean is over examples: each micro-step's gradient counts with its
        number of examples (`batch_size`), so a short last batch weighs what
        its examples weigh, and the update equals one device's step on all
        the accumulated examples. Without `batch_size` every micro-step
        counts the same.

        Runs in replica context. `DistributedModel` calls it with the hook it
        trains with; `apply` calls it with the constructor's hook.

        Args:
            grads: List of this replica's gradients (`None` entries skipped,
                with Keras's warning; all `None` is Keras's `ValueError`).
            trainable_variables: List of the matching variables.
            hook: The built `AllReduceHook` that sums the accumulated
                gradients over replicas on update steps.
            batch_size: Int, scalar tensor or `None`. This replica's number
                of examples in the micro-batch. Defaults to `None` (each
                micro-step counts as one).
            non_finite_gradients: String: what an update whose reduced
                gradient is not finite does, `"skip"`, `"raise"` or `"apply"`
                (see `DistributedModel.compile`). Defaults to `"apply"`.
            log_skips: Bool. Log a skipped update (`False` under XLA).
                Defaults to `True`.
        """
        trainable_variables = list(trainable_variables)
        grads = list(grads)
        if not grads:
            # As Keras's `apply`: nothing to apply.
            return
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        grads, variables = _apply.filter_empty_gradients(grads, trainable_variables)
        for variable in variables:
            self._index(variable)
        _apply.warn_of_summed_rows(
            self, grads, variables, self._initial_accumulation_steps
        )
        apply = self._applier(hook, non_finite_gradients, log_skips)
        self._cycle.accumulate(grads, variables, apply, batch_size=batch_size)

    def apply_pending(self, hook, non_finite_gradients="apply", log_skips=True):
        """Applies the micro-steps accumulated since the last update, if any.

        The mean over their examples, reduced with `hook` and applied by the
        inner optimizer, as a full cycle would. `DistributedModel.fit` calls
        it when an epoch's steps end, so an epoch that is not a multiple of
        `accumulation_steps` micro-batches ends with an update on its last,
        shorter window, as one batch `accumulation_steps` times larger
        would. Runs in replica context (`strategy.run`); does nothing when
        nothing is pending.

        Args:
            hook: The built `AllReduceHook` the model trains with.
            non_finite_gradients: String: `"apply"`, `"skip"` or
                `"raise"`, as `DistributedModel(non_finite_gradients=...)`.
            log_skips: Bool: whether a skipped update is logged.
        """
        self._check_built("apply_pending")
        self._cycle.apply_pending(self._applier(hook, non_finite_gradients, log_skips))

    @property
    def pending_variables(self):
        """Positions (in the built variable list) of the variables an update
        of the current window applies to (those that got gradients in the
        traced step), or `None` before the step is traced. A backup records
        them, so that a resumed run can close the window before it traces
        its own step."""
        variables = getattr(self._cycle, "last_variables", None) if self.built else None
        if variables is None:
            return None
        return [self._cycle.index(v) for v in variables]

    def restore_pending_variables(self, positions) -> None:
        """Sets `pending_variables` from a backup where no step was traced."""
        if not self.built or getattr(self._cycle, "last_variables", None) is not None:
            return
        built = _compat.optimizer_trainable_variables(self)
        self._cycle.last_variables = [built[i] for i in positions if i < len(built)]

    def _applier(self, hook, non_finite_gradients, log_skips):
        def apply(mean_grads, variables, batch_size=None):
            _apply.reduce_and_apply(
                self.inner_optimizer,
                mean_grads,
                variables,
                hook,
                batch_size=batch_size,
                non_finite_gradients=non_finite_gradients,
                log_skips=log_skips,
            )

        return apply

    def _index(self, variable):
        try:
            return self._cycle.index(variable)
        except KeyError:
            raise ValueError(
                f"Variable {variable.path!r} was not known to the optimizer when "
                "it was built. Build it on all trainable variables (compile the "
                "model, or `optimizer.build(model.trainable_variables)`)."
            ) from None

    # --- Serialization ----------------------------------------------------------

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(
                self.inner_optimizer
            ),
            "accumulation_steps": self._initial_accumulation_steps,
            "all_reduce_hook": keras.saving.serialize_keras_object(self._hook),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        hook = keras.saving.deserialize_keras_object(
            config.pop("all_reduce_hook", None), custom_objects=custom_objects
        )
        return cls(inner, all_reduce_hook=hook, **config)


def _check_steps(value) -> int:
    # Bounded: an absurd value (2**63) would otherwise fail only when the
    # int64 counter is built.
    return check_int(
        "accumulation_steps",
        value,
        minimum=1,
        maximum=10**9,
        hint="1 means no accumulation.",
    )


def find_accumulator(optimizer):
    """Returns the GradientAccumulationOptimizer in `optimizer`'s wrappers.

    Looks through loss-scaling and other wrappers (`inner_optimizer`);
    returns `None` when there is none.
    """
    for nested in nested_optimizers(optimizer):
        if isinstance(nested, GradientAccumulationOptimizer):
            return nested
    return None


def check_one_accumulator(optimizer, user: str) -> None:
    """Refuses accumulation by another wrapper than a GradientAccumulationOptimizer.

    `user` (e.g. `"AutoScaleBatch"`) counts and changes the global batch
    through `find_accumulator`; a `ShardedOptimizer(accumulation_steps=k)`
    makes each update's batch k times larger where it cannot see or change it.

    Raises:
        ValueError: a nested optimizer accumulates on its own.
    """
    accumulator = find_accumulator(optimizer)
    for nested in nested_optimizers(optimizer):
        steps = getattr(nested, "accumulation_steps", 1)
        if nested is not accumulator and isinstance(steps, int) and steps > 1:
            name = type(nested).__name__
            raise ValueError(
                f"{user} counts and grows the global batch through a "
                f"`keras_dist.GradientAccumulationOptimizer`; {name}("
                f"accumulation_steps={steps}) accumulates on its own. Received: "
                f"optimizer={type(optimizer).__name__}. Use "
                f"`keras_dist.GradientAccumulationOptimizer({name}(inner), "
                f"accumulation_steps={steps})` instead."
            )
