"""What every all-reduce hook is built from: the dtypes the collectives
sum, the default bucket size, a variable's spec, the bytes a step sent, and
the checks the hooks share (`keras_dist.core.hooks` has the protocol).

Pure TensorFlow.
"""

from __future__ import annotations

import dataclasses
import re

import tensorflow as tf

from keras_dist.core.collectives import num_elements

# Dtypes TensorFlow's collectives can sum on every backend keras_dist supports
# (`all_reduce` rejects int8/uint8 on CPU; bool, complex and strings are not
# gradients). Checked before the first collective, so a bad gradient fails the
# same way on every replica instead of leaving the others waiting.
SUPPORTED_DTYPES = (
    tf.float16,
    tf.bfloat16,
    tf.float32,
    tf.float64,
    tf.int32,
    tf.int64,
)
"""Gradient and variable dtypes the hooks accept: those every collective sums."""

DEFAULT_BUCKET_BYTES = 4 * 2**20
"""The built-in hooks' `bucket_bytes` (4 MiB): see `plan_buckets`.

Chosen by `benchmarks/bench_overlap.py` (docs/benchmarks/overlap.md)."""


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


@dataclasses.dataclass(frozen=True)
class VariableSpec:
    """What a hook knows about one variable it was built for.

    Attributes:
        name: String. The variable's path (Keras) or name (TensorFlow).
        shape: Tuple of ints.
        dtype: `tf.DType`.
    """

    name: str
    shape: tuple
    dtype: tf.DType

    @property
    def nbytes(self) -> int:
        """Size of the variable (and of its gradient) in bytes."""
        return num_elements(self.shape) * self.dtype.size


def check_gradient(position, gradient, spec, rows=False) -> None:
    """Raises ValueError if `gradient` does not fit the variable of `spec`.

    With `rows`, `gradient` holds rows of the variable (the values of a
    `tf.IndexedSlices`): its shape after the first axis must match.
    """
    if gradient.dtype not in SUPPORTED_DTYPES and several_replicas():
        raise ValueError(
            "`gradients` must have one of the dtypes "
            f"{[d.name for d in SUPPORTED_DTYPES]}. Received: "
            f"gradients[{position}] of dtype {gradient.dtype.name!r} for "
            f"variable {spec.name!r}. Cast the gradient before the hook."
        )
    if gradient.dtype != spec.dtype:
        raise ValueError(
            f"`gradients[{position}]` must have the dtype of its variable "
            f"{spec.name!r}, {spec.dtype.name}. Received: dtype "
            f"{gradient.dtype.name}. Cast the gradient to the "
            "variable's dtype."
        )
    shape = gradient.shape[1:] if rows else gradient.shape
    expected = spec.shape[1:] if rows else spec.shape
    if not shape.is_compatible_with(expected):
        raise ValueError(
            f"`gradients[{position}]` must have the shape of its variable "
            f"{spec.name!r}, {spec.shape}. Received: shape "
            f"{tuple(gradient.shape)}{' (rows of a sparse gradient)' if rows else ''}."
        )


def zero_if_not_finite(tensor):
    """Returns `tensor`, or zeros if any entry is NaN or infinite.

    For error-feedback state: one step that overflowed (a loss-scale probe
    under mixed precision) must not poison every later step.
    """
    # A cond, not tf.where: the common branch costs no tensor-sized op.
    return tf.cond(
        tf.reduce_all(tf.math.is_finite(tensor)),
        lambda: tensor,
        lambda: tf.zeros_like(tensor),
    )


def several_replicas() -> bool:
    # With one replica nothing is summed over a wire: any dtype passes (as
    # through the optimizer alone), complex variables included.
    context = tf.distribute.get_replica_context()
    if context is not None:
        return context.num_replicas_in_sync > 1
    return tf.distribute.get_strategy().num_replicas_in_sync > 1


def variable_name(variable) -> str:
    return str(getattr(variable, "path", None) or variable.name)


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", name)
