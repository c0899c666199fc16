"""Gradient all-reduce hooks: how replicas combine their gradients.

Every hook implements `AllReduceHook`; pass one to
`DistributedModel(..., all_reduce_hook=...)` or
`GradientAccumulationOptimizer(..., all_reduce_hook=...)` (Keras 3), or to
`keras_dist.tf_keras.DistributedOptimizer` (tf_keras).

| hook | sends (float32 gradients) | exact? |
| --- | --- | --- |
| `NoCompression()` | everything | yes |
| `FP16()`, `BF16()` | half (FP16: more on overflow) | ~5e-4 / ~4e-3 relative |
| `TopK(ratio)` | `ratio` of the entries + their indices | with error feedback |
| `PowerSGD(rank)` | two rank-`rank` factors per matrix | with error feedback |
| `DGC(ratio)` | like `TopK`, with the momentum in the hook | momentum SGD, delayed |

`hook.stats()` reports the bytes of the last step; `hook.state(name)` returns
the state a hook made with `add_state`.

Writing a hook: subclass `AllReduceHook` and issue collectives through the
helpers exported here (`all_reduce_sum`, `all_reduce_flat`, `all_gather`,
`all_gather_pairs`), keras_dist's collective layer
(`keras_dist.core.collectives`). The hooks are pure TensorFlow
(`keras_dist/core/`); importing this module registers them for Keras 3's
serialization, unless the process runs tf_keras (`TF_USE_LEGACY_KERAS=1`).
"""

from keras_dist._backend import legacy_keras
from keras_dist.core.casts import BF16 as BF16
from keras_dist.core.casts import FP16 as FP16
from keras_dist.core.collectives import all_gather as all_gather
from keras_dist.core.collectives import all_gather_pairs as all_gather_pairs
from keras_dist.core.collectives import all_reduce_flat as all_reduce_flat
from keras_dist.core.collectives import all_reduce_sum as all_reduce_sum
from keras_dist.core.collectives import check_bucket_bytes as check_bucket_bytes
from keras_dist.core.collectives import num_elements as num_elements
from keras_dist.core.collectives import plan_buckets as plan_buckets
from keras_dist.core.collectives import replica_context as replica_context
from keras_dist.core.collectives import tensor_bytes as tensor_bytes
from keras_dist.core.dgc import DGC as DGC
from keras_dist.core.hook_types import DEFAULT_BUCKET_BYTES as DEFAULT_BUCKET_BYTES
from keras_dist.core.hook_types import SUPPORTED_DTYPES as SUPPORTED_DTYPES
from keras_dist.core.hook_types import CompressionStats as CompressionStats
from keras_dist.core.hook_types import VariableSpec as VariableSpec
from keras_dist.core.hook_types import zero_if_not_finite as zero_if_not_finite
from keras_dist.core.hooks import AllReduceHook as AllReduceHook
from keras_dist.core.plain import NoCompression as NoCompression
from keras_dist.core.powersgd import PowerSGD as PowerSGD
from keras_dist.core.topk import TopK as TopK

if not legacy_keras():
    # Keras 3 can load `.keras` files naming `keras_dist>FP16` and the rest.
    from keras_dist import _registration  # noqa: F401

__all__ = [
    "BF16",
    "DEFAULT_BUCKET_BYTES",
    "DGC",
    "FP16",
    "SUPPORTED_DTYPES",
    "AllReduceHook",
    "CompressionStats",
    "NoCompression",
    "PowerSGD",
    "TopK",
    "VariableSpec",
    "all_gather",
    "all_gather_pairs",
    "all_reduce_flat",
    "all_reduce_sum",
    "check_bucket_bytes",
    "num_elements",
    "plan_buckets",
    "replica_context",
    "tensor_bytes",
    "zero_if_not_finite",
]
