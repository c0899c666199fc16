"""Every example runs (fast paths), so none of them rots (the demo: test_demo.py)."""

import os
import subprocess
import sys

import pytest
import transcripts
from helpers import REPO_ROOT

EXAMPLES = os.path.join(REPO_ROOT, "examples")


def run(args, timeout=300, cwd=None, stderr_too=False, tf_logs="2", merged=False):
    """Runs `python *args`; `tf_logs=None` leaves TF_CPP_MIN_LOG_LEVEL unset
    (as a user's shell has it: the launcher then quiets TensorFlow);
    `merged`: stdout and stderr in one pipe, in the order they were written."""
    env = dict(
        os.environ, TF_CPP_MIN_LOG_LEVEL=tf_logs or "", PYTHONPATH=str(REPO_ROOT)
    )
    if tf_logs is None:
        del env["TF_CPP_MIN_LOG_LEVEL"]
    result = subprocess.run(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
        text=True,
        timeout=timeout,
        cwd=cwd or REPO_ROOT,
        env=env,
    )
    stderr = result.stderr or ""
    assert result.returncode == 0, result.stdout[-4000:] + stderr[-4000:]
    return result.stdout + stderr if stderr_too else result.stdout


def test_mirrored_cnn_example():
    out = run([os.path.join(EXAMPLES, "mirrored_cnn.py"), "--smoke"], stderr_too=True)
    assert "digits (smoke)" in out
    assert "global batch 32 in both runs (16 per replica x 2)" in out
    # Every model is built in the scope it trains in: no scope warning.
    assert "was created under" not in out
    rows = {row[0]: row for row in _table_rows(out, "") if len(row) == 4}
    # The same global batch: the same updates, and the same model.
    assert rows["1 device"][1] == rows["2 devices"][1] == "16"
    assert abs(float(rows["1 device"][3]) - float(rows["2 devices"][3])) <= 0.02
    [line] = [line for line in out.splitlines() if line.startswith("max |w_2")]
    assert float(line.split("=")[1].split(":")[0]) < 1e-3, line
    # Logical CPU devices share the cores: no speed-up is claimed.
    assert "The 2 devices are logical CPU devices" in out
    assert "speed-up:" not in out


@pytest.mark.multiworker
def test_multi_worker_example_through_the_launcher():
    script = os.path.join(EXAMPLES, "multi_worker.py")
    launch = ["-m", "keras_dist", "launch", "--workers", "2", "--"]
    out = run([*launch, sys.executable, script, "--smoke"])
    for worker in (0, 1):
        assert (
            f"[worker:{worker}] all-reduce of (task index + 1) over workers: 3" in out
        )
    digests = {line.split()[3] for line in out.splitlines() if "weights sha256" in line}
    assert len(digests) == 1


@pytest.mark.extended
def test_elastic_example_loses_a_worker_and_goes_on_with_two(tmp_path):
    # The fault-tolerance guide's command: 3 workers, the last one's machine
    # is lost in epoch 2, the job goes on with 2 from the backup, holding
    # the update batch of 96 (accumulation 2 -> 3).
    slots = tmp_path / "slots"
    slots.write_text("3\n")
    script = os.path.join(EXAMPLES, "elastic.py")
    launch = ["-m", "keras_dist", "launch", "--workers", "2:3"]
    launch += ["--discover", f"cat {slots}", "--max-restarts", "2", "--"]
    out = run(
        [
            *launch,
            sys.executable,
            script,
            "--lose-a-worker",
            str(slots),
            "--backup-dir",
            str(tmp_path / "backup"),
        ],
        tf_logs=None,
        merged=True,
    )
    assert "starting the whole job again with 2 workers instead of 3" in out
    assert (
        "elastic resume: 3 worker(s) / 3 replica(s) -> 2 / 2; global batch per "
        "step 48 -> 32, per update 96 -> 96 (accumulation_steps=3)"
    ) in out
    done = [line for line in out.splitlines() if "] done on 2 replicas" in line]
    assert len(done) == 2
    assert "accumulation_steps=3, updates=48" in done[0]
    # The fault-tolerance guide's transcript: the launcher's lines and the
    # chief's. Not compared: the lost worker's last lines (what it wrote
    # before the kill reached its log file), the survivor's one-line error
    # (whichever check saw the loss first words it), a stale lock's owner,
    # and any log line of TensorFlow's that a loaded machine may add.
    shown = [
        line.replace(str(slots), "/tmp/slots").replace(
            str(tmp_path / "backup"), "/tmp/keras_dist_elastic"
        )
        for line in out.splitlines()
        if line.startswith(("keras-dist:", "[worker:0]"))
    ]
    transcripts.check(
        "elastic_lose_a_worker",
        "\n".join(shown),
        ignore=(
            r"^keras-dist:     |RuntimeError: Training stopped|taking it over"
            r"|WARNING|[IWE]\d{4} "
        ),
    )


