"""The all-reduce hook protocol shared by every gradient compressor."""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class CompressionStats:
    """Bytes one replica put on the wire for its gradients in the last step.

    Attributes:
        raw_bytes: Int. Size of the gradients as plain all-reduce sends them.
        sent_bytes: Int. Size of what the hook actually sent.
    """

    raw_bytes: int
    sent_bytes: int

    @property
    def ratio(self) -> float:
        """Compression ratio `raw_bytes / sent_bytes` (1.0 when nothing sent)."""
        return self.raw_bytes / self.sent_bytes if self.sent_bytes else 1.0


def tensor_bytes(tensor) -> int:
    """Returns the size in bytes of `tensor` (a tensor or variable)."""
    return int(tensor.shape.num_elements()) * tf.as_dtype(tensor.dtype).size


class AllReduceHook:
    """Base class of gradient all-reduce hooks: subclass it to write your own.

    A hook decides how the gradients of every replica are combined into the
    summed gradient that the optimizer applies. keras_dist calls it once per
    optimizer update, inside the replica context (like the body of
    `strategy.run`), with this replica's gradients; it must return the
    **sum** over all replicas of those gradients, in the same order, shapes
    and dtypes. The loss is already scaled by `1 / num_replicas_in_sync`, so
    the sum is the gradient of the global-batch mean loss.

    Inside `reduce`, use `tf.distribute.get_replica_context()` for the
    collectives (`all_reduce`, `all_gather`). Every replica must issue the
    same collectives in the same order, or the job deadlocks.

    The call order is the design of PyTorch DDP communication hooks
    (`torch.distributed.algorithms.ddp_comm_hooks`), adapted to
    `tf.distribute`:

    1. `build(variables)` once, under the strategy scope, before the first
       step: create any state (for example error-feedback residuals) here.
    2. `reduce(gradients, variables)` every update step, per replica.
    3. `stats()` any time after a step: bytes sent in the last step.

    Example:

    ```python
    class HalfPrecision(keras_dist.compression.AllReduceHook):
        def reduce(self, gradients, variables):
            ctx = tf.distribute.get_replica_context()
            half = [tf.cast(g, "float16") for g in gradients]
            summed = ctx.all_reduce("sum", half)
            return [tf.cast(s, g.dtype) for s, g in zip(summed, gradients)]

    model = keras_dist.DistributedModel(inputs, outputs,
                                        all_reduce_hook=HalfPrecision())
    ```
    """

    def __init__(self):
        self._built = False
        self._raw_bytes = 0
        self._sent_bytes = 0

    @property
    def built(self) -> bool:
        """Whether `build` has run."""
        return self._built

    def build(self, variables) -> None:
        """Creates the hook's state for `variables` (trainable variables).

        Called once, in cross-replica context under the strategy scope.
        Subclasses that keep state override it and call `super().build`.

        Args:
            variables: List of the trainable variables, in gradient order.
        """
        self._raw_bytes = sum(tensor_bytes(v) for v in variables)
        self._sent_bytes = self._raw_bytes
        self._built = True

    def reduce(self, gradients, variables):
        """Returns the sum over replicas of `gradients`.

        Args:
            gradients: List of this replica's gradient tensors (no `None`).
            variables: List of the matching trainable variables.

        Returns:
            List of summed gradients, one per input, same shapes and dtypes.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement `reduce(gradients, variables)`."
        )

    def stats(self) -> CompressionStats:
        """Returns the byte accounting of the last reduction.

        The default counts every gradient at its own dtype for both numbers
        (no compression). Hooks that compress override it.
        """
        return CompressionStats(raw_bytes=self._raw_bytes, sent_bytes=self._sent_bytes)

    def get_config(self) -> dict:
        """Returns the constructor arguments of the hook."""
        return {}

    @classmethod
    def from_config(cls, config: dict):
        """Creates a hook from `get_config`'s output."""
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


@keras.saving.register_keras_serializable(package="keras_dist")
class NoCompression(AllReduceHook):
    """Plain sum all-reduce, the default hook.

    The gradients go through one `all_reduce("sum")` per dtype at their own
    precision: exactly what stock Keras does, but owned by keras_dist so it
    happens once, before clipping.

    Example:

    ```python
    model = keras_dist.DistributedModel(
        inputs, outputs, all_reduce_hook=keras_dist.compression.NoCompression()
    )
    ```
    """

    def reduce(self, gradients, variables):
        return all_reduce_sum(gradients)


def all_reduce_sum(tensors):
    """Sums `tensors` over replicas with one collective per dtype.

    TensorFlow cannot all-reduce a list of mixed dtypes in one call, so the
    tensors are grouped by dtype and the results put back in input order.
    Must be called in replica context.

    Args:
        tensors: List of tensors (`tf.IndexedSlices` are densified).

    Returns:
        List of summed tensors in the input order.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError(
            "all_reduce_sum must be called in a replica context (inside "
            "`strategy.run`), not in cross-replica context."
        )
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if ctx.num_replicas_in_sync == 1:
        return tensors
    groups: dict[tf.DType, list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype, []).append(index)
    result = [None] * len(tensors)
    for indices in groups.values():
        summed = ctx.all_reduce(
            tf.distribute.ReduceOp.SUM, [tensors[i] for i in indices]
        )
        for i, value in zip(indices, summed):
            result[i] = value
    return result
