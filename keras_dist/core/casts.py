"""Cast compression: sum gradients in 16-bit floating point."""

from __future__ import annotations

import tensorflow as tf

from keras_dist.core.collectives import (
    all_reduce,
    all_reduce_sum,
    branch_across,
    is_sparse,
    replica_context,
)
from keras_dist.core.hook_types import DEFAULT_BUCKET_BYTES, CompressionStats
from keras_dist.core.hooks import AllReduceHook


class _CastCompression(AllReduceHook):
    """Sums floating-point gradients in `wire_dtype`; others at full size.

    Each replica divides its gradient by the number of replicas before the
    cast, so the collective adds up a mean; the result is cast back and
    multiplied by the number of replicas. Where the wire dtype has a
    narrower exponent range than the gradient (float16 for float32 and
    float64, bfloat16 for float64), a sum that is not finite on the wire is
    sent again at the gradient's own precision in the same step (a second
    collective, on those steps only), and counted in `overflow_steps`.

    With one replica nothing crosses a wire: the gradients pass through
    unchanged (no cast, no precision lost) and the ratio is 1.0.

    Sparse gradients (`tf.IndexedSlices`, an `Embedding`'s rows) keep their
    rows: they are all-gathered at their own precision, as `NoCompression`
    does, and counted at full size.
    """

    wire_dtype: tf.DType

    def __init__(self, bucket_bytes=DEFAULT_BUCKET_BYTES):
        super().__init__(bucket_bytes=bucket_bytes)
        # Whether the last traced `reduce` ran with one replica (nothing
        # sent); read by `sent_bytes`, so `stats()` and the logged ratio say
        # 1.0 instead of claiming bytes saved on a wire that is not there.
        self._one_replica = False
        # The variables whose gradients the last traced `reduce` got sparse
        # (sent at full precision).
        self._sparse = frozenset()

    def get_config(self) -> dict:
        return {"bucket_bytes": self.bucket_bytes}

    def build(self, variables) -> None:
        super().build(variables)
        if any(self.range_checked(spec.dtype) for spec in self.variable_specs):
            # Identical on every replica (they see the same sums), so a
            # checkpoint keeps replica 0's copy.
            for name in ("overflow_steps", "overflowed"):
                self.add_state(
                    name, (), tf.int64, aggregation="first", per_variable=False
                )

    def reduce(self, gradients, variables):
        gradients, indices = self.prepare(gradients, variables, keep_sparse=True)
        num_replicas = replica_context().num_replicas_in_sync
        self._one_replica = num_replicas == 1
        self._sparse = frozenset(
            index
            for index, gradient in zip(indices, gradients)
            if isinstance(gradient, tf.IndexedSlices)
        )
        if self._one_replica:
            return list(gradients)
        # Sparse gradients (an Embedding's rows) are all-gathered at their
        # own precision, as `NoCompression` does: the optimizer then
        # applies them as stock Keras would (a densified gradient changes
        # Adam's and Adagrad's update of repeated rows).
        dense = [i for i, g in enumerate(gradients) if not is_sparse(g)]
        result = [None] * len(gradients)
        for i, gradient in enumerate(gradients):
            if is_sparse(gradient):
                result[i] = all_reduce(gradient)
        gradients_dense = [gradients[i] for i in dense]
        payload = []
        for gradient in gradients_dense:
            wire = self.wire_dtype_for(gradient.dtype)
            if wire is None:
                payload.append(gradient)
                continue
            gradient = gradient / tf.cast(num_replicas, gradient.dtype)
            payload.append(tf.cast(gradient, wire))
        summed = all_reduce_sum(payload, self.bucket_bytes)
        reduced = []
        for gradient, value in zip(gradients_dense, summed):
            if self.wire_dtype_for(gradient.dtype) is None:
                reduced.append(value)
                continue
            value = tf.cast(value, gradient.dtype)
            reduced.append(value * tf.cast(num_replicas, gradient.dtype))
        checked = [
            i for i, g in enumerate(gradients_dense) if self.range_checked(g.dtype)
        ]
        if checked:
            reduced = self._resend_if_overflowed(
                gradients_dense, summed, reduced, checked
            )
        for i, value in zip(dense, reduced):
            result[i] = value
        return result

    def _resend_if_overflowed(self, gradients, summed, result, checked):
        """Sums the `checked` gradients again at full size if any wire sum
        is not finite; returns the result and updates the counters."""
        overflowed = tf.logical_not(
            tf.reduce_all(
                [tf.reduce_all(tf.math.is_finite(summed[i])) for i in checked]
            )
        )

        def resend(gradients, result):
            result = list(result)
            full = all_reduce_sum([gradients[i] for i in checked], self.bucket_bytes)
            for i, value in zip(checked, full):
                result[i] = value
            return result

        # Every replica saw the same sums, so replica 0's flag is every
        # replica's.
        result = branch_across(
            overflowed,
            resend,
            lambda _, result: [tf.identity(t) for t in result],
            (gradients, result),
        )
        return self.count_overflow(overflowed, list(result))

    def count_overflow(self, overflowed, values) -> list:
        """Counts a step sent again at full precision; returns `values` after.

        Args:
            overflowed: Boolean scalar tensor, the same on every replica.
            values: List of tensors the counters' updates must precede
                (what the step goes on with).

        Returns:
            `values`, each read after `overflowed` and `overflow_steps` are
            updated (unchanged when the hook keeps no counters: no gradient
            of a dtype that can overflow).
        """
        if "overflow_steps" not in self.state_names:
            return values
        count = tf.cast(overflowed, tf.int64)
        updates = [
            self.state("overflowed").assign(count),
            self.state("overflow_steps").assign_add(count),
        ]
        with tf.control_dependencies(updates):
            return [tf.identity(value) for value in values]

    def wire_dtype_for(self, dtype):
        """The dtype `dtype` travels in, or `None` for no compression."""
        if not dtype.is_floating:
            return None
        # 16-bit gradients already travel at 16 bits; re-casting a bfloat16
        # gradient to float16 (or back) would only lose range or precision.
        return self.wire_dtype if dtype.size > self.wire_dtype.size else dtype

    def range_checked(self, dtype) -> bool:
        """Whether a `dtype` gradient's wire sum can overflow where it cannot."""
        wire = self.wire_dtype_for(dtype)
        return wire is not None and wire != dtype and wire.max < dtype.max / 2

    @property
    def overflow_steps(self) -> int:
        """Steps whose 16-bit sum was not finite and was sent again at full
        size (read eagerly; 0 before `build`)."""
        if "overflow_steps" not in self.state_names:
            return 0
        return int(self.state("overflow_steps").numpy())

    def stats(self) -> CompressionStats:
        """Returns the byte accounting of the last step.

        A step whose 16-bit sum overflowed also counts the full-size bytes
        it sent again.
        """
        stats = super().stats()
        if "overflowed" in self.state_names and self.state("overflowed").numpy():
            return CompressionStats(
                stats.raw_bytes, stats.sent_bytes + self._resent_bytes()
            )
        return stats

    def compression_ratio(self):
        stats = super().stats()
        ratio = tf.constant(stats.ratio, tf.float32)
        if "overflowed" not in self.state_names:
            return ratio
        resent = CompressionStats(
            stats.raw_bytes, stats.sent_bytes + self._resent_bytes()
        )
        return tf.where(
            self.state("overflowed").read_value() > 0,
            tf.constant(resent.ratio, tf.float32),
            ratio,
        )

    def _resent_bytes(self) -> int:
        specs = self.variable_specs
        return sum(
            specs[i].nbytes
            for i in self.reduced_indices
            if self.range_checked(specs[i].dtype)
        )

    def sent_bytes(self, indices) -> int:
        if self._one_replica:
            return sum(self.variable_specs[i].nbytes for i in indices)
        sent = 0
        for index in indices:
            spec = self.variable_specs[index]
            wire = self.wire_dtype_for(spec.dtype)
            sent += (
                spec.nbytes
                if wire is None or index in self._sparse
                else spec.nbytes // spec.dtype.size * wire.size
            )
        return sent


