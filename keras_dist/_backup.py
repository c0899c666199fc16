"""A training run's whole state, written atomically and read back safely.

The machinery behind `keras_dist.callbacks.BackupAndRestore`. What is saved
is an *inventory* of variables: the model's (weights, non-trainable state,
seed generators), the optimizer's (slots, `iterations`, the accumulators and
counters of `GradientAccumulationOptimizer`), the all-reduce hook's state
(error feedback, PowerSGD factors, TopK residuals), the gradient statistics
of an adaptive `AutoScaleBatch`, and the metrics' running sums. Variables
that every replica holds alike (mirrored) are saved once. Variables that
each replica keeps for itself (`synchronization=ON_READ`: accumulators,
residuals, metric sums) are saved per replica: on several workers their
local copies are gathered to every worker with one all-gather, so the chief
alone can write the backup, and each replica gets its own copy back on
restore. Restoring them as a sum split in equal shares (what a Keras
checkpoint does) would change every compressed all-reduce after the restart.

Layout of `backup_dir`:

    CURRENT                 the name of the newest complete backup
    backup-00000007/        state.npz + manifest.json (with state.npz's sha256)
    backup-00000006/        the previous one, kept until the next is complete
    .partial-*/             a backup being written (removed when abandoned)

A backup is written into a `.partial-*` folder, synced, renamed to
`backup-N`, and only then named in `CURRENT` (an atomic `os.replace`), so a
process killed at any point leaves the previous backup usable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import uuid

import keras
import numpy as np
import tensorflow as tf

from keras_dist.core import collectives
from keras_dist.core import statistics as _gradient_statistics

logger = logging.getLogger(__name__)

FORMAT = "keras_dist.backup"
FORMAT_VERSION = 1
CURRENT = "CURRENT"
STATE_FILE = "state.npz"
MANIFEST_FILE = "manifest.json"
_BACKUP_NAME = re.compile(r"^backup-(\d{8})$")
# Complete backups kept: the newest and the one before it (the fallback
# when the newest turns out unreadable).
KEEP = 2


class BackupError(ValueError):
    """A backup exists but cannot be used for this run."""


# --- The inventory ------------------------------------------------------------------


@dataclasses.dataclass
class Item:
    """One variable of the inventory.

    Attributes:
        name: String. Where it comes from, e.g. `"model/dense/kernel"`.
        variable: The Keras or TensorFlow variable.
        per_replica: Bool. Each replica holds its own value (`ON_READ`).
    """

    name: str
    variable: object
    per_replica: bool

    @property
    def tf_variable(self):
        return _tf_variable(self.variable)


def _tf_variable(variable):
    if isinstance(variable, keras.Variable):
        return variable.value
    return variable


def _is_per_replica(variable) -> bool:
    tf_variable = _tf_variable(variable)
    return (
        isinstance(tf_variable, tf.distribute.DistributedValues)
        and tf_variable.synchronization == tf.VariableSynchronization.ON_READ
    )


def _name_of(variable) -> str:
    path = getattr(variable, "path", None)
    if isinstance(path, str) and path:
        return path
    return getattr(_tf_variable(variable), "name", "variable").split(":")[0]


def inventory(model) -> list[Item]:
    """Returns every variable a backup of `model`'s training holds, in order.

    The order is the order the model, its optimizer and its hook create
    their variables in, which is the same for the same model built the same
    way: the manifest checks it name by name.
    """
    from keras_dist.models import DistributedTrainerMixin
    from keras_dist.optimizers import find_accumulator

    groups = [("model", list(model.variables))]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        groups.append(("optimizer", list(optimizer.variables)))
        hooks = []
        if isinstance(model, DistributedTrainerMixin):
            hooks.append(model._training_hook())
        accumulator = find_accumulator(optimizer)
        if accumulator is not None and accumulator.built:
            hooks.append(accumulator._plain_hook())
        hook_state = []
        for hook in hooks:
            if getattr(hook, "built", False):
                hook_state.extend(hook.state_variables)
        groups.append(("hook", hook_state))
        statistics = _gradient_statistics.gradient_statistics(optimizer)
        if statistics is not None:
            groups.append(("statistics", list(statistics.variables)))
    groups.append(("metrics", list(model.metrics_variables)))
    items, seen = [], set()
    for group, variables in groups:
        for variable in variables:
            key = id(_tf_variable(variable))
            if key in seen:
                continue
            seen.add(key)
            items.append(
                Item(
                    name=f"{group}/{_name_of(variable)}",
                    variable=variable,
                    per_replica=_is_per_replica(variable),
                )
            )
    return items


# --- Reading and writing variable values ---------------------------------------------


def local_replicas(strategy) -> int:
    """Replicas of `strategy` in this process (1 for the default strategy)."""
    try:
        return len(strategy.extended.worker_devices)
    except RuntimeError:
        # The default strategy has no `worker_devices`: one replica.
        return 1


def count_workers(strategy) -> int:
    """Worker processes of `strategy` (1 unless multi-worker)."""
    return strategy.num_replicas_in_sync // local_replicas(strategy)


def worker_layout(strategy) -> tuple[int, int]:
    """Returns (first global replica id of this worker, local replicas)."""
    local = local_replicas(strategy)
    resolver = getattr(strategy, "cluster_resolver", None)
    task_id = getattr(resolver, "task_id", None) or 0
    if strategy.num_replicas_in_sync == local:
        return 0, local
    return int(task_id) * local, local


def read_values(items: list[Item], strategy) -> list[np.ndarray]:
    """Returns each item's value; per-replica items as `[replicas, ...]`.

    On several workers this is a collective (one all-gather): every worker
    must call it at the same point.
    """
    values: list[np.ndarray | None] = [None] * len(items)
    local_parts = []  # (index, [array per local replica])
    for index, item in enumerate(items):
        if item.per_replica:
            components = strategy.experimental_local_results(item.tf_variable)
            local_parts.append((index, [np.asarray(c.numpy()) for c in components]))
        else:
            values[index] = np.asarray(keras.ops.convert_to_numpy(item.variable))
    if local_parts:
        for index, stacked in zip(
            (i for i, _ in local_parts),
            gather_per_replica([p for _, p in local_parts], strategy),
        ):
            values[index] = stacked
    return values


def gather_per_replica(parts: list[list[np.ndarray]], strategy) -> list[np.ndarray]:
    """All-gathers per-replica arrays: returns one `[replicas, ...]` each."""
    replicas = strategy.num_replicas_in_sync
    base, local = worker_layout(strategy)
    if replicas == local:
        return [np.stack(arrays) for arrays in parts]
    # One collective for everything: each replica's arrays as bytes, padded
    # to whole float64 words (a gather moves bits; it does no arithmetic).
    buffers = [b"".join(arrays[j].tobytes() for arrays in parts) for j in range(local)]
    size = len(buffers[0])
    words = -(-size // 8)
    local_words = [
        np.frombuffer(buffer + b"\0" * (words * 8 - size), dtype=np.float64)
        for buffer in buffers
    ]

    def value_fn(context):
        return tf.constant(local_words[context.replica_id_in_sync_group - base])[None]

    distributed = strategy.experimental_distribute_values_from_function(value_fn)
    gathered = collectives.gather_across(strategy, distributed).numpy()
    result = [[] for _ in parts]
    for replica in range(replicas):
        raw = gathered[replica].tobytes()[:size]
        offset = 0
        for k, arrays in enumerate(parts):
            reference = arrays[0]
            length = reference.nbytes
            result[k].append(
                np.frombuffer(raw[offset : offset + length], dtype=reference.dtype)
                .reshape(reference.shape)
                .copy()
            )
            offset += length
    return [np.stack(arrays) for arrays in result]


def assign_values(items: list[Item], values: list[np.ndarray], strategy) -> None:
    """Gives every item its saved value; each replica its own copy.

    An item whose value is `None` is left as it is.
    """
    base, _ = worker_layout(strategy)
    for item, value in zip(items, values):
        if value is None:
            continue
        if item.per_replica:
            components = strategy.experimental_local_results(item.tf_variable)
            for offset, component in enumerate(components):
                component.assign(value[base + offset])
        else:
            item.variable.assign(value)


# --- The manifest ------------------------------------------------------------------


def describe(items: list[Item], values: list[np.ndarray]) -> list[dict]:
    return [
        {
            "name": item.name,
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "per_replica": item.per_replica,
        }
        for item, value in zip(items, values)
    ]


def expected_entries(items: list[Item], replicas: int) -> list[dict]:
    entries = []
    for item in items:
        variable = item.variable
        shape = [int(d) for d in variable.shape]
        if item.per_replica:
            shape = [replicas, *shape]
        dtype = tf.as_dtype(getattr(variable, "dtype", "float32")).name
        entries.append(
            {
                "name": item.name,
                "shape": shape,
                "dtype": dtype,
                "per_replica": item.per_replica,
            }
        )
    return entries


def check_compatible(manifest: dict, items: list[Item], strategy, where: str) -> None:
    """Raises `BackupError` unless the backup was written by this setup."""
    replicas = strategy.num_replicas_in_sync
    workers = count_workers(strategy)
    if manifest["replicas"] != replicas or manifest["workers"] != workers:
        raise BackupError(
            f"The backup in {where} was written by {manifest['workers']} "
            f"worker(s) with {manifest['replicas']} replica(s) in all; this run "
            f"has {workers} worker(s) with {replicas} replica(s). Per-replica "
            "state (accumulated gradients, error feedback) cannot be mapped "
            "onto another layout. Resume with the same cluster, or delete the "
            "backup directory to start over."
        )
    saved = manifest["variables"]
    expected = expected_entries(items, replicas)
    if len(saved) != len(expected):
        raise BackupError(
            f"The backup in {where} holds {len(saved)} variables; this model, "
            f"optimizer and hook have {len(expected)}. It was written by a "
            "different model, optimizer or all-reduce hook. Resume with the "
            "same setup, or point `backup_dir` elsewhere to start over."
        )
    for position, (old, new) in enumerate(zip(saved, expected)):
        if (old["shape"], old["dtype"], old["per_replica"]) != (
            new["shape"],
            new["dtype"],
            new["per_replica"],
        ) or old["name"].split("/")[0] != new["name"].split("/")[0]:
            raise BackupError(
                f"The backup in {where} does not match this model: variable "
                f"{position} is {old['name']} {old['shape']} {old['dtype']} in "
                f"the backup but {new['name']} {new['shape']} {new['dtype']} "
                "here. It was written by a different model, optimizer or "
                "all-reduce hook. Resume with the same setup, or point "
                "`backup_dir` elsewhere to start over."
            )


# --- Files ---------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def backup_names(backup_dir: str) -> list[str]:
    """Complete-looking backup folders, newest first."""
    try:
        names = os.listdir(backup_dir)
    except FileNotFoundError:
        return []
    return sorted((n for n in names if _BACKUP_NAME.match(n)), reverse=True)


def write(backup_dir: str, values: list[np.ndarray], manifest: dict) -> str:
    """Writes a complete backup and switches `CURRENT` to it; returns its name."""
    os.makedirs(backup_dir, exist_ok=True)
    existing = backup_names(backup_dir)
    number = int(_BACKUP_NAME.match(existing[0]).group(1)) + 1 if existing else 1
    name = f"backup-{number:08d}"
    partial = os.path.join(backup_dir, f".partial-{uuid.uuid4().hex}")
    os.makedirs(partial)
    state_path = os.path.join(partial, STATE_FILE)
    # Straight to the file: a second copy of a large model's state in memory
    # would be the peak of the whole save.
    with open(state_path, "wb") as handle:
        np.savez(handle, **{f"v{index}": value for index, value in enumerate(values)})
        handle.flush()
        os.fsync(handle.fileno())
    manifest = dict(manifest, sha256=_sha256_of(state_path))
    _write_file(
        os.path.join(partial, MANIFEST_FILE),
        json.dumps(manifest, indent=1).encode(),
    )
    _fsync_dir(partial)
    os.replace(partial, os.path.join(backup_dir, name))
    _fsync_dir(backup_dir)
    pointer = os.path.join(backup_dir, f".{CURRENT}.{uuid.uuid4().hex}")
    _write_file(pointer, (name + "\n").encode())
    os.replace(pointer, os.path.join(backup_dir, CURRENT))
    _fsync_dir(backup_dir)
    prune(backup_dir, keep=name)
    return name


def prune(backup_dir: str, keep: str) -> None:
    """Removes abandoned partial backups and all but the newest `KEEP`."""
    names = backup_names(backup_dir)
    kept = [keep, *[n for n in names if n != keep][: KEEP - 1]]
    for name in os.listdir(backup_dir):
        path = os.path.join(backup_dir, name)
        if name.startswith(".partial-") or (
            _BACKUP_NAME.match(name) and name not in kept
        ):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(f".{CURRENT}."):
            with contextlib.suppress(OSError):
                os.remove(path)


def _read_one(path: str) -> tuple[dict, list[np.ndarray]]:
    """Reads and verifies one backup folder; raises `BackupError` if unusable."""
    state_path = os.path.join(path, STATE_FILE)
    try:
        with open(os.path.join(path, MANIFEST_FILE), "rb") as handle:
            manifest = json.loads(handle.read())
        digest = _sha256_of(state_path)
    except (OSError, ValueError) as error:
        raise BackupError(f"{path} is incomplete or unreadable: {error}") from error
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise BackupError(
            f"{path} is not a keras_dist backup of format version "
            f"{FORMAT_VERSION} (found {manifest.get('format')!r} version "
            f"{manifest.get('version')!r})."
        )
    if digest != manifest.get("sha256"):
        raise BackupError(f"{path}/{STATE_FILE} is corrupt (its sha256 differs).")
    try:
        with np.load(state_path) as archive:
            values = [archive[f"v{i}"] for i in range(len(manifest["variables"]))]
    except (OSError, ValueError, KeyError) as error:
        raise BackupError(f"{path}/{STATE_FILE} is unreadable: {error}") from error
    return manifest, values


def read_latest(backup_dir: str):
    """Returns `(path, manifest, values)` of the newest usable backup, or `None`.

    `None` means there is nothing to resume from (no backup was ever
    completed). The backup `CURRENT` names comes first; when it is unusable
    the previous complete one is used, with a warning. When backups exist
    but none is usable, raises `BackupError`: the run must not start over
    silently.
    """
    candidates = []
    try:
        with open(os.path.join(backup_dir, CURRENT)) as handle:
            candidates.append(handle.read().strip())
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.warning("Cannot read %s: %s", os.path.join(backup_dir, CURRENT), error)
    candidates += [n for n in backup_names(backup_dir) if n not in candidates]
    if not candidates:
        return None
    problems = []
    for name in candidates:
        path = os.path.join(backup_dir, name)
        try:
            manifest, values = _read_one(path)
        except BackupError as error:
            problems.append(str(error))
            continue
        if problems:
            logger.warning(
                "Falling back to the previous complete backup %s: %s",
                path,
                "; ".join(problems),
            )
        return path, manifest, values
    raise BackupError(
        f"{backup_dir} holds backups, but none is usable: {'; '.join(problems)}. "
        "Training will not start over silently: move the directory away (or "
        "delete it) to start from scratch."
    )


def remove_all(backup_dir: str) -> None:
    """Removes every backup and `CURRENT`; the folder too when it is empty."""
    if not os.path.isdir(backup_dir):
        return
    for name in os.listdir(backup_dir):
        path = os.path.join(backup_dir, name)
        if name == CURRENT or name.startswith(f".{CURRENT}."):
            os.remove(path)
        elif _BACKUP_NAME.match(name) or name.startswith(".partial-"):
            shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(backup_dir)
