"""`keras-dist env` names the engine that started the process.

`keras_dist.cluster.detect_engine` reads only the environment; each engine
is given the variables it sets (measured: Ray 2.60 workers have
`RAY_RAYLET_PID` and `RAY_JOB_ID`; `srun` tasks `SLURM_STEP_NUM_TASKS`,
`SLURM_PROCID`, `SLURM_STEP_ID`; every pod `KUBERNETES_SERVICE_HOST`).
tests/test_slurm.py checks the same under a real `srun`.
"""

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO_ROOT

from keras_dist import cluster

TF_CONFIG = json.dumps(
    {
        "cluster": {"worker": ["localhost:2222", "localhost:2223"]},
        "task": {"type": "worker", "index": 1},
    }
)

CASES = [
    ({}, "none", "one process"),
    ({"TF_CONFIG": TF_CONFIG}, "TF_CONFIG", "set by hand"),
    (
        {"KERAS_DIST_TASK": "worker:1", "TF_CONFIG": TF_CONFIG},
        "keras-dist launch",
        "task worker:1",
    ),
    (
        {"RAY_RAYLET_PID": "12", "RAY_JOB_ID": "01000000", "TF_CONFIG": TF_CONFIG},
        "Ray",
        "TensorflowTrainer",
    ),
    ({"RAY_JOB_ID": "01000000"}, "Ray", "outside a TensorflowTrainer loop"),
    (
        {
            "SLURM_JOB_ID": "7",
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "1",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURMD_NODENAME": "node-a",
        },
        "SLURM job step",
        "task SLURM_PROCID=1 of 2, job 7 step 0 on node-a",
    ),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}, "SLURM allocation", "srun"),
    (
        {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "TF_CONFIG": TF_CONFIG},
        "Kubernetes",
        "TFJob",
    ),
    ({"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, "Kubernetes", "without TF_CONFIG"),
    # KubeRay: Ray on Kubernetes; Ray is what sets TF_CONFIG.
    (
        {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "RAY_JOB_ID": "01", "TF_CONFIG": "x"},
        "Ray",
        "TensorflowTrainer",
    ),
]


@pytest.mark.parametrize("environ, name, detail", CASES)
def test_detect_engine(environ, name, detail):
    engine = cluster.detect_engine(environ)
    assert engine.name == name
    assert detail in engine.detail


def test_keras_dist_env_prints_the_engine_and_the_strategy():
    environ = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "TF_CONFIG": TF_CONFIG}
    result = subprocess.run(
        [sys.executable, "-m", "keras_dist", "env"],
        env={**_base_env(), **environ},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Engine:        Kubernetes (a pod with TF_CONFIG" in result.stdout
    assert "Strategy:      MultiWorkerMirroredStrategy" in result.stdout


def _base_env():
    keep = ("PATH", "HOME", "LANG", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO_ROOT))
    return env
