"""`fit`, `evaluate` and `predict` of `DistributedModel` under parameter servers.

Keras 3 has no `fit` for `tf.distribute.experimental.ParameterServerStrategy`
(keras-team/keras#18624). This module drives the model through the
strategy's `tf.distribute.coordinator.ClusterCoordinator`, as tf_keras did:

- **Training** is asynchronous. Each worker reads its own copy of the input
  (`create_per_worker_dataset`, repeated), and the coordinator schedules
  chunks of `steps_per_execution` train steps; any free worker runs the next
  chunk and pushes its updates to the ps tasks. An epoch is
  `steps_per_epoch` steps in all, over all workers.
- **Metrics** live on the ps tasks and every worker adds to them, so the
  epoch's logs cover every worker's steps. Keras 3 updates variables by a
  read and a write (updates from two workers at once would be lost), so the
  step functions are traced with atomic updates
  (`_compat.parameter_servers.parameter_server_tracing`, in effect for the
  graphs being traced only).
- **Evaluation and prediction** are exact: the coordinator reads the data
  and schedules one call per batch, with the batch as its argument; each
  batch is evaluated once, and predictions come back in input order.

Private: use it through `DistributedModel`. Serving a `worker` or `ps`
task is `keras_dist.parameter_server.serving`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import re
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_dist._compat import keras_src as _compat
from keras_dist._compat import parameter_servers as _ps_compat
from keras_dist._compat import tf_internal
from keras_dist._validation import check_int
from keras_dist.core.plain import NoCompression
from keras_dist.optimizers import find_accumulator

logger = logging.getLogger(__name__)

# Chunks in flight per worker. Completed chunks are reported in order, so the
# coordinator waits on the oldest: with W workers and this many per worker, a
# straggler up to about 8W / (W - 1) times slower than the others does not
# hold them back (2 per worker stalled them beyond ~3x). More only delays
# `on_train_batch_end`.
_IN_FLIGHT_PER_WORKER = 8
_DEFAULT_BATCH_SIZE = 32


def is_parameter_server(strategy) -> bool:
    """Whether `strategy` is a `ParameterServerStrategy`."""
    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


def coordinator(strategy) -> tf.distribute.coordinator.ClusterCoordinator:
    """The strategy's `ClusterCoordinator` (TensorFlow keeps one per strategy)."""
    return tf.distribute.coordinator.ClusterCoordinator(strategy)


def num_workers(strategy) -> int:
    """Number of `worker` tasks of the strategy's cluster."""
    return _ps_compat.parameter_server_workers(strategy)


_PS_TASK = re.compile(r"/job:ps/replica:\d+/task:(\d+)")
_WORKER_TASK = re.compile(r"/job:worker/replica:\d+/task:(\d+)")
_ADDRESS = re.compile(r"ipv[46]:([^\s\",]+)")


@contextlib.contextmanager
def lost_ps_task_named():
    """Turns the coordinator's error for a lost ps task into a clear one.

    The variables live on the ps tasks: when one fails they are gone, so the
    training cannot go on (unlike a lost worker, whose steps the coordinator
    retries elsewhere). TensorFlow raises an `UnavailableError` of several
    screens; this names the task and the fix.
    """
    try:
        yield
    except (tf.errors.UnavailableError, tf.errors.AbortedError) as error:
        found = _PS_TASK.search(str(error))
        if found is None:
            raise
        address = _ADDRESS.search(str(error))
        where = f" at {address.group(1)}" if address else ""
        raise RuntimeError(
            f"Parameter server ps:{found.group(1)}{where} is unreachable: it "
            "failed or was stopped, and the variables it held are lost, so "
            "the training cannot go on (a lost worker is retried, a lost ps "
            "task is not). Restart the job, restoring the model from your "
            "last checkpoint (e.g. `keras.callbacks.ModelCheckpoint` on the "
            f"chief). TensorFlow's error: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}"
        ) from error


