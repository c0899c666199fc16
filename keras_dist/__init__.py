"""keras_dist: distributed training for Keras 3 on TensorFlow that works.

Importing this package builds no strategy, touches no GPU and prints nothing.
It checks that Keras is configured for the TensorFlow backend and that the
installed Keras and TensorFlow are versions it accepts (`_versions.py`: an
`ImportError` below the minimums, an `UntestedVersionWarning` outside the
tested range), then imports
its Keras pieces so that their serializable classes are registered (a
`.keras` file with a `DistributedModel` loads after `import keras_dist`).
Two cases skip that import: the `keras-dist` command line (`keras-dist
...`, `python -m keras_dist ...`: the launcher starts its tasks without
paying for a TensorFlow import, and its subcommands import what they use),
and a process in tf_keras mode (`TF_USE_LEGACY_KERAS=1`, as tf_keras and
tfmot programs set it): `keras_dist.tf_keras` and the core then load no
Keras 3 module, and the Keras 3 pieces load on first access.

The submodules the documentation uses (`keras_dist.strategy`,
`keras_dist.memory`, `keras_dist.testing`, ...) are attributes of the package
after a plain `import keras_dist`, loaded on first access.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

from keras_dist._backend import check_backend, legacy_keras
from keras_dist._versions import VERSION, check_versions

check_backend()
check_versions()

__version__ = VERSION

if TYPE_CHECKING:
    from keras_dist import batch_size as batch_size
    from keras_dist import callbacks as callbacks
    from keras_dist import cluster as cluster
    from keras_dist import compression as compression
    from keras_dist import memory as memory
    from keras_dist import models as models
    from keras_dist import noise_scale as noise_scale
    from keras_dist import optimizers as optimizers
    from keras_dist import sharding as sharding
    from keras_dist import strategy as strategy
    from keras_dist import testing as testing
    from keras_dist.batch_size import find_max_batch_size as find_max_batch_size
    from keras_dist.local_sgd import DiLoCoOptimizer as DiLoCoOptimizer
    from keras_dist.local_sgd import LocalSGDOptimizer as LocalSGDOptimizer
    from keras_dist.memory import init_memory_growth as init_memory_growth
    from keras_dist.models import DistributedModel as DistributedModel
    from keras_dist.optimizers import (
        GradientAccumulationOptimizer as GradientAccumulationOptimizer,
    )
    from keras_dist.sharding import ShardedOptimizer as ShardedOptimizer
    from keras_dist.strategy import auto_strategy as auto_strategy

_PUBLIC = {
    "DistributedModel": ("keras_dist.models", "DistributedModel"),
    "GradientAccumulationOptimizer": (
        "keras_dist.optimizers",
        "GradientAccumulationOptimizer",
    ),
    "ShardedOptimizer": ("keras_dist.sharding", "ShardedOptimizer"),
    "LocalSGDOptimizer": ("keras_dist.local_sgd", "LocalSGDOptimizer"),
    "DiLoCoOptimizer": ("keras_dist.local_sgd", "DiLoCoOptimizer"),
    "auto_strategy": ("keras_dist.strategy", "auto_strategy"),
    "init_memory_growth": ("keras_dist.memory", "init_memory_growth"),
    "find_max_batch_size": ("keras_dist.batch_size", "find_max_batch_size"),
    # Submodules, so that `keras_dist.strategy.describe_choice()` works after
    # `import keras_dist` (tests/test_public_api.py covers each).
    "batch_size": ("keras_dist.batch_size", None),
    "callbacks": ("keras_dist.callbacks", None),
    "cluster": ("keras_dist.cluster", None),
    "compression": ("keras_dist.compression", None),
    "memory": ("keras_dist.memory", None),
    "models": ("keras_dist.models", None),
    "noise_scale": ("keras_dist.noise_scale", None),
    "optimizers": ("keras_dist.optimizers", None),
    "sharding": ("keras_dist.sharding", None),
    "strategy": ("keras_dist.strategy", None),
    "testing": ("keras_dist.testing", None),
    # Imports tf_keras (and tfmot, when installed) on first access only.
    "tf_keras": ("keras_dist.tf_keras", None),
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


def _is_command_line() -> bool:
    # While `python -m keras_dist` locates the package, sys.argv[0] is "-m".
    argv = getattr(sys, "argv", None) or [""]
    return argv[0] == "-m" or os.path.basename(argv[0]) == "keras-dist"


if not _is_command_line() and not legacy_keras():
    for _name in ("compression", "optimizers", "models"):
        importlib.import_module(f"keras_dist.{_name}")
