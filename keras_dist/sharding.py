"""`ShardedOptimizer`: each replica keeps 1/N of the optimizer state (ZeRO)."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_dist import _apply, _registration  # noqa: F401 (registers the hooks)
from keras_dist._compat import keras_src as _compat
from keras_dist._owned import Owned, apply_owned
from keras_dist._sharding_checks import ELEMENTWISE, check_inner  # noqa: F401
from keras_dist._shards import Shards, apply_as_decided, load_whole, save_whole
from keras_dist._shards import tf_variable as _tf_variable
from keras_dist._validation import check_int
from keras_dist._wrapper import InnerOptimizerWrapper, check_base_kwargs
from keras_dist.core import (
    accumulation,
    casts,
    collectives,
    sharding,
)
from keras_dist.core.hook_types import DEFAULT_BUCKET_BYTES
from keras_dist.core.optimizer_view import nested_optimizers
from keras_dist.core.plain import NoCompression


@keras.saving.register_keras_serializable(package="keras_dist")
class ShardedOptimizer(InnerOptimizerWrapper):
    """Shards the optimizer state over the replicas: ZeRO stages 1 and 2.

    Adam keeps two slots per weight, so every replica of a model of `P`
    float32 parameters holds `8P` bytes of optimizer state, the same on every
    replica. Wrapped in `ShardedOptimizer`, each of the `N` replicas owns an
    equal slice of the parameters and keeps the optimizer state of its slice
    only: `8P / N` bytes, plus its float32 copy of the slice (`4P / N`). The
    parameters are cut into segments of about `bucket_bytes` (whole
    variables, from the last back, as the all-reduce's buckets are), and
    each segment is split into `N` equal pieces: a replica's slice is its
    piece of every segment. An update reduce-scatters each segment's
    gradients as soon as the backward pass has computed them (each replica
    gets the sum of its pieces, while the backward pass goes on), runs the
    wrapped optimizer's own update on the slice, and all-gathers the updated
    pieces into every replica's weights, segment by segment: the bytes of
    one all-reduce, as without sharding, and no copy of the whole model on
    the step (Rajbhandari et al., "ZeRO", SC 2020; DeepSpeed's stage 2).
    The weights equal the unsharded optimizer's, to float rounding.

    With `accumulation_steps=k > 1` (stage 2) every micro-step's gradients
    are reduce-scattered into slice-sized accumulators (their memory is 1/N
    too), and the update runs on every k-th. Communication then happens on
    every micro-step; `GradientAccumulationOptimizer(ShardedOptimizer(...),
    k)` keeps full-size local accumulators and communicates on updates only
    (stage 1 with accumulation): pick by what is scarcer, memory or network.

    Works with `DistributedModel` and with a plain `keras.Model`, under
    `MirroredStrategy`, `MultiWorkerMirroredStrategy` and without a strategy
    (one replica: nothing is sharded). What composes:

    - the inner optimizer's `clipnorm` (per variable), `global_clipnorm` and
      `clipvalue` act on the summed gradient, exactly (the norms are
      all-reduced from the slices); `weight_decay` and
      `exclude_from_weight_decay` act per element of the slice;
    - `LossScaleOptimizer` (mixed precision): inside, as
      `ShardedOptimizer(LossScaleOptimizer(inner))`, which
      `DistributedModel.compile` arranges under `mixed_float16`. A plain
      `keras.Model` under `mixed_float16` adds its own scaler outside: give
      it `ShardedOptimizer(inner)` (the inner scaler is refused there);
    - `DistributedModel(..., all_reduce_hook=FP16())` or `BF16()`: the
      gradients travel in 16 bits on the reduce-scatter and are summed in
      float32 on arrival (a float16 overflow is sent again at full precision
      in the same step, as the all-reduce hook does); the all-gather of the
      updated weights stays at full precision (the float32 weights are what
      the slices are read back from). The other hooks (TopK, PowerSGD, DGC,
      custom ones) are refused by name: they compress an all-reduce;
    - `BackupAndRestore`, `.keras` files and `tf.train.Checkpoint`: the state
      is saved whole (gathered from the slices) and resharded on load, on any
      number of replicas.

    An optimizer whose update of an element needs other elements of its
    variable (Adafactor's factored moments, Lamb's per-variable trust
    ratio, Muon's orthogonalized update) is sharded by whole variables
    instead (`shard_by="variables"`, which `"auto"` picks for them), as
    PyTorch's `ZeroRedundancyOptimizer` does: each replica owns whole
    variables, balanced by size, and keeps their state only, in copies of
    the inner optimizer on its device; one reduce-scatter gives each
    replica its variables' summed gradients, one all-gather everyone's
    updated variables. The state per replica is then about `1/N`, as
    even as the variables' sizes allow; `.keras` files and
    `tf.train.Checkpoint` hold it (on any replica count), the backups of
    `BackupAndRestore` do not yet (it refuses), and accumulation wraps it
    (`GradientAccumulationOptimizer(ShardedOptimizer(...), k)`). A subclass
    of an elementwise optimizer that replaces its update rule
    (`update_step`) is sharded by variables too, unless the class says its
    update is elementwise (`elementwise = True` as a class attribute).

    Args:
        inner_optimizer: `keras.optimizers.Optimizer`, or a
            `LossScaleOptimizer` around one. Sharded by elements: one of the
            elementwise ones (`ELEMENTWISE`: SGD, Adam, AdamW, Adamax, Nadam,
            RMSprop, Adagrad, Adadelta, Ftrl, Lion, or a subclass).
        accumulation_steps: Int >= 1. Micro-steps per update, with
            reduce-scattered slice accumulators (stage 2). Defaults to `1`.
        bucket_bytes: Int or `None`. The size of a segment in bytes: one
            reduce-scatter and one all-gather each (between worker
            processes on TensorFlow's CPU collectives, a larger one, and the
            vector of `shard_by="variables"`, go in concurrent chunks of this
            size). Defaults to
            `keras_dist.compression.DEFAULT_BUCKET_BYTES` (4 MiB). `None`:
            one segment, the whole model flattened (one collective each,
            after the backward pass). The saved state does not depend on
            it: a backup or `.keras` file loads with any value.
        shard_by: String: `"elements"` (every variable split over the
            replicas; elementwise optimizers only), `"variables"` (whole
            variables per replica; any optimizer, no `accumulation_steps`)
            or `"auto"`: elements for an elementwise optimizer, variables
            otherwise. Defaults to `"auto"`.
        name: String or `None`. Name of the optimizer.
        **kwargs: Base optimizer arguments, accepted only at their Keras
            default values: set them on `inner_optimizer`.

    Raises:
        TypeError: `inner_optimizer` is not a Keras optimizer.
        ValueError: an optimizer that is not elementwise with
            `shard_by="elements"`, EMA, Keras's own gradient accumulation,
            an optimizer that is already sharded or accumulating, or a
            refused argument.

    Example:

    ```python
    with strategy.scope():
        model = keras_dist.DistributedModel(inputs, outputs)
        model.compile(
            optimizer=keras_dist.ShardedOptimizer(keras.optimizers.Adam(1e-3)),
            loss="sparse_categorical_crossentropy",
        )
    ```
    """

    def __init__(
        self,
        inner_optimizer,
        accumulation_steps=1,
        bucket_bytes=DEFAULT_BUCKET_BYTES,
        shard_by="auto",
        name=None,
        **kwargs,
    ):
        check_base_kwargs("ShardedOptimizer", kwargs)
        by_variables = check_inner(inner_optimizer, shard_by) == "variables"
        steps = check_int(
            "accumulation_steps",
            accumulation_steps,
            minimum=1,
            maximum=10**9,
            hint="1 means no accumulation.",
        )
        bucket_bytes = collectives.check_bucket_bytes(bucket_bytes)
        if by_variables and steps > 1:
            raise ValueError(
                "ShardedOptimizer accumulates only when it shards by elements. "
                f"Received: accumulation_steps={steps} with "
                f"{type(inner_optimizer).__name__} sharded by whole variables. "
                "Wrap it: `GradientAccumulationOptimizer(ShardedOptimizer("
                f"inner), {steps})`."
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self._accumulation_steps = steps
        self._bucket_bytes = bucket_bytes
        self._shard_by = shard_by
        self._by_variables = by_variables

    # --- The wrapped optimizer ----------------------------------------------

    @property
    def _base(self):
        """The optimizer that updates the slices (inside loss scaling)."""
        inner = self.inner_optimizer
        if isinstance(inner, keras.optimizers.LossScaleOptimizer):
            return inner.inner_optimizer
        return inner

    @property
    def _loss_scaler(self):
        inner = self.inner_optimizer
        if isinstance(inner, keras.optimizers.LossScaleOptimizer):
            return inner
        return None

    @property
    def accumulation_steps(self) -> int:
        """Micro-steps per update (stage 2 when > 1)."""
        return self._accumulation_steps

    # --- State ----------------------------------------------------------------

    def build(self, var_list):
        var_list = list(var_list)
        strategy = tf.distribute.get_strategy()
        if _compat.optimizer_strategy(self._base) is not strategy:
            raise ValueError(
                "The `inner_optimizer` was created outside the strategy scope "
                "the model trains under. Create it inside `with "
                "strategy.scope():`, together with the model."
            )
        dtypes = {tf.as_dtype(v.dtype) for v in var_list}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating:
            raise ValueError(
                "ShardedOptimizer shards variables of one floating-point dtype. "
                f"Received: trainable variables of dtypes "
                f"{sorted(d.name for d in dtypes)}. Mark the others "
                "`trainable=False`."
            )
        dtype = next(iter(dtypes))
        replicas = strategy.num_replicas_in_sync
        if self._by_variables:
            self._build_owned(var_list, strategy)
            super().build(var_list)
            return
        layout = sharding.ShardLayout(
            [v.shape for v in var_list],
            replicas,
            bucket_bytes=self._bucket_bytes,
            dtype=dtype,
        )
        _compat.set_untracked_attribute(
            self,
            "_shards",
            Shards(layout, var_list, self._base, strategy),
        )
        with sharding.replica_local_variables(on_create=self._shards.checkpoint_whole):
            self._slice = keras.Variable(
                keras.initializers.Zeros(),
                shape=(layout.slice_size,),
                dtype=dtype,
                name="parameter_slice",
            )
            if self._loss_scaler is not None:
                self._loss_scaler.build([self._slice])
            else:
                self._base.build([self._slice])
            if self._accumulation_steps > 1:
                self._accumulator = keras.Variable(
                    keras.initializers.Zeros(),
                    shape=(layout.slice_size,),
                    dtype=dtype,
                    name="gradient_slice_accumulator",
                )
        if self._accumulation_steps > 1:
            self._build_cycle()
        self._save_inner_whole()
        super().build(var_list)

    def _build_owned(self, var_list, strategy):
        """Whole variables per replica: their state in per-variable copies
        of the inner optimizer on the owners' devices (`_owned.Owned`)."""
        layout = sharding.OwnerLayout(
            [v.shape for v in var_list],
            strategy.num_replicas_in_sync,
            chunk_bytes=self._bucket_bytes,
        )
        base = self._base
        _compat.set_untracked_attribute(
            self, "_shards", Shards(layout, var_list, base, strategy)
        )
        owned = Owned(layout, var_list, base, strategy)
        _compat.set_untracked_attribute(self, "_owned", owned)
        owned.track(self)
        (self._loss_scaler or base).build([])
        self._save_inner_whole()

    def _save_inner_whole(self):
        # Keras's saving visits `inner_optimizer` (and what it wraps) on its
        # own, calling their `save_own_variables`: a sharded slot would be
        # saved as the first replica's slice, an owned one not at all. Those
        # of these instances go through the same gathering and resharding as
        # this wrapper's.
        for inner in nested_optimizers(self.inner_optimizer):
            owned = getattr(self, "_owned", None) if inner is self._base else None
            _compat.set_untracked_attribute(
                inner,
                "save_own_variables",
                lambda store, inner=inner, owned=owned: save_whole(
                    self, inner.variables, store, owned
                ),
            )
            _compat.set_untracked_attribute(
                inner,
                "load_own_variables",
                lambda store, inner=inner, owned=owned: load_whole(
                    self, inner.variables, store, owned
                ),
            )

    def _build_cycle(self):
        examples = _compat.add_replica_local_variable(
            self, tf.zeros((), tf.float32), name="accumulated_examples"
        )

        def counter(name, value):
            return self.add_variable(
                shape=(),
                dtype="int64",
                initializer=keras.initializers.Constant(value),
                aggregation="only_first_replica",
                name=name,
            )

        _compat.set_untracked_attribute(
            self,
            "_cycle",
            accumulation.AccumulationCycle(
                [self._accumulator],
                examples,
                counter("pending_micro_steps", 0),
                counter("micro_steps", 0),
                counter("accumulation_steps", self._accumulation_steps),
                [self._slice],
            ),
        )

    @property
    def bucket_bytes(self):
        """The size of a segment of the layout in bytes (`None`: one)."""
        return self._bucket_bytes

    @property
    def shard_rules(self) -> dict:
        """`id(variable) -> segment lengths` of the per-replica slices.

        What `keras_dist.state.training_state` records as the `"shard"`
        rule: the slices are pieces of one vector's segments, resharded (not
        summed or copied) on another replica count.
        """
        if not self.built or self._by_variables:
            return {}
        segments = tuple(self._shards.layout.segments)
        sliced = [self._slice, *self._base.variables]
        if self._accumulation_steps > 1:
            sliced.append(self._accumulator)
        # Without a strategy (one replica) the slice is an ordinary variable
        # holding the whole vector: the inventory's 'same', not a shard.
        return {
            id(_tf_variable(v)): segments
            for v in sliced
            if tuple(v.shape) == (self._shards.layout.slice_size,)
            and isinstance(_tf_variable(v), tf.distribute.DistributedValues)
        }

    @property
    def shard_by(self) -> str:
        """How the state is sharded: `"elements"` or `"variables"`."""
        return "variables" if self._by_variables else "elements"

    @property
    def owned_state(self) -> list:
        """`(name, handle)` of the optimizer state each replica owns, for
        the training state's inventory (`inventory.OWNED` entries); empty
        unless sharded by whole variables."""
        owned = getattr(self, "_owned", None)
        if not self.built or owned is None:
            return []
        return owned.state_handles()

    # --- Update ---------------------------------------------------------------

    def scale_loss(self, loss):
        # Seen while tracing: `apply` checks that the loss it unscales was
        # scaled here (see `_check_loss_scaled`).
        self._scaled_loss = True
        return super().scale_loss(loss)

    def apply(self, grads, trainable_variables=None):
        """Reduce-scatters `grads`, updates the slices, all-gathers them.

        What a plain `keras.Model`'s `train_step` calls (replica context);
        `DistributedModel` calls `shard_and_apply` with its batch sizes.
        """
        self._check_loss_scaled()
        if trainable_variables is None:
            trainable_variables = _compat.optimizer_trainable_variables(self)
        self.shard_and_apply(grads, trainable_variables)

    def _check_loss_scaled(self):
        """Refuses to unscale gradients of a loss this optimizer did not scale.

        Under `mixed_float16` Keras's `compile` wraps any optimizer that is
        not a `LossScaleOptimizer` in one: `ShardedOptimizer(
        LossScaleOptimizer(inner))` given to a plain `keras.Model` gets an
        outer scaler that scales the loss and unscales the gradients, and the
        inner one would divide them by its own scale once more.
        """
        if self._loss_scaler is None or getattr(self, "_scaled_loss", False):
            return
        raise ValueError(
            "ShardedOptimizer(LossScaleOptimizer(...)) was asked to apply "
            "gradients of a loss it did not scale: its `scale_loss` was never "
            "called, so its LossScaleOptimizer would unscale gradients that "
            "were not scaled by it. Under mixed_float16 a plain keras.Model's "
            "compile wraps the optimizer in its own LossScaleOptimizer. "
            "Received: inner_optimizer="
            f"{type(self.inner_optimizer).__name__}({type(self._base).__name__})."
            " Pass `ShardedOptimizer(inner)` and let Keras add the loss "
            "scaling, use `keras_dist.DistributedModel`, or scale the loss "
            "with `optimizer.scale_loss(loss)` in your own training step."
        )

    def shard_and_apply(
        self,
        grads,
        trainable_variables,
        hook=None,
        batch_size=None,
        non_finite_gradients="apply",
        log_skips=True,
    ):
        """The sharded update of `trainable_variables` (replica context).

        Args:
            grads: List of this replica's gradients (`None`: zeros).
            trainable_variables: List of the matching variables.
            hook: The model's `AllReduceHook` or `None`: only
                `NoCompression` (or `None`) is accepted.
            batch_size: Int, scalar tensor or `None`. This replica's
                examples: each replica's gradient weighs by its share of the
                global batch (see `aggregation.weight_by_batch_share`).
            non_finite_gradients: String, `"skip"`, `"raise"` or `"apply"`
                (see `DistributedModel.compile`).
            log_skips: Bool. Log a skipped update. Defaults to `True`.
        """
        if not (
            hook is None
            or type(hook) is NoCompression
            or isinstance(hook, (casts.FP16, casts.BF16))
        ):
            raise ValueError(
                "ShardedOptimizer reduce-scatters the gradients itself; of the "
                "all-reduce hooks only the casts (`FP16`, `BF16`) apply to a "
                f"reduce-scatter. Received: all_reduce_hook={hook!r}. Use "
                "`NoCompression()` (the default), `FP16()` or `BF16()`, or "
                "train unsharded to compress with it."
            )
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        # Keras's error for no gradient at all, and its warning naming the
        # variables without one (they are left alone, as Keras does).
        _apply.filter_empty_gradients(grads, trainable_variables)
        shards = self._shards
        grads = shards.in_order(grads, trainable_variables)
        # Static per trace: which variables got a gradient, which sparse.
        active = [g is not None for g in grads]
        if self._by_variables:
            apply_owned(
                self, grads, hook, batch_size, non_finite_gradients, log_skips, active
            )
            return
        if self._accumulation_steps == 1:
            grads = shards.weighted(grads, batch_size)
            local = self._shards.reduce(
                shards.layout.segment_flats(shards.dense(grads), self._slice.dtype),
                hook,
            )
            # Sparse gradients travel as rows, every replica's gathered, as
            # the unsharded path sends them.
            rows = {
                i: collectives.all_reduce(g)
                for i, g in enumerate(grads)
                if isinstance(g, tf.IndexedSlices)
            }
            self._update(local, non_finite_gradients, log_skips, active, rows)
            return
        # Stage 2: the sum of every replica's examples' gradients, reduce-
        # scattered now into the slice accumulator; the cycle divides by the
        # examples on update (as `GradientAccumulationOptimizer` does).
        # Sparse rows are summed densely into it (a warning says what that
        # changes).
        _apply.warn_of_summed_rows(
            self,
            [g for g in grads if g is not None],
            [v for g, v in zip(grads, shards.variables) if g is not None],
            self._accumulation_steps,
        )
        dense = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        examples = tf.cast(1 if batch_size is None else batch_size, tf.float32)
        flats = shards.layout.segment_flats(shards.dense(dense), self._slice.dtype)
        weight = tf.cast(examples * replicas, self._slice.dtype)
        local = self._shards.reduce([flat * weight for flat in flats], hook)
        self._cycle.accumulate(
            [local],
            [self._slice],
            self._applier(non_finite_gradients, log_skips, active),
            batch_size=batch_size,
            weighted=True,
        )

    def apply_pending(self, hook, non_finite_gradients="apply", log_skips=True):
        """Applies the micro-steps accumulated since the last update (stage
        2), if any; `DistributedModel.fit` calls it when an epoch's steps
        end (see `GradientAccumulationOptimizer.apply_pending`). Does
        nothing without accumulation (`accumulation_steps=1`).

        Args:
            hook: The model's hook (the reduce-scatter already happened).
            non_finite_gradients: String, as in `shard_and_apply`.
            log_skips: Bool, as in `shard_and_apply`.
        """
        del hook
        if self._accumulation_steps == 1 or not self.built:
            return
        active = getattr(self, "_stage2_active", None)
        self._cycle.apply_pending(
            self._applier(non_finite_gradients, log_skips, active)
        )

    @property
    def pending_variables(self):
        """Positions of the variables a stage-2 update applies to (those
        that got gradients in the traced step), or `None` before it is
        traced or without accumulation (see
        `GradientAccumulationOptimizer.pending_variables`)."""
        active = getattr(self, "_stage2_active", None)
        return None if active is None else [i for i, a in enumerate(active) if a]

    def restore_pending_variables(self, positions) -> None:
        """Sets `pending_variables` from a backup where no step was traced."""
        if self._accumulation_steps == 1 or not self.built:
            return
        if getattr(self, "_stage2_active", None) is not None:
            return
        wanted = set(positions)
        active = [i in wanted for i in range(len(self._shards.variables))]
        _compat.set_untracked_attribute(self, "_stage2_active", active)
        self._cycle.last_variables = [self._slice]

    def _applier(self, non_finite_gradients, log_skips, active):
        _compat.set_untracked_attribute(self, "_stage2_active", active)

        def apply(mean, _):
            self._update(mean[0], non_finite_gradients, log_skips, active)

        return apply

    def _update(self, local, non_finite, log_skips, active=None, rows=None):
        """Updates this replica's slice with its summed gradient; gathers.

        `active` (one bool per variable, static) marks the variables that
        got a gradient: the others keep their values and optimizer state,
        as Keras skips them. `rows` (layout index -> gathered
        `tf.IndexedSlices`) are the sparse gradients, applied per
        occurrence of a row, as Keras applies them.
        """
        shards = self._shards
        base = self._base
        rows = dict(rows or {})
        active = list(active) if active is not None else [True] * len(shards.variables)
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        scaler = self._loss_scaler

        def scaled(divisor):
            nonlocal local
            local = local / tf.cast(divisor, local.dtype)
            for i, grad in rows.items():
                rows[i] = tf.IndexedSlices(
                    grad.values / tf.cast(divisor, grad.values.dtype),
                    grad.indices,
                    grad.dense_shape,
                )

        # Unscale, then clip, as Keras's `apply` does.
        if scaler is not None:
            scaled(scaler.dynamic_scale)
        if base.loss_scale_factor is not None:
            scaled(base.loss_scale_factor)
        finite = None
        if scaler is not None or non_finite != "apply":
            finite = tf.equal(
                sharding.count_non_finite(
                    local, [grad.values for grad in rows.values()]
                ),
                0,
            )
        local = shards.clipped(local, replica, rows)
        if base.clipvalue:
            for i, grad in rows.items():
                rows[i] = tf.IndexedSlices(
                    tf.clip_by_value(grad.values, -base.clipvalue, base.clipvalue),
                    grad.indices,
                    grad.dense_shape,
                )
        # The slice of the model's current weights: the weights may have
        # been set since the last update (set_weights, a restore).
        self._slice.assign(
            shards.layout.local_of(shards.variables, replica, self._slice.dtype)
        )

        # This replica's values reach `update` as its arguments (a
        # cross-replica `cond` passes each replica its own): the slice, then
        # each sparse variable's values and indices.
        keys = sorted(rows)
        parts = [local]
        for i in keys:
            parts += [rows[i].values, rows[i].indices]

        def update(parts):
            # Run per replica, maybe from a cross-replica `cond`.
            local = parts[0]
            rows = {
                i: tf.IndexedSlices(parts[1 + 2 * k], parts[2 + 2 * k])
                for k, i in enumerate(keys)
            }
            here = tf.distribute.get_replica_context().replica_id_in_sync_group
            mask = shards.local_decay_mask(here, active)
            if mask is not None:
                learning_rate = tf.cast(base.learning_rate, local.dtype)
                decay = tf.cast(base.weight_decay, local.dtype)
                self._slice.assign_sub(self._slice * decay * learning_rate * mask)
            inactive = shards.local_inactive(active, here)
            kept = []
            if inactive is not None:
                kept = [
                    (variable, variable.value.read_value())
                    for variable in [self._slice, *self._slots()]
                ]
            gradient = local
            if rows or inactive is not None:
                gradient = shards.local_sparse_update(local, rows, active, here)
            _compat.backend_update_step(
                base, [gradient], [self._slice], base.learning_rate
            )
            for variable, before in kept:
                variable.assign(tf.where(inactive, before, variable.value))
            base.iterations.assign_add(1)

        apply_as_decided(scaler, finite, update, parts, non_finite, base, log_skips)
        # Every replica's slice into every replica's weights.
        shards.assign(sharding.gather_slices(shards.layout, self._slice.value))

    def _slots(self):
        """The inner optimizer's slice-sized state (its slots)."""
        size = (self._shards.layout.slice_size,)
        return [
            v
            for v in self._base.variables
            if tuple(v.shape) == size and v is not self._base.iterations
        ]

    # --- Saving: whole state, resharded on load -----------------------------

    def save_own_variables(self, store):
        """Saves this wrapper's variables, the slices gathered whole.

        Keras's saving visits the inner optimizer on its own; its variables
        go through the same gathering (see `build`).
        """
        save_whole(self, _compat.optimizer_own_variables(self), store)

    def load_own_variables(self, store):
        """Loads what `save_own_variables` wrote, resharded for this strategy."""
        load_whole(self, _compat.optimizer_own_variables(self), store)

    # --- Serialization ----------------------------------------------------------

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(
                self.inner_optimizer
            ),
            "accumulation_steps": self._accumulation_steps,
            "bucket_bytes": self._bucket_bytes,
            "shard_by": self._shard_by,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)
