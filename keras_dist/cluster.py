"""Build and validate `TF_CONFIG` cluster descriptions.

TensorFlow reads the cluster layout of a multi-worker job from the `TF_CONFIG`
environment variable and fails late, deep inside a strategy constructor, when
it is malformed. The helpers here validate it up front and say what is wrong.

Example:

```python
import os
from keras_dist import cluster

spec = cluster.local_cluster(workers=2)          # free localhost ports
os.environ["TF_CONFIG"] = cluster.make_tf_config(spec, "worker", 0)
cluster.parse_tf_config()                        # validated dict
```
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Sequence

from keras_dist._validation import check_bool, check_int, check_real

logger = logging.getLogger(__name__)

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
# The tasks that join a MultiWorkerMirroredStrategy's collectives.
TRAINING_TASK_TYPES = ("chief", "worker")
# Seconds between two rounds of `wait_for_cluster` probes, and at most per
# connection attempt.
_PROBE_INTERVAL = 0.25
_CONNECT_TIMEOUT = 1.0
# Seconds a collective may wait for a peer: read by `auto_strategy` when its
# `collective_timeout` is `None`, set by `keras-dist launch` for its tasks.
COLLECTIVE_TIMEOUT_ENV_VAR = "KERAS_DIST_COLLECTIVE_TIMEOUT"
# What carries a CPU multi-worker strategy's sums (`keras_dist.core.gloo`):
# read by every worker, set by `keras-dist launch --collectives`. Unset means
# `auto`: gloo where PyTorch (with gloo) is installed and each worker has one
# CPU device, TensorFlow's collectives otherwise.
COLLECTIVES_ENV_VAR = "KERAS_DIST_COLLECTIVES"
COLLECTIVE_BACKENDS = ("auto", "tensorflow", "gloo")


def check_collectives(value, argument: str = "collectives"):
    """Returns a collective backend's name after checking it, or `None`.

    The one check of `KERAS_DIST_COLLECTIVES`, `keras_dist.launcher.launch(
    collectives=...)` and `keras-dist launch --collectives`. Case and
    surrounding spaces are ignored; `None` and `""` mean "not given".

    Args:
        value: What was received.
        argument: String. The name the error gives it. Defaults to
            `"collectives"`.

    Returns:
        `"auto"`, `"tensorflow"`, `"gloo"` or `None`.

    Raises:
        ValueError: `value` names no backend.
    """
    if value is None:
        return None
    name = str(value).strip().lower() if isinstance(value, str) else None
    if name == "":
        return None
    if name not in COLLECTIVE_BACKENDS:
        raise ValueError(
            f"{argument} must be one of {list(COLLECTIVE_BACKENDS)}. Received: "
            f"{value!r}. `tensorflow` sums through TensorFlow's collectives, "
            "`gloo` through PyTorch's gloo (CPU workers, needs PyTorch in "
            "every task), `auto` (the default) through gloo where PyTorch is "
            "installed and each worker has one CPU device."
        )
    return name


def check_collective_timeout(value, hint: str = "It is in seconds."):
    """Returns a collective timeout after checking it: seconds, or `None`.

    The one check of `auto_strategy(collective_timeout=...)`,
    `keras_dist.launcher.launch(collective_timeout=...)` and `keras-dist
    launch --collective-timeout`: a finite number of seconds > 0. Zero is
    refused (TensorFlow would fail every collective at once); `None` means
    "not given here".

    Args:
        value: What was received.
        hint: String. How to fix it, appended to the message. Defaults to
            `"It is in seconds."`.

    Returns:
        The timeout as a float, or `None`.

    Raises:
        TypeError: `value` is not a number.
        ValueError: `value` is not finite or not > 0.
    """
    return check_real(
        "collective_timeout",
        value,
        minimum=0,
        low_open=True,
        allow_none=True,
        hint=hint,
    )


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Returns `count` distinct TCP ports that are free on `host` right now.

    The sockets are bound together and closed together, so the ports are
    distinct; another process may still take one before it is used, which is
    why launchers should start their tasks promptly.

    Args:
        count: Int. How many ports. Must be >= 1.
        host: String. Interface to probe. Defaults to `"127.0.0.1"`.

    Returns:
        A list of `count` port numbers.

    Raises:
        TypeError: `count` is not an int.
        ValueError: `count` is < 1.
        OSError: the process has too few file descriptors left to hold
            `count` sockets at once (the message says how to raise the limit).
    """
    count = check_int("count", count, minimum=1)
    sockets = []
    try:
        for _ in range(count):
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            except OSError as error:
                if error.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                raise OSError(
                    error.errno,
                    f"cannot hold {count} free ports at once: the process ran "
                    f"out of file descriptors after {len(sockets)} "
                    f"({error.strerror}). Raise the limit (e.g. "
                    "`ulimit -n 4096`) or use fewer tasks.",
                ) from None
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def local_cluster(
    workers: int, ps: int = 0, chief: bool = False, host: str = "localhost"
) -> dict[str, list[str]]:
    """Returns a cluster spec with every task on a free local port.

    Args:
        workers: Int. Number of `worker` tasks, >= 1 (>= 0 when `chief`).
        ps: Int. Number of parameter-server tasks. Defaults to `0`.
        chief: Bool. Whether to add one `chief` task. Defaults to `False`.
        host: String. Host name written into the addresses. Defaults to
            `"localhost"`.

    Returns:
        A dict from task type to addresses, such as
        `{"worker": ["localhost:40001", "localhost:40002"]}`.

    Raises:
        TypeError: `workers` or `ps` is not an int, or `chief` not a bool.
        ValueError: `workers` or `ps` is out of range.
    """
    chief = check_bool("chief", chief)
    min_workers = 0 if chief else 1
    workers = check_int(
        "workers",
        workers,
        minimum=min_workers,
        hint="A cluster needs at least one task that trains.",
    )
    ps = check_int("ps", ps, minimum=0)
    total = workers + ps + int(chief)
    ports = iter(free_ports(total))
    spec: dict[str, list[str]] = {}
    if chief:
        spec["chief"] = [f"{host}:{next(ports)}"]
    if workers:
        spec["worker"] = [f"{host}:{next(ports)}" for _ in range(workers)]
    if ps:
        spec["ps"] = [f"{host}:{next(ports)}" for _ in range(ps)]
    return spec


