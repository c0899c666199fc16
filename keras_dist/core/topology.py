"""Where this process sits in a strategy: its replicas, the workers."""

from __future__ import annotations


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
