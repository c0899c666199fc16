"""`ShardedOptimizer(..., shard_by="variables")`: each replica owns whole
variables and keeps their optimizer state, on its device only.

The optimizer state of a variable lives in a copy of the inner optimizer
built on a stand-in for that variable alone (its shape, dtype and path),
created outside the strategy (`tf_internal.outside_strategy`) on the owning
replica's device: a strategy's variables have the same shape on every
replica, these do not exist on the others. The owner's step copies the
variable's current value into the stand-in, runs the optimizer's own update
rule on it (`update_step`, with its weight decay and the clipping of
`inner_optimizer`), and the updated stand-ins travel to every replica in
one all-gather (`sharding.OwnerLayout`).
"""

from __future__ import annotations

import contextlib
import logging

import keras
import numpy as np
import tensorflow as tf

from keras_dist._compat import keras_src as _compat
from keras_dist._compat import tf_internal
from keras_dist._shards import apply_as_decided
from keras_dist.core import collectives, sharding, topology

logger = logging.getLogger(__name__)


class Owned:
    """One built `ShardedOptimizer`'s owned variables and their optimizers.

    Args:
        layout: The `sharding.OwnerLayout` of `variables`.
        variables: List of the model's trainable `keras.Variable`s, in order.
        base: The inner optimizer (inside any loss scaling): each owned
            variable gets a copy of it (`from_config(get_config())`).
        strategy: The strategy the model trains under.
    """

    def __init__(self, layout, variables, base, strategy):
        self.layout = layout
        self.variables = list(variables)
        self.base = base
        self.strategy = strategy
        self.decayed = [_compat.uses_weight_decay(base, v) for v in self.variables]
        self.proxies = {}
        self.optimizers = {}
        self._remote_specs = {}
        first, count = topology.worker_layout(strategy)
        devices = _devices(strategy, count)
        for offset, device in enumerate(devices):
            for index in layout.owned[first + offset]:
                proxy, optimizer = _owner_copy(base, self.variables[index], device)
                self.proxies[index] = proxy
                self.optimizers[index] = optimizer

    def track(self, owner) -> None:
        """Makes each optimizer copy here a checkpoint dependency of `owner`
        (named by its variable's index): `tf.train.Checkpoint` saves and
        restores them, on any replica count in one process. A worker holds
        its own replicas' copies only: its checkpoint lacks the others'."""
        for index, optimizer in self.optimizers.items():
            _compat.track_checkpoint_dependency(
                owner, f"owned_state_{index}", optimizer
            )
        workers = topology.count_workers(self.strategy)
        if workers > 1:
            logger.warning(
                "keras_dist: ShardedOptimizer(shard_by='variables') on %d "
                "workers: a tf.train.Checkpoint written by one worker holds "
                "the optimizer state of that worker's variables only. Save "
                "with model.save(...) (a .keras file holds every worker's).",
                workers,
            )

    # --- The step (replica context) ----------------------------------------

    def replica(self) -> int:
        """This replica's id, which every strategy's step knows when tracing."""
        context = tf.distribute.get_replica_context()
        replica = tf.get_static_value(context.replica_id_in_sync_group)
        if replica is None:
            raise ValueError(
                "ShardedOptimizer(shard_by='variables') needs the replica id "
                "while tracing, which MirroredStrategy and "
                "MultiWorkerMirroredStrategy give; this strategy "
                f"({type(context.strategy).__name__}) does not. Use "
                "shard_by='elements'."
            )
        return int(replica)

    def load(self, replica: int) -> None:
        """Copies the model's current weights into this replica's stand-ins:
        they may have been set since the last update (set_weights, a
        restore)."""
        for index in self.layout.owned[replica]:
            self.proxies[index].assign(self.variables[index].value)

    def update(self, block, replica: int, active, global_norm=None, rows=None):
        """Runs the owned variables' updates on their summed gradients.

        Args:
            block: This replica's block of the summed, unscaled gradient.
            replica: This replica's id.
            active: List of bools, one per variable: those that got a
                gradient (the others keep their values and state, as Keras
                leaves them).
            global_norm: Scalar or `None`: the norm of the whole gradient,
                for `global_clipnorm`.
            rows: Dict or `None`: variable index -> its gathered
                `tf.IndexedSlices` (a sparse gradient; its block part is 0).
        """
        rows = rows or {}
        base = self.base
        learning_rate = base.learning_rate
        iterations = base.iterations
        owned = self.layout.owned[replica]
        for index, gradient in zip(owned, self.layout.unpack(replica, block)):
            if not active[index]:
                continue
            optimizer = self.optimizers[index]
            proxy = self.proxies[index]
            # The copy counts the steps of the inner optimizer (bias
            # corrections, schedules) and uses its current learning rate.
            optimizer.iterations.assign(iterations)
            current = optimizer.learning_rate
            if isinstance(current, keras.Variable):
                current.assign(learning_rate)
            gradient = _clipped(base, rows.get(index, gradient), global_norm)
            _compat.update_whole(
                optimizer,
                [gradient],
                [proxy],
                [proxy] if self.decayed[index] else [],
                learning_rate,
            )
        iterations.assign_add(1)

    def block(self, replica: int):
        """This replica's stand-ins (updated or not) as its block."""
        owned = self.layout.owned[replica]
        return self.layout.pack(
            replica,
            [self.proxies[i].value for i in owned],
            self.variables[0].dtype if not owned else None,
        )

    # --- Saving: every variable's state, whatever the replica count --------

    def slots(self, index: int) -> list:
        """The optimizer state of variable `index` on its owner (here)."""
        return _state_of(self.optimizers[index])

    def save(self, store, start: int) -> None:
        """Writes every variable's optimizer state into `store` from key
        `start` on, in the variables' order (each variable's state in its
        optimizer's order), the same on any replica count."""
        key = start
        for index in range(len(self.variables)):
            for value in self._state_values(index):
                store[str(key)] = value
                key += 1

    def load_saved(self, store, start: int) -> None:
        """Loads what `save` wrote into the owners here (any replica count)."""
        key = start
        expected = start + sum(
            len(self._state_specs(i)) for i in range(len(self.variables))
        )
        if len(store.keys()) != expected:
            raise ValueError(
                f"The saved optimizer has {len(store.keys())} variables; this "
                f"one has {expected}. Load it into the same optimizer and model."
            )
        for index in range(len(self.variables)):
            count = len(self._state_specs(index))
            if index in self.optimizers:
                for slot, offset in zip(self.slots(index), range(count)):
                    slot.assign(np.asarray(store[str(key + offset)]))
            key += count

    # --- The training state's inventory ------------------------------------

    def state_handles(self) -> list:
        """`(name, OwnedSlot)` for every variable's optimizer state, in the
        variables' order (each variable's state in its optimizer's order):
        the same list on every worker and on any replica count."""
        handles = []
        for index, variable in enumerate(self.variables):
            path = getattr(variable, "path", variable.name)
            for position, (shape, dtype) in enumerate(self._state_specs(index)):
                slot = OwnedSlot(self, index, position, shape, dtype)
                handles.append((f"owned/{path}/{position}", slot))
        return handles

    def _state_specs(self, index: int) -> list:
        if index in self.optimizers:
            return [(tuple(v.shape), v.dtype) for v in self.slots(index)]
        # Owned on another worker: the same optimizer built on a stand-in of
        # the same shape has the same state (built on the CPU once, dropped).
        specs = self._remote_specs.get(index)
        if specs is None:
            _, optimizer = _owner_copy(self.base, self.variables[index], "/cpu:0")
            specs = [(tuple(v.shape), v.dtype) for v in _state_of(optimizer)]
            self._remote_specs[index] = specs
        return specs

    def _state_values(self, index: int) -> list:
        strategy = self.strategy
        local = topology.local_replicas(strategy)
        if strategy.num_replicas_in_sync == local:
            return [np.asarray(v.numpy()) for v in self.slots(index)]
        # Several workers: the owner's value reaches every worker as a sum
        # in which the other replicas add zeros (every worker makes the
        # same calls, in the same order).
        owner = self.layout.owners[index]
        values = []
        slots = self.slots(index) if index in self.optimizers else None
        for position, (shape, dtype) in enumerate(self._state_specs(index)):

            def value(context, position=position, shape=shape, dtype=dtype):
                if context.replica_id_in_sync_group == owner and slots is not None:
                    return tf.identity(slots[position].value)
                return tf.zeros(shape, dtype)

            per_replica = strategy.experimental_distribute_values_from_function(value)
            summed = collectives.reduce_across(strategy, per_replica, "sum")
            values.append(np.asarray(summed))
        return values


