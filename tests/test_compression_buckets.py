"""Buckets in the compressing hooks (`TopK`, `DGC`, `PowerSGD`).

Bucketing changes how the hooks group their collectives, never what they
compute: every bucket size gives the same sums and state, the hooks issue
one bucket's collectives after the other in `buckets` order, and the byte
accounting stays what is sent. On 2 logical CPU replicas.
"""

import inspect
import re
import threading

import numpy as np
import pytest
import tensorflow as tf
from helpers import Harness, assert_config_round_trip

from keras_dist.compression import (
    DEFAULT_BUCKET_BYTES,
    DGC,
    PowerSGD,
    TopK,
    plan_buckets,
)
from keras_dist.core import plain as plain_module
from keras_dist.core import powersgd as powersgd_module
from keras_dist.core import topk as topk_module

# Mixed sizes and dtypes. Bytes: 2304, 64, 12288, 192, 20, 480, 24, 400.
SHAPES = [(3, 3, 4, 16), (16,), (64, 48), (48,), (5,), (20, 12), (12,), (10, 10)]
DTYPES = [
    "float32",
    "float32",
    "float32",
    "float32",
    "int32",
    "float16",
    "float16",
    "float32",
]
MEDIUM = 1024
BUCKET_SIZES = [1, MEDIUM, None]

HOOK_CLASSES = [TopK, DGC, PowerSGD]

# Arguments that make each hook do everything it can in 3 steps: error
# feedback; DGC's warm-up (a dynamic `k` in steps 0 and 1, static after);
# PowerSGD's plain first step (`start_step`, through `merge_call`), then two
# compressed steps with warm start, every matrix compressed.
STEPPED = {
    TopK: {"ratio": 0.1},
    DGC: {"ratio": 0.05, "momentum": 0.9, "warmup_steps": 2},
    PowerSGD: {"rank": 2, "start_step": 1, "min_compression_rate": 1},
}
# Static sizes, so the recorded payloads have static shapes.
STATIC = {
    TopK: {"ratio": 0.1},
    DGC: {"ratio": 0.1, "warmup_steps": 0},
    PowerSGD: {"rank": 2, "start_step": 0, "min_compression_rate": 1},
}


def class_id(hook_class):
    return hook_class.__name__


def step_grads(step, replicas=2):
    """Replica `r`'s gradients at `step`: `SHAPES` in `DTYPES`, seeded."""
    rng = np.random.default_rng(1000 + step)
    grads = []
    for _ in range(replicas):
        grads.append(
            [
                rng.integers(-50, 50, size=shape).astype(dtype)
                if dtype == "int32"
                else rng.normal(size=shape).astype(dtype)
                for shape, dtype in zip(SHAPES, DTYPES)
            ]
        )
    return grads


def specs():
    return [tf.TensorSpec(shape, dtype) for shape, dtype in zip(SHAPES, DTYPES)]


def local_state(harness):
    """Every state variable's per-replica values, by name."""
    return {
        name: harness.local(harness.hook.state(name))
        for name in harness.hook.state_names
    }


def assert_close(got, want, hook_class):
    if hook_class is PowerSGD:
        # The orthonormalisation batches equal shapes per bucket, so the QR
        # can round differently in the last bit.
        np.testing.assert_allclose(
            np.asarray(got, "float64"),
            np.asarray(want, "float64"),
            rtol=1e-6,
            atol=1e-6,
        )
    else:
        np.testing.assert_array_equal(got, want)


# --- The plans ----------------------------------------------------------------


@pytest.mark.parametrize("hook_class", HOOK_CLASSES, ids=class_id)
def test_buckets_follow_plan_buckets(hook_class):
    tensors = specs()
    tiny = hook_class(bucket_bytes=1).buckets(tensors)
    assert tiny == [[i] for i in reversed(range(len(SHAPES)))]
    medium = hook_class(bucket_bytes=MEDIUM).buckets(tensors)
    assert medium == plan_buckets(tensors, MEDIUM)
    assert medium == [[7, 3, 2], [6, 5], [4], [1, 0]]
    # Without buckets, one bucket: each phase sends one collective per
    # dtype (a sparsifier's float tensors all in one all-gather).
    assert hook_class(bucket_bytes=None).buckets(tensors) == [list(range(8))]
    assert hook_class(bucket_bytes=None).buckets([]) == []


# --- Same results whatever the bucket size ------------------------------------


