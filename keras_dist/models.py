"""`DistributedModel`: a `keras.Model` whose training works under a strategy.

Tested under the default strategy, `OneDeviceStrategy`, `MirroredStrategy`,
`MultiWorkerMirroredStrategy` and `ParameterServerStrategy` (asynchronous
`fit`/`evaluate`/`predict` through a `ClusterCoordinator`,
`_parameter_server.py`).
"""

from __future__ import annotations

import inspect
import logging
import warnings
import weakref

import keras
import tensorflow as tf

from keras_dist import _apply, _fit_data, _parameter_server, _validation
from keras_dist._compat import keras_src as _compat
from keras_dist._compat import tf_internal
from keras_dist.core import aggregation, collectives
from keras_dist.core.hooks import AllReduceHook
from keras_dist.core.plain import NoCompression
from keras_dist.optimizers import GradientAccumulationOptimizer, find_accumulator

logger = logging.getLogger(__name__)

_HOOK_STATE_PREFIX = "all_reduce_hook_state_"


class DistributedTrainerMixin(_compat.MultiWorkerBuildFix):
    """The training logic of `DistributedModel`, over any Keras TF trainer.

    `DistributedModel` is this mixin over `keras.Model`. It is a separate
    class so the same methods can sit over Keras's `TensorFlowTrainer` in
    Keras's own trainer tests (`tests/keras_conformance`); use
    `DistributedModel` in your code.
    """

    def __init__(self, *args, all_reduce_hook=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._set_hook(all_reduce_hook)
        self._keras_dist_check_finite = True

    def _set_hook(self, hook):
        if hook is not None:
            aggregation.check_hook(hook)
        # Plain attributes on purpose: the hook is not a layer, so it must
        # not show up in `model.layers`, summaries or weight lists.
        _compat.set_untracked_attribute(self, "_keras_dist_user_hook", hook)
        _compat.set_untracked_attribute(
            self, "_keras_dist_hook", NoCompression() if hook is None else hook
        )
        # The hook's per-replica state (error feedback, warm-start factors)
        # is saved with `tf.train.Checkpoint(model=...)`.
        _compat.track_checkpoint_dependency(
            self, "all_reduce_hook", self._keras_dist_hook
        )

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

        Raises:
            TypeError: `hook` is not an `AllReduceHook` instance.
            RuntimeError: called while `fit` runs (from a callback).
        """
        if getattr(self, "_keras_dist_fitting", False):
            raise RuntimeError(
                "`register_all_reduce_hook` cannot be called while `fit` runs "
                "(from a callback): the compiled train step uses the current "
                "hook until `fit` returns. Call it between `fit` calls."
            )
        self._set_hook(aggregation.check_hook(hook, argument="hook"))
        self.train_function = None
        _parameter_server.reset_functions(self)

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
        check_finite = self._keras_dist_check_finite and not self.jit_compile
        self._ensure_built(hook, variables)
        accumulator = find_accumulator(self.optimizer)
        if accumulator is not None:
            # Accumulate locally; reduce with the hook only on update steps.
            accumulator.accumulate_and_apply(
                gradients, variables, hook, batch_size, check_finite=check_finite
            )
        else:
            _apply.reduce_and_apply(
                self.optimizer,
                gradients,
                variables,
                hook,
                batch_size,
                check_finite=check_finite,
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
        if self._keras_dist_user_hook is None:
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

    def compile(
        self,
        optimizer="rmsprop",
        *args,
        auto_scale_loss=True,
        check_finite_gradients=True,
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
            check_finite_gradients: Bool. Stop training with an error naming
                the update, before the weights change, when the all-reduced
                gradient holds NaN or inf (NaN in the data can leave the
                logged loss finite while it turns the weights into NaN). Not
                done under loss scaling (the `LossScaleOptimizer` skips such
                steps itself) nor with `jit_compile=True` (XLA has no assert
                op). It costs one pass over the reduced gradient per update
                (`benchmarks/finite_check.py`). Defaults to `True`.
            **kwargs: Further arguments of `keras.Model.compile` (`loss`,
                `metrics`, `steps_per_execution`, ...).

        Raises:
            RuntimeError: under `mixed_float16`, a
                `GradientAccumulationOptimizer` whose inner optimizer has no
                loss scaling is already built, so it cannot be added.
        """
        optimizer = _loss_scaling_inside_accumulation(keras.optimizers.get(optimizer))
        self._keras_dist_check_finite = _validation.check_bool(
            "check_finite_gradients", check_finite_gradients
        )
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
        _parameter_server.reset_functions(self)

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

    # --- Distributed train / test functions ---------------------------------

    @property
    def cluster_coordinator(self) -> tf.distribute.coordinator.ClusterCoordinator:
        """The `ClusterCoordinator` that `fit` uses under parameter servers.

        The one TensorFlow keeps for the model's `ParameterServerStrategy`;
        schedule your own functions with it (`schedule`, `join`,
        `create_per_worker_dataset`).

        Raises:
            RuntimeError: the model was not created under a
                `ParameterServerStrategy` scope.
        """
        strategy = self.distribute_strategy
        if not _parameter_server.is_parameter_server(strategy):
            raise RuntimeError(
                "`cluster_coordinator` exists only under ParameterServerStrategy. "
                f"Received: a model created under {type(strategy).__name__}. "
                "Create and compile the model inside "
                "`ParameterServerStrategy(...).scope()`."
            )
        return _parameter_server.coordinator(strategy)

    def fit(self, *args, **kwargs):
        from keras_dist import callbacks as callbacks_lib

        self._check_strategy()
        if _parameter_server.is_parameter_server(self.distribute_strategy):
            values = _compat.bind_fit_arguments(self, args, kwargs)
            self._keras_dist_fitting = True
            try:
                return _parameter_server.fit(self, **values)
            finally:
                self._keras_dist_fitting = False
        # With an AutoScaleBatch callback, numpy arrays and unbatched datasets
        # are batched at its per_replica_batch_size x num_replicas_in_sync.
        args, kwargs = _fit_data.prepare_fit_arguments(self, args, kwargs)
        values = _compat.bind_fit_arguments(self, args, kwargs)
        # BackupAndRestore first; Keras's file-writing callbacks write the
        # shared path on the chief only.
        values["callbacks"], finish = callbacks_lib._fit_callbacks(
            self, values.get("callbacks")
        )
        self._keras_dist_fitting = True
        try:
            return super().fit(**values)
        except _COLLECTIVE_ERRORS as error:
            lost = _describe_lost_peer(self.distribute_strategy, error)
            if lost is None:
                raise
            raise RuntimeError(lost) from error
        finally:
            self._keras_dist_fitting = False
            finish()

    def evaluate(self, *args, **kwargs):
        self._check_strategy()
        if _parameter_server.is_parameter_server(self.distribute_strategy):
            values = _bind(keras.Model.evaluate, args, kwargs)
            return _parameter_server.evaluate(self, **values)
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        if _parameter_server.is_parameter_server(self.distribute_strategy):
            values = _bind(keras.Model.predict, args, kwargs)
            return _parameter_server.predict(self, **values)
        return super().predict(*args, **kwargs)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        self._check_strategy()
        self._check_stepwise()
        # Before anything is traced: the strategy's collectives get keys no
        # other strategy of this process uses (keras_dist.core.collectives).
        collectives.own(self.distribute_strategy)
        if tf.distribute.has_strategy() or _compat.model_strategy(self) is not None:
            # Under a strategy, `fit` built the layers from the first batch
            # (`_maybe_symbolic_build`), and the hook and an accumulation
            # optimizer must be built here, in cross-replica context. Without
            # one the weights may appear only in the first trace of the step;
            # `apply_gradients` builds the hook there.
            self.build_all_reduce_hook()
        self.train_function = self._make_distributed_function(self.train_step)
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is not None and not force:
            return self.test_function
        self._check_strategy()
        self._check_stepwise()
        self.test_function = self._make_distributed_function(self.test_step)
        return self.test_function

    def _check_strategy(self):
        strategy = self.distribute_strategy
        if self.jit_compile and strategy.num_replicas_in_sync > 1:
            # Stock Keras fails here too, later and opaquely (XLA cannot
            # compile the cross-replica step: "Graph execution error").
            raise ValueError(
                "`jit_compile=True` does not work with more than one replica: "
                "XLA cannot compile the cross-replica all-reduce of "
                f"{type(strategy).__name__} (stock Keras fails the same way). "
                f"Received: jit_compile=True with {strategy.num_replicas_in_sync} "
                'replicas. Compile with `jit_compile=False` (or `"auto"`, '
                "which Keras turns off under a strategy)."
            )

    def _check_stepwise(self):
        """Refuses Keras's own train/test functions under parameter servers."""
        if _parameter_server.is_parameter_server(self.distribute_strategy):
            raise RuntimeError(
                "Under ParameterServerStrategy a DistributedModel trains through "
                "`fit`, `evaluate` and `predict`, which schedule the steps on the "
                "workers; `train_on_batch`/`test_on_batch` and Keras's step "
                "functions would run on the coordinator. Call `fit`, or "
                "schedule your own `strategy.run(model.train_step, ...)` with "
                "`model.cluster_coordinator`."
            )

    def _make_distributed_function(self, step_function):
        """Keras's train/test function layout, with global logs.

        The same structure as stock Keras's TensorFlow trainer, so the same
        things work: `jit_compile` compiles the step only (never the
        iterator op), `steps_per_execution > 1` loops in one graph over one
        traced step, and optional inputs fed as `None` arrive as `None`.
        What differs is the reduction of the step outputs
        (`_reduce_step_outputs`), and that it happens once per call, after
        the last step of the `steps_per_execution` chunk: only that step's
        logs reach Keras, and under MultiWorkerMirroredStrategy reading the
        metric state is a collective, which the other steps need not pay.
        """
        strategy = self.distribute_strategy

        @tf.autograph.experimental.do_not_convert
        def one_step_on_data(data):
            # Per-replica outputs: no collective beyond the step's own.
            return strategy.run(step_function, args=(data,))

        @tf.autograph.experimental.do_not_convert
        def one_reduced_step_on_data(data):
            return self._reduce_step_outputs(one_step_on_data(data))

        if not self.run_eagerly:
            run_on_data = tf.function(
                one_step_on_data, reduce_retracing=True, jit_compile=self.jit_compile
            )
            step_on_data = tf.function(
                one_reduced_step_on_data,
                reduce_retracing=True,
                jit_compile=self.jit_compile,
            )
        else:
            run_on_data, step_on_data = one_step_on_data, one_reduced_step_on_data
        run_on_data = _optionals_as_none(run_on_data)
        step_on_data = _optionals_as_none(step_on_data)

        @tf.autograph.experimental.do_not_convert
        def step_on_iterator(iterator):
            if self.steps_per_execution == 1:
                return step_on_data(iterator.get_next())

            def more(step, outputs, next_data):
                del outputs
                return tf.logical_and(
                    step < self.steps_per_execution, next_data.has_value()
                )

            def run_one(step, outputs, next_data):
                del outputs
                outputs = run_on_data(next_data.get_value())
                # Never read a batch past `steps_per_execution`: the next
                # call of the function starts with it.
                next_data = tf.cond(
                    step + 1 < self.steps_per_execution,
                    iterator.get_next_as_optional,
                    lambda: next_data,
                )
                return step + 1, outputs, next_data

            # The loop carries the last step's per-replica outputs; they
            # are reduced once, after it.
            _, outputs, _ = tf.while_loop(
                more,
                run_one,
                [
                    tf.constant(1),
                    run_on_data(iterator.get_next()),
                    iterator.get_next_as_optional(),
                ],
            )
            return self._reduce_step_outputs(outputs)

        if not self.run_eagerly:
            step_on_iterator = tf.function(step_on_iterator, reduce_retracing=True)

        def function(iterator):
            if isinstance(
                iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)
            ):
                return step_on_iterator(iterator)
            # An iterator of distributed batches built in Python (the epoch
            # iterator of numpy data can hand out lists of batches). One
            # batch is held back so the chunk's last step is the one that
            # reduces.
            data = None
            for _, next_data in zip(range(self.steps_per_execution), iterator):
                if data is not None:
                    run_on_data(data)
                data = next_data
            return None if data is None else step_on_data(data)

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
                tf_internal.is_multi_worker(strategy) and tf.is_tensor(value)
            ):
                return collectives.reduce_across(strategy, value, op="mean")
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

    @property
    def all_reduce_hook_state(self) -> HookStateSaveable:
        """The hook's state as Keras saves it (`save_weights`, `.keras`).

        Keras's saving walks a model's attributes; this one carries the
        hook's per-replica state (error feedback, PowerSGD factors) under
        its own path in the file, beside the layers. A plain `keras.Model`
        of the same architecture has no such attribute, so it loads the
        same file and ignores the hook state: train distributed, deploy
        plain.
        """
        saveable = self.__dict__.get("_keras_dist_hook_saveable")
        if saveable is None or saveable.owner() is not self:
            saveable = HookStateSaveable(self)
            _compat.set_untracked_attribute(self, "_keras_dist_hook_saveable", saveable)
        return saveable

    def load_own_variables(self, store):
        # Files written before the hook state had its own path kept it in
        # the model's own variables, as `all_reduce_hook_state_<i>`.
        names = list(store.keys())
        legacy = [key for key in names if key.startswith(_HOOK_STATE_PREFIX)]
        if not legacy:
            super().load_own_variables(store)
            return
        super().load_own_variables(
            {k: store[k] for k in names if not k.startswith(_HOOK_STATE_PREFIX)}
        )
        self.all_reduce_hook_state.load_own_variables(
            {k[len(_HOOK_STATE_PREFIX) :]: store[k] for k in legacy}
        )

    def to_keras_model(self) -> keras.Model:
        """Returns a plain `keras.Model` with this model's layers and weights.

        For deployment where keras_dist is not installed: the result is a
        stock `keras.Model` (functional models) or the wrapped model
        (`from_model`), sharing this model's layers and variables (no
        copy), so `result.save("model.keras")` loads with stock Keras.
        Training state (the optimizer, the hook's state) stays here.

        A subclassed `DistributedModel` has its architecture in its own
        `call`: define the same class on `keras.Model` and load this model's
        weights into it (`save_weights` / `load_weights` work across the
        two, the hook state is ignored by plain Keras).

        Returns:
            A `keras.Model` that is not a `DistributedModel`.

        Raises:
            TypeError: the model is subclassed (see above).
            ValueError: the model is not built.
        """
        if isinstance(self, WrappedModel):
            return self.model
        if not isinstance(self, _compat.Functional):
            raise TypeError(
                f"`to_keras_model` cannot export the subclassed model "
                f"{type(self).__name__!r}: its architecture is its `call` "
                "method. Define the same class on `keras.Model`, build it, and "
                "`load_weights` a file saved with `model.save_weights(...)` "
                "(plain Keras ignores the all-reduce hook state in it)."
            )
        return keras.Model(self.inputs, self.outputs, name=self.name)


