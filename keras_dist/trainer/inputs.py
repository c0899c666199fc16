"""Python-side input of `fit`/`evaluate`/`predict`: batches in memory of
their own.

TensorFlow shares the memory of a numpy array it converts, instead of
copying it, when the array starts on a 64-byte boundary
(`EIGEN_MAX_ALIGN_BYTES`), and an op may write its result into an input
buffer that nothing else in TensorFlow holds (buffer forwarding). Together
they let TensorFlow write into the user's arrays. A `keras.utils.PyDataset`
whose `__getitem__` returns slices of the user's arrays (the usual way to
write one) is fed through `tf.data.Dataset.from_generator`;
`MirroredStrategy` splits each batch into per-replica slices that share its
buffer, and the loss wrote into the user's labels. Measured with stock
Keras (TensorFlow 2.21, Keras 3.15, 2 and 4 replicas on CPU): with the
arrays at a 64-byte boundary, every fit rewrote rows of `y` (those of
the replicas after the first), and the next fit on those arrays trained on garbage,
with no error; at a 16-byte boundary nothing was written. numpy places an
array there about one time in four, depending on what was allocated
before, so it looked random (`tests/test_inputs.py` aligns the arrays to
show it every time). No upstream issue describes it.

`DistributedModel` therefore hands TensorFlow a copy of every numpy array a
`PyDataset` or a generator yields (a `memcpy` of the batch per step). A
`tf.data.Dataset.from_generator` of your own is not seen by the model:
yield copies from it (`np.array(batch)`), not views.
"""

from __future__ import annotations

import types

import keras
import numpy as np


def own_batches(x):
    """`x` with its numpy batches copied as they are read.

    Args:
        x: What `fit`, `evaluate` or `predict` received as data (or as
            `validation_data`).

    Returns:
        A `keras.utils.PyDataset` proxy for a `PyDataset`, a generator for a
        generator, and `x` itself for anything else (arrays, tensors,
        `tf.data` datasets are converted by Keras into memory of
        TensorFlow's own).
    """
    if isinstance(x, keras.utils.PyDataset) and not isinstance(x, OwnedBatches):
        return OwnedBatches(x)
    if isinstance(x, types.GeneratorType):
        return (copy_arrays(batch) for batch in x)
    return x


def copy_arrays(batch):
    """`batch` with every numpy array in it replaced by a copy."""
    return keras.tree.map_structure(
        lambda leaf: (
            np.array(leaf, copy=True) if isinstance(leaf, np.ndarray) else leaf
        ),
        batch,
    )


class OwnedBatches(keras.utils.PyDataset):
    """A `PyDataset` that yields copies of another one's batches.

    Everything else (length, `num_batches`, epoch hooks, workers and
    multiprocessing) is the wrapped dataset's.

    Args:
        dataset: The user's `keras.utils.PyDataset`.
    """

    def __init__(self, dataset):
        # A user's PyDataset that skipped `super().__init__()` has none of
        # these; Keras's defaults apply then, as for the dataset itself.
        super().__init__(
            workers=getattr(dataset, "workers", 1),
            use_multiprocessing=getattr(dataset, "use_multiprocessing", False),
            max_queue_size=getattr(dataset, "max_queue_size", 10),
        )
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return copy_arrays(self.dataset[index])

    @property
    def num_batches(self):
        return self.dataset.num_batches

    def on_epoch_begin(self):
        self.dataset.on_epoch_begin()

    def on_epoch_end(self):
        self.dataset.on_epoch_end()
