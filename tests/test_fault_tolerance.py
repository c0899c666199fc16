"""Nothing lost when a worker dies: BackupAndRestore, launcher restarts,
bounded waits and preemption, with real processes and real signals.

The multi-worker tests run `tests/fault_worker.py` under `keras-dist launch`
with two workers: one launch trains the uninterrupted references (FP16,
PowerSGD, adaptive AutoScaleBatch) and the others hurt a worker (SIGKILL
between two backups in the middle of an accumulation cycle, SIGKILL inside
a backup, SIGTERM, a hung peer); the chief's final weights must equal the
reference's exactly (the same arithmetic in the same order: 0.0, asserted
to <= 1e-6; the same bound in one process). The single-process tests (2
logical replicas) cover the input
pipelines, steps_per_execution, a plain keras.Model and the bad-backup
errors. The backup store alone (atomic files, fallback, pruning) is in
`test_backup_store.py`.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import REPO_ROOT, Boom

import keras_dist
from keras_dist.backup import files as _files
from keras_dist.backup import manifest as _manifest
from keras_dist.backup import store as _backup
from keras_dist.callbacks import BackupAndRestore
from keras_dist.compression import FP16, PowerSGD

WORKER = os.path.join(REPO_ROOT, "tests", "fault_worker.py")
LAUNCH_TIMEOUT = 600


def launch(tmp, *args, max_restarts=0, collective_timeout=None, timeout=None, env=None):
    """Runs fault_worker.py on 2 workers; returns (status, output, seconds)."""
    command = [
        sys.executable,
        "-m",
        "keras_dist",
        "launch",
        "--workers",
        "2",
        "--max-restarts",
        str(max_restarts),
    ]
    if collective_timeout is not None:
        command += ["--collective-timeout", str(collective_timeout)]
    command += ["--", sys.executable, WORKER, str(tmp / "out"), str(tmp / "b"), *args]
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONPATH": REPO_ROOT,
        **(env or {}),
    }
    start = time.monotonic()
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=timeout or LAUNCH_TIMEOUT,
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


def weights(folder):
    with np.load(os.path.join(folder, "weights.npz")) as archive:
        return [archive[name] for name in archive.files]


def summary(folder):
    with open(os.path.join(folder, "summary.json")) as handle:
        return json.load(handle)


def assert_same_run(got, reference):
    for a, b in zip(weights(got), weights(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    got, reference = summary(got), summary(reference)
    assert got["iterations"] == reference["iterations"]
    assert got["accumulation_steps"] == reference["accumulation_steps"]
    # The resumed fit's History has the epochs it ran (the resumed one
    # included), with the same logs as the uninterrupted run's.
    assert set(got["history"]) == set(reference["history"])
    for key, values in got["history"].items():
        assert values, key
        assert values == pytest.approx(
            reference["history"][key][-len(values) :], rel=1e-6
        ), key


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The uninterrupted 2-worker runs, one launch for all four."""
    tmp = tmp_path_factory.mktemp("references")
    status, output, _ = launch(
        tmp,
        *("--config", "fp16", "--config", "powersgd"),
        *("--config", "autoscale", "--config", "diloco"),
    )
    assert status == 0, output[-3000:]
    # Training ended normally: the backups were deleted.
    assert not os.path.exists(tmp / "b" / "fp16")
    return tmp / "out"


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.extended
def test_kill_inside_a_save_then_sigterm_resume_exactly(tmp_path, references):
    # Attempt 0: the chief is SIGKILLed inside its 2nd backup (state file
    # written, not switched to): attempt 1 resumes from the 1st. Attempt 1:
    # worker 1 gets SIGTERM after its 6th batch (4 of them replayed): both
    # write a backup after the next one and exit 75; attempt 2 resumes
    # there. FP16 + accumulation 2.
    status, output, _ = launch(
        tmp_path,
        "--config",
        "fp16",
        "--hurt",
        "0:save:2",
        "--hurt",
        "1:term:6",
        max_restarts=2,
    )
    assert status == 0, output[-3000:]
    assert "killed inside the save" in output
    assert "restart 1 of 2: worker:0 failed with exit code 137" in output
    assert "fp16/backup-00000001 in epoch 1, after 4 batches" in output
    assert "preempted (SIGTERM); backup written in epoch 1, after batch 7" in output
    # Both workers exit 75; the launcher names the first it saw.
    assert "was preempted (status 75" in output
    assert "in epoch 1, after 7 batches of it" in output
    assert_same_run(tmp_path / "out" / "fp16", references / "fp16")


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.extended
def test_kill_inside_a_background_write_resumes_exactly(tmp_path, references):
    # `async_write=True`: the chief's 2nd backup is written on its writer
    # thread while training goes on, and the process is SIGKILLed there
    # (state file written, not switched to). The restart resumes from the
    # 1st backup and ends with the uninterrupted run's weights.
    status, output, _ = launch(
        tmp_path,
        "--config",
        "fp16",
        "--async-write",
        "--hurt",
        "0:save:2",
        max_restarts=1,
    )
    assert status == 0, output[-3000:]
    assert "killed inside the save on keras_dist-backup-writer" in output
    assert "restart 1 of 1: worker:0 failed with exit code 137" in output
    assert "fp16/backup-00000001 in epoch 1, after 4 batches" in output
    assert_same_run(tmp_path / "out" / "fp16", references / "fp16")


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.extended
def test_sigkill_mid_accumulation_powersgd_resumes_exactly(tmp_path, references):
    # Backups every 4 batches; the kill after batch 7 is between two of them
    # and in the middle of an accumulation cycle (7 is odd).
    status, output, _ = launch(
        tmp_path, "--config", "powersgd", "--hurt", "0:kill:7", max_restarts=1
    )
    assert status == 0, output[-3000:]
    # The launcher's report: the lost task, how, its last lines and log,
    # and what the restart resumes from.
    assert "keras-dist: worker:1 lost after" in output
    assert ": worker:1 was killed by SIGKILL." in output
    assert "its last lines (all of them: " in output
    assert "restart 1 of 1: worker:1 failed with exit code 137" in output
    assert "KERAS_DIST_RESTART=1" in output
    assert "from the backup of epoch 1, 4 batches into it" in output
    assert "powersgd/backup-00000001 in epoch 1, after 4 batches" in output
    # worker:0's collective-abort traceback is one line.
    assert "Traceback (most recent call last)" not in output
    assert_same_run(tmp_path / "out" / "powersgd", references / "powersgd")


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.extended
def test_sigkill_inside_a_diloco_window_resumes_exactly(tmp_path, references):
    # 6 updates an epoch, a sync every 5: the backup after batch 4 is 2
    # updates into the first window, the kill after batch 7 in its middle
    # (and in an accumulation cycle's). Each worker's weights, Adam moments
    # and the outer momentum come back; the run ends as the reference.
    status, output, _ = launch(
        tmp_path, "--config", "diloco", "--hurt", "0:kill:7", max_restarts=1
    )
    assert status == 0, output[-3000:]
    assert "restart 1 of 1: worker:1 failed with exit code 137" in output
    assert "diloco/backup-00000001 in epoch 1, after 4 batches" in output
    assert_same_run(tmp_path / "out" / "diloco", references / "diloco")


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.extended
def test_tensorflow_collectives_sigkill_resumes_exactly_as_the_default(
    tmp_path, references
):
    """The same kill with KERAS_DIST_COLLECTIVES=tensorflow: the run ends
    with the weights of the reference, which ran on the default collectives
    (gloo where PyTorch is installed, as in the suite's environment; then
    test_sigkill_mid_accumulation_powersgd_resumes_exactly is the gloo
    run's kill, and this one TensorFlow's).
    fault_worker.py accumulates gradients, whose sums run in a `tf.cond`
    and so stay on TensorFlow's collectives either way; the step's metric
    sums go through gloo under the default (test_gloo.py covers the
    gradients')."""
    status, output, _ = launch(
        tmp_path,
        "--config",
        "powersgd",
        "--hurt",
        "0:kill:7",
        max_restarts=1,
        env={"KERAS_DIST_COLLECTIVES": "tensorflow"},
    )
    assert status == 0, output[-3000:]
    assert "restart 1 of 1: worker:1 failed with exit code 137" in output
    assert "powersgd/backup-00000001 in epoch 1, after 4 batches" in output
    assert_same_run(tmp_path / "out" / "powersgd", references / "powersgd")


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.extended
def test_sigkill_after_autoscale_grew_the_batch_resumes_exactly(tmp_path, references):
    grown = summary(references / "autoscale")
    # The adaptive batch grew during the reference run (2 -> more).
    assert grown["accumulation_steps"] > 2
    assert grown["history"]["batch_size"][0] > 16 * 2  # grown in epoch 1 of 4
    status, output, _ = launch(
        tmp_path, "--config", "autoscale", "--hurt", "0:kill:31", max_restarts=1
    )
    assert status == 0, output[-3000:]
    assert "restart 1 of 1: worker:1 failed" in output
    assert "autoscale/backup-" in output
    assert_same_run(tmp_path / "out" / "autoscale", references / "autoscale")


