"""Gradient buckets: the plan, exact sums per bucket, and the overlap structure.

`plan_buckets` groups gradients so that each bucket's collective can start
while the backward pass still computes earlier layers' gradients. These tests
check the plan itself, that bucketed hooks sum exactly what unbucketed ones
do (2 logical replicas, and `DistributedModel.fit` against one device), and,
in 2 real worker processes, that the traced step lets the first gradient
collective run before the first layer's gradient exists (the property the
overlap relies on; `benchmarks/bench_overlap.py` measures the time it saves).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    Harness,
    assert_config_round_trip,
    compile_model,
    exact_sum,
    make_data,
    max_abs_diff,
    mlp,
)

import keras_dist
from keras_dist.compression import (
    BF16,
    DEFAULT_BUCKET_BYTES,
    FP16,
    NoCompression,
    VariableSpec,
    all_reduce_flat,
    all_reduce_sum,
    plan_buckets,
)
from keras_dist.core import collectives as plan_module
from keras_dist.core import plain as plain_module
from keras_dist.testing import run_workers

F32 = tf.float32


def spec(*shape, dtype=F32):
    return VariableSpec("v", tuple(shape), tf.as_dtype(dtype))


# --- The plan -----------------------------------------------------------------


def test_plan_walks_the_variables_backwards_and_closes_full_buckets():
    # 4-byte floats: sizes 400, 40, 400, 40, 4000 bytes.
    specs = [spec(100), spec(10), spec(100), spec(10), spec(1000)]
    assert plan_buckets(specs, 400) == [[4], [3, 2], [1, 0]]
    assert plan_buckets(specs, 1) == [[4], [3], [2], [1], [0]]
    assert plan_buckets(specs, 10**9) == [[4, 3, 2, 1, 0]]


def test_plan_without_buckets_is_one_group_per_dtype_in_input_order():
    specs = [spec(3), spec(2, dtype="float16"), spec(4), spec(5, dtype="int32")]
    assert plan_buckets(specs, None) == [[0, 2], [1], [3]]


def test_plan_fills_one_bucket_per_dtype_in_the_order_first_reached():
    specs = [
        spec(50),
        spec(100, dtype="float16"),
        spec(50),
        spec(100, dtype="float16"),
        spec(50),
    ]
    # 200 bytes each. float32 reaches 400 bytes with positions 4 and 2,
    # float16 with 3 and 1; position 0 is left in a bucket of its own.
    assert plan_buckets(specs, 400) == [[4, 2], [3, 1], [0]]


def test_plan_puts_each_sparse_gradient_alone_in_its_place():
    sparse = tf.IndexedSlices(
        tf.ones((2, 4)), tf.constant([0, 3]), tf.constant([10, 4], tf.int64)
    )
    tensors = [sparse, tf.ones((8,)), tf.ones((8,))]
    assert plan_buckets(tensors, 10**6) == [[2, 1], [0]]
    assert plan_buckets(tensors, None) == [[0], [1, 2]]


def test_plan_covers_every_position_once_and_is_deterministic():
    rng = np.random.default_rng(0)
    dtypes = ["float32", "float16", "bfloat16", "float64", "int32"]
    specs = [
        spec(int(rng.integers(1, 5000)), dtype=dtypes[int(rng.integers(0, 5))])
        for _ in range(60)
    ]
    for bucket_bytes in (None, 1, 1000, 20_000, 10**9):
        plan = plan_buckets(specs, bucket_bytes)
        assert sorted(p for bucket in plan for p in bucket) == list(range(60))
        assert all(len({specs[p].dtype for p in bucket}) == 1 for bucket in plan)
        assert plan == plan_buckets(list(specs), bucket_bytes)


@pytest.mark.parametrize(
    "value, error",
    [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)],
)
@pytest.mark.parametrize("hook_class", [NoCompression, FP16, BF16])
def test_bad_bucket_bytes_name_the_argument(hook_class, value, error):
    with pytest.raises(
        error, match=r"`bucket_bytes` must be .*Received: bucket_bytes="
    ):
        hook_class(bucket_bytes=value)
    with pytest.raises(error, match="bucket_bytes"):
        plan_buckets([spec(3)], value)


@pytest.mark.parametrize("hook_class", [NoCompression, FP16, BF16])
@pytest.mark.parametrize("bucket_bytes", [None, 1, DEFAULT_BUCKET_BYTES])
def test_bucket_bytes_round_trips_through_the_config(hook_class, bucket_bytes):
    hook = hook_class(bucket_bytes=bucket_bytes)
    assert hook.bucket_bytes == bucket_bytes
    clone = assert_config_round_trip(hook)
    assert clone.bucket_bytes == bucket_bytes
    if bucket_bytes == DEFAULT_BUCKET_BYTES:
        assert repr(hook) == f"{hook_class.__name__}()"
    else:
        assert f"bucket_bytes={bucket_bytes!r}" in repr(hook)


def test_built_in_default_and_custom_hook_default():
    assert NoCompression().bucket_bytes == DEFAULT_BUCKET_BYTES == 4 * 2**20

    class Custom(keras_dist.compression.AllReduceHook):
        def reduce(self, gradients, variables):
            return all_reduce_sum(gradients, self.bucket_bytes)

    # A hook written before buckets keeps one collective per dtype.
    assert Custom().bucket_bytes is None


# --- Sums per bucket on 2 replicas --------------------------------------------

SHAPES = [(3, 3, 4, 16), (16,), (64, 48), (48,), (48, 10), (10,)]


def record_all_reduce_sum(monkeypatch):
    calls = []
    original = plain_module.all_reduce_sum

    def recording(tensors, bucket_bytes=None):
        calls.append([tuple(t.shape) for t in tensors])
        return original(tensors, bucket_bytes)

    monkeypatch.setattr(plain_module, "all_reduce_sum", recording)
    return calls


@pytest.mark.parametrize("bucket_bytes", [None, 1, 2000, 13_000, 10**9])
def test_no_compression_sums_each_bucket_exactly_in_plan_order(
    mirrored, monkeypatch, bucket_bytes
):
    calls = record_all_reduce_sum(monkeypatch)
    per_replica = [random_grads_for(SHAPES, seed=r) for r in range(2)]
    hook = NoCompression(bucket_bytes=bucket_bytes)
    results = Harness(mirrored(2), hook, SHAPES).reduce(per_replica)
    for got, want in zip(results, exact_sum(per_replica)):
        np.testing.assert_array_equal(got[0], want)
        np.testing.assert_array_equal(got[1], want)
    plan = plan_buckets([spec(*s) for s in SHAPES], bucket_bytes)
    # Each replica (a thread of MirroredStrategy) issues one call per bucket;
    # they meet at every collective, so the calls come in pairs.
    expected = [[SHAPES[p] for p in bucket] for bucket in plan]
    assert calls == [call for call in expected for _ in range(2)]


def random_grads_for(shapes, seed):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape).astype("float32") for shape in shapes]


@pytest.mark.parametrize("hook_class", [FP16, BF16])
def test_casts_per_bucket_equal_the_single_collective(mirrored, hook_class):
    per_replica = [random_grads_for(SHAPES, seed=r) for r in range(2)]
    single = Harness(mirrored(2), hook_class(bucket_bytes=None), SHAPES)
    bucketed = Harness(mirrored(2), hook_class(bucket_bytes=1), SHAPES)
    for want, got in zip(single.reduce(per_replica), bucketed.reduce(per_replica)):
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_helpers_sum_mixed_dtypes_per_bucket(mirrored):
    strategy = mirrored(2)
    shapes = [(5,), (7, 3), (4,), (6,)]
    dtypes = ["float32", "float16", "int32", "float32"]

    def values(ctx):
        r = ctx.replica_id_in_sync_group + 1
        return [tf.cast(tf.fill(s, r), d) for s, d in zip(shapes, dtypes)]

    inputs = strategy.experimental_distribute_values_from_function(values)
    for helper in (all_reduce_sum, all_reduce_flat):
        for bucket_bytes in (None, 1, 30):

            @tf.function
            def step(inputs, helper=helper, bucket_bytes=bucket_bytes):
                return strategy.run(lambda t: helper(list(t), bucket_bytes), (inputs,))

            out = step(inputs)
            for tensor, shape, dtype in zip(out, shapes, dtypes):
                local = strategy.experimental_local_results(tensor)
                for value in local:
                    assert value.dtype == tf.as_dtype(dtype)
                    np.testing.assert_array_equal(value.numpy(), np.full(shape, 3))


# --- DistributedModel with buckets equals one device --------------------------


def embedding_model(seed=3):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(40, 8)(inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(32, activation="relu")(x)
    outputs = keras.layers.Dense(3)(x)  # logits, as compile_model's loss expects
    return keras_dist.DistributedModel(inputs, outputs)


def fit(model_fn, strategy, hook, x, y):
    with strategy.scope():
        model = compile_model(model_fn(), keras.optimizers.SGD(0.1, momentum=0.9))
        model.register_all_reduce_hook(hook)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.mark.parametrize("bucket_bytes", [1, 600])
def test_fit_with_buckets_equals_one_device(mirrored, bucket_bytes):
    """MLP and an Embedding model (sparse gradient in the buckets), 2 replicas."""
    x, y = make_data()
    for model_fn, inputs in (
        (lambda: mlp(keras_dist.DistributedModel), x),
        (embedding_model, (np.abs(x[:, :6]) * 7).astype("int32") % 40),
    ):
        reference = fit(
            model_fn, tf.distribute.get_strategy(), NoCompression(), inputs, y
        )
        bucketed = fit(model_fn, mirrored(2), NoCompression(bucket_bytes), inputs, y)
        assert max_abs_diff(reference, bucketed) < 1e-5


class CreatedBackwards(keras_dist.DistributedModel):
    """Layers created in the reverse of the order they are called in, so
    `trainable_variables` lists the last layer first."""

    def __init__(self):
        super().__init__()
        self.head = keras.layers.Dense(3, name="head")
        self.middle = keras.layers.Dense(32, activation="tanh", name="middle")
        self.stem = keras.layers.Dense(32, activation="tanh", name="stem")

    def call(self, x):
        return self.head(self.middle(self.stem(x)))


class RecordingPlan(NoCompression):
    """Records, per traced `reduce`, the layer of each bucket's variables."""

    def __init__(self, bucket_bytes):
        super().__init__(bucket_bytes=bucket_bytes)
        self.plans = []

    def reduce(self, gradients, variables):
        plan = self.buckets(gradients)
        self.plans.append(
            [[variables[p].path.split("/")[-2] for p in bucket] for bucket in plan]
        )
        return super().reduce(gradients, variables)


