"""Tests for the elastic launch (`--workers MIN:MAX`, `--discover`).

Real processes, tiny commands: each task prints what the launcher gave it
(`KERAS_DIST_WORKERS`, `KERAS_DIST_WORKERS_RANGE`), and the discovery
command reads a file the test writes (or a task writes, to simulate a node
that does not come back). `launch` and `cli.main` run in the test process;
the restart and supervision machinery they share is in
`test_launcher_supervisor.py`.
"""

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from helpers import task_lines, write_script

from keras_dist import cli, launcher
from keras_dist.launcher import elastic

# Prints the attempt and what the launcher said about the size. On attempt
# 0, worker:3 writes <argv[2]> into the discovery file <argv[1]> (the slots
# left once it is gone) and kills itself with SIGKILL, as a lost node would;
# the other workers of that attempt wait to be stopped.
TASK = """
    import os, signal, sys, time
    attempt = os.environ["KERAS_DIST_RESTART"]
    task = os.environ["KERAS_DIST_TASK"]
    print("attempt", attempt, "workers", os.environ["KERAS_DIST_WORKERS"],
          "range", os.environ.get("KERAS_DIST_WORKERS_RANGE", "-"), flush=True)
    if len(sys.argv) > 2 and attempt == "0":
        if task == "worker:3":
            with open(sys.argv[1], "w") as slots:
                slots.write(sys.argv[2])
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
"""


def _slots_file(tmp_path, slots):
    path = tmp_path / "slots"
    path.write_text(f"{slots}\n")
    return path


def _cat(path):
    return f"cat {shlex.quote(str(path))}"


def _launch(capsys, *argv):
    """Runs `keras-dist launch ARGV`; returns (status, stdout, stderr)."""
    status = cli.main(["launch", "--grace-period", "1", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# --- Parsing and validation ---------------------------------------------------


@pytest.mark.parametrize(
    ("text", "workers"), [("4", 4), ("2:4", (2, 4)), ("3:3", (3, 3)), ("1:8", (1, 8))]
)
def test_workers_take_a_count_or_a_range(text, workers):
    assert cli._workers(text) == workers


@pytest.mark.parametrize(
    "text", ["0:2", "3:2", "a:b", "2:", ":3", "2:4:6", "0", "x", "-1:2", "-2"]
)
def test_a_bad_workers_form_is_a_usage_error_naming_the_right_form(text, capsys):
    status = cli.main(["launch", "--workers", text, "--", "true"])

    err = capsys.readouterr().err
    assert status == 2
    assert "usage:" in err
    assert "argument --workers: must be an integer >= 1 (N workers) or MIN:MAX" in err
    assert f"1 <= MIN <= MAX (MIN to MAX workers, elastic). Received: {text!r}" in err


@pytest.mark.parametrize(
    ("extra", "received"),
    [
        (["--workers", "2:4", "--ps", "1"], "Received: --workers 2:4 --ps 1."),
        (["--workers", "2:4", "--chief"], "Received: --workers 2:4 --chief."),
        (
            ["--workers", "2", "--discover", "echo 2", "--chief"],
            "Received: --discover 'echo 2' --chief.",
        ),
    ],
)
def test_an_elastic_launch_refuses_a_chief_and_parameter_servers(
    extra, received, capsys
):
    status = cli.main(["launch", *extra, "--", "true"])

    err = capsys.readouterr().err
    assert status == 2
    assert "an elastic launch (--workers MIN:MAX or --discover) runs worker " in err
    assert received in err
    assert "Drop --ps and --chief" in err


def test_an_empty_discovery_command_is_a_usage_error(capsys):
    status = cli.main(["launch", "--workers", "1:2", "--discover", " ", "--", "true"])

    assert status == 2
    assert "argument --discover: must be a shell command" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"workers": (0, 2)}, ValueError, r"`workers\[0\]` must be an int >= 1"),
        ({"workers": (3, 2)}, ValueError, r"min <= max\. Received: workers=\(3, 2\)"),
        ({"workers": (2,)}, ValueError, r"a `\(min, max\)` pair\. Received"),
        ({"workers": (2, 4.0)}, TypeError, r"`workers\[1\]` must be an int"),
        ({"workers": "2:4"}, TypeError, r"`workers` must be an int >= 1\. Received"),
        ({"workers": (1, 2), "ps": 1}, ValueError, r"elastic launch .* ps=1"),
        ({"workers": (1, 2), "chief": True}, ValueError, r"chief=True\. Drop"),
        ({"workers": 2, "discover": "x", "chief": True}, ValueError, r"elastic"),
        ({"workers": (1, 2), "discover": 3}, TypeError, r"`discover` must be a str"),
        ({"workers": (1, 2), "discover": ""}, ValueError, r"`discover` must not be"),
    ],
)
def test_launch_validates_the_elastic_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        launcher.launch(["true"], **kwargs)


