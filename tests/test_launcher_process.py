"""Tests for keras_dist.launcher.process, with real processes (no mocks)."""

import io
import os
import pathlib
import signal
import sys
import textwrap
import time

import pytest
from helpers import run_python, wait_gone

from keras_dist.launcher import output as output_lib
from keras_dist.launcher import process as process_lib

pytestmark = pytest.mark.skipif(os.name != "posix", reason="process groups")


def python(code):
    return [sys.executable, "-c", textwrap.dedent(code)]


def spec(name, code, serves=False):
    return process_lib.TaskSpec(name, python(code), dict(os.environ), serves=serves)


class Messages(list):
    def __call__(self, message):
        self.append(message)


def test_env_with_package_puts_this_copy_first():
    env = process_lib.env_with_package({"PYTHONPATH": "/elsewhere", "A": "1"})
    assert env["PYTHONPATH"] == os.pathsep.join(
        [process_lib.PACKAGE_PARENT, "/elsewhere"]
    )
    assert env["A"] == "1"
    assert process_lib.env_with_package({})["PYTHONPATH"] == process_lib.PACKAGE_PARENT
    assert (pathlib.Path(process_lib.PACKAGE_PARENT) / "keras_dist").is_dir()


def test_start_gives_a_process_group_and_merges_stderr(tmp_path):
    process = process_lib.start(
        python("""
            import os, sys
            print(os.getpgid(0) == os.getpid(), flush=True)
            print("to stderr", file=sys.stderr, flush=True)
            print(sys.stdin.read() == "", flush=True)
        """),
        os.environ,
    )
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    assert out.decode().splitlines() == ["True", "to stderr", "True"]


def test_start_raises_os_error_for_a_missing_program():
    with pytest.raises(OSError):
        process_lib.start(["no-such-program-kd"], os.environ)


def test_prefixed_output_copies_whole_lines_with_the_task_name():
    stream = io.StringIO()
    output = output_lib.TaskOutput(stream)
    process = process_lib.start(
        python("""
            import sys
            sys.stdout.buffer.write(b"one\\r\\ntwo\\n\\xff bad byte\\nno newline")
        """),
        os.environ,
    )
    task = process_lib.Task(process_lib.TaskSpec("worker:3", [], {}), process)
    output.follow(task).join(timeout=60)
    process.wait(timeout=60)
    assert stream.getvalue().splitlines() == [
        "[worker:3] one",
        "[worker:3] two",
        "[worker:3] \ufffd bad byte",
        "[worker:3] no newline",
    ]
    assert not output.broken


def test_prefixed_output_drops_lines_once_the_reader_is_gone():
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w") as stream:
        output = output_lib.TaskOutput(stream)
        process = process_lib.start(
            python("""
                for line in range(10000):
                    print(line)
            """),
            os.environ,
        )
        task = process_lib.Task(process_lib.TaskSpec("worker:0", [], {}), process)
        output.follow(task).join(timeout=60)
        # The task was read to the end, so it never blocked nor saw EPIPE.
        assert process.wait(timeout=60) == 0
        assert output.broken
        stream.buffer.raw.close()


def test_wait_any_returns_the_first_process_that_exits():
    slow = process_lib.start(python("import time; time.sleep(30)"), os.environ)
    fast = process_lib.start(python("raise SystemExit(7)"), os.environ)
    try:
        assert process_lib.wait_any([slow, fast], timeout=60) is fast
        assert fast.returncode == 7
        start = time.monotonic()
        assert process_lib.wait_any([slow], timeout=0.3) is None
        assert time.monotonic() - start < 5
    finally:
        process_lib.kill([slow, fast])
    assert slow.returncode == -signal.SIGKILL