@pytest.mark.multiworker
@pytest.mark.slow
def test_hung_peer_fails_the_survivor_within_the_collective_timeout(tmp_path):
    # Worker 1 stays alive but stops taking part (it sleeps after 3
    # batches); worker 0 waits in its next all-reduce until the timeout.
    timeout = 15
    status, output, seconds = launch(
        tmp_path, "--hurt", "0:hang:3", collective_timeout=timeout
    )
    assert status != 0
    assert "Training stopped on worker:0: a peer stopped taking part" in output
    # keras_dist's watchdog, not TensorFlow's per-collective timeout: its
    # line is in worker 0's log file, which the one-line error names.
    log = re.search(r"\(traceback: (\S+worker-0\.log)\)", output)
    assert log, output[-3000:]
    with open(log.group(1)) as handle:
        assert "waited 15 s in one call into TensorFlow" in handle.read()
    assert "keras-dist: worker:1 hung after" in output
    assert "still running: worker:1." in output
    # Start-up (~20-40 s here) + 3 batches + the timeout, with a generous
    # margin for a loaded 2-core machine; without the timeout: 600 s.
    assert seconds < timeout + 150, seconds


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.extended
def test_stopped_peer_fails_the_survivor_long_before_the_timeout(tmp_path):
    # Worker 1 is SIGSTOPped after 3 batches: frozen, its heartbeats too.
    # TensorFlow's coordination service misses them and aborts the
    # survivor's collectives in about 10 s (measured 7-8 s), whatever the
    # collective timeout (300 s, the launcher's default, here); the
    # launcher then stops the job, the frozen task with SIGKILL.
    status, output, seconds = launch(tmp_path, "--hurt", "0:stop:3")
    assert status != 0
    assert "Training stopped on worker:0: lost worker:1: it stopped sending" in output
    assert "keras-dist: worker:1 lost after" in output
    assert ": worker:1 is stopped (SIGSTOP)." in output
    # Start-up (~20-40 s) + 3 batches + ~10 s, with a margin for a loaded
    # machine; far below the 300 s timeout.
    assert seconds < 200, seconds


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.parametrize(
    "backend", [pytest.param("tensorflow", marks=pytest.mark.extended), "auto"]
)
def test_stopped_first_worker_is_named_by_the_survivor(tmp_path, backend):
    # Worker 0 hosts TensorFlow's coordination service: when it is frozen,
    # worker 1's own heartbeats to the service time out, and TensorFlow's
    # error names no task ("Deadline Exceeded ... CoordinationService/
    # Heartbeat"). The survivor's line names worker 0 all the same, with
    # TensorFlow's collectives and with the default (gloo, PyTorch being
    # installed).
    status, output, seconds = launch(
        tmp_path, "--hurt", "0:stop0:3", env={"KERAS_DIST_COLLECTIVES": backend}
    )
    assert status != 0
    assert (
        "Training stopped on worker:1: lost worker:0: this worker's heartbeats "
        "to the coordination service it hosts time out"
    ) in output, output[-3000:]
    assert ": worker:0 is stopped (SIGSTOP)." in output
    assert seconds < 200, seconds


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.extended
def test_stock_backup_and_checkpoint_write_on_the_chief_only(tmp_path):
    status, output, _ = launch(tmp_path, "--stock")
    assert status == 0, output[-3000:]
    assert "BlockingIOError" not in output
    assert sorted(os.listdir(tmp_path / "b")) == [
        "latest.weights.h5",
        "training_metadata.json",
    ]
    assert os.listdir(tmp_path / "out") == ["model.weights.h5"]
    # The non-chief's temporary folders are gone.
    assert output.count("stock done") == 2


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.parametrize(
    "backend", ["tensorflow", pytest.param("gloo", marks=pytest.mark.extended)]
)
def test_peer_killed_during_all_reduce_is_named(tmp_path, backend):
    # Without the launcher (which would stop the survivor at once): worker 1
    # SIGKILLs itself after 3 batches; worker 0 fails at its next
    # collective with an error that names worker 1, whether TensorFlow's
    # collectives or gloo (KERAS_DIST_COLLECTIVES) sum the gradients.
    from keras_dist import cluster

    if backend == "gloo":
        pytest.importorskip("torch", reason="the gloo backend needs PyTorch")

    spec = cluster.local_cluster(workers=2)
    processes = []
    for index in range(2):
        env = {
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "PYTHONPATH": REPO_ROOT,
            "TF_CONFIG": cluster.make_tf_config(spec, "worker", index),
            "KERAS_DIST_TASK": f"worker:{index}",
            "KERAS_DIST_COLLECTIVE_TIMEOUT": "60",
            "KERAS_DIST_COLLECTIVES": backend,
        }
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    WORKER,
                    str(tmp_path / "o"),
                    str(tmp_path / "b"),
                    "--hurt",
                    "0:kill:3",
                ],
                env=env,
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    start = time.monotonic()
    try:
        output0, _ = processes[0].communicate(timeout=LAUNCH_TIMEOUT)
        processes[1].communicate(timeout=60)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    assert processes[1].returncode == -signal.SIGKILL
    assert processes[0].returncode == 1, output0[-3000:]
    # With gloo, whichever collective of the step meets the loss first
    # fails it: TensorFlow's (the batch sizes) or gloo's (the gradients,
    # test_gloo.py); either way the survivor names the lost peer.
    assert "RuntimeError: Training stopped on worker:0: lost worker:1" in output0
    assert time.monotonic() - start < 60 + 150


