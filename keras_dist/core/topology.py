"""Where this process sits in a strategy: its replicas, the workers, and
the strategy `keras_dist.auto_strategy` set it up with."""

from __future__ import annotations

import weakref

_auto_strategy = [None]


def remember_auto_strategy(strategy) -> None:
    """Records the strategy `auto_strategy` built (held weakly)."""
    _auto_strategy[0] = weakref.ref(strategy)


def auto_strategy_built():
    """The strategy `auto_strategy` last built in this process, or `None`."""
    reference = _auto_strategy[0]
    return None if reference is None else reference()


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