def make_tf_config(
    cluster: dict[str, list[str]], task_type: str, task_index: int
) -> str:
    """Returns the `TF_CONFIG` JSON string for one task of `cluster`.

    Args:
        cluster: Dict. Task type -> list of `"host:port"` addresses.
        task_type: String. One of `"chief"`, `"worker"`, `"ps"`, `"evaluator"`.
        task_index: Int. Index of the task within its type.

    Returns:
        The JSON string; it is validated with `parse_tf_config` first.

    Raises:
        ValueError: the result would not be a valid `TF_CONFIG` (see
            `parse_tf_config`).
    """
    text = json.dumps(
        {"cluster": cluster, "task": {"type": task_type, "index": task_index}}
    )
    parse_tf_config(text)
    return text


def parse_tf_config(text: str | None = None) -> dict | None:
    """Parses and validates a `TF_CONFIG` string.

    Args:
        text: String or `None`. The JSON text; `None` reads the `TF_CONFIG`
            environment variable. Defaults to `None`.

    Returns:
        The parsed dict, or `None` when `text` is `None` and `TF_CONFIG` is
        unset or empty.

    Raises:
        ValueError: the text is not JSON, has no `cluster`, names an unknown
            task type, a bad address, or a task index out of range. The message
            quotes the offending part.
    """
    source = "the argument"
    if text is None:
        text = os.environ.get("TF_CONFIG", "")
        source = "the TF_CONFIG environment variable"
        if not text.strip():
            return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"TF_CONFIG from {source} is not valid JSON ({error}). "
            f"Received: {text!r}. Build it with "
            "`keras_dist.cluster.make_tf_config(...)`."
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"TF_CONFIG must be a JSON object with `cluster` and `task`. "
            f"Received: {text!r}."
        )
    cluster = config.get("cluster")
    if not isinstance(cluster, dict) or not cluster:
        raise ValueError(
            "TF_CONFIG has no `cluster` (a non-empty object of task type -> "
            f"list of 'host:port'). Received: cluster={cluster!r}."
        )
    for task_type, addresses in cluster.items():
        if task_type not in TASK_TYPES:
            raise ValueError(
                f"TF_CONFIG's cluster names an unknown task type {task_type!r}. "
                f"Known types: {', '.join(TASK_TYPES)}."
            )
        if not isinstance(addresses, list) or not addresses:
            raise ValueError(
                f"TF_CONFIG's cluster[{task_type!r}] must be a non-empty list of "
                f"'host:port' strings. Received: {addresses!r}."
            )
        for address in addresses:
            _check_address(task_type, address)
    _check_unique_addresses(cluster)
    if len(cluster.get("chief", [])) > 1:
        raise ValueError(
            "TF_CONFIG's cluster may have at most one `chief`. "
            f"Received: chief={cluster['chief']!r}."
        )
    task = config.get("task")
    if task is None:
        return config
    if not isinstance(task, dict):
        raise ValueError(
            "TF_CONFIG's `task` must be an object with `type` and `index`. "
            f"Received: task={task!r}."
        )
    task_type = task.get("type")
    task_index = task.get("index", 0)
    if task_type not in TASK_TYPES:
        raise ValueError(
            f"TF_CONFIG's task type {task_type!r} is unknown. "
            f"Known types: {', '.join(TASK_TYPES)}."
        )
    if not isinstance(task_index, int) or isinstance(task_index, bool):
        raise ValueError(
            f"TF_CONFIG's task index must be an integer. Received: {task_index!r}."
        )
    if task_type == "evaluator" and task_type not in cluster:
        return config
    members = cluster.get(task_type)
    if members is None:
        raise ValueError(
            f"TF_CONFIG's task type {task_type!r} is not in its cluster "
            f"(cluster has {sorted(cluster)})."
        )
    if not 0 <= task_index < len(members):
        raise ValueError(
            f"TF_CONFIG's task index {task_index} is out of range for "
            f"{task_type!r}, which has {len(members)} task(s) "
            f"(valid: 0..{len(members) - 1})."
        )
    return config