def test_collective_timeout_reaches_the_strategy(monkeypatch):
    from keras_dist import strategy as strategy_lib

    options = strategy_lib._with_collective_timeout(None, 12.5)
    assert options.timeout_seconds == 12.5
    monkeypatch.setenv("KERAS_DIST_COLLECTIVE_TIMEOUT", "30")
    assert strategy_lib._with_collective_timeout(None, None).timeout_seconds == 30
    given = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=64)
    merged = strategy_lib._with_collective_timeout(given, None)
    assert (merged.bytes_per_pack, merged.timeout_seconds) == (64, 30)
    with pytest.raises(ValueError, match="once"):
        strategy_lib._with_collective_timeout(
            tf.distribute.experimental.CommunicationOptions(timeout_seconds=5), 9
        )
    monkeypatch.setenv("KERAS_DIST_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="KERAS_DIST_COLLECTIVE_TIMEOUT"):
        strategy_lib._with_collective_timeout(None, None)
    with pytest.raises(ValueError, match="collective_timeout"):
        keras_dist.auto_strategy(collective_timeout=0)


# --- One process, 2 logical replicas -----------------------------------------


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 3))).astype("float32")
    return x, y


def make_model(
    strategy, hook="fp16", distributed=True, steps_per_execution=1, accumulation_steps=2
):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(3),
            ]
        )
        optimizer = keras_dist.GradientAccumulationOptimizer(
            keras.optimizers.Adam(0.01), accumulation_steps=accumulation_steps
        )
        if distributed:
            hooks = {"fp16": FP16(), "powersgd": PowerSGD(rank=1, start_step=0)}
            model = keras_dist.DistributedModel.from_model(
                model, all_reduce_hook=hooks[hook]
            )
        model.compile(
            optimizer=optimizer,
            loss="mse",
            metrics=["mae"],
            steps_per_execution=steps_per_execution,
        )
    return model


