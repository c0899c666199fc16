"""`NoCompression`: the plain sum all-reduce, keras_dist's default hook."""

from __future__ import annotations

from keras_dist.core.collectives import all_reduce, all_reduce_sum, is_sparse
from keras_dist.core.hook_types import DEFAULT_BUCKET_BYTES
from keras_dist.core.hooks import AllReduceHook


class NoCompression(AllReduceHook):
    """Plain sum all-reduce, the default hook.

    The gradients are summed at their own precision, as stock Keras does,
    but owned by keras_dist so it happens once, before clipping. They go in
    buckets of about `bucket_bytes`, in reverse order of the model's
    variables, one collective per bucket issued as soon as its gradients
    exist, so communication overlaps the rest of the backward pass (see
    `plan_buckets`). Sparse gradients (`tf.IndexedSlices`, from `Embedding`
    and other gathers) stay sparse, as in stock Keras: their rows and
    indices are all-gathered, in their place in that order, and the
    optimizer applies a sparse update. `FP16` and `BF16` send them the same
    way, at full precision; the other compressing hooks densify them (they
    compress dense tensors), which also changes what Adam-like optimizers
    make of a repeated row: for embeddings keep this hook or a cast.

    Args:
        bucket_bytes: Int or `None`. Bytes per collective (see
            `plan_buckets`). `None` sends all gradients of a dtype in one
            collective after the whole backward pass. Defaults to
            `DEFAULT_BUCKET_BYTES` (4 MiB).

    Example:

    ```python
    model = keras_dist.DistributedModel(
        inputs, outputs, all_reduce_hook=keras_dist.compression.NoCompression()
    )
    ```
    """

    def __init__(self, bucket_bytes=DEFAULT_BUCKET_BYTES):
        super().__init__(bucket_bytes=bucket_bytes)

    def get_config(self) -> dict:
        return {"bucket_bytes": self.bucket_bytes}

    def reduce(self, gradients, variables):
        gradients, _ = self.prepare(gradients, variables, keep_sparse=True)
        result = [None] * len(gradients)
        for bucket in self.buckets(gradients):
            if is_sparse(gradients[bucket[0]]):
                # Sparse gradients (embeddings, gathers) stay
                # `tf.IndexedSlices`, as in stock Keras: the strategy
                # all-gathers their rows and indices instead of summing a
                # dense vocabulary-sized tensor, and the optimizer applies
                # them as sparse updates.
                (i,) = bucket
                result[i] = all_reduce(gradients[i])
                continue
            # One dtype per bucket: one collective.
            summed = all_reduce_sum([gradients[i] for i in bucket])
            for i, value in zip(bucket, summed):
                result[i] = value
        return result
