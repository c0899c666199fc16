"""Tests for keras_dist.launcher.tf_logs: when TensorFlow's own lines are hidden.

Whole commands (`launch` on the README example, `env`, `demo`) are in
`test_cli.py`, `test_launcher_supervisor.py` and `test_demo.py`; this file
tests the rule and the filter, without TensorFlow.
"""

import subprocess
import sys
import textwrap

import pytest
from helpers import REPO_ROOT
from tf_log_lines import native_log_lines

from keras_dist.launcher import tf_logs

# Lines written by TensorFlow 2.21 on this machine (two-worker launch of the
# README example, TF_CPP_MIN_LOG_LEVEL unset), and the older format.
NATIVE = [
    "WARNING: All log messages before absl::InitializeLog() is called are "
    "written to STDERR",
    "I0000 00:00:1796356644.450448    1393 port.cc:153] oneDNN custom "
    "operations are on.",
    "I0000 00:00:1796356644.450750    1393 cudart_stub.cc:31] Could not find "
    "cuda drivers on your machine, GPU will not be used.",
    "E0000 00:00:1796356647.926629    1393 cuda_platform.cc:52] failed call to "
    "cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
    "I0000 00:00:1796356647.943606    1431 coordination_service.cc:502] "
    "Waiting for 1/2 tasks to connect.",
    "I0000 00:00:1796356647.943520    1431 coordination_service.h:529] "
    "/job:worker/replica:0/task:0 has connected to coordination service.",
    "W0000 00:00:1796356648.385427    1393 dataset.cc:997] Input of "
    "GeneratorDatasetOp::Dataset will not be optimized",
    "I0623 14:05:07.450448    1393 port.cc:153] after absl is initialised",
    "2025-09-17 14:44:05.157831: I external/local_xla/xla/tsl/cuda/"
    "cudart_stub.cc:32] Could not find cuda drivers on your machine.",
    "2025-09-17 14:44:05.176998: E external/local_xla/xla/stream_executor/"
    "cuda/cuda_fft.cc:467] Unable to register cuFFT factory",
]

KEPT = [
    "Epoch 1/10",
    "29/29 - 1s - 41ms/step - accuracy: 0.9082 - loss: 0.5967",
    # Python logging through absl names a .py file: the user's, kept.
    "I0623 14:05:07.450448 140234 train.py:12] my own log line",
    # Fatal lines say why the process aborts.
    "F0000 00:00:1796356644.450448    1393 collective.cc:12] Check failed",
    "WARNING:tensorflow:a Python warning",
    "Traceback (most recent call last):",
    "",
]


@pytest.mark.parametrize("line", NATIVE)
def test_native_lines_are_recognised(line):
    assert tf_logs.is_native_log_line(line)
    assert not tf_logs.keep_line(line)
    # The tests' own, broader counter agrees.
    assert native_log_lines(line) == [line]


@pytest.mark.parametrize("line", KEPT)
def test_other_lines_are_kept(line):
    assert not tf_logs.is_native_log_line(line)
    assert tf_logs.keep_line(line)


@pytest.mark.parametrize(
    "environ, flag, quiet",
    [
        ({}, False, True),
        ({}, True, False),
        ({"KERAS_DIST_TF_LOGS": "1"}, False, False),
        ({"KERAS_DIST_TF_LOGS": "true"}, False, False),
        ({"KERAS_DIST_TF_LOGS": "0"}, False, True),
        ({"KERAS_DIST_TF_LOGS": "off"}, False, True),
        ({"KERAS_DIST_TF_LOGS": ""}, False, True),
        # The user chose a level: theirs, and nothing is filtered.
        ({"TF_CPP_MIN_LOG_LEVEL": "0"}, False, False),
        ({"TF_CPP_MIN_LOG_LEVEL": "3"}, False, False),
    ],
)
def test_quiet_unless_the_user_said_something_about_tensorflow_logs(
    environ, flag, quiet
):
    assert tf_logs.is_quiet(environ, flag) is quiet
    env = dict(environ)
    assert tf_logs.prepare_environment(env, flag) is quiet
    if quiet:
        assert env == {**environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    else:
        assert env == environ


def _run(code):
    # `sys.argv = ["-m"]`: as under `python -m keras_dist`, `import keras_dist`
    # then loads no TensorFlow.
    return subprocess.run(
        [
            sys.executable,
            "-c",
            'import sys; sys.argv = ["-m"]\n' + textwrap.dedent(code),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_quiet_import_drops_native_lines_written_to_descriptor_2():
    # What absl does while TensorFlow loads: writes to fd 2 directly. A
    # Python warning written meanwhile comes out, in order, after the block.
    result = _run(
        """
        import os, sys
        from keras_dist.launcher import tf_logs
        print("before", file=sys.stderr, flush=True)
        with tf_logs.quiet_import(True):
            os.write(2, b"WARNING: All log messages before absl::InitializeLog() "
                        b"is called are written to STDERR\\n")
            os.write(2, b"I0000 00:00:1796356644.45 1393 port.cc:153] oneDNN\\n")
            print("a warning", file=sys.stderr)
            os.write(2, b"E0000 00:00:1796356647.92 1393 cuda_platform.cc:52] x\\n")
        print("after", file=sys.stderr)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["before", "a warning", "after"]


def test_quiet_import_passes_everything_when_not_quiet_and_reraises():
    result = _run(
        """
        import os
        from keras_dist.launcher import tf_logs
        try:
            with tf_logs.quiet_import(True):
                raise ValueError("boom")
        except ValueError as error:
            print("caught", error)
        with tf_logs.quiet_import(False):
            os.write(2, b"I0000 00:00:1796356644.45 1393 port.cc:153] shown\\n")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "caught boom\n"
    assert "port.cc:153] shown" in result.stderr
