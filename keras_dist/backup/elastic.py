"""Elastic resume: a backup of N workers (R replicas) goes on with N' (R').

`BackupAndRestore` resumes a backup on another number of replicas in three
parts, all decided here before anything is assigned:

- **State**: every entry of the training-state inventory follows its rule
  (`keras_dist.core.inventory.reshard`): mirrored state as it is,
  per-replica sums (accumulated gradients and examples, error feedback,
  DGC's momentum, metric sums) added up and split in equal shares, warm
  starts (PowerSGD's factors) copied, shards joined and split again. State
  with no rule is refused, named.
- **Data**: the backup counts the samples of the *global* stream (all
  workers' batches of one step are consecutive samples of it: tf.distribute
  splits each global batch over the replicas). The new run skips the same
  number of samples, in batches of its own global batch, so no sample is
  skipped or seen twice. That needs whole batches: a position that is not a
  multiple of the new batch is refused.
- **Optimization**: the global batch of an *update* (step batch x
  `accumulation_steps`) is held: `accumulation_steps` becomes
  `update batch / new step batch` (k' = k * N / N' when the per-replica
  batch is the same). Where that does not divide, the nearest whole number
  of micro-steps is used and the learning rate follows the update batch:
  by `AutoScaleBatch`'s rule when one is in the fit, else linearly (a float
  learning rate; a schedule is refused). Each change is one log line.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import keras

from keras_dist._compat import keras_src as _compat
from keras_dist.backup import manifest as manifest_lib
from keras_dist.backup.store import BackupError
from keras_dist.core import topology
from keras_dist.core.inventory import PER_REPLICA, reshard
from keras_dist.schedules import has_float_learning_rate

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Resize:
    """How a backup written on one layout goes on with this run's.

    Attributes:
        workers: Tuple of ints `(saved, now)`.
        replicas: Tuple of ints `(saved, now)`.
        step_batch: Tuple of ints `(saved, now)`: the global batch of a step.
        update_batch: Tuple of ints `(saved, now)`: the global batch of an
            update (step batch x accumulation steps).
        position: Int. Batches of this run's input to skip.
        calls: Int. Calls of the train function of the resumed epoch that
            the interrupted run had done, in this run's batches.
        accumulation_steps: Int or `None` (no accumulating optimizer).
        pending: Int. Micro-steps of this run the backup's cycle holds.
        epoch: Int. The epoch to resume in: the backup's, or the next one
            when the backup ends its epoch (a short last batch has no
            counterpart in this run's batches).
    """

    workers: tuple
    replicas: tuple
    step_batch: tuple
    update_batch: tuple
    position: int
    calls: int
    accumulation_steps: int | None
    pending: int
    epoch: int

    @property
    def learning_rate_factor(self) -> float:
        """The linear rule's factor for the learning rate (1: unchanged)."""
        return self.update_batch[1] / self.update_batch[0]

    def describe(self) -> str:
        """One line: the layouts and the batches."""
        steps = self.accumulation_steps or 1
        return (
            f"{self.workers[0]} worker(s) / {self.replicas[0]} replica(s) -> "
            f"{self.workers[1]} / {self.replicas[1]}; global batch per step "
            f"{self.step_batch[0]} -> {self.step_batch[1]}, per update "
            f"{self.update_batch[0]} -> {self.update_batch[1]} "
            f"(accumulation_steps={steps})"
        )


def is_resize(manifest: dict, strategy) -> bool:
    """Whether the backup was written on another number of replicas or workers."""
    return manifest["replicas"] != strategy.num_replicas_in_sync or manifest[
        "workers"
    ] != topology.count_workers(strategy)


def plan(
    manifest: dict,
    strategy,
    data: tuple,
    spx: int,
    where: str,
    shuffles_batches: bool = False,
) -> Resize:
    """Decides how the backup goes on with this run, or refuses it.

    Args:
        manifest: Dict. The backup's manifest.
        strategy: This run's strategy.
        data: Tuple `(kind, batch)` of this run's input (see
            `keras_dist._compat.keras_src.epoch_iterator_input`); `None`
            when `fit` hands callbacks no input iterator (a plain
            `keras.Model`).
        spx: Int. `steps_per_execution` (the same as the backup's).
        where: String. The backup, for messages.
        shuffles_batches: Bool. The input shuffles after it batches
            (`.batch(n).shuffle(...)`): its samples come in another order
            in batches of another size. Defaults to `False`.

    Returns:
        A `Resize`.

    Raises:
        BackupError: the backup cannot go on with this run exactly.
    """
    workers = (manifest["workers"], topology.count_workers(strategy))
    replicas = (manifest["replicas"], strategy.num_replicas_in_sync)
    layout = (
        f"The backup in {where} was written by {workers[0]} worker(s) with "
        f"{replicas[0]} replica(s); this run has {workers[1]} with {replicas[1]}"
    )
    saved_batch = manifest.get("global_batch")
    if saved_batch is None:
        raise BackupError(
            f"{layout}, and the backup does not record its global batch (it "
            "was written by a keras_dist before 0.4, or by a fit whose input "
            "has no known batch size). Resume it with the same number of "
            "workers and replicas."
        )
    kind, batch = data if data is not None else ("a plain keras.Model's input", None)
    if batch is None:
        raise BackupError(
            f"{layout}. Going on with another number needs the global batch "
            f"of this run's input, which keras_dist cannot tell for {kind}. "
            "Resume on another number of workers from NumPy arrays, a "
            "batched tf.data.Dataset (`.batch(n)`, last in the pipeline but "
            "for `repeat`/`prefetch`) or a keras.utils.PyDataset, with "
            "keras_dist.DistributedModel (`DistributedModel.from_model(model)`"
            f"); or resume with {workers[0]} worker(s)."
        )
    if shuffles_batches and batch != saved_batch:
        raise BackupError(
            f"{layout}. This run's global batch is {batch} samples where the "
            f"backup's was {saved_batch}, and its tf.data input shuffles after "
            "it batches (`.batch(n).shuffle(...)`): batches of another size "
            "hold other samples, so the run would go on with another order of "
            "them than the interrupted one. Batch last (`.shuffle(..., seed=s)"
            ".batch(n)`) to resume on another number of workers, keep the "
            f"global batch at {saved_batch}, or resume with {workers[0]} "
            "worker(s)."
        )
    accumulation = manifest.get("accumulation")
    saved_steps = accumulation["steps"] if accumulation else 1
    update = saved_batch * saved_steps
    if accumulation is None:
        steps, new_update = None, batch
    else:
        steps = max(1, round(update / batch))
        new_update = batch * steps
    pending = _whole(
        (accumulation["pending"] if accumulation else 0) * saved_batch,
        batch,
        f"{layout}. The backup is in the middle of an update: "
        f"{accumulation and accumulation['pending']} micro-step(s) of "
        f"{saved_batch} samples accumulated",
    )
    if steps is not None and pending >= steps:
        raise BackupError(
            f"{layout}. The backup is in the middle of an update with "
            f"{pending} micro-steps of this run's batch accumulated, as many "
            f"as an update of accumulation_steps={steps} holds. Resume with "
            f"{workers[0]} worker(s), or save at the end of an update "
            "(save_freq a multiple of accumulation_steps)."
        )
    if manifest.get("epoch_complete"):
        # The backup ends its epoch, whose last batch may be short: go on at
        # the next epoch's first batch (an input that starts afresh each
        # epoch), where both layouts agree. The epoch's last update was
        # applied before the backup was written.
        return Resize(
            workers=workers,
            replicas=replicas,
            step_batch=(saved_batch, batch),
            update_batch=(update, new_update),
            position=0,
            calls=0,
            accumulation_steps=steps,
            pending=pending,
            epoch=manifest["epoch"] + 1,
        )
    position = _whole(
        manifest["position"] * saved_batch,
        batch,
        f"{layout}. The input had handed out {manifest['position']} batches of "
        f"{saved_batch} samples",
    )
    trained = _whole(
        manifest["calls"] * spx * saved_batch,
        batch * spx,
        f"{layout}. The resumed epoch had trained {manifest['calls'] * spx} "
        f"batches of {saved_batch} samples",
    )
    return Resize(
        workers=workers,
        replicas=replicas,
        step_batch=(saved_batch, batch),
        update_batch=(update, new_update),
        position=position,
        calls=trained,
        accumulation_steps=steps,
        pending=pending,
        epoch=manifest["epoch"],
    )


def _whole(samples: int, batch: int, what: str) -> int:
    """`samples / batch`, refused with `what` when it is not whole."""
    if samples % batch:
        raise BackupError(
            f"{what}: {samples} samples, not a whole number of this run's "
            f"batches of {batch}. Resuming there would skip or repeat samples. "
            "Resume with the same number of workers, choose batch sizes that "
            "divide each other, or save where the position is a multiple of "
            "both (save_freq a multiple of accumulation_steps, or "
            'save_freq="epoch")'
        )
    return samples // batch


def reshard_values(inventory, manifest: dict, values: list, replicas: int) -> list:
    """The backup's values mapped onto this run's `replicas`, entry by entry.

    Each entry follows its rule (`keras_dist.core.inventory.reshard`). One
    replica without a strategy keeps plain variables where a strategy keeps
    per-replica ones (accumulators, metric sums): a saved per-replica stack
    is merged onto it by the rule the backup recorded, and a plain saved
    value is the one replica's value of a per-replica entry.
    """
    result = []
    for entry, saved, value in zip(inventory, manifest["variables"], values):
        if value is None:
            result.append(None)
        elif saved["per_replica"] and not entry.per_replica:
            # A shard's vector is the whole variable on one replica.
            length = entry.length or math.prod(entry.shape)
            as_saved = dataclasses.replace(
                entry,
                placement=PER_REPLICA,
                rule=saved["rule"],
                length=length if saved["rule"] == "shard" else None,
                segments=saved.get("segments") if saved["rule"] == "shard" else None,
            )
            merged = reshard(as_saved, value, 1)[0]
            result.append(merged.reshape(entry.shape))
        else:
            if entry.per_replica and not saved["per_replica"]:
                value = (
                    value.reshape(-1)[None] if entry.rule == "shard" else value[None]
                )
            segments = manifest_lib.saved_segments(saved, entry)
            result.append(reshard(entry, value, replicas, segments))
    return result


def apply(model, resize: Resize, accumulator, autoscale) -> None:
    """Sets this run's accumulation and learning rate for `resize`.

    Runs after the backup's values were assigned (they hold the backup's
    `accumulation_steps` and pending count).

    Args:
        model: The model.
        resize: The `Resize` of `plan`.
        accumulator: The model's `GradientAccumulationOptimizer`, or `None`.
        autoscale: The fit's `AutoScaleBatch`, or `None`.

    Raises:
        BackupError: the learning rate must follow the update batch but is
            a schedule and no `AutoScaleBatch` scales it.
    """
    if accumulator is not None:
        accumulator.accumulation_steps = resize.accumulation_steps
        accumulator.pending_micro_steps.assign(resize.pending)
    logger.warning("BackupAndRestore: elastic resume: %s.", resize.describe())
    per_replica = per_replica_layers(model)
    if per_replica and resize.replicas[0] != resize.replicas[1]:
        logger.warning(
            "BackupAndRestore: elastic resume from %d to %d replicas with %s: "
            "batch statistics (BatchNormalization) and random masks (Dropout "
            "and other random layers) are drawn per replica, so training "
            "after the resize differs from an uninterrupted run on %d "
            "replica(s) (alike in distribution, not equal).",
            resize.replicas[0],
            resize.replicas[1],
            ", ".join(per_replica),
            resize.replicas[0],
        )
    factor = resize.learning_rate_factor
    if factor == 1:
        return
    if autoscale is not None:
        logger.warning(
            "BackupAndRestore: the update batch cannot be held (%d is not a "
            "multiple of this run's step batch %d); AutoScaleBatch's rule "
            "(lr_scaling=%r) sets the learning rate for %d.",
            resize.update_batch[0],
            resize.step_batch[1],
            autoscale.lr_scaling,
            resize.update_batch[1],
        )
        return
    optimizer = model.optimizer
    if not has_float_learning_rate(optimizer):
        raise BackupError(
            f"Elastic resume: {resize.describe()}. The update batch changes "
            f"(x{factor:.4g}) and the learning rate must follow it, but it is "
            "a schedule. Wrap the schedule in keras_dist.callbacks."
            "ScaledLearningRate and add keras_dist.callbacks.AutoScaleBatch, "
            "or pick worker counts whose step batch divides "
            f"{resize.update_batch[0]}."
        )
    rate = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    optimizer.learning_rate = rate * factor
    logger.warning(
        "BackupAndRestore: the update batch cannot be held (%d is not a "
        "multiple of this run's step batch %d): learning rate %.6g -> %.6g "
        "(linear rule, x%.4g).",
        resize.update_batch[0],
        resize.step_batch[1],
        rate,
        rate * factor,
        factor,
    )


def per_replica_layers(model) -> list:
    """Names of the layers whose training output depends on the replica's
    share of the batch: batch statistics (`BatchNormalization`) and random
    draws (layers with a `seed_generator`: `Dropout`, `GaussianNoise`, ...)."""
    found = []
    for layer in _compat.sublayers(model):
        if isinstance(layer, keras.layers.BatchNormalization) or hasattr(
            layer, "seed_generator"
        ):
            found.append(layer.name)
    return found
