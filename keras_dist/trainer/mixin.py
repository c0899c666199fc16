"""`DistributedTrainerMixin`: `DistributedModel`'s training logic over any
Keras TensorFlow trainer, put together from one mixin per concern."""

from __future__ import annotations

import dataclasses
import logging

import keras

from keras_dist import state
from keras_dist._compat import keras_src as _compat
from keras_dist.core import aggregation
from keras_dist.core.hooks import AllReduceHook
from keras_dist.core.optimizer_view import nested_optimizers
from keras_dist.core.plain import NoCompression
from keras_dist.optimizers import GradientAccumulationOptimizer
from keras_dist.parameter_server import training as _parameter_server
from keras_dist.sharding import ShardedOptimizer
from keras_dist.trainer.fit import FitMixin
from keras_dist.trainer.functions import FunctionsMixin, check_scopes
from keras_dist.trainer.saving import SavingMixin
from keras_dist.trainer.steps import StepMixin

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainerState:
    """What keras_dist keeps on a `DistributedModel`, in one place.

    Attributes:
        hook: The `AllReduceHook` the model trains with (the user's, or a
            `NoCompression`).
        user_hook: The hook the user gave, or `None` (saved in the config).
        non_finite: String, `compile`'s `non_finite_gradients`.
        fitting: Bool. Whether the model's `fit` is running.
        evaluating: Bool. Whether its `evaluate` is (also inside `fit`).
        saveable: The `HookStateSaveable` of `all_reduce_hook_state`.
        pending_function: The function that applies an accumulation's
            pending micro-steps at the end of an epoch, once made.
    """

    hook: object = None
    user_hook: object = None
    non_finite: str = "skip"
    fitting: bool = False
    evaluating: bool = False
    saveable: object = None
    pending_function: object = None


class DistributedTrainerMixin(
    FitMixin,
    FunctionsMixin,
    StepMixin,
    SavingMixin,
    _compat.MultiWorkerBuildFix,
    _compat.EpochStepsEnd,
):
    """The training logic of `DistributedModel`, over any Keras TF trainer.

    `DistributedModel` is this mixin over `keras.Model`. It is a separate
    class so the same methods can sit over Keras's `TensorFlowTrainer` in
    Keras's own trainer tests (`tests/keras_conformance`); use
    `DistributedModel` in your code.
    """

    def __init__(self, *args, all_reduce_hook=None, **kwargs):
        # One untracked object holds what keras_dist keeps on the model: the
        # hook is not a layer, so it must not show up in `model.layers`,
        # summaries or weight lists.
        _compat.set_untracked_attribute(self, "_keras_dist", TrainerState())
        super().__init__(*args, **kwargs)
        self._set_hook(all_reduce_hook)

    def _set_hook(self, hook):
        if hook is not None:
            aggregation.check_hook(hook)
        self._keras_dist.user_hook = hook
        self._keras_dist.hook = NoCompression() if hook is None else hook
        # The hook's per-replica state (error feedback, warm-start factors)
        # is saved with `tf.train.Checkpoint(model=...)`.
        _compat.track_checkpoint_dependency(
            self, "all_reduce_hook", self._keras_dist.hook
        )

    def training_state(self):
        """Returns the inventory of this model's training state.

        Every variable a training step reads or writes (the model's, the
        optimizer's, the hooks' state, gradient statistics, metric sums)
        and the callbacks' registered state, each with its placement and
        its rule for another replica count: what `BackupAndRestore` saves
        and restores.

        Returns:
            A `keras_dist.core.inventory.StateInventory`.
        """
        return state.training_state(self)

    @property
    def all_reduce_hook(self) -> AllReduceHook:
        """The `AllReduceHook` that sums gradients across replicas."""
        return self._keras_dist.hook

    def register_all_reduce_hook(self, hook: AllReduceHook) -> None:
        """Replaces the all-reduce hook.

        Can be called before or between `fit` calls; the train function is
        rebuilt on the next `fit`. The new hook starts with fresh state.

        Args:
            hook: `keras_dist.compression.AllReduceHook` instance.

        Raises:
            TypeError: `hook` is not an `AllReduceHook` instance.
            RuntimeError: called while `fit` runs (from a callback).
        """
        if self._keras_dist.fitting:
            raise RuntimeError(
                "`register_all_reduce_hook` cannot be called while `fit` runs "
                "(from a callback): the compiled train step uses the current "
                "hook until `fit` returns. Call it between `fit` calls."
            )
        self._set_hook(aggregation.check_hook(hook, argument="hook"))
        self.train_function = None
        _parameter_server.reset_functions(self)

    def compile(
        self,
        optimizer="rmsprop",
        *args,
        auto_scale_loss=True,
        non_finite_gradients="skip",
        **kwargs,
    ):
        """Configures the model for training; see `keras.Model.compile`.

        One difference: under the `mixed_float16` policy a
        `GradientAccumulationOptimizer` keeps the outermost place and the
        loss scaling goes inside it (`GradientAccumulationOptimizer(
        LossScaleOptimizer(inner))`), so the loss scale is checked on the
        reduced, accumulated gradient, identically on every replica.

        Args:
            optimizer: As in `keras.Model.compile`: a Keras optimizer, or the
                name of one. Defaults to `"rmsprop"`.
            *args: Further positional arguments of `keras.Model.compile`.
            auto_scale_loss: Bool. As in Keras: under `mixed_float16`, add
                loss scaling (inside a `GradientAccumulationOptimizer`, see
                above). Defaults to `True`.
            non_finite_gradients: String, what an update does when the
                all-reduced gradient holds NaN or inf (NaN in the data can
                leave the logged loss finite while it would turn the weights
                into NaN). `"skip"`: no update (weights, optimizer state and
                `iterations` unchanged), a warning names the update, training
                goes on, and the step's logs carry its loss as computed, so
                `keras.callbacks.TerminateOnNaN` stops a run whose loss is
                not finite, as with stock Keras. `"raise"`: stop with an
                error naming the update, before the weights change (with
                `jit_compile=True`, which has no assert op, `"apply"`).
                `"apply"`: apply it, as stock Keras does. Under loss scaling
                the `LossScaleOptimizer` skips such steps itself. `"skip"`
                and `"raise"` cost one pass over the reduced gradient per
                update. Defaults to `"skip"`.
            **kwargs: Further arguments of `keras.Model.compile` (`loss`,
                `metrics`, `steps_per_execution`, ...).

        Raises:
            RuntimeError: under `mixed_float16`, a
                `GradientAccumulationOptimizer` whose inner optimizer has no
                loss scaling is already built, so it cannot be added.
        """
        optimizer = _loss_scaling_inside(keras.optimizers.get(optimizer))
        self._keras_dist.non_finite = aggregation.check_non_finite_gradients(
            non_finite_gradients
        )
        wrapper = _innermost_wrapper(optimizer)
        if (
            auto_scale_loss
            and wrapper is not None
            and self.dtype_policy.name == "mixed_float16"
        ):
            if not isinstance(
                wrapper.inner_optimizer, keras.optimizers.LossScaleOptimizer
            ):
                if wrapper.built:
                    raise RuntimeError(
                        f"Under mixed_float16 the {type(wrapper).__name__}'s "
                        "inner optimizer needs loss scaling, but it is already "
                        f"built. Pass `{type(wrapper).__name__}("
                        "keras.optimizers.LossScaleOptimizer(inner))` yourself."
                    )
                logger.info(
                    "mixed_float16: wrapping the %s's inner optimizer in a "
                    "LossScaleOptimizer.",
                    type(wrapper).__name__,
                )
                wrapper.inner_optimizer = keras.optimizers.LossScaleOptimizer(
                    wrapper.inner_optimizer, name="loss_scale_optimizer"
                )
            auto_scale_loss = False
        super().compile(optimizer, *args, auto_scale_loss=auto_scale_loss, **kwargs)
        check_scopes(self)
        _parameter_server.reset_functions(self)

    def compile_from_config(self, config):
        # Keras skips compiling on load when `compile` is overridden (ours
        # is); DistributedModel.compile takes the same arguments, so compile.
        if type(self).compile is not DistributedTrainerMixin.compile:
            return super().compile_from_config(config)
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)
        return None


