"""The train and test functions of `DistributedModel`, with global logs."""

from __future__ import annotations

import warnings
import weakref

import keras
import tensorflow as tf

from keras_dist import _apply
from keras_dist._compat import keras_src as _compat
from keras_dist._compat import tf_internal
from keras_dist.core import collectives, topology
from keras_dist.core.optimizer_view import nested_optimizers
from keras_dist.parameter_server import training as _parameter_server
from keras_dist.trainer import logs as logs_lib


class FunctionsMixin:
    """`make_train_function` / `make_test_function` and their checks."""

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
        self._share_model_state()
        self.train_function = self._make_distributed_function(self.train_step)
        # Made again with the train function: the hook and the optimizer
        # may have changed (a new `compile`).
        self._keras_dist.pending_function = None
        self._warn_of_micro_batch_statistics()
        return self.train_function

    def _share_model_state(self):
        """A periodic optimizer (local SGD, DiLoCo) averages this model's
        non-trainable state (BatchNormalization's statistics) at its syncs."""
        for nested in nested_optimizers(getattr(self, "optimizer", None)):
            share = getattr(nested, "synchronize_model_state", None)
            if callable(share):
                share(self)

    def _warn_of_micro_batch_statistics(self):
        """Says that BatchNormalization sees micro-batches under accumulation.

        Its statistics (and moving averages) are those of each micro-batch,
        so the run differs from one batch `k` times larger, where the
        gradients alone agree.
        """
        updater = _apply.pending_updater(getattr(self, "optimizer", None))
        steps = 1 if updater is None else int(updater.accumulation_steps)
        if steps <= 1:
            return
        layers = [
            layer.name
            for layer in _compat.sublayers(self)
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
        ]
        if layers:
            warnings.warn(
                f"keras_dist: with accumulation_steps={steps}, the "
                f"BatchNormalization layers {layers} compute their batch "
                "statistics (and update their moving averages) on each "
                "micro-batch, not on the examples of a whole update: training "
                f"differs from one batch {steps} times larger (the gradients "
                "agree, the statistics do not).",
                stacklevel=3,
            )

    def _after_steps(self):
        """Ends an epoch of `fit`: applies an accumulation's pending window.

        Keras's `fit` calls it (`_compat.EpochStepsEnd`) when an epoch's
        steps end, before validation and `on_epoch_end`; `evaluate` calls
        it too, and nothing happens then. An epoch whose micro-steps are not
        a multiple of the accumulation steps ends with an update on its
        last, shorter window, as one batch `k` times larger would end it
        with a shorter batch.
        """
        settings = self._keras_dist
        if not settings.fitting or settings.evaluating:
            return
        optimizer = getattr(self, "optimizer", None)
        updater = _apply.pending_updater(optimizer)
        if updater is not None and not updater.built:
            updater = None
        syncer = _apply.periodic_syncer(optimizer)
        if syncer is not None and not syncer.built:
            syncer = None
        if updater is None and syncer is None:
            return
        if settings.pending_function is None:
            settings.pending_function = self._make_pending_function(updater, syncer)
        settings.pending_function()

    def _make_pending_function(self, updater, syncer=None):
        strategy = self.distribute_strategy
        hook = self._training_hook()
        non_finite = self._keras_dist.non_finite
        if non_finite == "raise" and self.jit_compile:
            non_finite = "apply"
        log_skips = not self.jit_compile

        def step():
            # An accumulation's last window first: its update may be the
            # one that fills a local SGD window.
            if updater is not None:
                updater.apply_pending(
                    hook, non_finite_gradients=non_finite, log_skips=log_skips
                )
            if syncer is not None:
                syncer.sync_pending()

        def apply_pending():
            # Traced alike on every worker, at the same point of `fit`.
            with collectives.stable_instance_keys():
                strategy.run(step)

        if self.run_eagerly:
            return apply_pending
        return tf.function(apply_pending)

    def make_test_function(self, force=False):
        if self.test_function is not None and not force:
            return self.test_function
        self._check_strategy()
        self._check_stepwise()
        self.test_function = self._make_distributed_function(self.test_step)
        return self.test_function

    def _check_strategy(self):
        strategy = self.distribute_strategy
        check_scopes(self)
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

        def compiled(fn):
            if self.run_eagerly:
                return _optionals_as_none(fn)
            return _optionals_as_none(
                tf.function(fn, reduce_retracing=True, jit_compile=self.jit_compile)
            )

        # Batches handed over from Python are traced by their shapes, which
        # can differ between workers (a short last batch), so their
        # collectives keep TensorFlow's instance keys; the iterator's steps
        # are traced alike on every worker and keep theirs
        # (`collectives.stable_instance_keys`), with functions of their own.
        run_on_data, step_on_data = (
            compiled(one_step_on_data),
            compiled(one_reduced_step_on_data),
        )
        iterator_run_on_data, iterator_step_on_data = (
            compiled(one_step_on_data),
            compiled(one_reduced_step_on_data),
        )

        @tf.autograph.experimental.do_not_convert
        def step_on_iterator(iterator):
            with collectives.stable_instance_keys():
                return steps_on_iterator(iterator)

        def steps_on_iterator(iterator):
            if self.steps_per_execution == 1:
                return iterator_step_on_data(iterator.get_next())

            def more(step, outputs, next_data):
                del outputs
                return tf.logical_and(
                    step < self.steps_per_execution, next_data.has_value()
                )

            def run_one(step, outputs, next_data):
                del outputs
                outputs = iterator_run_on_data(next_data.get_value())
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
                    iterator_run_on_data(iterator.get_next()),
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
        averaged over replicas. Under several workers both come from one
        all-reduce (`trainer.logs.one_collective`) where the metrics allow.
        """
        strategy = self.distribute_strategy
        multi_worker = tf_internal.is_multi_worker(strategy)
        packed = logs_lib.one_collective(self, outputs) if multi_worker else None
        if packed is None:
            metrics, means = logs_lib.flatten_logs(self.get_metrics_result()), {}
        else:
            metrics, means = packed

        def reduce_value(value):
            if id(value) in means:
                return means[id(value)]
            if isinstance(value, tf.distribute.DistributedValues) or (
                multi_worker and tf.is_tensor(value)
            ):
                return collectives.reduce_across(strategy, value, op="mean")
            return value

        def logs_of(outputs):
            if not isinstance(outputs, dict):
                return keras.tree.map_structure(reduce_value, outputs)
            logs = {}
            for key, value in outputs.items():
                if key in metrics:
                    logs[key] = metrics[key]
                elif isinstance(value, dict):
                    logs[key] = logs_of(value)
                else:
                    logs[key] = reduce_value(value)
            return logs

        return logs_of(outputs)


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


_warned = weakref.WeakSet()


def check_scopes(model) -> None:
    """Refuses a model fitted in another strategy's scope than its own, and
    warns (once per model) when it trains on fewer replicas than the
    strategy `keras_dist.auto_strategy()` built.

    Both are a model created outside `strategy.scope()`: it holds plain
    variables and trains on one device, or TensorFlow fails with "Mixing
    different tf.distribute.Strategy objects".
    """
    strategy = _compat.model_strategy(model)  # `None`: outside every scope
    current = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    if current is not None and current is not strategy:
        raise ValueError(
            f"The model {model.name!r} was created under "
            f"{_describe(strategy)} but is used inside the scope of "
            f"{_describe(current)}. Create (and compile) the model inside "
            "`with strategy.scope():` of the strategy it trains with, or wrap "
            "an existing model there with "
            "`keras_dist.DistributedModel.from_model(model)` (its variables "
            "must be created in that scope too)."
        )
    replicas = 1 if strategy is None else strategy.num_replicas_in_sync
    built = topology.auto_strategy_built()
    if (
        built is not None
        and built is not strategy
        and built.num_replicas_in_sync > replicas
        and model not in _warned
    ):
        _warned.add(model)
        warnings.warn(
            f"The model {model.name!r} was created under {_describe(strategy)}, "
            f"not under the {_describe(built)} that keras_dist.auto_strategy() "
            f"built: it trains on {replicas} replica(s) instead of "
            f"{built.num_replicas_in_sync}. Create and compile the model inside "
            "`with strategy.scope():`.",
            stacklevel=4,
        )


def _describe(strategy) -> str:
    if strategy is None or type(strategy).__name__ == "_DefaultDistributionStrategy":
        return "no strategy scope (one device)"
    return f"{type(strategy).__name__} ({strategy.num_replicas_in_sync} replicas)"