def fit_until(
    model, backup, inputs, crash_at=None, extra=(), async_write=False, **kwargs
):
    backup = BackupAndRestore(backup, save_freq=3, async_write=async_write)
    callbacks = [backup, *extra]
    if crash_at:
        callbacks.append(Boom(crash_at))
    try:
        history = model.fit(inputs, epochs=3, callbacks=callbacks, verbose=0, **kwargs)
    except KeyboardInterrupt:
        # A crashed process finishes its background write before it exits
        # (a thread that is not a daemon); here the next run is in the same
        # process, so wait for it as the exit would.
        backup._writer.wait()
        return None
    return history.history


PIPELINES = {
    # Read whole every epoch: a fresh iterator each epoch.
    "epochs": lambda x, y: (tf.data.Dataset.from_tensor_slices((x, y)).batch(16), {}),
    # One stream over every epoch, reshuffled every epoch by `repeat`.
    "stream": lambda x, y: (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(96, seed=3, reshuffle_each_iteration=True)
        .batch(16)
        .repeat(),
        {"steps_per_epoch": 6},
    ),
}


@pytest.fixture
def backup_dir(request, tmp_path):
    """Where the interrupted run's backups go: a local folder, or `ram://`
    (TensorFlow's in-memory file system, written like an object store)."""
    if request.param == "disk":
        yield str(tmp_path / "b")
        return
    root = f"ram://kd-fault-{uuid.uuid4().hex}"
    yield f"{root}/b"
    _files.rmtree(root)