class FP16(_CastCompression):
    """Sums gradients in float16: half the bytes of float32.

    Horovod's `Compression.fp16` for Keras 3. Floating-point gradients wider
    than 16 bits are divided by the number of replicas, cast to float16,
    summed, cast back and multiplied by the number of replicas: the collective
    adds a mean. Integer gradients pass through at full size, and
    float16/bfloat16 gradients are summed at their own precision.

    A float32 gradient beyond float16's range (65504) would become `inf` on
    the wire. When any float16 sum of a step is not finite, those gradients
    are sent again at their own precision in the same step (a second
    collective, on such steps only), so the optimizer gets the exact sum;
    `overflow_steps` (the state `"overflow_steps"`) counts those steps, and
    `stats()` counts the bytes of both sends. Gradients that are themselves
    non-finite stay non-finite (and are counted).

    The relative error per element is about float16's 2**-11 (~5e-4) for
    values in the normal range; values below ~6e-8 times the number of
    replicas flush to zero. Under `keras.mixed_precision` with a
    `LossScaleOptimizer`, the loss scale lifts small gradients out of that
    range, and a gradient that overflows is `inf` already, which the
    loss-scale optimizer detects and skips, as it would without compression.

    With one replica (one device, no cluster) nothing is sent, so the hook
    passes the gradients through unchanged and reports a ratio of 1.0: a
    script that uses it runs the same on a laptop and on a cluster. Sparse
    gradients (an `Embedding`'s rows) are gathered at full precision, as
    `NoCompression` does.

    Use it when the network, not compute, limits the step time (several
    machines on 1-10 Gbit/s Ethernet); on one machine it brought no
    measurable gain in our benchmarks. Prefer `BF16` when gradients span a
    wide range; many overflow steps mean FP16 saves nothing.

    Args:
        bucket_bytes: Int or `None`. Bytes of gradients (before the cast)
            per collective, issued in reverse layer order so communication
            overlaps the backward pass (see
            `keras_dist.compression.plan_buckets`). `None`: one
            collective per dtype. Defaults to 4 MiB.

    Example:

    ```python
    with strategy.scope():
        model = keras_dist.DistributedModel(
            inputs, outputs, all_reduce_hook=keras_dist.compression.FP16()
        )
    ```
    """

    wire_dtype = tf.float16