class HookStateSaveable(_compat.StateSaveable):
    """Carries a model's all-reduce hook state through Keras's saving.

    `DistributedModel.all_reduce_hook_state` returns one. What is saved:
    `"sum"` state as the sum over replicas, `"first"` state as replica 0's
    copy (see `AllReduceHook.add_state`). Loading into a model whose hook
    keeps no state skips the saved state with a warning; loading into a hook
    with a different amount of state is an error.

    Args:
        model: The `DistributedModel` whose hook state this carries.
    """

    def __init__(self, model):
        # A weak reference: Keras's saving walks this object's attributes,
        # and must not walk back into the model.
        self._model = weakref.ref(model)

    def owner(self):
        """Returns the `DistributedModel` whose hook state this carries.

        A method, not an attribute: Keras's saving walks attributes.
        """
        return self._model()

    def save_own_variables(self, store):
        hook = self.owner().all_reduce_hook
        if hook.built:
            for index, variable in enumerate(hook.state_variables):
                store[str(index)] = variable.numpy()

    def load_own_variables(self, store):
        keys = sorted(store.keys(), key=int)
        if not keys:
            return
        model = self.owner()
        hook = model.all_reduce_hook
        aggregation.build_hook(
            hook, model.trainable_variables, model.distribute_strategy
        )
        state = hook.state_variables
        if not state:
            logger.warning(
                "The weights hold all-reduce hook state (%d variables), but "
                "this model's hook %r keeps none: skipped. Training goes on "
                "without the saved error feedback; register the hook the file "
                "was saved with to resume it exactly.",
                len(keys),
                hook,
            )
            return
        if len(state) != len(keys):
            raise ValueError(
                f"The saved all-reduce hook state has {len(keys)} variables but "
                f"the model's hook {hook!r} has {len(state)}. Load the weights "
                "into a model with the same hook (or call "
                "`register_all_reduce_hook` with it before loading)."
            )
        for key, variable in zip(keys, state):
            variable.assign(store[key])