def test_exit_status_and_description_follow_the_shell():
    process = process_lib.start(python("import time; time.sleep(30)"), os.environ)
    process_lib.send_signal(process, signal.SIGTERM)
    code = process.wait(timeout=60)
    assert code == -signal.SIGTERM
    assert process_lib.exit_status(code) == 143
    assert process_lib.describe_exit(code) == "exit code 143 (killed by SIGTERM)"
    assert process_lib.describe_exit(3) == "exit code 3"
    assert process_lib.exit_status(3) == 3


def test_stop_gives_sigterm_then_sigkill_after_the_grace_period(tmp_path):
    # The task ignores SIGTERM and has started a grandchild: both are killed
    # after the grace period, the grandchild with its process group.
    pid_file = tmp_path / "grandchild.pid"
    stubborn = process_lib.start(
        python(f"""
            import signal, subprocess, sys, time
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            child = subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(60)"]
            )
            open({str(pid_file)!r}, "w").write(str(child.pid))
            print("ready", flush=True)
            time.sleep(60)
        """),
        os.environ,
    )
    polite = process_lib.start(python("import time; time.sleep(60)"), os.environ)
    assert stubborn.stdout.readline() == b"ready\n"

    start = time.monotonic()
    process_lib.stop([stubborn, polite], grace_period=1.0)
    elapsed = time.monotonic() - start

    assert 0.9 < elapsed < 10
    assert polite.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL
    wait_gone(int(pid_file.read_text()))
    stubborn.stdout.close()


def test_run_tasks_success_prefixes_every_task():
    out = io.StringIO()
    messages = Messages()
    specs = [spec(f"worker:{index}", f"print('hello {index}')") for index in range(2)]

    status = process_lib.run_tasks(specs, out, messages, grace_period=1.0)

    assert status == 0
    assert sorted(out.getvalue().splitlines()) == [
        "[worker:0] hello 0",
        "[worker:1] hello 1",
    ]
    assert messages == []


def test_run_tasks_first_failure_stops_the_others(tmp_path):
    out = io.StringIO()
    messages = Messages()
    ready = tmp_path / "ready"
    specs = [
        spec(
            "worker:0",
            f"""
            import os, sys, time
            while not os.path.exists({str(ready)!r}):
                time.sleep(0.02)
            sys.exit(3)
            """,
        ),
        spec(
            "worker:1",
            f"""
            import os, time
            open({str(ready)!r}, "w").write(str(os.getpid()))
            time.sleep(60)
            """,
        ),
    ]

    start = time.monotonic()
    status = process_lib.run_tasks(specs, out, messages, grace_period=1.0)

    assert status == 3
    assert time.monotonic() - start < 30
    assert messages == [
        "task worker:0 failed with exit code 3; stopping the other tasks."
    ]
    wait_gone(int(ready.read_text()), timeout=1.0)


def test_run_tasks_a_serving_task_that_exits_is_a_failure():
    messages = Messages()
    specs = [
        spec("ps:0", "raise SystemExit(0)", serves=True),
        spec("worker:0", "import time; time.sleep(60)"),
    ]

    status = process_lib.run_tasks(specs, io.StringIO(), messages, grace_period=1.0)

    assert status == 1
    assert messages[0].startswith("parameter server ps:0 stopped with exit code 0")


def test_run_tasks_ends_when_the_coordinator_does():
    messages = Messages()
    specs = [
        spec("ps:0", "import time; time.sleep(60)", serves=True),
        spec("chief:0", "import time; time.sleep(0.5)"),
        spec("worker:0", "import time; time.sleep(60)"),
    ]

    start = time.monotonic()
    status = process_lib.run_tasks(
        specs, io.StringIO(), messages, grace_period=1.0, coordinator="chief:0"
    )

    assert status == 0
    assert time.monotonic() - start < 30
    assert messages == [
        "chief:0 (the coordinator) finished; stopping the 1 worker task(s) "
        "still serving."
    ]


