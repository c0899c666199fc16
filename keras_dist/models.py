"""`DistributedModel`: a `keras.Model` whose training works under a strategy.

Tested under the default strategy, `OneDeviceStrategy`, `MirroredStrategy`,
`MultiWorkerMirroredStrategy` and `ParameterServerStrategy` (asynchronous
`fit`/`evaluate`/`predict` through a `ClusterCoordinator`). The code is in
`keras_dist/trainer/`, one module per concern.
"""

from keras_dist.trainer.mixin import DistributedTrainerMixin as DistributedTrainerMixin
from keras_dist.trainer.models import DistributedModel as DistributedModel
from keras_dist.trainer.models import (
    FunctionalDistributedModel as FunctionalDistributedModel,
)
from keras_dist.trainer.models import WrappedModel as WrappedModel
from keras_dist.trainer.saving import HookStateSaveable as HookStateSaveable

__all__ = [
    "DistributedModel",
    "DistributedTrainerMixin",
    "FunctionalDistributedModel",
    "HookStateSaveable",
    "WrappedModel",
]
