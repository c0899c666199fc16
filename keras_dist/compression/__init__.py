"""Gradient all-reduce hooks: how replicas combine their gradients.

Every hook implements `AllReduceHook`; pass one to
`DistributedModel(..., all_reduce_hook=...)` or
`GradientAccumulationOptimizer(..., all_reduce_hook=...)`.
"""

from keras_dist.compression.base import AllReduceHook as AllReduceHook
from keras_dist.compression.base import CompressionStats as CompressionStats
from keras_dist.compression.base import NoCompression as NoCompression

__all__ = ["AllReduceHook", "CompressionStats", "NoCompression"]
