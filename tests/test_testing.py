"""Tests for `keras_dist.testing.run_workers`, with real worker processes."""

import functools
import json
import os
import time

import pytest

from keras_dist.testing import WorkerError, run_workers

# The functions below run in the worker processes, which import this module by
# name: they must stay at module level.


def all_reduce_task_index():
    import tensorflow as tf

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    @tf.function
    def all_reduce():
        value = strategy.run(lambda: tf.constant(index + 1.0))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)

    return index, strategy.num_replicas_in_sync, float(all_reduce())


def raise_in_worker(message):
    raise ValueError(message)


def sleep_forever():
    time.sleep(600)


@pytest.mark.multiworker
def test_two_workers_all_reduce_to_the_same_value():
    results = run_workers(all_reduce_task_index, num_workers=2, timeout=150)

    assert results == [(0, 2, 3.0), (1, 2, 3.0)]


def test_worker_exception_carries_the_worker_traceback():
    with pytest.raises(WorkerError) as info:
        run_workers(raise_in_worker, num_workers=1, args=("boom from the worker",))

    message = str(info.value)
    assert "worker 0 of 1 exited with code 1" in message
    assert "Traceback" in message
    assert "in raise_in_worker" in message
    assert "ValueError: boom from the worker" in message


def test_hanging_worker_times_out():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="timed out"):
        run_workers(sleep_forever, num_workers=2, timeout=2)
    assert time.monotonic() - start < 10


def test_lambda_is_rejected():
    with pytest.raises(ValueError, match="must be a module-level function"):
        run_workers(lambda: 1)


def test_local_function_is_rejected():
    def local():
        return 1

    with pytest.raises(ValueError, match="must be a module-level function"):
        run_workers(local)


def test_bad_arguments_are_rejected():
    with pytest.raises(TypeError, match="`fn` must be callable"):
        run_workers("all_reduce_task_index")
    with pytest.raises(ValueError, match="`num_workers` must be an int >= 1"):
        run_workers(sleep_forever, num_workers=0)


@pytest.mark.parametrize("num_workers", [True, 2.0, "2"])
def test_num_workers_must_be_an_int(num_workers):
    # `True` is an int in Python; it used to start one worker.
    with pytest.raises(TypeError, match=r"`num_workers` must be an int >= 1\. Rec"):
        run_workers(sleep_forever, num_workers=num_workers)


@pytest.mark.parametrize("timeout", [-1, 0, float("inf"), float("nan")])
def test_timeout_must_be_a_positive_finite_number(timeout):
    with pytest.raises(ValueError, match=r"`timeout` must be a finite number > 0\."):
        run_workers(sleep_forever, timeout=timeout)


def test_timeout_must_be_a_number():
    with pytest.raises(TypeError, match=r"`timeout` must be .*Received: timeout='5'"):
        run_workers(sleep_forever, timeout="5")


def test_partial_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="module-level function"):
        run_workers(functools.partial(raise_in_worker, "x"))


def test_finished_worker_waits_for_its_peers_results(tmp_path):
    # A worker stays alive until every peer has its result, so its exit
    # cannot cut a collective a peer is still receiving.
    import threading

    from keras_dist import testing

    mine, peer = tmp_path / "result_0.pkl", tmp_path / "result_1.pkl"
    mine.write_bytes(b"done")
    timer = threading.Timer(0.5, peer.write_bytes, args=(b"done",))
    timer.start()
    testing._wait_for_peers([str(mine), str(peer)], timeout=60)
    # It returned because the peer's result appeared (written at 0.5 s).
    assert peer.exists()
    timer.join()
    # A peer that never answers does not keep it alive past the bound.
    start = time.monotonic()
    testing._wait_for_peers([str(mine), str(tmp_path / "missing.pkl")], timeout=0.3)
    assert time.monotonic() - start < 30
