"""`LocalSGDOptimizer` and `DiLoCoOptimizer`: synchronize every H updates."""

from __future__ import annotations

import logging
import warnings

import keras
import tensorflow as tf

from keras_dist import _apply, _registration  # noqa: F401 (registers the hooks)
from keras_dist._compat import keras_src as _compat
from keras_dist._validation import check_int
from keras_dist._wrapper import InnerOptimizerWrapper, check_base_kwargs
from keras_dist.core import aggregation, periodic
from keras_dist.core.optimizer_view import nested_optimizers
from keras_dist.core.plain import NoCompression
from keras_dist.optimizers import find_accumulator

logger = logging.getLogger(__name__)


@keras.saving.register_keras_serializable(package="keras_dist")
class LocalSGDOptimizer(InnerOptimizerWrapper):
    """Each replica trains on its own for `sync_every` updates, then they average.

    Post-local SGD (Lin et al., ICLR 2020; PyTorch's `PostLocalSGDOptimizer`
    with `PeriodicModelAverager`): after `warmup_steps` synchronous updates,
    every replica applies its own gradient to its own copy of the weights
    with its own optimizer state, with **no communication**; every
    `sync_every` updates the replicas average their weights. A sync sends
    what one synchronous step sends (the weights' size), so a step costs
    1/`sync_every` of a synchronous step's communication: the answer to a
    slow network when compressing the gradients is not enough.

    Semantics:

    - `sync_every` counts **optimizer updates**: under
      `GradientAccumulationOptimizer(LocalSGDOptimizer(inner, H), k)` a sync
      comes every `H` updates (`H * k` micro-batches), and an accumulation
      window is summed on its replica only.
    - A sync averages the trainable weights and the model's floating-point
      non-trainable state (BatchNormalization's moving statistics), each
      replica weighted by the examples it trained on since the last sync.
      With one update per window (`sync_every=1`) and SGD (with or without
      momentum) this is synchronous training. The inner optimizer's state
      (Adam's moments) stays on its replica.
    - The averaging goes through `sync_hook`: the replicas sum how far each
      moved since the last sync (`FP16()` halves the bytes of a sync).
    - `DistributedModel.fit` also syncs when an epoch's steps end (unless
      `sync_at_epoch_end=False`), so validation, `on_epoch_end` callbacks,
      `evaluate`, `predict` and saving after `fit` see one model. Between
      syncs each replica evaluates with its own weights, and a save reads
      the first replica's.
    - Backups (`BackupAndRestore`) save every replica's weights and
      optimizer state, and resume inside a window exactly. On another
      number of replicas the replicas' weights and state are averaged (an
      early sync) and the window goes on.

    Not supported (refused when built): `ShardedOptimizer` inside or
    around it, a `LossScaleOptimizer` (`mixed_float16`; use
    `mixed_bfloat16`), `ParameterServerStrategy`, a `sync_hook` with state
    (`TopK`, `PowerSGD`, `DGC`: their error feedback belongs to per-step
    gradients).

    Args:
        inner_optimizer: `keras.optimizers.Optimizer`. Each replica's own
            optimizer (its state stays per replica).
        sync_every: Int >= 1. Updates between syncs (`H`).
        warmup_steps: Int >= 0. Synchronous updates before the first local
            one (post-local SGD's warm-up). Defaults to `0`.
        sync_hook: `keras_dist.compression.AllReduceHook` without state, or
            `None` (a plain sum). How a sync sums the replicas' changes.
        sync_at_epoch_end: Bool. Whether `DistributedModel.fit` syncs when
            an epoch's steps end. Defaults to `True`.
        name: String or `None`. Name of the optimizer.
        **kwargs: Base optimizer arguments, accepted only at their Keras
            defaults (they belong on `inner_optimizer`).

    Example:

    ```python
    with strategy.scope():
        model = keras_dist.DistributedModel(inputs, outputs)
        model.compile(
            optimizer=keras_dist.LocalSGDOptimizer(
                keras.optimizers.SGD(0.1, momentum=0.9), sync_every=16
            ),
            loss="sparse_categorical_crossentropy",
        )
    ```
    """

    def __init__(
        self,
        inner_optimizer,
        sync_every,
        warmup_steps=0,
        sync_hook=None,
        sync_at_epoch_end=True,
        name=None,
        **kwargs,
    ):
        wrapper = type(self).__name__
        check_base_kwargs(wrapper, kwargs)
        _check_inner(wrapper, inner_optimizer)
        sync_every = _check_sync_every(sync_every)
        warmup_steps = check_int(
            "warmup_steps", warmup_steps, minimum=0, maximum=10**12
        )
        if not isinstance(sync_at_epoch_end, bool):
            raise TypeError(
                "`sync_at_epoch_end` must be a bool. Received: "
                f"sync_at_epoch_end={sync_at_epoch_end!r}."
            )
        super().__init__(learning_rate=0.0, name=name)
        self._initial_sync_every = sync_every
        self._warmup_steps = warmup_steps
        self.inner_optimizer = inner_optimizer
        self.sync_at_epoch_end = sync_at_epoch_end
        self._sync_hook = (
            NoCompression()
            if sync_hook is None
            else aggregation.check_hook(sync_hook, "sync_hook")
        )
        self._user_sync_hook = sync_hook
        _compat.set_untracked_attribute(self, "_model_state", None)
        _compat.set_untracked_attribute(self, "_warned_plain", False)

    # --- State ----------------------------------------------------------------

    def build(self, var_list):
        var_list = list(var_list)
        strategy = tf.distribute.get_strategy()
        self._check_strategy(strategy)
        self._anchors = [
            self.add_variable_from_reference(v, name="anchor") for v in var_list
        ]
        for anchor, variable in zip(self._anchors, var_list):
            anchor.assign(variable)
        self._since_sync = self.add_variable(
            shape=(),
            dtype="int64",
            initializer="zeros",
            aggregation="only_first_replica",
            name="updates_since_sync",
        )
        self._sync_every_variable = self.add_variable(
            shape=(),
            dtype="int64",
            initializer=keras.initializers.Constant(self._initial_sync_every),
            aggregation="only_first_replica",
            name="sync_every",
        )
        # Examples this replica trained on since the last sync.
        self._examples = _compat.add_replica_local_variable(
            self, tf.zeros((), tf.float32), name="examples_since_sync"
        )
        self.inner_optimizer.build(var_list)
        self._build_outer(self._anchors)
        aggregation.build_hook(self._sync_hook, var_list, strategy)
        if self._sync_hook.per_variable_state_names:
            raise ValueError(
                f"{type(self).__name__} needs a `sync_hook` without state: "
                f"{type(self._sync_hook).__name__} keeps error feedback "
                "meant for the gradients of every step, not for the changes "
                "of a window. Received: sync_hook="
                f"{self._sync_hook!r}. Use `keras_dist.compression.FP16()`, "
                "`BF16()` or `None` (a plain sum)."
            )
        window = periodic.SyncWindow(
            var_list,
            self._anchors,
            _tf(self._since_sync),
            _tf(self._sync_every_variable),
            self._examples,
        )
        window.bind(self._sync_hook, self._outer_apply)
        if self._model_state is not None:
            window.model_state = list(self._model_state)
        _compat.set_untracked_attribute(self, "_window", window)
        super().build(var_list)

    def _build_outer(self, anchors):
        """DiLoCo builds its outer optimizer on the anchors."""

    def _check_strategy(self, strategy):
        if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
            raise ValueError(
                f"{type(self).__name__} does not work under "
                "ParameterServerStrategy: the variables live on the parameter "
                "servers, so the workers have no copy of their own to train "
                "between syncs. Received: strategy=ParameterServerStrategy. "
                "Use MirroredStrategy or MultiWorkerMirroredStrategy "
                "(`keras_dist.auto_strategy()`)."
            )
        if _compat.optimizer_strategy(self.inner_optimizer) is not strategy:
            raise ValueError(
                "The `inner_optimizer` was created outside the strategy scope "
                "the model trains under. Received: inner_optimizer="
                f"{self.inner_optimizer!r}. Create it inside "
                "`with strategy.scope():`, together with the model."
            )
        if keras.config.dtype_policy().name == "mixed_float16":
            raise ValueError(_LOSS_SCALING.format(name=type(self).__name__))

    @property
    def sync_every(self) -> int:
        """Updates between syncs (`H`). Assignable while training runs."""
        if not self.built:
            return self._initial_sync_every
        return int(self._sync_every_variable.numpy())

    @sync_every.setter
    def sync_every(self, value):
        value = _check_sync_every(value)
        self._initial_sync_every = value
        if self.built:
            self._sync_every_variable.assign(value)

    @property
    def warmup_steps(self) -> int:
        """Synchronous updates before the first local one."""
        return self._warmup_steps

    @property
    def sync_hook(self):
        """The hook a sync sums the replicas' changes with."""
        return self._sync_hook

    @property
    def updates_since_sync(self):
        """Updates applied since the last sync (the same on every replica)."""
        self._check_built("updates_since_sync")
        return self._since_sync

    def synchronize_model_state(self, model) -> None:
        """Averages `model`'s non-trainable state at every sync too.

        Its floating-point non-trainable variables (BatchNormalization's
        moving mean and variance): each replica updates its own copy
        between syncs. `DistributedModel` calls it when `fit` starts; with
        a plain `keras.Model`, call it after `compile` and before `fit`.

        Args:
            model: The `keras.Model` this optimizer trains.
        """
        state = [
            v for v in model.non_trainable_variables if tf.as_dtype(v.dtype).is_floating
        ]
        replicas = model.distribute_strategy.num_replicas_in_sync
        # Statistics that training updates per replica (a frozen layer's do
        # not move).
        moving = [
            layer.name
            for layer in _compat.sublayers(model)
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
        ]
        if moving and replicas > 1 and self._model_state is None:
            # Once per optimizer: `fit` calls this each time it starts.
            logger.warning(
                "keras_dist: %s averages the moving statistics of %s over the "
                "%d replicas at every sync. Stock Keras under a strategy lets "
                "each replica's copy of them drift apart and reads and saves "
                "the first replica's, so the statistics (and what they "
                "normalize) differ from stock Keras's on as many replicas, by "
                "design.",
                type(self).__name__,
                ", ".join(moving),
                replicas,
            )
        _compat.set_untracked_attribute(self, "_model_state", state)
        if self.built:
            self._window.model_state = list(state)

    @property
    def local_rules(self) -> dict:
        """`id(tf variable) -> "mean"` for the state each replica holds on
        its own between syncs: the weights, the model state averaged at a
        sync and the inner optimizer's slots. The training-state inventory
        saves a copy per replica and averages them on another replica
        count."""
        if not self.built:
            return {}
        shared = {
            id(_tf(v))
            for v in (self.inner_optimizer.iterations, _learning_rate(self))
            if v is not None
        }
        local = [*self._window.variables, *self._window.model_state]
        for nested in nested_optimizers(self.inner_optimizer):
            local += _compat.optimizer_own_variables(nested)
        return {id(_tf(v)): "mean" for v in local if id(_tf(v)) not in shared}

    def _check_built(self, what):
        if not self.built:
            raise RuntimeError(
                f"`{what}` needs a built optimizer: compile the model and train "
                "(or call `optimizer.build(model.trainable_variables)`) first."
            )

    # --- Update -----------------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        """Applies this replica's `grads` to its own weights; syncs every H.

        Called in replica context by a plain `keras.Model`'s `train_step`
        (`apply_gradients`).
        """
        if tf.distribute.in_cross_replica_context() and (
            tf.distribute.get_strategy().num_replicas_in_sync > 1
        ):
            raise RuntimeError(
                f"{type(self).__name__}.apply must run in replica context "
                "(inside `strategy.run`, as `fit` runs `train_step`). A "
                "LossScaleOptimizer around it (mixed_float16) applies in "
                "cross-replica context: use mixed_bfloat16."
            )
        if trainable_variables is None:
            trainable_variables = _compat.optimizer_trainable_variables(self)
        if self._model_state is None and not self._warned_plain:
            _compat.set_untracked_attribute(self, "_warned_plain", True)
            warnings.warn(
                f"keras_dist: {type(self).__name__} trains a plain keras.Model: "
                "its syncs average the trainable weights only (not "
                "BatchNormalization's moving statistics), and a window runs "
                "across epochs. Call `optimizer.synchronize_model_state(model)` "
                "after compile, or wrap the model with "
                "`keras_dist.DistributedModel.from_model(model)`, which also "
                "syncs when an epoch ends.",
                stacklevel=2,
            )
        self.apply_locally(grads, trainable_variables, hook=None)

    def apply_locally(
        self,
        grads,
        trainable_variables,
        hook=None,
        batch_size=None,
        non_finite_gradients="apply",
        log_skips=True,
    ):
        """One update: synchronous in the warm-up, on this replica after it.

        Runs in replica context. `keras_dist`'s aggregation path calls it
        for `DistributedModel` (with the hook the model trains with, which
        sums the warm-up's gradients); `apply` for a plain `keras.Model`.

        Args:
            grads: List of this replica's gradients (`None` entries dropped
                with their variables, as Keras does).
            trainable_variables: List of the matching variables.
            hook: `AllReduceHook` or `None`: sums the warm-up's gradients
                (`None`: a plain sum).
            batch_size: Int, scalar tensor or `None`: this replica's examples.
            non_finite_gradients: String: `"apply"`, `"skip"` or `"raise"`.
            log_skips: Bool: whether a skipped update is logged.
        """
        variables = list(trainable_variables)
        grads = list(grads)
        if not grads:
            return
        _apply.build_optimizer(self, variables)
        grads, variables = _apply.filter_empty_gradients(grads, variables)
        hook = self._sync_hook if hook is None else hook
        names = [getattr(v, "path", None) or v.name for v in variables]
        how_to_raise = (
            "compile(..., non_finite_gradients='raise')" if log_skips else None
        )

        def local(grads):
            window = self._window
            window.start_window()
            window.local_update(
                grads,
                variables,
                self._apply_inner,
                non_finite_gradients,
                self.inner_optimizer.iterations,
                how_to_raise,
                names,
                batch_size=batch_size,
            )

        def synchronous(grads):
            _apply.reduce_and_apply(
                self.inner_optimizer,
                grads,
                variables,
                hook,
                batch_size,
                non_finite_gradients=non_finite_gradients,
                log_skips=log_skips,
            )

        if self._warmup_steps == 0:
            local(grads)
            return
        _choose(
            self.inner_optimizer.iterations < self._warmup_steps,
            synchronous,
            local,
            grads,
        )

    def sync_pending(self):
        """Syncs now when the window holds updates (replica context).

        `DistributedModel.fit` calls it when an epoch's steps end (with
        `sync_at_epoch_end`).
        """
        self._check_built("sync_pending")
        self._window.sync_pending()

    def _apply_inner(self, grads, variables):
        with _compat.optimizer_all_reduce_disabled(self.inner_optimizer):
            self.inner_optimizer.apply(grads, variables)

    def _outer_apply(self, mean_delta, anchors):
        """Local SGD: the anchors move by the replicas' mean change."""
        for anchor, delta in zip(anchors, mean_delta):
            anchor.assign_sub(delta)

    # --- Serialization ----------------------------------------------------------

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(
                self.inner_optimizer
            ),
            "sync_every": self._initial_sync_every,
            "warmup_steps": self._warmup_steps,
            "sync_hook": keras.saving.serialize_keras_object(self._user_sync_hook),
            "sync_at_epoch_end": self.sync_at_epoch_end,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        for key in ("inner_optimizer", "outer_optimizer", "sync_hook"):
            if key in config:
                config[key] = keras.saving.deserialize_keras_object(
                    config[key], custom_objects=custom_objects
                )
        return cls(**config)


