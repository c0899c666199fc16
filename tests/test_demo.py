"""`keras-dist demo`: its run and files, output off a terminal, `--out`, its note."""

import io
import json
import os
import re
import subprocess
import sys

import pytest
import transcripts
from helpers import REPO_ROOT
from tf_log_lines import native_log_lines

from keras_dist import demo


def _result(
    name,
    replicas,
    accuracy,
    epoch_loss=(),
    epoch_accuracy=(),
    accumulation_steps=1,
    hook="NoCompression",
):
    return demo.Result(
        name=name,
        replicas=replicas,
        accumulation_steps=accumulation_steps,
        hook=hook,
        test_accuracy=accuracy,
        samples_per_second=1000.0,
        bytes_per_step=0 if replicas == 1 else 1024,
        compression_ratio=1.0,
        seconds=1.0,
        epoch_loss=list(epoch_loss),
        epoch_accuracy=list(epoch_accuracy),
    )


def test_demo_through_a_pipe_writes_its_table_without_control_codes(tmp_path):
    # Every configuration on 2 replicas for 2 epochs; stdout is a pipe, not a
    # terminal. One run for what the demo prints and what it writes.
    # TF_CPP_MIN_LOG_LEVEL unset: the demo hides TensorFlow's lines itself.
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("TF_CPP_MIN_LOG_LEVEL", "KERAS_DIST_TF_LOGS")
    }
    env["PYTHONPATH"] = str(REPO_ROOT)
    args = ["demo", "--replicas", "2", "--epochs", "2", "--out", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, "-m", "keras_dist", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=600,
        cwd=REPO_ROOT,
        env=env,
    )
    out = result.stdout.decode()
    assert result.returncode == 0, out[-4000:]
    assert "\x1b[" not in out
    assert "\r" not in out
    assert native_log_lines(out) == []
    # The dataset shuffles itself; Keras does not warn about `shuffle=True`.
    assert "shuffle=True" not in out
    assert "| configuration | test accuracy |" in out
    flat = " ".join(out.split())
    assert (
        'at every one of the 2 epochs, the "2 replicas" run matches the '
        '"1 replica" run: its training accuracy is the same' in flat
    ), out[-3000:]
    assert "samples/s: the 2 logical CPU replicas" in out
    assert demo.BENCHMARKS_PAGE in out
    written = (tmp_path / "results.md").read_text()
    assert written.startswith("| configuration |")
    assert "throughput cannot grow with replicas here" in " ".join(written.split())
    results = json.loads((tmp_path / "results.json").read_text())
    names = [r["name"] for r in results["results"]]
    assert names[0] == "1 replica"
    assert any("accumulation" in name for name in names)
    # Sharding halves Adam's state per replica (two slots and the slice it
    # updates: 12P/2 against 8P).
    state = {r["name"]: r["state_bytes"] for r in results["results"]}
    assert state["2 replicas, ShardedOptimizer"] < 0.8 * state["2 replicas"]
    assert "| optimizer state per replica |" in out
    # The fault act: a worker SIGKILLed, the launcher's report, the resume,
    # and the weights of the uninterrupted run.
    act = out.split("--- A worker lost mid-epoch", 1)[1]
    assert "keras-dist: worker:1 lost after" in act
    assert "worker:1 was killed by SIGKILL." in act
    assert "restart 1 of 1: worker:1 failed with exit code 137" in act
    assert "BackupAndRestore: resumed from" in act
    difference = re.search(r"max \|diff\| = ([0-9.e+-]+)", act)
    assert difference is not None, act
    assert float(difference.group(1)) < 1e-5
    transcripts.check("demo_fault_act", "--- A worker lost mid-epoch" + act)
    for row in results["results"]:
        assert row["test_accuracy"] > 0.5, row
        assert len(row["epoch_loss"]) == len(row["epoch_accuracy"]) == 2, row
    two = next(r for r in results["results"] if r["name"].endswith("replicas"))
    assert two["bytes_per_step"] > 0
    assert (tmp_path / "results.png").exists()


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize(
    "verbose, stream, expected",
    [
        (None, _Terminal(), 1),
        (None, io.StringIO(), 2),
        (None, object(), 2),
        (1, io.StringIO(), 1),
        (0, _Terminal(), 0),
        (2, _Terminal(), 2),
    ],
)
def test_fit_verbosity_follows_the_terminal_unless_given(verbose, stream, expected):
    assert demo.fit_verbosity(verbose, stream) == expected