# keras_dist's optimizer wrappers: loss scaling goes inside the innermost,
# where the reduced gradient is checked and unscaled.
_WRAPPERS = (GradientAccumulationOptimizer, ShardedOptimizer)


def _innermost_wrapper(optimizer):
    """The innermost keras_dist wrapper among `optimizer` and what it wraps."""
    wrappers = [o for o in nested_optimizers(optimizer) if isinstance(o, _WRAPPERS)]
    return wrappers[-1] if wrappers else None


def _loss_scaling_inside(optimizer):
    """`LossScaleOptimizer(wrapper(...inner))` reordered to `wrapper(...
    LossScaleOptimizer(inner))` for keras_dist's wrappers.

    `apply_gradients` goes through `GradientAccumulationOptimizer` and
    `ShardedOptimizer` and applies with their inner optimizer, so an outer
    `LossScaleOptimizer` would scale the loss and never unscale the update
    (its `apply` is not on that path). Inside the innermost wrapper, it
    checks and unscales the reduced (accumulated) gradient, as `compile`
    arranges under `mixed_float16`.
    """
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer
    wrapper = _innermost_wrapper(optimizer.inner_optimizer)
    if wrapper is None:
        return optimizer
    if optimizer.built or wrapper.built:
        raise RuntimeError(
            f"`optimizer` is a built `LossScaleOptimizer` around a "
            f"`{type(wrapper).__name__}`; DistributedModel applies loss "
            "scaling inside it and cannot reorder built optimizers. Received: "
            f"optimizer={optimizer!r}. Pass `{type(wrapper).__name__}("
            "keras.optimizers.LossScaleOptimizer(inner))` instead."
        )
    logger.info(
        "Moving the LossScaleOptimizer inside the %s (it checks and unscales "
        "the reduced gradient).",
        type(wrapper).__name__,
    )
    wrapper.inner_optimizer = keras.optimizers.LossScaleOptimizer(
        wrapper.inner_optimizer,
        initial_scale=optimizer.initial_scale,
        dynamic_growth_steps=optimizer.dynamic_growth_steps,
        name=optimizer.name,
    )
    return optimizer.inner_optimizer