def num_training_tasks(config: dict | None) -> int:
    """Returns how many tasks of `config` train (chief plus workers)."""
    if not config:
        return 0
    cluster = config["cluster"]
    return len(cluster.get("chief", [])) + len(cluster.get("worker", []))


@dataclasses.dataclass(frozen=True)
class Engine:
    """The engine that started this process, as `detect_engine` sees it.

    Attributes:
        name: String. `"keras-dist launch"`, `"Ray"`, `"SLURM job step"`,
            `"SLURM allocation"` (a SLURM job outside `srun`),
            `"Kubernetes"`, `"TF_CONFIG"` (set by something else) or
            `"none"`.
        detail: String. What it set, e.g. `"task SLURM_PROCID=1 of 2, job 7
            step 0 on node-a"`.
    """

    name: str
    detail: str


def detect_engine(environ=None) -> Engine:
    """Returns which cluster engine started this process, from its variables.

    Only the environment is read (nothing is contacted): `KERAS_DIST_TASK`
    (the launcher), `RAY_RAYLET_PID`/`RAY_JOB_ID` (a Ray worker; Ray Train's
    `TensorflowTrainer` sets `TF_CONFIG` in its loop), `SLURM_STEP_NUM_TASKS`
    (a task of an `srun` job step) or `SLURM_JOB_ID` (a SLURM job outside
    `srun`), `KUBERNETES_SERVICE_HOST` (a pod; a Kubeflow TFJob sets
    `TF_CONFIG`), and `TF_CONFIG` itself. The first match in that order
    wins: Ray on Kubernetes is Ray, which is what sets `TF_CONFIG` there.

    Args:
        environ: Mapping or `None`. The environment to read; `None` reads
            `os.environ`. Defaults to `None`.

    Returns:
        A frozen `Engine` with the engine's name and what it set.

    Example:

    ```python
    from keras_dist import cluster

    engine = cluster.detect_engine({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"})
    assert engine.name == "SLURM allocation"
    ```
    """
    env = os.environ if environ is None else environ
    tf_config = "TF_CONFIG set" if env.get("TF_CONFIG", "").strip() else "no TF_CONFIG"
    if env.get("KERAS_DIST_TASK"):
        return Engine(
            "keras-dist launch",
            f"task {env['KERAS_DIST_TASK']} of a local cluster ({tf_config})",
        )
    if env.get("RAY_RAYLET_PID") or env.get("RAY_JOB_ID"):
        where = (
            "a Ray Train worker (TF_CONFIG set by TensorflowTrainer)"
            if tf_config == "TF_CONFIG set"
            else "a Ray worker outside a TensorflowTrainer loop (no TF_CONFIG)"
        )
        return Engine("Ray", where)
    if env.get("SLURM_STEP_NUM_TASKS"):
        return Engine(
            "SLURM job step",
            f"task SLURM_PROCID={env.get('SLURM_PROCID', '?')} of "
            f"{env['SLURM_STEP_NUM_TASKS']}, job {env.get('SLURM_JOB_ID', '?')} "
            f"step {env.get('SLURM_STEP_ID', '?')} on "
            f"{env.get('SLURMD_NODENAME', '?')}",
        )
    if env.get("SLURM_JOB_ID"):
        return Engine(
            "SLURM allocation",
            f"job {env['SLURM_JOB_ID']} with {env.get('SLURM_NTASKS', '?')} "
            "task(s), outside a job step: start the script with `srun`",
        )
    if env.get("KUBERNETES_SERVICE_HOST"):
        where = (
            "a pod with TF_CONFIG (a Kubeflow TFJob or the manifest sets it)"
            if tf_config == "TF_CONFIG set"
            else "a pod without TF_CONFIG (one process)"
        )
        return Engine("Kubernetes", where)
    if tf_config == "TF_CONFIG set":
        return Engine(
            "TF_CONFIG", "set by hand or by an engine keras_dist does not know"
        )
    return Engine("none", "no cluster engine: one process")


