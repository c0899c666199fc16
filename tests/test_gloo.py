"""The gloo collective backend (`KERAS_DIST_COLLECTIVES=gloo`, core/gloo.py).

The multi-worker tests train in real worker processes whose gradient sums go
through a gloo process group (PyTorch's c10d, over TCP); the fault tests are
in test_fault_tolerance.py (a killed peer, a resume after one).
"""

import itertools
import json
import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
import workers
from helpers import max_abs_diff

from keras_dist import cluster
from keras_dist.compression import BF16, DGC, FP16, NoCompression, PowerSGD, TopK
from keras_dist.core import collectives, gloo, gloo_group
from keras_dist.testing import run_workers

pytest.importorskip("torch", reason="the gloo backend needs PyTorch (extra `test`)")

TESTS = os.path.dirname(os.path.abspath(__file__))
# The MLP of helpers.py: Dense(8 -> 16) and Dense(16 -> 3), float32.
MLP_BYTES = (8 * 16 + 16 + 16 * 3 + 3) * 4


def _compressed_fits(configs, backend):
    """`workers.compressed_fit` on 2 workers with `KERAS_DIST_COLLECTIVES`
    set to `backend` (`""`: unset, `auto`)."""
    return run_workers(
        workers.compressed_fit,
        args=configs,
        env={"KERAS_DIST_COLLECTIVES": backend},
        timeout=300,
    )


HOOKS = [
    NoCompression(),
    NoCompression(bucket_bytes=1),
    FP16(),
    BF16(),
    PowerSGD(rank=2, start_step=0),
    # Plain sums for 2 steps, then compressed: the switch is a `tf.cond`
    # whose sums stay on TensorFlow's collectives.
    PowerSGD(rank=2, start_step=2),
    # Index/value pairs of static size: an all-gather, through gloo.
    TopK(ratio=0.2),
    DGC(ratio=0.05, warmup_steps=0, clipnorm=1.0),
]
SHARDED_CASES = [
    ("adam", 1, 8, None),
    ("clipnorm", 1, 8, None),
    ("adamw", 1, 8, keras.saving.serialize_keras_object(FP16())),
    ("sgd", 4, 2, None),
    # Sharded by whole variables (Lamb is not elementwise).
    ("lamb", 1, 8, None),
]


@pytest.fixture(scope="module")
def equality_fits():
    """The compressed and the sharded fits of the two equality tests, on 2
    workers, with gloo and with TensorFlow's collectives: one launch each
    (`workers.compressed_and_sharded_fits`)."""
    configs = [keras.saving.serialize_keras_object(h) for h in HOOKS]
    return {
        backend: run_workers(
            workers.compressed_and_sharded_fits,
            args=(configs, SHARDED_CASES),
            env={"KERAS_DIST_COLLECTIVES": backend},
            timeout=600,
        )
        for backend in ("gloo", "tensorflow")
    }


