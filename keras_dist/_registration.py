"""Registers the core's all-reduce hooks for Keras 3's serialization.

The hooks are pure TensorFlow (`keras_dist/core/`); a `.keras` file that
holds a model or optimizer with a hook names it `keras_dist>FP16` and so
on. Imported by the Keras 3 front end (`keras_dist.optimizers`,
`keras_dist.models`), so `import keras_dist` registers them.
"""

from __future__ import annotations

import keras

from keras_dist.core.casts import BF16, FP16
from keras_dist.core.dgc import DGC
from keras_dist.core.plain import NoCompression
from keras_dist.core.powersgd import PowerSGD
from keras_dist.core.topk import TopK

HOOKS = (NoCompression, FP16, BF16, TopK, PowerSGD, DGC)

for _hook in HOOKS:
    keras.saving.register_keras_serializable(package="keras_dist")(_hook)
