"""tfmot's quantization-aware training and weight clustering, distributed.

Through `keras_dist.tf_keras.DistributedOptimizer` (FP16 all-reduce,
accumulation) on 2 logical CPU replicas and on 2 worker processes: the QAT
model converts to an int8 TFLite model within 2 points of its float
accuracy; clustering leaves at most 8 values per kernel; every replica and
worker ends with the same weights. Pruning: `tests/test_tf_keras.py`.
"""

import os
import re
import subprocess
import sys

import pytest
import tfmot_workers as tw
from helpers import REPO_ROOT, max_abs_diff

from keras_dist.testing import run_workers

QAT_EPOCHS = 5
MICRO_BATCH = 16


def check_qat(result):
    assert result["float_accuracy"] >= 0.9
    assert abs(result["tflite_accuracy"] - result["float_accuracy"]) <= 0.02
    for layer, tensors in result["kernel_dtypes"].items():
        # One int8 tensor per kernel, with quantization scales; no float copy.
        [(dtype, scales)] = tensors
        assert dtype == "int8", (layer, tensors)
        assert scales and min(scales) > 0, (layer, tensors)
    # int8 weights: about a quarter of the float32 weights' bytes.
    assert result["tflite_bytes"] < result["float_weight_bytes"] / 2


def check_clustering(result):
    assert result["accuracy"] >= 0.9
    assert len(result["unique"]) == 3  # the Conv2D and both Dense kernels
    for layer, unique in result["unique"].items():
        assert unique <= tw.CLUSTERS, (layer, unique)


def test_qat_on_two_replicas_converts_to_int8_tflite(mirrored):
    strategy = mirrored(2)
    result = tw.qat_fit(strategy, epochs=QAT_EPOCHS, micro_batch=MICRO_BATCH)
    check_qat(result)
    # 1500 examples in global micro-batches of 32: 47 micro-steps an epoch,
    # one update every 2 (a partial accumulation carries into the next epoch).
    assert result["updates"] == 47 * QAT_EPOCHS // 2
    # Weights, and the quantizers' ranges (updated in the forward pass), alike
    # on both replicas.
    assert all(result["replicas_agree"].values()), result["replicas_agree"]


def test_weight_clustering_on_two_replicas(mirrored):
    result = tw.clustered_fit(mirrored(2), init="KMEANS_PLUS_PLUS")
    check_clustering(result)
    assert any("cluster_centroids" in name for name in result["replicas_agree"])
    assert all(result["replicas_agree"].values()), result["replicas_agree"]


@pytest.mark.multiworker
@pytest.mark.slow
def test_qat_and_clustering_on_two_worker_processes():
    first, second = run_workers(
        tw.multi_worker_qat_and_clustering, num_workers=2, timeout=400
    )
    for worker in (first, second):
        check_qat(worker["qat"])
        check_clustering(worker["clustering"])
    assert max_abs_diff(first["qat"]["weights"], second["qat"]["weights"]) == 0
    assert first["qat"]["tflite_accuracy"] == second["qat"]["tflite_accuracy"]
    assert (
        max_abs_diff(first["clustering"]["weights"], second["clustering"]["weights"])
        == 0
    )


def test_qat_example_exports_int8_tflite(tmp_path):
    script = os.path.join(REPO_ROOT, "examples", "qat_distributed.py")
    completed = subprocess.run(
        [sys.executable, script, "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO_ROOT)),
    )
    out = completed.stdout
    assert completed.returncode == 0, out[-4000:] + completed.stderr[-4000:]
    assert "2 replicas" in out
    accuracies = dict(
        re.findall(r"^(float|tflite int8) accuracy: ([0-9.]+)", out, re.M)
    )
    assert set(accuracies) == {"float", "tflite int8"}, out
    assert abs(float(accuracies["float"]) - float(accuracies["tflite int8"])) <= 0.02
    [path] = tmp_path.glob("*.tflite")
    assert f"{path} ({path.stat().st_size:,} bytes)" in out