def wait_for_cluster(
    cluster: dict[str, list[str]],
    timeout: float,
    task_type: str | None = None,
    task_index: int = 0,
    *,
    task_types: Sequence[str] = TRAINING_TASK_TYPES,
    log_interval: float = 15.0,
) -> None:
    """Waits until every other task of `cluster` answers on its address.

    A multi-worker strategy waits inside TensorFlow, silently and without a
    limit, for tasks that never start. This plain TCP probe runs first: it
    connects to each other task's `host:port` until all of them accept, logs
    a warning every `log_interval` seconds naming the tasks that have not
    answered yet, and raises after `timeout` seconds.

    A task's TensorFlow server only listens once its strategy is built, so
    while this process waits it listens on its own address (`task_type`,
    `task_index`) itself: tasks started at different times find each other
    here instead of each waiting for the other's server. The listener is
    closed before this returns, freeing the port for TensorFlow.

    Args:
        cluster: Dict. Task type -> list of `"host:port"` addresses, as in
            `TF_CONFIG`.
        timeout: Float. Seconds to wait at most, > 0.
        task_type: String or `None`. This process's task type; `None` when
            this process is not a task of `cluster` (it then only probes).
            Defaults to `None`.
        task_index: Int. This process's index within `task_type`. Defaults
            to `0`.
        task_types: Sequence of strings. The task types to wait for.
            Defaults to `("chief", "worker")`, the tasks of a
            `MultiWorkerMirroredStrategy`.
        log_interval: Float. Seconds between two progress warnings, > 0.
            Defaults to `15.0`.

    Raises:
        TypeError: `timeout` or `log_interval` is not a number.
        ValueError: `timeout` or `log_interval` is not a finite number > 0.
        RuntimeError: some task did not answer within `timeout`; the message
            names each one, its address and the last connection error.
    """
    timeout = check_real(
        "timeout", timeout, minimum=0, low_open=True, hint="It is in seconds."
    )
    log_interval = check_real(
        "log_interval", log_interval, minimum=0, low_open=True, hint="It is in seconds."
    )
    own = (task_type, task_index)
    pending = {
        f"{kind}:{index}": address
        for kind in task_types
        for index, address in enumerate(cluster.get(kind, []))
        if (kind, index) != own
    }
    if not pending:
        return
    listeners = []
    if task_type is not None and task_index < len(cluster.get(task_type, [])):
        listeners = _listen(cluster[task_type][task_index])
    errors: dict[str, str] = {}
    start = time.monotonic()
    deadline = start + timeout
    next_log = start + log_interval
    try:
        while True:
            _answer_probes(listeners)
            for name, address in list(pending.items()):
                left = deadline - time.monotonic()
                error = _connect(address, max(0.01, min(_CONNECT_TIMEOUT, left)))
                if error is None:
                    del pending[name]
                else:
                    errors[name] = error
            now = time.monotonic()
            if not pending:
                logger.info(
                    "All tasks of the cluster answered after %.1f s.", now - start
                )
                return
            if now >= deadline:
                raise RuntimeError(
                    f"Timed out after {timeout:g} s waiting for the cluster to "
                    f"start: {_describe_pending(pending, errors)} did not "
                    f"answer. {_startup_hint(task_type, task_index)}Check that "
                    "these addresses are right and reachable from here (host "
                    "name, port, firewall), or allow more time with "
                    "`auto_strategy(startup_timeout=...)` or the "
                    "KERAS_DIST_STARTUP_TIMEOUT environment variable."
                )
            if now >= next_log:
                logger.warning(
                    "Still waiting for %d task(s) of the cluster after %.0f s "
                    "(timeout %g s): %s.",
                    len(pending),
                    now - start,
                    timeout,
                    _describe_pending(pending, errors),
                )
                next_log = now + log_interval
            time.sleep(min(_PROBE_INTERVAL, max(0.0, deadline - now)))
    finally:
        for listener in listeners:
            listener.close()


