"""Resuming from a backup: what `fit` replays, and what must match first.

`BackupAndRestore` reads a backup when `fit` starts (`Resume`), restores it
at the first batch and replays the batches the interrupted run had trained
(`replaying_train_function`). Before it skips them it checks that they are
the same batches: the same backup on every worker, the same batch size.
What a save records for these checks (`batch_size`, `accumulation_state`)
is measured here too.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _apply
from keras_dist._compat import keras_src as _compat
from keras_dist.backup import store, transfer
from keras_dist.core import topology
from keras_dist.optimizers import find_accumulator


@dataclasses.dataclass
class Resume:
    """A backup `fit` resumes from: its folder, manifest and values.

    Attributes:
        path: String. The backup's folder.
        manifest: Dict. Its manifest.
        values: List of arrays. Its variable values.
        restored: Bool. Whether the values were assigned (at the first batch).
    """

    path: str
    manifest: dict
    values: list
    restored: bool = False

    @property
    def epoch(self) -> int:
        """The epoch to resume in."""
        return self.manifest["epoch"]

    @property
    def calls(self) -> int:
        """Calls of the train function already done in that epoch (each runs
        `steps_per_execution` batches): `fit` calls the callbacks for them
        again, but the train function only returns the backup's logs."""
        return self.manifest["calls"]

    @property
    def position(self) -> int:
        """Batches the input iterator had handed out when the backup was
        written; a fresh iterator skips as many."""
        return self.manifest["position"]

    @property
    def logs(self) -> dict:
        """The logs of the last step before the backup."""
        return self.manifest["logs"]


def accumulator_of(model):
    """The model's `GradientAccumulationOptimizer` (through wrappers), or `None`."""
    optimizer = getattr(model, "optimizer", None)
    return None if optimizer is None else find_accumulator(optimizer)


def accumulation_state(model, configured) -> dict | None:
    """The accumulation cycle at a save: the value this run was configured
    with, the value in use, and the pending micro-steps (`manifest.
    accumulation_steps_on_resume` decides with them on resume)."""
    accumulator = accumulator_of(model)
    if accumulator is None or not accumulator.built or configured is None:
        return None
    return {
        "configured": int(configured),
        "steps": int(accumulator.accumulation_steps),
        "pending": int(accumulator.pending_micro_steps.numpy()),
    }


def pending_variables(model) -> list | None:
    """The variables an accumulation's pending window applies to (their
    positions in the optimizer's variable list), or `None` (no
    accumulation, or no step traced)."""
    updater = _apply.pending_updater(getattr(model, "optimizer", None))
    return None if updater is None else updater.pending_variables


def restore_pending_variables(model, positions) -> None:
    """Gives a resumed accumulation the variables of its pending window:
    `fit` may close the window at the end of an epoch before this process
    has traced a step (a backup written at an epoch's last batch)."""
    updater = _apply.pending_updater(getattr(model, "optimizer", None))
    if updater is not None and positions is not None:
        updater.restore_pending_variables(positions)


def batch_size(model, batches: int) -> int | None:
    """Examples per step on this worker, from the loss tracker's count.

    Keras's `loss` metric counts the examples of the epoch (its `count`
    variable, summed over this worker's replicas here: no collective).
    Divided by the epoch's batches so far it is the batch size, when every
    one was full: `BackupAndRestore` reads it after the epoch's first call
    (a short batch can only end an epoch; after it, a count such as 16 * 4
    + 6 = 70 over 5 batches would give a batch of 14 that never was).
    `None` when that is not known (no loss tracker).
    """
    tracker = next((m for m in model.metrics if m.name == "loss"), None)
    count = getattr(tracker, "count", None)
    if count is None or batches <= 0:
        return None
    variable = count.value if isinstance(count, keras.Variable) else count
    strategy = model.distribute_strategy
    examples = sum(
        float(component.numpy())
        for component in strategy.experimental_local_results(variable)
    )
    size = examples / batches
    return int(size) if size >= 1 and size == int(size) else None


def restore_provider_states(providers: dict, states: dict) -> None:
    for name, saved in states.items():
        provider = providers.get(name)
        if provider is None:
            raise store.BackupError(
                f"The backup holds the state of {name}, but this fit has no "
                f"{name} callback. Pass the same callbacks to resume exactly."
            )
        provider.restore_backup_state(saved)
    for name in providers:
        if name not in states:
            raise store.BackupError(
                f"This fit has a {name} callback, but the backup holds no state "
                "of one. Pass the same callbacks as the run that wrote it."
            )


def check_same_backup_everywhere(strategy, resume: Resume) -> None:
    """Every worker must resume from the same backup (a shared folder)."""
    if topology.count_workers(strategy) == 1:
        return
    digest = int(resume.manifest["sha256"][:12], 16)
    mine = np.array([digest, resume.epoch, resume.calls], dtype=np.int64)
    _, local = topology.worker_layout(strategy)
    gathered = transfer.gather_per_replica([[mine] * local], strategy)[0]
    if not (gathered == gathered[0]).all():
        raise store.BackupError(
            "The workers found different backups in `backup_dir` (is it on "
            "storage every worker reads? a folder local to each machine is "
            f"not). Per replica (sha256 prefix, epoch, calls): {gathered.tolist()}."
        )


def _check_batch_size(model, batch, resume: Resume) -> None:
    """Refuses to skip batches of another size than the interrupted run's.

    The backup counts the batches the interrupted run had read; skipping as
    many batches of another size would resume at other examples.
    """
    expected = resume.manifest.get("batch_size")
    first = next((t for t in tf.nest.flatten(batch) if t is not None), None)
    if expected is None or first is None:
        return
    sizes = [
        t.shape[0] for t in model.distribute_strategy.experimental_local_results(first)
    ]
    if any(size is None for size in sizes):
        return  # not a dense batch (ragged): nothing to compare
    got = sum(int(size) for size in sizes)
    if got != expected:
        raise store.BackupError(
            f"The backup in {resume.path} was written while training on "
            f"batches of {expected} examples (per step on each worker); this "
            f"run's input gives batches of {got}. Skipping the "
            f"{resume.position} batches the interrupted run had read would "
            "resume at other examples than it stopped at. Resume with the "
            f"same batch size (batch_size={expected} on one worker), or move "
            "the backup directory away to start over."
        )


def replaying_train_function(model, train_function, resume, epoch_iterator, spx):
    """The train function for the resumed epoch's already-trained batches.

    Its first call reads the `resume.position` batches the interrupted run
    had consumed from the input iterator; its first `resume.calls` calls
    return the backup's logs without training; the next one trains and puts
    `train_function` back.
    """
    state = {"skip": resume.position, "call": 0}

    def replay(iterator):
        if state["skip"]:
            try:
                for index in range(state["skip"]):
                    batch = iterator.get_next()
                    if index == 0:
                        _check_batch_size(model, batch, resume)
            except tf.errors.OutOfRangeError as error:
                raise store.BackupError(
                    f"The backup in {resume.path} was written after "
                    f"{resume.position} batches of the input, but the input "
                    "ran out before that: resume with the same data and "
                    "batch size."
                ) from error
            state["skip"] = 0
        call = state["call"]
        state["call"] += 1
        # What Keras's epoch iterator counted at this call in the first run,
        # so that it re-creates its input iterator at the same batch.
        if epoch_iterator is not None:
            _compat.set_epoch_iterator_position(
                epoch_iterator, resume.position + (call + 1 - resume.calls) * spx
            )
        if call < resume.calls:
            return dict(resume.logs)
        model.train_function = train_function
        return train_function(iterator)

    return replay
