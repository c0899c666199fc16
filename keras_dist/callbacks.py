"""keras_dist's Keras callbacks.

- `AutoScaleBatch` (`keras_dist/autoscale.py`): batch size and learning rate
  that follow the replicas; adaptive batch growth toward the gradient noise
  scale. `ScaledLearningRate` (`keras_dist/schedules.py`) lets it rescale a
  learning-rate schedule.
- `BackupAndRestore` (`keras_dist/backup/`): a killed or preempted worker
  costs only the work since the last backup; `fit` resumes at that step
  with every piece of state. `register_backup_state` adds a callback's own
  state to the backups; `EXIT_PREEMPTED` is the exit status after a
  preemption.
"""

from keras_dist.autoscale import LR_SCALINGS as LR_SCALINGS
from keras_dist.autoscale import AutoScaleBatch as AutoScaleBatch
from keras_dist.backup.callback import BackupAndRestore as BackupAndRestore
from keras_dist.launcher.process import EXIT_PREEMPTED as EXIT_PREEMPTED
from keras_dist.noise_scale import NoiseScaleMeasurement as NoiseScaleMeasurement
from keras_dist.noise_scale import estimate_noise as estimate_noise
from keras_dist.schedules import ScaledLearningRate as ScaledLearningRate
from keras_dist.state import register_backup_state as register_backup_state

__all__ = [
    "EXIT_PREEMPTED",
    "LR_SCALINGS",
    "AutoScaleBatch",
    "BackupAndRestore",
    "NoiseScaleMeasurement",
    "ScaledLearningRate",
    "estimate_noise",
    "register_backup_state",
]
