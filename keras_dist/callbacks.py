"""`AutoScaleBatch`: replica-aware batch size and learning rate, adaptive batch growth.

The usual advice for data-parallel training is "global batch = per-device
batch x number of devices, and scale the learning rate with it". No Keras
callback does this, and none changes the batch during `fit` (Keras builds the
input pipeline once per `fit`). `AutoScaleBatch` keeps the per-replica
micro-batch fixed and changes the *effective* batch through
`GradientAccumulationOptimizer.accumulation_steps`, which can change while
`fit` runs without retracing:

    global batch = per_replica_batch_size x num_replicas_in_sync x accumulation_steps

It scales the learning rate with the global batch (linear rule of Goyal et
al., 2017, or square root), warms it up gradually from the unscaled rate, and,
in adaptive mode, grows the batch toward the gradient noise scale measured
during training (McCandlish et al., 2018).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _compat, _gradient_statistics
from keras_dist._fit_data import BatchesFitData
from keras_dist.optimizers import find_accumulator

logger = logging.getLogger(__name__)

LR_SCALINGS = ("linear", "sqrt", None)


# --- Learning-rate schedules ---------------------------------------------------


@keras.saving.register_keras_serializable(package="keras_dist")
class ScaledLearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule times a multiplier that `AutoScaleBatch` sets.

    A Keras `LearningRateSchedule` cannot be assigned a new value while
    training runs, so `AutoScaleBatch` cannot rescale it directly. Wrap the
    schedule in `ScaledLearningRate`: the learning rate at update `t` is then
    `schedule(t) * multiplier`, and the callback sets `multiplier` to the
    batch-size scale factor (with warmup). The schedule keeps its own
    meaning: it is the learning rate of the base batch size, and it advances
    once per optimizer update.

    Args:
        schedule: `keras.optimizers.schedules.LearningRateSchedule`. The
            schedule for the base batch size.

    Example:

    ```python
    schedule = keras_dist.callbacks.ScaledLearningRate(
        keras.optimizers.schedules.CosineDecay(0.1, decay_steps=10_000)
    )
    optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
    callback = keras_dist.callbacks.AutoScaleBatch(
        per_replica_batch_size=32, base_batch_size=256, warmup_epochs=5
    )
    ```
    """

    def __init__(self, schedule):
        if not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            raise TypeError(
                "`schedule` must be a `keras.optimizers.schedules."
                f"LearningRateSchedule`. Received: schedule={schedule!r}. For a "
                "constant learning rate pass a float to the optimizer instead; "
                "AutoScaleBatch rescales it directly."
            )
        self.schedule = schedule
        self.multiplier = tf.Variable(
            1.0,
            trainable=False,
            name="learning_rate_multiplier",
            dtype=tf.float32,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )

    def __call__(self, step):
        value = self.schedule(step)
        return value * tf.cast(self.multiplier, value.dtype)

    def get_config(self):
        return {"schedule": keras.saving.serialize_keras_object(self.schedule)}

    @classmethod
    def from_config(cls, config):
        return cls(keras.saving.deserialize_keras_object(config["schedule"]))


# --- The noise-scale estimator ---------------------------------------------------


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


# --- The callback -------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
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