@pytest.mark.parametrize("replicas", [1, 2])
def test_buckets_follow_the_order_the_backward_pass_computes(mirrored, replicas):
    # Walking `trainable_variables` backwards would send the stem (computed
    # last) first and hold every other bucket behind it; the plan read from
    # the traced step sends the head first, as the backward pass computes it.
    x, y = make_data(n=32)
    hook = RecordingPlan(bucket_bytes=1)
    with mirrored(replicas).scope():
        model = compile_model(CreatedBackwards(), keras.optimizers.SGD(0.1))
        model.register_all_reduce_hook(hook)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.trainable_variables[0].path.split("/")[-2] == "head"
    assert hook.plans
    for plan in hook.plans:
        layers = [bucket[0] for bucket in plan]
        assert layers == ["head", "head", "middle", "middle", "stem", "stem"]


def test_a_model_listed_in_call_order_keeps_the_reverse_plan(mirrored):
    x, y = make_data(n=32)
    hook = RecordingPlan(bucket_bytes=1)
    with mirrored(2).scope():
        model = compile_model(
            mlp(keras_dist.DistributedModel), keras.optimizers.SGD(0.1)
        )
        model.register_all_reduce_hook(hook)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    specs = [spec(*v.shape) for v in model.trainable_variables]
    names = [v.path.split("/")[-2] for v in model.trainable_variables]
    expected = [[names[p] for p in bucket] for bucket in plan_buckets(specs, 1)]
    assert hook.plans and all(plan == expected for plan in hook.plans)