@keras.saving.register_keras_serializable(package="keras_dist")
class DiLoCoOptimizer(LocalSGDOptimizer):
    """DiLoCo: local steps of an inner optimizer, an outer step every H.

    Douillard et al., "DiLoCo: Distributed Low-Communication Training of
    Language Models" (2023): every replica takes `sync_every` steps of its
    inner optimizer (AdamW in the paper) on its own; then the replicas
    average their *pseudo-gradient*, the global weights minus their own,
    and an outer optimizer (SGD with Nesterov momentum, learning rate 0.7,
    momentum 0.9) applies it to the global weights, which every replica
    takes. 8 workers at H = 500 match synchronous training with 500 times
    less communication in the paper. Local SGD is DiLoCo with the outer
    `SGD(learning_rate=1.0)`.

    Everything else is as in `LocalSGDOptimizer`: `sync_every` counts
    updates, the inner optimizer's state stays per replica, the outer
    optimizer's state is one copy (the same on every replica), the sync
    goes through `sync_hook` (`FP16()`: OpenDiLoCo's half-precision
    all-reduce), and the refusals are the same.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer`. Each replica's own
            optimizer.
        sync_every: Int >= 1. Inner updates between outer steps (`H`).
        outer_optimizer: `keras.optimizers.Optimizer` or `None`. Applies the
            averaged pseudo-gradient to the global weights. Create it in
            the strategy scope. `None`: `SGD(learning_rate=0.7,
            momentum=0.9, nesterov=True)`, the paper's.
        warmup_steps: Int >= 0. Synchronous updates first. Defaults to `0`.
        sync_hook: As in `LocalSGDOptimizer`.
        sync_at_epoch_end: As in `LocalSGDOptimizer`.
        name: String or `None`. Name of the optimizer.
        **kwargs: As in `LocalSGDOptimizer`.

    Example:

    ```python
    with strategy.scope():
        model = keras_dist.DistributedModel(inputs, outputs)
        model.compile(
            optimizer=keras_dist.DiLoCoOptimizer(
                keras.optimizers.AdamW(1e-3), sync_every=128
            ),
            loss="sparse_categorical_crossentropy",
        )
    ```
    """

    def __init__(
        self,
        inner_optimizer,
        sync_every,
        outer_optimizer=None,
        warmup_steps=0,
        sync_hook=None,
        sync_at_epoch_end=True,
        name=None,
        **kwargs,
    ):
        super().__init__(
            inner_optimizer,
            sync_every,
            warmup_steps=warmup_steps,
            sync_hook=sync_hook,
            sync_at_epoch_end=sync_at_epoch_end,
            name=name,
            **kwargs,
        )
        if outer_optimizer is None:
            outer_optimizer = keras.optimizers.SGD(
                learning_rate=0.7, momentum=0.9, nesterov=True, name="outer_sgd"
            )
        elif not isinstance(outer_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "`outer_optimizer` must be a `keras.optimizers.Optimizer` "
                f"instance or None. Received: outer_optimizer={outer_optimizer!r}."
                " Pass e.g. `keras.optimizers.SGD(0.7, momentum=0.9, "
                "nesterov=True)`."
            )
        elif any(
            hasattr(n, "apply_locally") or hasattr(n, "inner_optimizer")
            for n in nested_optimizers(outer_optimizer)
        ):
            raise ValueError(
                "`outer_optimizer` must be a plain Keras optimizer (it applies "
                "one averaged pseudo-gradient per sync). Received: "
                f"outer_optimizer={type(outer_optimizer).__name__}."
            )
        self.outer_optimizer = outer_optimizer

    @property
    def variables(self):
        return super().variables + self.outer_optimizer.variables

    def _build_outer(self, anchors):
        if (
            _compat.optimizer_strategy(self.outer_optimizer)
            is not tf.distribute.get_strategy()
        ):
            raise ValueError(
                "The `outer_optimizer` was created outside the strategy scope "
                "the model trains under. Received: outer_optimizer="
                f"{self.outer_optimizer!r}. Create it inside "
                "`with strategy.scope():`, or leave it `None`."
            )
        self.outer_optimizer.build(anchors)

    def _outer_apply(self, mean_delta, anchors):
        """The outer optimizer's step on the averaged pseudo-gradient."""
        with _compat.optimizer_all_reduce_disabled(self.outer_optimizer):
            self.outer_optimizer.apply(mean_delta, self._anchors)

    def get_config(self):
        config = super().get_config()
        config["outer_optimizer"] = keras.saving.serialize_keras_object(
            self.outer_optimizer
        )
        return config