def test_run_tasks_reports_a_command_that_cannot_start():
    messages = Messages()
    specs = [
        spec("worker:0", "import time; time.sleep(60)"),
        process_lib.TaskSpec("worker:1", ["no-such-program-kd"], dict(os.environ)),
    ]

    status = process_lib.run_tasks(specs, io.StringIO(), messages, grace_period=1.0)

    assert status == process_lib.EXIT_CANNOT_START == 127
    assert messages[0].startswith("cannot start 'no-such-program-kd': ")


def test_run_tasks_says_when_file_descriptors_run_out(tmp_path):
    # Each running task holds its output pipe: 100 tasks do not fit in 48
    # descriptors. The tasks already started are stopped.
    code = f"""
        import os, resource, sys
        # Imported as the command line imports it, without TensorFlow.
        sys.argv[0] = "-m"
        from keras_dist.launcher import process as process_lib
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
        folder = {str(tmp_path)!r}
        script = (
            "import os, time; "
            f"open(os.path.join({{folder!r}}, str(os.getpid())), 'w'); "
            "time.sleep(60)"
        )
        command = [sys.executable, "-c", script]
        specs = [
            process_lib.TaskSpec(f"worker:{{i}}", command, dict(os.environ))
            for i in range(100)
        ]
        status = process_lib.run_tasks(specs, sys.stdout, print, grace_period=1.0)
        print("status", status)
    """
    result = run_python(code)
    assert "cannot start 100 tasks: the system refused another process or file " in (
        result.stdout
    )
    assert "ulimit -n 4096" in result.stdout
    assert result.stdout.splitlines()[-1] == "status 1"
    for path in tmp_path.iterdir():
        wait_gone(int(path.name), timeout=5.0)


def test_launcher_restarts_a_lost_worker_in_place_then_goes_on_without_it(tmp_path):
    """The launcher's part of a parameter-server job surviving its workers.

    (Moved here from test_parameter_server_unit.py.)
    """
    out, messages = io.StringIO(), []
    chief_may_exit = tmp_path / "done"
    runs = tmp_path / "runs"
    specs = [
        spec(
            "chief:0",
            f"""
            import os, time
            while not os.path.exists({str(chief_may_exit)!r}):
                time.sleep(0.02)
            time.sleep(1.5)  # the launcher sees worker:1's exit first
            """,
        ),
        spec("worker:0", "import time; time.sleep(60)"),
        # worker:1 fails at once, every time; the second failure, with no
        # restart left, lets the chief finish.
        spec(
            "worker:1",
            f"""
            import os, sys
            with open({str(runs)!r}, "a") as file:
                file.write("run\\n")
            if open({str(runs)!r}).read().count("run") == 2:
                open({str(chief_may_exit)!r}, "w").close()
            sys.exit(9)
            """,
        ),
    ]

    status = process_lib.run_tasks(
        specs,
        out,
        messages.append,
        grace_period=1.0,
        coordinator="chief:0",
        replaceable=["worker:0", "worker:1"],
        restarts=1,
    )

    assert status == 0, messages
    assert runs.read_text().count("run") == 2
    assert messages[:2] == [
        "task worker:1 failed with exit code 9; started it again in place (the "
        "coordinator retries its steps); 0 restart(s) left.",
        "task worker:1 failed with exit code 9; the coordinator retries its "
        "steps on worker:0.",
    ]
    assert messages[2:] == [
        "chief:0 (the coordinator) finished; stopping the 1 worker task(s) still "
        "serving."
    ]


def test_launcher_stops_when_no_worker_is_left():
    messages = []
    specs = [
        spec("chief:0", "import time; time.sleep(60)"),
        spec("worker:0", "import sys; sys.exit(4)"),
    ]
    status = process_lib.run_tasks(
        specs,
        io.StringIO(),
        messages.append,
        grace_period=1.0,
        coordinator="chief:0",
        replaceable=["worker:0"],
    )
    assert status == 4
    assert messages == [
        "task worker:0 failed with exit code 4 and no worker is left; stopping "
        "the other tasks."
    ]
