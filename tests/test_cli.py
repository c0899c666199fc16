"""Tests for the `keras-dist` command line, with real processes.

Most `launch` tests call `cli.main` in the test process (the launcher itself
is then free, the tasks are real processes); the tests that need the launcher
to be a process of its own (`python -m keras_dist`, SIGINT) start it as one.
What `launch` does with its tasks (chief, coordinator, failures, restarts) is
in `test_launcher_supervisor.py`.
"""

import ast
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import (
    REPO_ROOT,
    SLEEPER,
    is_alive,
    task_lines,
    wait_gone,
    write_script,
)
from tf_log_lines import native_log_lines

from keras_dist import cli
from keras_dist.core import gloo

# Generous: a process that imports TensorFlow takes ~10 s on 2 busy cores.
PROCESS_TIMEOUT = 120


def _wait_for_files(paths, timeout, process=None):
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(path) for path in paths):
        if process is not None and process.poll() is not None:
            raise AssertionError(f"launcher exited early with {process.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {paths}")
        time.sleep(0.05)


def _run_module(args, timeout=PROCESS_TIMEOUT, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "keras_dist", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def test_launch_prefixes_lines_and_gives_each_worker_its_tf_config(tmp_path, capsys):
    script = write_script(
        tmp_path,
        "show.py",
        """
        import os, sys
        print(os.environ["TF_CONFIG"])
        print("task", os.environ["KERAS_DIST_TASK"], file=sys.stderr)
        """,
    )

    status = cli.main(["launch", "--workers", "2", "--", sys.executable, script])

    output = capsys.readouterr().out
    assert status == 0
    configs = []
    for index in range(2):
        lines = task_lines(output, f"worker:{index}")
        assert f"task worker:{index}" in lines, output
        config = json.loads(next(line for line in lines if line.startswith("{")))
        assert config["task"] == {"type": "worker", "index": index}
        configs.append(config)
    assert configs[0]["cluster"] == configs[1]["cluster"]
    addresses = configs[0]["cluster"]["worker"]
    assert len(addresses) == 2
    assert len({address.rsplit(":", 1)[1] for address in addresses}) == 2
    assert all(
        line.startswith(("[worker:0] ", "[worker:1] ")) for line in output.splitlines()
    )


def test_ps_task_serves_until_the_workers_finish(tmp_path, capsys):
    # The worker waits until the parameter server's gRPC port accepts
    # connections, so the server really started.
    script = write_script(
        tmp_path,
        "reach_ps.py",
        """
        import json, os, socket, time
        config = json.loads(os.environ["TF_CONFIG"])
        host, port = config["cluster"]["ps"][0].rsplit(":", 1)
        deadline = time.monotonic() + 100
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        print("reached ps")
        """,
    )

    status = cli.main(
        ["launch", "--workers", "1", "--ps", "1", "--", sys.executable, script]
    )

    output = capsys.readouterr().out
    assert status == 0, output
    assert "reached ps" in task_lines(output, "worker:0")
    listening = [line for line in task_lines(output, "ps:0") if "listening on" in line]
    assert listening, output
    wait_gone(int(re.search(r"\(pid (\d+)\)", listening[0]).group(1)), timeout=1.0)


def test_ps_server_refuses_a_task_that_is_not_a_ps(monkeypatch, capsys):
    config = {"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker"}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))

    status = cli.main(["_ps-server"])

    assert status == 2
    err = capsys.readouterr().err
    assert "keras-dist: `_ps-server` runs a parameter-server task and needs " in err
    assert "It is started by `keras-dist launch --ps M`." in err