# Each case on one store in `make test` (so that each store sees both
# pipelines, both hooks and both write modes), and on the other store in
# `make test-all`.
RESUME_CASES = [
    ("disk", "epochs", "fp16", 11, 1, False),
    ("ram", "epochs", "powersgd", 8, 1, False),
    ("ram", "stream", "fp16", 11, 1, False),
    ("disk", "stream", "powersgd", 5, 2, False),
    ("ram", "epochs", "fp16", 11, 1, True),
    ("disk", "stream", "powersgd", 5, 2, True),
]
OTHER_STORE = {"disk": "ram", "ram": "disk"}


def _resume_params():
    for store, *case in RESUME_CASES:
        yield pytest.param(store, *case)
        yield pytest.param(OTHER_STORE[store], *case, marks=pytest.mark.extended)


@pytest.mark.parametrize(
    (
        "backup_dir",
        "pipeline",
        "hook",
        "crash_at",
        "steps_per_execution",
        "async_write",
    ),
    list(_resume_params()),
    indirect=["backup_dir"],
)
def test_resume_is_exact_on_replicas(
    mirrored,
    tmp_path,
    backup_dir,
    pipeline,
    hook,
    crash_at,
    steps_per_execution,
    async_write,
):
    strategy = mirrored(2)
    x, y = data()

    def run(folder, crash_at=None):
        # A new dataset for each run, as a restarted process builds it: a
        # dataset object read again reshuffles (its seed generator moved on).
        inputs, kwargs = PIPELINES[pipeline](x, y)
        model = make_model(strategy, hook, steps_per_execution=steps_per_execution)
        return model, fit_until(
            model, folder, inputs, crash_at, async_write=async_write, **kwargs
        )

    reference, expected = run(str(tmp_path / "r"))
    assert run(backup_dir, crash_at)[1] is None
    assert _files.exists(_files.join(backup_dir, _backup.CURRENT))
    resumed, history = run(backup_dir)
    for a, b in zip(resumed.weights, reference.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6)
    # The logs of the epochs it ran too (the resumed one included: the
    # metrics' running sums were in the backup).
    assert set(history) == set(expected)
    for key, values in history.items():
        assert values == pytest.approx(expected[key][-len(values) :], rel=1e-6)
    assert not _files.exists(backup_dir)


def test_a_fit_after_a_crash_finishes_its_background_write_first(mirrored, tmp_path):
    # A notebook: `fit` crashes while a background write may still run, and
    # the next cell fits a fresh model with the same callback object. It
    # waits for that write, then resumes exactly from the newest backup.
    strategy = mirrored(2)
    x, y = data()
    inputs, _ = PIPELINES["epochs"](x, y)
    reference = make_model(strategy)
    expected = fit_until(reference, str(tmp_path / "r"), inputs)
    backup = BackupAndRestore(str(tmp_path / "b"), save_freq=3, async_write=True)
    with pytest.raises(KeyboardInterrupt):
        make_model(strategy).fit(
            inputs, epochs=3, callbacks=[backup, Boom(11)], verbose=0
        )
    resumed = make_model(strategy)
    history = resumed.fit(inputs, epochs=3, callbacks=[backup], verbose=0).history
    # Resumed in the second epoch (6 batches each), not started over.
    assert len(history["loss"]) == 2
    for a, b in zip(resumed.weights, reference.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6)
    assert history["loss"] == pytest.approx(
        expected["loss"][-len(history["loss"]) :], rel=1e-6
    )


def test_plain_keras_model_resumes_exactly(mirrored, tmp_path):
    strategy = mirrored(2)
    x, y = data()
    inputs, _ = PIPELINES["epochs"](x, y)
    reference = make_model(strategy, distributed=False)
    fit_until(reference, str(tmp_path / "r"), inputs)
    fit_until(make_model(strategy, distributed=False), str(tmp_path / "b"), inputs, 10)
    resumed = make_model(strategy, distributed=False)
    fit_until(resumed, str(tmp_path / "b"), inputs)
    for a, b in zip(resumed.weights, reference.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6)


