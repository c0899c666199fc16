"""`ShardedOptimizer` over GPUs: the NCCL all-to-all and all-gather.

On GPUs `MirroredStrategy`'s collectives run on NCCL, so the sharded update's
reduce-scatter (an all-to-all plus a local sum) and all-gather take another
code path than on CPUs. Marked `gpu`: skipped where TensorFlow sees no GPU,
and a sharded run needs two (NCCL puts one replica on each GPU).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import compile_model, make_data, max_abs_diff, mlp
from sharding_workers import INNER

import keras_dist
from keras_dist.core import collectives


@pytest.fixture
def gpu_strategy():
    """MirroredStrategy over every visible GPU (NCCL), without TF32.

    TF32 matrix products (on by default on Ampere and newer) round to 10
    bits of mantissa; the comparison with the unsharded run is float32's.
    """
    gpus = tf.config.list_logical_devices("GPU")
    if len(gpus) < 2:
        pytest.skip(f"a sharded run needs 2 GPUs; TensorFlow sees {len(gpus)}")
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    try:
        yield tf.distribute.MirroredStrategy([gpu.name for gpu in gpus])
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(tf32)


@pytest.mark.gpu
def test_reduce_scatter_and_all_gather_over_nccl(gpu_strategy):
    replicas = gpu_strategy.num_replicas_in_sync
    size = 3 * replicas
    values = [np.arange(size, dtype="float32") * (r + 1) for r in range(replicas)]
    per_replica = gpu_strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(values[ctx.replica_id_in_sync_group])
    )

    @tf.function
    def step(flat):
        def replica_fn(flat):
            local = collectives.reduce_scatter(flat)
            return local, collectives.all_gather(local[None], axis=0)

        return gpu_strategy.run(replica_fn, (flat,))

    local, gathered = step(per_replica)
    total = np.sum(values, axis=0)
    for replica, (piece, whole) in enumerate(
        zip(
            gpu_strategy.experimental_local_results(local),
            gpu_strategy.experimental_local_results(gathered),
        )
    ):
        assert "GPU" in piece.device
        np.testing.assert_array_equal(
            piece.numpy(), total[3 * replica : 3 * replica + 3]
        )
        np.testing.assert_array_equal(whole.numpy().reshape(-1), total)


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("name", ["adam", "adamw", "global_clipnorm"])
def test_sharded_over_the_gpus_equals_unsharded(gpu_strategy, name, steps):
    replicas = gpu_strategy.num_replicas_in_sync
    global_batch = 4 * replicas * steps
    x, y = make_data(n=12 * global_batch)
    reference = compile_model(mlp(keras_dist.DistributedModel), INNER[name](keras))
    reference.fit(x, y, batch_size=global_batch, epochs=3, shuffle=False, verbose=0)
    with gpu_strategy.scope():
        optimizer = keras_dist.ShardedOptimizer(
            INNER[name](keras), accumulation_steps=steps
        )
        model = compile_model(mlp(keras_dist.DistributedModel), optimizer)
    model.fit(
        x, y, batch_size=global_batch // steps, epochs=3, shuffle=False, verbose=0
    )
    assert int(model.optimizer.iterations.numpy()) == 36
    # Each GPU holds 1/N of Adam's slots.
    slots = optimizer.inner_optimizer.variables[-1]
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    shapes = {
        tuple(c.shape) for c in gpu_strategy.experimental_local_results(slots.value)
    }
    assert shapes == {(-(-parameters // replicas),)}
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-5