def fetch(cluster, remote_value):
    """A scheduled closure's outputs, read from the worker that ran it.

    TensorFlow marks a closure's outputs ready once its function is
    dispatched; the coordinator's thread for that worker then copies them
    here and, when the copy fails because the worker died, runs the closure
    again on another worker. A `fetch` from this thread can take the copy
    first, and then raises `UnavailableError` for a closure that is retried
    (seen in CI: a SIGKILLed worker ended `fit`). Here the closure is waited
    for again and its outputs read from where it ran the second time. A lost
    ps task still raises, for `lost_ps_task_named`.
    """
    for _ in range(num_workers(cluster.strategy)):
        try:
            return remote_value.fetch()
        except (tf.errors.UnavailableError, tf.errors.CancelledError) as error:
            holders = tf_internal.remote_value_devices(remote_value)
            if _PS_TASK.search(str(error)) or not any(
                _WORKER_TASK.search(device) for device in holders
            ):
                raise
            logger.warning(
                "keras_dist: the outputs of a step were lost with the worker "
                "that ran it (%s); the coordinator runs it again on another "
                "worker. TensorFlow's error: %s",
                ", ".join(sorted(holders)),
                str(error).splitlines()[0] if str(error) else type(error).__name__,
            )
            cluster.join()
    return remote_value.fetch()


# --- Checks ------------------------------------------------------------------


def check_model(model, callbacks) -> None:
    """Refuses what has no meaning under parameter servers, naming the fix.

    A callback that cannot work here says why in its class attribute
    `parameter_server_refusal` (keras_dist's `AutoScaleBatch` and
    `BackupAndRestore` do); Keras's own `BackupAndRestore` is refused too.
    """
    if model.optimizer is None:
        raise RuntimeError(
            "The model must be compiled before `fit`/`evaluate`: call "
            "`model.compile(optimizer=..., loss=...)` under `strategy.scope()`."
        )
    if not isinstance(model.all_reduce_hook, NoCompression):
        raise ValueError(
            "An all-reduce hook has nothing to reduce under "
            "ParameterServerStrategy: each worker sends its gradients to the "
            "ps tasks itself, and no worker sums gradients with another. "
            f"Received: all_reduce_hook={model.all_reduce_hook!r}. Remove "
            "the hook (`all_reduce_hook=None`), or train with "
            "MultiWorkerMirroredStrategy, where gradients are all-reduced."
        )
    accumulator = find_accumulator(model.optimizer)
    if accumulator is not None:
        raise ValueError(
            "GradientAccumulationOptimizer does not work under "
            "ParameterServerStrategy: its accumulators are per replica and "
            "synchronous, while parameter-server workers update the ps tasks "
            "asynchronously. Received: optimizer="
            f"{type(model.optimizer).__name__}. Use the inner optimizer "
            "with a larger per-worker batch (or `steps_per_execution`), or "
            "MultiWorkerMirroredStrategy for a synchronous big batch."
        )
    for callback in callbacks or ():
        reason = getattr(callback, "parameter_server_refusal", None)
        if reason is None and isinstance(callback, keras.callbacks.BackupAndRestore):
            reason = (
                "its resume point is a synchronous step, and parameter-server "
                "steps are asynchronous. To survive a failed chief, save with "
                "`keras.callbacks.ModelCheckpoint` or `tf.train.Checkpoint` "
                "from the chief and load at start."
            )
        if reason is not None:
            # keras_dist's callbacks by their public name; others in full.
            module = type(callback).__module__
            name = type(callback).__name__
            if not module.startswith("keras_dist."):
                name = f"{module}.{name}"
            raise ValueError(
                f"{name} does not work under ParameterServerStrategy: {reason}"
            )


# --- Input -------------------------------------------------------------------


def _is_dataset_fn(x) -> bool:
    return callable(x) and not isinstance(x, (tf.data.Dataset, np.ndarray))


def _is_arrays(x) -> bool:
    leaves = keras.tree.flatten(x)
    return bool(leaves) and all(
        isinstance(leaf, (np.ndarray, tf.Tensor)) or hasattr(leaf, "__array__")
        for leaf in leaves
    )


