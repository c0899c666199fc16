"""Serve one `worker` or `ps` task of a parameter-server cluster.

Under `ParameterServerStrategy` the chief's `ClusterCoordinator` drives every
`worker` and `ps` task through its `tf.distribute.Server`; such a task has
nothing else to do than serve until the job ends. `serve` is that task's
whole life, for both places that start one: `keras_dist.auto_strategy()` on a
`worker` or `ps` task (the same script runs on every task, as on Kubernetes),
and the parameter-server tasks of `keras-dist launch --ps M`, which run no
script of the user's (`python -m keras_dist _ps-server`).

This module imports TensorFlow and the standard library only, never Keras:
a launcher's ps task starts without paying for it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence

import tensorflow as tf

logger = logging.getLogger(__name__)


def serve(
    cluster_spec: tf.train.ClusterSpec | Mapping[str, Sequence[str]],
    task_type: str,
    task_index: int,
    protocol: str = "grpc",
    announce: Callable[[str, str], None] | None = None,
) -> None:
    """Runs this task's `tf.distribute.Server` until the process is stopped.

    Starts the server of task `task_type:task_index`, says where it listens,
    then blocks in `server.join()`, which does not return: the launcher (or
    the cluster's job controller) stops the process when the chief is done.

    Args:
        cluster_spec: `tf.train.ClusterSpec` or dict. The whole cluster, task
            type -> addresses, e.g. `{"chief": [...], "worker": [...],
            "ps": [...]}`.
        task_type: String. This task's type, `"worker"` or `"ps"`.
        task_index: Int. This task's index among the tasks of `task_type`.
        protocol: String. The server's RPC layer. Defaults to `"grpc"`.
        announce: Callable or `None`. Called as `announce(name, address)`,
            e.g. `("ps:0", "localhost:2222")`, once the server listens.
            `None` logs the warning `keras_dist: ps:0 of a parameter-server
            cluster is serving on ADDRESS (pid N) until the job ends; ...`.
            Defaults to `None`.

    Raises:
        ValueError: `task_type:task_index` is not a task of `cluster_spec`.

    Example:

    ```python
    import json, os
    from keras_dist.parameter_server import serving

    config = json.loads(os.environ["TF_CONFIG"])
    serving.serve(config["cluster"], "ps", config["task"]["index"])
    ```
    """
    cluster_spec = tf.train.ClusterSpec(cluster_spec)
    name = f"{task_type}:{task_index}"
    try:
        address = cluster_spec.task_address(task_type, task_index)
    except ValueError:
        raise ValueError(
            "`task_type` and `task_index` must name a task of `cluster_spec`. "
            f"Received: task_type={task_type!r}, task_index={task_index!r}, "
            f"cluster_spec={cluster_spec.as_dict()!r}. Check the task in "
            "TF_CONFIG against its cluster."
        ) from None
    server = tf.distribute.Server(
        cluster_spec,
        job_name=task_type,
        task_index=task_index,
        protocol=protocol,
        start=True,
    )
    if announce is None:
        logger.warning(
            "keras_dist: %s of a parameter-server cluster is serving on %s "
            "(pid %d) until the job ends; the chief coordinates the training.",
            name,
            address,
            os.getpid(),
        )
    else:
        announce(name, address)
    server.join()
