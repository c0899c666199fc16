"""What an operator sees under `keras-dist launch`: the failure report,
tracebacks in one line, progress lines drawn once, the chief's output alone,
log files, and no restart of an error that would repeat.

The scripts here are plain Python (no TensorFlow): they act out what a
training task does to its output and its exit. The real faults (SIGKILL,
SIGSTOP, a hung peer) of real training tasks are in test_fault_tolerance.py.
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from keras_dist.launcher import attempts, output, report


def launch(tmp_path, script, *args):
    """Runs `script` (Python source) under the launcher; (status, out, err)."""
    path = tmp_path / "task.py"
    path.write_text(textwrap.dedent(script))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_dist",
            "launch",
            "--log-dir",
            str(tmp_path / "logs"),
            *args,
            "--",
            sys.executable,
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout, done.stderr


def test_a_line_is_shown_as_it_ends():
    assert output.render("10/64 [==>...]\r20/64 [====>.]") == "20/64 [====>.]"
    assert output.render("loss: 0.5\b\b\b0.4") == "loss: 0.4"
    assert output.render("\x1b[1m64/64\x1b[0m done\r") == "64/64 done"
    assert output.render("plain") == "plain"


def test_an_error_in_the_script_is_one_line_and_restarts(tmp_path):
    # Attempt 0: worker:1 raises (chained, as a lost peer's error is) after
    # its first step; attempt 1 succeeds.
    status, out, err = launch(
        tmp_path,
        """
        import os, sys
        from keras_dist.launcher import attempts
        attempts.mark_started()
        print("step 1 done", flush=True)
        task = os.environ["KERAS_DIST_TASK"]
        if task == "worker:1" and os.environ["KERAS_DIST_RESTART"] == "0":
            try:
                raise KeyError("inner")
            except KeyError as error:
                raise RuntimeError("something broke in epoch 2") from error
        print("done", flush=True)
        """,
        "--workers",
        "2",
        "--max-restarts",
        "1",
    )
    assert status == 0, err
    log = tmp_path / "logs" / "attempt-1" / "worker-1.log"
    assert (
        f"[worker:1] RuntimeError: something broke in epoch 2 (traceback: {log})" in out
    )
    assert "Traceback" not in out
    assert "Traceback (most recent call last):" in log.read_text()
    assert "The above exception was the direct cause" in log.read_text()
    assert "keras-dist: worker:1 failed after" in err
    assert ": RuntimeError: something broke in epoch 2 (traceback:" in err
    assert "restart 1 of 1: worker:1 failed with exit code 1" in err
    assert "from the start (no backup written)." in err
    assert out.count("[worker:1] done\n") == 1


def test_a_set_up_error_that_repeats_is_not_restarted(tmp_path):
    status, _, err = launch(
        tmp_path,
        """
        raise ValueError("batch_size must be positive")
        """,
        "--workers",
        "2",
        "--max-restarts",
        "5",
    )
    assert status == 1
    assert "restart 1 of 5" in err
    assert "restart 2 of 5" not in err
    assert (
        "failed before its first step with the same error as in attempt 1: "
        "ValueError: batch_size must be positive. A restart would fail the same "
        "way; not restarting (exit status 1)." in err
    )


def test_an_error_that_changes_is_restarted(tmp_path):
    status, _, err = launch(
        tmp_path,
        """
        import os
        raise ValueError("attempt " + os.environ["KERAS_DIST_RESTART"])
        """,
        "--workers",
        "1",
        "--max-restarts",
        "2",
    )
    assert status == 1
    assert "giving up after 3 attempts (max restarts 2)" in err


def test_progress_lines_and_the_chief_alone(tmp_path):
    status, out, _ = launch(
        tmp_path,
        """
        import os, pathlib, sys, time
        task = os.environ["KERAS_DIST_TASK"]
        for i in (1, 2, 3):
            sys.stdout.write(f"\\r{i}/3 [{'=' * i}]")
            sys.stdout.flush()
        print(f" epoch done on {task}", flush=True)
        # worker:0's line is out before worker:1 fails (a failure stops
        # the other workers, and a loaded machine may start worker:0 late).
        shown = pathlib.Path(__file__).with_name("worker-0-done")
        if task == "worker:0":
            shown.touch()
        else:
            while not shown.exists():
                time.sleep(0.05)
            time.sleep(0.5)
            raise RuntimeError("worker 1 has a problem")
        """,
        "--workers",
        "2",
        "--only-chief",
    )
    assert status == 1
    assert "[worker:0] 3/3 [===] epoch done on worker:0\n" in out
    # worker:1's lines are in its log file only; its error is shown.
    assert "epoch done on worker:1" not in out
    assert "[worker:1] RuntimeError: worker 1 has a problem (traceback:" in out
    log = (tmp_path / "logs" / "attempt-1" / "worker-1.log").read_text()
    assert "epoch done on worker:1" in log


def test_an_elastic_range_restarts_by_default(tmp_path):
    status, _, err = launch(
        tmp_path,
        """
        import os
        from keras_dist.launcher import attempts
        attempts.mark_started()
        if os.environ["KERAS_DIST_RESTART"] == "0":
            raise SystemExit(3)
        """,
        "--workers",
        "1:2",
    )
    assert status == 0, err
    assert "a failed job is restarted up to 3 times" in err
    assert "restart 1 of 3" in err


def test_the_notes_a_task_leaves_for_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv(attempts.RUN_DIR_ENV_VAR, str(tmp_path))
    monkeypatch.setenv(attempts.TASK_ENV_VAR, "worker:3")
    assert attempts.started_tasks(str(tmp_path)) == set()
    attempts.mark_started()
    assert attempts.started_tasks(str(tmp_path)) == {"worker:3"}
    assert attempts.last_backup(str(tmp_path)) is None
    attempts.note_backup("/shared/run/backup-00000004", 1, 40)
    note = attempts.last_backup(str(tmp_path))
    assert attempts.describe_backup(note) == (
        "from the backup of epoch 2, 40 batches into it (/shared/run/backup-00000004)"
    )
    monkeypatch.delenv(attempts.RUN_DIR_ENV_VAR)
    monkeypatch.delenv(attempts.TASK_ENV_VAR)


@pytest.mark.parametrize(
    ("code", "expected"), [(-9, "killed by SIGKILL"), (3, "exit code 3")]
)
def test_how_a_task_ended_is_named(code, expected):
    assert report.describe_code(code) == expected


def test_the_state_of_a_stopped_process_is_read():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, 19)  # SIGSTOP
        # The kernel marks the process stopped when it is next scheduled: on
        # a loaded machine that takes a while, so poll up to a deadline.
        deadline = time.monotonic() + 20
        while report.process_state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert report.process_state(child.pid) == "T"
    finally:
        child.kill()
        child.wait()
    assert report.process_state(child.pid) is None
