"""`ShardedOptimizer` (ZeRO stages 1 and 2): the unsharded result with 1/N of
the optimizer state per replica.

Every test compares with the same training unsharded (one device, the global
batch): weights after about 100 updates to 1e-6 (float32) or 1e-3 (mixed
precision).
"""

import json
import math

import keras
import numpy as np
import pytest
import sharding_workers
import tensorflow as tf
from helpers import (
    SEGMENT_BYTES,
    Boom,
    assert_config_round_trip,
    compile_model,
    make_data,
    max_abs_diff,
    mlp,
)
from sharding_workers import INNER, OWNED

import keras_dist
from keras_dist.backup import store
from keras_dist.callbacks import AutoScaleBatch, BackupAndRestore
from keras_dist.core.sharding import ShardLayout
from keras_dist.testing import run_workers

EXAMPLES = 192  # 12 updates of 16 per epoch: 108 updates in 9 epochs
EPOCHS = 9


def unsharded(name, batch_size, epochs=EPOCHS, policy=None):
    x, y = make_data(n=EXAMPLES)
    model = compile_model(mlp(keras_dist.DistributedModel), INNER[name](keras))
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


def sharded(strategy, name, micro_batch, steps=1, wrap_accumulation=False):
    x, y = make_data(n=EXAMPLES)
    with strategy.scope():
        if wrap_accumulation:
            optimizer = keras_dist.GradientAccumulationOptimizer(
                keras_dist.ShardedOptimizer(
                    INNER[name](keras), bucket_bytes=SEGMENT_BYTES
                ),
                steps,
            )
        else:
            optimizer = keras_dist.ShardedOptimizer(
                INNER[name](keras), accumulation_steps=steps, bucket_bytes=SEGMENT_BYTES
            )
        model = compile_model(mlp(keras_dist.DistributedModel), optimizer)
    model.fit(x, y, batch_size=micro_batch, epochs=EPOCHS, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("name", sorted(INNER))
def test_every_elementwise_optimizer_equals_unsharded_on_two_replicas(name, mirrored):
    reference = unsharded(name, batch_size=16)
    model = sharded(mirrored(2), name, micro_batch=16)
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * 12
    # Float32 rounding: the sum of two replicas' halves is not the one
    # device's mean to the bit. RMSprop's division by the root of a small
    # second moment grows it most: 1.19e-6 on an AMD EPYC host, the same with
    # one segment (`bucket_bytes=None`) and before segments existed.
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 2e-6


@pytest.mark.parametrize("name", ["adamw", "nadam", "clipnorm", "sgd"])
def test_four_replicas_equal_unsharded(name, mirrored):
    reference = unsharded(name, batch_size=16)
    model = sharded(mirrored(4), name, micro_batch=16)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6


@pytest.mark.parametrize("wrap_accumulation", [False, True], ids=["stage2", "stage1"])
@pytest.mark.parametrize("replicas", [2, 4])
def test_accumulation_equals_the_big_batch(replicas, wrap_accumulation, mirrored):
    # 4 micro-steps of 4 examples: one update of 16, as the reference.
    reference = unsharded("adam", batch_size=16)
    model = sharded(
        mirrored(replicas),
        "adam",
        micro_batch=4,
        steps=4,
        wrap_accumulation=wrap_accumulation,
    )
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * 12
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6


@pytest.mark.parametrize("steps", [1, 2])
def test_mixed_precision_equals_unsharded(steps, mirrored):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        strategy = mirrored(2)
        x, y = make_data(n=EXAMPLES)
        with strategy.scope():
            reference = compile_model(
                mlp(keras_dist.DistributedModel), keras.optimizers.Adam(0.01)
            )
        reference.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
        with strategy.scope():
            optimizer = keras_dist.ShardedOptimizer(
                keras.optimizers.Adam(0.01), accumulation_steps=steps
            )
            model = compile_model(mlp(keras_dist.DistributedModel), optimizer)
        # DistributedModel.compile put the loss scaling inside.
        assert isinstance(
            optimizer.inner_optimizer, keras.optimizers.LossScaleOptimizer
        )
        model.fit(x, y, batch_size=16 // steps, epochs=3, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    # Float16 rounding of two micro-batches' gradients against one batch's:
    # 1.9e-3 with accumulation on an AMD EPYC host, with one segment too.
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 3e-3
    assert int(model.optimizer.iterations.numpy()) == int(
        reference.optimizer.iterations.numpy()
    )


def test_a_plain_keras_model_trains_sharded(mirrored):
    reference = unsharded("adam", batch_size=16)
    x, y = make_data(n=EXAMPLES)
    with mirrored(2).scope():
        model = compile_model(
            mlp(), keras_dist.ShardedOptimizer(keras.optimizers.Adam(0.01))
        )
    model.fit(x, y, batch_size=16, epochs=EPOCHS, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6


@pytest.mark.parametrize("replicas", [2, 4])
def test_each_replica_keeps_one_nth_of_the_optimizer_state(replicas, mirrored):
    strategy = mirrored(replicas)
    model = sharded(strategy, "adam", micro_batch=16)
    reference = unsharded("adam", batch_size=16, epochs=1)
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    unsharded_bytes = sum(
        int(np.prod(v.shape)) * 4
        for v in reference.optimizer.variables
        if tuple(v.shape) != ()
    )
    assert unsharded_bytes == 2 * parameters * 4  # Adam: two slots
    inner = model.optimizer.inner_optimizer
    per_replica = []
    for replica in range(replicas):
        per_replica.append(
            sum(
                int(
                    np.prod(strategy.experimental_local_results(v.value)[replica].shape)
                )
                * 4
                for v in inner.variables
                if tuple(v.shape) != ()
            )
        )
    slice_size = -(-parameters // replicas)
    assert per_replica == [2 * slice_size * 4] * replicas
    # 1/N of the unsharded state, plus the padding to a multiple of N.
    assert per_replica[0] - unsharded_bytes / replicas < 2 * 4 * replicas


def test_a_keras_file_saved_on_two_replicas_resumes_on_four(tmp_path, mirrored):
    x, y = make_data(n=EXAMPLES)
    reference = compile_model(mlp(keras_dist.DistributedModel), INNER["adam"](keras))
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    with mirrored(2).scope():
        model = compile_model(
            mlp(keras_dist.DistributedModel),
            keras_dist.ShardedOptimizer(INNER["adam"](keras)),
        )
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / "model.keras")
    with mirrored(4).scope():
        loaded = keras.saving.load_model(tmp_path / "model.keras")
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_abs_diff(reference.get_weights(), loaded.get_weights()) < 1e-6
    # The weights load into a plain keras.Model of the same architecture.
    model.save_weights(tmp_path / "model.weights.h5")
    plain = mlp()
    plain.load_weights(tmp_path / "model.weights.h5")
    assert max_abs_diff(plain.get_weights(), model.get_weights()) == 0


def fit_backed_up(strategy, make_optimizer, folder, batch_size, crash_at=None):
    """Fits `mlp` for 2 epochs, a backup every 5 batches; `None` when `Boom`
    stopped it after batch `crash_at`."""
    x, y = make_data(n=EXAMPLES)
    with strategy.scope():
        model = compile_model(mlp(keras_dist.DistributedModel), make_optimizer())
    callbacks = [BackupAndRestore(str(folder), save_freq=5)]
    if crash_at:
        callbacks.append(Boom(crash_at))
    try:
        model.fit(
            x,
            y,
            batch_size=batch_size,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
    except KeyboardInterrupt:
        return None
    return model


def test_backup_and_restore_resumes_sharded_accumulation_exactly(tmp_path, mirrored):
    strategy = mirrored(2)

    def run(folder, crash_at=None):
        return fit_backed_up(
            strategy,
            lambda: keras_dist.ShardedOptimizer(
                INNER["adam"](keras), accumulation_steps=2
            ),
            tmp_path / folder,
            batch_size=8,
            crash_at=crash_at,
        )

    reference = run("r")
    assert run("b", crash_at=17) is None  # mid-epoch, mid-accumulation
    resumed = run("b")
    assert max_abs_diff(reference.get_weights(), resumed.get_weights()) < 1e-6
    assert int(resumed.optimizer.iterations.numpy()) == int(
        reference.optimizer.iterations.numpy()
    )


def test_training_state_reshards_the_slices(mirrored):
    model = sharded(mirrored(2), "adam", micro_batch=16)
    entries = [e for e in model.training_state() if e.rule == "shard"]
    # The parameter slice and Adam's two slots.
    assert len(entries) == 3
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert {e.length for e in entries} == {parameters}
    # mlp's variables in three segments (SEGMENT_BYTES), padded apart.
    assert {e.shard_segments for e in entries} == {(128, 16, 51)}
    assert {e.shape for e in entries} == {(64 + 8 + 26,)}


def test_a_backup_of_the_flat_layout_resumes_in_segments(tmp_path, mirrored):
    # Backups written before the slices were laid out by segments hold one
    # segment (the whole vector split in N) and say nothing of segments:
    # one written with `bucket_bytes=None`, its manifest stripped of them,
    # resumes in the segmented layout as if it had not stopped.
    strategy = mirrored(2)

    def run(folder, bucket_bytes, crash_at=None):
        return fit_backed_up(
            strategy,
            lambda: keras_dist.ShardedOptimizer(
                INNER["adam"](keras), bucket_bytes=bucket_bytes
            ),
            tmp_path / folder,
            batch_size=16,
            crash_at=crash_at,
        )

    reference = run("r", SEGMENT_BYTES)
    assert run("b", None, crash_at=17) is None
    manifests = list((tmp_path / "b").glob("*/manifest.json"))
    assert manifests
    for path in manifests:
        manifest = json.loads(path.read_text())
        shards = [v for v in manifest["variables"] if v["rule"] == "shard"]
        assert len(shards) == 3 and all(v.pop("segments") == [195] for v in shards)
        manifest[store.MANIFEST_CHECKSUM] = store.manifest_checksum(manifest)
        path.write_text(json.dumps(manifest))
    resumed = run("b", SEGMENT_BYTES)
    assert max_abs_diff(reference.get_weights(), resumed.get_weights()) < 1e-6


@pytest.mark.parametrize("saved, loaded", [(SEGMENT_BYTES, None), (None, 8)])
def test_a_keras_file_loads_whatever_the_segments(tmp_path, mirrored, saved, loaded):
    # `.keras` files hold the state in the variables' order, whatever the
    # layout: one saved in segments loads with others, and the slots train
    # on as they would have.
    x, y = make_data(n=EXAMPLES)
    with mirrored(2).scope():
        model = compile_model(
            mlp(keras_dist.DistributedModel),
            keras_dist.ShardedOptimizer(INNER["adam"](keras), bucket_bytes=saved),
        )
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / "model.keras")
    with mirrored(2).scope():
        other = compile_model(
            mlp(keras_dist.DistributedModel),
            keras_dist.ShardedOptimizer(INNER["adam"](keras), bucket_bytes=loaded),
        )
        other.build((None, 8))
        other.optimizer.build(other.trainable_variables)
        other.load_weights(tmp_path / "model.keras")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    other.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_abs_diff(model.get_weights(), other.get_weights()) < 1e-6


def test_no_vector_of_the_whole_model_on_the_step(mirrored):
    # The gradients are reduce-scattered and the weights gathered segment by
    # segment: no op of the traced step makes a vector as long as the model
    # (with one segment, the flatten, the received rows and the gathered
    # vector each are: memory at the peak that unsharded training has not).
    x, y = make_data(n=32)

    def largest_vector(bucket_bytes):
        strategy = mirrored(2)
        with strategy.scope():
            model = mlp(keras_dist.DistributedModel)
            optimizer = keras_dist.ShardedOptimizer(
                INNER["adam"](keras), bucket_bytes=bucket_bytes
            )
            optimizer.build(model.trainable_variables)

        @tf.function
        def step(x, y):
            def replica(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(
                        keras.losses.sparse_categorical_crossentropy(
                            y, model(x), from_logits=True
                        )
                    )
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply(grads, model.trainable_variables)

            strategy.run(replica, (x, y))

        graph = step.get_concrete_function(x[:16], y[:16]).graph
        return max(
            int(output.shape[0])
            for op in graph.get_operations()
            for output in op.outputs
            if output.shape.rank == 1 and output.shape[0] is not None
        )

    assert largest_vector(SEGMENT_BYTES) < 195 <= largest_vector(None)


# One launch of 2 worker processes for every 2-process case of the sharded
# optimizer (a cluster start costs ~20 s of CPU here): elementwise ones
# (stage 1), stage 2, and whole-variable ownership with its .keras files.
TWO_WORKER_CASES = [
    *((name, 1, 8, None) for name in ["adam", "adamw", "clipnorm"]),
    ("sgd", 4, 2, None),
    *((name, 1, 8, None) for name in sorted(OWNED)),
]


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """`(results by case name per worker, the folder of their .keras files)`."""
    folder = tmp_path_factory.mktemp("two_workers")
    results = run_workers(
        sharding_workers.sharded_cases,
        num_workers=2,
        args=(TWO_WORKER_CASES,),
        kwargs={"save_to": str(folder)},
        timeout=600,
    )
    names = [case[0] for case in TWO_WORKER_CASES]
    return [dict(zip(names, worker)) for worker in results], folder


def reference_of(name, inner):
    x, y = make_data()
    reference = compile_model(mlp(keras_dist.DistributedModel), inner[name](keras))
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return reference


@pytest.mark.multiworker
def test_two_worker_processes_equal_unsharded(two_workers):
    results, _ = two_workers
    for name in ["adam", "adamw", "clipnorm", "sgd"]:
        reference = reference_of(name, INNER)
        for worker in results:
            got = worker[name]
            assert max_abs_diff(reference.get_weights(), got["weights"]) < 1e-6, name
            # Each worker's one replica holds half of each slot.
            parameters = sum(
                int(np.prod(v.shape)) for v in reference.trainable_variables
            )
            assert got["slot_shape"] == [(-(-parameters // 2),)]


@pytest.mark.multiworker
def test_two_worker_processes_shard_whole_variables_as_unsharded(two_workers):
    # Adafactor, Lamb and Muon (tests/test_sharding_ownership.py has the
    # rest of their checks; this launch is shared).
    results, folder = two_workers
    for name in sorted(OWNED):
        reference = reference_of(name, OWNED)
        for worker in results:
            got = worker[name]
            tolerance = 5e-6 if name == "muon" else 1e-6
            assert max_abs_diff(reference.get_weights(), got["weights"]) < tolerance
        # Each worker keeps the state of its replica's variables only.
        assert [r[name]["owned"] for r in results] == [[0], [1, 2, 3]]
        # Each worker's .keras file holds every variable's state, the other
        # worker's share gathered: the two files are the same.
        states = [
            keras.saving.load_model(folder / f"{name}-{task}.keras").optimizer._owned
            for task in (0, 1)
        ]
        for index in range(len(states[0].variables)):
            first, second = ([v.numpy() for v in s.slots(index)] for s in states)
            assert max_abs_diff(first, second) == 0
            assert any(np.any(v != 0) for v in first), (name, index)


# --- Refusals and configuration ---


@pytest.mark.parametrize(
    ("inner", "match"),
    [
        (lambda: keras.optimizers.Adafactor(), "Adafactor needs a whole variable"),
        (lambda: keras.optimizers.Lamb(), "Lamb needs a whole variable"),
        (lambda: keras.optimizers.Adam(use_ema=True), "moving average"),
        (
            lambda: keras_dist.GradientAccumulationOptimizer(
                keras.optimizers.Adam(), 2
            ),
            "Wrap accumulation around the ShardedOptimizer",
        ),
        (lambda: "adam", "must be a `keras.optimizers.Optimizer`"),
    ],
)
def test_what_cannot_be_sharded_is_refused_by_name(inner, match):
    # Sharded by elements (`"auto"` shards Adafactor and Lamb by variables:
    # tests/test_sharding_ownership.py).
    with pytest.raises((ValueError, TypeError), match=match):
        keras_dist.ShardedOptimizer(inner(), shard_by="elements")


def test_a_hook_that_compresses_an_all_reduce_is_refused(mirrored):
    x, y = make_data(n=32)
    with mirrored(2).scope():
        model = compile_model(
            mlp(keras_dist.DistributedModel),
            keras_dist.ShardedOptimizer(keras.optimizers.Adam()),
        )
        model.register_all_reduce_hook(keras_dist.compression.TopK(0.1))
    with pytest.raises(ValueError, match="only the casts"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def cast_sharded(strategy, hook, loss_scale=1.0, sharded=True, inner="sgd"):
    x, y = make_data(n=EXAMPLES)
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with strategy.scope():
        # Plain SGD: its update is proportional to the gradient, so the
        # weights show the size of the wire's rounding. Adam divides by the
        # root of the second moment, and on elements whose gradient is near
        # zero turns any rounding difference into a step of the full rate.
        optimizer = keras.optimizers.SGD(0.1) if inner == "sgd" else INNER[inner](keras)
        if sharded:
            optimizer = keras_dist.ShardedOptimizer(optimizer)
        model = mlp(keras_dist.DistributedModel)
        if hook is not None:
            model.register_all_reduce_hook(hook)
        model.compile(
            optimizer=optimizer,
            loss=lambda t, p: loss_scale * cross_entropy(t, p),
        )
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("cast", ["FP16", "BF16"])
def test_cast_hooks_send_the_reduce_scatter_in_16_bits(cast, mirrored):
    strategy = mirrored(2)
    hook = getattr(keras_dist.compression, cast)()
    model = cast_sharded(strategy, hook)
    exact = cast_sharded(strategy, None)
    unsharded_hook = getattr(keras_dist.compression, cast)()
    unsharded = cast_sharded(strategy, unsharded_hook, sharded=False)
    # Each replica's gradient rounds once to 16 bits (the sum is float32):
    # as close to the exact run as the unsharded hook, which also rounds
    # the sum (measured: FP16 4.0e-5 against 4.7e-5, BF16 6.9e-4 against
    # 5.8e-4 after 3 epochs).
    sharded_error = max_abs_diff(exact.get_weights(), model.get_weights())
    unsharded_error = max_abs_diff(exact.get_weights(), unsharded.get_weights())
    assert 0 < sharded_error <= 1.5 * unsharded_error + 1e-6, (
        sharded_error,
        unsharded_error,
    )
    # The reduce-scatter's bytes are half of float32's (raw / sent).
    assert hook.stats().ratio == pytest.approx(2.0)


def test_fp16_overflow_is_sent_again_at_full_precision(mirrored):
    # Gradients of a loss x 1e6 exceed float16's 65504 on every step: each
    # step is sent again in float32, so the result is the uncompressed one.
    strategy = mirrored(2)
    hook = keras_dist.compression.FP16()
    model = cast_sharded(strategy, hook, loss_scale=1e6, inner="adam")
    exact = cast_sharded(strategy, None, loss_scale=1e6, inner="adam")
    assert max_abs_diff(exact.get_weights(), model.get_weights()) < 1e-6
    assert hook.overflow_steps == int(model.optimizer.iterations.numpy()) > 0


def test_config_round_trip():
    optimizer = keras_dist.ShardedOptimizer(
        keras.optimizers.AdamW(0.01, weight_decay=0.2), accumulation_steps=3, name="z"
    )
    clone = assert_config_round_trip(optimizer)
    assert clone.accumulation_steps == 3
    assert isinstance(clone.inner_optimizer, keras.optimizers.AdamW)
    with pytest.raises(ValueError, match="Set `clipnorm` on the `inner_optimizer`"):
        keras_dist.ShardedOptimizer(keras.optimizers.Adam(), clipnorm=1.0)


def test_no_strategy_trains_unsharded_alike():
    reference = unsharded("adamw", batch_size=16)
    model = sharded(tf.distribute.get_strategy(), "adamw", micro_batch=16)
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6


def autoscaled(strategy, sharded_inner, steps):
    x, y = make_data(n=64)
    with strategy.scope():
        inner = keras.optimizers.SGD(0.1, momentum=0.9)
        if sharded_inner:
            inner = keras_dist.ShardedOptimizer(inner)
        optimizer = keras_dist.GradientAccumulationOptimizer(inner, steps)
        model = compile_model(mlp(keras_dist.DistributedModel), optimizer)
    autoscale = AutoScaleBatch(4, base_batch_size=4, lr_scaling="sqrt", warmup_epochs=1)
    history = model.fit(x, y, epochs=2, shuffle=False, callbacks=[autoscale], verbose=0)
    return model, history.history


def test_auto_scale_batch_scales_stage_one_as_unsharded(mirrored):
    strategy = mirrored(2)
    model, history = autoscaled(strategy, True, 2)
    reference, reference_history = autoscaled(strategy, False, 2)
    assert history["batch_size"] == reference_history["batch_size"] == [16, 16]
    np.testing.assert_allclose(
        history["learning_rate"], reference_history["learning_rate"], rtol=1e-6
    )
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6


def test_auto_scale_batch_refuses_stage_two(mirrored):
    # AutoScaleBatch would count a batch 2x too small and scale the rate
    # for it: refused, naming the stage-1 form it can count and grow.
    x, y = make_data(n=64)
    with mirrored(2).scope():
        optimizer = keras_dist.ShardedOptimizer(
            keras.optimizers.SGD(0.1), accumulation_steps=2
        )
        model = compile_model(mlp(keras_dist.DistributedModel), optimizer)
    with pytest.raises(ValueError, match=r"GradientAccumulationOptimizer\(Sharded"):
        model.fit(x, y, epochs=1, callbacks=[AutoScaleBatch(4)], verbose=0)


@pytest.mark.parametrize("bucket_bytes", [None, 8, 24])
@pytest.mark.parametrize("replicas", [1, 2, 5, 20])
def test_layout_reads_a_replicas_slice_without_the_whole_vector(replicas, bucket_bytes):
    # `local_of` reads only the parts of the variables a slice covers (the
    # update's refresh of the slice from the weights); it must equal the
    # replica's row of the saved layout (`to_slices`), padding included,
    # whether the replica id is known when tracing or not; and `positions`
    # must find every element of the variables in its owner's slice.
    shapes = [(3, 2), (5,), (1,), (2, 2)]
    layout = ShardLayout(shapes, replicas, bucket_bytes=bucket_bytes)
    assert sum(layout.segments) == layout.total == 16
    tensors = [
        tf.reshape(tf.range(start, start + math.prod(shape), dtype=tf.float64), shape)
        for start, shape in zip([1, 100, 200, 300], shapes)
    ]
    whole = layout.flatten(tensors, tf.float32).numpy()
    stack = layout.to_slices(whole)
    assert stack.shape == (replicas, layout.slice_size)
    np.testing.assert_array_equal(layout.to_whole(stack), whole)
    dynamic = tf.function(
        lambda r: layout.local_of(tensors, r, tf.float32),
        input_signature=[tf.TensorSpec([], tf.int32)],
    )
    numbers = np.arange(layout.total, dtype=np.int32)
    found = np.zeros(layout.total)
    for replica in range(replicas):
        static = layout.local_of(tensors, tf.constant(replica), tf.float32)
        assert static.dtype == tf.float32
        np.testing.assert_array_equal(static.numpy(), stack[replica])
        np.testing.assert_array_equal(dynamic(replica).numpy(), stack[replica])
        np.testing.assert_array_equal(
            layout.local(whole, tf.constant(replica)).numpy(), stack[replica]
        )
        np.testing.assert_array_equal(
            layout.local(numbers, replica, fill=-1).numpy(),
            layout.to_slices(numbers + 1)[replica] - 1,
        )
        mine, at = layout.positions(tf.range(layout.total), replica)
        found[mine.numpy()] = stack[replica][at.numpy()]
    np.testing.assert_array_equal(found, whole)
    # The segments are read from the last variable back, whole variables each.
    if bucket_bytes == 8:
        assert layout.segments == [6, 6, 4]  # (5,) and (1,) share one
        assert layout.issue_order == [2, 1, 0]


class ScaledByNorm(keras.optimizers.SGD):
    """LARS-like: the step of an element reads its whole variable's norm."""

    def update_step(self, gradient, variable, learning_rate):
        scale = 1.0 / (1.0 + keras.ops.norm(variable))
        variable.assign_sub(gradient * learning_rate * scale)


class ElementwiseSGD(keras.optimizers.SGD):
    """Its own update rule, declared elementwise."""

    elementwise = True

    def update_step(self, gradient, variable, learning_rate):
        variable.assign_sub(gradient * learning_rate)


def test_a_subclass_with_its_own_update_rule_must_say_it_is_elementwise():
    with pytest.raises(
        ValueError, match=r"ScaledByNorm.*own update_step.*elementwise = True"
    ):
        keras_dist.ShardedOptimizer(ScaledByNorm(0.1), shard_by="elements")
    # By default such a subclass is sharded by whole variables (exact).
    assert keras_dist.ShardedOptimizer(ScaledByNorm(0.1)).shard_by == "variables"
    assert keras_dist.ShardedOptimizer(ElementwiseSGD(0.1)).shard_by == "elements"
    # A subclass that only changes defaults keeps its base's rule.
    keras_dist.ShardedOptimizer(type("Tuned", (keras.optimizers.Adam,), {})(0.1))