class OwnedSlot:
    """One optimizer variable of one owned variable, as the inventory
    holds it (`keras_dist.core.inventory.OWNED`).

    The owner replica keeps it; this process has it when one of its
    replicas is the owner (`local`). The owner on another replica count is
    whoever the layout of that count names: a value saved whole is assigned
    where it lives now.
    """

    def __init__(self, owned: Owned, index: int, position: int, shape, dtype):
        self._owned = owned
        self.index = index
        self.position = position
        self.shape = tf.TensorShape(shape)
        self.dtype = tf.as_dtype(dtype)

    @property
    def owner(self) -> int:
        """The id of the replica that holds it."""
        return int(self._owned.layout.owners[self.index])

    @property
    def local(self) -> bool:
        """Whether a replica of this process holds it."""
        return self.index in self._owned.optimizers

    def read(self):
        """Its value now, a tensor (only where `local`)."""
        return tf.identity(self._owned.slots(self.index)[self.position].value)

    def assign(self, value) -> None:
        """Sets its value where this process holds it; elsewhere nothing."""
        if self.local:
            self._owned.slots(self.index)[self.position].assign(np.asarray(value))


def _state_of(optimizer) -> list:
    """An optimizer's variables but its step count and learning rate (the
    inner optimizer's are used)."""
    skip = {id(optimizer.iterations)}
    current = optimizer.learning_rate
    if isinstance(current, keras.Variable):
        skip.add(id(current))
    return [v for v in optimizer.variables if id(v) not in skip]