def test_module_launcher_stops_its_tasks_on_sigint(tmp_path):
    script = write_script(tmp_path, "sleeper.py", SLEEPER)
    command = [sys.executable, script, str(tmp_path), "60"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "keras_dist", "launch", "--workers=2", "--", *command],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell starts background jobs with SIGINT ignored, and the
        # launcher would inherit that when the suite itself runs in the
        # background: give it the default, as a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        pid_files = [str(tmp_path / f"worker_{index}.pid") for index in range(2)]
        _wait_for_files(pid_files, PROCESS_TIMEOUT, launcher)
        pids = [int(pathlib.Path(path).read_text()) for path in pid_files]
        assert all(is_alive(pid) for pid in pids)

        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()

    assert launcher.returncode == 130, err
    assert "interrupted" in err
    assert "[worker:0] ready" in out and "[worker:1] ready" in out
    for pid in pids:
        wait_gone(pid, timeout=5.0)


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "a command is required"),
        (["bogus"], "invalid choice"),
        (["launch", "--workers", "2"], "no command to launch"),
        (["launch", "--workers", "2", "--"], "no command to launch"),
        (["launch", "--workers", "0", "--", "true"], "must be an integer >= 1"),
        (["launch", "--workers", "two", "--", "true"], "must be an integer"),
        (["launch", "--workers", "1", "--ps", "-1", "--", "true"], ">= 0"),
        (["launch", "--workers", "1", "--bogus", "--", "true"], "--bogus"),
        (["launch", "--", "true"], "--workers"),
        (["env", "--", "true"], "takes no command"),
        # Issue 31 W4: 0 passed the parser (">= 0") and ended in a traceback.
        (
            ["launch", "--workers", "1", "--collective-timeout", "0", "--", "true"],
            "--collective-timeout: must be a finite number of seconds > 0. "
            "Received: '0'",
        ),
        (
            ["launch", "--workers", "1", "--collective-timeout", "inf", "--", "true"],
            "finite number of seconds > 0",
        ),
        (
            ["launch", "--workers", "1", "--collective-timeout", "-2", "--", "true"],
            "Received: '-2'",
        ),
        (
            ["launch", "--workers", "1", "--collectives", "nccl", "--", "true"],
            "--collectives: invalid choice: 'nccl'",
        ),
    ],
)
def test_usage_errors_exit_2_with_a_message(argv, message, capsys):
    status = cli.main(argv)

    captured = capsys.readouterr()
    assert status == 2
    assert "usage:" in captured.err
    assert message in captured.err


def test_help_returns_0(capsys):
    assert cli.main(["launch", "--help"]) == 0
    assert "--workers N" in capsys.readouterr().out


def test_env_prints_versions_devices_and_strategy():
    env = {key: value for key, value in os.environ.items() if key != "TF_CONFIG"}
    result = _run_module(["env"], env=env)

    assert result.returncode == 0, result.stderr
    import keras
    import tensorflow as tf

    assert f"TensorFlow:    {tf.__version__}" in result.stdout
    assert f"Keras:         {keras.__version__}" in result.stdout
    assert "Python:" in result.stdout
    assert "CPU devices:" in result.stdout
    assert re.search(r"^Strategy: +\w+Strategy", result.stdout, re.MULTILINE)
    assert "because:" in result.stdout
    assert "Memory growth:" in result.stdout


def test_env_says_what_carries_the_sums(monkeypatch, capsys):
    from keras_dist._versions import installed_version

    monkeypatch.delenv("KERAS_DIST_COLLECTIVES", raising=False)
    torch = installed_version("torch")
    assert torch is not None  # the `test` extra installs it
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert (
        "Collectives:   gloo for workers with one CPU device (auto: PyTorch "
        f"{torch} with gloo is installed), TensorFlow's otherwise" in out
    )
    monkeypatch.setenv("KERAS_DIST_COLLECTIVES", "gloo")
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"Collectives:   gloo (KERAS_DIST_COLLECTIVES=gloo; PyTorch {torch})" in out
    monkeypatch.setenv("KERAS_DIST_COLLECTIVES", "tensorflow")
    assert cli.main(["env"]) == 0
    assert "Collectives:   TensorFlow's (ring on CPU" in capsys.readouterr().out
    # Where PyTorch does not import: TensorFlow's, and what gloo would bring.
    monkeypatch.delenv("KERAS_DIST_COLLECTIVES")
    monkeypatch.setitem(sys.modules, "torch", None)
    gloo.gloo_missing.cache_clear()
    try:
        assert cli.main(["env"]) == 0
    finally:
        gloo.gloo_missing.cache_clear()
    out = capsys.readouterr().out
    assert "Collectives:   TensorFlow's (auto: PyTorch is not installed;" in out
    assert "1.05x PyTorch DDP's, against 1.74x" in out