class BF16(_CastCompression):
    """Sums gradients in bfloat16: half the bytes, float32's range.

    Like `FP16`, but the wire format is bfloat16 (8 exponent bits, 8
    significant bits): it has float32's exponent range, so a float32
    gradient does not overflow it (float64 gradients are checked and sent
    again as `FP16` does). The price is precision: 2**-8 (~4e-3) relative
    per element, 2 to 3 decimal digits, and small entries summed with
    large ones lose their low digits. Gradients are still divided by the
    number of replicas before the cast and multiplied back after the sum.

    TensorFlow's NCCL all-reduce has no bfloat16 kernel: on GPUs, choose a
    cross-device implementation that has one (for example
    `tf.distribute.MirroredStrategy(cross_device_ops=
    tf.distribute.HierarchicalCopyAllReduce())`) or use `FP16`.

    Args:
        bucket_bytes: Int or `None`. Bytes of gradients (before the cast)
            per collective, issued in reverse layer order so communication
            overlaps the backward pass (see
            `keras_dist.compression.plan_buckets`). `None`: one
            collective per dtype. Defaults to 4 MiB.

    Example:

    ```python
    with strategy.scope():
        model = keras_dist.DistributedModel(
            inputs, outputs, all_reduce_hook=keras_dist.compression.BF16()
        )
    ```
    """

    wire_dtype = tf.bfloat16