_LOSS_SCALING = (
    "{name} does not support loss scaling (the mixed_float16 policy, "
    "keras.optimizers.LossScaleOptimizer): each replica would scale its own "
    "loss and skip its own updates, and the replicas' update counts, which "
    "decide when they sync, would part. Use the mixed_bfloat16 policy (no "
    "loss scaling), or synchronous training."
)


def _check_inner(wrapper, inner):
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a `keras.optimizers.Optimizer` instance. "
            f"Received: inner_optimizer={inner!r}. Pass e.g. "
            "`keras.optimizers.SGD(0.1, momentum=0.9)`."
        )
    for nested in nested_optimizers(inner):
        name = type(nested).__name__
        if isinstance(nested, keras.optimizers.LossScaleOptimizer):
            raise ValueError(_LOSS_SCALING.format(name=wrapper))
        if find_accumulator(nested) is nested:
            raise ValueError(
                f"Wrap accumulation around {wrapper}, not inside it: "
                f"`GradientAccumulationOptimizer({wrapper}(inner, sync_every), "
                "accumulation_steps)` (sync_every then counts updates). "
                f"Received: inner_optimizer={name}."
            )
        if hasattr(nested, "shard_and_apply"):
            raise ValueError(
                f"{wrapper} does not work with ShardedOptimizer: between syncs "
                "each replica needs the whole optimizer state of its own "
                f"weights. Received: inner_optimizer={name}. Train "
                "unsharded, or sharded and synchronous."
            )
        if hasattr(nested, "apply_locally"):
            raise ValueError(
                f"`inner_optimizer` already synchronizes periodically ({name}). "
                f"Received: inner_optimizer={name}."
            )
    if getattr(inner, "gradient_accumulation_steps", None):
        raise ValueError(
            "`inner_optimizer` uses Keras's own `gradient_accumulation_steps`, "
            "which fails under tf.distribute (keras-team/keras#20582). Use "
            f"`GradientAccumulationOptimizer({wrapper}(inner, sync_every), k)`."
        )