def _num_examples(x) -> int:
    return int(keras.tree.flatten(x)[0].shape[0])


def _array_dataset(x, y, sample_weight, batch_size, shuffle) -> tf.data.Dataset:
    if batch_size is None:
        batch_size = _DEFAULT_BATCH_SIZE
    elements = tuple(value for value in (x, y, sample_weight) if value is not None)
    dataset = tf.data.Dataset.from_tensor_slices(
        elements if len(elements) > 1 else elements[0]
    )
    if shuffle:
        dataset = dataset.shuffle(_num_examples(x), reshuffle_each_iteration=True)
    return dataset.batch(batch_size)


def _training_dataset(strategy, x, y, sample_weight, batch_size, shuffle, steps):
    """The per-worker input of `fit`, a batch for shapes, and the epoch steps."""
    if _is_dataset_fn(x):
        if y is not None or sample_weight is not None:
            raise ValueError(
                "With a dataset function as `x`, the function's dataset yields "
                "the targets: `y` and `sample_weight` must be `None`. "
                f"Received: y={type(y).__name__}, "
                f"sample_weight={type(sample_weight).__name__}."
            )
        if steps is None:
            raise ValueError(
                "`steps_per_epoch` is required when `x` is a dataset "
                "function under ParameterServerStrategy: every worker "
                "repeats its dataset, so an epoch has no end of its own. "
                f"Received: x={x!r}, steps_per_epoch=None. Pass "
                "`steps_per_epoch=<steps over all workers per epoch>`."
            )
        # TensorFlow builds the function's dataset once, on the chief, and
        # runs that graph on every worker: each sees input pipeline 0 of 1.
        context = tf.distribute.InputContext(
            num_replicas_in_sync=strategy.num_replicas_in_sync
        )
        first = next(iter(x(context).take(1)))
        distributed = strategy.distribute_datasets_from_function(
            lambda input_context: x(input_context).repeat()
        )
        return distributed, first, steps
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise ValueError(
                "With a `tf.data.Dataset` as `x`, the dataset yields the "
                "targets: `y` and `sample_weight` must be `None`. Received: "
                f"y={type(y).__name__}, sample_weight={type(sample_weight).__name__}."
            )
        dataset = x
    elif _is_arrays(x):
        dataset = _array_dataset(x, y, sample_weight, batch_size, shuffle)
    else:
        raise TypeError(
            "Under ParameterServerStrategy `fit` takes a `tf.data.Dataset`, a "
            "dataset function `dataset_fn(input_context)`, or NumPy arrays. "
            f"Received: x of type {type(x).__name__}. Wrap a generator or "
            "`PyDataset` in `tf.data.Dataset.from_generator`."
        )
    if steps is None:
        cardinality = int(dataset.cardinality())
        if cardinality < 0:
            raise ValueError(
                "`steps_per_epoch` is required for an infinite dataset or one "
                "of unknown size under ParameterServerStrategy (each worker "
                "repeats the dataset, so an epoch has no end of its own). "
                f"Received: a dataset of cardinality {cardinality}, "
                "steps_per_epoch=None. Pass `steps_per_epoch=...`."
            )
        if cardinality == 0:
            raise ValueError(
                "The data given to `fit` is empty: it yields no batch. "
                "Received: a dataset of cardinality 0."
            )
        steps = cardinality
    first = next(iter(dataset.take(1)), None)
    if first is None:
        raise ValueError(
            "The data given to `fit` is empty: it yields no batch. Check the "
            "dataset (a filter or a split that left nothing)."
        )
    # The dataset is built on the coordinator and rebuilt on every worker
    # from its serialized graph (a dataset captured in a function cannot be
    # copied to a worker: "Unable to parse tensor proto").
    distributed = strategy.experimental_distribute_dataset(dataset.repeat())
    return distributed, first, steps


