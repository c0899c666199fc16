"""`BackupAndRestore`: back up the whole training state; resume exactly."""

from __future__ import annotations

import logging
import os
import signal
import threading
import weakref

import keras
import tensorflow as tf

from keras_dist import state
from keras_dist._compat import keras_src as _compat
from keras_dist._validation import check_bool, check_int
from keras_dist._versions import VERSION
from keras_dist.backup import elastic, files, store, transfer
from keras_dist.backup import lock as lock_lib
from keras_dist.backup import manifest as manifest_lib
from keras_dist.backup import resume as resume_lib
from keras_dist.backup.writer import BackgroundWriter
from keras_dist.core import collectives, topology
from keras_dist.launcher import attempts
from keras_dist.launcher.process import EXIT_PREEMPTED
from keras_dist.optimizers import check_one_accumulator

logger = logging.getLogger(__name__)


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the whole training state; after a failure, `fit` resumes exactly.

    Pass it to `fit` with the same `backup_dir` on every run of the job (on
    every worker). When `fit` starts and `backup_dir` holds a backup, the
    training state is restored from it and `fit` goes on at the epoch *and
    step* where the backup was written: the batches the interrupted run had
    already consumed in that epoch are skipped, so with a deterministic
    input pipeline the resumed run sees the same batches and ends with the
    same weights as a run that was never interrupted.

    What a backup holds: the model's variables, the optimizer's (slots,
    `iterations`, and a `GradientAccumulationOptimizer`'s accumulated
    gradients and pending micro-steps), the all-reduce hook's state (error
    feedback, PowerSGD factors, TopK residuals), `AutoScaleBatch`'s state
    (effective batch, learning-rate scaling, noise-scale averages), the
    metrics' running sums, the epoch, the step and the input position.
    State that each replica keeps for itself is saved per replica (gathered
    from every worker with one all-gather), and each replica gets its own
    copy back.

    Under several workers only the chief (worker 0 when there is no chief)
    writes `backup_dir`; the other workers write nothing. Every worker reads
    the backup when `fit` starts, so `backup_dir` must be on storage that
    every worker can read: an object store (`gs://bucket/run1`, any URL
    TensorFlow's `tf.io.gfile` knows), a shared file system, a volume
    mounted on every pod. The workers check that they all found the same
    backup. The chief takes `backup_dir` for its job when `fit` starts (a
    `LOCK` file naming it): a second job on the same folder stops with
    `BackupInUseError` instead of deleting the first one's backups.

    A backup is written beside the previous one and becomes current only
    when complete (on a local disk an atomic rename; on an object store the
    backup under its own prefix, then the pointer to it), and is trusted
    only when its checksums match, so a process killed during a save leaves
    the previous backup usable; an unusable newest backup falls back to the
    previous one with a warning. A backup this run cannot continue exactly
    (another model, optimizer or hook, another `steps_per_execution`,
    another batch size in the middle of an epoch, an `accumulation_steps`
    that cannot carry the pending cycle) is a `ValueError` saying which; so
    is a directory that holds backups of which none is usable: `fit` never
    starts over silently. A changed `accumulation_steps` that can carry the
    cycle is used, with one warning line
    (`manifest.accumulation_steps_on_resume`).

    Elastic resume: a backup written by another number of workers or
    replicas goes on with this run's (`keras_dist.backup.elastic`). Every
    piece of state follows its rule in the training-state inventory, the
    input skips the samples the interrupted run had consumed (in this run's
    batches: NumPy arrays or a batched `tf.data.Dataset`, with a
    `DistributedModel`), and the global batch per update is held by setting
    `accumulation_steps` (where it cannot be, the learning rate follows by
    `AutoScaleBatch`'s rule or linearly); one warning line says what
    changed. What cannot be continued exactly is refused, named.

    Writing in the background (`async_write=True`): the state is gathered
    on the step (a consistent snapshot) and written on a thread while
    training goes on, so a save blocks the step only for the gather, as
    Orbax's `AsyncCheckpointer` and PyTorch's `async_save` do. One write runs
    at a time (the next save waits for it before gathering: at most one
    extra copy of the state in memory); a failed write raises in `fit` at
    the next batch; `fit` waits for the last write before it returns, and a
    preempted worker before it exits. A process killed during a background
    write leaves the previous backup current, as during any write.

    Preemption: `SIGTERM` to any worker while `fit` runs makes every worker
    write a backup at the next step boundary (the workers agree on it with a
    one-number all-reduce per step) and exit with status 75
    (`keras_dist.callbacks.EXIT_PREEMPTED`), which `keras-dist launch
    --max-restarts` restarts; the resumed run loses at most the step in
    flight.

    Which input pipelines resume exactly:

    - data read whole every epoch (no `steps_per_epoch`): a `tf.data`
      pipeline without shuffling or with `shuffle(..., seed=...,
      reshuffle_each_iteration=False)`, or NumPy arrays with `shuffle=False`;
    - one endless stream with `steps_per_epoch`: `dataset.shuffle(n,
      seed=...).repeat()` reshuffles every epoch and still resumes exactly
      (the resumed run re-reads the stream from its start and skips what was
      consumed), with a `DistributedModel`. Its `fit` tells this callback
      where the input stands; a plain `keras.Model` tells no callback, so
      with one the resumed run counts the batches of the epoch only, and a
      stream that carries over epochs restarts from its beginning. A plain
      `keras.Model` without a strategy scope builds its metrics in the
      first step, after the restore: wrap it with
      `DistributedModel.from_model` to resume it.

    Pipelines that are random in a way a new process cannot replay (NumPy
    arrays with `fit(shuffle=True)`, an unseeded `shuffle`, a seeded one
    with `reshuffle_each_iteration=True` read anew every epoch) resume at
    the right step and state, but the rest of that epoch sees other batches
    than the interrupted run would have.

    Order: list this callback first in `callbacks` when training a plain
    `keras.Model` (`DistributedModel.fit` puts it first itself), so that the
    state is restored before other callbacks read it. For the batches that
    are skipped, callbacks still get `on_train_batch_begin` and
    `on_train_batch_end`, with the logs of the backup.

    Args:
        backup_dir: String or path. Where the backups are written: a local
            folder, or a URL such as `"gs://bucket/run1"`. The folder is
            created if needed.
        save_freq: `"epoch"` or int >= 1. `"epoch"` writes a backup at the
            end of every epoch; an int, after every that many batches.
            Defaults to `"epoch"`.
        delete_checkpoint: Bool. Whether to delete the backups when `fit`
            ends normally. Defaults to `True`.
        async_write: Bool. Whether to write each backup on a background
            thread (see "Writing in the background"). Defaults to `False`.

    Raises:
        TypeError: `backup_dir` is not a string or path, `save_freq` not an
            int, or `delete_checkpoint` or `async_write` not a bool.
        ValueError: `backup_dir` is empty, or `save_freq` is neither
            `"epoch"` nor >= 1. In `fit`: a backup this run cannot continue
            exactly (see above).
        keras_dist.backup.lock.BackupInUseError: In `fit`: another job's
            process holds `backup_dir`.
        OSError: In `fit`: a save failed (nothing of it is left behind; a
            full disk names `backup_dir` and the room a backup needs).

    Example:

    ```python
    import keras
    import numpy as np
    import keras_dist

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras_dist.DistributedModel.from_model(
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    )
    model.compile(optimizer="sgd", loss="mse")
    backup = keras_dist.callbacks.BackupAndRestore("/tmp/kd_backup", save_freq=2)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, callbacks=[backup])
    ```
    """

    restores_training_state = True
    """`DistributedModel.fit` runs such a callback first (see "Order")."""

    parameter_server_refusal = (
        "its resume point is a synchronous step, and parameter-server steps "
        "are asynchronous. A worker that fails is retried by the coordinator "
        "without it; to survive a failed chief, save with "
        "`keras.callbacks.ModelCheckpoint` or `tf.train.Checkpoint` from the "
        "chief and load at start."
    )
    """Why `fit` under parameter servers refuses this callback."""

    def __init__(
        self, backup_dir, save_freq="epoch", delete_checkpoint=True, async_write=False
    ):
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)):
            raise TypeError(
                "`backup_dir` must be a string or a path. Received: "
                f"backup_dir={backup_dir!r} of type {type(backup_dir).__name__}."
            )
        backup_dir = os.fspath(backup_dir)
        if not backup_dir:
            raise ValueError(
                "`backup_dir` must name a folder. Received: backup_dir=''. Pass "
                "the folder where the backups go, e.g. '/shared/run1/backup'."
            )
        self.backup_dir = backup_dir
        if save_freq != "epoch":
            save_freq = check_int(
                "save_freq", save_freq, minimum=1, hint='Or pass save_freq="epoch".'
            )
        self.save_freq = save_freq
        self.delete_checkpoint = check_bool("delete_checkpoint", delete_checkpoint)
        self.async_write = check_bool("async_write", async_write)
        self._writer = BackgroundWriter()
        self._resume: resume_lib.Resume | None = None
        self._epoch_iterator = None
        self._strategy = None
        self._epoch = 0
        self._batch_begin = 0
        self._batches_since_save = 0
        self._preempted = False
        self._previous_sigterm = None
        self._in_fit = False
        self._train_function = None
        self._pending = None
        self._owner = None
        self._configured_steps = None
        self._batches_in_epoch = 0
        self._full_batch = None
        self._input = None
        self._resize = None

    # --- fit hooks -------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._finish_previous_write()
        model = self.model
        self._strategy = model.distribute_strategy
        self._fit = state.session(model)
        # The input iterator `DistributedModel.fit` created; a plain
        # `keras.Model` hands none to callbacks (see "Which input pipelines
        # resume exactly" above).
        self._epoch_iterator = self._fit.epoch_iterator
        # What `fit` reads and its global batch, for the global data position.
        self._input = None
        self._resize = None
        self._in_fit = True
        self._epoch = 0
        self._batches_since_save = 0
        self._preempted = False
        self._resume = None
        self._train_function = None
        self._pending = None
        self._batches_in_epoch = 0
        self._full_batch = None
        accumulator = resume_lib.accumulator_of(model)
        # What this run asks for, before a backup overwrites the variable.
        self._configured_steps = (
            None if accumulator is None else int(accumulator.accumulation_steps)
        )
        # The writer takes the folder before reading it: a second job stops
        # here, before it trains or deletes anything.
        try:
            self._owner = (
                lock_lib.acquire(self.backup_dir) if self._is_chief() else None
            )
        except OSError as error:
            self._raise_if_unreachable(error)
            raise
        try:
            self._begin_resume(model)
        except OSError as error:
            if self._owner is not None:
                lock_lib.release(self.backup_dir, self._owner)
                self._owner = None
            self._raise_if_unreachable(error)
            raise
        except BaseException:
            if self._owner is not None:
                lock_lib.release(self.backup_dir, self._owner)
                self._owner = None
            raise
        self._install_sigterm_handler()

    def _raise_if_unreachable(self, error: OSError) -> None:
        """An object store's error, as one that names `backup_dir` and what
        to check (credentials, the bucket), instead of a raw libcurl line."""
        if not files.is_local(self.backup_dir):
            raise store.BackupError(
                files.unreachable(self.backup_dir, "backup_dir", error)
            ) from error

    def _finish_previous_write(self):
        """Waits for a write a failed `fit` left running; warns if it failed.

        The new `fit` reads the newest complete backup after it: the write
        either completed (and is read) or left the previous one current.
        """
        try:
            self._writer.wait()
        except Exception as error:
            logger.warning(
                "BackupAndRestore: the background write of the previous fit "
                "failed (%s: %s); resuming from the newest complete backup.",
                type(error).__name__,
                error,
            )

    def _begin_resume(self, model):
        """Reads the newest backup, if any, and sets `fit` up to resume from it."""
        found = store.read_latest(self.backup_dir)
        if found is not None:
            path, manifest, values = found
            if manifest["steps_per_execution"] != model.steps_per_execution:
                raise store.BackupError(
                    f"The backup in {path} was written with steps_per_execution="
                    f"{manifest['steps_per_execution']}; this model has "
                    f"steps_per_execution={model.steps_per_execution}. Compile "
                    "with the same value to resume."
                )
            if elastic.is_resize(manifest, self._strategy):
                if getattr(model, "optimizer", None) is not None:
                    check_one_accumulator(
                        model.optimizer,
                        "An elastic resume (a backup of another number of replicas)",
                    )
                self._resize = elastic.plan(
                    manifest,
                    self._strategy,
                    self._fit_input(),
                    self._spx,
                    path,
                    shuffles_batches=self._epoch_iterator is not None
                    and _compat.epoch_iterator_shuffles_batches(self._epoch_iterator),
                )
                # The position and calls in this run's batches; the saved
                # per-worker batch size does not apply to this layout.
                manifest = dict(
                    manifest,
                    epoch=self._resize.epoch,
                    position=self._resize.position,
                    calls=self._resize.calls,
                    batch_size=None,
                )
            self._resume = resume_lib.Resume(
                path=path, manifest=manifest, values=values
            )
            _compat.set_initial_epoch(model, self._resume.epoch)
            self._fit.replay_epoch = self._resume.epoch
            self._fit.replay_batches = self._resume.calls * self._spx
            # What the backup holds must exist before the first step.
            if self._epoch_iterator is not None:
                _compat.build_from_epoch_iterator(model, self._epoch_iterator)
        else:
            _compat.set_initial_epoch(model, None)
            self._fit.replay_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._batches_in_epoch = 0

    def on_train_batch_begin(self, batch, logs=None):
        self._writer.raise_if_failed()
        self._flush()
        self._batch_begin = batch
        resume = self._resume
        if resume is not None and not resume.restored:
            # Restored here, after every callback's `on_train_begin` (state
            # they create, such as AutoScaleBatch's gradient statistics, is
            # in the backup too) and after `fit` reset the metrics.
            self._restore(resume)

    def on_train_batch_end(self, batch, logs=None):
        self._batches_in_epoch = batch + 1
        if self._fit.is_replayed(batch):
            return
        if batch < self._spx:
            # The epoch's first call: its batches are full ones (a short
            # batch ends an epoch), unless the epoch is shorter than a call.
            steps = (self.params or {}).get("steps")
            self._full_batch = (
                resume_lib.batch_size(self.model, self._batches_in_epoch)
                if steps is None or steps >= self._spx
                else None
            )
        self._batches_since_save += max(1, batch - self._batch_begin + 1)
        calls = batch // self._spx + 1
        if self._agree_on_preemption():
            self._request_save(self._epoch, calls, logs, preempted=batch)
        elif self.save_freq != "epoch" and self._batches_since_save >= self.save_freq:
            self._request_save(self._epoch, calls, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._flush()
        self._fit.replay_epoch = None
        if self._train_function is not None:
            # A backup written at the end of the epoch: every call of it was
            # replayed; the next epoch trains with the real function.
            self.model.train_function = self._train_function
            self._train_function = None
        if self.save_freq == "epoch":
            # Written now, before the next epoch starts. The metrics' sums
            # of this epoch are not restored into the next (see `_restore`),
            # and AutoScaleBatch realigns with the optimizer on restore.
            self._request_save(epoch + 1, 0, logs)
            self._flush()

    def on_train_end(self, logs=None):
        try:
            if self._pending is not None and (
                self._pending["preempted"] is not None or not self.delete_checkpoint
            ):
                self._flush()
            self._pending = None
            self._writer.wait()
        finally:
            self._end_fit()
            owner, self._owner = self._owner, None
            if owner is not None:
                self._end_ownership(owner)

    def _end_ownership(self, owner):
        if self.delete_checkpoint:
            store.remove_all(self.backup_dir, owner=owner)
        else:
            lock_lib.release(self.backup_dir, owner)
            files.remove_empty_folder(self.backup_dir)

    # --- Saving and restoring --------------------------------------------------------

    @property
    def _spx(self) -> int:
        return int(self.model.steps_per_execution)

    def _fit_input(self):
        """What `fit` reads and its global batch (read once per `fit`), or
        `None` for a plain `keras.Model` (no input iterator handed over)."""
        if self._input is None and self._epoch_iterator is not None:
            self._input = _compat.epoch_iterator_input(self._epoch_iterator)
        return self._input

    def _is_chief(self) -> bool:
        return bool(self._strategy.extended.should_checkpoint)

    def _request_save(self, epoch, calls, logs, preempted=None):
        """Notes a backup of the state after this batch (or epoch).

        It is written at the next callback hook of `fit`, once every other
        callback has seen this batch: their state (AutoScaleBatch's
        counters and decisions) must be that of the end of the batch.
        """
        self._batches_since_save = 0
        if self._epoch_iterator is None:
            # A plain `keras.Model`: the batches of this epoch (a fresh input
            # iterator every epoch, as without `steps_per_epoch`).
            position = calls * self._spx
        elif calls == 0 and _compat.next_epoch_starts_fresh(self._epoch_iterator):
            position = 0
        else:
            position = _compat.epoch_iterator_position(self._epoch_iterator)
        steps = (self.params or {}).get("steps")
        self._pending = {
            "epoch": int(epoch),
            "calls": int(calls),
            "position": int(position),
            # The epoch's last batch (maybe a short one), of an input that
            # starts afresh each epoch: on another layout the backup goes on
            # at the next epoch's start (`elastic.plan`).
            "epoch_complete": bool(
                steps is not None
                and calls * self._spx >= steps
                and self._epoch_iterator is not None
                and _compat.next_epoch_starts_fresh(self._epoch_iterator)
            ),
            "batch_size": self._full_batch,
            "logs": _float_logs(logs),
            "preempted": preempted,
        }

    def _flush(self):
        """Writes the backup `_request_save` noted; exits when preempted."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        preempted = pending.pop("preempted")
        self._save(**pending)
        if preempted is not None:
            self._writer.wait()
            logger.warning(
                "BackupAndRestore: preempted (SIGTERM); backup written in epoch "
                "%d, after batch %d. Exiting with status %d for a restart.",
                pending["epoch"] + 1,
                preempted + 1,
                EXIT_PREEMPTED,
            )
            self._restore_sigterm_handler()
            raise SystemExit(EXIT_PREEMPTED)

    def _save(self, epoch, calls, position, epoch_complete, batch_size, logs):
        """Writes a backup (chief) after gathering per-replica state (all)."""
        model = self.model
        # One write at a time: the previous one ends before this gather.
        self._writer.wait()
        inventory = state.training_state(model)
        # Tensors read now (the steps after it do not change them); the
        # NumPy copies are made with the write.
        snapshot = transfer.snapshot_values(inventory, self._strategy)
        if not self._is_chief():
            return
        replicas = self._strategy.num_replicas_in_sync
        manifest = {
            "format": store.FORMAT,
            "version": store.FORMAT_VERSION,
            "keras_dist": VERSION,
            "epoch": int(epoch),
            "calls": int(calls),
            "position": int(position),
            "epoch_complete": epoch_complete,
            "steps_per_execution": self._spx,
            "batch_size": batch_size,
            "global_batch": (self._fit_input() or (None, None))[1],
            "accumulation": resume_lib.accumulation_state(
                model, self._configured_steps
            ),
            "pending_variables": resume_lib.pending_variables(model),
            "replicas": replicas,
            "workers": topology.count_workers(self._strategy),
            "logs": logs,
            "callbacks": inventory.provider_states(),
        }
        if self.async_write:
            logger.info(
                "BackupAndRestore: writing the backup of epoch %d, %d calls into "
                "it, in the background.",
                epoch + 1,
                calls,
            )
            self._writer.submit(self._write, inventory, snapshot, manifest, self._owner)
        else:
            self._write(inventory, snapshot, manifest, self._owner)

    def _write(self, inventory, snapshot, manifest, owner):
        values = transfer.materialize(snapshot)
        manifest = dict(manifest, variables=manifest_lib.describe(inventory, values))
        name = store.write(self.backup_dir, values, manifest, owner=owner)
        attempts.note_backup(
            files.join(self.backup_dir, name),
            manifest["epoch"],
            manifest["calls"] * manifest["steps_per_execution"],
        )
        logger.info(
            "BackupAndRestore: wrote %s (epoch %d, %d calls into it).",
            files.join(self.backup_dir, name),
            manifest["epoch"] + 1,
            manifest["calls"],
        )

    def _restore(self, resume: resume_lib.Resume):
        model = self.model
        _build_training_state(model)
        inventory = state.training_state(model)
        resize = self._resize
        manifest_lib.check_compatible(
            resume.manifest, inventory, self._strategy, resume.path, resize is not None
        )
        resume_lib.check_same_backup_everywhere(self._strategy, resume)
        steps = None if resize else self._accumulation_steps_on_resume(resume)
        # On a resize every per-replica entry follows its rule; otherwise
        # only sharded state saved in another layout is relaid.
        values = elastic.reshard_values(
            inventory,
            resume.manifest,
            resume.values,
            self._strategy.num_replicas_in_sync,
        )
        if resume.calls == 0:
            # Resumed at the start of an epoch: `fit` has just reset the
            # metrics; the backup's sums belong to the epoch before.
            values = [
                None if entry.group == "metrics" else value
                for entry, value in zip(inventory, values)
            ]
        transfer.assign_values(inventory, values, self._strategy)
        if steps is not None:
            resume_lib.accumulator_of(model).accumulation_steps = steps
        if resize is not None:
            elastic.apply(
                model,
                resize,
                resume_lib.accumulator_of(model),
                inventory.providers.get("AutoScaleBatch"),
            )
        resume_lib.restore_provider_states(
            inventory.providers, resume.manifest.get("callbacks", {})
        )
        resume_lib.restore_pending_variables(
            model, resume.manifest.get("pending_variables")
        )
        # The resumed epoch's first batch was read by the interrupted run.
        self._full_batch = resume.manifest.get("batch_size")
        resume.restored = True
        logger.warning(
            "BackupAndRestore: resumed from %s in epoch %d, after %d batches of it.",
            resume.path,
            resume.epoch + 1,
            resume.calls * self._spx,
        )
        if resume.calls or resume.position:
            self._train_function = model.train_function
            model.train_function = resume_lib.replaying_train_function(
                model, model.train_function, resume, self._epoch_iterator, self._spx
            )

    def _accumulation_steps_on_resume(self, resume: resume_lib.Resume):
        """The new `accumulation_steps` when this run asks for another value
        than the backup's run did (`None`: the backup's stands)."""
        saved = resume.manifest.get("accumulation")
        if saved is None or self._configured_steps is None:
            return None
        if saved["configured"] == self._configured_steps:
            # The same setting: the backup's value stands, also when it was
            # changed while training (AutoScaleBatch grows it).
            return None
        return manifest_lib.accumulation_steps_on_resume(
            saved["steps"],
            saved["pending"],
            self._configured_steps,
            resume.path,
            trackers=sorted(resume.manifest.get("callbacks", {})),
        )

    # --- Preemption -------------------------------------------------------------

    def _install_sigterm_handler(self):
        if threading.current_thread() is not threading.main_thread():
            return
        callback = weakref.ref(self)
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            owner = callback()
            if owner is not None and owner._in_fit:
                owner._preempted = True
                return
            # Not training any more: behave as before.
            signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        self._previous_sigterm = (previous,)
        signal.signal(signal.SIGTERM, on_sigterm)

    def _restore_sigterm_handler(self):
        if self._previous_sigterm is not None:
            (previous,) = self._previous_sigterm
            self._previous_sigterm = None
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)

    def _end_fit(self):
        self._in_fit = False
        self._restore_sigterm_handler()
        state.session(self.model).replay_epoch = None
        _compat.set_initial_epoch(self.model, None)

    def _agree_on_preemption(self) -> bool:
        """Whether any worker received SIGTERM (a collective on several workers)."""
        if topology.count_workers(self._strategy) == 1:
            return self._preempted
        flag = 1.0 if self._preempted else 0.0
        value = self._strategy.experimental_distribute_values_from_function(
            lambda context: tf.constant(flag)
        )
        total = collectives.reduce_across(self._strategy, value)
        return float(total) > 0


def _build_training_state(model) -> None:
    """Creates the optimizer's and the hook's variables, if not yet there.

    Without a strategy they appear only in the first trace of the train
    step, after the first batch's `on_train_batch_begin`, where a backup is
    restored. A `DistributedModel` builds its hook too
    (`build_all_reduce_hook`).
    """
    build = getattr(model, "build_all_reduce_hook", None)
    if build is not None:
        build()
        return
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        with model.distribute_strategy.scope():
            optimizer.build(model.trainable_variables)


def _float_logs(logs) -> dict:
    result = {}
    for key, value in (logs or {}).items():
        try:
            result[key] = float(keras.ops.convert_to_numpy(value))
        except (TypeError, ValueError):
            continue
    return result
