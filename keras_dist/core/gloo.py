"""The fast CPU collective backend: gloo, through PyTorch's c10d.

TensorFlow's CPU all-reduce between worker processes is a ring over gRPC:
each piece of a tensor is a gRPC message, serialized, sent and parsed before
its reduction starts. Between 2 processes on one machine, 100 MB of float32
take 0.21-0.24 s that way (subdivided, `collectives.RING_SUBDIVS`) and 0.07-
0.09 s with gloo over plain TCP, the backend PyTorch's DDP uses on CPUs
(docs/benchmarks/ddp.md). Where PyTorch with gloo imports (`choose`:
`KERAS_DIST_COLLECTIVES` unset or `auto`; or `gloo`, which fails without
it), the sums of `collectives.all_reduce_sum` and
`all_reduce_flat` (every hook's dense buckets, and the step's metric sums),
and the all-to-all of `collectives.reduce_scatter` and the static-shaped
`collectives.all_gather` (the sharded optimizer's gradients and updated
slices) of a `MultiWorkerMirroredStrategy` with one device per worker
travel through a gloo process group instead, unless they are traced inside
a `tf.cond` or `tf.while_loop` (`GlooGroup.carries`); everything else (the
batch-size and norm reductions, sparse gradients, gathers of sizes known
only when the step runs) stays on TensorFlow's collectives.

How the group sums, and what it guarantees: `gloo_group`.

Where PyTorch is needed: only in the workers that use the backend (the
tested version, CPU wheel: `INSTALL`, or the extra `gloo`); without it,
`auto` keeps TensorFlow's collectives, and every worker must choose alike
(`_check_every_worker_agrees`).
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import weakref
from typing import NamedTuple

import tensorflow as tf

from keras_dist._compat import tf_internal
from keras_dist.cluster import COLLECTIVES_ENV_VAR, check_collectives

# Read here by the rest of the package: the install line, and whether a
# step's error is a failed gloo collective.
from keras_dist.core.gloo_group import INSTALL as INSTALL
from keras_dist.core.gloo_group import (
    KEY_PREFIX,
    GlooGroup,
    NoGloo,
    import_torch,
)
from keras_dist.core.gloo_group import is_failure as is_failure
from keras_dist.core.topology import local_replicas

ENV_VAR = COLLECTIVES_ENV_VAR

_lock = threading.Lock()
_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Groups of strategies switched back to TensorFlow (`use(..., False)`), kept
# for a switch back: a process group is met once per strategy.
_disabled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def requested_backend() -> str:
    """The backend `KERAS_DIST_COLLECTIVES` names (`"auto"` if unset).

    Raises:
        ValueError: the variable names no backend.
    """
    return check_collectives(os.environ.get(ENV_VAR), ENV_VAR) or "auto"


class Choice(NamedTuple):
    """What carries a strategy's sums, and why (`choose`)."""

    backend: str  # "gloo" or "tensorflow"
    reason: str


def choose(strategy) -> Choice:
    """Resolves `KERAS_DIST_COLLECTIVES` for one multi-worker strategy.

    `auto` (the variable unset) picks gloo when PyTorch with gloo imports
    here and the strategy has one CPU device per worker, TensorFlow's
    collectives otherwise (GPUs: NCCL; several devices per worker: the
    local all-reduce gloo cannot do; no PyTorch). Imports PyTorch only for
    a strategy gloo could serve.

    Raises:
        ValueError: the variable names no backend.
    """
    backend = requested_backend()
    if backend != "auto":
        return Choice(backend, f"{ENV_VAR}={backend}")
    devices = list(strategy.extended.worker_devices)
    if any("GPU" in device.upper() for device in devices):
        return Choice("tensorflow", "auto: GPU workers (NCCL)")
    if len(devices) != 1:
        return Choice(
            "tensorflow", f"auto: {len(devices)} devices per worker, gloo serves 1"
        )
    missing = gloo_missing()
    if missing:
        return Choice("tensorflow", f"auto: {missing}")
    return Choice("gloo", "auto: PyTorch with gloo is installed")


@functools.cache
def gloo_missing() -> str | None:
    """Why gloo cannot run in this process, or `None` when it can.

    Imports PyTorch (about 2 s and 180 MiB here, once per process).
    """
    try:
        import_torch()
    except NoGloo:
        return "this PyTorch build has no gloo"
    except ImportError:
        return "PyTorch is not installed"
    except Exception as error:
        # A PyTorch that is there but does not load (a missing shared
        # library: OSError) must not stop a job that never asked for it.
        return f"PyTorch does not import here ({type(error).__name__}: {error})"
    return None