def _local_batches(x, y, sample_weight, batch_size, steps, argument="x"):
    """The batches of `evaluate`/`predict`, read on the coordinator."""
    if _is_dataset_fn(x):
        dataset = x(tf.distribute.InputContext())
    elif isinstance(x, tf.data.Dataset):
        dataset = x
    elif _is_arrays(x):
        dataset = _array_dataset(x, y, sample_weight, batch_size, shuffle=False)
    else:
        raise TypeError(
            f"Under ParameterServerStrategy `{argument}` is a `tf.data.Dataset`, "
            "a dataset function or NumPy arrays. Received: "
            f"{type(x).__name__}."
        )
    if steps is None and int(dataset.cardinality()) == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "The evaluation/prediction data is infinite: pass `steps` (or "
            f"`validation_steps` in `fit`). Received: an infinite `{argument}` "
            "and steps=None."
        )
    if steps is not None:
        dataset = dataset.take(steps)
    return iter(dataset)


# --- Building ------------------------------------------------------------------


def build(model, strategy, batch) -> None:
    """Creates every variable on the coordinator before any step is scheduled.

    Layers, compiled metrics and loss, the optimizer and the hook are built
    under the strategy's scope, so their variables live on the ps tasks.
    """
    with strategy.scope():
        if _compat._needs_symbolic_build(model):
            _compat.symbolic_build(model, batch)
        model.build_all_reduce_hook()


def _local_value(strategy, value):
    """One value from a step's output (the first local replica's)."""
    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


def _step_logs(model, strategy, outputs):
    """A step's logs on the worker: metrics from their (global) state."""
    metrics = model.get_metrics_result()
    logs = keras.tree.map_structure(lambda v: _local_value(strategy, v), outputs)
    if isinstance(logs, dict):
        logs = {**logs, **{k: v for k, v in metrics.items() if k in logs}}
    return logs


# Model -> {"train" | "test" | "predict": traced step function}.
_FUNCTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _train_function(model, strategy):
    functions = _FUNCTIONS.setdefault(model, {})
    if functions.get("train") is not None:
        return functions["train"]

    def train_chunk(iterator, num_steps):
        with _ps_compat.parameter_server_tracing():
            outputs = strategy.run(model.train_step, args=(next(iterator),))
            for _ in tf.range(num_steps - 1):
                outputs = strategy.run(model.train_step, args=(next(iterator),))
            return _step_logs(model, strategy, outputs)

    function = tf.function(train_chunk)
    functions["train"] = function
    return function


def _batch_function(model, strategy, step, name):
    functions = _FUNCTIONS.setdefault(model, {})
    if functions.get(name) is not None:
        return functions[name]

    def on_batch(data):
        with _ps_compat.parameter_server_tracing():
            outputs = strategy.run(step, args=(data,))
            if name == "predict":
                return keras.tree.map_structure(
                    lambda v: _local_value(strategy, v), outputs
                )
            return _step_logs(model, strategy, outputs)

    function = tf.function(on_batch, reduce_retracing=True)
    functions[name] = function
    return function


def reset_functions(model) -> None:
    """Forgets the traced step functions (after `compile` or a new hook)."""
    _FUNCTIONS.pop(model, None)


def _to_floats(logs) -> dict:
    flat = {}
    for key, value in (logs or {}).items():
        if isinstance(value, dict):
            flat.update(_to_floats(value))
        else:
            value = np.asarray(value)
            flat[key] = float(value) if value.size == 1 else value
    return flat


def _metrics_logs(model) -> dict:
    """The metrics read from the ps tasks: every worker's steps."""
    return _to_floats(model.get_metrics_result())


class _InFlight:
    """Scheduled chunks, completed in order; reports each to the callbacks."""

    def __init__(self, cluster, limit, on_done):
        self._cluster = cluster
        self._pending = collections.deque()
        self._limit = limit
        self._on_done = on_done
        self.last_logs = {}

    def add(self, step, remote_value):
        self._pending.append((step, remote_value))
        while len(self._pending) > self._limit:
            self._complete_oldest()

    def drain(self):
        while self._pending:
            self._complete_oldest()

    def _complete_oldest(self):
        step, remote_value = self._pending.popleft()
        self.last_logs = _to_floats(fetch(self._cluster, remote_value))
        self._on_done(step, self.last_logs)


