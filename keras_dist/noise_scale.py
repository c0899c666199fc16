"""The gradient noise scale: estimates, moving averages, target batch.

McCandlish et al. (2018) show that the largest useful batch is about the
*simple noise scale* `B_simple = tr(Sigma) / |G|^2`, where `G` is the true
gradient and `Sigma` the per-example gradient covariance. Data-parallel
training measures both for free: each replica's gradient is a small-batch
gradient, the all-reduced one a large-batch gradient, and the difference of
their squared norms separates `|G|^2` from `tr(Sigma)` (`estimate_noise`).

`NoiseScaleController` turns windows of those squared norms into a smoothed
`B_simple` and into the accumulation steps that bring the global batch
toward it; `keras_dist.callbacks.AutoScaleBatch` drives it in adaptive mode,
and `NoiseScaleMeasurement` records each of its decisions. This module is
plain Python arithmetic: it imports neither TensorFlow nor Keras, and works
with norms measured by any framework.

Reference:
    McCandlish, Kaplan, Amodei et al., 2018. "An Empirical Model of
    Large-Batch Training". https://arxiv.org/abs/1812.06162 (appendix A.1).
"""

from __future__ import annotations

import dataclasses
import math

from keras_dist._validation import check_int, check_real

__all__ = [
    "NoiseScaleController",
    "NoiseScaleEstimate",
    "NoiseScaleMeasurement",
    "estimate_noise",
]


def estimate_noise(local_sq_norm, reduced_sq_norm, num_replicas, per_replica_batch):
    """Unbiased estimates of `|G|^2` and `tr(Sigma)` from two gradient norms.

    A gradient averaged over `B` examples has expected squared norm
    `|G|^2 + tr(Sigma) / B`, where `G` is the true gradient and `Sigma` the
    per-example gradient covariance. Measured at two batch sizes, the
    per-replica batch `b` (`local_sq_norm = mean_i |G_i|^2`) and the global
    batch `R * b` (`reduced_sq_norm = |G_reduced|^2`), the two equations give
    (McCandlish et al., 2018, appendix A.1):

        |G|^2     ~ (R * reduced_sq_norm - local_sq_norm) / (R - 1)
        tr(Sigma) ~ R * b * (local_sq_norm - reduced_sq_norm) / (R - 1)

    Both are unbiased; their ratio `tr(Sigma) / |G|^2` is the simple noise
    scale `B_simple`. Average or smooth each term before dividing.

    Args:
        local_sq_norm: Float. Mean over replicas of the squared norm of each
            replica's gradient (of the mean loss over its own examples).
        reduced_sq_norm: Float. Squared norm of the all-reduced gradient.
        num_replicas: Int >= 2. Replicas `R` in the all-reduce.
        per_replica_batch: Int. Examples behind each replica's gradient `b`
            (micro-batch x accumulation steps).

    Returns:
        A tuple `(gradient_sq_norm, trace_covariance)` of floats.

    Raises:
        ValueError: `num_replicas < 2`.
    """
    if num_replicas < 2:
        raise ValueError(
            "`num_replicas` must be >= 2: the estimate compares per-replica and "
            f"all-reduced gradients. Received: num_replicas={num_replicas!r}."
        )
    r = float(num_replicas)
    gradient_sq_norm = (r * reduced_sq_norm - local_sq_norm) / (r - 1.0)
    trace_covariance = r * per_replica_batch * (local_sq_norm - reduced_sq_norm)
    return gradient_sq_norm, trace_covariance / (r - 1.0)


@dataclasses.dataclass(frozen=True)
class NoiseScaleEstimate:
    """What `NoiseScaleController.update` learned from one window.

    Attributes:
        gradient_sq_norm: Float. Estimate of `|G|^2` from this window alone.
        trace_covariance: Float. Estimate of `tr(Sigma)` from this window
            alone.
        noise_scale: Float. `B_simple` after this window: the ratio of the
            smoothed estimates (`inf` while the smoothed `|G|^2` is not
            positive).
    """

    gradient_sq_norm: float
    trace_covariance: float
    noise_scale: float


@dataclasses.dataclass(frozen=True)
class NoiseScaleMeasurement:
    """One adaptation decision of `AutoScaleBatch` in adaptive mode.

    Attributes:
        update: Int. Optimizer updates since the callback started on this
            optimizer.
        samples: Int. Training examples seen since then (all replicas).
        gradient_sq_norm: Float. Estimate of `|G|^2` from this window alone.
        trace_covariance: Float. Estimate of `tr(Sigma)` from this window
            alone.
        noise_scale: Float. `B_simple`: the ratio of the smoothed estimates
            (`inf` while the smoothed `|G|^2` is not positive).
        batch_size: Int. Global batch size after the decision.
    """

    update: int
    samples: int
    gradient_sq_norm: float
    trace_covariance: float
    noise_scale: float
    batch_size: int


