"""Deep Gradient Compression (Lin et al., ICLR 2018)."""

from __future__ import annotations

import math
import numbers
import types

import tensorflow as tf

from keras_dist._validation import check_bool, check_int, check_real
from keras_dist.core.collectives import num_elements, replica_context
from keras_dist.core.hook_types import DEFAULT_BUCKET_BYTES, CompressionStats
from keras_dist.core.hooks import AllReduceHook
from keras_dist.core.topk import reduce_sparsified, top_k_indices

_INDEX_BYTES = 4
# The paper's warm-up: densities 25%, 6.25%, 1.5625%, 0.390625% (sparsity 75%,
# 93.75%, 98.4375%, 99.6%), each a quarter of the one before, then `ratio`.
_WARMUP_FIRST_DENSITY = 0.25
_WARMUP_FACTOR = 0.25
# Optimizer attributes that mean "this optimizer keeps a momentum of its own"
# (SGD and RMSprop `momentum`, the Adam family and Lion `beta_1`, Muon).
_MOMENTUM_ATTRIBUTES = ("momentum", "beta_1", "adam_beta_1")
# Optimizer attributes that clip the update it applies (both Keras front ends).
_CLIPPING_ATTRIBUTES = ("clipnorm", "global_clipnorm", "clipvalue")