def unreachable_tasks(
    cluster: dict,
    task_type: str | None = None,
    task_index: int | None = None,
    timeout: float = 2.0,
) -> list[tuple[str, str, str]]:
    """Returns the tasks of `cluster` that do not answer on their address.

    Each as `(name, address, why)`, e.g. `("worker:1", "localhost:2222",
    "Connection refused")`; this task (`task_type`, `task_index`) is skipped.
    Used to name the peer a failed collective lost.
    """
    missing = []
    for kind, addresses in cluster.items():
        for index, address in enumerate(addresses):
            if (kind, index) == (task_type, task_index):
                continue
            why = _connect(address, timeout)
            if why is not None:
                missing.append((f"{kind}:{index}", address, why))
    return missing


def _startup_hint(task_type, task_index) -> str:
    if task_type is None:
        return ""
    return (
        f"This process is {task_type}:{task_index}. Start every task of the "
        "cluster, each with the same cluster and its own `task`. "
    )


def _describe_pending(pending, errors) -> str:
    return ", ".join(
        f"{name} at {address} ({errors.get(name, 'not tried')})"
        for name, address in pending.items()
    )


def _split_address(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def _connect(address: str, timeout: float) -> str | None:
    """Connects to `address` and hangs up; returns `None` or why it failed."""
    try:
        host, port = _split_address(address)
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as error:
        return error.strerror or str(error) or type(error).__name__
    return None


def _listen(address: str) -> list[socket.socket]:
    """Listens on this task's own port until its TensorFlow server does.

    Binds where TensorFlow's server will: every interface, as other hosts
    may reach this one by an address that differs from what its own host
    name resolves to here (Debian maps it to 127.0.1.1). `localhost` or a
    loopback IP (a local cluster) binds loopback only. Returns no listener
    when the port is taken: TensorFlow reports that itself.
    """
    host, port = _split_address(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    loopback = bool(infos) and _is_loopback_name(host)
    if loopback:
        targets = [(family, sockaddr[:2]) for family, *_, sockaddr in infos]
    elif socket.has_dualstack_ipv6():
        targets = [(socket.AF_INET6, ("::", port))]
    else:
        targets = [(socket.AF_INET, ("", port))]
    listeners = []
    for family, sockaddr in dict.fromkeys(targets):
        try:
            listener = socket.create_server(
                sockaddr,
                family=family,
                backlog=64,
                dualstack_ipv6=not loopback and family == socket.AF_INET6,
            )
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                logger.debug("%s is already in use; not listening on it.", address)
                for opened in listeners:
                    opened.close()
                return []
            continue
        listener.setblocking(False)
        listeners.append(listener)
    return listeners


def _is_loopback_name(host: str) -> bool:
    """`localhost` or a loopback IP; not a host name that maps to one here."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _answer_probes(listeners) -> None:
    """Accepts and drops the probes that reached this task's listeners."""
    for listener in listeners:
        while True:
            try:
                connection, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            # Reset instead of a normal close: no TIME_WAIT left on the port
            # TensorFlow binds next.
            connection.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
            connection.close()


def _check_unique_addresses(cluster: dict) -> None:
    owners: dict[str, list[str]] = {}
    for task_type, addresses in cluster.items():
        for index, address in enumerate(addresses):
            host, port = address.rsplit(":", 1)
            key = f"{host.strip().lower()}:{int(port)}"
            owners.setdefault(key, []).append(f"{task_type}:{index}")
    for key, tasks in owners.items():
        if len(tasks) > 1:
            raise ValueError(
                f"TF_CONFIG's cluster gives the address {key!r} to "
                f"{len(tasks)} tasks ({', '.join(tasks)}). Every task needs its "
                "own 'host:port': only one process can listen on it, and the "
                "others would wait for a peer that never answers. Build the "
                "cluster with `keras_dist.cluster.local_cluster(...)` or give "
                "each task its own port."
            )


def _check_address(task_type: str, address: object) -> None:
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(
            f"TF_CONFIG's cluster[{task_type!r}] holds {address!r}, which is not "
            "a 'host:port' string."
        )
    port = address.rsplit(":", 1)[1]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"TF_CONFIG's cluster[{task_type!r}] address {address!r} has no "
            "valid port (1-65535)."
        )