def _check_sync_every(value) -> int:
    return check_int(
        "sync_every",
        value,
        minimum=1,
        maximum=10**9,
        hint="1 syncs after every update (synchronous training for SGD).",
    )


def _choose(flag, if_true, if_false, grads):
    """Runs `if_true(grads)` or `if_false(grads)` on every replica alike.

    `flag` is the same on every replica. The branches hold collectives and
    `merge_call`s, so the cond is in cross-replica context (see
    `keras_dist.core.accumulation`); the gradients cross `merge_call` as
    tensors (a sparse one as its values, indices and shape).
    """
    packed = [_pack(g) for g in grads]

    def cross_replica(strategy, flag, packed):
        flag = strategy.experimental_local_results(flag)[0]

        def branch(fn):
            def run():
                strategy.extended.call_for_each_replica(
                    lambda packed: fn([_unpack(p) for p in packed]), args=(packed,)
                )
                return tf.constant(True)

            return run

        return tf.cond(flag, branch(if_true), branch(if_false))

    tf.distribute.get_replica_context().merge_call(
        cross_replica, args=(tf.convert_to_tensor(flag), packed)
    )


def _pack(gradient):
    if isinstance(gradient, tf.IndexedSlices):
        return (gradient.values, gradient.indices, gradient.dense_shape)
    return (tf.convert_to_tensor(gradient),)


def _unpack(packed):
    if len(packed) == 3:
        return tf.IndexedSlices(*packed)
    return packed[0]


def _tf(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def _learning_rate(optimizer):
    value = getattr(
        list(nested_optimizers(optimizer.inner_optimizer))[-1], "_learning_rate", None
    )
    return value if isinstance(value, (keras.Variable, tf.Variable)) else None


def find_periodic(optimizer):
    """The `LocalSGDOptimizer` (or `DiLoCoOptimizer`) in `optimizer`'s
    wrappers, or `None`."""
    if optimizer is None:
        return None
    for nested in nested_optimizers(optimizer):
        if isinstance(nested, LocalSGDOptimizer):
            return nested
    return None
