"""`fit`, `evaluate` and `predict` of `DistributedModel`: the plumbing around
Keras's loops (callback order, files written on the chief only, the epoch
iterator the backup reads, a lost peer named), and parameter servers."""

from __future__ import annotations

import functools
import inspect
import os
import re
import shutil
import tempfile

import keras
import tensorflow as tf

from keras_dist import _fit_data, state
from keras_dist._compat import keras_src as _compat
from keras_dist._compat import tf_internal
from keras_dist.core import aggregation, gloo, watchdog
from keras_dist.core.topology import count_workers
from keras_dist.launcher import attempts
from keras_dist.parameter_server import training as _parameter_server
from keras_dist.trainer import inputs


class FitMixin:
    """`fit`/`evaluate`/`predict` and `cluster_coordinator`."""

    @property
    def cluster_coordinator(self) -> tf.distribute.coordinator.ClusterCoordinator:
        """The `ClusterCoordinator` that `fit` uses under parameter servers.

        The one TensorFlow keeps for the model's `ParameterServerStrategy`;
        schedule your own functions with it (`schedule`, `join`,
        `create_per_worker_dataset`).

        Raises:
            RuntimeError: the model was not created under a
                `ParameterServerStrategy` scope.
        """
        strategy = self.distribute_strategy
        if not _parameter_server.is_parameter_server(strategy):
            raise RuntimeError(
                "`cluster_coordinator` exists only under ParameterServerStrategy. "
                f"Received: a model created under {type(strategy).__name__}. "
                "Create and compile the model inside "
                "`ParameterServerStrategy(...).scope()`."
            )
        return _parameter_server.coordinator(strategy)

    def fit(self, *args, **kwargs):
        self._check_strategy()
        if _parameter_server.is_parameter_server(self.distribute_strategy):
            values = _compat.bind_fit_arguments(self, args, kwargs)
            self._keras_dist.fitting = True
            try:
                return _parameter_server.fit(self, **values)
            finally:
                self._keras_dist.fitting = False
        # With an AutoScaleBatch callback, numpy arrays and unbatched datasets
        # are batched at its per_replica_batch_size x num_replicas_in_sync.
        args, kwargs = _fit_data.prepare_fit_arguments(self, args, kwargs)
        values = _compat.bind_fit_arguments(self, args, kwargs)
        _per_epoch_lines_under_the_launcher(values)
        # TensorFlow may write into the numpy arrays a PyDataset yields.
        values["x"] = inputs.own_batches(values.get("x"))
        values["validation_data"] = inputs.own_batches(values.get("validation_data"))
        # BackupAndRestore first; Keras's file-writing callbacks write the
        # shared path on the chief only.
        values["callbacks"], finish = fit_callbacks(self, values.get("callbacks"))
        session = state.session(self)
        session.epoch_iterator = None
        self._keras_dist.fitting = True
        try:
            return super().fit(**values)
        except tf.errors.OpError as error:
            non_finite = aggregation.non_finite_error(error)
            if non_finite is not None:
                # The assert's own text is pages of graph context.
                raise non_finite from None
            if not _lost_a_peer(error):
                raise
            lost = _describe_lost_peer(self.distribute_strategy, error)
            if lost is None:
                raise
            raise RuntimeError(lost) from error
        finally:
            self._keras_dist.fitting = False
            session.epoch_iterator = None
            finish()

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras's `fit` hands its epoch iterator to this method first (the
        # one place a model sees it, keras/src/backend/tensorflow/trainer.py);
        # the backup reads from it where the input stands. Validation's
        # `evaluate` comes here later with its own, which is not recorded.
        session = state.session(self)
        if (
            self._keras_dist.fitting
            and iterator is not None
            and session.epoch_iterator is None
        ):
            session.epoch_iterator = iterator
        super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def evaluate(self, *args, **kwargs):
        self._check_strategy()
        if _parameter_server.is_parameter_server(self.distribute_strategy):
            values = _bind(keras.Model.evaluate, args, kwargs)
            return _parameter_server.evaluate(self, **values)
        values = _bind(keras.Model.evaluate, args, kwargs)
        values["x"] = inputs.own_batches(values.get("x"))
        _per_epoch_lines_under_the_launcher(values)
        settings = self._keras_dist
        evaluating, settings.evaluating = settings.evaluating, True
        try:
            return super().evaluate(**values)
        finally:
            settings.evaluating = evaluating

    def predict(self, *args, **kwargs):
        if _parameter_server.is_parameter_server(self.distribute_strategy):
            values = _bind(keras.Model.predict, args, kwargs)
            return _parameter_server.predict(self, **values)
        values = _bind(keras.Model.predict, args, kwargs)
        values["x"] = inputs.own_batches(values.get("x"))
        return super().predict(**values)


