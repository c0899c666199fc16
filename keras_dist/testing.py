"""Run a function as real `MultiWorkerMirroredStrategy` worker processes, and
watch a long run's threads, files and memory.

Testing multi-worker code needs several processes that find each other through
`TF_CONFIG`. `run_workers` starts them on free localhost ports, collects each
worker's return value, and fails with the worker's own traceback when one
fails, so a bug inside a collective is reported instead of hanging.

A leak shows only in long runs: `resource_usage` reads a process's thread
count, open file descriptors and resident memory, and `ResourceSampler`
records them every few seconds from a thread of its own, for a soak test
that asserts they stay flat.

Example:

```python
# my_test.py (the function must be importable: module level)
def train():
    import tensorflow as tf
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    ...
    return model.get_weights()

def test_two_workers():
    weights_0, weights_1 = keras_dist.testing.run_workers(train, num_workers=2)
```
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence

from keras_dist import cluster as cluster_lib
from keras_dist._validation import check_int, check_real
from keras_dist.launcher import process as process_lib

# How long a finished worker waits for its peers to finish before it exits
# (see `_wait_for_peers`); the caller's `timeout` bounds the whole run.
PEER_WAIT_SECONDS = 60.0


class WorkerError(RuntimeError):
    """A worker process failed or timed out; carries its traceback and output."""


def run_workers(
    fn: Callable,
    num_workers: int = 2,
    args: Sequence = (),
    kwargs: dict | None = None,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> list:
    """Runs `fn(*args, **kwargs)` once in each of `num_workers` worker processes.

    Every process gets a `TF_CONFIG` naming all workers on free localhost
    ports and its own task index, so `tf.distribute.MultiWorkerMirroredStrategy()`
    created inside `fn` forms one cluster.

    Args:
        fn: Callable. A module-level function (it is imported by name in the
            child processes). Its return value must be picklable.
        num_workers: Int. Number of processes. Defaults to `2`.
        args: Sequence. Picklable positional arguments for `fn`. Defaults to
            `()`.
        kwargs: Dict or `None`. Picklable keyword arguments for `fn`.
        timeout: Float. Seconds before all workers are killed and a
            `WorkerError` is raised. Defaults to `300`.
        env: Dict or `None`. Extra environment variables for the workers.

    Returns:
        The list of return values, indexed by worker.

    Raises:
        TypeError: `fn` is not callable, `num_workers` is not an int or
            `timeout` not a number.
        ValueError: `fn` is not a module-level function (a lambda, a nested
            function, a `functools.partial`), `num_workers` < 1, or `timeout`
            is not a finite number > 0.
        WorkerError: a worker raised, exited non-zero or timed out. The message
            holds that worker's traceback and the tail of its output.
    """
    if not callable(fn):
        raise TypeError(f"`fn` must be callable. Received: fn={fn!r}.")
    qualname = getattr(fn, "__qualname__", None)
    if qualname is None or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            "`fn` must be a module-level function so the worker processes can "
            f"import it by name. Received: fn={fn!r}. Wrap partial arguments "
            "into `args`/`kwargs` instead."
        )
    num_workers = check_int("num_workers", num_workers, minimum=1)
    timeout = check_real(
        "timeout", timeout, minimum=0, low_open=True, hint="It is in seconds."
    )
    spec = cluster_lib.local_cluster(workers=num_workers)
    workdir = tempfile.mkdtemp(prefix="keras_dist_workers_")
    module_file = getattr(sys.modules.get(fn.__module__), "__file__", None)
    procs = []
    logs = []
    for index in range(num_workers):
        job = {
            "module": fn.__module__,
            "module_file": module_file,
            "qualname": qualname,
            "args": tuple(args),
            "kwargs": dict(kwargs or {}),
            "sys_path": list(sys.path),
            "result": os.path.join(workdir, f"result_{index}.pkl"),
            "peer_results": [
                os.path.join(workdir, f"result_{peer}.pkl")
                for peer in range(num_workers)
            ],
        }
        job_path = os.path.join(workdir, f"job_{index}.pkl")
        with open(job_path, "wb") as handle:
            pickle.dump(job, handle)
        # The child runs `-m keras_dist.testing` before it reads the job file,
        # so this copy of keras_dist must be importable from the start.
        child_env = process_lib.env_with_package({**os.environ, **(env or {})})
        child_env["TF_CONFIG"] = cluster_lib.make_tf_config(spec, "worker", index)
        child_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        log = open(os.path.join(workdir, f"worker_{index}.log"), "w+b")  # noqa: SIM115
        logs.append(log)
        procs.append(
            process_lib.start(
                [sys.executable, "-m", "keras_dist.testing", job_path],
                child_env,
                stdout=log,
            )
        )
    try:
        failed = _wait_all(procs, timeout)
        if failed is not None:
            index, reason = failed
            # Stop the others before reading the logs they share offsets with.
            process_lib.kill(procs)
            raise WorkerError(
                f"worker {index} of {num_workers} {reason}.\n"
                f"{_describe(workdir, index, logs[index])}"
            )
        results = []
        for index in range(num_workers):
            with open(os.path.join(workdir, f"result_{index}.pkl"), "rb") as handle:
                results.append(pickle.load(handle)["value"])
        return results
    finally:
        process_lib.kill(procs)
        for log in logs:
            log.close()
        shutil.rmtree(workdir, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class ResourceUsage:
    """What one process holds at one moment.

    Attributes:
        threads: Int. Its threads (Python's and native ones).
        open_files: Int. Its open file descriptors (files, sockets, pipes).
        rss_bytes: Int. Its resident memory, in bytes.
    """

    threads: int
    open_files: int
    rss_bytes: int


def resource_usage(pid: int | None = None) -> ResourceUsage:
    """Returns the threads, open file descriptors and resident memory of a process.

    Read from `/proc`, so Linux only.

    Args:
        pid: Int or `None`. The process; `None` is this one. Defaults to
            `None`.

    Returns:
        A `ResourceUsage`.

    Raises:
        OSError: the process does not exist, or this system has no `/proc`.
    """
    root = f"/proc/{'self' if pid is None else int(pid)}"
    fields = {}
    with open(f"{root}/status") as handle:
        for line in handle:
            name, _, value = line.partition(":")
            fields[name] = value.split()
    return ResourceUsage(
        threads=int(fields["Threads"][0]),
        open_files=len(os.listdir(f"{root}/fd")),
        rss_bytes=int(fields["VmRSS"][0]) * 1024,
    )


class ResourceSampler:
    """Appends this process's `resource_usage` to a JSON-lines file, periodically.

    For soak tests: start it before training, and each line of `path` is one
    sample, `{"time": seconds since start, "threads": ..., "open_files":
    ..., "rss_bytes": ..., **labels}`. `labels` (a dict the caller may
    change while it runs, e.g. the current phase and step) are copied into
    every sample. The sampler's own thread and file are open the whole time,
    so they add a constant, not a trend.

    Args:
        path: String. The file to append to.
        interval: Float. Seconds between samples. Defaults to `1.0`.

    Example:

    ```python
    sampler = keras_dist.testing.ResourceSampler("usage.jsonl")
    sampler.start()
    model.fit(...)
    sampler.stop()
    ```
    """

    def __init__(self, path: str, interval: float = 1.0):
        self.path = str(path)
        self.interval = check_real(
            "interval", interval, minimum=0, low_open=True, hint="In seconds."
        )
        self.labels: dict = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> ResourceSampler:
        """Starts sampling (one sample at once); returns the sampler."""
        if self._thread is not None:
            raise RuntimeError("This ResourceSampler is already started.")
        self._started = time.monotonic()
        self._file = open(self.path, "a")  # noqa: SIM115
        self.sample()
        self._thread = threading.Thread(
            target=self._run, name="keras_dist-resource-sampler", daemon=True
        )
        self._thread.start()
        return self

    def sample(self) -> None:
        """Writes one sample now."""
        usage = dataclasses.asdict(resource_usage())
        line = {"time": round(time.monotonic() - self._started, 3), **usage}
        line.update(self.labels)
        with self._lock:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()

    def stop(self) -> None:
        """Writes a last sample and stops."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.sample()
        self._file.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()


def _wait_all(procs, timeout):
    """Waits for all processes; returns (index, reason) of the first failure."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        exited = process_lib.wait_any(pending, max(0.0, deadline - time.monotonic()))
        if exited is None:
            stuck = [procs.index(proc) for proc in pending]
            return stuck[0], f"timed out after {timeout:g} s (still running: {stuck})"
        pending.remove(exited)
        if exited.returncode != 0:
            return procs.index(exited), f"exited with code {exited.returncode}"
    return None


def _describe(workdir, index, log):
    parts = []
    error_path = os.path.join(workdir, f"result_{index}.pkl")
    if os.path.exists(error_path):
        with open(error_path, "rb") as handle:
            payload = pickle.load(handle)
        if "traceback" in payload:
            parts.append("Traceback in the worker:\n" + payload["traceback"])
    log.flush()
    log.seek(0)
    output = log.read().decode(errors="replace")
    parts.append("Last output of the worker:\n" + output[-4000:])
    return "\n".join(parts)


def _child_main(job_path: str) -> int:
    with open(job_path, "rb") as handle:
        job = pickle.load(handle)
    for entry in reversed(job["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        fn = _import_function(job)
        value = fn(*job["args"], **job["kwargs"])
        data = pickle.dumps({"value": value})
        code = 0
    except BaseException:
        data = pickle.dumps({"traceback": traceback.format_exc()})
        code = 1
    # Written whole, then renamed: a peer that sees the file sees all of it.
    with open(job["result"] + ".tmp", "wb") as handle:
        handle.write(data)
    os.replace(job["result"] + ".tmp", job["result"])
    if code == 0:
        _wait_for_peers(job["peer_results"])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: TensorFlow's collective threads can block it.
    os._exit(code)


def _wait_for_peers(result_paths, timeout=PEER_WAIT_SECONDS):
    """Stays alive until every worker has its result (or `timeout` passes).

    A worker that leaves right after its last collective can close the
    socket a peer is still receiving that collective's data through ("Socket
    closed" in the peer): the peer then fails a step that had succeeded.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(path) for path in result_paths):
            return
        time.sleep(0.05)


def _import_function(job):
    name = job["module"]
    try:
        if name == "__main__":
            # The caller's script; here `__main__` is this module. Loaded under
            # another name, its `if __name__ == "__main__":` block stays idle.
            raise ImportError(name)
        module = importlib.import_module(name)
    except ImportError:
        if not job["module_file"]:
            raise
        name = "__keras_dist_main__" if name == "__main__" else name
        spec = importlib.util.spec_from_file_location(name, job["module_file"])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    target = module
    for part in job["qualname"].split("."):
        target = getattr(target, part)
    return target


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