def test_fit_of_a_model_listed_backwards_with_buckets_equals_one_device(mirrored):
    x, y = make_data()

    def train(strategy, hook):
        with strategy.scope():
            model = compile_model(
                CreatedBackwards(), keras.optimizers.SGD(0.1, momentum=0.9)
            )
            model.register_all_reduce_hook(hook)
            model(x[:1])
        model.set_weights(initial)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model.get_weights()

    keras.utils.set_random_seed(3)
    first = CreatedBackwards()
    first(x[:1])
    initial = first.get_weights()
    reference = train(tf.distribute.get_strategy(), NoCompression())
    bucketed = train(mirrored(2), NoCompression(bucket_bytes=600))
    assert max_abs_diff(reference, bucketed) < 1e-5


def test_ready_order_is_the_order_the_graph_creates_them():
    @tf.function
    def trace():
        a = tf.constant(1.0)
        b = a * 2.0
        c = b + 1.0
        order = plan_module.ready_order([c, a, b, tf.IndexedSlices(b, [0])])
        sizes.append(order)
        return c

    sizes = []
    trace()
    assert sizes == [[1, 2, 3, 0]]
    assert plan_module.ready_order([tf.constant(1.0)]) is None
    with pytest.raises(ValueError, match="every position"):
        plan_buckets([spec(1), spec(2)], 1, order=[0, 0])


