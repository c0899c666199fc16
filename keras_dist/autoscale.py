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
during training (McCandlish et al., 2018). The noise-scale arithmetic lives in
`keras_dist.noise_scale` (`estimate_noise` and `NoiseScaleMeasurement` are
importable from here too); the callback feeds it and applies its decisions.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref

import keras
import numpy as np

from keras_dist import state as state_lib
from keras_dist._autoscale_state import (
    FitState,
    Run,
    read_micro_steps,
    read_pending_micro_steps,
)
from keras_dist._fit_data import BatchesFitData
from keras_dist._validation import check_bool, check_choice, check_int, check_real
from keras_dist.core import statistics as _gradient_statistics
from keras_dist.noise_scale import (
    NoiseScaleController,
    NoiseScaleMeasurement,
    check_ema_decay,
    check_max_growth,
)
from keras_dist.noise_scale import estimate_noise as estimate_noise
from keras_dist.optimizers import (
    check_one_accumulator,
    find_accumulator,
)
from keras_dist.schedules import (
    find_scaled_schedule,
    has_float_learning_rate,
)

logger = logging.getLogger(__name__)

LR_SCALINGS = ("linear", "sqrt", None)


# --- The callback -------------------------------------------------------------------


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
    of `|G|^2` and `tr(Sigma)` (see `keras_dist.noise_scale`), smooths each
    with an exponential moving average, and takes the simple noise scale
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

    parameter_server_refusal = (
        "it measures the gradient noise scale from the all-reduce, and "
        "parameter-server workers do not all-reduce. Remove it from "
        "`callbacks`, or train with MultiWorkerMirroredStrategy."
    )
    """Why `fit` under parameter servers refuses this callback."""

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
        per_replica_batch_size = check_int(
            "per_replica_batch_size", per_replica_batch_size, minimum=1
        )
        base_batch_size = check_int(
            "base_batch_size", base_batch_size, minimum=1, allow_none=True
        )
        lr_scaling = check_choice(
            "lr_scaling",
            lr_scaling,
            LR_SCALINGS,
            hint="Use 'linear' for SGD (Goyal et al.), 'sqrt' for adaptive "
            "optimizers such as Adam, None to keep the learning rate.",
        )
        warmup_epochs = check_real("warmup_epochs", warmup_epochs, minimum=0)
        warmup_steps = check_int(
            "warmup_steps", warmup_steps, minimum=0, allow_none=True
        )
        if warmup_steps is not None and warmup_epochs:
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
        adaptive = check_bool("adaptive", adaptive)
        max_batch_size = check_int(
            "max_batch_size", max_batch_size, minimum=1, allow_none=True
        )
        if max_batch_size is not None and not adaptive:
            raise ValueError(
                "`max_batch_size` bounds the growth of adaptive mode. "
                f"Received: max_batch_size={max_batch_size!r} with "
                "adaptive=False. Pass adaptive=True, or drop max_batch_size."
            )
        if max_batch_size is None and adaptive:
            raise ValueError(
                "Adaptive mode needs `max_batch_size`, the largest global batch "
                "it may grow to. Received: max_batch_size=None with "
                "adaptive=True. Pass e.g. max_batch_size=8192."
            )
        if max_batch_size is not None and max_batch_size < per_replica_batch_size:
            raise ValueError(
                "`max_batch_size` (a global batch) must be >= "
                f"`per_replica_batch_size`. Received: max_batch_size="
                f"{max_batch_size!r}, per_replica_batch_size="
                f"{per_replica_batch_size!r}."
            )
        self.per_replica_batch_size = per_replica_batch_size
        self.base_batch_size = base_batch_size
        self.lr_scaling = lr_scaling
        self.warmup_epochs = warmup_epochs
        self.warmup_steps = warmup_steps
        self.adaptive = adaptive
        self.max_batch_size = max_batch_size
        self.adapt_every = check_int("adapt_every", adapt_every, minimum=1)
        self.ema_decay = check_ema_decay(ema_decay)
        self.max_growth = check_max_growth(max_growth)
        self.verbose = check_int("verbose", verbose, minimum=0, maximum=1)
        # What survives across `fit` calls on one optimizer.
        self._run: Run | None = None
        # State of the current (or last) `fit`, made in `on_train_begin`.
        self._fit: FitState | None = None
        self._told_how_to_batch = False
        # Set by `data_batched_by_model` just before `fit`, read when it starts.
        self._fit_data = None

    # --- Public state -------------------------------------------------------

    @property
    def batch_size(self):
        """Global batch size of the current (or last) `fit`; `None` before."""
        fit = self._fit
        if fit is None:
            return None
        return self.per_replica_batch_size * fit.replicas * fit.accumulation_steps

    @property
    def noise_scale(self):
        """Latest smoothed `B_simple` estimate (`nan` before the first one)."""
        if self._fit is None or self._fit.controller is None:
            return math.nan
        return self._fit.controller.noise_scale

    @property
    def measurements(self) -> list[NoiseScaleMeasurement]:
        """Every adaptation decision of the current (or last) `fit`."""
        return [] if self._fit is None else self._fit.measurements

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
        check_one_accumulator(optimizer, "AutoScaleBatch")
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
        schedule = find_scaled_schedule(optimizer)
        float_rate = schedule is None and has_float_learning_rate(optimizer)
        if schedule is None and not float_rate and self.lr_scaling is not None:
            raise TypeError(
                "AutoScaleBatch cannot rescale this optimizer's learning rate, "
                "a `LearningRateSchedule`. Wrap the schedule: "
                "`keras.optimizers.SGD(keras_dist.callbacks.ScaledLearningRate("
                "schedule))`, or pass lr_scaling=None."
            )

        updates = int(optimizer.iterations.numpy())
        micro_steps = read_micro_steps(accumulator, updates)
        self._start_run(optimizer, float_rate, global_batch, updates, micro_steps)
        fit = FitState(
            replicas=replicas,
            accumulation_steps=steps,
            accumulator=accumulator,
            schedule=schedule,
            epoch_steps=epoch_steps,
            updates=updates - self._run.origin_updates,
            micro_steps=micro_steps - self._run.origin_micro_steps,
            pending_micro_steps=read_pending_micro_steps(accumulator),
        )
        if self.adaptive:
            fit.controller = NoiseScaleController(
                num_replicas=replicas,
                per_replica_batch_size=self.per_replica_batch_size,
                max_batch_size=self.max_batch_size,
                ema_decay=self.ema_decay,
                max_growth=self.max_growth,
            )
            fit.statistics = _gradient_statistics.gradient_statistics(optimizer)
            if fit.statistics is None:
                with strategy.scope():
                    fit.statistics = _gradient_statistics.GradientStatistics()
                _gradient_statistics.attach_statistics(optimizer, fit.statistics)
                # `fit` made its train function before this hook; make it again
                # so that its first trace includes the statistics.
                model.make_train_function(force=True)
            fit.last_totals = fit.statistics.read()
        self._fit = fit
        state_lib.register_backup_state(model, "AutoScaleBatch", self)
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
        if state_lib.session(self.model).is_replayed(batch):
            # Trained before a restart (BackupAndRestore): counted already.
            return
        fit = self._fit
        fit.batch_begin = batch
        # Set the rate for the first update this call may complete.
        if (
            fit.accumulation_steps - fit.pending_micro_steps
            <= self.model.steps_per_execution
        ):
            self._apply_multiplier(
                self._multiplier_for(
                    fit.updates, fit.micro_steps - fit.pending_micro_steps
                )
            )

    def on_train_batch_end(self, batch, logs=None):
        if state_lib.session(self.model).is_replayed(batch):
            return
        fit = self._fit
        micro = max(1, batch - fit.batch_begin + 1)
        total = fit.pending_micro_steps + micro
        new_updates = total // fit.accumulation_steps
        fit.pending_micro_steps = total % fit.accumulation_steps
        fit.updates += new_updates
        fit.micro_steps += micro
        if self.adaptive:
            fit.updates_since_decision += new_updates
            if fit.updates_since_decision >= self.adapt_every:
                fit.updates_since_decision = 0
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
            logs["noise_scale"] = float(self.noise_scale)

    # --- BackupAndRestore ---------------------------------------------------------

    def backup_state(self) -> dict:
        """This callback's state in this `fit`, for `BackupAndRestore` (JSON)."""
        fit, run = self._fit, self._run
        state = {
            "run": {
                "base_learning_rate": run.base_learning_rate,
                "base_batch_size": run.base_batch_size,
                "origin_updates": run.origin_updates,
                "origin_micro_steps": run.origin_micro_steps,
                "last_learning_rate": run.last_learning_rate,
            },
            "fit": {
                "accumulation_steps": fit.accumulation_steps,
                "updates": fit.updates,
                "micro_steps": fit.micro_steps,
                "pending_micro_steps": fit.pending_micro_steps,
                "multiplier": fit.multiplier,
                "updates_since_decision": fit.updates_since_decision,
                "last_totals": list(fit.last_totals) if fit.last_totals else None,
                "measurements": [dataclasses.asdict(m) for m in fit.measurements],
            },
        }
        if fit.controller is not None:
            state["controller"] = {
                "ema_gradient_sq_norm": fit.controller.ema_gradient_sq_norm,
                "ema_trace_covariance": fit.controller.ema_trace_covariance,
                "windows": fit.controller.windows,
            }
        return state

    def restore_backup_state(self, state: dict) -> None:
        """Puts back what `backup_state` returned (the variables, such as
        `accumulation_steps`, come back with the model's)."""
        fit, run = self._fit, self._run
        for key, value in state["run"].items():
            setattr(run, key, value)
        saved = dict(state["fit"])
        saved["last_totals"] = (
            tuple(saved["last_totals"]) if saved["last_totals"] else None
        )
        saved["measurements"] = [
            NoiseScaleMeasurement(**m) for m in saved["measurements"]
        ]
        multiplier = saved.pop("multiplier")
        for key, value in saved.items():
            setattr(fit, key, value)
        if fit.accumulator is not None and fit.accumulator.built:
            # An elastic resume may have set another (keras_dist.backup.elastic).
            fit.accumulation_steps = int(fit.accumulator.accumulation_steps)
        if "controller" in state and fit.controller is not None:
            for key, value in state["controller"].items():
                setattr(fit.controller, key, value)
        fit.multiplier = None
        if multiplier is not None:
            self._apply_multiplier(multiplier)
        # What this callback's `on_epoch_end` does after a backup written at
        # the end of an epoch: realign the counters with the optimizer.
        self._resync()

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
        self._run = Run(
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
            warmup_micro_steps = self.warmup_epochs * self._fit.epoch_steps
            return min(1.0, cycle_start_micro_step / warmup_micro_steps)
        return 1.0

    def _multiplier_for(self, update, cycle_start_micro_step):
        progress = self._warmup_progress(update, cycle_start_micro_step)
        return 1.0 + (self._scale_factor() - 1.0) * progress

    def _apply_multiplier(self, multiplier):
        fit = self._fit
        if multiplier == fit.multiplier:
            return
        fit.multiplier = multiplier
        if fit.schedule is not None:
            fit.schedule.multiplier.assign(multiplier)
        elif self._run.base_learning_rate is not None:
            rate = self._run.base_learning_rate * multiplier
            self.model.optimizer.learning_rate = rate
            # What the float32 variable holds, to recognise it in a later fit.
            self._run.last_learning_rate = float(np.float32(rate))

    # --- Adaptive batch ------------------------------------------------------------

    def _adapt(self):
        fit = self._fit
        totals = fit.statistics.read()
        local, reduced, count = (
            now - before for now, before in zip(totals, fit.last_totals)
        )
        fit.last_totals = totals
        estimate = fit.controller.update(
            local, reduced, count, accumulation_steps=fit.accumulation_steps
        )
        if estimate is None:
            return
        steps = fit.controller.target_accumulation_steps(fit.accumulation_steps)
        if steps > fit.accumulation_steps:
            previous = self.batch_size
            fit.accumulation_steps = steps
            fit.accumulator.accumulation_steps = steps
            message = (
                f"AutoScaleBatch: noise scale {estimate.noise_scale:.1f} -> global "
                f"batch {previous} -> {self.batch_size} (accumulation_steps={steps}) "
                f"after {fit.updates} updates."
            )
            logger.info(message)
            if self.verbose:
                print(message)
        fit.measurements.append(
            NoiseScaleMeasurement(
                update=fit.updates,
                samples=fit.micro_steps * self.per_replica_batch_size * fit.replicas,
                gradient_sq_norm=estimate.gradient_sq_norm,
                trace_covariance=estimate.trace_covariance,
                noise_scale=estimate.noise_scale,
                batch_size=self.batch_size,
            )
        )

    def _resync(self):
        # Once per epoch, realign the Python mirror with the optimizer (a
        # last, shorter `steps_per_execution` call can overcount).
        fit = self._fit
        updates = int(self.model.optimizer.iterations.numpy())
        fit.updates = updates - self._run.origin_updates
        fit.micro_steps = (
            read_micro_steps(fit.accumulator, updates) - self._run.origin_micro_steps
        )
        if fit.accumulator is not None and fit.accumulator.built:
            fit.pending_micro_steps = read_pending_micro_steps(fit.accumulator)

    # --- Data ------------------------------------------------------------------

    def _tell_how_to_batch(self, fit_data):
        fit_batch = self.per_replica_batch_size * self._fit.replicas
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
            self._fit.replicas,
            fit_batch,
            fit_batch,
        )