@pytest.fixture
def no_training(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the demo trained before checking --out")

    monkeypatch.setattr(demo, "_run", fail)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_out_in_proc_fails_before_training(no_training, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--out", "/proc/x"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--out must be a folder the demo can create and write" in err
    assert "Received: --out '/proc/x'" in err
    assert "Pass a writable folder" in err


def test_out_under_a_file_fails_before_training(no_training, tmp_path):
    blocker = tmp_path / "results"
    blocker.write_text("")
    message = demo.check_out(str(blocker / "demo"))
    assert message is not None
    assert f"Received: --out '{blocker / 'demo'}'" in message
    assert demo.check_out(str(blocker)) is not None
    with pytest.raises(SystemExit, match="2"):
        demo.main(["--out", str(blocker)])


def test_out_is_created_when_writable(tmp_path):
    out = tmp_path / "a" / "b"
    assert demo.check_out(str(out)) is None
    assert out.is_dir()
    assert list(out.iterdir()) == []


def test_note_explains_samples_per_second_with_this_run_s_accuracy():
    results = [
        _result("1 replica", 1, 0.975),
        _result("2 replicas", 2, 0.975),
        _result("2 replicas, PowerSGD rank 2", 2, 0.967),
    ]
    note = demo.format_note(results, replicas=2, cores=2)
    flat = " ".join(note.split())
    assert "the 2 logical CPU replicas" in flat
    assert "2 CPU cores" in flat
    assert "throughput cannot grow with replicas here" in flat
    assert "(1 replica 0.975; 2 replicas 0.967-0.975)" in flat
    assert f"bandwidth-shaped network: {demo.BENCHMARKS_PAGE}" in flat
    assert max(len(line) for line in note.splitlines()) <= 78


def test_note_says_the_replicated_run_trained_as_one_device():
    loss, accuracy = [1.9685, 0.7435, 0.2767], [0.5724, 0.8381, 0.9197]
    results = [
        _result("1 replica", 1, 0.975, loss, accuracy),
        _result("2 replicas", 2, 0.975, loss, accuracy),
        _result(
            "2 replicas, accumulation x2",
            2,
            0.975,
            [1.9685, 0.7435, 0.2767 * (1 + 2.4e-3)],
            accuracy,
            accumulation_steps=2,
        ),
        # A compression hook changes the sums on purpose: not compared.
        _result("2 replicas, FP16", 2, 0.975, [9.0, 9.0, 9.0], accuracy, hook="FP16"),
    ]

    flat = " ".join(demo.format_note(results, replicas=2, cores=2).split())

    assert (
        "Same training on one device and on replicas: at every one of the 3 "
        'epochs, the "2 replicas" run matches the "1 replica" run: its training '
        "accuracy is the same, and its loss is the same too." in flat
    )
    assert (
        'So does "2 replicas, accumulation x2": its training accuracy is the '
        "same, and its loss agrees to 2.4e-03 (relative; largest at epoch 3)." in flat
    )
    assert "FP16" not in flat


def test_note_says_when_the_replicated_run_trained_differently():
    results = [
        _result("1 replica", 1, 0.975, [1.0, 0.5], [0.5, 0.8]),
        _result("2 replicas", 2, 0.9, [1.0, 0.6], [0.5, 0.72]),
    ]

    flat = " ".join(demo.format_note(results, replicas=2, cores=2).split())

    assert flat.startswith(
        'Not the same training: at every epoch the "2 replicas" run should '
        'match the "1 replica" run up to float rounding; its training accuracy '
        "agrees to 1.0e-01 (relative; largest at epoch 2), and its loss agrees "
        "to 1.7e-01 (relative; largest at epoch 2), beyond the 0.01 that "
        "rounding explains."
    )


def test_note_compares_nothing_without_epochs():
    results = [_result("1 replica", 1, 0.975), _result("2 replicas", 2, 0.975)]
    assert demo.format_equality(results) is None
    assert demo.format_note(results, replicas=2, cores=2).startswith("samples/s")
