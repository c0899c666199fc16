"""Multi-worker start-up and stop, with real processes: a missing worker is
reported within the start-up timeout, workers started apart still form a
cluster, and SIGTERM stops training workers at once."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from keras_dist import cluster
from keras_dist.launcher import DEFAULT_GRACE_PERIOD
from keras_dist.launcher import process as process_lib

pytestmark = [
    pytest.mark.multiworker,
    pytest.mark.skipif(os.name != "posix", reason="process groups and SIGTERM"),
]

# Builds the strategy, runs one all-reduce, prints the sum.
BUILD_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import keras_dist
    import tensorflow as tf

    start = time.monotonic()
    try:
        strategy = keras_dist.auto_strategy(startup_timeout=float(sys.argv[1]))
    except RuntimeError as error:
        print(f"after {time.monotonic() - start:.1f} s: {error}", flush=True)
        sys.exit(3)
    total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
    print(f"sum={float(total)}", flush=True)
    """
)

# Trains in a loop of all-reduces until stopped; says when it is under way.
TRAIN_SCRIPT = textwrap.dedent(
    """
    import keras_dist
    import tensorflow as tf

    strategy = keras_dist.auto_strategy(startup_timeout=120)

    @tf.function
    def step():
        values = strategy.run(lambda: tf.ones([1000]))
        return strategy.reduce("SUM", values, axis=None)

    step()
    print("training", flush=True)
    while True:
        step()
    """
)


def _env(**extra):
    env = process_lib.env_with_package(os.environ)
    env.update(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3", **extra)
    for name in ("KERAS_DIST_STARTUP_TIMEOUT", "KERAS_DIST_TPU", "TPU_NAME"):
        env.pop(name, None)
    return env


def _start_worker(spec, index, timeout):
    env = _env(TF_CONFIG=cluster.make_tf_config(spec, "worker", index))
    return process_lib.start([sys.executable, "-c", BUILD_SCRIPT, str(timeout)], env)


def _finish(process, timeout):
    try:
        out, _ = process.communicate(timeout=timeout)
    finally:
        process_lib.kill([process])
    return out.decode(errors="replace")


def test_missing_worker_is_reported_within_the_timeout():
    spec = cluster.local_cluster(workers=2)
    start = time.monotonic()
    process = _start_worker(spec, 0, timeout=8)
    # Importing TensorFlow takes part of the budget on a busy machine.
    out = _finish(process, timeout=120)
    elapsed = time.monotonic() - start
    assert process.returncode == 3, out
    missing = spec["worker"][1]
    assert (
        f"Timed out after 8 s waiting for the cluster to start: worker:1 at {missing}"
        in out
    )
    assert "This process is worker:0" in out
    assert "KERAS_DIST_STARTUP_TIMEOUT" in out
    reported_after = float(out.split("after ", 1)[1].split(" s:", 1)[0])
    assert 8 <= reported_after < 12, out
    assert elapsed < 100


@pytest.mark.slow
def test_workers_started_apart_form_one_cluster():
    spec = cluster.local_cluster(workers=2)
    first = _start_worker(spec, 0, timeout=120)
    try:
        time.sleep(15)
        assert first.poll() is None, "worker 0 gave up before worker 1 started"
        second = _start_worker(spec, 1, timeout=120)
        out_second = _finish(second, timeout=180)
        out_first = _finish(first, timeout=60)
    finally:
        process_lib.kill([first])
    assert second.returncode == 0, out_second
    assert first.returncode == 0, out_first
    assert "sum=2.0" in out_first
    assert "sum=2.0" in out_second


def test_sigterm_stops_a_training_launch_at_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    command = [sys.executable, "-m", "keras_dist", "launch", "--workers", "2"]
    launcher = subprocess.Popen(
        [*command, "--", sys.executable, str(script)],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    try:
        deadline = time.monotonic() + 240
        while sum(line.rstrip().endswith("] training") for line in lines) < 2:
            line = launcher.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        time.sleep(1)  # both workers well inside their collective loop
        start = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        rest = launcher.stdout.read()
        launcher.wait(timeout=60)
        stop_seconds = time.monotonic() - start
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 128 + signal.SIGTERM, rest
    assert "received SIGTERM; stopping all tasks" in rest
    # Without auto_strategy restoring SIGTERM, every worker ignored it and
    # the stop took the whole grace period before SIGKILL.
    assert stop_seconds < DEFAULT_GRACE_PERIOD / 2, (stop_seconds, rest)