# --- What the tasks are told --------------------------------------------------


def test_every_task_gets_the_number_of_workers(tmp_path, capsys):
    script = write_script(tmp_path, "task.py", TASK)
    environ = {**os.environ, elastic.WORKERS_RANGE_ENV_VAR: "9:9"}

    status = launcher.launch([sys.executable, script], workers=2, environ=environ)

    out = capsys.readouterr().out
    assert status == 0
    # Not elastic: no range, not even one inherited from the environment.
    for index in range(2):
        assert task_lines(out, f"worker:{index}") == ["attempt 0 workers 2 range -"]


@pytest.mark.parametrize(
    ("slots", "started", "why"),
    [
        ("3", 3, "reports 3 slot(s)."),
        ("9", 4, "reports 9 slot(s), more than the maximum 4."),
    ],
    ids=["3-of-4", "9-capped-at-4"],
)
def test_the_first_attempt_starts_the_workers_discovery_allows(
    tmp_path, capsys, slots, started, why
):
    script = write_script(tmp_path, "task.py", TASK)
    discover = _cat(_slots_file(tmp_path, slots))

    status, out, err = _launch(
        capsys, "--workers", "3:4", "--discover", discover, "--", sys.executable, script
    )

    assert status == 0, err
    for index in range(started):
        assert task_lines(out, f"worker:{index}") == [
            f"attempt 0 workers {started} range 3:4"
        ]
    assert task_lines(out, f"worker:{started}") == []
    assert (
        f"keras-dist: starting {started} workers (--workers 3:4): --discover "
        f"{shlex.quote(discover)} {why}"
    ) in err


# --- Restarts on another number of workers ------------------------------------


@pytest.mark.parametrize("slots_after", ["3", "4"], ids=["node-lost", "node-back"])
def test_a_restart_runs_on_the_slots_left(tmp_path, capsys, slots_after):
    script = write_script(tmp_path, "task.py", TASK)
    slots = _slots_file(tmp_path, 4)
    discover = _cat(slots)

    status, out, err = _launch(
        capsys,
        *("--workers", "3:4", "--discover", discover, "--max-restarts", "2"),
        *("--", sys.executable, script, str(slots), slots_after),
    )

    assert status == 0, err
    size = int(slots_after)
    failure = "restart 1 of 2: worker:3 failed with exit code 137 (killed by SIGKILL)"
    if size == 3:
        assert (
            f"keras-dist: {failure}; starting the whole job again with 3 workers "
            f"instead of 4: --discover {shlex.quote(discover)} reports 3 slot(s) "
            "(KERAS_DIST_RESTART=1), from the start (no backup written)."
        ) in err
    else:
        # The same size: the restart is announced as without --discover.
        assert (
            f"keras-dist: {failure}; starting the whole job again "
            "(KERAS_DIST_RESTART=1), from the start (no backup written)."
        ) in err
    for index in range(size):
        assert f"attempt 1 workers {size} range 3:4" in task_lines(
            out, f"worker:{index}"
        )
    assert "restart 2" not in err


def test_too_few_slots_after_a_failure_stop_the_launch_with_status_69(tmp_path, capsys):
    script = write_script(tmp_path, "task.py", TASK)
    slots = _slots_file(tmp_path, 4)
    discover = _cat(slots)

    status, out, err = _launch(
        capsys,
        *("--workers", "3:4", "--discover", discover, "--max-restarts", "2"),
        *("--", sys.executable, script, str(slots), "2"),
    )

    assert status == elastic.EXIT_TOO_FEW_WORKERS == 69
    assert (
        "keras-dist: worker:3 failed with exit code 137 (killed by SIGKILL); "
        f"2 worker slot(s) available (--discover {shlex.quote(discover)} printed "
        "2), fewer than the minimum 3 of --workers 3:4; stopping (exit status 69)."
    ) in err
    assert "restart 1" not in err
    assert "attempt 1" not in out


