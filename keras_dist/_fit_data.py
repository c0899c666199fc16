"""Batching of `DistributedModel.fit`'s data at a callback's batch size.

`AutoScaleBatch` fixes the per-replica batch; `DistributedModel.fit` batches
numpy arrays and unbatched datasets at that size times the replica count, so
the user does not compute it. The callback takes part through the small
`BatchesFitData` protocol, so this module (and the model) need not import
the callbacks module.
"""

from __future__ import annotations

import math
import types

import keras
import numpy as np
import tensorflow as tf

from keras_dist._compat import keras_src as _compat


class BatchesFitData:
    """Protocol of a callback that asks `DistributedModel.fit` to batch data.

    A callback that inherits it and sets `per_replica_batch_size` gets
    numpy arrays and unbatched datasets batched at
    `per_replica_batch_size x num_replicas_in_sync` by
    `DistributedModel.fit`, which then calls `data_batched_by_model`.
    """

    per_replica_batch_size: int

    def data_batched_by_model(self, description: str) -> None:
        """Called by `DistributedModel.fit` after it batched the data.

        Args:
            description: String. What was batched (`"arrays"`,
                `"unbatched dataset"`).
        """


def prepare_fit_arguments(model, args, kwargs):
    """Batches `fit`'s data at an `AutoScaleBatch` callback's size.

    Called by `keras_dist.DistributedModel.fit` with its arguments. Without
    an `AutoScaleBatch` among the callbacks, returns them unchanged.
    Otherwise numpy arrays (and tensors) become a `tf.data.Dataset` batched
    at `per_replica_batch_size x num_replicas_in_sync`, shuffled when `fit`'s
    `shuffle` asks (every epoch), prefetched, with the auto-shard policy
    `DATA` (in-memory data has no files to shard by); `validation_split` is
    applied first, as Keras does. An unbatched `tf.data.Dataset` is batched
    and prefetched (shuffle it yourself beforehand; its own sharding options
    are kept). Batched datasets, generators and `PyDataset`s are left alone.

    Args:
        model: The `keras.Model` whose `fit` is called.
        args: Tuple of the positional arguments of `fit` (after `self`).
        kwargs: Dict of the keyword arguments of `fit`.

    Returns:
        A tuple `(args, kwargs)` for `keras.Model.fit`.

    Raises:
        ValueError: `batch_size` or the dataset's static batch size differs
            from the callback's.
    """
    values = _compat.bind_fit_arguments(model, args, kwargs)
    _refuse_generator_on_replicas(model, values.get("x"))
    autoscale = _find_batching_callback(values.get("callbacks"))
    if autoscale is None:
        _refuse_unbatched_dataset(model, values.get("x"))
        return args, kwargs
    batch = (
        autoscale.per_replica_batch_size
        * model.distribute_strategy.num_replicas_in_sync
    )
    x = values.get("x")
    if isinstance(x, tf.data.Dataset):
        if _is_unbatched(x, model):
            values["x"] = x.batch(batch).prefetch(tf.data.AUTOTUNE)
            autoscale.data_batched_by_model("unbatched dataset")
        else:
            static = _static_batch_size(x)
            if static is not None and static != batch:
                raise ValueError(
                    f"The dataset given to `fit` is batched at {static}, but "
                    "AutoScaleBatch needs per_replica_batch_size x "
                    f"num_replicas_in_sync = {batch}. Received: a dataset with "
                    f"batch size {static}. Pass the dataset unbatched (the "
                    f"model batches it) or batch it at {batch}."
                )
        return (), values
    if not _is_array_data(x, values.get("y"), values.get("sample_weight")):
        return args, kwargs
    requested = values.get("batch_size")
    if requested is not None and requested != batch:
        raise ValueError(
            "`batch_size` must be None (or equal to per_replica_batch_size x "
            f"num_replicas_in_sync = {batch}) when AutoScaleBatch batches "
            f"DistributedModel's data. Received: batch_size={requested!r}. "
            "Drop `batch_size`; set the size with the callback's "
            "`per_replica_batch_size`."
        )
    y, sample_weight = values.get("y"), values.get("sample_weight")
    split = values.get("validation_split") or 0.0
    if split and values.get("validation_data") is None:
        (x, y, sample_weight), validation = _split_last(x, y, sample_weight, split)
        values["validation_data"] = validation
    values["validation_split"] = 0.0
    if values.get("validation_batch_size") is None:
        values["validation_batch_size"] = batch
    elements = tuple(part for part in (x, y, sample_weight) if part is not None)
    values.update(
        x=_array_dataset(
            elements if len(elements) > 1 else elements[0],
            batch,
            values.get("shuffle", True),
            seed=_update_count(model),
        ),
        y=None,
        sample_weight=None,
        batch_size=None,
        # Shuffled above; Keras would warn that it cannot shuffle a dataset.
        shuffle=False,
    )
    autoscale.data_batched_by_model("arrays")
    return (), values


