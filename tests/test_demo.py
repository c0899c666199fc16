"""`keras-dist demo`: its run and files, output off a terminal, `--out`, its note."""

import io
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO_ROOT

from keras_dist import demo


def _result(name, replicas, accuracy):
    return demo.Result(
        name=name,
        replicas=replicas,
        accumulation_steps=1,
        hook="NoCompression",
        test_accuracy=accuracy,
        samples_per_second=1000.0,
        bytes_per_step=0 if replicas == 1 else 1024,
        compression_ratio=1.0,
        seconds=1.0,
    )


def test_demo_through_a_pipe_writes_its_table_without_control_codes(tmp_path):
    # Every configuration on 2 replicas for 2 epochs; stdout is a pipe, not a
    # terminal. One run for what the demo prints and what it writes.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO_ROOT))
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
    assert "| configuration | test accuracy |" in out
    assert "samples/s: the 2 logical CPU replicas" in out
    assert demo.BENCHMARKS_PAGE in out
    written = (tmp_path / "results.md").read_text()
    assert written.startswith("| configuration |")
    assert "throughput cannot grow with replicas here" in " ".join(written.split())
    results = json.loads((tmp_path / "results.json").read_text())
    names = [r["name"] for r in results["results"]]
    assert names[0] == "1 replica"
    assert any("accumulation" in name for name in names)
    for row in results["results"]:
        assert row["test_accuracy"] > 0.5, row
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