@pytest.mark.multiworker
def test_gloo_sums_equal_tensorflow_collectives_exactly(equality_fits):
    """2 workers, the same fits with gloo and with TensorFlow's collectives:
    the same weights to the bit (2 workers add in one order), every dense
    bucket outside a `tf.cond` through gloo, FP16/BF16 payloads included."""
    hooks = HOOKS
    with_gloo = [result["compressed"] for result in equality_fits["gloo"]]
    with_tf = [result["compressed"] for result in equality_fits["tensorflow"]]
    # `compressed_fit` reports the group's running counts: per fit, the
    # difference from the previous one.
    for worker in range(2):
        totals = [(0, 0)] + [result["gloo"] for result in with_gloo[worker]]
        for result, before, after in zip(with_gloo[worker], totals, totals[1:]):
            result["gloo"] = (after[0] - before[0], after[1] - before[1])
    steps = 2 * 64 // 16
    for index, hook in enumerate(hooks):
        for worker in range(2):
            got = with_gloo[worker][index]
            reference = with_tf[worker][index]
            assert reference["gloo"] is None
            assert max_abs_diff(got["weights"], reference["weights"]) < 1e-6, hook
            assert got["loss"] == pytest.approx(reference["loss"], rel=1e-6), hook
        calls, nbytes = with_gloo[0][index]["gloo"]
        assert calls > 0, hook
        assert with_gloo[1][index]["gloo"] == (calls, nbytes)
    # Per step, one all-reduce of the step's metric values (6 float32: the
    # loss's and accuracy's sums and counts, trainer/logs.py) and the
    # gradients': the whole model uncompressed, one per variable in 1-byte
    # buckets, half the bytes for FP16 and BF16 (whose step's logs carry one
    # more float32 value).
    logs = 6 * 4
    assert with_gloo[0][0]["gloo"] == (2 * steps, steps * (MLP_BYTES + logs))
    assert with_gloo[0][1]["gloo"] == (5 * steps, steps * (MLP_BYTES + logs))
    for index in (2, 3):
        assert with_gloo[0][index]["gloo"] == (
            2 * steps,
            steps * (MLP_BYTES // 2 + logs + 4),
        )
    # PowerSGD from the first step: its factors and uncompressed biases in
    # gloo (fewer bytes than the model); behind the cond, the metric sums
    # only (with one more float32 value, as FP16's).
    calls, nbytes = with_gloo[0][4]["gloo"]
    assert calls > 2 * steps and nbytes < steps * (MLP_BYTES + logs)
    assert with_gloo[0][5]["gloo"] == (steps, steps * (logs + 4))
    # TopK and DGC: the pairs' all-gather too (fewer bytes than the model).
    for index in (6, 7):
        calls, nbytes = with_gloo[0][index]["gloo"]
        assert calls == 2 * steps, hooks[index]


@pytest.mark.multiworker
def test_half_precision_sums_add_in_worker_order_on_every_worker():
    """float16 and bfloat16 sums go through gloo as an all-to-all, adds and
    a second all-to-all (`gloo_group._HalfSums`): with 3 workers, lengths
    that do not divide by 3 (the padding), one element and 100,003, each
    worker gets the bits of TensorFlow's adds in worker order."""
    lengths = [1, 5, 100_003]
    results = run_workers(
        workers.half_sums,
        num_workers=3,
        args=(lengths,),
        env={"KERAS_DIST_COLLECTIVES": "gloo"},
        timeout=300,
    )
    for result in results:
        assert result["float16"]["equal"] and result["bfloat16"]["equal"]
        # The metric-free step: 2 steps x 2 dtypes, one bucket each.
        assert result["issued"] == 4
        assert result["float16"]["sums"] == results[0]["float16"]["sums"]


@pytest.mark.multiworker
def test_the_sharded_optimizer_through_gloo_equals_tensorflow_collectives(
    equality_fits,
):
    """2 workers, ShardedOptimizer fits with gloo and with TensorFlow's
    collectives: the same weights to the bit (gloo moves the rows, the sum
    is TensorFlow's either way; TensorFlow's move them in unordered chunks),
    the reduce-scatters and all-gathers outside a `tf.cond` through gloo's
    all-to-all."""
    cases = SHARDED_CASES
    with_gloo = [result["sharded"] for result in equality_fits["gloo"]]
    with_tf = [result["sharded"] for result in equality_fits["tensorflow"]]
    # TensorFlow's collectives carried the segments (SEGMENT_BYTES) in
    # unordered chunks, the same bits (`core/chunked.py`).
    assert all(result["chunked"] for result in equality_fits["tensorflow"])
    for worker in range(2):
        for case, got, reference in zip(cases, with_gloo[worker], with_tf[worker]):
            assert reference["gloo"] is None
            assert max_abs_diff(got["weights"], reference["weights"]) == 0.0, case
            assert got["iterations"] == reference["iterations"], case
    # The group's running counts, per fit (after the compressed fits').
    ops = [equality_fits["gloo"][0]["sharded_base"]]
    ops += [result["gloo"] for result in with_gloo[0]]
    counts = [
        {
            op: after[op] - before.get(op, 0)
            for op in after
            if after[op] != before.get(op, 0)
        }
        for before, after in itertools.pairwise(ops)
    ]
    assert with_gloo[1][-1]["gloo"] == with_gloo[0][-1]["gloo"]
    steps = 2 * 64 // 16
    segments = 3  # mlp's variables at SEGMENT_BYTES
    # Stage 1: per step and segment one reduce-scatter and one all-gather of
    # the updated pieces; one all-reduce of the step's metric sums.
    for index in range(3):
        assert counts[index] == {
            "all_to_all": segments * steps,
            "all_gather": segments * steps,
            "all_reduce": steps,
        }, cases[index]
    # Stage 2: a reduce-scatter per segment and micro-step through gloo; the
    # update (and its all-gathers) runs every 4th, inside a `tf.cond`:
    # TensorFlow's.
    micro_steps = 2 * 64 // 4
    assert counts[3]["all_to_all"] == segments * micro_steps
    assert counts[3].get("all_gather", 0) == 0
    # By whole variables: one reduce-scatter of the blocks and one
    # all-gather per step.
    assert counts[4] == {"all_to_all": steps, "all_gather": steps, "all_reduce": steps}


def test_the_backend_is_chosen_by_name(monkeypatch):
    monkeypatch.delenv(gloo.ENV_VAR, raising=False)
    assert gloo.requested_backend() == "auto"
    monkeypatch.setenv(gloo.ENV_VAR, " GLOO ")
    assert gloo.requested_backend() == "gloo"
    monkeypatch.setenv(gloo.ENV_VAR, "nccl")
    with pytest.raises(ValueError, match=r"KERAS_DIST_COLLECTIVES must be one of"):
        gloo.requested_backend()


def test_auto_keeps_tensorflow_for_several_devices_per_worker(monkeypatch, mirrored):
    monkeypatch.delenv(gloo.ENV_VAR, raising=False)
    strategy = mirrored(2)
    choice = gloo.enable_if_requested(strategy)
    assert choice == ("tensorflow", "auto: 2 devices per worker, gloo serves 1")
    assert gloo.group_for(strategy) is None


def test_auto_picks_gloo_where_pytorch_is_installed(monkeypatch):
    monkeypatch.delenv(gloo.ENV_VAR, raising=False)
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    choice = gloo.choose(strategy)
    assert choice.backend == "gloo"
    assert choice.reason == "auto: PyTorch with gloo is installed"
    monkeypatch.setenv(gloo.ENV_VAR, "tensorflow")
    assert gloo.choose(strategy) == ("tensorflow", "KERAS_DIST_COLLECTIVES=tensorflow")


def test_the_chief_says_what_carries_the_sums(caplog):
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with caplog.at_level("INFO", logger="keras_dist.core.collectives"):
        collectives._log_backend(strategy, gloo.Choice("gloo", "auto: PyTorch"))
        collectives._log_backend(strategy, gloo.Choice("tensorflow", "auto: why"))
    gloo_line, tf_line = caplog.records
    assert gloo_line.levelname == "WARNING"
    assert gloo_line.getMessage() == (
        "keras_dist: gradients sum through gloo (auto: PyTorch; "
        "KERAS_DIST_COLLECTIVES=tensorflow for TensorFlow's collectives)."
    )
    assert tf_line.levelname == "INFO"
    assert "TensorFlow's collectives (auto: why)" in tf_line.getMessage()


def test_auto_without_pytorch_keeps_tensorflow(monkeypatch):
    """The same strategy where PyTorch does not import: TensorFlow's
    collectives, and the reason says so (no error)."""
    monkeypatch.delenv(gloo.ENV_VAR, raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    gloo.gloo_missing.cache_clear()
    try:
        choice = gloo.choose(tf.distribute.OneDeviceStrategy("/cpu:0"))
    finally:
        gloo.gloo_missing.cache_clear()
    assert choice == ("tensorflow", "auto: PyTorch is not installed")


def test_gloo_refuses_several_devices_per_worker(monkeypatch, mirrored):
    monkeypatch.setenv(gloo.ENV_VAR, "gloo")
    with pytest.raises(ValueError, match=r"serves one device per worker.*has 2"):
        gloo.enable_if_requested(mirrored(2))


def test_gloo_without_torch_says_how_to_install_it(monkeypatch):
    monkeypatch.setenv(gloo.ENV_VAR, "gloo")
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with pytest.raises(ImportError, match=r"needs PyTorch.*pip install torch"):
        gloo.enable_if_requested(strategy)


def test_local_strategies_keep_tensorflow_collectives(monkeypatch, mirrored):
    """The variable concerns worker processes: a local MirroredStrategy's
    sums stay TensorFlow's (`own` asks gloo only for multi-worker ones)."""
    monkeypatch.setenv(gloo.ENV_VAR, "gloo")
    strategy = mirrored(2)
    collectives.own(strategy)
    assert gloo.group_for(strategy) is None
    summed = strategy.run(lambda: collectives.all_reduce_sum([tf.ones([3])])[0])
    np.testing.assert_array_equal(
        strategy.experimental_local_results(summed)[0], [2.0, 2.0, 2.0]
    )


def test_a_sum_buffer_is_reused_only_when_no_one_else_holds_it():
    """`_Buffers`: a buffer someone may still read (TensorFlow, while a
    tensor aliases it) is not handed out again; a free one is."""
    buffers = gloo_group._Buffers()

    def take():
        buffer = buffers.take(1000, np.float32)
        return buffer.ctypes.data, buffer

    address = take()[0]
    assert address % gloo_group._ALIGNMENT == 0
    assert take()[0] == address  # no one held it
    handed = [take()[1]]
    handed[0][:] = 7.0

    @tf.function
    def step():
        summed = tf.numpy_function(lambda: handed[0], [], tf.float32, stateful=True)
        return summed * 2.0, summed + 0.0

    doubled, same = step()
    other, buffer = take()  # still in `handed`: another buffer
    assert other != address
    buffer[:] = 1.0
    handed.clear()
    # Whether TensorFlow's tensors alias it or not, a buffer taken and written
    # while they live leaves them as they are.
    for _ in range(20):
        _, buffer = take()
        buffer[:] = 1.0
        tf.constant(0.0).numpy()
    np.testing.assert_array_equal(doubled.numpy(), np.full(1000, 14.0, np.float32))
    np.testing.assert_array_equal(same.numpy(), np.full(1000, 7.0, np.float32))
    del doubled, same, buffer
    for _ in range(100):  # TensorFlow drops its Python references lazily
        if take()[0] == address:
            break
        tf.constant(0.0).numpy()
    else:
        raise AssertionError("a buffer no one holds was not reused")
    # Up to `_POOLED_PER_SIZE` buffers are kept per size and dtype.
    held = [take()[1] for _ in range(gloo_group._POOLED_PER_SIZE + 2)]
    assert len({buffer.ctypes.data for buffer in held}) == len(held)
    assert (
        len(buffers._pools[(1000, np.dtype(np.float32))]) == gloo_group._POOLED_PER_SIZE
    )
    assert buffers.take(1000, np.float64).dtype == np.float64


@pytest.mark.multiworker
@pytest.mark.parametrize(
    "how",
    [
        "kill",
        "hang",
        pytest.param("stop", marks=pytest.mark.extended),
        "stop_first",
        pytest.param("kill_half", marks=pytest.mark.extended),
        pytest.param("stop_half", marks=pytest.mark.extended),
    ],
)
def test_a_lost_peer_fails_the_gloo_sum(how):
    """Worker 1 stops between two sums. SIGKILLed: worker 0's next gloo sum
    fails within seconds (the socket closes; gloo's own timeout is 30
    minutes). Hung (alive, sockets open): it fails after the strategy's
    `collective_timeout`, 5 s (gloo's timeout, or the watchdog's abort,
    whichever comes first). SIGSTOPped, no timeout: when TensorFlow's
    coordination service misses its heartbeats (about 10 s), not after
    gloo's 30 minutes, whichever worker is stopped (`stop_first`: worker 0,
    and worker 1 reports). The error names the worker, and `fit` reports it
    as a lost peer (`gloo.is_failure`)."""
    spec = cluster.local_cluster(workers=2)
    processes = []
    for index in range(2):
        env = {
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "PYTHONPATH": os.pathsep.join([TESTS, os.path.dirname(TESTS)]),
            "TF_CONFIG": cluster.make_tf_config(spec, "worker", index),
            "KERAS_DIST_COLLECTIVES": "gloo",
        }
        processes.append(
            subprocess.Popen(
                [sys.executable, os.path.join(TESTS, "gloo_workers.py"), how],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    survivor = 1 if how == "stop_first" else 0
    how = how.removesuffix("_half")
    try:
        output, _ = processes[survivor].communicate(timeout=240)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    if how == "kill":
        assert processes[1].returncode == -signal.SIGKILL
    assert processes[survivor].returncode == 0, output[-3000:]
    line = next(x for x in output.splitlines() if x.startswith("OUTCOME "))
    outcome = json.loads(line[len("OUTCOME ") :])
    assert outcome["done"] == 2, outcome
    assert outcome["type"] == "UnknownError", outcome
    assert outcome["is_failure"], outcome
    assert f"gloo collective failed on worker {survivor} of 2" in outcome["message"]
    if how == "hang":
        assert "within 5 s" in outcome["message"] or (
            "longer than the collective timeout (5 s" in outcome["message"]
        ), outcome
        assert 4 < outcome["seconds"] < 60, outcome
    elif how == "stop":
        assert "collectives were aborted" in outcome["message"], outcome
        assert "stopped sending heartbeats" in outcome["message"], outcome
        assert "/job:worker/replica:0/task:1" in outcome["message"], outcome
        assert outcome["seconds"] < 90, outcome
    elif how == "stop_first":
        # Worker 0 hosts the coordination service: worker 1's heartbeats to
        # it time out (as with TensorFlow's collectives).
        assert "collectives were aborted" in outcome["message"], outcome
        assert "CoordinationService/Heartbeat" in outcome["message"], outcome
        assert outcome["seconds"] < 90, outcome
    else:
        assert outcome["seconds"] < 60, outcome


@pytest.mark.multiworker
def test_workers_that_disagree_on_the_backend_are_told_at_start_up():
    # Once they failed only after the collective timeout, with gloo's raw
    # DistStoreError.
    pytest.importorskip("torch", reason="the gloo backend needs PyTorch")
    errors = run_workers(workers.disagreeing_backends, num_workers=2, timeout=240)
    assert (
        "worker 0 (this one) sums through 'gloo' (KERAS_DIST_COLLECTIVES=gloo), "
        "worker 1 through 'tensorflow' (KERAS_DIST_COLLECTIVES=tensorflow)"
    ) in errors[0]
    assert (
        "worker 1 (this one) sums through 'tensorflow' "
        "(KERAS_DIST_COLLECTIVES=tensorflow), worker 0 through 'gloo'"
    ) in errors[1]
    for error in errors:
        assert "The workers disagree on what carries their sums" in error


@pytest.mark.multiworker
@pytest.mark.extended
def test_by_default_cpu_workers_sum_through_gloo_and_say_so():
    """No variable set, PyTorch installed: a 2-worker fit's sums go through
    gloo, equal to the same fit with TensorFlow's collectives, and the chief
    logs the choice once. A worker where PyTorch does not import would sum
    through TensorFlow's: its peers are told at start-up, with the reason.
    (The log line: test_the_chief_says_what_carries_the_sums.)"""
    config = ([keras.saving.serialize_keras_object(NoCompression())],)
    by_default = _compressed_fits(config, "")
    with_tf = _compressed_fits(config, "tensorflow")
    for worker in range(2):
        got, reference = by_default[worker][0], with_tf[worker][0]
        assert got["gloo"][0] > 0 and reference["gloo"] is None
        assert max_abs_diff(got["weights"], reference["weights"]) < 1e-6
    errors = run_workers(
        workers.one_worker_without_pytorch,
        env={"KERAS_DIST_COLLECTIVES": ""},
        timeout=240,
    )
    assert (
        "worker 0 (this one) sums through 'gloo' (auto: PyTorch with gloo is "
        "installed), worker 1 through 'tensorflow'" in errors[0]
    ), errors[0]
    assert (
        "worker 1 through 'tensorflow' (auto: PyTorch is not installed)" in (errors[0])
    )