def test_multi_worker_example_without_launcher_explains_itself():
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "multi_worker.py")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2
    assert "keras-dist launch --workers 2" in result.stderr


def _table_rows(out, first_cell):
    """The cells of the markdown table rows of `out` that start with `first_cell`."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in out.splitlines()
        if line.startswith(f"| {first_cell}")
    ]


def test_custom_training_loop_example_matches_one_device():
    script = os.path.join(EXAMPLES, "custom_training_loop.py")
    out = run([script, "--smoke", "--accumulation-steps", "2"])
    assert "2 replicas, custom loop (strategy.run + apply_gradients)" in out
    assert "2 micro-batch(es) per update -> 64 examples per update" in out
    [line] = [line for line in out.splitlines() if line.startswith("max |w_2")]
    difference = float(line.split("=")[1].split()[0])
    assert difference < 1e-5, line
    epochs = [line.split("(")[0] for line in out.splitlines() if "  epoch " in line]
    # Both runs log the same loss and accuracy, epoch by epoch.
    assert len(epochs) == 4 and epochs[:2] == epochs[2:], epochs
    # 8 micro-batches of 32 per epoch, 2 per update.
    assert "(8 steps, 4 updates so far" in out


@pytest.mark.extended
def test_mixed_precision_example_wires_loss_scaling_inside_accumulation():
    out = run([os.path.join(EXAMPLES, "mixed_precision.py"), "--smoke"])
    assert (
        "DistributedModel.compile gives:  GradientAccumulationOptimizer("
        "accumulation_steps=2) -> LossScaleOptimizer(" in out
    )
    assert "keras.Model.compile would give: LossScaleOptimizer(" in out
    assert "layer 'hidden': computes in float16, kernel variable float32" in out
    assert "layer 'logits': computes in float32, kernel variable float32" in out
    assert "loss scale: 32768 at the start" in out
    rows = {row[0]: row for row in _table_rows(out, "mixed_float16")}
    rows.update({row[0]: row for row in _table_rows(out, "float32")})
    assert rows["mixed_float16"][1] == "float16" and rows["float32"][1] == "float32"
    for row in rows.values():
        loss = float(row[2])
        assert 0 < loss < 2.5, row  # finite, and below log(10) = 2.30 + noise


@pytest.mark.extended
def test_memory_growth_example_explains_no_gpu_and_too_late():
    import tensorflow as tf

    out = run([os.path.join(EXAMPLES, "memory_growth.py"), "--smoke"])
    assert "same arguments: returns the first result unchanged: True" in out
    assert "other arguments raise RuntimeError:" in out
    assert "GPU memory settings are fixed once per process" in out
    assert "per-replica batch 64 fits." in out
    assert "with a 10% safety margin: 57." in out
    if tf.config.list_physical_devices("GPU"):
        assert "memory_growth=True" in out
        assert "late call raised RuntimeError: TensorFlow has already" in out
        return
    assert "returned MemoryConfig(devices=()" in out
    assert "memory_growth_state() = {}" in out
    assert "TensorFlow sees no GPU, so there was nothing to configure" in out
    assert "late call returned MemoryConfig(devices=()" in out
    assert "auto_strategy(cpu_replicas=4) raised RuntimeError:" in out
    assert "TensorFlow is already initialised with 2" in out
    assert "per-replica batch 57 (global 114)" in out


@pytest.mark.extended
def test_custom_hook_example_compresses_and_error_feedback_converges():
    out = run([os.path.join(EXAMPLES, "custom_hook.py"), "--smoke"])
    assert "compression_ratio: 3.98" in out  # in fit's logs
    [int8] = _table_rows(out, "Int8(error_feedback=True) | 3.")
    [plain] = _table_rows(out, "NoCompression() | 1.")
    assert float(int8[1]) > 3.9
    assert abs(float(int8[3]) - float(plain[3])) <= 0.05  # test accuracy
    assert "round trip through get_config: Int8(error_feedback=True)" in out
    errors = {row[0]: row for row in _table_rows(out, "") if len(row) == 3}
    one, many = (float(v) for v in errors["Int8(error_feedback=True)"][1:])
    no_feedback = float(errors["Int8(error_feedback=False)"][2])
    # Error feedback: the error of the sum over 10 steps shrinks ~10x.
    assert many < one / 5 and many < no_feedback / 5, errors


def test_sharded_example_keeps_half_of_adams_state_per_replica():
    script = os.path.join(EXAMPLES, "sharded.py")
    out = run([script, "--smoke", "--cpu-replicas", "2"], stderr_too=True)
    assert "MirroredStrategy, 2 replica(s)" in out
    assert "was created under" not in out
    # fit's one line per epoch, for the sharded and the plain run.
    assert out.count("Epoch 2/2") == 2
    parameters = int(out.split("(P = ")[1].split()[0].replace(",", ""))
    slice_size = -(-parameters // 2)
    rows = {
        row[0]: [int(cell.replace(",", "")) for cell in row[1:]]
        for row in _table_rows(out, "")
        if len(row) == 6 and row[0].isdigit()  # not the header
    }
    # Adam's two slots for half the parameters, against all of them, plus
    # the float32 slice the update runs on.
    expected = [8 * slice_size, 8 * parameters, 4 * slice_size, 12 * slice_size]
    assert rows == {"0": [*expected, 8 * parameters], "1": [*expected, 8 * parameters]}
    assert "test accuracy: " in out
    [line] = [line for line in out.splitlines() if "max |w_sharded" in line]
    assert float(line.split("=")[1].split()[0]) < 1e-5, line


@pytest.mark.multiworker
@pytest.mark.extended
def test_sharded_example_through_the_launcher():
    # auto_strategy() builds the cluster from the launcher's TF_CONFIG; the
    # one-process --cpu-replicas is then ignored, with a note.
    script = os.path.join(EXAMPLES, "sharded.py")
    launch = ["-m", "keras_dist", "launch", "--workers", "2", "--"]
    out = run(
        [*launch, sys.executable, script, "--smoke", "--cpu-replicas", "2"],
        stderr_too=True,
    )
    for worker in (0, 1):
        assert f"[worker:{worker}] --cpu-replicas 2 ignored: TF_CONFIG" in out
        assert f"[worker:{worker}] | {worker} | " in out  # its own replica's row
    differences = [
        float(line.split("=")[1].split()[0])
        for line in out.splitlines()
        if "max |w_sharded" in line
    ]
    assert len(differences) == 2 and max(differences) < 1e-5, differences


def test_ray_example_passes_object_store_urls_through(monkeypatch):
    # The Ray workers start in other folders: a local --backup-dir/--storage
    # is made absolute, an object store URL (the clusters guide's first
    # choice) is not (os.path.abspath made gs://b/r into <cwd>/gs:/b/r).
    monkeypatch.syspath_prepend(os.path.join(REPO_ROOT, "examples"))
    # The example sets TF_CPP_MIN_LOG_LEVEL if unset: keep this process's.
    level = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", level or "0")
    import ray_train

    if level is None:
        monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL")

    assert ray_train._absolute("gs://bucket/run1") == "gs://bucket/run1"
    assert ray_train._absolute("s3://bucket/run1") == "s3://bucket/run1"
    assert ray_train._absolute("backups") == os.path.join(os.getcwd(), "backups")
    assert ray_train._absolute(None) is None