# --- The overlap structure, in 2 real worker processes -----------------------


@pytest.mark.multiworker
def test_first_gradient_collective_does_not_wait_for_the_first_layer():
    """In the traced step of MultiWorkerMirroredStrategy, the collective that
    carries the last layers' gradients does not depend on the first layer's
    gradient (it can run while that is computed); without buckets it does."""
    # The order of TensorFlow's collective ops in the graph: gloo's sums
    # are not collective ops (test_gloo.py checks their overlap).
    first, second = run_workers(
        _collective_dependencies,
        num_workers=2,
        args=([1024, None],),
        env={"KERAS_DIST_COLLECTIVES": "tensorflow"},
        timeout=300,
    )
    assert first == second
    bucketed, single = first
    # 1 KiB buckets, from the last variable: [bias 40 B + kernel 10 KiB],
    # then every other variable (each >= 1 KiB) alone.
    assert bucketed["collectives"] == 5
    assert not bucketed["first_waits_for_first_layer"]
    assert bucketed["first_waits_for_last_layer"]
    assert bucketed["last_waits_for_first_layer"]
    assert single["collectives"] == 1
    assert single["first_waits_for_first_layer"]


def _collective_dependencies(bucket_sizes):
    """Worker: traces DistributedModel.train_step for each `bucket_bytes` and
    reports, for the gradient collectives, which gradients they depend on."""
    import keras
    import tensorflow as tf

    import keras_dist
    from keras_dist.compression import NoCompression

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x = tf.ones((8, 32))
    y = tf.zeros((8,), tf.int32)
    reports = []
    for bucket_bytes in bucket_sizes:
        seen = {}

        class Recording(NoCompression):
            def reduce(self, gradients, variables, seen=seen):
                seen["gradients"] = list(gradients)
                return super().reduce(gradients, variables)

        with strategy.scope():
            inputs = keras.Input((32,))
            h = keras.layers.Dense(256, activation="relu")(inputs)
            h = keras.layers.Dense(256, activation="relu")(h)
            outputs = keras.layers.Dense(10)(h)
            model = keras_dist.DistributedModel(inputs, outputs)
            model.compile(
                keras.optimizers.SGD(0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            model.register_all_reduce_hook(Recording(bucket_bytes))
            model.build_all_reduce_hook()

        @tf.function
        def step(x, y, model=model):
            return strategy.run(model.train_step, args=((x, y),))

        graph = step.get_concrete_function(x, y).graph
        gradients = seen["gradients"]
        gradient_ops = {g.op.name for g in gradients}
        collectives = [
            op
            for op in graph.get_operations()
            if op.type == "CollectiveReduceV2" and _ancestor_names(op) & gradient_ops
        ]
        first_layer, last_layer = gradients[0].op.name, gradients[-1].op.name
        reports.append(
            {
                "collectives": len(collectives),
                "first_waits_for_first_layer": first_layer
                in _ancestor_names(collectives[0]),
                "first_waits_for_last_layer": last_layer
                in _ancestor_names(collectives[0]),
                "last_waits_for_first_layer": first_layer
                in _ancestor_names(collectives[-1]),
            }
        )
    return reports


def _ancestor_names(op) -> set:
    """Names of every op `op` waits for: data and control inputs, transitively."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                stack.append(parent)
    return seen