@keras.saving.register_keras_serializable(package="keras_dist")
class DistributedModel(DistributedTrainerMixin, keras.Model):
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
        if _is_functional_call(args, kwargs) and not issubclass(
            cls, _compat.Functional
        ):
            # Keras would rewrite the bases of every class up the hierarchy,
            # DistributedModel's included, for the whole process: put the
            # functional class in the user's class instead, as Keras does
            # for a direct subclass of keras.Model.
            cls = _functional_class(cls)
        return super().__new__(cls)

    def __init__(self, *args, all_reduce_hook=None, **kwargs):
        if _is_functional_call(args, kwargs) and not isinstance(
            self, _compat.Functional
        ):
            # A subclass whose own `__init__` passes inputs and outputs up
            # (`super().__init__(inputs=..., outputs=...)`): same as above.
            _functional_class(type(self))
        super().__init__(*args, all_reduce_hook=all_reduce_hook, **kwargs)

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

    def get_config(self):
        return self._with_hook_config(super().get_config())

    def _with_hook_config(self, config):
        # Only a hook the user gave: the default is recreated on load, and
        # saving it would make it look user-given (see `_training_hook`).
        config["all_reduce_hook"] = keras.saving.serialize_keras_object(
            self._keras_dist_user_hook
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        hook = keras.saving.deserialize_keras_object(
            config.pop("all_reduce_hook", None), custom_objects=custom_objects
        )
        model = super().from_config(config, custom_objects=custom_objects)
        if hook is not None:
            model.register_all_reduce_hook(hook)
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
        return self._with_hook_config(config)

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


# What a collective raises when a peer is gone: its connection reset
# (Unavailable), the coordination service's heartbeat missed (Unavailable or
# Aborted), or `collective_timeout` passed (DeadlineExceeded).
_COLLECTIVE_ERRORS = (
    tf.errors.DeadlineExceededError,
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
)


def _describe_lost_peer(strategy, error) -> str | None:
    """Names the peer a failed collective lost, or `None` when not multi-worker."""
    from keras_dist import cluster as cluster_lib

    resolver = getattr(strategy, "cluster_resolver", None)
    if not tf_internal.is_multi_worker(strategy) or resolver is None:
        return None
    cluster = resolver.cluster_spec().as_dict()
    missing = cluster_lib.unreachable_tasks(
        cluster, resolver.task_type, resolver.task_id
    )
    lines = [line.strip() for line in str(error.message).splitlines()]
    telling = ("timed out", "unhealthy", "peer", "connection", "socket", "abort")
    first_line = next(
        (line for line in lines if any(word in line.lower() for word in telling)),
        next((line for line in lines if line), ""),
    )
    if missing:
        names = ", ".join(
            f"{name} ({address}: {why})" for name, address, why in missing
        )
        cause = f"lost {names}: it no longer answers"
    elif isinstance(error, tf.errors.DeadlineExceededError):
        cause = (
            "a collective timed out (`collective_timeout`), and every task "
            "still answers: one of them stopped taking part (hung, or busy "
            "for longer than the timeout)"
        )
    else:
        cause = "a collective failed, and every task still answers"
    return (
        f"Training stopped on {resolver.task_type}:{resolver.task_id}: {cause}. "
        f"TensorFlow said: {type(error).__name__}: {first_line} Restart the "
        "job (`keras-dist launch --max-restarts N` does it) with "
        "`keras_dist.callbacks.BackupAndRestore` to resume from the last backup."
    )


def _gradients(tape, loss, variables):
    """`tape.gradient(loss, variables)`, also for partitioned variables.

    A variable split across ps tasks (`variable_partitioner`) gets the
    gradients of its shards joined along axis 0: an `IndexedSlices` when
    every shard's is one (embeddings), else a dense tensor.
    """
    shards = [_compat.variable_shards(variable) for variable in variables]
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


def _bind(method, args, kwargs) -> dict:
    """`args`/`kwargs` of a call of Keras's `method`, by parameter name."""
    bound = inspect.signature(method).bind(None, *args, **kwargs)
    values = dict(bound.arguments)
    values.pop("self")
    values.update(values.pop("kwargs", {}))
    return values


def _functional_class(cls):
    """`FunctionalDistributedModel` for `DistributedModel`; else `cls`, with
    `DistributedModel` replaced by it among its bases (and theirs)."""
    if cls is DistributedModel:
        return FunctionalDistributedModel
    if cls is object or not issubclass(cls, DistributedModel):
        return cls
    if not issubclass(cls, FunctionalDistributedModel):
        cls.__bases__ = tuple(_functional_class(base) for base in cls.__bases__)
    return cls


def _optionals_as_none(step_on_data):
    """Feeds `None` for empty `tf.experimental.Optional`s, as Keras does.

    A generator that yields `None` for an optional input reaches the step
    as an Optional (tf.data has no `None`).
    """

    def step(data):
        data = keras.tree.map_structure(
            lambda v: None if isinstance(v, tf.experimental.Optional) else v, data
        )
        return step_on_data(data)

    return step


def _is_functional_call(args, kwargs) -> bool:
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


def _loss_scaling_inside_accumulation(optimizer):
    """`LossScaleOptimizer(GradientAccumulationOptimizer(inner))` reordered.

    `apply_gradients` accumulates through the `GradientAccumulationOptimizer`
    and applies with its inner optimizer, so an outer `LossScaleOptimizer`
    would scale the loss and never unscale the update (its `apply` is not
    on that path). Inside, it checks and unscales the reduced, accumulated
    gradient, as `compile` arranges under `mixed_float16`.
    """
    if not (
        isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        and isinstance(optimizer.inner_optimizer, GradientAccumulationOptimizer)
    ):
        return optimizer
    accumulator = optimizer.inner_optimizer
    if optimizer.built or accumulator.built:
        raise RuntimeError(
            "`optimizer` is a built `LossScaleOptimizer` around a "
            "`GradientAccumulationOptimizer`; DistributedModel applies loss "
            "scaling inside the accumulation and cannot reorder built "
            f"optimizers. Received: optimizer={optimizer!r}. Pass "
            "`GradientAccumulationOptimizer(keras.optimizers."
            "LossScaleOptimizer(inner))` instead."
        )
    logger.info(
        "Moving the LossScaleOptimizer inside the GradientAccumulationOptimizer "
        "(it checks and unscales the accumulated, reduced gradient)."
    )
    accumulator.inner_optimizer = keras.optimizers.LossScaleOptimizer(
        accumulator.inner_optimizer,
        initial_scale=optimizer.initial_scale,
        dynamic_growth_steps=optimizer.dynamic_growth_steps,
        name=optimizer.name,
    )
    return accumulator


def _batch_size(x):
    """The batch dimension of `x` (a tensor; `x` may hold numpy arrays)."""
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