def _per_epoch_lines_under_the_launcher(values) -> None:
    """`verbose="auto"` under `keras-dist launch`: one line per epoch.

    The launcher reads a task's output through a pipe and shows it with the
    task's name in front of every line; a progress bar redrawn with `\r`
    and `\b` would reach it as one line per epoch anyway, erasing the name.
    """
    if values.get("verbose", "auto") == "auto" and attempts.run_dir() is not None:
        values["verbose"] = 2


class _MarkStarted(keras.callbacks.Callback):
    """Tells the launcher that this task trained its first step."""

    def on_train_batch_end(self, batch, logs=None):
        attempts.mark_started()


def fit_callbacks(model, callbacks):
    """Returns the callbacks `DistributedModel.fit` runs, and a cleanup function.

    `BackupAndRestore` goes first, so the state is back before other
    callbacks read it. Under several workers, on every worker but the chief,
    Keras's own `BackupAndRestore` reads the shared backup but then writes
    to a temporary folder, and `ModelCheckpoint` writes to one: otherwise
    every worker writes the same files (h5py fails with `BlockingIOError:
    unable to lock file`, or the files are garbled). The temporary folders
    are removed when `fit` ends.
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks, lambda: None
    callbacks = list(callbacks or [])
    if attempts.run_dir() is not None:
        callbacks.append(_MarkStarted())
    ours = [c for c in callbacks if getattr(c, "restores_training_state", False)]
    if len(ours) > 1:
        raise ValueError(
            "Pass at most one keras_dist BackupAndRestore to `fit`. Received: "
            f"{len(ours)} of them."
        )
    others = [c for c in callbacks if c not in ours]
    cleanups = [callback._end_fit for callback in ours]
    strategy = model.distribute_strategy
    if count_workers(strategy) > 1 and not strategy.extended.should_checkpoint:
        redirected = []
        for callback in others:
            redirected.append(callback)
            if isinstance(callback, keras.callbacks.BackupAndRestore):
                folder = tempfile.mkdtemp(prefix="keras_dist_backup_")
                follower = _RedirectAfterRestore(callback, folder)
                redirected.append(follower)
                cleanups.append(follower.undo)
            elif isinstance(callback, keras.callbacks.ModelCheckpoint):
                folder = tempfile.mkdtemp(prefix="keras_dist_checkpoint_")
                previous = callback.filepath
                callback.filepath = os.path.join(folder, os.path.basename(previous))
                cleanups.append(
                    functools.partial(_undo_checkpoint, callback, previous, folder)
                )
        others = redirected

    def finish():
        for cleanup in cleanups:
            cleanup()

    return ours + others, finish


class _RedirectAfterRestore(keras.callbacks.Callback):
    """Points a stock BackupAndRestore at a temporary folder once it has read
    the shared backup (it follows it in the callback list)."""

    def __init__(self, callback, folder):
        super().__init__()
        self._callback = callback
        self._folder = folder
        self._previous = None

    def on_train_begin(self, logs=None):
        self._previous = _compat.redirect_stock_backup(self._callback, self._folder)

    def undo(self):
        if self._previous is not None:
            _compat.restore_attributes(self._callback, self._previous)
            self._previous = None
        shutil.rmtree(self._folder, ignore_errors=True)


def _undo_checkpoint(callback, filepath, folder):
    callback.filepath = filepath
    shutil.rmtree(folder, ignore_errors=True)


# What a collective raises when a peer is gone: its connection reset
# (Unavailable), the coordination service's heartbeat missed (Unavailable or
# Aborted), or `collective_timeout` passed (DeadlineExceeded).
_COLLECTIVE_ERRORS = (
    tf.errors.DeadlineExceededError,
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
)


def _lost_a_peer(error) -> bool:
    """Whether `error` is a collective's (TensorFlow's or gloo's) that lost a peer."""
    return isinstance(error, _COLLECTIVE_ERRORS) or gloo.is_failure(error)


