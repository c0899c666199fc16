"""Runs one case of the matrix: its stock reference and keras_dist's candidate.

The reference is stock Keras: the same model as a plain `keras.Model`, on
one device, with the same global batch (for an accumulating piece, one batch
`k` times larger; for a resumed piece, the uninterrupted run). Dropout and
BatchNormalization draw their masks and statistics per replica, in stock
Keras as in keras_dist, so on several replicas their reference is stock
Keras on as many replicas (`MirroredStrategy`).

The candidate is keras_dist's piece on the case's strategy. The outcome
records whether it trained, the largest weight difference and the update
counts, or the error it raised, and the warnings it gave (Python warnings
and keras_dist's log records).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import tempfile
import time
import warnings

import keras
import numpy as np
import tensorflow as tf
from helpers import SEGMENT_BYTES

import keras_dist
from diffmatrix import axes
from diffmatrix.axes import Case

CRASH_AT = 7  # the batch after which a backup piece's first run stops
SAVE_FREQ = 5  # its backups: after batches 5 and 10 (a short batch of 6)


@dataclasses.dataclass
class Outcome:
    """What the candidate of a case did, next to its reference."""

    case: str
    trained: bool
    max_diff: float | None = None
    iterations: tuple | None = None
    error: str | None = None
    warnings: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0


# --- Strategies ----------------------------------------------------------------

_STRATEGIES = {}


def strategy_of(kind: str, replicas: int = 2):
    """`None` (no strategy) or a `MirroredStrategy` on logical CPUs, shared
    by the cases of this process (a notebook trains several models)."""
    if kind == "none" or replicas == 1:
        return None
    if kind == "multi_worker":
        if kind not in _STRATEGIES:
            _STRATEGIES[kind] = keras_dist.auto_strategy()
        return _STRATEGIES[kind]
    key = (kind, replicas)
    if key not in _STRATEGIES:
        _STRATEGIES[key] = tf.distribute.MirroredStrategy(
            [f"/cpu:{i}" for i in range(replicas)],
            cross_device_ops=tf.distribute.ReductionToOneDevice(),
        )
    return _STRATEGIES[key]


def _scope(strategy):
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _policy(feature):
    if feature != "mixed_float16":
        yield
        return
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


# --- The pieces ----------------------------------------------------------------


def accumulation_steps(piece: str) -> int:
    return (
        2 if piece in ("accumulate_2", "sharded_2", "backup_elastic_accumulate") else 1
    )


def candidate_optimizer(case: Case):
    inner = axes.build_optimizer(case.optimizer)
    if case.piece.startswith("accumulate") or case.piece == "backup_elastic_accumulate":
        return keras_dist.GradientAccumulationOptimizer(
            inner, accumulation_steps=accumulation_steps(case.piece)
        )
    if case.piece in ("sharded_variables", "backup_sharded_variables"):
        return keras_dist.ShardedOptimizer(inner, shard_by="variables")
    if case.piece.startswith("sharded"):
        # Small segments: the matrix's models would make one at 4 MiB.
        return keras_dist.ShardedOptimizer(
            inner,
            accumulation_steps=accumulation_steps(case.piece),
            bucket_bytes=SEGMENT_BYTES,
        )
    if case.piece == "local_sgd_1":
        return keras_dist.LocalSGDOptimizer(inner, sync_every=1)
    if case.piece == "diloco_1":
        # The outer SGD(1.0) moves the global weights by the mean change.
        outer = keras.optimizers.SGD(1.0)
        return keras_dist.DiLoCoOptimizer(inner, 1, outer_optimizer=outer)
    return inner


def candidate_hook(piece: str):
    if piece == "model_fp16":
        return keras_dist.compression.FP16()
    if piece == "model_bf16":
        return keras_dist.compression.BF16()
    return None


def _compile(model, case, optimizer):
    model.compile(
        optimizer=optimizer,
        loss=axes.loss_of(case.feature),
        loss_weights=axes.loss_weights_of(case.feature),
    )


def _fit(model, data, epochs, callbacks=()):
    model.fit(**data.kwargs, epochs=epochs, verbose=0, callbacks=list(callbacks))


def _two_fits(model, case, optimizer, data, rebuild_optimizer):
    """A `frozen_*` feature: fit, freeze a layer, compile again, fit."""
    _fit(model, data, 1)
    axes.freeze(model)
    if case.feature == "frozen_new_optimizer":
        optimizer = rebuild_optimizer()
    _compile(model, case, optimizer)
    _fit(model, data, 1)


def _iterations(model) -> int:
    return int(model.optimizer.iterations.numpy())


# --- Reference -----------------------------------------------------------------

_REFERENCES = {}


def reference(case: Case):
    """`(weights, iterations)` of stock Keras for `case` (cached)."""
    replicas = 1 if case.strategy == "none" else 2
    per_replica = case.feature in ("dropout", "batchnorm") and replicas > 1
    batch = axes.BATCH * accumulation_steps(case.piece)
    key = (case.feature, case.optimizer, case.input, batch, per_replica)
    if key not in _REFERENCES:
        strategy = strategy_of("mirrored", replicas) if per_replica else None
        with _policy(case.feature), _scope(strategy):
            model = axes.build_model(case.feature)
            optimizer = axes.build_optimizer(case.optimizer)
            _compile(model, case, optimizer)
        data = axes.fit_data(case.input, case.feature, batch)
        with _policy(case.feature):
            if case.feature.startswith("frozen"):
                _two_fits(
                    model,
                    case,
                    optimizer,
                    data,
                    lambda: axes.build_optimizer(case.optimizer),
                )
            else:
                _fit(model, data, axes.EPOCHS)
        _REFERENCES[key] = (
            [np.array(w) for w in model.get_weights()],
            _iterations(model),
        )
    return _REFERENCES[key]


# --- Candidate -----------------------------------------------------------------


class _Crash(keras.callbacks.Callback):
    """Stops the first run of a backup piece after `at` batches (a crash in
    this process; the second run resumes from the backup)."""

    def __init__(self, at):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            raise KeyboardInterrupt("crash")


def _candidate_model(case, strategy):
    with _policy(case.feature), _scope(strategy):
        model = axes.build_model(case.feature, keras_dist.DistributedModel)
        if candidate_hook(case.piece) is not None:
            model.register_all_reduce_hook(candidate_hook(case.piece))
        optimizer = candidate_optimizer(case)
        _compile(model, case, optimizer)
    return model, optimizer


def candidate(case: Case, folder: str | None = None):
    """Trains keras_dist's piece of `case`; returns `(weights, iterations)`.

    `folder`: where a backup piece writes (every worker of a multi-worker
    case must name the same); `None` makes one.
    """
    strategy = strategy_of(case.strategy)
    data = axes.fit_data(case.input, case.feature, axes.BATCH)
    if case.piece.startswith("backup"):
        return _resumed(case, data, folder)
    model, optimizer = _candidate_model(case, strategy)
    with _policy(case.feature):
        if case.feature.startswith("frozen"):

            def rebuild():
                with _scope(strategy):
                    return candidate_optimizer(case)

            _two_fits(model, case, optimizer, data, rebuild)
        else:
            _fit(model, data, axes.EPOCHS)
    return model.get_weights(), _iterations(model)


def _resumed(case, data, folder=None):
    """A run stopped after `CRASH_AT` batches and resumed from its backup:
    on the same strategy, or (elastic) on one device <-> 2 replicas."""
    made = folder is None
    folder = tempfile.mkdtemp(prefix="kd_matrix_") if made else folder
    try:
        first = strategy_of(case.strategy)
        if case.piece in ("backup_same", "backup_sharded_variables"):
            second = first
        else:
            second = strategy_of("mirrored") if first is None else None
        model, _ = _candidate_model(case, first)
        backup = keras_dist.callbacks.BackupAndRestore(folder, save_freq=SAVE_FREQ)
        with _policy(case.feature), contextlib.suppress(KeyboardInterrupt):
            _fit(model, data, axes.EPOCHS, [backup, _Crash(CRASH_AT)])
        # A restarted script builds its input again (a reshuffling dataset
        # object would go on with the next shuffle order).
        data = axes.fit_data(case.input, case.feature, axes.BATCH)
        model, _ = _candidate_model(case, second)
        backup = keras_dist.callbacks.BackupAndRestore(folder, save_freq=SAVE_FREQ)
        with _policy(case.feature):
            _fit(model, data, axes.EPOCHS, [backup])
        return model.get_weights(), _iterations(model)
    finally:
        if made:
            shutil.rmtree(folder, ignore_errors=True)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run(case: Case, folder: str | None = None) -> Outcome:
    """The case's outcome: the candidate next to its reference."""
    start = time.perf_counter()
    records = _Records()
    logger = logging.getLogger("keras_dist")
    logger.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                weights, iterations = candidate(case, folder)
            except Exception as error:  # the outcome records it
                return Outcome(
                    case.id,
                    trained=False,
                    error=f"{type(error).__name__}: {error}",
                    warnings=_texts(caught, records),
                    seconds=time.perf_counter() - start,
                )
        expected, expected_iterations = reference(case)
        diff = max(
            float(np.max(np.abs(np.asarray(a, np.float64) - b)))
            for a, b in zip(weights, expected, strict=True)
        )
        return Outcome(
            case.id,
            trained=True,
            max_diff=diff,
            iterations=(iterations, expected_iterations),
            warnings=_texts(caught, records),
            seconds=time.perf_counter() - start,
        )
    finally:
        logger.removeHandler(records)


def _texts(caught, records):
    texts = [str(w.message) for w in caught] + list(records.messages)
    # Noise every run gives, whatever the piece.
    return [t for t in texts if "oneDNN" not in t]


def run_in_worker(case_ids, folder):
    """Runs cases under this worker's MultiWorkerMirroredStrategy (a
    `keras_dist.testing.run_workers` function); returns their outcomes.
    `folder` is shared by the workers (backups)."""
    import os

    return [
        dataclasses.asdict(run(Case.from_id(case_id), os.path.join(folder, case_id)))
        for case_id in case_ids
    ]
