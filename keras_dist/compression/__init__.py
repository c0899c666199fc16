"""Gradient all-reduce hooks: how replicas combine their gradients.

Every hook implements `AllReduceHook`; pass one to
`DistributedModel(..., all_reduce_hook=...)` or
`GradientAccumulationOptimizer(..., all_reduce_hook=...)`.

| hook | sends (float32 gradients) | exact? |
| --- | --- | --- |
| `NoCompression()` | everything | yes |
| `FP16()`, `BF16()` | half (FP16: more on overflow) | ~5e-4 / ~4e-3 relative |
| `TopK(ratio)` | `ratio` of the entries + their indices | with error feedback |
| `PowerSGD(rank)` | two rank-`rank` factors per matrix | with error feedback |
| `DGC(ratio)` | like `TopK`, with the momentum in the hook | momentum SGD, delayed |

`hook.stats()` reports the bytes of the last step; `hook.state(name)` returns
the state a hook made with `add_state`.
"""

from keras_dist.compression.base import AllReduceHook as AllReduceHook
from keras_dist.compression.base import CompressionStats as CompressionStats
from keras_dist.compression.base import NoCompression as NoCompression
from keras_dist.compression.casts import BF16 as BF16
from keras_dist.compression.casts import FP16 as FP16
from keras_dist.compression.dgc import DGC as DGC
from keras_dist.compression.powersgd import PowerSGD as PowerSGD
from keras_dist.compression.topk import TopK as TopK

__all__ = [
    "BF16",
    "DGC",
    "FP16",
    "AllReduceHook",
    "CompressionStats",
    "NoCompression",
    "PowerSGD",
    "TopK",
]