# TensorFlow's coordination service names the tasks it misses this way.
_UNHEALTHY = "stopped sending heartbeats"
# What a worker's agent reports when its own heartbeats to the service time
# out: the task that hosts the service is stopped or frozen.
_SERVICE_LOST = "CoordinationService/Heartbeat"
_REPORTED_BY = re.compile(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)")
# gRPC's words for a peer whose process closed its sockets.
_CONNECTION_LOST = re.compile(r"Connection reset by peer|Socket closed|Broken pipe")


def _describe_lost_peer(strategy, error) -> str | None:
    """One line naming the peer a failed collective lost, or `None` when
    not multi-worker.

    A peer whose process is gone no longer answers on its address; one that
    is stopped (SIGSTOP) still accepts connections but sends no heartbeats,
    which TensorFlow's coordination service reports with its name; one that
    is alive but stopped taking part is what keras_dist's watchdog aborts
    (`core/watchdog.py`) after the collective timeout.
    """
    from keras_dist import cluster as cluster_lib

    resolver = getattr(strategy, "cluster_resolver", None)
    if not tf_internal.is_multi_worker(strategy) or resolver is None:
        return None
    me = f"{resolver.task_type}:{resolver.task_id}"
    message = str(error.message)
    cluster = resolver.cluster_spec().as_dict()
    missing = cluster_lib.unreachable_tasks(
        cluster, resolver.task_type, resolver.task_id
    )
    if missing:
        names = ", ".join(
            f"{name} ({address}: {why})" for name, address, why in missing
        )
        cause = f"lost {names}: it no longer answers"
    elif _UNHEALTHY in message:
        reported = [f"{kind}:{index}" for kind, index in _REPORTED_BY.findall(message)]
        others = [name for name in dict.fromkeys(reported) if name != me]
        who = ", ".join(others) or "a peer"
        cause = (
            f"lost {who}: it stopped sending heartbeats (its process is "
            "stopped, or its machine froze)"
        )
    elif _SERVICE_LOST in message:
        # The service runs in the chief, or in worker 0 without one
        # (TensorFlow's multi-worker strategy); its host is the one lost.
        host = "chief:0" if "chief" in cluster else "worker:0"
        cause = (
            f"lost {host}: this worker's heartbeats to the coordination "
            f"service it hosts time out (its process is stopped, or its "
            "machine froze)"
        )
    elif watchdog.aborted() is not None or isinstance(
        error, tf.errors.DeadlineExceededError
    ):
        timeout = watchdog.timeout_of(strategy)
        limit = f" ({timeout:g} s)" if timeout else ""
        cause = (
            "a peer stopped taking part: this worker waited for it in a "
            f"collective longer than the collective timeout{limit}; the peers "
            "still answer (one is stuck, or busy for longer than the timeout)"
        )
    elif _CONNECTION_LOST.search(message) and _REPORTED_BY.search(message):
        # The peer's end of a transfer closed (its process is exiting) and
        # its address still answered the probe a moment later.
        reported = [f"{kind}:{index}" for kind, index in _REPORTED_BY.findall(message)]
        others = [name for name in dict.fromkeys(reported) if name != me]
        who = ", ".join(others) or "a peer"
        cause = f"lost {who}: its connection was closed (its process ended)"
    else:
        first = next(
            (line.strip() for line in message.splitlines() if line.strip()), ""
        )
        cause = f"a collective failed ({type(error).__name__}: {first[:160]})"
    return (
        f"Training stopped on {me}: {cause}. Restart the job "
        "(`keras-dist launch --max-restarts N`) with "
        "`keras_dist.callbacks.BackupAndRestore` to resume from the last backup."
    )


def _bind(method, args, kwargs) -> dict:
    """`args`/`kwargs` of a call of Keras's `method`, by parameter name."""
    bound = inspect.signature(method).bind(None, *args, **kwargs)
    values = dict(bound.arguments)
    values.pop("self")
    values.update(values.pop("kwargs", {}))
    return values
