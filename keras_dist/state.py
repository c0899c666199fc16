"""A Keras 3 model's training state: its inventory and its `fit` session.

Two things the backup, `AutoScaleBatch` and the trainer share without
importing each other:

- `training_state(model)`: the model's `StateInventory`
  (`keras_dist.core.inventory`): its variables, the optimizer's (slots,
  `iterations`, a `GradientAccumulationOptimizer`'s accumulators and
  counters), the all-reduce hooks' state, gradient statistics, the metrics'
  running sums, and the callbacks registered with `register_backup_state`.
  A `DistributedModel` returns the same from `model.training_state()`; for
  a plain `keras.Model` this function is the adapter.
- `session(model)`: what the running `fit` of the model shares with its
  callbacks: the input iterator `DistributedModel.fit` created, and the
  batches a resumed epoch replays.

Both live here, keyed by the model (weakly), rather than as attributes
stashed on Keras objects.
"""

from __future__ import annotations

import dataclasses
import weakref

import keras

from keras_dist.core import inventory as inventory_lib
from keras_dist.core.optimizer_view import nested_optimizers
from keras_dist.core.statistics import gradient_statistics
from keras_dist.optimizers import find_accumulator


@dataclasses.dataclass
class FitSession:
    """What the running `fit` of one model shares with its callbacks.

    Attributes:
        epoch_iterator: Keras's `EpochIterator` of the running `fit`, when a
            `DistributedModel` created it; `None` for a plain `keras.Model`.
        replay_epoch: Int or `None`. The epoch whose first `replay_batches`
            batches were trained by the run a backup came from.
        replay_batches: Int. See `replay_epoch`.
        providers: Dict of name -> weak reference to an object whose plain
            Python state a backup carries (`register_backup_state`).
    """

    epoch_iterator: object = None
    replay_epoch: int | None = None
    replay_batches: int = 0
    providers: dict = dataclasses.field(default_factory=dict)

    def is_replayed(self, batch: int) -> bool:
        """Whether `batch` was already trained by the run a backup came from."""
        return self.replay_epoch is not None and batch < self.replay_batches


_SESSIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def session(model) -> FitSession:
    """The `FitSession` of `model` (made on first use)."""
    found = _SESSIONS.get(model)
    if found is None:
        found = _SESSIONS[model] = FitSession()
    return found


def register_backup_state(model, name: str, provider) -> None:
    """Makes `BackupAndRestore` save `provider.backup_state()` under `name`.

    For a callback with plain Python state that must survive a restart
    (`AutoScaleBatch` calls it in `on_train_begin`). On resume, the state is
    given back with `provider.restore_backup_state(state)`. The provider is
    held weakly.

    Args:
        model: The model being trained.
        name: String. The key of the state in the backup.
        provider: Object with `backup_state() -> dict` (JSON-serializable)
            and `restore_backup_state(state: dict)`.
    """
    session(model).providers[name] = weakref.ref(provider)


def training_state(model) -> inventory_lib.StateInventory:
    """Returns the `StateInventory` of `model`'s training, in a fixed order.

    The order is the order the model, its optimizer and its hooks create
    their variables in: the same for the same model built the same way.
    """
    hooks = [getattr(model, "all_reduce_hook", None)]
    optimizer = getattr(model, "optimizer", None)
    accumulator = None if optimizer is None else find_accumulator(optimizer)
    if accumulator is not None:
        hooks.append(accumulator.all_reduce_hook)
    state = inventory_lib.StateInventory()
    # Under local SGD the weights and slots are each replica's own between
    # syncs (`LocalSGDOptimizer.local_rules`).
    local = {}
    for nested in nested_optimizers(optimizer):
        local.update(getattr(nested, "local_rules", {}))
    _add(state, "model", model.variables, local=local)
    if optimizer is not None:
        # A sharded optimizer's slices are pieces of one vector.
        shards = {}
        for nested in nested_optimizers(optimizer):
            shards.update(getattr(nested, "shard_rules", {}))
        _add(state, "optimizer", optimizer.variables, shards, local=local)
        # Sharded by whole variables: each variable's state on its owner.
        for nested in nested_optimizers(optimizer):
            for name, handle in getattr(nested, "owned_state", ()):
                state.add("optimizer", handle, name, placement=inventory_lib.OWNED)
        for hook in hooks:
            if hook is not None and hook.built:
                for name, variable in zip(hook.state_names, hook.state_variables):
                    state.add("hook", variable, name)
        statistics = gradient_statistics(optimizer)
        if statistics is not None:
            _add(state, "statistics", statistics.variables)
    _add(state, "metrics", model.metrics_variables)
    for name, provider in session(model).providers.items():
        provider = provider()
        if provider is not None:
            state.add_provider(name, provider)
    return state


def _add(state, group, variables, shards=None, local=None) -> None:
    for variable in variables:
        tf_variable = (
            variable.value if isinstance(variable, keras.Variable) else variable
        )
        segments = (shards or {}).get(id(tf_variable))
        rule = (local or {}).get(id(tf_variable))
        state.add(
            group,
            tf_variable,
            _name_of(variable, tf_variable),
            rule=rule if segments is None else "shard",
            length=None if segments is None else sum(segments),
            segments=segments,
            placement=None if rule is None else inventory_lib.PER_REPLICA,
        )


def _name_of(variable, tf_variable) -> str:
    path = getattr(variable, "path", None)
    if isinstance(path, str) and path:
        return path
    return getattr(tf_variable, "name", "variable").split(":")[0]
