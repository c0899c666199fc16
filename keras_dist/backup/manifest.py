"""What a backup says about itself, and whether this run can use it."""

from __future__ import annotations

import numpy as np

from keras_dist.backup.store import BackupError
from keras_dist.core.topology import count_workers


def describe(inventory, values: list[np.ndarray]) -> list[dict]:
    """The manifest's entry of every saved value."""
    return [
        {
            "name": entry.name,
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "per_replica": entry.per_replica,
            "rule": entry.rule,
        }
        for entry, value in zip(inventory, values)
    ]


def expected_entries(inventory, replicas: int) -> list[dict]:
    """What `describe` would say of this inventory on `replicas` replicas."""
    entries = []
    for entry in inventory:
        shape = list(entry.shape)
        if entry.per_replica:
            shape = [replicas, *shape]
        entries.append(
            {
                "name": entry.name,
                "shape": shape,
                "dtype": entry.dtype.name,
                "per_replica": entry.per_replica,
            }
        )
    return entries


def check_compatible(manifest: dict, inventory, strategy, where: str) -> None:
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
    expected = expected_entries(inventory, replicas)
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