def _array_dataset(arrays, batch, shuffle, seed):
    """Batches in-memory `arrays` like Keras's array adapter: shuffled indices,
    then one gather per batch (no shuffle buffer holding a copy of the data).

    The shuffle seed is the same on every worker (the optimizer's update
    count), so with `DATA` sharding the workers split one permutation instead
    of drawing overlapping examples from different ones.
    """
    tensors = keras.tree.map_structure(tf.convert_to_tensor, arrays)
    size = int(_leaves(tensors)[0].shape[0])
    indices = tf.data.Dataset.range(size)
    if shuffle and shuffle != "batch":
        indices = indices.shuffle(size, seed=seed, reshuffle_each_iteration=True)
    indices = indices.batch(batch)
    if shuffle == "batch":
        indices = indices.shuffle(
            math.ceil(size / batch), seed=seed, reshuffle_each_iteration=True
        )
    dataset = indices.map(
        lambda index: keras.tree.map_structure(
            lambda tensor: tf.gather(tensor, index), tensors
        ),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return dataset.prefetch(tf.data.AUTOTUNE).with_options(options)


def _find_batching_callback(callbacks):
    if callbacks is None:
        return None
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    found = [c for c in keras.tree.flatten(callbacks) if isinstance(c, BatchesFitData)]
    if len(found) > 1:
        raise ValueError(
            "`callbacks` must hold at most one AutoScaleBatch. Received: "
            f"{len(found)}. Keep one."
        )
    return found[0] if found else None


def _leaves(structure):
    return [leaf for leaf in keras.tree.flatten(structure) if leaf is not None]


def _is_array_data(x, y, sample_weight):
    if x is None or (y is None and sample_weight is not None):
        return False
    leaves = _leaves((x, y, sample_weight))
    return bool(leaves) and all(
        isinstance(leaf, np.ndarray) or tf.is_tensor(leaf) for leaf in leaves
    )


def _split_last(x, y, sample_weight, split):
    size = int(_leaves(x)[0].shape[0])
    at = math.floor(size * (1.0 - split))

    def head(part):
        return (
            None if part is None else keras.tree.map_structure(lambda a: a[:at], part)
        )

    def tail(part):
        return (
            None if part is None else keras.tree.map_structure(lambda a: a[at:], part)
        )

    validation = tuple(tail(part) for part in (x, y, sample_weight) if part is not None)
    return (head(x), head(y), head(sample_weight)), validation


def _is_unbatched(dataset, model) -> bool:
    """Whether `dataset` yields single examples rather than batches.

    A dataset cannot say it; infer it from its element shapes. A scalar
    component (a class label) is an example; otherwise a functional model's
    input rank decides; otherwise all-unknown first dimensions (what
    `batch()` produces) mean batches. When nothing tells, assume batches:
    feeding examples as batches fails loudly in Keras, the converse would
    train silently on wrong shapes.
    """
    specs = _leaves(dataset.element_spec)
    shapes = [spec.shape for spec in specs if hasattr(spec, "shape")]
    if not shapes or any(shape.rank is None for shape in shapes):
        return False
    if any(shape.rank == 0 for shape in shapes):
        return True
    inputs = getattr(model, "inputs", None)
    first = dataset.element_spec
    if isinstance(first, tuple):
        first = first[0]
    x_shapes = [spec.shape for spec in _leaves(first) if hasattr(spec, "shape")]
    if inputs:
        input_ranks = [len(tensor.shape) for tensor in keras.tree.flatten(inputs)]
        if len(input_ranks) == len(x_shapes):
            return all(
                shape.rank == rank - 1 for shape, rank in zip(x_shapes, input_ranks)
            )
    return not all(shape[0] is None for shape in shapes)


def _static_batch_size(dataset):
    shapes = [
        spec.shape for spec in _leaves(dataset.element_spec) if hasattr(spec, "shape")
    ]
    sizes = {shape[0] for shape in shapes if shape.rank}
    if len(sizes) == 1:
        (size,) = sizes
        return size
    return None


def _update_count(model):
    optimizer = getattr(model, "optimizer", None)
    return 0 if optimizer is None else int(optimizer.iterations.numpy())


def _refuse_generator_on_replicas(model, x):
    """Raises for a Python generator when `fit` runs on several replicas.

    tf.distribute cannot split a generator's batches (their size is not
    known to the input pipeline), so every replica takes a whole yielded
    batch: each step trains on R yielded batches, and stock Keras does so
    silently (8 yields of 16 on 2 replicas: 4 steps of 32). Refused rather
    than trained differently from one device.
    """
    replicas = model.distribute_strategy.num_replicas_in_sync
    if isinstance(x, types.GeneratorType) and replicas > 1:
        raise ValueError(
            "`x` must not be a Python generator when training on more than one "
            f"replica: tf.distribute cannot split its batches, so each of the "
            f"{replicas} replicas would take a whole yielded batch and every "
            "step would train on several of them (stock Keras does this "
            "silently). Received: x=<generator> with num_replicas_in_sync="
            f"{replicas}. Use a `keras.utils.PyDataset` (exact: each batch is "
            "split over the replicas), a batched `tf.data.Dataset`, or numpy "
            "arrays."
        )


def _refuse_unbatched_dataset(model, x):
    """Raises when `fit` gets a dataset of single examples (no `.batch`).

    Only where the model's input rank makes it certain (a functional
    model); Keras would fail later with a shape error that does not say
    why.
    """
    if (
        isinstance(x, tf.data.Dataset)
        and getattr(model, "inputs", None)
        and _is_unbatched(x, model)
    ):
        raise ValueError(
            "`x` must be a batched `tf.data.Dataset`: its elements have the "
            "shape of single examples, one dimension short of the model's "
            f"inputs. Received: element_spec={x.element_spec}. Call "
            "`dataset.batch(global_batch_size)` (with an "
            "`AutoScaleBatch` callback, DistributedModel batches it for you)."
        )
