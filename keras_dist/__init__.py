"""keras_dist: distributed training for Keras 3 on TensorFlow that works.

Importing this package builds no strategy, touches no GPU and prints nothing.
It checks that Keras is configured for the TensorFlow backend and loads the
rest on first use, so `keras-dist launch` starts its tasks without paying for
a TensorFlow import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from keras_dist._backend import check_backend

check_backend()

__version__ = "0.1.0"

if TYPE_CHECKING:
    from keras_dist import cluster as cluster
    from keras_dist import compression as compression
    from keras_dist.memory import init_memory_growth as init_memory_growth
    from keras_dist.models import DistributedModel as DistributedModel
    from keras_dist.optimizers import (
        GradientAccumulationOptimizer as GradientAccumulationOptimizer,
    )
    from keras_dist.strategy import auto_strategy as auto_strategy

_PUBLIC = {
    "DistributedModel": ("keras_dist.models", "DistributedModel"),
    "GradientAccumulationOptimizer": (
        "keras_dist.optimizers",
        "GradientAccumulationOptimizer",
    ),
    "auto_strategy": ("keras_dist.strategy", "auto_strategy"),
    "init_memory_growth": ("keras_dist.memory", "init_memory_growth"),
    "cluster": ("keras_dist.cluster", None),
    "compression": ("keras_dist.compression", None),
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    try:
        module_name, attribute = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'keras_dist' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