@pytest.mark.parametrize(
    ("workers", "needed"),
    [("3:4", "the minimum 3 of --workers 3:4"), ("3", "the 3 of --workers 3")],
)
def test_too_few_slots_at_the_start_start_no_task(tmp_path, capsys, workers, needed):
    status, out, err = _launch(
        capsys, "--workers", workers, "--discover", "echo 2", "--", "no-such-kd"
    )

    assert status == 69
    assert out == ""
    assert (
        "keras-dist: 2 worker slot(s) available (--discover 'echo 2' printed 2), "
        f"fewer than {needed}; stopping (exit status 69)."
    ) in err


# --- A discovery command that fails -------------------------------------------


@pytest.mark.parametrize(
    ("discover", "message"),
    [
        (
            "echo three",
            "--discover 'echo three' must print one integer >= 0, the number of "
            "worker slots available (e.g. `echo 4`). It printed: 'three\\n'.",
        ),
        ("echo 2; echo 3", "It printed: '2\\n3\\n'."),
        ("echo -1", "It printed: '-1\\n'."),
        ("true", "It printed: ''."),
        (
            "echo 4; echo gone >&2; exit 3",
            "--discover 'echo 4; echo gone >&2; exit 3' failed with exit code 3 "
            "(stdout '4', stderr 'gone'). It must exit with status 0",
        ),
        ("no-such-command-kd", "failed with exit code 127"),
    ],
)
def test_a_broken_discovery_stops_the_launch_with_status_1(discover, message, capsys):
    status, out, err = _launch(
        capsys, "--workers", "1:2", "--discover", discover, "--", "no-such-kd"
    )

    assert status == elastic.EXIT_DISCOVERY_FAILED == 1
    assert out == ""
    assert message in err
    assert err.rstrip().endswith("Stopping (exit status 1).")
    assert "Traceback" not in err


def test_a_discovery_that_hangs_is_stopped(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(elastic, "DISCOVER_TIMEOUT", 0.5)
    group = tmp_path / "group"
    # `$$` is the shell's pid, the id of the process group it was started in.
    discover = f"echo $$ > {shlex.quote(str(group))}; echo 3; sleep 60"

    start = time.monotonic()
    status, _, err = _launch(
        capsys, "--workers", "1:2", "--discover", discover, "--", "no-such-kd"
    )

    assert status == 1
    assert time.monotonic() - start < 15
    assert "did not finish within 0.5 s and was stopped (it printed '3')" in err
    # The shell and its `sleep` are gone with their group (the orphaned
    # `sleep`, killed, may take a moment to be reaped).
    _wait_group_gone(int(group.read_text()))


def _wait_group_gone(pgid, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            os.killpg(pgid, signal.SIGKILL)
            raise AssertionError(f"process group {pgid} is still running")
        time.sleep(0.05)


def test_sigterm_while_discovering_stops_the_discovery_too(tmp_path):
    # SIGTERM to the launcher while its discovery command runs: the command
    # and what it started must not outlive it (they did, the launcher
    # dying by the default action of SIGTERM; Ctrl-C was clean).
    group = tmp_path / "group"
    discover = f"echo $$ > {shlex.quote(str(group))}; sleep 100; echo 2"
    command = [sys.executable, "-m", "keras_dist", "launch", "--workers", "1:2"]
    launcher_process = subprocess.Popen(
        [*command, "--discover", discover, "--", "true"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not group.exists() or not group.read_text().strip():
            assert time.monotonic() < deadline, "the discovery command never ran"
            time.sleep(0.05)
        launcher_process.send_signal(signal.SIGTERM)
        _, err = launcher_process.communicate(timeout=30)
    finally:
        if launcher_process.poll() is None:
            launcher_process.kill()
    assert launcher_process.returncode == 143
    assert "received SIGTERM while asking for worker slots; stopping." in err
    _wait_group_gone(int(group.read_text()))


def test_a_discovery_that_leaves_a_child_answers_at_once(tmp_path):
    # The count is printed and the shell exits; a background child still
    # holds its output. The answer counts at once (not after the 30 s
    # timeout), and the child is stopped with the command's group.
    group = tmp_path / "group"
    discover = f"echo $$ > {shlex.quote(str(group))}; sleep 100 & echo 3"
    start = time.monotonic()
    assert elastic.discover_slots(discover) == 3
    assert time.monotonic() - start < 10
    _wait_group_gone(int(group.read_text()))


def test_a_huge_discovery_output_is_cut_in_the_message():
    discover = f"{shlex.quote(sys.executable)} -c 'print(\"x\" * 20_000_000)'"
    with pytest.raises(elastic.DiscoveryError) as raised:
        elastic.discover_slots(discover)
    message = str(raised.value)
    assert "(20000001 characters in all)" in message
    assert len(message) < 2000
