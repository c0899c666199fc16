"""The local cluster launcher behind `keras-dist launch`.

- `keras_dist.launcher.supervisor`: `launch`, which builds the tasks of a
  local cluster, runs them, relays the exit status of the one that failed
  and restarts a failed job (`--max-restarts`); it splits the cores
  between the tasks (`TF_NUM_INTRAOP_THREADS`, `KERAS_DIST_SPLIT_THREADS`).
- `keras_dist.launcher.elastic`: elastic sizing (`--workers MIN:MAX`,
  `--discover`): the worker range, the discovery command, the tasks'
  `KERAS_DIST_WORKERS` and `KERAS_DIST_WORKERS_RANGE`.
- `keras_dist.launcher.process`: starting, watching and stopping groups of
  task processes, one helper for the launcher and
  `keras_dist.testing.run_workers`.
- `keras_dist.launcher.tf_logs`: when and how `keras-dist` hides
  TensorFlow's native log lines (`--tf-logs`, `KERAS_DIST_TF_LOGS`).

Nothing here imports TensorFlow or Keras: the launcher starts its tasks
without paying for them.

Example:

```python
from keras_dist.launcher import launch

status = launch(["python", "train.py"], workers=2)  # keras-dist launch
```
"""

from keras_dist.launcher.elastic import (
    EXIT_DISCOVERY_FAILED as EXIT_DISCOVERY_FAILED,
)
from keras_dist.launcher.elastic import EXIT_TOO_FEW_WORKERS as EXIT_TOO_FEW_WORKERS
from keras_dist.launcher.elastic import WORKERS_ENV_VAR as WORKERS_ENV_VAR
from keras_dist.launcher.elastic import (
    WORKERS_RANGE_ENV_VAR as WORKERS_RANGE_ENV_VAR,
)
from keras_dist.launcher.process import EXIT_PREEMPTED as EXIT_PREEMPTED
from keras_dist.launcher.supervisor import (
    COLLECTIVE_TIMEOUT_ENV_VAR as COLLECTIVE_TIMEOUT_ENV_VAR,
)
from keras_dist.launcher.supervisor import (
    DEFAULT_COLLECTIVE_TIMEOUT as DEFAULT_COLLECTIVE_TIMEOUT,
)
from keras_dist.launcher.supervisor import DEFAULT_GRACE_PERIOD as DEFAULT_GRACE_PERIOD
from keras_dist.launcher.supervisor import RESTART_ENV_VAR as RESTART_ENV_VAR
from keras_dist.launcher.supervisor import (
    SPLIT_THREADS_ENV_VAR as SPLIT_THREADS_ENV_VAR,
)
from keras_dist.launcher.supervisor import TASK_ENV_VAR as TASK_ENV_VAR
from keras_dist.launcher.supervisor import launch as launch

__all__ = [
    "COLLECTIVE_TIMEOUT_ENV_VAR",
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "DEFAULT_GRACE_PERIOD",
    "EXIT_DISCOVERY_FAILED",
    "EXIT_PREEMPTED",
    "EXIT_TOO_FEW_WORKERS",
    "RESTART_ENV_VAR",
    "SPLIT_THREADS_ENV_VAR",
    "TASK_ENV_VAR",
    "WORKERS_ENV_VAR",
    "WORKERS_RANGE_ENV_VAR",
    "launch",
]
