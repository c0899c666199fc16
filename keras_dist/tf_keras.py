"""keras_dist's pieces for tf_keras (Keras 2) models.

tensorflow-model-optimization (pruning, quantization-aware training, weight
clustering) accepts only tf_keras models, and so did Horovod. This module
gives those models keras_dist's all-reduce hooks (`keras_dist.compression`,
the same classes) and gradient accumulation under `MirroredStrategy` and
`MultiWorkerMirroredStrategy`, through the same pure-TensorFlow core as the
Keras 3 pieces (`keras_dist.core`: aggregation, accumulation, hooks). It
imports no Keras 3 module itself (with `TF_USE_LEGACY_KERAS=1`, the usual
setting of tf_keras programs, `import keras_dist.tf_keras` loads none).

Needs `pip install ".[tfmot]"` in the keras_dist clone (tf_keras, and tfmot
for the pruning and quantization pieces). `import keras_dist` imports neither.

Example (Horovod's `hvd.DistributedOptimizer(opt, compression=fp16,
backward_passes_per_step=2)`):

```python
import tensorflow as tf
import tf_keras

import keras_dist
from keras_dist.tf_keras import DistributedOptimizer

strategy = keras_dist.auto_strategy()
with strategy.scope():
    model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(4,))])
    model.compile(
        optimizer=DistributedOptimizer(
            tf_keras.optimizers.Adam(0.01),
            all_reduce_hook=keras_dist.compression.FP16(),
            accumulation_steps=2,
        ),
        loss="mse",
    )
model.fit(tf.zeros((64, 4)), tf.zeros((64, 1)), batch_size=16, verbose=0)
```
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
import weakref

import tensorflow as tf

try:
    import tf_keras
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(
        "keras_dist.tf_keras needs the tf_keras package (Keras 2), which is "
        'not installed. Install it with `pip install ".[tfmot]"` in the '
        "keras_dist clone."
    ) from error

from keras_dist._backend import legacy_keras
from keras_dist._compat import tf_keras_src
from keras_dist._validation import check_int
from keras_dist.core import accumulation, aggregation
from keras_dist.core.hooks import AllReduceHook
from keras_dist.core.optimizer_view import OptimizerView, view_of
from keras_dist.core.plain import NoCompression

__all__ = ["DistributedOptimizer", "UpdatePruningStep", "import_tfmot"]

logger = logging.getLogger(__name__)

_LEGACY_KERAS_VAR = "TF_USE_LEGACY_KERAS"


def import_tfmot():
    """Imports tensorflow-model-optimization without switching `tf.keras`.

    tfmot sets `TF_USE_LEGACY_KERAS=1` when it is imported. In a process
    that has not touched `tf.keras` yet, tfmot's own first access then binds
    `tf.keras` to tf_keras for the rest of the process, so Keras 3 code that
    uses `tf.keras.layers...` afterwards gets Keras 2 layers and fails.
    This resolves `tf.keras` first (Keras 3, unless the process chose
    otherwise), imports tfmot, and puts the variable back. tfmot itself
    uses tf_keras either way. `import keras_dist.tf_keras` calls it when
    tfmot is installed and the process runs Keras 3 (no
    `TF_USE_LEGACY_KERAS`); later `import tensorflow_model_optimization`
    gets the same module.

    Returns:
        The `tensorflow_model_optimization` module.

    Raises:
        ImportError: tfmot is not installed.
    """
    previous = os.environ.get(_LEGACY_KERAS_VAR)
    getattr(tf.keras, "version", None)  # resolve tf.keras as this process sees it
    try:
        import tensorflow_model_optimization as tfmot
    except ImportError as error:
        raise ImportError(
            "tensorflow-model-optimization is not installed. Install it with "
            '`pip install ".[tfmot]"` in the keras_dist clone.'
        ) from error
    finally:
        if previous is None:
            os.environ.pop(_LEGACY_KERAS_VAR, None)
        else:
            os.environ[_LEGACY_KERAS_VAR] = previous
    return tfmot


if importlib.util.find_spec("tensorflow_model_optimization") is not None and (
    not legacy_keras()
):
    # In a Keras 3 process, import tfmot now, the safe way, so a later
    # `import tensorflow_model_optimization` does not switch `tf.keras`. In
    # tf_keras mode there is nothing to protect, and tfmot (which loads
    # Keras 3 modules of its own) is imported only when used.
    import_tfmot()

_OPTIMIZER_TYPES = (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer)


def DistributedOptimizer(  # a factory, named like the class it returns
    optimizer,
    all_reduce_hook: AllReduceHook | None = None,
    accumulation_steps: int = 1,
    non_finite_gradients: str = "skip",
):
    """Wraps a tf_keras optimizer so it sums gradients through a hook.

    Returns `optimizer` itself, made distributed: it stays an `Adam` (or
    whatever it is), with everything it holds (a learning-rate schedule of
    your own, callable hyperparameters, overridden methods), as Horovod's
    `DistributedOptimizer` wrapped the instance. Its `apply_gradients`:

    1. with `accumulation_steps=k > 1`, adds each micro-step's gradient into
       replica-local accumulators, with no communication, and goes on only
       every k-th call, with the mean over the accumulated examples;
    2. sums the gradients over replicas and workers **once**, through
       `all_reduce_hook` (compression);
    3. applies them with the wrapped optimizer's own `apply_gradients`, whose
       `clipnorm` / `clipvalue` / `global_clipnorm` then act on the reduced
       gradient, and whose `iterations` counts **updates**.

    Under `MirroredStrategy` and `MultiWorkerMirroredStrategy` the update
    equals one big batch on one device (to float rounding) for uncompressed
    hooks. Create the optimizer inside the strategy's `scope()`, before
    `compile`. Its variables (the accumulators, the hook's state) are saved
    by `tf.train.Checkpoint` and tf_keras checkpoints with the optimizer.

    Args:
        optimizer: A `tf_keras.optimizers.Optimizer`, not yet used (a
            `tf_keras.optimizers.legacy` one works without accumulation).
        all_reduce_hook: A `keras_dist.compression.AllReduceHook` instance,
            or `None` for an uncompressed sum. Defaults to `None`.
        accumulation_steps: Int >= 1. Micro-steps per update (Horovod's
            `backward_passes_per_step`). Defaults to `1`.
        non_finite_gradients: String, what an update does when the reduced
            gradient holds NaN or inf: `"skip"` (no update, a warning names
            it, training goes on), `"raise"` (stop with an error naming the
            update, before the weights change) or `"apply"` (as tf_keras
            does). Defaults to `"skip"`.

    Returns:
        The wrapped optimizer.

    Raises:
        TypeError: `optimizer` is not a tf_keras optimizer (a Keras 3
            optimizer: use `keras_dist.GradientAccumulationOptimizer` and
            `keras_dist.DistributedModel`), or `all_reduce_hook` is not an
            `AllReduceHook` instance.
        ValueError: `accumulation_steps` < 1, or > 1 with a legacy
            optimizer, `optimizer` has already been used, or
            `non_finite_gradients` is not one of the three.

    Wrapping before or after `model.compile(optimizer=optimizer)` is the
    same: the instance the model holds is the one made distributed. Passed
    to a Keras 3 model instead, it is refused by Keras ("Could not interpret
    optimizer identifier"), and the message then says that tf_keras and
    Keras 3 were mixed and what to use.
    """
    if not isinstance(optimizer, _OPTIMIZER_TYPES):
        hint = ""
        if type(optimizer).__module__.startswith("keras"):
            hint = (
                " A Keras 3 optimizer trains Keras 3 models: use "
                "`keras_dist.DistributedModel` and "
                "`keras_dist.GradientAccumulationOptimizer` instead."
            )
        raise TypeError(
            "`optimizer` must be a tf_keras optimizer "
            "(`tf_keras.optimizers.Adam(...)`, or one of "
            "`tf_keras.optimizers.legacy`). Received: optimizer="
            f"{optimizer!r} of type {type(optimizer).__module__}."
            f"{type(optimizer).__name__}.{hint}"
        )
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError(
            f"`optimizer` is already a DistributedOptimizer: {optimizer!r}. "
            "Wrap the plain optimizer once."
        )
    if all_reduce_hook is not None:
        aggregation.check_hook(all_reduce_hook)
    accumulation_steps = check_int(
        "accumulation_steps", accumulation_steps, minimum=1, maximum=10**9
    )
    aggregation.check_non_finite_gradients(non_finite_gradients)
    if (
        accumulation_steps > 1
        and not tf.compat.v1.executing_eagerly_outside_functions()
    ):
        # Its micro-step adds to the accumulators and decides in separate
        # ops; a TF1 session runs only what `apply_gradients` returns.
        raise ValueError(
            "`accumulation_steps` > 1 needs TensorFlow 2 execution (eager or "
            "tf.function), not a TF1 graph. Received: accumulation_steps="
            f"{accumulation_steps} inside a `tf.Graph`."
        )
    if accumulation_steps > 1 and isinstance(
        optimizer, tf_keras.optimizers.legacy.Optimizer
    ):
        # Measured: legacy Adam's fused update fails inside the update's
        # tf.cond ("beta1_power is not a scalar").
        raise ValueError(
            "`accumulation_steps` > 1 needs a current tf_keras optimizer; the "
            f"legacy ones do not apply inside its update. Received: "
            f"{type(optimizer).__module__}.{type(optimizer).__name__} with "
            f"accumulation_steps={accumulation_steps}. Use "
            f"`tf_keras.optimizers.{type(optimizer).__name__}`."
        )
    used = _built(optimizer)
    iterations = tf_keras_src.created_iterations(optimizer)
    if not used and iterations is not None and tf.executing_eagerly():
        # In a TF1 graph the counter cannot be read; an unbuilt optimizer
        # has applied nothing.
        used = int(iterations.numpy()) != 0
    if used:
        raise ValueError(
            "`optimizer` has already been used (it has state that wrapping "
            f"would lose). Received: {optimizer!r}. Wrap a new optimizer, "
            "before `compile`."
        )
    if accumulation_steps > 1:
        _guard_stock_pruning_callback()
    optimizer.__class__ = _distributed_class(type(optimizer))
    optimizer._keras_dist_hook = (
        NoCompression() if all_reduce_hook is None else all_reduce_hook
    )
    object.__setattr__(
        optimizer,
        "_keras_dist",
        _Settings(steps=accumulation_steps, non_finite=non_finite_gradients),
    )
    return optimizer


def _built(optimizer) -> bool:
    if isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer):
        return bool(optimizer._slots)
    return bool(getattr(optimizer, "_built", False))


@dataclasses.dataclass
class _Settings:
    """What `DistributedOptimizer` adds to an optimizer, besides its hook.

    Attributes:
        steps: Int. Micro-steps per update.
        non_finite: String. See `non_finite_gradients`.
        cycle: The `AccumulationCycle`, once built (`steps` > 1).
    """

    steps: int = 1
    non_finite: str = "apply"
    cycle: object = None


class _DistributedMixin:
    """The `apply_gradients` of `DistributedOptimizer`, over any tf_keras one.

    The hook is a tracked attribute (`tf.train.Checkpoint` saves its state
    with the optimizer); the rest is one untracked `_Settings`. An optimizer
    made by `from_config` of this class (tf_keras's `clone_and_build_model`)
    trains as the plain optimizer would: a plain sum, no accumulation, a
    non-finite update applied.
    """

    def __str__(self) -> str:
        # Keras 3's `compile` puts it in its refusal ("Could not interpret
        # optimizer identifier: ..."): say what was mixed up.
        name = type(self).__name__
        return (
            f"<tf_keras.optimizers.{name} made distributed by "
            "keras_dist.tf_keras.DistributedOptimizer. It is a tf_keras (Keras "
            "2) optimizer: it trains tf_keras models. tf_keras and Keras 3 were "
            "mixed: a Keras 3 model takes a Keras 3 optimizer, "
            f"keras.optimizers.{name}(...), wrapped for accumulation in "
            "keras_dist.GradientAccumulationOptimizer, with the hook on "
            "keras_dist.DistributedModel(..., all_reduce_hook=...)>"
        )

    @property
    def _settings(self) -> _Settings:
        settings = self.__dict__.get("_keras_dist")
        if settings is None:
            settings = _Settings()
            object.__setattr__(self, "_keras_dist", settings)
        return settings

    @property
    def all_reduce_hook(self) -> AllReduceHook:
        """The hook that sums the gradients over replicas."""
        hook = self.__dict__.get("_keras_dist_hook")
        if hook is None:
            self._keras_dist_hook = hook = NoCompression()
        return hook

    @property
    def accumulation_steps(self) -> int:
        """Micro-steps per update."""
        return self._settings.steps

    def apply_gradients(self, grads_and_vars, name=None, **kwargs):
        """Accumulates, sums through the hook, then applies once (see the class)."""
        grads_and_vars = tuple(grads_and_vars)
        if not grads_and_vars:
            # As tf_keras: nothing to apply.
            return self.iterations
        if not all(isinstance(v, tf.Variable) for _, v in grads_and_vars):
            # Not variables (a tensor): tf_keras's own error says so.
            return super().apply_gradients(grads_and_vars, name=name, **kwargs)
        grads, variables = _filter_empty_gradients(grads_and_vars)
        if tf.distribute.in_cross_replica_context():
            raise RuntimeError(
                "DistributedOptimizer.apply_gradients runs in replica context "
                "(inside `strategy.run`, as tf_keras's `fit` calls it), not in "
                "cross-replica context."
            )
        self._keras_dist_build(variables)
        apply = functools.partial(self._keras_dist_apply, name=name)
        cycle = self._settings.cycle
        if cycle is not None:
            cycle.accumulate(grads, variables, apply)
            return self.iterations
        result = apply(grads, variables)
        if tf.executing_eagerly() or result is None:
            return self.iterations
        # In a TF1 graph the caller runs what this returns: the update, or
        # the decision whose branches update.
        return result if isinstance(result, tf.Operation) else tf.group(result)

    def _keras_dist_apply(self, grads, variables, name=None):
        view = _optimizer_view(self)
        aggregator = tf_keras_src.custom_gradient_aggregator(self)
        if aggregator is not None:
            # The legacy optimizers' `gradient_aggregator` is tf_keras's
            # way of choosing how gradients are summed: it replaces the hook.
            if type(self.all_reduce_hook) is not NoCompression:
                raise ValueError(
                    "Pass either an all-reduce hook or the optimizer's own "
                    "`gradient_aggregator`, not both: each sums the gradients. "
                    f"Received: all_reduce_hook={self.all_reduce_hook!r} and "
                    f"gradient_aggregator={aggregator!r}."
                )
            pairs = aggregator(list(zip(grads, variables)))
            reduced = [g for g, _ in pairs]
            trainable = [v for _, v in pairs]
        else:
            _, trainable, reduced = aggregation.reduce_gradients(
                grads, variables, self.all_reduce_hook, view=view
            )

        def apply(reduced):
            if isinstance(self, tf_keras.optimizers.legacy.Optimizer):
                return super(_DistributedMixin, self).apply_gradients(
                    zip(reduced, trainable),
                    name=name,
                    experimental_aggregate_gradients=False,
                )
            return super(_DistributedMixin, self).apply_gradients(
                zip(reduced, trainable),
                name=name,
                skip_gradients_aggregation=True,
            )

        non_finite = self._settings.non_finite
        if (
            non_finite == "skip"
            and not tf.compat.v1.executing_eagerly_outside_functions()
        ):
            # A TF1 session runs only the ops it is asked for, and the ops of
            # a conditional branch are not among them: the update is applied
            # as tf_keras applies it.
            non_finite = "apply"
        return aggregation.apply_reduced(
            reduced,
            apply,
            non_finite,
            lambda: self.iterations,
            loss_scaled=view.loss_scale is not None,
            how_to_raise="DistributedOptimizer(..., non_finite_gradients='raise')",
        )

    def _keras_dist_build(self, variables):
        """Creates the hook's state and the accumulators, in cross-replica context."""
        hook = self.all_reduce_hook
        settings = self._settings
        needs_cycle = settings.steps > 1 and settings.cycle is None
        if aggregation.hook_covers(hook, variables) and not needs_cycle:
            return

        def build(strategy):
            aggregation.build_hook(hook, variables, strategy)
            if needs_cycle:
                with tf.init_scope(), strategy.scope():
                    self._keras_dist_make_cycle(variables)

        tf.distribute.get_replica_context().merge_call(build)

    def _keras_dist_make_cycle(self, variables):
        def local(value, name):
            return tf.Variable(
                value,
                trainable=False,
                name=name,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM,
            )

        def shared(value, name):
            return tf.Variable(
                tf.constant(value, tf.int64),
                trainable=False,
                name=name,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )

        # Attributes of the optimizer: tf_keras checkpoints save them.
        self.keras_dist_accumulators = [
            local(tf.zeros(v.shape, v.dtype), f"accumulator_{i}")
            for i, v in enumerate(variables)
        ]
        self.keras_dist_examples = local(tf.zeros((), tf.float32), "examples")
        self.keras_dist_pending = shared(0, "pending_micro_steps")
        self.keras_dist_micro_steps = shared(0, "micro_steps")
        self.keras_dist_steps = shared(self._settings.steps, "accumulation_steps")
        self._settings.cycle = accumulation.AccumulationCycle(
            self.keras_dist_accumulators,
            self.keras_dist_examples,
            self.keras_dist_pending,
            self.keras_dist_micro_steps,
            self.keras_dist_steps,
            variables,
        )

    @property
    def micro_steps(self):
        """Micro-steps seen so far (`None` without accumulation)."""
        cycle = self._settings.cycle
        return None if cycle is None else cycle.micro_steps


def _filter_empty_gradients(grads_and_vars):
    """Drops `None` gradients, with tf_keras's error and warning."""
    grads_and_vars = tuple(grads_and_vars)
    kept = [(g, v) for g, v in grads_and_vars if g is not None]
    if not kept:
        raise ValueError(
            "No gradients provided for any variable: "
            f"{[v.name for _, v in grads_and_vars]}. Provided `grads_and_vars` "
            f"is {grads_and_vars}."
        )
    missing = [v.name for g, v in grads_and_vars if g is None]
    if missing:
        logger.warning(
            "Gradients do not exist for variables %s when minimizing the loss. "
            "If you're using `model.compile()`, did you forget to provide a "
            "`loss` argument?",
            missing,
        )
    return [g for g, _ in kept], [v for _, v in kept]


def _optimizer_view(optimizer) -> OptimizerView:
    """What the hooks may know of a tf_keras optimizer (`OptimizerView`)."""
    return view_of(
        optimizer,
        tf_keras.mixed_precision.LossScaleOptimizer,
        lambda scaler: tf.cast(scaler.loss_scale, tf.float32),
        sgd="tf_keras.optimizers.SGD",
        sgd_types=(tf_keras.optimizers.SGD, tf_keras.optimizers.legacy.SGD),
    )


@functools.cache
def _distributed_class(base):
    # The class keeps the wrapped class's name and module: tf_keras saves
    # the optimizer by them, so a saved model loads with the plain optimizer
    # (its slots and `iterations` included; the accumulators are not part
    # of the model file: `tf.train.Checkpoint` saves them).
    cls = type(
        base.__name__,
        (_DistributedMixin, base),
        {"__module__": base.__module__, "__qualname__": base.__qualname__},
    )
    tf_keras_src.save_under_the_name_of(cls, base)
    return cls


def _guard_stock_pruning_callback() -> None:
    """Makes tfmot's own `UpdatePruningStep` refuse an accumulating optimizer.

    tfmot's callback advances the pruning schedule once per batch; with
    `accumulation_steps=k` that is k times per update, so the model is
    pruned ahead of its schedule (measured: sparsity 0.79 where the schedule
    says ~0.63) and nothing says so. Installed once per process, when an
    accumulating `DistributedOptimizer` is made and tfmot is installed: the
    callback's `on_train_begin` raises, naming `UpdatePruningStep` here.
    """
    if (
        _pruning_guard
        or importlib.util.find_spec("tensorflow_model_optimization") is None
    ):
        return
    stock = import_tfmot().sparsity.keras.UpdatePruningStep
    on_train_begin = stock.on_train_begin

    def guarded_on_train_begin(self, logs=None):
        optimizer = getattr(self.model, "optimizer", None)
        if (
            isinstance(optimizer, _DistributedMixin)
            and optimizer.accumulation_steps > 1
            and self not in _counting_updates
        ):
            raise ValueError(
                "tfmot.sparsity.keras.UpdatePruningStep advances the pruning "
                "schedule once per batch, and with "
                f"DistributedOptimizer(accumulation_steps="
                f"{optimizer.accumulation_steps}) a batch is a micro-step: "
                "the model would be pruned "
                f"{optimizer.accumulation_steps}x ahead of its schedule. Use "
                "`keras_dist.tf_keras.UpdatePruningStep()` in `fit`'s "
                "callbacks instead; it counts optimizer updates."
            )
        return on_train_begin(self, logs)

    stock.on_train_begin = guarded_on_train_begin
    _pruning_guard.append(guarded_on_train_begin)


# The guard, once installed (one per process), and the stock callbacks that
# `UpdatePruningStep` drives once per update: the guard lets them through.
_pruning_guard: list = []
_counting_updates: weakref.WeakSet = weakref.WeakSet()


class UpdatePruningStep(tf_keras.callbacks.Callback):
    """tfmot's `UpdatePruningStep`, counting optimizer updates.

    tfmot advances a pruned layer's step once per batch (in the layer's
    call). With gradient accumulation a batch is a micro-step, while the
    schedule (`begin_step`, `frequency`, `end_step`) is meant in updates:
    this callback sets every pruned layer's step to the optimizer's
    `iterations` (the updates so far) before each batch, so the schedule
    advances once per update and the micro-steps of one update prune alike.
    Without accumulation it does what tfmot's callback does.

    Use it instead of `tfmot.sparsity.keras.UpdatePruningStep` in `fit`:
    with `accumulation_steps > 1` tfmot's own callback raises (it would run
    the schedule ahead by that factor).
    """

    def __init__(self):
        super().__init__()
        self._inner = import_tfmot().sparsity.keras.UpdatePruningStep()
        _counting_updates.add(self._inner)

    def set_model(self, model):
        super().set_model(model)
        self._inner.set_model(model)

    def on_train_begin(self, logs=None):
        self._inner.on_train_begin(logs)

    def on_train_batch_begin(self, batch, logs=None):
        updates = int(self.model.optimizer.iterations.numpy())
        tf_keras.backend.batch_set_value(
            [(layer.pruning_step, updates) for layer in self._inner.prunable_layers]
        )

    def on_epoch_end(self, epoch, logs=None):
        self._inner.on_epoch_end(epoch, logs)
