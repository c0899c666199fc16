"""The state `AutoScaleBatch` keeps: across `fit` calls on one optimizer
(`Run`) and within one `fit` (`FitState`), and the reads of the
accumulation optimizer's counters that realign it."""

from __future__ import annotations

import dataclasses
import weakref

from keras_dist.core import statistics as _gradient_statistics
from keras_dist.noise_scale import NoiseScaleController, NoiseScaleMeasurement
from keras_dist.optimizers import GradientAccumulationOptimizer
from keras_dist.schedules import ScaledLearningRate


@dataclasses.dataclass
class Run:
    """What must survive across `fit` calls on the same optimizer.

    A second `fit` must not rescale an already scaled learning rate, nor
    warm up again: the base rate, the base batch and the warmup origin are
    kept while the optimizer is the same and nobody else changed its rate.
    """

    optimizer: weakref.ref
    base_learning_rate: float | None
    base_batch_size: int
    origin_updates: int
    origin_micro_steps: int
    last_learning_rate: float | None = None


@dataclasses.dataclass
class FitState:
    """Per-`fit` state of `AutoScaleBatch`, made anew in `on_train_begin`.

    The counters mirror the accumulation optimizer's in Python (reading its
    variables every step would synchronise host and device); they count from
    the run's origin (`Run`) and are realigned with the optimizer once per
    epoch.
    """

    replicas: int
    accumulation_steps: int
    accumulator: GradientAccumulationOptimizer | None
    schedule: ScaledLearningRate | None
    epoch_steps: int | None
    updates: int
    micro_steps: int
    # Micro-steps of the accumulation cycle in progress.
    pending_micro_steps: int
    # `batch` of the last `on_train_batch_begin`: with `steps_per_execution`,
    # one call runs `batch_end - batch_begin + 1` micro-steps.
    batch_begin: int = 0
    # The last learning-rate multiplier set, to skip setting it again.
    multiplier: float | None = None
    measurements: list[NoiseScaleMeasurement] = dataclasses.field(default_factory=list)
    # Adaptive mode only.
    controller: NoiseScaleController | None = None
    statistics: _gradient_statistics.GradientStatistics | None = None
    # The statistics' running sums at the last decision.
    last_totals: tuple[float, float, int] | None = None
    updates_since_decision: int = 0


def read_micro_steps(accumulator, updates):
    """Micro-steps the accumulation optimizer ran (`updates` without one)."""
    if accumulator is not None and accumulator.built:
        return int(accumulator.micro_steps.numpy())
    return updates


def read_pending_micro_steps(accumulator):
    """Micro-steps of the accumulation cycle in progress (0 without one)."""
    if accumulator is not None and accumulator.built:
        return int(accumulator.pending_micro_steps.numpy())
    return 0
