"""A bound on how long a worker waits for its peers, for one thread per process.

`MultiWorkerMirroredStrategy`'s collectives wait for every peer. TensorFlow
can bound each one (`CommunicationOptions(timeout_seconds=...)`), but it
pays for the bound with a thread that sleeps out the whole timeout for every
collective issued (`BaseCollectiveExecutor::ExecuteAsync` schedules the
check with `SchedNonBlockingClosureAfter`, which starts a thread): a fast
training loop issues several collectives a step and reaches the process's
thread limit within minutes (`std::system_error: Resource temporarily
unavailable`, SIGABRT; 16,000 threads after 1,000 steps of a two-layer MLP).

keras_dist keeps the bound and drops its cost. Every strategy it sees
(`keras_dist.auto_strategy`, `DistributedModel`, the collective layer's
`own`) has the timeout taken out of its communication options and given to
one watchdog thread per process. About once a second the watchdog looks at
what each thread is doing (`sys._current_frames`): a thread that has been
inside one and the same call into TensorFlow's executor (a step, an
evaluation batch, an eager collective) for longer than the timeout is
waiting for a peer that stopped taking part, and the watchdog aborts the
process's collectives (`abort_collective_ops`, as TensorFlow's own peer
health check does). The waiting step then fails with `DeadlineExceededError`
naming the timeout, the process exits and a launcher restarts the job.

What each failure of a peer costs a surviving worker, measured with two
worker processes on one machine (`tests/test_watchdog.py`,
`docs/guides/fault_tolerance.md`):

- the peer's process died (SIGKILL) or is stopped (SIGSTOP): TensorFlow's
  coordination service misses its heartbeats and aborts the collectives
  after about 10 s, whatever the timeout;
- the peer is alive but stuck outside its collectives (in Python, a
  deadlock, a long validation): the timeout, plus up to one poll.

The bound is on one call, not one collective: make the timeout longer than
the longest step, and than the longest time one worker may spend outside
collectives while the others wait (a validation pass, a backup, the first
trace).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref

from keras_dist._compat import tf_internal

logger = logging.getLogger(__name__)

# The longest pause between two looks; a short timeout polls more often.
POLL_SECONDS = 1.0
# A timeout's polls: the abort comes at most timeout / POLLS_PER_TIMEOUT late.
POLLS_PER_TIMEOUT = 10


class _Watchdog:
    """The process's watchdog: the timeouts of its strategies and its thread."""

    def __init__(self):
        self._lock = threading.Lock()
        # `strategy.extended` -> (timeout in seconds, this task's name).
        self._timeouts = weakref.WeakKeyDictionary()
        self._thread = None
        self.aborted = None

    def watch(self, strategy, timeout: float, task: str) -> None:
        with self._lock:
            self._timeouts[strategy.extended] = (float(timeout), task)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="keras_dist-watchdog", daemon=True
                )
                self._thread.start()

    def timeout_of(self, strategy) -> float | None:
        with self._lock:
            entry = self._timeouts.get(strategy.extended)
        return None if entry is None else entry[0]

    def _bound(self):
        """The shortest timeout of the live strategies, and its task's name."""
        with self._lock:
            entries = list(self._timeouts.values())
        return min(entries) if entries else (None, None)

    def _run(self) -> None:
        me = threading.get_ident()
        # Thread id -> (the frame of its current call, when first seen). The
        # frame object itself is kept, not its id: a call that ends frees
        # its frame, and the next call's frame may take its address.
        calls = {}
        while self.aborted is None:
            timeout, task = self._bound()
            if timeout is None:
                calls.clear()
                time.sleep(POLL_SECONDS)
                continue
            time.sleep(min(POLL_SECONDS, timeout / POLLS_PER_TIMEOUT))
            now = time.monotonic()
            calls = _running_calls(calls, now, me)
            waited = max((now - since for _, since in calls.values()), default=0.0)
            if waited > timeout:
                calls.clear()
                self._abort(task, timeout, waited)

    def _abort(self, task: str, timeout: float, waited: float) -> None:
        message = (
            f"keras_dist: {task} waited {waited:.0f} s in one call into "
            f"TensorFlow, longer than the collective timeout ({timeout:g} s, "
            "`auto_strategy(collective_timeout=...)` or "
            "KERAS_DIST_COLLECTIVE_TIMEOUT): a peer is alive but no longer "
            "takes part in the collectives (stuck, or busy for longer than "
            "the timeout). This process's collectives are aborted so that "
            "the job stops and can be restarted"
        )
        # The step that waited fails with this message; the log line is for
        # a process whose waiting call was not a step (a custom loop).
        logger.info("%s.", message)
        self.aborted = message
        tf_internal.abort_collectives(message)


def _running_calls(calls, now: float, me: int):
    """Each thread's current call into TensorFlow, with when it was first seen."""
    frames = sys._current_frames()
    running = {}
    for ident, frame in frames.items():
        if ident == me or not tf_internal.executing_in_tensorflow(frame):
            continue
        seen = calls.get(ident)
        if seen is not None and seen[0] is frame:
            running[ident] = seen
        else:
            running[ident] = (frame, now)
    return running


_WATCHDOG = _Watchdog()


def watch(strategy, timeout: float | None) -> None:
    """Bounds how long a call of `strategy`'s process may wait for peers.

    Idempotent; a second call for the same strategy replaces its timeout.
    The process's one watchdog thread starts with the first strategy it
    watches and applies the shortest timeout of the strategies still alive.

    Args:
        strategy: A multi-worker `tf.distribute.Strategy`.
        timeout: Float or `None`. Seconds; `None` does nothing.
    """
    if timeout is None:
        return
    resolver = getattr(strategy, "cluster_resolver", None)
    task_type = getattr(resolver, "task_type", None)
    task = f"{task_type}:{resolver.task_id}" if task_type else "this worker"
    _WATCHDOG.watch(strategy, timeout, task)


def timeout_of(strategy) -> float | None:
    """The watchdog's timeout for `strategy`, or `None` when it has none."""
    return _WATCHDOG.timeout_of(strategy)


def aborted() -> str | None:
    """The message the watchdog aborted this process's collectives with, or
    `None` while it has not."""
    return _WATCHDOG.aborted