def _devices(strategy, count: int) -> list:
    try:
        return list(strategy.extended.worker_devices)
    except RuntimeError:
        return [None] * count


def _owner_copy(base, variable, device):
    """A stand-in for `variable` and a copy of `base` built on it, on
    `device`, outside the strategy."""
    path = getattr(variable, "path", variable.name)
    parent, _, _ = path.rpartition("/")
    grand, _, last = parent.rpartition("/")
    with tf_internal.outside_strategy(device):
        # The stand-in's path is the variable's: Muon's exclusions and
        # `exclude_from_weight_decay` names match it as they match the model's.
        scope = (
            keras.name_scope(last, override_parent=grand)
            if parent
            else contextlib.nullcontext()
        )
        with scope:
            proxy = keras.Variable(
                keras.initializers.Zeros(),
                shape=variable.shape,
                dtype=variable.dtype,
                trainable=True,
                name=variable.name,
            )
        optimizer = type(base).from_config(base.get_config())
        optimizer.build([proxy])
    return proxy, optimizer


def _clipped(base, gradient, global_norm):
    """Keras's clipping of one whole variable's gradient (the formulas of
    keras/src/optimizers/base_optimizer.py), the global norm given."""
    if base.clipnorm and base.clipnorm > 0:
        squares = tf.reduce_sum(tf.square(gradient))
        positive = squares > 0
        norm = tf.where(
            positive, tf.sqrt(tf.where(positive, squares, tf.ones_like(squares))), 0.0
        )
        return gradient * base.clipnorm / tf.maximum(norm, base.clipnorm)
    if base.global_clipnorm and base.global_clipnorm > 0:
        clip = tf.cast(base.global_clipnorm, gradient.dtype)
        norm = tf.cast(global_norm, gradient.dtype)
        return gradient * (clip * tf.minimum(1.0 / norm, 1.0 / clip))
    if base.clipvalue and base.clipvalue > 0:
        if isinstance(gradient, tf.IndexedSlices):
            values = tf.clip_by_value(gradient.values, -base.clipvalue, base.clipvalue)
            return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
        return tf.clip_by_value(gradient, -base.clipvalue, base.clipvalue)
    return gradient


def apply_owned(sharded, grads, hook, batch_size, non_finite, log_skips, active):
    """Sharded by whole variables: each replica's block of the summed
    gradients (one reduce-scatter), its owners' updates, one all-gather.

    Sparse gradients (an `Embedding`'s rows) travel as rows, every
    replica's gathered, as unsharded: the owner's optimizer reads them per
    occurrence of a row, as Keras's does.
    """
    owned = sharded._owned
    base = sharded._base
    scaler = sharded._loss_scaler
    grads = sharded._shards.weighted(grads, batch_size)
    dtype = tf.as_dtype(owned.variables[0].dtype)
    block = sharded._shards.reduce(
        owned.layout.segment_flats(sharded._shards.dense(grads), dtype), hook
    )
    rows = {
        i: collectives.all_reduce(g)
        for i, g in enumerate(grads)
        if isinstance(g, tf.IndexedSlices)
    }
    sharded._shards.refuse_norm_clipping(rows)
    keys = sorted(rows)
    values = [rows[i].values for i in keys]
    # Unscale, then clip (in the owners' update), as Keras's `apply` does.
    for divisor in (
        None if scaler is None else scaler.dynamic_scale,
        base.loss_scale_factor,
    ):
        if divisor is not None:
            block = block / tf.cast(divisor, dtype)
            values = [v / tf.cast(divisor, v.dtype) for v in values]
    finite = None
    if scaler is not None or non_finite != "apply":
        finite = tf.equal(sharding.count_non_finite(block, values), 0)
    norm = sharding.global_norm(block) if base.global_clipnorm else tf.zeros(())
    replica = owned.replica()
    owned.load(replica)
    parts = [block, norm]
    for i, value in zip(keys, values):
        parts += [value, rows[i].indices]

    def update(parts):
        # Run per replica, maybe from a cross-replica `cond`: the replica
        # and its values come from there.
        sparse = {
            i: tf.IndexedSlices(parts[2 + 2 * k], parts[3 + 2 * k], rows[i].dense_shape)
            for k, i in enumerate(keys)
        }
        owned.update(parts[0], owned.replica(), active, parts[1], sparse)

    apply_as_decided(scaler, finite, update, parts, non_finite, base, log_skips)
    sharded._shards.assign(sharding.gather_blocks(owned.layout, owned.block(replica)))
