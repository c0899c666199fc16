"""Every touch of private Keras 3 API (and TensorFlow's, for the Keras front end).

keras_dist fixes places where stock Keras 3 is broken under `tf.distribute`,
and some of those fixes need private hooks. They all live here (the core's
TensorFlow touches in `tf_internal.py`), each with the reason, so an upgrade
has one package to check. `tests/test_compat.py` fails loudly when any of
them moves.

Tested with TensorFlow 2.21 and Keras 3.15 (declared minimums: TensorFlow
2.16, Keras 3.5, untested).
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import keras
import tensorflow as tf

from keras_dist._backend import check_backend
from keras_dist._compat import tf_internal as _tf_internal

# The versions every touch below was verified against, and the policy for
# others, live in `_versions.py` (checked at `import keras_dist`).
from keras_dist._versions import TESTED_KERAS as TESTED_KERAS
from keras_dist._versions import TESTED_TENSORFLOW as TESTED_TENSORFLOW
from keras_dist.core.optimizer_view import nested_optimizers

check_backend()


# --- Optimizer: the private all-reduce that keras_dist replaces -------------
#
# Keras 3 sums gradients across replicas inside
# `TFOptimizer._backend_update_step` through the private
# `_all_reduce_sum_gradients` (keras/src/backend/tensorflow/optimizer.py), and
# clips before it (keras#19308 asks for a public hook). keras_dist reduces the
# gradients itself, through its all-reduce hook, and then calls the
# optimizer's public `apply`; the optimizer's own all-reduce must then be a
# pass-through or the gradients would be summed twice.

_OPTIMIZER_ALL_REDUCE = "_all_reduce_sum_gradients"
_patch_lock = threading.Lock()
_patch_depth: dict[int, int] = {}


def _passthrough_all_reduce(grads_and_vars):
    return list(grads_and_vars)


@contextlib.contextmanager
def optimizer_all_reduce_disabled(optimizer):
    """Makes `optimizer.apply` skip Keras's own cross-replica gradient sum.

    `MirroredStrategy` runs replicas in threads that interleave at every
    `merge_call`, so the override is installed by the first thread to enter
    and removed by the last one to leave.
    """
    targets = list(nested_optimizers(optimizer))
    with _patch_lock:
        for target in targets:
            if not hasattr(type(target), _OPTIMIZER_ALL_REDUCE):
                raise RuntimeError(
                    f"{type(target).__name__} has no `{_OPTIMIZER_ALL_REDUCE}`; "
                    "this Keras version moved the optimizer's all-reduce. "
                    f"keras_dist is tested with Keras {TESTED_KERAS[0]}-"
                    f"{TESTED_KERAS[1]}."
                )
            depth = _patch_depth.get(id(target), 0)
            if depth == 0:
                setattr(target, _OPTIMIZER_ALL_REDUCE, _passthrough_all_reduce)
            _patch_depth[id(target)] = depth + 1
    try:
        yield
    finally:
        with _patch_lock:
            for target in targets:
                depth = _patch_depth[id(target)] - 1
                if depth == 0:
                    del _patch_depth[id(target)]
                    delattr(target, _OPTIMIZER_ALL_REDUCE)
                else:
                    _patch_depth[id(target)] = depth


def update_rule_overridden(cls, base) -> list:
    """The update methods subclass `cls` of optimizer class `base` replaces
    (`update_step`, `_backend_update_step`): names, empty when none."""
    return [
        name
        for name in ("update_step", "_backend_update_step")
        if getattr(cls, name) is not getattr(base, name)
    ]


def backend_update_step(optimizer, gradients, variables, learning_rate) -> None:
    """Runs `optimizer`'s own update of `variables` and nothing else.

    `Optimizer._backend_update_step` is what `apply` calls after clipping
    and weight decay: the update rule of the optimizer class (with its own
    per-step state, such as Nadam's `u_product`), without the iteration
    count or EMA. keras_dist's sharded optimizer runs it on each replica's
    slice, with Keras's cross-replica sum switched off.
    """
    with optimizer_all_reduce_disabled(optimizer):
        optimizer._backend_update_step(gradients, variables, learning_rate)


def update_whole(optimizer, gradients, variables, decayed, learning_rate) -> None:
    """`optimizer`'s `apply` from weight decay on, on its own plain variables:
    its `_apply_weight_decay(decayed)` (a class's own: Muon decays the
    variables it updates like Adam by another factor), then its
    `update_step` of each variable. No iteration count, no all-reduce."""
    decay = type(optimizer)._apply_weight_decay
    if decay is _TFOptimizer._apply_weight_decay:
        # TensorFlow's version updates through the optimizer's strategy: the
        # backend-free rule, with the same arithmetic, updates in place.
        decay = _BaseOptimizer._apply_weight_decay
    decay(optimizer, decayed)
    for gradient, variable in zip(gradients, variables):
        optimizer.update_step(gradient, variable, learning_rate)


def uses_weight_decay(optimizer, variable) -> bool:
    """Whether `optimizer` decays `variable` (its exclusions applied)."""
    return optimizer.weight_decay is not None and optimizer._use_weight_decay(variable)


# --- Trainer internals that a train_step needs ------------------------------


def compute_loss(model, x, y, y_pred, sample_weight, training=True):
    """`Trainer._compute_loss`: `compute_loss` plus the `training` plumbing."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def call_has_training_arg(model) -> bool:
    """Whether `model.call` accepts `training` (Keras records it privately)."""
    return model._call_has_training_arg


def update_loss_tracker(model, loss, batch_size) -> None:
    """Feeds the `loss` entry of the logs the way stock `train_step` does.

    The loss a train step sees is scaled by `1 / num_replicas_in_sync` for
    the gradient sum; the tracker records the unscaled value.
    """
    from keras.src.losses import loss as loss_module

    model._loss_tracker.update_state(
        loss_module.unscale_loss_for_distribution(loss), sample_weight=batch_size
    )


def model_strategy(model):
    """The strategy the model was created under, or `None` (no scope)."""
    return model._distribute_strategy


def symbolic_build(model, data_batch) -> None:
    """`Trainer._symbolic_build`: builds layers, metrics and loss from a batch."""
    model._symbolic_build(data_batch=data_batch)


# --- Model classes ------------------------------------------------------------

# Keras's functional model class; `DistributedModel(inputs, outputs)` returns a
# subclass of it, as `keras.Model(inputs, outputs)` returns a `Functional`.
# KerasSaveable is the base of everything Keras's saving walks (layers,
# optimizers, metrics): `DistributedModel.all_reduce_hook_state` returns one,
# so the hook's state has its own path in `.keras` / `.weights.h5` files and
# plain Keras models load the same files.
from keras.src.backend.tensorflow.optimizer import TFOptimizer as _TFOptimizer  # noqa: E402
from keras.src.models.functional import Functional as Functional  # noqa: E402
from keras.src.optimizers.base_optimizer import BaseOptimizer as _BaseOptimizer  # noqa: E402
from keras.src.saving.keras_saveable import KerasSaveable  # noqa: E402


class StateSaveable(KerasSaveable):
    """Base of an object that Keras's saving visits for its own variables.

    Keras saves `save_own_variables` of every `KerasSaveable` it finds among
    a model's attributes, under the attribute's name. `_obj_type` must be
    one of the types Keras computes an attribute skip list for; "Loss" is
    the smallest (a subclass must keep no `KerasSaveable` attributes of its
    own, which Keras would then walk too).
    """

    def _obj_type(self):
        return "Loss"


def sublayers(model) -> list:
    """Every layer of `model`, nested ones too (`Layer._flatten_layers`)."""
    return list(model._flatten_layers(include_self=False))


def _needs_symbolic_build(model) -> bool:
    """The conditions under which `Trainer._symbolic_build` does any work."""
    return (
        not all(layer.built for layer in model._flatten_layers())
        or (model._compile_metrics is not None and not model._compile_metrics.built)
        or (model._compile_loss is not None and not model._compile_loss.built)
        or (model.optimizer is not None and not model.optimizer.built)
    )


class MultiWorkerBuildFix:
    """Mixin that fixes `Trainer._maybe_symbolic_build` for multi-worker.

    Stock Keras reduces the first batch with `strategy.reduce("MEAN", batch)`
    to learn its shapes, which raises "Attempt to convert a value
    (PerReplica...)" under MultiWorkerMirroredStrategy. The batch is only used
    for its shapes, so the first local replica's shard is enough.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = model_strategy(self)
        if strategy is None:
            return
        if iterator is not None and getattr(iterator, "_num_batches", None) == 0:
            # Stock Keras warns that the input "ran out of data" and returns
            # an empty history (fit) or `[]` (evaluate).
            raise ValueError(
                "The data given to `fit`/`evaluate` is empty: it yielded no "
                "batch. Received: an input with 0 examples. Check the "
                "dataset (a filter or a split that left nothing, "
                "`drop_remainder=True` on fewer examples than one batch)."
            )
        if not _needs_symbolic_build(self):
            # Everything is built (a second `fit`, or `evaluate` after `fit`):
            # skip creating a distributed iterator only to read one batch's
            # shapes, which costs ~0.5 s per call under MirroredStrategy.
            return
        if iterator is not None and data_batch is None:
            data_batch = epoch_batch_spec(iterator)
        if iterator is not None and data_batch is None:
            for _, _, it in iterator:
                try:
                    batch = next(it)
                except StopIteration:
                    # Stock Keras lets a bare StopIteration escape here.
                    raise ValueError(
                        "The data given to `fit`/`evaluate` is empty: it "
                        "yielded no batch. Received: an input with 0 "
                        "examples. Check the dataset (a filter or a split "
                        "that left nothing, `drop_remainder=True` on fewer "
                        "examples than one batch)."
                    ) from None
                data_batch = _first_replica_batch(strategy, batch)
                break
        with strategy.scope():
            symbolic_build(self, data_batch)


def epoch_batch_spec(epoch_iterator):
    """The first replica's batch as `tf.TypeSpec`s, read without iterating.

    Building needs a batch's shapes and dtypes only. Reading one batch and
    resetting, as stock Keras does, makes a second iterator of the data: a
    dataset that reshuffles each iteration (`shuffle(..., seed=s)`, the
    default `reshuffle_each_iteration=True`; arrays with `shuffle=True`)
    then trains on its second order where one device trains on its first.
    Keras's TensorFlow epoch iterator keeps its (distributed) dataset in
    `_distributed_dataset` (keras/src/backend/tensorflow/trainer.py).
    `None` when there is none to read.
    """
    dataset = getattr(epoch_iterator, "_distributed_dataset", None)
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return None

    def first(component):
        values = getattr(component, "_value_specs", None)
        return values[0] if values else component

    return tf.nest.map_structure(first, spec)


class EpochStepsEnd:
    """Mixin: calls `self._after_steps()` when a loop over steps ends.

    Keras's TensorFlow `fit` calls `_get_metrics_result_or_logs` right after
    an epoch's last train step, before validation and `on_epoch_end`
    (keras/src/backend/tensorflow/trainer.py); `evaluate` calls it after its
    last test step. The model tells the two apart.
    """

    def _get_metrics_result_or_logs(self, logs):
        self._after_steps()
        return super()._get_metrics_result_or_logs(logs)


def _first_replica_batch(strategy, batch):
    """The first local replica's shard of a distributed batch (for shapes)."""
    return keras.tree.map_structure(
        lambda value: (
            strategy.experimental_local_results(value)[0]
            if isinstance(value, tf.distribute.DistributedValues)
            else value
        ),
        batch,
    )


# --- Optimizer state ------------------------------------------------------------


def add_replica_local_variable(optimizer, reference, name):
    """Adds a zero variable shaped like `reference`, one copy per replica.

    `synchronization="on_read"` keeps a separate copy on every replica that a
    replica reads and writes without communication; `aggregation="sum"` makes
    a read in cross-replica context (saving a checkpoint) return the sum over
    replicas, and a restore give every replica an equal share of it. Tracked
    with the optimizer's private `_track_variable`, as its own
    `add_variable` does, so it is saved with the optimizer.
    """
    with keras.name_scope(optimizer.name, caller=optimizer):
        variable = keras.Variable(
            initializer="zeros",
            shape=reference.shape,
            dtype=reference.dtype,
            trainable=False,
            aggregation="sum",
            synchronization="on_read",
            name=name,
        )
    optimizer._track_variable(variable)
    return variable


def track_checkpoint_dependency(owner, name, trackable) -> None:
    """Makes `trackable` a named checkpoint dependency of `owner`.

    The all-reduce hook is kept out of Keras's layer tracking on purpose (it
    must not appear in `model.layers` or `model.weights`), so it is added to
    the TensorFlow checkpoint graph directly, with the private
    `Trackable._track_trackable`.
    """
    owner._track_trackable(trackable, name=name, overwrite=True)


def optimizer_own_variables(optimizer) -> list:
    """The variables an optimizer created itself (not its inner optimizer's).

    `Optimizer.variables` of a wrapper must list its own variables and its
    inner optimizer's; Keras keeps the former in the private `_variables`
    (as `LossScaleOptimizer` does when it adds its inner optimizer's).
    """
    return list(optimizer._variables)


def optimizer_trainable_variables(optimizer) -> list:
    """The variables `optimizer` was built for (`Optimizer.build`'s list)."""
    return list(optimizer._trainable_variables)


def optimizer_strategy(optimizer):
    """The strategy a Keras TF optimizer captured when it was created."""
    return optimizer._distribution_strategy


# --- Attributes kept out of Keras's and TensorFlow's tracking ---------------


def set_untracked_attribute(owner, name, value) -> None:
    """Sets `owner.name = value` past Keras's and `tf.Module`'s tracking.

    Keras layers and optimizers (and `tf.Module`s) wrap and track whatever
    is assigned to them (a hook would become a sub-layer, with its state in
    `model.weights`; a list would become a tracked list saved in
    checkpoints). keras_dist keeps a few attributes out of that on purpose;
    `object.__setattr__` skips the trackers' `__setattr__`.
    """
    object.__setattr__(owner, name, value)


def find_attribute_of_type(obj, cls):
    """Returns the first attribute value of `obj` that is a `cls`, or `None`.

    Keras has no public accessor for an optimizer's learning-rate schedule
    object (its `learning_rate` returns the current value), so keras_dist
    looks for its `ScaledLearningRate` among the optimizer's attributes.
    """
    for value in vars(obj).values():
        if isinstance(value, cls):
            return value
    return None


# --- `Model.fit`'s signature ------------------------------------------------


def bind_fit_arguments(model, args, kwargs) -> dict:
    """Returns `fit`'s arguments by name, as `keras.Model.fit` binds them.

    `DistributedModel.fit` takes `*args, **kwargs` and forwards them; to
    rebatch the data it needs them by name, with Keras's positional order
    (x, y, batch_size, epochs, ...), which this binds to.
    """
    arguments = inspect.signature(keras.Model.fit).bind(model, *args, **kwargs)
    values = dict(arguments.arguments)
    values.pop("self", None)
    return values


# --- `fit`'s epoch iterator, for an exact mid-epoch resume -------------------
#
# `BackupAndRestore` resumes inside an epoch: it must know how many batches
# the input iterator of Keras's `fit` had handed out (`EpochIterator`'s
# `_steps_seen`), whether the next epoch gets a fresh iterator, and it must
# set that count back after a restart so Keras re-creates its iterator at
# the same batch as before. The epoch iterator is a local of
# `keras/src/backend/tensorflow/trainer.py`'s `fit`, which hands it to the
# model's `_maybe_symbolic_build(iterator=...)` first: `DistributedModel`
# records it there (`keras_dist/trainer/fit.py`). Keras has no public access
# to it (stock `BackupAndRestore` resumes at the epoch only, and sets the
# private `_initial_epoch` for it).


def epoch_iterator_position(epoch_iterator) -> int:
    """Batches handed out by the iterator `fit` is reading from now."""
    return int(epoch_iterator._steps_seen)


def set_epoch_iterator_position(epoch_iterator, position: int) -> None:
    epoch_iterator._steps_seen = int(position)


def next_epoch_starts_fresh(epoch_iterator) -> bool:
    """Whether the next epoch of `fit` reads from a new input iterator.

    Keras re-creates it every epoch without `steps_per_epoch`, and when the
    data ran out; otherwise the next epoch goes on where this one stopped.
    """
    return (
        epoch_iterator.steps_per_epoch is None
        or epoch_iterator._current_iterator is None
    )


def epoch_iterator_input(epoch_iterator) -> tuple[str, int | None]:
    """What `fit` reads (`"arrays"`, `"tf.data"`, `"PyDataset"` or the
    adapter's name) and its batch size, the global batch of one step
    (`None` when it cannot be told without disturbing the input)."""
    adapter = epoch_iterator.data_adapter
    name = type(adapter).__name__
    if name == "ArrayDataAdapter":
        return "arrays", int(adapter.batch_size)
    if name == "TFDatasetAdapter":
        dataset = adapter.get_tf_dataset()
        if not isinstance(dataset, tf.data.Dataset):
            return "a distributed dataset", None
        return "tf.data", _tf_internal.dataset_batch_size(dataset)
    if name == "PyDatasetAdapter":
        # Its batches are the dataset's own: the first one's size (indexing
        # a PyDataset reads that batch; the iteration is not disturbed).
        first = adapter.py_dataset[0]
        inputs = first[0] if isinstance(first, tuple) else first
        leaves = keras.tree.flatten(inputs)
        size = getattr(leaves[0], "shape", [None])[0] if leaves else None
        return "PyDataset", None if size is None else int(size)
    return name, None


def epoch_iterator_shuffles_batches(epoch_iterator) -> bool:
    """Whether `fit`'s input is a `tf.data.Dataset` that shuffles its
    batches (see `tf_internal.shuffles_batches`)."""
    adapter = epoch_iterator.data_adapter
    if type(adapter).__name__ != "TFDatasetAdapter":
        return False
    dataset = adapter.get_tf_dataset()
    return isinstance(dataset, tf.data.Dataset) and _tf_internal.shuffles_batches(
        dataset
    )


def build_from_epoch_iterator(model, epoch_iterator) -> None:
    """Builds what `fit` would build in its first step (metrics, optimizer).

    Without a strategy Keras builds the compiled metrics lazily, in the first
    train step; a backup that holds their state is restored before it. Reads
    one batch for its shapes and resets the iterator, as `fit` does before
    its first epoch (call it from `on_train_begin`).
    """
    if not _needs_symbolic_build(model):
        return
    strategy = model.distribute_strategy
    data_batch = epoch_batch_spec(epoch_iterator)
    if data_batch is not None:
        with strategy.scope():
            symbolic_build(model, data_batch)
        return
    for _, _, iterator in epoch_iterator:
        batch = iterator[0] if isinstance(iterator, (list, tuple)) else next(iterator)
        data_batch = _first_replica_batch(strategy, batch)
        break
    epoch_iterator.reset()
    if data_batch is not None:
        with strategy.scope():
            symbolic_build(model, data_batch)


def set_initial_epoch(model, epoch: int | None) -> None:
    """Makes the next `fit` of `model` start at `epoch` (as stock Keras's
    `BackupAndRestore` does); `None` clears it."""
    model._initial_epoch = None if epoch is None else int(epoch)


# --- Stock Keras callbacks that write files ----------------------------------
#
# Keras's `BackupAndRestore` keeps its paths in private attributes (set in
# its `__init__`); on a worker that is not the chief, `DistributedModel.fit`
# points them at a temporary folder once the backup was read, so that only
# the chief writes the shared one.

_STOCK_BACKUP_PATHS = {
    "backup_dir": "",
    "_weights_path": "latest.weights.h5",
    "_training_metadata_path": "training_metadata.json",
    "_prev_weights_path": "latest.weights.h5.bkp",
    "_prev_training_metadata_path": "training_metadata.json.bkp",
}


def redirect_stock_backup(callback, folder: str) -> dict:
    """Points a `keras.callbacks.BackupAndRestore` at `folder`.

    Returns the attributes it replaced, for `restore_attributes`.
    """
    import os

    previous = {name: getattr(callback, name) for name in _STOCK_BACKUP_PATHS}
    for name, file_name in _STOCK_BACKUP_PATHS.items():
        setattr(
            callback, name, os.path.join(folder, file_name) if file_name else folder
        )
    return previous


def restore_attributes(obj, previous: dict) -> None:
    for name, value in previous.items():
        setattr(obj, name, value)
