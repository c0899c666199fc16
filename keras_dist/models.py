"""`DistributedModel`: a `keras.Model` whose training is correct under any strategy."""

from __future__ import annotations

import logging
import warnings

import keras
import tensorflow as tf

from keras_dist import _aggregation, _compat
from keras_dist import callbacks as callbacks_lib
from keras_dist.compression.base import AllReduceHook, NoCompression
from keras_dist.optimizers import GradientAccumulationOptimizer

logger = logging.getLogger(__name__)

_HOOK_STATE_PREFIX = "all_reduce_hook_state_"
_UNSUPPORTED_STRATEGIES = (tf.distribute.experimental.ParameterServerStrategy,)


@keras.saving.register_keras_serializable(package="keras_dist")
class DistributedModel(_compat.MultiWorkerBuildFix, keras.Model):
    """A `keras.Model` whose `fit`, `evaluate` and `predict` are correct when
    distributed.

    Change one word, `keras.Model` -> `keras_dist.DistributedModel`, and under
    any `tf.distribute` strategy:

    - `fit` and `evaluate` work under `MultiWorkerMirroredStrategy` (stock
      Keras 3 fails there, in `_maybe_symbolic_build` and when reducing the
      logs);
    - the gradients are summed over replicas once, by an all-reduce hook you
      can replace (compression), and only then clipped and applied, so
      `clipnorm` / `global_clipnorm` see the global gradient, as on one device;
    - losses and metrics in the logs are computed from the metric state of all
      replicas and workers, not averaged per-replica results.

    Build it in any of Keras's forms, under `strategy.scope()`:

    ```python
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        # Functional
        inputs = keras.Input((784,))
        outputs = keras.layers.Dense(10)(inputs)
        model = keras_dist.DistributedModel(inputs, outputs)

        # Subclass
        class Net(keras_dist.DistributedModel):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.dense = keras.layers.Dense(10)

            def call(self, x):
                return self.dense(x)

        # Any existing model (Sequential, keras.applications, ...): same
        # layers and weights, DistributedModel's training logic.
        model = keras_dist.DistributedModel.from_model(
            keras.applications.ResNet50(weights=None)
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(dataset, epochs=3)
    ```

    A custom `train_step` can call `self.apply_gradients(gradients,
    variables)` to use the same aggregation path (hook, then clipping, then
    one update).

    Args:
        all_reduce_hook: `keras_dist.compression.AllReduceHook` or `None`. How
            gradients are summed across replicas. Defaults to `None`, a plain
            sum all-reduce (`NoCompression()`).
        *args: Passed to `keras.Model` (`inputs`, `outputs`, ...).
        **kwargs: Passed to `keras.Model` (`inputs`, `outputs`, `name`, ...).
    """

    def __new__(cls, *args, **kwargs):
        if cls is DistributedModel and _is_functional_call(args, kwargs):
            return super().__new__(FunctionalDistributedModel)
        return super().__new__(cls)

    def __init__(self, *args, all_reduce_hook=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._set_hook(all_reduce_hook)

    def _set_hook(self, hook):
        object.__setattr__(self, "_hook_is_default", hook is None)
        hook = NoCompression() if hook is None else hook
        # Plain attribute on purpose: the hook is not a layer, so it must not
        # show up in `model.layers`, summaries or weight lists.
        object.__setattr__(self, "_keras_dist_hook", _aggregation.check_hook(hook))
        # The hook's per-replica state (error feedback, warm-start factors)
        # is saved with `tf.train.Checkpoint(model=...)`.
        _compat.track_checkpoint_dependency(self, "all_reduce_hook", hook)

    @property
    def all_reduce_hook(self) -> AllReduceHook:
        """The `AllReduceHook` that sums gradients across replicas."""
        return self._keras_dist_hook

    def register_all_reduce_hook(self, hook: AllReduceHook) -> None:
        """Replaces the all-reduce hook.

        Can be called before or between `fit` calls; the train function is
        rebuilt on the next `fit`. The new hook starts with fresh state.

        Args:
            hook: `keras_dist.compression.AllReduceHook` instance.
        """
        self._set_hook(hook)
        self.train_function = None

    @classmethod
    def from_model(cls, model: keras.Model, all_reduce_hook=None, name=None):
        """Returns a DistributedModel around an existing model.

        The result shares `model`'s layers and variables (no copy): training it
        trains `model`. Create `model` under the same `strategy.scope()` as the
        result, so its variables are distributed.

        Args:
            model: `keras.Model`. Any built or unbuilt model: Sequential,
                functional, subclassed, or from `keras.applications`.
            all_reduce_hook: See the class arguments. Defaults to `None`.
            name: String or `None`. Name of the wrapper. Defaults to
                `"distributed_" + model.name`.

        Returns:
            A `DistributedModel` whose `call` is `model.call`.
        """
        if not isinstance(model, keras.Model):
            raise TypeError(
                "`model` must be a `keras.Model`. Received: "
                f"model={type(model).__name__}."
            )
        if isinstance(model, DistributedModel):
            raise ValueError(
                f"`model` {model.name!r} is already a DistributedModel; use it "
                "as it is (call `register_all_reduce_hook` to change its hook)."
            )
        strategy = tf.distribute.get_strategy()
        for variable in model.variables:
            if not strategy.extended.variable_created_in_scope(variable.value):
                raise ValueError(
                    f"The variables of `model` {model.name!r} were created "
                    "outside the current strategy's scope, so they are not "
                    "distributed. Create the model inside "
                    "`with strategy.scope():` and call `from_model` there."
                )
        return WrappedModel(
            model,
            all_reduce_hook=all_reduce_hook,
            name=name or f"distributed_{model.name}",
        )

    # --- Training step ------------------------------------------------------

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
            _compat.update_loss_tracker(self, loss, _batch_size(x))
            if self.optimizer is not None:
                loss = self.optimizer.scale_loss(loss)
        if self.trainable_weights:
            trainable_weights = self.trainable_weights
            gradients = tape.gradient(loss, trainable_weights)
            self.apply_gradients(gradients, trainable_weights)
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

    def apply_gradients(self, gradients, variables):
        """Sums `gradients` over replicas with the hook, then applies them once.

        Call it from a custom `train_step` or from a custom training loop
        inside `strategy.run` (replica context). The gradients are this
        replica's gradients of a loss scaled by `1 / num_replicas_in_sync`
        (what Keras losses do under a strategy).

        Args:
            gradients: List of gradients (`None` entries are skipped).
            variables: List of the matching trainable variables.
        """
        if getattr(self, "optimizer", None) is None:
            raise RuntimeError(
                "`apply_gradients` needs an optimizer: call `model.compile("
                "optimizer=...)` first."
            )
        self._build_hook()
        if isinstance(self.optimizer, GradientAccumulationOptimizer):
            # Accumulate locally; reduce with the hook only on update steps.
            self.optimizer.apply_with_hook(gradients, variables, self._effective_hook())
        else:
            _aggregation.reduce_and_apply(
                self.optimizer, gradients, variables, self.all_reduce_hook
            )

    def _effective_hook(self):
        # The model's hook applies; a hook given to the accumulation optimizer
        # is used when the model kept the default one.
        optimizer_hook = self.optimizer.all_reduce_hook
        if optimizer_hook is None or optimizer_hook is self.all_reduce_hook:
            return self.all_reduce_hook
        if self._hook_is_default:
            return optimizer_hook
        raise ValueError(
            "Both the model and its GradientAccumulationOptimizer have an "
            f"all-reduce hook ({self.all_reduce_hook!r} and {optimizer_hook!r}). "
            "Set the hook in one place: on the model (recommended) or on the "
            "optimizer."
        )

    def compile(self, optimizer="rmsprop", *args, auto_scale_loss=True, **kwargs):
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
            **kwargs: Further arguments of `keras.Model.compile` (`loss`,
                `metrics`, `steps_per_execution`, ...).

        Raises:
            RuntimeError: under `mixed_float16`, a
                `GradientAccumulationOptimizer` whose inner optimizer has no
                loss scaling is already built, so it cannot be added.
        """
        optimizer = keras.optimizers.get(optimizer)
        if (
            auto_scale_loss
            and isinstance(optimizer, GradientAccumulationOptimizer)
            and self.dtype_policy.name == "mixed_float16"
        ):
            if not isinstance(
                optimizer.inner_optimizer, keras.optimizers.LossScaleOptimizer
            ):
                if optimizer.built:
                    raise RuntimeError(
                        "Under mixed_float16 the GradientAccumulationOptimizer's "
                        "inner optimizer needs loss scaling, but it is already "
                        "built. Pass `GradientAccumulationOptimizer("
                        "keras.optimizers.LossScaleOptimizer(inner))` yourself."
                    )
                logger.info(
                    "mixed_float16: wrapping the accumulation optimizer's inner "
                    "optimizer in a LossScaleOptimizer."
                )
                optimizer.inner_optimizer = keras.optimizers.LossScaleOptimizer(
                    optimizer.inner_optimizer, name="loss_scale_optimizer"
                )
            auto_scale_loss = False
        super().compile(optimizer, *args, auto_scale_loss=auto_scale_loss, **kwargs)

    def _build_hook(self):
        # A GradientAccumulationOptimizer creates replica-local variables and
        # builds its hook in cross-replica context: it cannot build lazily
        # inside the `strategy.run` of a real strategy as a plain Keras
        # optimizer does (under the default strategy it can).
        unbuilt_accumulator = (
            isinstance(self.optimizer, GradientAccumulationOptimizer)
            and not getattr(self.optimizer, "built", False)
            and tf.distribute.has_strategy()
        )
        if self.all_reduce_hook.built and not unbuilt_accumulator:
            return
        if not tf.distribute.in_cross_replica_context():
            missing = (
                "The all-reduce hook"
                if not self.all_reduce_hook.built
                else "The GradientAccumulationOptimizer"
            )
            raise RuntimeError(
                f"{missing} must be built before the first replica step. Call "
                "`model.build_all_reduce_hook()` after `model.compile(...)` and "
                "before `strategy.run` (fit does it)."
            )
        self.build_all_reduce_hook()

    def build_all_reduce_hook(self) -> None:
        """Builds the hook's state and the optimizer for the trainable variables.

        `fit` builds what it needs itself. Call this after `compile` and
        before a custom training loop that calls `apply_gradients` inside
        `strategy.run`: the hook (even the stateless default) and a
        `GradientAccumulationOptimizer` must be built in cross-replica
        context. It enters the model's strategy scope itself and does nothing
        for what is already built.
        """
        self._build_hook_state()
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            with self.distribute_strategy.scope():
                optimizer.build(self.trainable_variables)

    def _build_hook_state(self) -> None:
        _aggregation.build_hook(
            self.all_reduce_hook, self.trainable_variables, self.distribute_strategy
        )

    def compile_from_config(self, config):
        # Keras skips compiling on load when `compile` is overridden (ours
        # is); DistributedModel.compile takes the same arguments, so compile.
        if type(self).compile is not DistributedModel.compile:
            return super().compile_from_config(config)
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)
        return None

    # --- Distributed train / test functions ---------------------------------

    def fit(self, *args, **kwargs):
        self._check_strategy()
        # With an AutoScaleBatch callback, numpy arrays and unbatched datasets
        # are batched at its per_replica_batch_size x num_replicas_in_sync.
        args, kwargs = callbacks_lib.prepare_fit_arguments(self, args, kwargs)
        return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        self._check_strategy()
        return super().evaluate(*args, **kwargs)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        self._check_strategy()
        self._build_hook_state()
        self.train_function = self._make_distributed_function(self.train_step)
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is not None and not force:
            return self.test_function
        self._check_strategy()
        self.test_function = self._make_distributed_function(self.test_step)
        return self.test_function

    def _check_strategy(self):
        strategy = self.distribute_strategy
        if isinstance(strategy, _UNSUPPORTED_STRATEGIES):
            raise TypeError(
                "DistributedModel.fit/evaluate do not support "
                f"{type(strategy).__name__} (Keras 3 has no parameter-server "
                "fit either, keras#18624). Received: strategy="
                f"{type(strategy).__name__}. Use MultiWorkerMirroredStrategy "
                "(`keras_dist.auto_strategy()` picks it for a TF_CONFIG without "
                "`ps` tasks), or drive the model from a "
                "`tf.distribute.coordinator.ClusterCoordinator.schedule` loop."
            )

    def _make_distributed_function(self, step_function):
        strategy = self.distribute_strategy

        @tf.autograph.experimental.do_not_convert
        def one_step_on_data(data):
            outputs = strategy.run(step_function, args=(data,))
            return self._reduce_step_outputs(outputs)

        @tf.autograph.experimental.do_not_convert
        def one_step_on_iterator(iterator):
            return one_step_on_data(next(iterator))

        def multi_step_on_iterator(iterator):
            outputs = one_step_on_data(next(iterator))
            for _ in tf.range(self.steps_per_execution - 1):
                optional = iterator.get_next_as_optional()
                if not optional.has_value():
                    break
                outputs = one_step_on_data(optional.get_value())
            return outputs

        if self.steps_per_execution == 1:
            step_on_iterator = one_step_on_iterator
        else:
            step_on_iterator = multi_step_on_iterator
        step_on_data = one_step_on_data
        if not self.run_eagerly:
            step_on_iterator = tf.function(
                step_on_iterator, reduce_retracing=True, jit_compile=self.jit_compile
            )
            step_on_data = tf.function(
                one_step_on_data, reduce_retracing=True, jit_compile=self.jit_compile
            )

        def function(iterator):
            if isinstance(
                iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)
            ):
                return step_on_iterator(iterator)
            # An iterator of distributed batches built in Python (the epoch
            # iterator of numpy data can hand out lists of batches).
            outputs = None
            for _, data in zip(range(self.steps_per_execution), iterator):
                outputs = step_on_data(data)
            return outputs

        return function

    def _reduce_step_outputs(self, outputs):
        """Turns per-replica step outputs into global logs (cross-replica).

        Values that are model metrics are recomputed from the metric state,
        which sums the state of every replica and worker; other values are
        averaged over replicas.
        """
        strategy = self.distribute_strategy
        metrics = _flatten_logs(self.get_metrics_result())

        def reduce_value(value):
            if isinstance(value, tf.distribute.DistributedValues) or (
                _compat.is_multi_worker(strategy) and tf.is_tensor(value)
            ):
                return strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None)
            return value

        if isinstance(outputs, dict):
            logs = {}
            for key, value in outputs.items():
                if key in metrics:
                    logs[key] = metrics[key]
                elif isinstance(value, dict):
                    logs[key] = self._reduce_step_outputs(value)
                else:
                    logs[key] = reduce_value(value)
            return logs
        return keras.tree.map_structure(reduce_value, outputs)

    # --- Serialization --------------------------------------------------------

    def save_own_variables(self, store):
        # `.keras` files, `save_weights`, ModelCheckpoint and BackupAndRestore
        # carry the hook's state too. "sum" state is saved as the sum over
        # replicas, "first" state as replica 0's copy (see AllReduceHook).
        super().save_own_variables(store)
        if self.all_reduce_hook.built:
            for index, variable in enumerate(self.all_reduce_hook.state_variables):
                store[f"{_HOOK_STATE_PREFIX}{index}"] = variable.numpy()

    def load_own_variables(self, store):
        # Keras's weight stores offer `keys()` but not always iteration.
        names = list(store.keys())
        keys = [key for key in names if key.startswith(_HOOK_STATE_PREFIX)]
        if not keys:
            super().load_own_variables(store)
            return
        super().load_own_variables(
            {k: store[k] for k in names if not k.startswith(_HOOK_STATE_PREFIX)}
        )
        self._build_hook_state()
        state = self.all_reduce_hook.state_variables
        if len(state) != len(keys):
            raise ValueError(
                f"The saved all-reduce hook state has {len(keys)} variables but "
                f"the model's hook {self.all_reduce_hook!r} has {len(state)}. "
                "Load the weights into a model with the same hook (or call "
                "`register_all_reduce_hook` with it before loading)."
            )
        for index, variable in enumerate(state):
            variable.assign(store[f"{_HOOK_STATE_PREFIX}{index}"])

    def get_config(self):
        config = super().get_config()
        config["all_reduce_hook"] = keras.saving.serialize_keras_object(
            self.all_reduce_hook
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        hook = keras.saving.deserialize_keras_object(
            config.pop("all_reduce_hook", None), custom_objects=custom_objects
        )
        model = super().from_config(config, custom_objects=custom_objects)
        model._set_hook(hook)
        return model


@keras.saving.register_keras_serializable(package="keras_dist")
class FunctionalDistributedModel(DistributedModel, _compat.Functional):
    """The class `DistributedModel(inputs, outputs)` returns.

    Keras turns `Model(inputs, outputs)` into its `Functional` class; this is
    the same for `DistributedModel`, without changing `DistributedModel`'s
    own base classes (which Keras would do for a subclass called in the
    functional form). Use it through `DistributedModel(inputs, outputs)`.
    """


@keras.saving.register_keras_serializable(package="keras_dist")
class WrappedModel(DistributedModel):
    """The class `DistributedModel.from_model(model)` returns.

    Calls the wrapped model; its layers and variables are the wrapped model's.

    Args:
        model: `keras.Model` to wrap.
        all_reduce_hook: See `DistributedModel`.
        **kwargs: `keras.Model` arguments (`name`, ...).
    """

    def __init__(self, model, all_reduce_hook=None, **kwargs):
        super().__init__(all_reduce_hook=all_reduce_hook, **kwargs)
        self.model = model
        if model.built:
            self.built = True

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def build(self, input_shape):
        if not self.model.built:
            self.model.build(input_shape)
        self.built = True

    def get_config(self):
        config = keras.Model.get_config(self)
        config["model"] = keras.saving.serialize_keras_object(self.model)
        config["all_reduce_hook"] = keras.saving.serialize_keras_object(
            self.all_reduce_hook
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        config["all_reduce_hook"] = keras.saving.deserialize_keras_object(
            config.get("all_reduce_hook"), custom_objects=custom_objects
        )
        return cls(**config)


def _is_functional_call(args, kwargs) -> bool:
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


def _batch_size(x):
    first = next(t for t in keras.tree.flatten(x) if t is not None)
    return tf.shape(first)[0]


def _flatten_logs(logs):
    flat = {}
    for key, value in logs.items():
        if isinstance(value, dict):
            flat.update(_flatten_logs(value))
        else:
            flat[key] = value
    return flat