@pytest.mark.parametrize("hook_class", HOOK_CLASSES, ids=class_id)
def test_bucket_size_does_not_change_the_sums_or_the_state(mirrored, hook_class):
    strategy = mirrored(2)
    harnesses = {
        size: Harness(
            strategy,
            hook_class(**STEPPED[hook_class], bucket_bytes=size),
            SHAPES,
            DTYPES,
        )
        for size in BUCKET_SIZES
    }
    for step in range(3):
        grads = step_grads(step)
        results = {size: h.reduce(grads) for size, h in harnesses.items()}
        want = results[None]
        for per_replica, dtype in zip(want, DTYPES):
            np.testing.assert_array_equal(per_replica[1], per_replica[0])
            assert per_replica[0].dtype == dtype
        for size in BUCKET_SIZES[:-1]:
            for position, (got, expected) in enumerate(zip(results[size], want)):
                for replica in range(2):
                    try:
                        assert_close(got[replica], expected[replica], hook_class)
                    except AssertionError as error:
                        raise AssertionError(
                            f"step {step}, bucket_bytes={size}, gradient "
                            f"{position}, replica {replica}"
                        ) from error
    want_state = local_state(harnesses[None])
    assert want_state
    for size in BUCKET_SIZES[:-1]:
        state = local_state(harnesses[size])
        assert state.keys() == want_state.keys()
        for name, per_replica in state.items():
            for got, expected in zip(per_replica, want_state[name]):
                assert_close(got, expected, hook_class)
    for harness in harnesses.values():
        if hook_class is not TopK:
            assert harness.hook.steps == 3


def test_sparsifiers_without_error_feedback_or_with_clipping(mirrored):
    strategy = mirrored(2)
    for make in (
        lambda size: TopK(ratio=0.2, error_feedback=False, bucket_bytes=size),
        lambda size: DGC(ratio=0.05, warmup_steps=0, clipnorm=1.0, bucket_bytes=size),
    ):
        harnesses = [
            Harness(strategy, make(size), SHAPES, DTYPES) for size in (1, None)
        ]
        for step in range(2):
            grads = step_grads(step)
            bucketed, whole = (h.reduce(grads) for h in harnesses)
            for got, want in zip(bucketed, whole):
                np.testing.assert_array_equal(got, want)


# --- One bucket after the other -----------------------------------------------


def record_calls(monkeypatch, module, name, calls):
    """Wraps the collective helper `module.name` to log each call's payload.

    Each call appends `(thread, name, [(dtype, shape), ...])`: under
    MirroredStrategy every replica traces `reduce` in its own thread.
    """
    original = getattr(module, name)

    def recording(*args):
        tensors = [t for arg in args if isinstance(arg, list) for t in arg]
        payload = [(tf.as_dtype(t.dtype).name, tuple(t.shape)) for t in tensors]
        calls.append((threading.get_ident(), name, payload))
        return original(*args)

    monkeypatch.setattr(module, name, recording)


def per_replica_calls(calls):
    """The recorded calls grouped by replica (thread), each in issue order."""
    by_thread = {}
    for thread, name, payload in calls:
        by_thread.setdefault(thread, []).append((name, payload))
    return list(by_thread.values())


def payload_bytes(payload):
    return sum(
        int(np.prod(shape)) * tf.as_dtype(dtype).size for dtype, shape in payload
    )


def expected_sparsifier_calls(hook, gather_name, tensors):
    """The calls `TopK`/`DGC` make: per bucket, one all-gather of the float
    tensors' entries, or one `all_reduce_sum` of its non-float tensors."""
    calls = []
    for bucket in hook.buckets(tensors):
        floats = [p for p in bucket if tensors[p].dtype.is_floating]
        others = [p for p in bucket if not tensors[p].dtype.is_floating]
        if floats:
            tops = [("int32", (hook.k_for(hook.variable_specs[p]),)) for p in floats]
            values = [
                (tensors[p].dtype.name, (hook.k_for(hook.variable_specs[p]),))
                for p in floats
            ]
            calls.append((gather_name, tops + values))
        if others:
            payload = [(tensors[p].dtype.name, tuple(SHAPES[p])) for p in others]
            calls.append(("all_reduce_sum", payload))
    return calls


def expected_powersgd_calls(hook, tensors):
    """The calls `PowerSGD` makes: per bucket, P and the raw gradients in one
    `all_reduce_flat`, then the bucket's Q in another."""
    calls = []
    for bucket in hook.buckets(tensors):
        plans = [hook.plan_for(hook.variable_specs[p], p) for p in bucket]
        ps = [(p.dtype.name, (p.rank, p.cols)) for p in plans if p is not None]
        raw = [
            (tensors[p].dtype.name, tuple(SHAPES[p]))
            for p, plan in zip(bucket, plans)
            if plan is None
        ]
        calls.append(("all_reduce_flat", ps + raw))
        qs = [(p.dtype.name, (p.rows, p.rank)) for p in plans if p is not None]
        if qs:
            calls.append(("all_reduce_flat", qs))
    return calls


SPARSIFIER_HELPERS = {
    TopK: (topk_module, "all_gather_pairs"),
    DGC: (topk_module, "all_gather_pairs"),
}