def crashed_backup(strategy, tmp_path, crash_at=10):
    x, y = data()
    inputs, _ = PIPELINES["epochs"](x, y)
    model = make_model(strategy)
    fit_until(model, str(tmp_path / "b"), inputs, crash_at)
    return inputs


def other_model(strategy):
    """A model with other variables than `make_model`'s (one layer)."""
    with strategy.scope():
        other = keras_dist.DistributedModel.from_model(
            keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)]),
            all_reduce_hook=FP16(),
        )
        other.compile(
            optimizer=keras_dist.GradientAccumulationOptimizer(
                keras.optimizers.Adam(0.01), accumulation_steps=2
            ),
            loss="mse",
            metrics=["mae"],
        )
    return other


def test_backup_of_another_model_is_an_error(mirrored, tmp_path):
    strategy = mirrored(2)
    inputs = crashed_backup(strategy, tmp_path)
    other = other_model(strategy)
    with pytest.raises(ValueError, match="different model"):
        fit_until(other, str(tmp_path / "b"), inputs)


def test_backup_of_another_replica_count_resumes_elastically(
    mirrored, tmp_path, caplog
):
    # Refused before issue 29; now the batch of 16 per step and 2
    # accumulation steps hold on 1 replica (tests/test_elastic.py checks
    # the arithmetic and exactness).
    crashed_backup(mirrored(2), tmp_path)
    x, y = data()
    model = make_model(mirrored(1))
    with caplog.at_level("WARNING"):
        assert fit_until(model, str(tmp_path / "b"), PIPELINES["epochs"](x, y)[0])
    assert (
        "elastic resume: 1 worker(s) / 2 replica(s) -> 1 / 1; global batch per "
        "step 16 -> 16, per update 32 -> 32 (accumulation_steps=2)"
    ) in caplog.text


def test_backup_of_another_model_on_another_replica_count_is_an_error(
    mirrored, tmp_path
):
    crashed_backup(mirrored(2), tmp_path)
    x, y = data()
    strategy = mirrored(1)
    other = other_model(strategy)
    with pytest.raises(ValueError, match="different model"):
        fit_until(other, str(tmp_path / "b"), PIPELINES["epochs"](x, y)[0])


@pytest.mark.parametrize("corrupt", ["state", "manifest"])
def test_corrupt_newest_backup_falls_back_to_the_previous(
    mirrored, tmp_path, caplog, corrupt
):
    strategy = mirrored(2)
    inputs = crashed_backup(strategy, tmp_path)
    names = _backup.backup_names(str(tmp_path / "b"))
    assert names == ["backup-00000003", "backup-00000002"]
    newest = tmp_path / "b" / names[0]
    if corrupt == "state":
        state = newest / _backup.STATE_FILE
        state.write_bytes(state.read_bytes()[:-10] + b"0123456789")
        problem = "backup-00000003/state.npz is corrupt"
    else:
        # Issue 31 W2: an edited epoch resumed silently at the wrong place.
        manifest = newest / _backup.MANIFEST_FILE
        fields = json.loads(manifest.read_text())
        assert fields["epoch"] == 1
        manifest.write_text(json.dumps({**fields, "epoch": 2}))
        problem = "backup-00000003/manifest.json is corrupt or was edited"
    model = make_model(strategy)
    callback = BackupAndRestore(str(tmp_path / "b"), save_freq=3)
    with caplog.at_level("WARNING"), pytest.raises(KeyboardInterrupt):
        model.fit(inputs, epochs=1, callbacks=[callback, Boom(1)], verbose=0)
    assert problem in caplog.text
    assert "resumed from" in caplog.text and "backup-00000002" in caplog.text


def test_no_usable_backup_is_an_error_not_a_fresh_start(mirrored, tmp_path):
    strategy = mirrored(2)
    inputs = crashed_backup(strategy, tmp_path)
    for name in _backup.backup_names(str(tmp_path / "b")):
        (tmp_path / "b" / name / _backup.MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=r"none is usable.*will not start over"):
        fit_until(make_model(strategy), str(tmp_path / "b"), inputs)


def test_a_partial_first_backup_starts_fresh(mirrored, tmp_path):
    # Killed during the very first save: nothing was ever completed.
    (tmp_path / "b" / ".partial-1234").mkdir(parents=True)
    (tmp_path / "b" / ".partial-1234" / _backup.STATE_FILE).write_bytes(b"half")
    x, y = data()
    model = make_model(mirrored(2))
    assert fit_until(model, str(tmp_path / "b"), PIPELINES["epochs"](x, y)[0])
    assert int(model.optimizer.iterations.numpy()) == 9