class AutoScaleBatch(BatchesFitData, keras.callbacks.Callback):
    """Scales the batch with the replicas, the learning rate with the batch,
    and (optionally) grows the batch toward the gradient noise scale.

    **Replica scaling.** The global batch is `per_replica_batch_size x
    num_replicas_in_sync x accumulation_steps` (the last factor when the
    optimizer is a `keras_dist.GradientAccumulationOptimizer`, else 1). With
    `keras_dist.DistributedModel`, `fit` on numpy arrays or on an *unbatched*
    `tf.data.Dataset` batches the data at `per_replica_batch_size x
    num_replicas_in_sync` (shuffling numpy data as `fit(shuffle=...)` asks,
    prefetching, and sharding in-memory data by example across workers);
    leave `fit`'s `batch_size` unset. With a plain `keras.Model`, batch the
    data yourself at that size; the callback says so once.

    **Learning rate.** The optimizer's learning rate is the rate for
    `base_batch_size`. At global batch `B` the callback uses `lr * f(B)` with
    `f(B) = B / base_batch_size` for `lr_scaling="linear"` (Goyal et al.,
    2017), `sqrt(B / base_batch_size)` for `"sqrt"`, and `1` for `None`.
    During warmup (`warmup_steps` optimizer updates, or `warmup_epochs`
    epochs of data) the rate rises linearly from the unscaled rate: the
    update with warmup progress `p` in `[0, 1]` uses
    `lr * (1 + (f(B) - 1) * p)`, where `p = t / warmup_steps` for update `t`
    (counted from 0), or, for `warmup_epochs`, the fraction of
    `warmup_epochs` epochs of micro-batches seen before the update's
    accumulation cycle began. A float learning rate is assigned directly; a
    `LearningRateSchedule` must be wrapped in `ScaledLearningRate`, whose
    multiplier the callback sets (`schedule(t) * multiplier`). The rate is
    set before each update; with `steps_per_execution > 1` it is set once
    per execution.

    **Adaptive mode** (`adaptive=True`, needs a `GradientAccumulationOptimizer`
    and at least 2 replicas). The aggregation path records, after every
    update, the squared norm of each replica's gradient (all-reduced as one
    extra scalar) and of the all-reduced gradient. Every `adapt_every`
    updates the callback turns the window's averages into unbiased estimates
    of `|G|^2` and `tr(Sigma)` (see `estimate_noise`), smooths each with an
    exponential moving average, and takes the simple noise scale
    `B_simple = EMA(tr(Sigma)) / EMA(|G|^2)` (McCandlish et al., 2018). When
    `B_simple` exceeds the global batch, `accumulation_steps` grows toward
    `floor(B_simple / (per_replica_batch_size x num_replicas_in_sync))`, by
    at most a factor `max_growth` per decision and to at most
    `max_batch_size` in total; it never shrinks, and it holds while the
    smoothed `|G|^2` is not positive (no usable estimate yet). The learning rate
    follows the new batch by the rule above (`lr_scaling=None` keeps it, the
    "increase the batch instead of decaying the rate" regime of Smith et al.,
    2018). Every decision uses reduced values only, identical on every
    replica and worker, so all workers agree on the batch and the rate.

    **Logs.** Each epoch's logs (and so `History`, the progress bar and a
    `TensorBoard` callback listed *after* this one) get `batch_size` (the
    global batch), `learning_rate` and, in adaptive mode, `noise_scale`
    (`nan` before the first measurement). `measurements` lists every
    adaptation decision of the last `fit`.

    One instance can serve several `fit` calls: the per-`fit` state is reset
    in `on_train_begin`. On the same optimizer, a later `fit` continues where
    the previous one stopped (the base learning rate, the warmup and the
    grown batch are kept); a new optimizer starts afresh.

    Args:
        per_replica_batch_size: Int >= 1. Examples per replica per micro-step.
        base_batch_size: Int >= 1 or `None`. The global batch size that the
            optimizer's learning rate was tuned for (Goyal et al.: 256 for
            `lr=0.1`). Defaults to `None`: the global batch when training
            starts, so the rate only changes when the batch grows.
        lr_scaling: `"linear"`, `"sqrt"` or `None`. How the learning rate
            follows the global batch. Defaults to `"linear"`.
        warmup_epochs: Number >= 0. Epochs of gradual warmup from the
            unscaled rate. Needs a known number of steps per epoch. Defaults
            to `0` (no warmup).
        warmup_steps: Int >= 0 or `None`. Warmup length in optimizer updates
            instead of epochs. Defaults to `None`.
        adaptive: Bool. Grow the batch toward the measured noise scale.
            Defaults to `False`.
        max_batch_size: Int or `None`. Largest global batch adaptive mode may
            reach; required in adaptive mode (the accumulation costs no
            memory, so this is a choice about training dynamics, not memory).
            Defaults to `None`.
        adapt_every: Int >= 1. Optimizer updates between two adaptation
            decisions. Defaults to `20`.
        ema_decay: Float in `[0, 1)`. Decay of the moving averages of the
            `|G|^2` and `tr(Sigma)` estimates (one step per decision). The
            first decision waits until they cover `1 / (1 - ema_decay)`
            windows. Defaults to `0.9` (10 windows).
        max_growth: Float > 1. Largest factor by which one decision may
            multiply the global batch. The first estimates, from few small
            batches, are noisy; growing step by step lets later, better
            estimates stop the growth. Defaults to `2.0`.
        verbose: Int, 0 or 1. With 1, print each batch-size change. Defaults
            to `0` (changes are logged at INFO level through `logging`).

    Raises:
        ValueError: non-positive sizes, unknown `lr_scaling`, contradictory
            warmup arguments, warmup without `lr_scaling`, `max_batch_size`
            missing in adaptive mode, given outside it or below
            `per_replica_batch_size`, `ema_decay` outside `[0, 1)`,
            `max_growth <= 1`. When `fit` starts: adaptive mode with one
            replica, `max_batch_size` below the starting global batch,
            `warmup_epochs` with an unknown number of steps per epoch.
        TypeError: arguments of the wrong type. When `fit` starts: adaptive
            mode without a `GradientAccumulationOptimizer`, or a
            `LearningRateSchedule` not wrapped in `ScaledLearningRate` while
            `lr_scaling` is set.
        RuntimeError: when `fit` starts, the model is not compiled.

    Example:

    ```python
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        model = keras_dist.DistributedModel(inputs, outputs)
        model.compile(
            optimizer=keras_dist.GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.1, momentum=0.9), accumulation_steps=1
            ),
            loss="sparse_categorical_crossentropy",
        )
    autoscale = keras_dist.callbacks.AutoScaleBatch(
        per_replica_batch_size=32,
        base_batch_size=256,
        lr_scaling="linear",
        warmup_epochs=5,
        adaptive=True,
        max_batch_size=8192,
    )
    history = model.fit(x_train, y_train, epochs=90, callbacks=[autoscale])
    history.history["batch_size"], history.history["noise_scale"]
    ```

    References:
        Goyal et al., 2017. "Accurate, Large Minibatch SGD: Training ImageNet
        in 1 Hour". https://arxiv.org/abs/1706.02677
        McCandlish, Kaplan, Amodei et al., 2018. "An Empirical Model of
        Large-Batch Training". https://arxiv.org/abs/1812.06162
        Smith, Kindermans, Ying, Le, 2018. "Don't Decay the Learning Rate,
        Increase the Batch Size". https://arxiv.org/abs/1711.00489
    """

    def __init__(
        self,
        per_replica_batch_size,
        base_batch_size=None,
        lr_scaling="linear",
        warmup_epochs=0,
        warmup_steps=None,
        adaptive=False,
        max_batch_size=None,
        adapt_every=20,
        ema_decay=0.9,
        max_growth=2.0,
        verbose=0,
    ):
        super().__init__()
        _check_positive_int("per_replica_batch_size", per_replica_batch_size)
        if base_batch_size is not None:
            _check_positive_int("base_batch_size", base_batch_size)
        if lr_scaling not in LR_SCALINGS:
            raise ValueError(
                "`lr_scaling` must be one of 'linear', 'sqrt' or None. "
                f"Received: lr_scaling={lr_scaling!r}. Use 'linear' for SGD "
                "(Goyal et al.), 'sqrt' for adaptive optimizers such as Adam, "
                "None to keep the learning rate."
            )
        if (
            not isinstance(warmup_epochs, numbers.Real)
            or isinstance(warmup_epochs, bool)
            or not warmup_epochs >= 0
            or math.isinf(warmup_epochs)
        ):
            raise ValueError(
                "`warmup_epochs` must be a finite number >= 0. Received: "
                f"warmup_epochs={warmup_epochs!r}."
            )
        if warmup_steps is not None:
            _check_positive_int("warmup_steps", warmup_steps, minimum=0)
            if warmup_epochs:
                raise ValueError(
                    "Pass `warmup_epochs` or `warmup_steps`, not both. Received: "
                    f"warmup_epochs={warmup_epochs!r}, warmup_steps={warmup_steps!r}."
                )
        if lr_scaling is None and (warmup_epochs or warmup_steps):
            raise ValueError(
                "Warmup rises from the unscaled to the scaled learning rate, so "
                "it needs `lr_scaling`. Received: lr_scaling=None with "
                f"warmup_epochs={warmup_epochs!r}, warmup_steps={warmup_steps!r}. "
                "Set lr_scaling='linear' or 'sqrt', or drop the warmup."
            )
        if not isinstance(adaptive, bool):
            raise TypeError(
                f"`adaptive` must be a bool. Received: adaptive={adaptive!r}."
            )
        if max_batch_size is not None:
            _check_positive_int("max_batch_size", max_batch_size)
            if not adaptive:
                raise ValueError(
                    "`max_batch_size` bounds the growth of adaptive mode. "
                    f"Received: max_batch_size={max_batch_size!r} with "
                    "adaptive=False. Pass adaptive=True, or drop max_batch_size."
                )
            if max_batch_size < per_replica_batch_size:
                raise ValueError(
                    "`max_batch_size` (a global batch) must be >= "
                    f"`per_replica_batch_size`. Received: max_batch_size="
                    f"{max_batch_size!r}, per_replica_batch_size="
                    f"{per_replica_batch_size!r}."
                )
        elif adaptive:
            raise ValueError(
                "Adaptive mode needs `max_batch_size`, the largest global batch "
                "it may grow to. Received: max_batch_size=None with "
                "adaptive=True. Pass e.g. max_batch_size=8192."
            )
        _check_positive_int("adapt_every", adapt_every)
        if (
            not isinstance(ema_decay, numbers.Real)
            or isinstance(ema_decay, bool)
            or not 0 <= ema_decay < 1
        ):
            raise ValueError(
                "`ema_decay` must be a number in [0, 1). Received: "
                f"ema_decay={ema_decay!r}. 0 uses each window alone; 0.9 "
                "averages over about 10 windows."
            )
        if (
            not isinstance(max_growth, numbers.Real)
            or isinstance(max_growth, bool)
            or not 1 < max_growth < math.inf
        ):
            raise ValueError(
                "`max_growth` must be a finite number > 1. Received: "
                f"max_growth={max_growth!r}. 2 lets one decision at most double "
                "the batch."
            )
        if verbose not in (0, 1):
            raise ValueError(
                f"`verbose` must be 0 or 1. Received: verbose={verbose!r}."
            )
        self.per_replica_batch_size = per_replica_batch_size
        self.base_batch_size = base_batch_size
        self.lr_scaling = lr_scaling
        self.warmup_epochs = warmup_epochs
        self.warmup_steps = warmup_steps
        self.adaptive = adaptive
        self.max_batch_size = max_batch_size
        self.adapt_every = adapt_every
        self.ema_decay = float(ema_decay)
        self.max_growth = float(max_growth)
        self.verbose = verbose
        self.measurements: list[NoiseScaleMeasurement] = []
        self._run: _Run | None = None
        self._told_how_to_batch = False
        # Set by `data_batched_by_model` just before `fit`, read when it starts.
        self._fit_data = None
        self._replicas = None
        self._steps = None

    # --- Public state -------------------------------------------------------

    @property
    def batch_size(self):
        """Global batch size of the current (or last) `fit`; `None` before."""
        if self._replicas is None:
            return None
        return self.per_replica_batch_size * self._replicas * self._steps

    @property
    def noise_scale(self):
        """Latest smoothed `B_simple` estimate (`nan` before the first one)."""
        return getattr(self, "_noise_scale", math.nan)

    def data_batched_by_model(self, description: str) -> None:
        """Called by `DistributedModel.fit` after it batched the data.

        Args:
            description: String. What was batched (`"arrays"`,
                `"unbatched dataset"`); logged when training starts.
        """
        self._fit_data = description

    # --- Training hooks -------------------------------------------------------

    def on_train_begin(self, logs=None):
        # What `prepare_fit_arguments` did for this `fit` (None: nothing).
        fit_data, self._fit_data = self._fit_data, None
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            raise RuntimeError(
                "AutoScaleBatch needs a compiled model: call `model.compile("
                "optimizer=...)` before `fit`."
            )
        strategy = model.distribute_strategy
        replicas = strategy.num_replicas_in_sync
        accumulator = find_accumulator(optimizer)
        if self.adaptive and accumulator is None:
            raise TypeError(
                "Adaptive mode grows the batch through `accumulation_steps`, so "
                "the optimizer must be a `keras_dist.GradientAccumulationOptimizer`. "
                f"Received: optimizer={type(optimizer).__name__}. Compile with "
                "`keras_dist.GradientAccumulationOptimizer(optimizer, "
                "accumulation_steps=1)`."
            )
        if self.adaptive and replicas < 2:
            raise ValueError(
                "Adaptive mode estimates the gradient noise from the difference "
                "between per-replica and all-reduced gradients, so it needs at "
                f"least 2 replicas. Received: num_replicas_in_sync={replicas}. "
                "Train under a strategy with 2 or more replicas (on one machine "
                "without GPUs: `keras_dist.auto_strategy(cpu_replicas=2)`)."
            )
        steps = accumulator.accumulation_steps if accumulator is not None else 1
        global_batch = self.per_replica_batch_size * replicas * steps
        if self.max_batch_size is not None and self.max_batch_size < global_batch:
            raise ValueError(
                "`max_batch_size` must be >= the starting global batch, "
                f"per_replica_batch_size x replicas x accumulation_steps = "
                f"{self.per_replica_batch_size} x {replicas} x {steps} = "
                f"{global_batch}. Received: max_batch_size={self.max_batch_size}. "
                "Raise max_batch_size or lower per_replica_batch_size."
            )
        epoch_steps = self.params.get("steps") if self.params else None
        if self.warmup_epochs and not epoch_steps:
            raise ValueError(
                "`warmup_epochs` needs the number of steps per epoch, which this "
                f"`fit` does not know. Received: warmup_epochs={self.warmup_epochs!r}. "
                "Pass `steps_per_epoch` to `fit`, or use `warmup_steps`."
            )
        self._schedule = _find_scaled_schedule(optimizer)
        float_rate = self._schedule is None and _has_float_learning_rate(optimizer)
        if self._schedule is None and not float_rate and self.lr_scaling is not None:
            raise TypeError(
                "AutoScaleBatch cannot rescale this optimizer's learning rate, "
                "a `LearningRateSchedule`. Wrap the schedule: "
                "`keras.optimizers.SGD(keras_dist.callbacks.ScaledLearningRate("
                "schedule))`, or pass lr_scaling=None."
            )

        self._replicas = replicas
        self._steps = steps
        self._accumulator = accumulator
        self._epoch_steps = epoch_steps
        updates = int(optimizer.iterations.numpy())
        micro_steps = _micro_steps(accumulator, updates)
        self._start_run(optimizer, float_rate, global_batch, updates, micro_steps)
        self._updates = updates - self._run.origin_updates
        self._micro_steps = micro_steps - self._run.origin_micro_steps
        self._pending = (
            int(accumulator.pending_micro_steps.numpy())
            if accumulator is not None and accumulator.built
            else 0
        )
        self._multiplier = None
        self._batch_begin = 0
        self._noise_scale = math.nan
        self._ema = [0.0, 0.0]
        self._windows = 0
        self._since_decision = 0
        self.measurements = []
        if self.adaptive:
            self._statistics = _gradient_statistics.gradient_statistics(optimizer)
            if self._statistics is None:
                with strategy.scope():
                    self._statistics = _gradient_statistics.GradientStatistics()
                _gradient_statistics.attach_statistics(optimizer, self._statistics)
                # `fit` made its train function before this hook; make it again
                # so that its first trace includes the statistics.
                model.make_train_function(force=True)
            self._last_read = self._statistics.read()
        self._tell_how_to_batch(fit_data)
        logger.info(
            "AutoScaleBatch: global batch %d = %d per replica x %d replicas x %d "
            "accumulation steps; base batch %d, lr_scaling=%r.",
            global_batch,
            self.per_replica_batch_size,
            replicas,
            steps,
            self._run.base_batch_size,
            self.lr_scaling,
        )

    def on_train_batch_begin(self, batch, logs=None):
        self._batch_begin = batch
        # Set the rate for the first update this call may complete.
        if self._steps - self._pending <= self.model.steps_per_execution:
            self._apply_multiplier(
                self._multiplier_for(self._updates, self._micro_steps - self._pending)
            )

    def on_train_batch_end(self, batch, logs=None):
        # Mirror the accumulation optimizer's counters in Python: reading its
        # variables every step would synchronise host and device.
        micro = max(1, batch - self._batch_begin + 1)
        total = self._pending + micro
        new_updates = total // self._steps
        self._pending = total % self._steps
        self._updates += new_updates
        self._micro_steps += micro
        if self.adaptive:
            self._since_decision += new_updates
            if self._since_decision >= self.adapt_every:
                self._since_decision = 0
                self._adapt()

    def on_epoch_end(self, epoch, logs=None):
        self._resync()
        if logs is None:
            return
        logs["batch_size"] = self.batch_size
        logs["learning_rate"] = float(
            keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)
        )
        if self.adaptive:
            logs["noise_scale"] = float(self._noise_scale)

    # --- Learning rate -----------------------------------------------------------

    def _start_run(self, optimizer, float_rate, global_batch, updates, micro_steps):
        rate = (
            float(keras.ops.convert_to_numpy(optimizer.learning_rate))
            if float_rate
            else None
        )
        run = self._run
        if (
            run is not None
            and run.optimizer() is optimizer
            and (
                run.last_learning_rate is None
                or rate is None
                or math.isclose(rate, run.last_learning_rate, rel_tol=1e-6)
            )
        ):
            return
        self._run = _Run(
            optimizer=weakref.ref(optimizer),
            base_learning_rate=rate,
            base_batch_size=self.base_batch_size or global_batch,
            origin_updates=updates,
            origin_micro_steps=micro_steps,
        )

    def _scale_factor(self):
        ratio = self.batch_size / self._run.base_batch_size
        if self.lr_scaling == "linear":
            return ratio
        if self.lr_scaling == "sqrt":
            return math.sqrt(ratio)
        return 1.0

    def _warmup_progress(self, update, cycle_start_micro_step):
        if self.warmup_steps:
            return min(1.0, update / self.warmup_steps)
        if self.warmup_epochs:
            warmup_micro_steps = self.warmup_epochs * self._epoch_steps
            return min(1.0, cycle_start_micro_step / warmup_micro_steps)
        return 1.0

    def _multiplier_for(self, update, cycle_start_micro_step):
        progress = self._warmup_progress(update, cycle_start_micro_step)
        return 1.0 + (self._scale_factor() - 1.0) * progress

    def _apply_multiplier(self, multiplier):
        if multiplier == self._multiplier:
            return
        self._multiplier = multiplier
        if self._schedule is not None:
            self._schedule.multiplier.assign(multiplier)
        elif self._run.base_learning_rate is not None:
            rate = self._run.base_learning_rate * multiplier
            self.model.optimizer.learning_rate = rate
            # What the float32 variable holds, to recognise it in a later fit.
            self._run.last_learning_rate = float(np.float32(rate))

    # --- Adaptive batch ------------------------------------------------------------

    def _adapt(self):
        totals = self._statistics.read()
        local, reduced, count = (
            now - before for now, before in zip(totals, self._last_read)
        )
        self._last_read = totals
        if count <= 0:
            return
        gradient_sq_norm, trace = estimate_noise(
            local / count,
            reduced / count,
            self._replicas,
            self.per_replica_batch_size * self._steps,
        )
        # Averages start at 0: their ratio equals that of the bias-corrected
        # averages (Adam's correction divides both alike), so the first,
        # noisiest window does not dominate.
        decay = self.ema_decay
        self._ema[0] = decay * self._ema[0] + (1 - decay) * gradient_sq_norm
        self._ema[1] = decay * self._ema[1] + (1 - decay) * trace
        self._windows += 1
        self._noise_scale = (
            self._ema[1] / self._ema[0] if self._ema[0] > 0 else math.inf
        )
        warm = self._windows >= 1 / (1 - decay) - 1e-9
        steps = self._target_steps(self._noise_scale) if warm else self._steps
        if steps > self._steps:
            previous = self.batch_size
            self._steps = steps
            self._accumulator.accumulation_steps = steps
            message = (
                f"AutoScaleBatch: noise scale {self._noise_scale:.1f} -> global "
                f"batch {previous} -> {self.batch_size} (accumulation_steps={steps}) "
                f"after {self._updates} updates."
            )
            logger.info(message)
            if self.verbose:
                print(message)
        self.measurements.append(
            NoiseScaleMeasurement(
                update=self._updates,
                samples=self._micro_steps
                * self.per_replica_batch_size
                * self._replicas,
                gradient_sq_norm=gradient_sq_norm,
                trace_covariance=trace,
                noise_scale=self._noise_scale,
                batch_size=self.batch_size,
            )
        )

    def _target_steps(self, noise_scale):
        if not math.isfinite(noise_scale):
            # The smoothed |G|^2 is not positive: the estimate is still all
            # noise. Wait for more measurements rather than jump.
            return self._steps
        unit = self.per_replica_batch_size * self._replicas
        most = min(
            self.max_batch_size // unit, math.floor(self._steps * self.max_growth)
        )
        return max(self._steps, min(most, math.floor(noise_scale / unit)))

    def _resync(self):
        # Once per epoch, realign the Python mirror with the optimizer (a
        # last, shorter `steps_per_execution` call can overcount).
        optimizer = self.model.optimizer
        updates = int(optimizer.iterations.numpy())
        self._updates = updates - self._run.origin_updates
        self._micro_steps = (
            _micro_steps(self._accumulator, updates) - self._run.origin_micro_steps
        )
        if self._accumulator is not None and self._accumulator.built:
            self._pending = int(self._accumulator.pending_micro_steps.numpy())

    # --- Data ------------------------------------------------------------------

    def _tell_how_to_batch(self, fit_data):
        fit_batch = self.per_replica_batch_size * self._replicas
        if fit_data is not None:
            logger.info(
                "AutoScaleBatch: DistributedModel batched the %s at %d.",
                fit_data,
                fit_batch,
            )
            return
        if self._told_how_to_batch:
            return
        self._told_how_to_batch = True
        logger.warning(
            "AutoScaleBatch assumes every training step gets %d examples "
            "(per_replica_batch_size x num_replicas_in_sync = %d x %d), but it "
            "cannot see how this model's data is batched. Batch at that size: "
            "`model.fit(x, y, batch_size=%d)` or `dataset.batch(%d)`. "
            "keras_dist.DistributedModel does it for you when `fit` gets numpy "
            "arrays or an unbatched tf.data.Dataset and no `batch_size`.",
            fit_batch,
            self.per_replica_batch_size,
            self._replicas,
            fit_batch,
            fit_batch,
        )


# --- Helpers --------------------------------------------------------------------------


def _check_positive_int(name, value, minimum=1):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(
            f"`{name}` must be an int >= {minimum}. Received: {name}={value!r} "
            f"(type {type(value).__name__})."
        )
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}. Received: {name}={value!r}.")


def _micro_steps(accumulator, updates):
    if accumulator is not None and accumulator.built:
        return int(accumulator.micro_steps.numpy())
    return updates


def _find_scaled_schedule(optimizer):
    # Keras has no public accessor for an optimizer's schedule object (its
    # `learning_rate` returns the schedule's current value), so look for a
    # `ScaledLearningRate` among the attributes of the optimizers, by type.
    for nested in _compat.nested_optimizers(optimizer):
        schedule = _compat.find_attribute_of_type(nested, ScaledLearningRate)
        if schedule is not None:
            return schedule
    return None


def _has_float_learning_rate(optimizer):
    innermost = list(_compat.nested_optimizers(optimizer))[-1]
    return isinstance(innermost.get_config().get("learning_rate"), numbers.Real)