@pytest.mark.parametrize("size", BUCKET_SIZES)
@pytest.mark.parametrize("hook_class", HOOK_CLASSES, ids=class_id)
def test_one_bucket_after_the_other_and_bytes_are_what_is_sent(
    monkeypatch, mirrored, hook_class, size
):
    hook = hook_class(**STATIC[hook_class], bucket_bytes=size)
    calls = []
    if hook_class is PowerSGD:
        record_calls(monkeypatch, powersgd_module, "all_reduce_flat", calls)
    else:
        module, gather_name = SPARSIFIER_HELPERS[hook_class]
        record_calls(monkeypatch, module, gather_name, calls)
        record_calls(monkeypatch, topk_module, "all_reduce_sum", calls)
    harness = Harness(mirrored(2), hook, SHAPES, DTYPES)
    harness.reduce(step_grads(0))

    tensors = specs()
    if hook_class is PowerSGD:
        expected = expected_powersgd_calls(hook, tensors)
    else:
        expected = expected_sparsifier_calls(hook, gather_name, tensors)
    buckets = hook.buckets(tensors)
    if size == 1:
        assert len(buckets) == len(SHAPES)
    elif size is None:
        assert len(buckets) == 1
    if hook_class is PowerSGD:
        # Two phases per bucket holding a matrix, one otherwise.
        assert len(expected) == len(buckets) + sum(
            any(hook.plan_for(hook.variable_specs[p], p) for p in bucket)
            for bucket in buckets
        )
    elif size is not None:
        # A bucket holds one dtype: one collective each.
        assert len(expected) == len(buckets)
    else:
        # One all-gather for every float tensor, one sum for the int32 one.
        assert [name for name, _ in expected] == [gather_name, "all_reduce_sum"]

    replicas = per_replica_calls(calls)
    assert len(replicas) == 2
    for issued in replicas:
        assert issued == expected
        assert sum(payload_bytes(payload) for _, payload in issued) == (
            hook.stats().sent_bytes
        )
    assert hook.stats().raw_bytes == sum(
        int(np.prod(s)) * tf.as_dtype(d).size for s, d in zip(SHAPES, DTYPES)
    )


@pytest.mark.parametrize("size", [MEDIUM, None])
def test_powersgd_plain_steps_are_bucketed(monkeypatch, mirrored, size):
    """Before `start_step`, `all_reduce_sum` gets the hook's bucket size."""
    calls = []
    original = plain_module.all_reduce_sum

    def recording(tensors, bucket_bytes=None):
        calls.append(bucket_bytes)
        return original(tensors, bucket_bytes)

    monkeypatch.setattr(powersgd_module, "all_reduce_sum", recording)
    hook = PowerSGD(rank=2, start_step=5, min_compression_rate=1, bucket_bytes=size)
    harness = Harness(mirrored(2), hook, SHAPES, DTYPES)
    grads = step_grads(0)
    result = harness.reduce(grads)
    assert calls == [size, size]
    for got, *replica_grads in zip(result, *grads):
        want = replica_grads[0] + replica_grads[1]
        np.testing.assert_array_equal(got[0], want)
        np.testing.assert_array_equal(got[1], want)


# --- Arguments and config -----------------------------------------------------


@pytest.mark.parametrize("hook_class", HOOK_CLASSES, ids=class_id)
def test_bucket_bytes_is_the_last_argument_and_defaults_to_4_mib(hook_class):
    parameters = inspect.signature(hook_class).parameters
    assert list(parameters)[-1] == "bucket_bytes"
    assert parameters["bucket_bytes"].default == DEFAULT_BUCKET_BYTES
    hook = hook_class()
    assert hook.bucket_bytes == DEFAULT_BUCKET_BYTES
    assert hook.get_config()["bucket_bytes"] == DEFAULT_BUCKET_BYTES


@pytest.mark.parametrize("size", [1, MEDIUM, DEFAULT_BUCKET_BYTES, None, np.int64(64)])
@pytest.mark.parametrize("hook_class", HOOK_CLASSES, ids=class_id)
def test_config_round_trip(hook_class, size):
    hook = hook_class(**STEPPED[hook_class], bucket_bytes=size)
    config = hook.get_config()
    assert config["bucket_bytes"] == size
    assert config["bucket_bytes"] is None or type(config["bucket_bytes"]) is int
    revived = assert_config_round_trip(hook)
    assert revived.bucket_bytes == hook.bucket_bytes
    assert repr(revived) == repr(hook)
    # The default size is left out of the repr (`TopK(ratio=0.01, ...)`).
    shown = f"bucket_bytes={hook.bucket_bytes!r}" in repr(hook)
    assert shown == (hook.bucket_bytes != DEFAULT_BUCKET_BYTES)


@pytest.mark.parametrize(
    "value, error",
    [
        (0, ValueError),
        (-1, ValueError),
        (1.5, TypeError),
        (True, TypeError),
        ("4MB", TypeError),
    ],
)
@pytest.mark.parametrize("hook_class", HOOK_CLASSES, ids=class_id)
def test_bad_bucket_bytes_are_refused(hook_class, value, error):
    match = r"`bucket_bytes` must be an int >= 1 or None\. Received: " + re.escape(
        f"bucket_bytes={value!r}"
    )
    with pytest.raises(error, match=match):
        hook_class(bucket_bytes=value)