def test_backup_and_restore_arguments():
    with pytest.raises(TypeError, match="backup_dir"):
        BackupAndRestore(3)
    with pytest.raises(ValueError, match="backup_dir"):
        BackupAndRestore("")
    with pytest.raises(ValueError, match="save_freq"):
        BackupAndRestore("/tmp/x", save_freq=0)
    with pytest.raises(TypeError, match="save_freq"):
        BackupAndRestore("/tmp/x", save_freq="batch")
    with pytest.raises(TypeError, match="delete_checkpoint"):
        BackupAndRestore("/tmp/x", delete_checkpoint="yes")
    with pytest.raises(TypeError, match="async_write"):
        BackupAndRestore("/tmp/x", async_write=1)


def test_resume_is_exact_without_a_strategy(tmp_path):
    # The default strategy (one device, no strategy scope): the README's case.
    strategy = tf.distribute.get_strategy()
    x, y = data()
    inputs, _ = PIPELINES["epochs"](x, y)
    reference = make_model(strategy)
    fit_until(reference, str(tmp_path / "r"), inputs)
    fit_until(make_model(strategy), str(tmp_path / "b"), inputs, 10)
    resumed = make_model(strategy)
    fit_until(resumed, str(tmp_path / "b"), inputs)
    for a, b in zip(resumed.weights, reference.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6)


# --- Changed settings on resume (issue 31 B1, W1) -------------------------------


class SetAccumulationSteps(keras.callbacks.Callback):
    """Assigns `accumulation_steps` after the N-th batch of the run."""

    def __init__(self, after, steps):
        super().__init__()
        self.after, self.steps, self.seen = after, steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.after:
            self.model.optimizer.accumulation_steps = self.steps


def test_a_changed_accumulation_steps_resumes_with_the_new_value_exactly(
    mirrored, tmp_path, caplog
):
    # Issue 31 B1 (was: the backup's 2 silently undid the new 4). The
    # backup after batch 9 holds 1 pending micro-step of a 2-step cycle;
    # resumed with 4, that cycle completes after 3 more, as in a run that
    # assigned `accumulation_steps = 4` after batch 9 without stopping.
    strategy = mirrored(2)
    x, y = data()
    inputs, _ = PIPELINES["epochs"](x, y)
    reference = make_model(strategy)
    fit_until(
        reference, str(tmp_path / "r"), inputs, extra=[SetAccumulationSteps(9, 4)]
    )
    fit_until(make_model(strategy), str(tmp_path / "b"), inputs, crash_at=11)
    _, manifest, _ = _backup.read_latest(str(tmp_path / "b"))
    assert manifest["accumulation"] == {"configured": 2, "steps": 2, "pending": 1}
    resumed = make_model(strategy, accumulation_steps=4)
    with caplog.at_level("WARNING"):
        fit_until(resumed, str(tmp_path / "b"), inputs)
    assert resumed.optimizer.accumulation_steps == 4
    assert reference.optimizer.accumulation_steps == 4
    assert "accumulation_steps 4 (this run) instead of 2" in caplog.text
    assert "1 pending micro-step(s) complete an update after 3 more" in caplog.text
    assert int(resumed.optimizer.iterations.numpy()) == int(
        reference.optimizer.iterations.numpy()
    )
    for a, b in zip(resumed.weights, reference.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6)


def test_a_changed_accumulation_steps_that_cannot_carry_the_cycle_is_refused(
    mirrored, tmp_path
):
    strategy = mirrored(2)
    inputs = crashed_backup(strategy, tmp_path)  # after batch 9: 1 pending
    model = make_model(strategy, accumulation_steps=1)
    with pytest.raises(
        ValueError,
        match=r"accumulation_steps=2 in the middle of an update \(1 micro-steps "
        r"accumulated\); this run asks for accumulation_steps=1",
    ):
        fit_until(model, str(tmp_path / "b"), inputs)
    # Nothing was trained or deleted: the same backup resumes with 2.
    assert _backup.read_latest(str(tmp_path / "b"))[1]["epoch"] == 1