# --- fit / evaluate / predict ---------------------------------------------------


def fit(
    model,
    x=None,
    y=None,
    batch_size=None,
    epochs=1,
    verbose="auto",
    callbacks=None,
    validation_split=0.0,
    validation_data=None,
    shuffle=True,
    class_weight=None,
    sample_weight=None,
    initial_epoch=0,
    steps_per_epoch=None,
    validation_steps=None,
    validation_batch_size=None,
    validation_freq=1,
):
    """`DistributedModel.fit` under `ParameterServerStrategy`; returns History."""
    # 0 or less would "train" no step and return zero logs.
    steps_per_epoch = check_int(
        "steps_per_epoch",
        steps_per_epoch,
        minimum=1,
        allow_none=True,
        hint="It counts the steps of one epoch over all workers; `None` takes "
        "the size of the data.",
    )
    strategy = model.distribute_strategy
    check_model(model, callbacks)
    if class_weight is not None:
        raise ValueError(
            "`class_weight` is not supported by `fit` under "
            f"ParameterServerStrategy. Received: class_weight={class_weight!r}. "
            "Weight the examples with `sample_weight` (or a third element of "
            "the dataset) instead."
        )
    if validation_split:
        if not _is_arrays(x):
            raise ValueError(
                "`validation_split` only works with NumPy arrays. Received: "
                f"validation_split={validation_split} with x of type "
                f"{type(x).__name__}. Pass `validation_data` instead."
            )
        x, y, sample_weight, validation_data = _split(
            x, y, sample_weight, validation_split
        )
    distributed, first, steps = _training_dataset(
        strategy, x, y, sample_weight, batch_size, shuffle, steps_per_epoch
    )
    build(model, strategy, first)
    cluster = coordinator(strategy)
    iterator = iter(cluster.create_per_worker_dataset(distributed))
    train = _train_function(model, strategy)
    callback_list = _callback_list(
        model, callbacks, verbose, steps, epochs=epochs, history=True
    )
    model.stop_training = False
    chunk = max(1, int(model.steps_per_execution))
    in_flight = _InFlight(
        cluster,
        _IN_FLIGHT_PER_WORKER * num_workers(strategy),
        callback_list.on_train_batch_end,
    )
    callback_list.on_train_begin()
    with lost_ps_task_named():
        epoch_logs = {}
        for epoch in range(initial_epoch, epochs):
            model.reset_metrics()
            callback_list.on_epoch_begin(epoch)
            step = 0
            while step < steps and not model.stop_training:
                size = min(chunk, steps - step)
                callback_list.on_train_batch_begin(step)
                remote = cluster.schedule(
                    train, args=(iterator, tf.constant(size, tf.int32))
                )
                step += size
                in_flight.add(step - 1, remote)
            in_flight.drain()
            cluster.join()
            epoch_logs = {**in_flight.last_logs, **_metrics_logs(model)}
            if validation_data is not None and _should_validate(epoch, validation_freq):
                val_x, val_y, val_weight = keras.utils.unpack_x_y_sample_weight(
                    validation_data
                )
                val_logs = evaluate(
                    model,
                    val_x,
                    val_y,
                    batch_size=validation_batch_size or batch_size,
                    sample_weight=val_weight,
                    steps=validation_steps,
                    callback_list=callback_list,
                    return_dict=True,
                )
                epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
            callback_list.on_epoch_end(epoch, epoch_logs)
            if model.stop_training:
                break
    callback_list.on_train_end(epoch_logs)
    return model.history


def _should_validate(epoch, validation_freq) -> bool:
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq


def _split(x, y, sample_weight, validation_split):
    count = _num_examples(x)
    split_at = math.floor(count * (1.0 - validation_split))
    if split_at in (0, count):
        raise ValueError(
            f"`validation_split={validation_split}` leaves no example for "
            f"training or for validation out of {count}."
        )

    def head(value):
        return keras.tree.map_structure(lambda a: a[:split_at], value)

    def tail(value):
        return keras.tree.map_structure(lambda a: a[split_at:], value)

    validation = tuple(
        tail(value) for value in (x, y, sample_weight) if value is not None
    )
    return head(x), head(y), head(sample_weight), validation


def evaluate(
    model,
    x=None,
    y=None,
    batch_size=None,
    verbose="auto",
    sample_weight=None,
    steps=None,
    callbacks=None,
    return_dict=False,
    callback_list=None,
):
    """`DistributedModel.evaluate` under `ParameterServerStrategy`."""
    strategy = model.distribute_strategy
    check_model(model, callbacks)
    first, batches = _first_and_rest("evaluate", x, y, sample_weight, batch_size, steps)
    build(model, strategy, first)
    cluster = coordinator(strategy)
    if callback_list is None:
        callback_list = _callback_list(model, callbacks, verbose, steps)
    test = _batch_function(model, strategy, model.test_step, "test")
    in_flight = _InFlight(
        cluster,
        _IN_FLIGHT_PER_WORKER * num_workers(strategy),
        callback_list.on_test_batch_end,
    )
    model.reset_metrics()
    callback_list.on_test_begin()
    with lost_ps_task_named():
        for step, batch in enumerate(_chain(first, batches)):
            callback_list.on_test_batch_begin(step)
            in_flight.add(step, cluster.schedule(test, args=(batch,)))
        in_flight.drain()
        cluster.join()
    logs = {**in_flight.last_logs, **_metrics_logs(model)}
    callback_list.on_test_end(logs)
    if return_dict:
        return logs
    # As Keras: the loss first, then the metrics, in their order.
    values = list(logs.values())
    return values[0] if len(values) == 1 else values


def predict(model, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """`DistributedModel.predict` under `ParameterServerStrategy`, in order."""
    strategy = model.distribute_strategy
    first, batches = _first_and_rest("predict", x, None, None, batch_size, steps)
    with strategy.scope():
        if not model.built:
            inputs, _, _ = keras.utils.unpack_x_y_sample_weight(first)
            model(inputs)
    cluster = coordinator(strategy)
    callback_list = _callback_list(model, callbacks, verbose, steps)
    predict_batch = _batch_function(model, strategy, model.predict_step, "predict")
    remotes = []
    callback_list.on_predict_begin()
    outputs = []
    with lost_ps_task_named():
        for step, batch in enumerate(_chain(first, batches)):
            callback_list.on_predict_batch_begin(step)
            remotes.append(cluster.schedule(predict_batch, args=(batch,)))
        cluster.join()
        for step, remote in enumerate(remotes):
            output = fetch(cluster, remote)
            outputs.append(output)
            callback_list.on_predict_batch_end(step, {"outputs": output})
    callback_list.on_predict_end()
    return keras.tree.map_structure_up_to(
        outputs[0], lambda *parts: np.concatenate(parts), *outputs
    )


def _first_and_rest(what, x, y, sample_weight, batch_size, steps):
    batches = _local_batches(x, y, sample_weight, batch_size, steps)
    first = next(batches, None)
    if first is None:
        raise ValueError(f"The data given to `{what}` is empty: it yields no batch.")
    return first, batches


def _callback_list(model, callbacks, verbose, steps, epochs=1, history=False):
    """Keras's `CallbackList`, with its progress bar and History, as `fit` makes."""
    verbose = 1 if verbose == "auto" else verbose
    return keras.callbacks.CallbackList(
        callbacks,
        add_history=history,
        add_progbar=verbose != 0,
        model=model,
        verbose=verbose,
        epochs=epochs,
        steps=steps,
    )


def _chain(first, rest):
    yield first
    yield from rest