def test_env_reports_a_malformed_tf_config(monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["localhost:x"]}}')

    status = cli.main(["env"])

    out = capsys.readouterr().out
    assert status == 1
    assert re.search(r"^Strategy: +cannot decide: .*no valid port", out, re.MULTILINE)
    assert "Memory growth:" in out


def test_cli_module_imports_no_framework_at_top_level():
    # The launcher process must stay light: TensorFlow and Keras are imported
    # inside the commands that need them.
    tree = ast.parse(pathlib.Path(cli.__file__).read_text())
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"tensorflow", "keras", "numpy"}


LAUNCH_TWO = [sys.executable, "-m", "keras_dist", "launch", "--workers=2", "--"]


def _launch_then_close_stdout(script, go):
    """`launch` of `script go` on 2 workers whose reader leaves after one line.

    Reads the first line, closes the launcher's stdout, then creates the file
    `go` (the tasks wait for it). Returns the launcher's exit code, the first
    line and its stderr.
    """
    launcher = subprocess.Popen(
        [*LAUNCH_TWO, sys.executable, script, go],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = launcher.stdout.readline()
        launcher.stdout.close()
        pathlib.Path(go).touch()
        err = launcher.stderr.read()
        launcher.wait(timeout=PROCESS_TIMEOUT)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    return launcher.returncode, first, err


def test_closed_stdout_drops_output_but_the_tasks_run_on(tmp_path):
    # `keras-dist launch ... | head -1`: the reader goes away after one line.
    # The tasks print on after that (once `go` exists) and finish; the
    # launcher reports no failure and no traceback, and exits with their 0.
    script = write_script(
        tmp_path,
        "chatty.py",
        """
        import os, sys, time
        print("first", flush=True)
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.02)
        for line in range(5000):
            print("line", line, flush=True)
        open(sys.argv[1] + "." + os.environ["KERAS_DIST_TASK"], "w").close()
        """,
    )
    go = str(tmp_path / "go")
    returncode, first, err = _launch_then_close_stdout(script, go)

    assert first.endswith("first\n")
    assert returncode == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert "failed" not in err, err
    for index in range(2):
        assert os.path.exists(f"{go}.worker:{index}")


def test_broken_pipe_keeps_the_exit_code_of_a_failing_task(tmp_path):
    script = write_script(
        tmp_path,
        "fail_late.py",
        """
        import os, sys, time
        print("first", flush=True)
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.02)
        for line in range(2000):
            print("line", line, flush=True)
        sys.exit(5 if os.environ["KERAS_DIST_TASK"] == "worker:1" else 0)
        """,
    )
    go = str(tmp_path / "go")
    returncode, first, err = _launch_then_close_stdout(script, go)

    assert first.endswith("first\n")
    assert returncode == 5, err
    assert "worker:1 failed with exit code 5" in err
    assert "Traceback" not in err, err


def test_too_few_file_descriptors_is_a_clear_error():
    # 100 workers need more descriptors than a limit of 64 allows: the
    # launcher says so instead of raising a raw OSError.
    def limit_descriptors():
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    result = subprocess.run(
        [sys.executable, "-m", "keras_dist", "launch", "--workers=100", "--", "true"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT,
        preexec_fn=limit_descriptors,
    )

    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert re.search(r"keras-dist: .*file descriptors.*ulimit -n", result.stderr)


def test_restart_options_reach_the_launcher(tmp_path, capsys):
    # attempt 0 fails; attempt 1 succeeds and has the collective timeout.
    script = write_script(
        tmp_path,
        "fail_first.py",
        """
        import os, sys
        print("timeout", os.environ["KERAS_DIST_COLLECTIVE_TIMEOUT"])
        sys.exit(3 if os.environ["KERAS_DIST_RESTART"] == "0" else 0)
        """,
    )

    status = cli.main(
        [
            *("launch", "--workers", "1", "--max-restarts", "1"),
            *("--collective-timeout", "7.5", "--", sys.executable, script),
        ]
    )

    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert task_lines(captured.out, "worker:0") == ["timeout 7.5", "timeout 7.5"]
    assert "restart 1 of 1: worker:0 failed with exit code 3" in captured.err


@pytest.mark.parametrize(
    ("argv", "environment", "expected"),
    [
        (["--collectives", "gloo"], {}, "gloo"),
        # The flag wins over the variable; without either, nothing is set
        # (the tasks choose: auto).
        (
            ["--collectives", "tensorflow"],
            {"KERAS_DIST_COLLECTIVES": "gloo"},
            "tensorflow",
        ),
        ([], {"KERAS_DIST_COLLECTIVES": "gloo"}, "gloo"),
        (["--collectives", "auto"], {"KERAS_DIST_COLLECTIVES": "gloo"}, "auto"),
        ([], {}, "unset"),
    ],
)
def test_the_collectives_flag_reaches_every_task(
    argv, environment, expected, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("KERAS_DIST_COLLECTIVES", raising=False)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    script = write_script(
        tmp_path,
        "backend.py",
        """
        import os
        print("collectives", os.environ.get("KERAS_DIST_COLLECTIVES", "unset"))
        """,
    )

    status = cli.main(["launch", "--workers", "2", *argv, "--", sys.executable, script])

    captured = capsys.readouterr()
    assert status == 0, captured.err
    for task in ("worker:0", "worker:1"):
        assert task_lines(captured.out, task) == [f"collectives {expected}"]


def test_a_bad_collectives_variable_is_refused_once_by_the_launcher(monkeypatch):
    from keras_dist.launcher import supervisor

    monkeypatch.setenv("KERAS_DIST_COLLECTIVES", "mpi")
    with pytest.raises(ValueError, match=r"KERAS_DIST_COLLECTIVES must be one of"):
        supervisor.launch(["true"], workers=1)
    with pytest.raises(ValueError, match=r"collectives must be one of .* 'MPI'"):
        supervisor.launch(["true"], workers=1, collectives="MPI")


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_grace_period_must_be_finite_on_the_command_line(value, capsys):
    status = cli.main(["launch", "--workers", "1", "--grace-period", value, "--", "x"])

    assert status == 2
    assert "must be a finite number >= 0" in capsys.readouterr().err


def _readme_example(epochs):
    """The README's fifteen-line example, training `epochs` epochs."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## In fifteen lines", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "epochs=10" in code
    return code.replace("epochs=10", f"epochs={epochs}")


def _environment_without_tf_log_settings():
    return {
        name: value
        for name, value in os.environ.items()
        if name not in ("TF_CONFIG", "TF_CPP_MIN_LOG_LEVEL", "KERAS_DIST_TF_LOGS")
    }


@pytest.mark.multiworker
@pytest.mark.extended
def test_two_worker_readme_example_prints_tensorflow_logs_when_asked(tmp_path):
    # `keras-dist launch --workers 2 --tf-logs -- python train.py` on the
    # README's example (2 epochs instead of 10): TensorFlow's C++ lines (the
    # oneDNN notice, "Could not find cuda drivers", `failed call to cuInit`,
    # the coordination service) come through when asked for; training
    # output too. Without `--tf-logs` they are hidden: test_readme.py's run
    # of the README's command checks that.
    script = tmp_path / "train.py"
    script.write_text(_readme_example(epochs=2))
    result = _run_module(
        ["launch", "--workers", "2", "--tf-logs", "--", sys.executable, str(script)],
        env=_environment_without_tf_log_settings(),
        timeout=600,
    )

    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for index in range(2):
        assert "Epoch 2/2" in task_lines(result.stdout, f"worker:{index}")
    assert len(native_log_lines(result.stdout + result.stderr)) > 0


def test_env_prints_no_tensorflow_log_line_by_default():
    result = _run_module(["env"], env=_environment_without_tf_log_settings())

    assert result.returncode == 0, result.stderr
    assert native_log_lines(result.stdout + result.stderr) == []
    # Everything that needs no TensorFlow comes first; the last line says
    # where the time went.
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:6]] == [
        "keras_dist",
        "Python",
        "TensorFlow",
        "Keras",
        "TF_CONFIG",
        "Engine",
    ]
    assert re.fullmatch(
        r"Took: +[\d.]+ s \([\d.]+ s of it importing TensorFlow, which imports "
        r"Keras\)",
        lines[-1],
    )


def test_help_names_the_tf_logs_switch(capsys):
    for command in ("launch", "env"):
        assert cli.main([command, "--help"]) == 0
        help_text = " ".join(capsys.readouterr().out.split())
        assert "--tf-logs" in help_text
        assert "KERAS_DIST_TF_LOGS=1" in help_text


def test_one_collective_timeout_check_for_the_launcher_and_the_strategy():
    # The CLI, `launch` and `auto_strategy` all call cluster's one check.
    from keras_dist import cluster, strategy
    from keras_dist.launcher import supervisor

    assert cluster.check_collective_timeout(2) == 2.0
    assert cluster.check_collective_timeout(None) is None
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"`collective_timeout` must be .* > 0"):
            cluster.check_collective_timeout(bad)
    with pytest.raises(ValueError, match="collective_timeout=0"):
        supervisor.launch(["true"], workers=1, collective_timeout=0)
    with pytest.raises(ValueError, match="`None` reads KERAS_DIST_COLLECTIVE_TIMEOUT"):
        strategy._with_collective_timeout(None, 0)
    assert supervisor.COLLECTIVE_TIMEOUT_ENV_VAR == cluster.COLLECTIVE_TIMEOUT_ENV_VAR
    assert strategy.COLLECTIVE_TIMEOUT_ENV_VAR == cluster.COLLECTIVE_TIMEOUT_ENV_VAR


def test_every_option_is_in_the_command_reference(capsys):
    """docs/api/cli.md names each option of each subcommand (a table row,
    or in the text: `env`'s one) in that subcommand's section, with its
    choices as the parser has them (the demo parses its own arguments: its
    options are read from its help)."""
    import argparse

    from helpers import REPO_ROOT

    from keras_dist import demo

    page = (REPO_ROOT / "docs" / "api" / "cli.md").read_text()
    subparsers = next(
        action
        for action in cli._build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    options = {
        name: [
            (option, action.choices)
            for action in parser._actions
            for option in action.option_strings
        ]
        for name, parser in subparsers.choices.items()
        if not name.startswith("_") and name != "demo"
    }
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    options["demo"] = [
        (option, None)
        for option in re.findall(r"^  (--[\w-]+)", capsys.readouterr().out, re.M)
    ]
    assert len(options["demo"]) >= 5
    missing = []
    for name, found in options.items():
        section = page.split(f"## `keras-dist {name}`", 1)[1].split("\n## ", 1)[0]
        for option, choices in found:
            if option in ("-h", "--help"):
                continue
            if f"`{option}" not in section:
                missing.append(f"{name} {option}")
            elif choices and "{" + ",".join(choices) + "}" not in section:
                missing.append(f"{name} {option} {{{','.join(choices)}}}")
    assert not missing, missing