@dataclasses.dataclass
class NoiseScaleController:
    """Smooths noise-scale estimates and chooses the batch they call for.

    Feed it, every window of updates, the sums of the two squared gradient
    norms over the window (`update`); it keeps an exponential moving average
    of each unbiased estimate (`estimate_noise`) and their ratio, the simple
    noise scale `B_simple`. `target_accumulation_steps` then says how many
    accumulation steps bring the global batch `per_replica_batch_size x
    num_replicas x steps` toward `B_simple`: at most `max_growth` times the
    current steps per decision, at most `max_batch_size` in total, never
    fewer steps than now, and no change before the averages cover
    `1 / (1 - ema_decay)` windows (the first estimates, from few small
    batches, are noisy, and the ratio of two noisy means is biased upward)
    or while the smoothed `|G|^2` is not positive.

    The constructor arguments are the hyperparameters; the remaining fields
    (`ema_gradient_sq_norm`, `ema_trace_covariance`, `windows`) are the
    state, which starts at zero. Every method is a pure function of both and
    of its arguments, so controllers fed the same reduced values on
    different workers decide alike.

    Args:
        num_replicas: Int >= 2. Replicas in the all-reduce.
        per_replica_batch_size: Int >= 1. Examples per replica per
            micro-step.
        max_batch_size: Int >= 1. Largest global batch to ask for.
        ema_decay: Float in `[0, 1)`. Decay of the moving averages, one step
            per window. Defaults to `0.9` (about 10 windows).
        max_growth: Float > 1. Largest factor by which one decision may
            multiply the accumulation steps. Defaults to `2.0`.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an argument out of range.

    Example:

    ```python
    controller = NoiseScaleController(
        num_replicas=2, per_replica_batch_size=16, max_batch_size=1024
    )
    steps = 1
    for local_sum, reduced_sum, count in sums_per_window:
        controller.update(local_sum, reduced_sum, count, accumulation_steps=steps)
        steps = controller.target_accumulation_steps(steps)
    ```
    """

    num_replicas: int
    per_replica_batch_size: int
    max_batch_size: int
    ema_decay: float = 0.9
    max_growth: float = 2.0
    ema_gradient_sq_norm: float = dataclasses.field(default=0.0, init=False)
    ema_trace_covariance: float = dataclasses.field(default=0.0, init=False)
    windows: int = dataclasses.field(default=0, init=False)

    def __post_init__(self):
        self.num_replicas = check_int(
            "num_replicas",
            self.num_replicas,
            minimum=2,
            hint="The estimate compares per-replica and all-reduced gradients.",
        )
        self.per_replica_batch_size = check_int(
            "per_replica_batch_size", self.per_replica_batch_size, minimum=1
        )
        self.max_batch_size = check_int(
            "max_batch_size", self.max_batch_size, minimum=1
        )
        self.ema_decay = check_ema_decay(self.ema_decay)
        self.max_growth = check_max_growth(self.max_growth)

    @property
    def noise_scale(self) -> float:
        """The smoothed `B_simple`: `nan` before the first window, `inf`
        while the smoothed `|G|^2` is not positive."""
        if self.windows == 0:
            return math.nan
        if self.ema_gradient_sq_norm <= 0:
            return math.inf
        return self.ema_trace_covariance / self.ema_gradient_sq_norm

    @property
    def warm(self) -> bool:
        """Whether the averages cover `1 / (1 - ema_decay)` windows."""
        return self.windows >= 1 / (1 - self.ema_decay) - 1e-9

    def update(
        self, local_sq_norm_sum, reduced_sq_norm_sum, count, accumulation_steps=1
    ) -> NoiseScaleEstimate | None:
        """Adds one window of measurements to the moving averages.

        Args:
            local_sq_norm_sum: Float. Sum over the window's updates of the
                mean over replicas of each replica's squared gradient norm.
            reduced_sq_norm_sum: Float. Sum over the same updates of the
                all-reduced gradient's squared norm.
            count: Int. Updates in the window.
            accumulation_steps: Int >= 1. Micro-steps behind each update in
                this window. Defaults to `1`.

        Returns:
            The window's `NoiseScaleEstimate`, or `None` when `count` is 0
            (nothing measured; the state is unchanged).
        """
        if count <= 0:
            return None
        gradient_sq_norm, trace_covariance = estimate_noise(
            local_sq_norm_sum / count,
            reduced_sq_norm_sum / count,
            self.num_replicas,
            self.per_replica_batch_size * accumulation_steps,
        )
        # The averages start at 0: their ratio equals that of the
        # bias-corrected averages (Adam's correction divides both alike), so
        # the first, noisiest window does not dominate.
        decay = self.ema_decay
        self.ema_gradient_sq_norm = (
            decay * self.ema_gradient_sq_norm + (1 - decay) * gradient_sq_norm
        )
        self.ema_trace_covariance = (
            decay * self.ema_trace_covariance + (1 - decay) * trace_covariance
        )
        self.windows += 1
        return NoiseScaleEstimate(
            gradient_sq_norm=gradient_sq_norm,
            trace_covariance=trace_covariance,
            noise_scale=self.noise_scale,
        )

    def target_accumulation_steps(self, accumulation_steps) -> int:
        """The accumulation steps the smoothed noise scale calls for.

        Args:
            accumulation_steps: Int >= 1. The current steps.

        Returns:
            `floor(B_simple / (per_replica_batch_size x num_replicas))`,
            bounded by `accumulation_steps x max_growth` and by
            `max_batch_size`, and never below `accumulation_steps`; the
            current steps while the averages are not warm or the noise scale
            is not finite.
        """
        noise_scale = self.noise_scale
        if not self.warm or not math.isfinite(noise_scale):
            # The smoothed |G|^2 is not positive, or covers too few windows:
            # the estimate is still mostly noise. Wait rather than jump.
            return accumulation_steps
        unit = self.per_replica_batch_size * self.num_replicas
        most = min(
            self.max_batch_size // unit,
            math.floor(accumulation_steps * self.max_growth),
        )
        return max(accumulation_steps, min(most, math.floor(noise_scale / unit)))


def check_ema_decay(value) -> float:
    """Checks the moving average's decay (shared with `AutoScaleBatch`)."""
    return check_real(
        "ema_decay",
        value,
        minimum=0,
        maximum=1,
        high_open=True,
        hint="0 uses each window alone; 0.9 averages over about 10 windows.",
    )


def check_max_growth(value) -> float:
    """Checks the largest batch growth per decision (shared with
    `AutoScaleBatch`)."""
    return check_real(
        "max_growth",
        value,
        minimum=1,
        low_open=True,
        hint="2 lets one decision at most double the batch.",
    )
