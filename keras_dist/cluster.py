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

import errno
import json
import os
import socket

from keras_dist._validation import check_bool, check_int

TASK_TYPES = ("chief", "worker", "ps", "evaluator")


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