class DGC(AllReduceHook):
    """Top-k sparsification that keeps momentum SGD's accuracy.

    Implements Deep Gradient Compression (Lin, Han, Mao, Wang and Dally,
    "Deep Gradient Compression: Reducing the Communication Bandwidth for
    Distributed Training", ICLR 2018). Plain top-k with error feedback
    (`TopK`) under a momentum optimizer loses accuracy at high sparsity: the
    optimizer's momentum only ever sees the few entries that were sent, and
    an entry held back for many steps arrives without the momentum it
    would have gathered. DGC moves the momentum into the hook, before the
    sparsification, so each replica runs momentum SGD locally and sends the
    largest entries of its accumulated update:

    1. **Local gradient clipping** (with `clipnorm`): this replica's
       gradient `g` is clipped to global norm `clipnorm / sqrt(N)` over all
       its floating-point tensors, `N` the number of replicas (see below).
    2. **Momentum correction**: the velocity `u = momentum * u + g` and the
       accumulation `v = v + u` (Nesterov: `u = momentum * (u + g)`,
       `v = v + u + g`).
    3. The `k = ceil(density * n)` entries of largest `|v|` of each tensor
       are sent (values and int32 positions, all-gathered as in `TopK`: one
       all-gather per bucket of about `bucket_bytes` of gradients, in
       reverse order of the model's variables), and each replica adds every
       replica's entries into a dense zero tensor: the result is the sum of
       the sparsified accumulations.
    4. **Momentum factor masking**: `u` and `v` are set to zero at the sent
       positions, so a stale velocity does not keep pushing an entry that
       was just applied.

    The optimizer applies the result with plain SGD: **the optimizer must be
    SGD without momentum and without clipping** (`keras.optimizers.SGD(lr)`,
    `tf_keras.optimizers.SGD(lr)`); keras_dist raises a `ValueError` naming
    the fix when training starts otherwise:

    - an optimizer with momentum of its own (`SGD(momentum=0.9)`, `Adam`,
      `RMSprop(momentum>0)`, `Lion`, ...) would apply momentum twice;
    - an adaptive optimizer (`Adagrad`, `Adadelta`, `RMSprop`, `Adafactor`,
      `Ftrl`, ...) would divide each entry by its own history of the
      hook's sums, which are sparse accumulations: an entry held back for
      many steps arrives as one large value, and its step would be scaled
      down by the very size DGC kept for it; the paper's guarantees are for
      momentum SGD, and nothing here was measured with another optimizer;
    - the optimizer's `clipnorm`, `global_clipnorm` or `clipvalue` would
      clip that summed sparse update, cutting entries that masking has
      already cleared from the hook's state (lost, not delayed): clip with
      the hook's `clipnorm` instead (below).

    `DGC(momentum=0.9)` with `SGD(lr)` is the counterpart of
    `SGD(lr, momentum=0.9)` uncompressed.
    With `ratio=1.0` every entry is sent each step and masking clears the
    velocity, so DGC is plain SGD: momentum acts through the entries that
    wait.

    **Sparsity warm-up.** For the first `warmup_steps` optimizer updates the
    density (fraction sent) falls exponentially, as the paper's 4-epoch
    warm-up: 0.25, 0.0625, 0.015625, ... (each a quarter of the one before,
    every density above `ratio`), each for an equal share of
    `warmup_steps`, then `ratio`. `DGC(ratio=0.001, warmup_steps=400)` sends
    25% for steps 0-99, 6.25% for 100-199, 1.5625% for 200-299, 0.39% for
    300-399 and 0.1% from step 400. `warmup_schedule` lists the stages. The
    paper warms up over 4 epochs of 90 or more; set `warmup_steps` to a few
    epochs' optimizer updates (the default, 1000, suits about 4 epochs of
    250 steps). The step counter counts optimizer updates (with
    `GradientAccumulationOptimizer`, one per `accumulation_steps` batches).

    **Clipping threshold.** Each replica's gradient is its share of the
    summed gradient (keras_dist scales the loss by `1 / N`). The paper clips
    each share at `N^-1/2` times the threshold meant for the sum: the sum
    of `N` independent shares of norm `clipnorm / sqrt(N)` has norm about
    `clipnorm`. Keras's own `clipnorm`/`global_clipnorm`/`clipvalue` on the
    optimizer would act on the summed, sparse result, and are refused.

    **Mixed precision.** Under a `LossScaleOptimizer` the gradients reaching
    the hook are multiplied by the loss scale, which changes during
    training; the hook divides them by the current scale before clipping
    and accumulating, so its state is in true gradient units, and multiplies
    what it sends back. A step whose summed result is not finite (a loss
    scale overflow, which the `LossScaleOptimizer` skips) leaves the state
    unchanged.

    **Measured** (digits CNN, 2 replicas, SGD at 0.02, 3 seeds; see
    `docs/benchmarks/dgc.md`): after 10 epochs `DGC(0.001)` reached 0.987
    test accuracy against 0.985 for uncompressed momentum SGD and 0.966 for
    `TopK(0.001)` with momentum; after 4 epochs it was 18 points behind
    (`TopK`: 22). At high sparsity an entry waits hundreds of updates
    between sends, so short runs lag; `DGC(0.01)` was 3 points behind after
    4 epochs. Tested on logical CPU replicas and in 2 worker processes
    (`MultiWorkerMirroredStrategy`, equal to 2 logical replicas); not on
    GPUs. During the warm-up `k` changes with the step, so the all-gather
    takes sizes known only when the step runs (TensorFlow's collective
    all-gather exchanges the sizes first anyway, for `TopK` too).

    Bytes sent per replica and step: `k * (value size + 4)` per tensor, as
    `TopK`; non-float gradients are summed with a plain all-reduce, in their
    bucket's place. With `clipnorm`, the first bucket waits for the whole
    gradient (the clipping norm covers every tensor), so the buckets no
    longer overlap the backward pass.
    `stats()` and the `compression_ratio` log follow the warm-up. State, per
    replica and per floating-point variable `i`: `"velocity_{i}"` (`u`) and
    `"accumulation_{i}"` (`v`), saved as their sum over replicas (split
    evenly on restore, see `AllReduceHook.add_state`), and `"step"`, the
    update counter (identical on every replica).

    Args:
        ratio: Float in (0, 1]. Fraction of each tensor's entries sent after
            the warm-up (the paper's 99.9% sparsity is `0.001`). Defaults to
            `0.001`.
        momentum: Float in [0, 1). The momentum of SGD, applied by the hook.
            Defaults to `0.9`.
        clipnorm: Float > 0 or `None`. Norm threshold for the summed
            gradient; each replica clips its own gradient to
            `clipnorm / sqrt(num_replicas)` before accumulating. `None`: no
            clipping. Defaults to `None`.
        warmup_steps: Int >= 0. Optimizer updates over which the density
            falls from 0.25 to `ratio`; `0` sends `ratio` from the first
            step. Defaults to `1000`.
        nesterov: Bool. Nesterov momentum (`u = momentum * (u + g)`,
            `v = v + u + g`). Defaults to `False`.
        bucket_bytes: Int or `None`. Bytes of gradients (before the
            sparsification) per all-gather, issued in reverse layer order so
            communication overlaps the backward pass (see
            `keras_dist.compression.plan_buckets`). `None`: one
            all-gather for all floating-point gradients. Defaults to 4 MiB.

    Example:

    ```python
    with strategy.scope():
        model = keras_dist.DistributedModel(
            inputs,
            outputs,
            all_reduce_hook=keras_dist.compression.DGC(
                ratio=0.001, momentum=0.9, warmup_steps=4 * steps_per_epoch
            ),
        )
        model.compile(optimizer=keras.optimizers.SGD(0.02), loss=loss)
    ```
    """

    # One bucket of every gradient when `bucket_bytes` is None: the payloads
    # of all dtypes share one buffer.
    one_bucket_without_size = True

    def __init__(
        self,
        ratio=0.001,
        momentum=0.9,
        clipnorm=None,
        warmup_steps=1000,
        nesterov=False,
        bucket_bytes=DEFAULT_BUCKET_BYTES,
    ):
        super().__init__(bucket_bytes=bucket_bytes)
        self.ratio = check_real(
            "ratio",
            ratio,
            minimum=0,
            maximum=1,
            low_open=True,
            hint="It is the fraction of each gradient's entries sent after the "
            "warm-up. Try `ratio=0.001` (the paper's 99.9% sparsity).",
        )
        self.momentum = check_real(
            "momentum",
            momentum,
            minimum=0,
            maximum=1,
            high_open=True,
            hint="It is SGD's momentum, applied by the hook. Try `momentum=0.9`.",
        )
        self.clipnorm = check_real(
            "clipnorm",
            clipnorm,
            minimum=0,
            low_open=True,
            allow_none=True,
            hint="It is the norm threshold for the summed gradient; use `None` "
            "for no clipping.",
        )
        self.warmup_steps = check_int(
            "warmup_steps",
            warmup_steps,
            minimum=0,
            hint="It is the number of optimizer updates over which the density "
            "falls from 0.25 to `ratio`. Use `warmup_steps=0` for no warm-up.",
        )
        self.nesterov = check_bool("nesterov", nesterov)
        # Set by `bind_optimizer` while a step is traced; not state, and out
        # of `tf.Module`'s tracking (a checkpoint must not hold the
        # optimizer).
        self._binding = types.SimpleNamespace(loss_scale=None)

    # --- Schedule -------------------------------------------------------------

    @property
    def warmup_schedule(self) -> tuple:
        """The density stages as `(first_step, density)` pairs, in order.

        The last pair is `(warmup_steps, ratio)`: the density from then on.
        Without a warm-up (`warmup_steps=0`, or `ratio >= 0.25`) it is
        `((0, ratio),)`.
        """
        densities = []
        density = _WARMUP_FIRST_DENSITY
        while self.warmup_steps and density > self.ratio:
            densities.append(density)
            density *= _WARMUP_FACTOR
        stages = [
            (self.warmup_steps * j // len(densities), d)
            for j, d in enumerate(densities)
        ]
        stages.append((self.warmup_steps if densities else 0, self.ratio))
        # With fewer steps than stages, stages that would last 0 steps drop.
        return tuple(
            stage
            for stage, following in zip(stages, [*stages[1:], None])
            if following is None or following[0] > stage[0]
        )

    def density_at(self, step) -> float:
        """Returns the fraction of entries sent at 0-based update `step`."""
        density = self.warmup_schedule[0][1]
        for first, stage_density in self.warmup_schedule:
            if step >= first:
                density = stage_density
        return density

    def k_for(self, spec, density=None) -> int:
        """Entries sent for the gradient of variable `spec` at `density`.

        `density` defaults to `ratio` (after the warm-up).
        """
        density = self.ratio if density is None else density
        n = num_elements(spec.shape)
        return min(n, max(1, math.ceil(density * n)))

    # --- State ----------------------------------------------------------------

    def build(self, variables) -> None:
        super().build(variables)
        self.add_state("step", (), tf.int64, aggregation="first", per_variable=False)
        for index, spec in enumerate(self.variable_specs):
            if spec.dtype.is_floating:
                self.add_state(_velocity_name(index), spec.shape, spec.dtype)
                self.add_state(_accumulation_name(index), spec.shape, spec.dtype)

    @property
    def steps(self) -> int:
        """Number of `reduce` calls run so far (read eagerly)."""
        if not self.built:
            return 0
        return int(self.state("step").numpy())

    def bind_optimizer(self, view) -> None:
        """Checks the optimizer that applies this hook's sums.

        keras_dist's aggregation path calls it while tracing a step, before
        `reduce`. It refuses an optimizer that applies momentum of its own,
        is not plain SGD, or clips, and remembers the loss scale, which
        `reduce` divides out of the gradients.

        Args:
            view: `keras_dist.core.optimizer_view.OptimizerView` of the optimizer
                (built by the front end).

        Raises:
            ValueError: the optimizer, or one it wraps, applies momentum or
                clips, or the optimizer that applies the update is not SGD.
        """
        for nested in view.optimizers:
            for attribute in _MOMENTUM_ATTRIBUTES:
                value = getattr(nested, attribute, None)
                if value is None or (
                    isinstance(value, numbers.Real)
                    and not isinstance(value, bool)
                    and value == 0
                ):
                    continue
                raise ValueError(
                    "`optimizer` must not apply momentum with "
                    f"`{type(self).__name__}`, which applies momentum itself "
                    f"(momentum={self.momentum}); the optimizer would apply it "
                    f"a second time. Received: optimizer="
                    f"{type(nested).__name__} with {attribute}={value!r}. Use "
                    f"`{view.sgd}(learning_rate)` (momentum 0) and "
                    f"set the momentum on the hook: "
                    f"`{type(self).__name__}(momentum=...)`."
                )
        applying = view.applying
        if view.sgd_types and not isinstance(applying, view.sgd_types):
            raise ValueError(
                f"`optimizer` must be plain SGD with `{type(self).__name__}`: "
                "the hook's sums are momentum-corrected sparse accumulations, "
                "meant to be added at a fixed learning rate; an adaptive "
                "optimizer would scale each entry by its own history of them "
                "(an entry held back for many steps arrives at once, and its "
                "step would shrink by the size the hook kept for it). "
                f"Received: optimizer={type(applying).__name__}. Use "
                f"`{view.sgd}(learning_rate)` with "
                f"`{type(self).__name__}(momentum=...)`, or another hook "
                "(`FP16()`, `PowerSGD(...)`) with an adaptive optimizer."
            )
        for nested in view.optimizers:
            for attribute in _CLIPPING_ATTRIBUTES:
                value = getattr(nested, attribute, None)
                if value is None:
                    continue
                if attribute == "clipvalue":
                    fix = (
                        f"`{type(self).__name__}` has no element-wise "
                        f"clipping: use `{type(self).__name__}(clipnorm=...)`"
                    )
                else:
                    fix = (
                        "set the threshold on the hook instead: "
                        f"`{type(self).__name__}(clipnorm={value!r})` clips "
                        "each replica's gradient before it is accumulated "
                        "(the paper's local gradient clipping)"
                    )
                raise ValueError(
                    f"`optimizer` must not clip with `{type(self).__name__}`: "
                    f"its `{attribute}` would clip the summed sparse update, "
                    "in which an entry held back for many steps arrives at "
                    "once, and the part it cut would be lost (masking has "
                    "already cleared it from the hook's state). Received: "
                    f"optimizer={type(nested).__name__} with "
                    f"{attribute}={value!r}. Remove it from the optimizer and "
                    f"{fix}."
                )
        self._binding.loss_scale = view.loss_scale

    def _loss_scale(self):
        """The factor the loss was multiplied by, or `None`."""
        loss_scale = self._binding.loss_scale
        return None if loss_scale is None else loss_scale()

    # --- Reduction ------------------------------------------------------------

    def reduce(self, gradients, variables):
        gradients, indices = self.prepare(gradients, variables)
        ctx = replica_context()
        step = self.state("step").assign_add(1) - 1
        stages = self.warmup_schedule
        # The stage is the same on every replica (the step counters agree),
        # so during the warm-up `k` is a tensor, not a branch of the graph:
        # every replica sends the same number of entries, and the
        # all-gather takes shapes known only when the step runs.
        stage = _stage_index(step, stages) if len(stages) > 1 else None
        sparse_positions = [i for i, g in enumerate(gradients) if g.dtype.is_floating]
        scale = self._loss_scale()
        local = [gradients[p] for p in sparse_positions]
        if scale is not None:
            local = [g / tf.cast(scale, g.dtype) for g in local]
        if self.clipnorm is not None and local:
            threshold = self.clipnorm / math.sqrt(ctx.num_replicas_in_sync)
            local = _clip_by_global_norm(local, threshold)
        local = dict(zip(sparse_positions, local))

        updates = []

        def select(position):
            gradient = local[position]
            index = indices[position]
            velocity = self.state(_velocity_name(index))
            accumulation = self.state(_accumulation_name(index))
            u = velocity.read_value()
            v = accumulation.read_value()
            if self.nesterov:
                u = self.momentum * (u + gradient)
                v = v + u + gradient
            else:
                u = self.momentum * u + gradient
                v = v + u
            flat_v = tf.reshape(v, [-1])
            spec = self.variable_specs[index]
            top = self._top_k(tf.abs(flat_v), spec, stage)
            values = tf.gather(flat_v, top)
            if scale is not None:
                values = values * tf.cast(scale, values.dtype)
            # Momentum factor masking: what was sent leaves both u and v.
            zeros = tf.zeros_like(values)
            masked_u = tf.tensor_scatter_nd_update(
                tf.reshape(u, [-1]), top[:, None], zeros
            )
            masked_v = tf.tensor_scatter_nd_update(flat_v, top[:, None], zeros)
            updates.append((velocity, masked_u))
            updates.append((accumulation, masked_v))
            return top, values

        result = reduce_sparsified(gradients, self.buckets(gradients), select)

        if not updates:
            return result
        # The result is the same on every replica, so every replica makes
        # the same choice: a step that is not finite (a loss-scale overflow,
        # skipped by the LossScaleOptimizer) leaves the state as it was.
        finite = tf.reduce_all(
            [tf.reduce_all(tf.math.is_finite(result[p])) for p in sparse_positions]
        )
        # Selects, not `tf.cond`s: when `reduce` runs inside a branch (the
        # update `cond` of GradientAccumulationOptimizer) a cond stays a
        # function call per tensor, which is slow on small tensors.
        assignments = []
        for variable, new in updates:
            new = tf.reshape(new, variable.shape)
            # A non-finite entry that was not sent (`zero_if_not_finite` in
            # `TopK`) must not stay in the state.
            new = tf.where(tf.reduce_all(tf.math.is_finite(new)), new, 0)
            assignments.append(
                variable.assign(tf.where(finite, new, variable.read_value()))
            )
        with tf.control_dependencies(assignments):
            return [tf.identity(r) for r in result]

    def _top_k(self, magnitudes, spec, stage):
        """Indices of the entries to send: `k_for(spec, density)` of them."""
        stages = self.warmup_schedule
        ks = [self.k_for(spec, density) for _, density in stages]
        if stage is None or len(set(ks)) == 1:
            return top_k_indices(magnitudes, ks[-1])
        k = tf.gather(tf.constant(ks, tf.int32), stage)

        def warmup():
            return tf.math.top_k(magnitudes, k=k, sorted=False).indices

        # After the warm-up, `top_k_indices`'s sampled search with a static
        # `k` (much faster on large tensors on CPU).
        return tf.cond(
            stage == len(stages) - 1,
            lambda: top_k_indices(magnitudes, ks[-1]),
            warmup,
        )

    # --- Statistics -----------------------------------------------------------

    def stats(self) -> CompressionStats:
        """Returns the byte accounting of the last step (before any, the first).

        Follows the warm-up: a step at density `d` sends `ceil(d * n)`
        entries of each tensor.
        """
        stats = super().stats()
        density = self.density_at(max(self.steps - 1, 0))
        return CompressionStats(
            stats.raw_bytes, self._sent_bytes_at(self.reduced_indices, density)
        )

    def sent_bytes(self, indices) -> int:
        """Bytes sent after the warm-up (at `ratio`) for the gradients of
        `indices`."""
        return self._sent_bytes_at(indices, self.ratio)

    def _sent_bytes_at(self, indices, density) -> int:
        sent = 0
        for index in indices:
            spec = self.variable_specs[index]
            if spec.dtype.is_floating:
                sent += self.k_for(spec, density) * (spec.dtype.size + _INDEX_BYTES)
            else:
                sent += spec.nbytes
        return sent

    def compression_ratio(self):
        indices = self.reduced_indices
        raw = sum(self.variable_specs[i].nbytes for i in indices)
        stages = self.warmup_schedule
        ratios = [raw / max(self._sent_bytes_at(indices, d), 1) for _, d in stages]
        if len(stages) == 1:
            return tf.constant(ratios[0], tf.float32)
        last_step = tf.maximum(self.state("step").read_value() - 1, 0)
        return tf.gather(
            tf.constant(ratios, tf.float32), _stage_index(last_step, stages)
        )

    def get_config(self) -> dict:
        return {
            "ratio": self.ratio,
            "momentum": self.momentum,
            "clipnorm": self.clipnorm,
            "warmup_steps": self.warmup_steps,
            "nesterov": self.nesterov,
            "bucket_bytes": self.bucket_bytes,
        }


def _velocity_name(index) -> str:
    return f"velocity_{index}"


def _accumulation_name(index) -> str:
    return f"accumulation_{index}"


def _stage_index(step, stages):
    """The index into `stages` of the stage holding `step` (int32 tensor)."""
    firsts = tf.constant([first for first, _ in stages[1:]], tf.int64)
    return tf.reduce_sum(tf.cast(tf.cast(step, tf.int64) >= firsts, tf.int32))


def _clip_by_global_norm(tensors, threshold):
    """Scales `tensors` so that their joint norm is at most `threshold`."""
    norm = tf.sqrt(
        tf.add_n([tf.reduce_sum(tf.square(tf.cast(t, tf.float32))) for t in tensors])
    )
    factor = threshold / tf.maximum(norm, threshold)
    return [t * tf.cast(factor, t.dtype) for t in tensors]
