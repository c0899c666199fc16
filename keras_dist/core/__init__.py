"""keras_dist's core: the gradient path both Keras front ends share.

Pure TensorFlow; nothing here imports Keras (a test imports the core with
`keras` blocked). From the bottom up:

- `topology`: where this process sits in a strategy (replicas, workers).
- `gloo_group`: one worker's member of a gloo process group (PyTorch's
  c10d): the sums, all-to-alls and all-gathers it carries; `gloo`: the
  choice of that backend for CPU workers' collectives (by default where
  PyTorch is installed, `KERAS_DIST_COLLECTIVES`).
- `collectives`: the collective layer (owns collective keys; all-reduce,
  all-gather, buckets, packing); every collective of the package.
- `hooks`: the all-reduce hook protocol; `plain`, `casts`, `topk`,
  `powersgd`, `dgc`: the built-in hooks' algorithms; `optimizer_view`: what
  a hook may know of the optimizer (each front end builds it).
- `aggregation`: weighing by batch share and the hook's reduction;
  `accumulation`: the gradient-accumulation cycle; `statistics`: the
  squared norms behind the gradient noise scale.
- `inventory`: the one inventory of training state that backups read.

The Keras 3 front end (`DistributedModel`, `GradientAccumulationOptimizer`,
the callbacks) and the tf_keras one (`keras_dist.tf_keras`) build on it.
"""
