"""`find_max_batch_size`: the largest per-replica batch whose training step fits."""

from __future__ import annotations

import gc
import logging
import math

import keras
import tensorflow as tf

from keras_dist._compat import keras_src as _compat
from keras_dist._validation import check_int, check_real
from keras_dist.core import collectives
from keras_dist.core.statistics import gradient_statistics
from keras_dist.optimizers import find_accumulator

logger = logging.getLogger(__name__)


def find_max_batch_size(
    model,
    sample_batch_fn,
    *,
    initial_batch_size=1,
    max_batch_size=65536,
    safety_margin=0.1,
    steps=None,
    train_step_fn=None,
):
    """Finds the largest per-replica batch whose training step fits in memory.

    Runs real training steps at growing per-replica batch sizes: doubling
    from `initial_batch_size` until a step raises
    `tf.errors.ResourceExhaustedError` (or `max_batch_size` is reached), then
    a binary search between the last size that ran and the first that did
    not. The result keeps a `safety_margin` below the largest size that ran,
    because memory use varies between steps (allocator fragmentation, other
    processes, longer sequences). After every trial the model's weights, the
    optimizer's state (slots, iterations, accumulators), the all-reduce
    hook's state and the metrics are put back as they were, so the model
    trains afterwards as if the search had not happened.

    Under a strategy with several workers, every trial ends with a tiny
    collective in which the workers agree whether it ran everywhere, so all
    workers try the same sizes in the same order and return the same result,
    the minimum over workers. A worker that runs out of memory before the
    gradient all-reduce leaves the others waiting in it until the
    collective's timeout; where workers differ in memory, run the search in a
    one-worker job on the smallest machine and pass its result to all.

    Use the result as `AutoScaleBatch(per_replica_batch_size=...)`, and grow
    the global batch beyond it with accumulation steps.

    Args:
        model: `keras.Model`. A compiled model (under its strategy's scope).
        sample_batch_fn: Callable `batch_size -> batch`. Returns one global
            batch of `batch_size` examples (numpy arrays or tensors), as `fit`
            takes it: `x`, `(x, y)` or `(x, y, sample_weight)`. It is called
            with `per_replica x num_replicas_in_sync`, and every array in
            the batch must have that many rows. Random data of the real
            shapes is enough.
        initial_batch_size: Int >= 1. First per-replica batch size tried.
            Defaults to `1`.
        max_batch_size: Int >= `initial_batch_size`. Largest per-replica batch
            size tried. Defaults to `65536`.
        safety_margin: Float in `[0, 1)`. Fraction of the largest working
            size given up: the result is `floor(largest * (1 -
            safety_margin))`, at least 1. Defaults to `0.1`.
        steps: Int >= 1 or `None`. Training steps per trial. Defaults to
            `None`: the `accumulation_steps` of a
            `GradientAccumulationOptimizer` (so that a trial includes an
            update), else 1.
        train_step_fn: Callable `batch -> None` or `None`. Runs the training
            step(s) of one trial on `batch`. Defaults to `None`:
            `model.fit` on the batch repeated `steps` times, with the model's
            own strategy, train step and optimizer. Pass one for a custom
            training loop.

    Returns:
        Int. The per-replica batch size to use.

    Raises:
        TypeError: `model` is not a Keras model, a callable argument is not
            callable, or a size, the margin or `steps` is not a number.
        ValueError: sizes, margin or steps out of range, or
            `sample_batch_fn(n)` returned a batch whose arrays do not all
            have `n` rows (a search on a batch of fixed size measures
            nothing).
        RuntimeError: the model is not compiled, or even `initial_batch_size`
            does not fit.

    Example:

    ```python
    def sample_batch(batch_size):
        x = np.random.rand(batch_size, 224, 224, 3).astype("float32")
        y = np.random.randint(0, 1000, size=(batch_size,))
        return x, y

    with strategy.scope():
        model = keras_dist.DistributedModel.from_model(
            keras.applications.ResNet50(weights=None)
        )
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    per_replica = keras_dist.find_max_batch_size(model, sample_batch)
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` must be a `keras.Model`. Received: model={type(model).__name__}."
        )
    if not callable(sample_batch_fn):
        raise TypeError(
            "`sample_batch_fn` must be a callable `batch_size -> batch`. "
            f"Received: sample_batch_fn={sample_batch_fn!r}."
        )
    if train_step_fn is not None and not callable(train_step_fn):
        raise TypeError(
            "`train_step_fn` must be a callable `batch -> None` or None. "
            f"Received: train_step_fn={train_step_fn!r}."
        )
    initial_batch_size = check_int("initial_batch_size", initial_batch_size, minimum=1)
    max_batch_size = check_int("max_batch_size", max_batch_size, minimum=1)
    if max_batch_size < initial_batch_size:
        raise ValueError(
            "`max_batch_size` must be >= `initial_batch_size`. Received: "
            f"max_batch_size={max_batch_size!r}, "
            f"initial_batch_size={initial_batch_size!r}."
        )
    safety_margin = check_real(
        "safety_margin",
        safety_margin,
        minimum=0,
        maximum=1,
        high_open=True,
        hint="It is the fraction of the largest working batch to give up. Use "
        "e.g. 0.1 for 10%.",
    )
    steps = check_int("steps", steps, minimum=1, allow_none=True)
    if getattr(model, "optimizer", None) is None:
        raise RuntimeError(
            "`find_max_batch_size` runs training steps: compile the model "
            "(`model.compile(optimizer=..., loss=...)`) first."
        )
    strategy = model.distribute_strategy
    replicas = strategy.num_replicas_in_sync
    if steps is None:
        accumulator = find_accumulator(model.optimizer)
        steps = accumulator.accumulation_steps if accumulator is not None else 1
    if train_step_fn is None:
        train_step_fn = _fit_step(model, steps)
    if not model.built or not model.optimizer.built:
        with strategy.scope():
            _compat.symbolic_build(
                model, _sample(sample_batch_fn, initial_batch_size * replicas)
            )
    snapshot = _Snapshot(model)

    def fits(per_replica):
        ok = True
        try:
            train_step_fn(_sample(sample_batch_fn, per_replica * replicas))
        except tf.errors.ResourceExhaustedError as error:
            ok = False
            logger.debug(
                "Out of memory at per-replica batch %d: %s", per_replica, error
            )
        finally:
            snapshot.restore()
        if not ok:
            # Drop the failed step's frames and tensors before the next trial.
            gc.collect()
        ok = _all_workers_ok(strategy, ok)
        logger.info(
            "find_max_batch_size: per-replica batch %d %s.",
            per_replica,
            "fits" if ok else "is out of memory",
        )
        return ok

    if not fits(initial_batch_size):
        raise RuntimeError(
            "Even the smallest batch tried does not fit in memory: a training "
            f"step at per-replica batch {initial_batch_size} raised "
            "ResourceExhaustedError. Received: initial_batch_size="
            f"{initial_batch_size}. Lower it, shrink the model or its inputs, "
            "or train in mixed precision."
        )
    largest, failed = initial_batch_size, None
    while largest < max_batch_size:
        candidate = min(2 * largest, max_batch_size)
        if not fits(candidate):
            failed = candidate
            break
        largest = candidate
    if failed is not None:
        while failed - largest > 1:
            middle = (largest + failed) // 2
            if fits(middle):
                largest = middle
            else:
                failed = middle
    result = max(1, math.floor(largest * (1.0 - safety_margin)))
    logger.info(
        "find_max_batch_size: largest per-replica batch that ran: %d%s; with a "
        "%.0f%% safety margin: %d.",
        largest,
        " (the max_batch_size cap)" if failed is None else "",
        100 * safety_margin,
        result,
    )
    return result


def _sample(sample_batch_fn, batch_size):
    """Returns `sample_batch_fn(batch_size)` after checking its batch dimension."""
    batch = sample_batch_fn(batch_size)
    for path, leaf in keras.tree.flatten_with_path(batch):
        if leaf is None:
            continue
        shape = getattr(leaf, "shape", None)
        rows = shape[0] if shape is not None and len(shape) else None
        if rows is None and shape is not None and len(shape):
            continue  # Unknown until run: nothing to check here.
        if rows != batch_size:
            where = "".join(f"[{key!r}]" for key in path) or " itself"
            found = (
                f"has shape {tuple(shape)}"
                if shape is not None
                else f"is a {type(leaf).__name__}, not an array"
            )
            raise ValueError(
                f"`sample_batch_fn` must return a batch of exactly the "
                f"`batch_size` examples it is asked for. Called with "
                f"batch_size={batch_size}, it returned a batch whose "
                f"element{where} {found}. Received: "
                f"sample_batch_fn={sample_batch_fn!r}. Build the arrays "
                "from the argument, e.g. `np.random.rand(batch_size, ...)`: "
                "a batch of fixed size makes the search measure nothing."
            )
    return batch


def _fit_step(model, steps):
    def step(batch):
        dataset = tf.data.Dataset.from_tensors(batch).repeat(steps)
        # Every worker generates the same global batch; the distributed
        # dataset splits each one over the replicas.
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF
        )
        model.fit(dataset.with_options(options), epochs=1, shuffle=False, verbose=0)

    return step


class _Snapshot:
    """Host copies of the state a training step changes, and their restore."""

    def __init__(self, model):
        self._model = model
        self._weights = model.get_weights()
        self._variables = list(model.optimizer.variables)
        for hook in (
            getattr(model, "all_reduce_hook", None),
            getattr(model.optimizer, "all_reduce_hook", None),
        ):
            if hook is not None and hook.built:
                self._variables.extend(hook.state_variables)
        statistics = gradient_statistics(model.optimizer)
        if statistics is not None:
            self._variables.extend(
                [
                    statistics.local_sq_norm_sum,
                    statistics.reduced_sq_norm_sum,
                    statistics.count,
                ]
            )
        self._values = [keras.ops.convert_to_numpy(v) for v in self._variables]
        self._history = getattr(model, "history", None)

    def restore(self):
        model = self._model
        model.set_weights(self._weights)
        for variable, value in zip(self._variables, self._values):
            variable.assign(value)
        model.reset_metrics()
        if self._history is not None:
            model.history = self._history


def _all_workers_ok(strategy, ok):
    """Whether the trial ran on every replica of every worker (one collective)."""
    if strategy.num_replicas_in_sync == 1:
        return ok
    failed = tf.constant(0.0 if ok else 1.0)
    per_replica = strategy.run(lambda: tf.identity(failed))
    total = collectives.reduce_across(strategy, per_replica)
    return float(total) == 0.0
