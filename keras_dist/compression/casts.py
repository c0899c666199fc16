"""Cast compression: sum gradients in 16-bit floating point."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_dist.compression.base import AllReduceHook, all_reduce_sum, replica_context


class _CastCompression(AllReduceHook):
    """Sums floating-point gradients in `wire_dtype`; others at full size.

    Each replica divides its gradient by the number of replicas before the
    cast, so the collective adds up a mean, which cannot overflow the 16-bit
    range when every gradient fits; the result is cast back and multiplied
    by the number of replicas.
    """

    wire_dtype: tf.DType

    def reduce(self, gradients, variables):
        gradients, _ = self.prepare(gradients, variables)
        num_replicas = replica_context().num_replicas_in_sync
        payload = []
        for gradient in gradients:
            wire = self._wire_dtype_for(gradient.dtype)
            if wire is None:
                payload.append(gradient)
                continue
            if num_replicas > 1:
                gradient = gradient / tf.cast(num_replicas, gradient.dtype)
            payload.append(tf.cast(gradient, wire))
        summed = all_reduce_sum(payload)
        result = []
        for gradient, value in zip(gradients, summed):
            if self._wire_dtype_for(gradient.dtype) is None:
                result.append(value)
                continue
            value = tf.cast(value, gradient.dtype)
            if num_replicas > 1:
                value = value * tf.cast(num_replicas, gradient.dtype)
            result.append(value)
        return result

    def _wire_dtype_for(self, dtype):
        """The dtype `dtype` travels in, or `None` for no compression."""
        if not dtype.is_floating:
            return None
        # 16-bit gradients already travel at 16 bits; re-casting a bfloat16
        # gradient to float16 (or back) would only lose range or precision.
        return self.wire_dtype if dtype.size > self.wire_dtype.size else dtype

    def sent_bytes(self, indices) -> int:
        sent = 0
        for index in indices:
            spec = self.variable_specs[index]
            wire = self._wire_dtype_for(spec.dtype)
            sent += (
                spec.nbytes
                if wire is None
                else spec.nbytes // spec.dtype.size * wire.size
            )
        return sent


@keras.saving.register_keras_serializable(package="keras_dist")
class FP16(_CastCompression):
    """Sums gradients in float16: half the bytes of float32.

    Horovod's `Compression.fp16` for Keras 3. Floating-point gradients wider
    than 16 bits are divided by the number of replicas, cast to float16,
    summed, cast back and multiplied by the number of replicas: the collective
    adds a mean, so the sum cannot overflow float16 (max 65504) as long as
    each replica's gradient fits. Integer gradients pass through at full
    size, and float16/bfloat16 gradients are summed at their own precision.

    The relative error per element is about float16's 2**-11 (~5e-4) for
    values in the normal range; values below ~6e-8 times the number of
    replicas flush to zero. Under `keras.mixed_precision` with a
    `LossScaleOptimizer`, the loss scale lifts small gradients out of that
    range, and a gradient that overflows becomes `inf`, which the loss-scale
    optimizer detects and skips, as it would without compression.

    Use it when the network, not compute, limits the step time (several
    machines on 1-10 Gbit/s Ethernet); on one machine the casts cost more than
    they save. Prefer `BF16` when gradients span a wide range.

    Example:

    ```python
    with strategy.scope():
        model = keras_dist.DistributedModel(
            inputs, outputs, all_reduce_hook=keras_dist.compression.FP16()
        )
    ```
    """

    wire_dtype = tf.float16


@keras.saving.register_keras_serializable(package="keras_dist")
class BF16(_CastCompression):
    """Sums gradients in bfloat16: half the bytes, float32's range.

    Like `FP16`, but the wire format is bfloat16 (8 exponent bits, 8
    mantissa bits): it cannot overflow or underflow where float32 does not,
    at a coarser relative precision of 2**-8 (~4e-3) per element. Gradients
    are still divided by the number of replicas before the cast and
    multiplied back after the sum.

    TensorFlow's NCCL all-reduce has no bfloat16 kernel: on GPUs, choose a
    cross-device implementation that has one (for example
    `tf.distribute.MirroredStrategy(cross_device_ops=
    tf.distribute.HierarchicalCopyAllReduce())`) or use `FP16`.

    Example:

    ```python
    with strategy.scope():
        model = keras_dist.DistributedModel(
            inputs, outputs, all_reduce_hook=keras_dist.compression.BF16()
        )
    ```
    """

    wire_dtype = tf.bfloat16