def enable_if_requested(strategy) -> Choice:
    """Sends `strategy`'s sums through gloo when `choose` picks it.

    Called by `collectives.own` for every multi-worker strategy, before
    anything is traced, so a strategy gloo cannot serve fails at once.
    The process group itself is made at the first gradient sum.

    Returns:
        The `Choice`: whether `strategy`'s gradient sums go through gloo,
        and why.

    Raises:
        ValueError: `KERAS_DIST_COLLECTIVES` is not a backend, or names
            gloo for a strategy with several devices per worker, or the
            workers chose differently.
        ImportError: gloo is asked for and PyTorch is not installed.
    """
    choice = choose(strategy)
    _check_every_worker_agrees(strategy, choice)
    if choice.backend != "gloo":
        return choice
    local = local_replicas(strategy)
    if local != 1:
        raise ValueError(
            f"{ENV_VAR}=gloo serves one device per worker (CPU workers); "
            f"this worker's strategy has {local} "
            f"({list(strategy.extended.worker_devices)}). Unset {ENV_VAR} "
            "for TensorFlow's collectives (NCCL on GPUs)."
        )
    use(strategy)
    return choice


_AGREEMENTS = itertools.count()
# Seconds a worker waits for the others' backend choice at start-up (they
# make it as they build the same strategy, right after the cluster met).
AGREE_TIMEOUT_SECONDS = 120.0


def _check_every_worker_agrees(strategy, choice: Choice) -> None:
    """Refuses a cluster whose workers chose different backends.

    A worker that sums through gloo while its peer sums through TensorFlow
    would wait for a peer that never comes, and fail only after the
    collective timeout with gloo's raw `DistStoreError`. Each worker
    publishes its choice and the reason in TensorFlow's coordination
    service and reads the others'.

    Raises:
        ValueError: another worker chose another backend; names both and
            why each chose as it did.
    """
    workers = strategy.num_replicas_in_sync // local_replicas(strategy)
    if workers == 1:
        return  # nobody to disagree with (and no coordination service)
    rank = tf_internal.worker_rank(strategy)
    # One key per multi-worker strategy of this process (every worker
    # builds its strategies in the same order; keys are set only once).
    key = f"{KEY_PREFIX}backend/{next(_AGREEMENTS)}/"
    tf_internal.publish_key(f"{key}{rank}", f"{choice.backend}|{choice.reason}")
    for peer in range(workers):
        if peer == rank:
            continue
        try:
            published = tf_internal.read_key(
                f"{key}{peer}", timeout_seconds=AGREE_TIMEOUT_SECONDS
            )
        except tf.errors.OpError:
            # It did not say (an older keras_dist, or slow): the first
            # collective will tell.
            continue
        theirs, _, their_reason = published.partition("|")
        if theirs != choice.backend:
            raise ValueError(
                f"The workers disagree on what carries their sums: worker "
                f"{rank} (this one) sums through {choice.backend!r} "
                f"({choice.reason}), worker {peer} through {theirs!r} "
                f"({their_reason or 'no reason given'}). Received: "
                f"{ENV_VAR}={os.environ.get(ENV_VAR, '')!r} here. Install the "
                "same packages in every task, or set the same "
                f"{ENV_VAR} (tensorflow or gloo) for all of them "
                "(`keras-dist launch --collectives` passes it to every task)."
            )


def use(strategy, enabled: bool = True) -> None:
    """Sends `strategy`'s gradient sums through gloo, or back to TensorFlow.

    For what is traced afterwards: a function traced before keeps its
    collectives. `KERAS_DIST_COLLECTIVES=gloo` calls it for every
    multi-worker strategy; this is the switch for one strategy (a benchmark
    times both in the same processes). Every worker must make the same
    choice before tracing the same step.

    Raises:
        ImportError: `enabled` and PyTorch (with gloo) is not installed.
    """
    with _lock:
        if not enabled:
            if strategy.extended in _groups:
                _disabled[strategy.extended] = _groups.pop(strategy.extended)
            return
        import_torch()
        if strategy.extended not in _groups:
            _groups[strategy.extended] = _disabled.pop(strategy.extended, None)


def group_for(strategy) -> GlooGroup | None:
    """The gloo group summing `strategy`'s gradients, or `None` (TensorFlow).

    Makes the group (a rendezvous with every worker) the first time.
    """
    extended = strategy.extended
    if extended not in _groups:
        return None
    with _lock:
        group = _groups[extended]
        if group is None:
            group = GlooGroup.connect(strategy)
            _groups[extended] = group
    return group


def torch_version() -> str:
    """The installed PyTorch's version (`"not installed"` without one)."""
    from keras_dist._versions import installed_version

    return installed_version("torch") or "not installed"
