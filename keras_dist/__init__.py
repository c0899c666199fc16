"""keras_dist: distributed training for Keras 3 on TensorFlow that works.

Importing this package builds no strategy, touches no GPU and prints nothing.
"""

from keras_dist import _compat

_compat.check_backend()

from keras_dist import cluster as cluster  # noqa: E402
from keras_dist import compression as compression  # noqa: E402
from keras_dist.memory import init_memory_growth as init_memory_growth  # noqa: E402
from keras_dist.models import DistributedModel as DistributedModel  # noqa: E402
from keras_dist.optimizers import (  # noqa: E402
    GradientAccumulationOptimizer as GradientAccumulationOptimizer,
)
from keras_dist.strategy import auto_strategy as auto_strategy  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "DistributedModel",
    "GradientAccumulationOptimizer",
    "auto_strategy",
    "cluster",
    "compression",
    "init_memory_growth",
]