def test_the_accumulation_rule():
    rule = _manifest.accumulation_steps_on_resume
    assert rule(2, 1, 2, "here") == 2
    assert rule(2, 1, 4, "here") == 4
    assert rule(4, 0, 1, "here") == 1  # a completed cycle carries to any value
    assert rule(4, 3, 8, "here") == 8
    with pytest.raises(ValueError, match=r"accumulation_steps=4 .* asks for .*=3"):
        rule(4, 3, 3, "here")
    with pytest.raises(ValueError, match=r"saved state of AutoScaleBatch"):
        rule(1, 0, 2, "here", trackers=["AutoScaleBatch"])
    assert rule(4, 3, 4, "here", trackers=["AutoScaleBatch"]) == 4


@pytest.mark.parametrize("new_batch_size", [8, 32])
def test_a_changed_batch_size_is_refused_naming_both(
    mirrored, tmp_path, new_batch_size
):
    # Issue 31 W1 (was: a smaller batch resumed at other examples, silently).
    strategy = mirrored(2)
    crashed_backup(strategy, tmp_path)  # batches of 16, after batch 9
    _, manifest, _ = _backup.read_latest(str(tmp_path / "b"))
    assert (manifest["batch_size"], manifest["position"]) == (16, 3)
    x, y = data()
    inputs = tf.data.Dataset.from_tensor_slices((x, y)).batch(new_batch_size)
    with pytest.raises(
        ValueError,
        match=rf"batches of 16 examples .* gives batches of {new_batch_size}\. ",
    ):
        fit_until(make_model(strategy), str(tmp_path / "b"), inputs)


@pytest.mark.parametrize("async_write", [False, True], ids=["sync", "async"])
def test_a_full_disk_stops_fit_with_the_room_needed_and_no_partial_left(
    tmp_path, async_write
):
    # Issue 31 W3, on a real 64 KiB tmpfs: the first backup does not fit.
    # Written in the background, the error stops `fit` at the next batch.
    from test_backup_store import tmpfs

    with tmpfs(tmp_path / "disk", "64k") as disk:
        folder = os.path.join(disk, "backup")
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4000)])
        model.compile(optimizer="adam", loss="mse")
        x = np.zeros((32, 8), "float32")
        with pytest.raises(OSError) as raised:
            model.fit(
                x,
                np.zeros((32, 4000), "float32"),
                batch_size=16,
                callbacks=[
                    BackupAndRestore(folder, save_freq=1, async_write=async_write)
                ],
                verbose=0,
            )
        assert raised.value.errno == 28
        assert f"backup_dir={folder!r}" in str(raised.value)
        assert "room for about 3 of them" in str(raised.value)
        # No partial backup keeps the disk full for the next attempt.
        assert os.listdir(folder) == [_backup.lock_lib.LOCK_FILE]


def test_another_steps_per_execution_is_refused(mirrored, tmp_path):
    strategy = mirrored(2)
    inputs = crashed_backup(strategy, tmp_path)
    model = make_model(strategy, steps_per_execution=2)
    with pytest.raises(
        ValueError, match=r"steps_per_execution=1; this model has steps_per_execution=2"
    ):
        fit_until(model, str(tmp_path / "b"), inputs)


def test_a_callback_with_backup_state_added_on_resume_is_refused(mirrored, tmp_path):
    strategy = mirrored(2)
    inputs = crashed_backup(strategy, tmp_path)
    autoscale = keras_dist.callbacks.AutoScaleBatch(8)
    with pytest.raises(
        ValueError, match=r"has a AutoScaleBatch callback, but the backup holds no"
    ):
        fit_until(make_model(strategy), str(tmp_path / "b"), inputs, extra=[autoscale])


def test_a_batch_size_changed_at_an_epoch_boundary_resumes(mirrored, tmp_path):
    # A backup written at the end of an epoch skips nothing: the next epoch
    # starts from its first example, at the new batch size.
    strategy = mirrored(2)
    x, y = data()

    def fit(batch_size, crash_at=None):
        callbacks = [BackupAndRestore(str(tmp_path / "b"))]  # save_freq="epoch"
        if crash_at:
            callbacks.append(Boom(crash_at))
        model = make_model(strategy)
        inputs = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
        return model, model.fit(inputs, epochs=2, callbacks=callbacks, verbose=0)

    with pytest.raises(KeyboardInterrupt):
        fit(16, crash_at=8)  # in epoch 1, after the backup of epoch 0
    model, history = fit(8)
    assert len(history.history["loss"]) == 1  # epoch 1 only
    # Epoch 0: 6 micro-steps of 16 (3 updates); epoch 1: 12 of 8 (6 updates).
    assert int(model.optimizer.iterations.numpy()) == 3 + 6
