"""What a backup says about itself, and whether this run can use it."""

from __future__ import annotations

import logging

import numpy as np

from keras_dist.backup.store import BackupError
from keras_dist.core.topology import count_workers

logger = logging.getLogger(__name__)


def describe(inventory, values: list[np.ndarray]) -> list[dict]:
    """The manifest's entry of every saved value."""
    entries = []
    for entry, value in zip(inventory, values):
        described = {
            "name": entry.name,
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "per_replica": entry.per_replica,
            "rule": entry.rule,
        }
        if entry.rule == "shard":
            described["segments"] = list(entry.shard_segments)
        entries.append(described)
    return entries


def saved_segments(saved: dict, entry) -> list | None:
    """The segments a saved `"shard"` value was laid out by (`None` for
    other rules). Backups written before the slices were laid out by
    segments record none: theirs is one segment, the whole vector."""
    if saved.get("rule") != "shard" or entry.rule != "shard":
        return None
    return saved.get("segments") or [entry.length]


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


def check_compatible(
    manifest: dict, inventory, strategy, where: str, resize: bool = False
) -> None:
    """Raises `BackupError` unless the backup was written by this setup.

    Args:
        manifest: Dict. The backup's manifest.
        inventory: This run's `StateInventory`.
        strategy: This run's strategy.
        where: String. The backup, for messages.
        resize: Bool. Whether the backup may come from another number of
            workers and replicas (an elastic resume: every per-replica
            entry must then have a rule for it).
    """
    replicas = strategy.num_replicas_in_sync
    workers = count_workers(strategy)
    if not resize and (
        manifest["replicas"] != replicas or manifest["workers"] != workers
    ):
        raise BackupError(
            f"The backup in {where} was written by {manifest['workers']} "
            f"worker(s) with {manifest['replicas']} replica(s) in all; this run "
            f"has {workers} worker(s) with {replicas} replica(s). Per-replica "
            "state (accumulated gradients, error feedback) cannot be mapped "
            "onto another layout. Resume with the same cluster, or delete the "
            "backup directory to start over."
        )
    saved = manifest["variables"]
    # On a resize, the saved stacks are compared at the backup's replica count.
    expected = expected_entries(inventory, manifest["replicas"])
    if len(saved) != len(expected):
        raise BackupError(
            f"The backup in {where} holds {len(saved)} variables; this model, "
            f"optimizer and hook have {len(expected)}. It was written by a "
            "different model, optimizer or all-reduce hook. Resume with the "
            "same setup, or point `backup_dir` elsewhere to start over."
        )
    for position, (old, new, entry) in enumerate(zip(saved, expected, inventory)):
        old_shape, new_shape = old["shape"], new["shape"]
        if resize and old["per_replica"] != new["per_replica"]:
            # One replica without a strategy keeps no per-replica variables:
            # compare one replica's shape.
            old_shape = old_shape[1:] if old["per_replica"] else old_shape
            new_shape = new_shape[1:] if new["per_replica"] else new_shape
        elif not resize and old["per_replica"] != new["per_replica"]:
            old_shape = None  # not this model's layout
        # A shard's size follows the replica count and its segments;
        # `reshard` relays it and checks the length.
        segments = saved_segments(old, entry)
        relaid = segments is not None and segments != list(entry.shard_segments)
        shape_differs = old_shape != new_shape and not (
            (resize or relaid) and "shard" in (entry.rule, old.get("rule"))
        )
        if (
            shape_differs
            or old["dtype"] != new["dtype"]
            or old["name"].split("/")[0] != new["name"].split("/")[0]
        ):
            raise BackupError(
                f"The backup in {where} does not match this model: variable "
                f"{position} is {old['name']} {old['shape']} {old['dtype']} in "
                f"the backup but {new['name']} {new['shape']} {new['dtype']} "
                "here. It was written by a different model, optimizer or "
                "all-reduce hook. Resume with the same setup, or point "
                "`backup_dir` elsewhere to start over."
            )
    if resize and manifest["replicas"] != replicas:
        exact = [e.name for e in inventory if e.per_replica and e.rule == "exact"]
        if exact:
            raise BackupError(
                f"The backup in {where} was written on {manifest['replicas']} "
                f"replica(s); this run has {replicas}. These per-replica "
                "variables have no rule for another replica count (their "
                f"aggregation is NONE): {', '.join(exact)}. Resume with "
                f"{manifest['replicas']} replica(s), or give them an "
                "aggregation (SUM, MEAN or ONLY_FIRST_REPLICA)."
            )


def accumulation_steps_on_resume(
    saved_steps: int, pending: int, new_steps: int, where: str, trackers=()
) -> int:
    """The `accumulation_steps` a resumed run trains with: one rule for all.

    A resume that changes the number of micro-steps per update, because the
    user built the optimizer with another value or because an elastic
    resume on another worker count keeps the global batch
    (`k' = k * N / N'`), goes through this rule:

    - the same value: nothing changes;
    - another value, and the backup's pending micro-steps are fewer than
      the new value: the run resumes with the **new** value, exactly. The
      pending micro-steps stay accumulated and the cycle completes after
      `new_steps - pending` more, as if the interrupted run had assigned
      `accumulation_steps = new_steps` at the backup's step (what
      `GradientAccumulationOptimizer` does when it is assigned while
      training). One line is logged;
    - otherwise the pending cycle cannot be carried (it already holds as
      many micro-steps as an update of the new size, or more: the next
      update would average over more than `new_steps`), and the resume is
      refused with both values named.

    Callbacks whose saved state was computed with the backup's value
    (`AutoScaleBatch` grows `accumulation_steps` itself) cannot follow a
    change: `trackers` names them, and a change is refused.

    Args:
        saved_steps: Int. `accumulation_steps` in the backup.
        pending: Int. Micro-steps the backup's cycle holds, in micro-steps
            of this run.
        new_steps: Int. The value this run asks for.
        where: String. The backup, for messages.
        trackers: Sequence of strings. Callbacks in the backup that track
            `accumulation_steps`.

    Returns:
        The value to train with.

    Raises:
        BackupError: the change cannot be carried exactly.
    """
    if new_steps == saved_steps:
        return saved_steps
    if trackers:
        raise BackupError(
            f"The backup in {where} was written with accumulation_steps="
            f"{saved_steps}; this run asks for accumulation_steps={new_steps}, "
            f"but the saved state of {', '.join(trackers)} was computed with "
            f"{saved_steps}. Resume with accumulation_steps={saved_steps}, or "
            "move the backup directory away to start over."
        )
    if pending >= new_steps:
        raise BackupError(
            f"The backup in {where} was written with accumulation_steps="
            f"{saved_steps} in the middle of an update ({pending} micro-steps "
            f"accumulated); this run asks for accumulation_steps={new_steps}, "
            f"fewer than or as many as those {pending}, so its next update "
            f"would average over more than {new_steps} micro-steps. Resume "
            f"with accumulation_steps={saved_steps}, or with at least "
            f"{pending + 1}, or move the backup directory away to start over."
        )
    logger.warning(
        "BackupAndRestore: accumulation_steps %d (this run) instead of %d (the "
        "backup in %s); the %d pending micro-step(s) complete an update after "
        "%d more.",
        new_steps,
        saved_steps,
        where,
        pending,
        new_steps - pending,
    )
    return new_steps
