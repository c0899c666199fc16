"""Tests for keras_dist.launcher.supervisor (`launch`), with real processes.

`launch` runs in the test process (the launcher itself is then free, the
tasks are real processes). The command line around it (`keras-dist launch`,
`python -m keras_dist`, SIGINT, usage errors) is in `test_cli.py`.
"""

import io
import json
import os
import sys
import textwrap
import time

import pytest
from helpers import SLEEPER, run_python, task_lines, wait_gone, write_script

from keras_dist import cli, launcher
from keras_dist.launcher import process as process_lib
from keras_dist.launcher import supervisor


def test_cluster_tasks_start_the_ps_first_each_with_its_environment():
    spec = {
        "chief": ["localhost:1"],
        "worker": ["localhost:2", "localhost:3"],
        "ps": ["localhost:4"],
    }
    tasks = supervisor.cluster_tasks(
        ["python", "train.py"], spec, {"A": "1", "PYTHONPATH": "/x"}, attempt=2
    )

    assert [task.name for task in tasks] == ["ps:0", "chief:0", "worker:0", "worker:1"]
    assert [task.serves for task in tasks] == [True, False, False, False]
    ps, chief, *workers = tasks
    assert ps.command == [sys.executable, "-m", "keras_dist", "_ps-server"]
    assert ps.env["PYTHONPATH"] == os.pathsep.join([process_lib.PACKAGE_PARENT, "/x"])
    for task in (chief, *workers):
        assert task.command == ["python", "train.py"]
        assert task.env["PYTHONPATH"] == "/x"
    for task in tasks:
        task_type, index = task.name.split(":")
        config = json.loads(task.env["TF_CONFIG"])
        assert config == {
            "cluster": spec,
            "task": {"type": task_type, "index": int(index)},
        }
        assert task.env["KERAS_DIST_TASK"] == task.name
        assert task.env["KERAS_DIST_RESTART"] == "2"
        assert task.env["KERAS_DIST_WORKERS"] == "2"
        assert task.env["PYTHONUNBUFFERED"] == "1"
        assert task.env["A"] == "1"


def test_the_launcher_imports_no_framework():
    # The launcher process must stay light; `callbacks` imports
    # `launcher.process` too, so nothing here may import Keras back.
    result = run_python(
        "import sys\n"
        "sys.argv = ['-m']\n"
        "import keras_dist.launcher, keras_dist.cli\n"
        "heavy = {'tensorflow', 'keras', 'numpy'}\n"
        "print(sorted({name.split('.')[0] for name in sys.modules} & heavy))\n"
    )
    assert result.stdout == "[]\n"


def test_one_launch_function_for_the_cli_and_the_library():
    assert cli.launch is launcher.launch is supervisor.launch
    assert launcher.EXIT_PREEMPTED == process_lib.EXIT_PREEMPTED == 75


def test_launch_with_chief_runs_the_command_as_chief_too(tmp_path, capsys):
    script = write_script(
        tmp_path,
        "show.py",
        """
        import json, os
        config = json.loads(os.environ["TF_CONFIG"])
        print(sorted(config["cluster"]), config["task"]["type"])
        """,
    )

    status = launcher.launch([sys.executable, script], workers=1, chief=True)

    output = capsys.readouterr().out
    assert status == 0
    assert task_lines(output, "chief:0") == ["['chief', 'worker'] chief"]
    assert task_lines(output, "worker:0") == ["['chief', 'worker'] worker"]


def test_failing_worker_stops_the_others_and_sets_the_exit_code(tmp_path, capsys):
    # worker:0 fails once worker:1 is surely running; worker:1 would sleep 60 s.
    failer = """
        import os, sys, time
        if os.environ["KERAS_DIST_TASK"] == "worker:0":
            other = os.path.join(sys.argv[1], "worker_1.pid")
            while not os.path.exists(other):
                time.sleep(0.02)
            print("giving up", flush=True)
            sys.exit(3)
    """
    script = write_script(
        tmp_path, "fail_or_sleep.py", textwrap.dedent(failer) + textwrap.dedent(SLEEPER)
    )

    start = time.monotonic()
    status = launcher.launch([sys.executable, script, str(tmp_path), "60"], workers=2)
    elapsed = time.monotonic() - start

    captured = capsys.readouterr()
    assert status == 3
    assert elapsed < 20
    assert "[worker:0] giving up" in captured.out
    assert "worker:0 failed with exit code 3" in captured.err
    wait_gone(int((tmp_path / "worker_1.pid").read_text()), timeout=1.0)


def test_unstartable_command_exits_127(capsys):
    status = launcher.launch(["no-such-program-kd"], workers=1)

    assert status == 127
    assert "cannot start" in capsys.readouterr().err


def test_launch_rejects_an_empty_command():
    with pytest.raises(ValueError, match="`command` must name a program"):
        launcher.launch([], workers=1)


def test_with_ps_the_launch_ends_when_the_chief_does(tmp_path, capsys):
    # ParameterServerStrategy workers only serve (`server.join()` never
    # returns); the chief, the coordinator, decides when the job is done.
    script = write_script(tmp_path, "sleeper.py", SLEEPER)
    chief = write_script(
        tmp_path,
        "chief_or_sleeper.py",
        f"""
        import os, runpy, sys, time
        if os.environ["KERAS_DIST_TASK"] == "chief:0":
            deadline = time.monotonic() + 60
            while len([n for n in os.listdir(sys.argv[1]) if n.endswith(".pid")]) < 2:
                assert time.monotonic() < deadline, "workers did not start"
                time.sleep(0.05)
            print("coordinator done")
        else:
            runpy.run_path({script!r}, run_name="__main__")
        """,
    )
    pids = tmp_path / "pids"
    pids.mkdir()

    status = launcher.launch(
        [sys.executable, chief, str(pids), "300"], workers=2, ps=1, chief=True
    )

    captured = capsys.readouterr()
    assert status == 0, captured.out + captured.err
    assert "coordinator done" in task_lines(captured.out, "chief:0")
    assert "chief:0 (the coordinator) finished; stopping the 2 worker task(s)" in (
        captured.err
    )
    for name in ("worker_0", "worker_1"):
        wait_gone(int((pids / f"{name}.pid").read_text()), timeout=1.0)


def test_without_ps_a_finished_chief_waits_for_the_workers(tmp_path, capsys):
    script = write_script(
        tmp_path,
        "chief_first.py",
        """
        import os, time
        if os.environ["KERAS_DIST_TASK"] == "worker:0":
            time.sleep(1.5)
        print("done")
        """,
    )

    status = launcher.launch([sys.executable, script], workers=1, chief=True)

    output = capsys.readouterr().out
    assert status == 0
    assert task_lines(output, "worker:0") == ["done"]


def test_a_worker_that_finishes_early_is_not_blamed(tmp_path, capsys):
    # worker:0 exits 0 at once; worker:1 fails later (as a peer whose
    # collective lost worker:0 would). The report names worker:1 as the
    # failed task and worker:0 as the one that left early.
    script = write_script(
        tmp_path,
        "early.py",
        """
        import os, sys, time
        if os.environ["KERAS_DIST_TASK"] == "worker:0":
            sys.exit(0)
        time.sleep(1.0)
        print("peer gone", flush=True)
        sys.exit(4)
        """,
    )

    status = launcher.launch([sys.executable, script], workers=2)

    err = capsys.readouterr().err
    assert status == 4
    assert "worker:1 failed with exit code 4 after" in err
    assert "worker:0 had already exited with status 0: a task that leaves early" in err
    assert "worker:0 failed" not in err


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"workers": True}, TypeError, r"`workers` must be an int >= 1\. Received"),
        ({"workers": 0}, ValueError, r"`workers` must be an int >= 1\. Received"),
        ({"workers": 1, "ps": -1}, ValueError, r"`ps` must be an int >= 0"),
        ({"workers": 1, "chief": "no"}, TypeError, r"`chief` must be a bool"),
        ({"workers": 1, "grace_period": -1}, ValueError, r"`grace_period` must be"),
        ({"workers": 1, "grace_period": "5"}, TypeError, r"grace_period='5'"),
    ],
)
def test_launch_validates_its_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        launcher.launch(["true"], **kwargs)


MULTIWORKER_SCRIPT = """
    import json, os
    import tensorflow as tf

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    @tf.function
    def all_reduce():
        value = strategy.run(lambda: tf.constant(index + 1.0))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)

    print(f"replicas={strategy.num_replicas_in_sync} sum={float(all_reduce())}")
"""


@pytest.mark.multiworker
def test_launch_runs_a_real_multi_worker_all_reduce(tmp_path, capsys):
    script = write_script(tmp_path, "all_reduce.py", MULTIWORKER_SCRIPT)

    status = launcher.launch([sys.executable, script], workers=2)

    output = capsys.readouterr().out
    assert status == 0, output
    for index in range(2):
        assert "replicas=2 sum=3.0" in task_lines(output, f"worker:{index}"), output


# --- Restarts (--max-restarts) -----------------------------------------------


FLAKY = """
import os, sys, time
attempt = int(os.environ["KERAS_DIST_RESTART"])
task = os.environ["KERAS_DIST_TASK"]
print("attempt", attempt, task, os.environ["KERAS_DIST_COLLECTIVE_TIMEOUT"])
# Both tasks print before either exits: the launcher stops the other task as
# soon as one fails, which could cut a slower task's line.
folder = sys.argv[2]
with open(os.path.join(folder, f"{attempt}-{task}"), "w") as marker:
    marker.write(os.environ["KERAS_DIST_COLLECTIVE_TIMEOUT"])
deadline = time.monotonic() + 60
while time.monotonic() < deadline and sum(
    name.startswith(f"{attempt}-") for name in os.listdir(folder)
) < 2:
    time.sleep(0.02)
sys.exit(0 if attempt >= int(sys.argv[1]) else 3)
"""


def run_flaky(capsys, tmp_path, succeed_at, **kwargs):
    """Launches FLAKY on 2 workers; returns (status, stdout + stderr)."""
    command = [sys.executable, "-c", FLAKY, str(succeed_at), str(tmp_path)]
    environ = {
        name: value
        for name, value in os.environ.items()
        if name != "KERAS_DIST_COLLECTIVE_TIMEOUT"
    }
    status = launcher.launch(command, workers=2, environ=environ, **kwargs)
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def test_launch_restarts_the_whole_job_until_it_succeeds(capsys, tmp_path):
    status, output = run_flaky(capsys, tmp_path, 2, max_restarts=2)

    assert status == 0
    for attempt in range(3):
        assert f"attempt {attempt} worker:0 300" in output
    assert "restart 1 of 2: worker:" in output
    assert "failed with exit code 3" in output
    assert "(KERAS_DIST_RESTART=2)" in output


def test_launch_gives_up_with_the_last_status(capsys, tmp_path):
    status, output = run_flaky(
        capsys, tmp_path, 5, max_restarts=1, collective_timeout=7
    )

    assert status == 3
    # Every task of both attempts ran, with the timeout. (Read from the
    # tasks' files: a task's last output line can still be in the pipe when
    # the launcher, stopping the job, stops reading it.)
    for attempt in (0, 1):
        for task in ("worker:0", "worker:1"):
            assert (tmp_path / f"{attempt}-{task}").read_text() == "7"
    assert "giving up after 2 attempts (max restarts 1); exit status 3" in output


def test_launch_without_restarts_keeps_todays_behaviour(capsys, tmp_path):
    status, output = run_flaky(capsys, tmp_path, 1)

    assert status == 3
    assert "restart" not in output


def test_launch_refuses_restarts_with_parameter_servers_but_no_chief():
    # With a chief (the coordinator) a failed worker is restarted in place.
    with pytest.raises(ValueError, match=r"max_restarts.*needs `chief=True`"):
        launcher.launch(["true"], workers=1, ps=1, max_restarts=1)
    with pytest.raises(ValueError, match="max_restarts"):
        launcher.launch(["true"], workers=1, max_restarts=-1)


# A task that reports what TensorFlow would read, then writes two lines in
# TensorFlow's native formats and one of its own.
NOISY_TASK = """
    import os, sys
    print("level", os.environ.get("TF_CPP_MIN_LOG_LEVEL"),
          "switch", os.environ.get("KERAS_DIST_TF_LOGS"), flush=True)
    print("WARNING: All log messages before absl::InitializeLog() is called "
          "are written to STDERR", file=sys.stderr, flush=True)
    print("I0000 00:00:1796356644.450448    1393 port.cc:153] oneDNN custom "
          "operations are on.", file=sys.stderr, flush=True)
    print("mine", flush=True)
"""


@pytest.mark.parametrize(
    "environ, tf_logs, level, switch, shown",
    [
        # Nothing said: quiet (level 3, native lines dropped).
        ({}, False, "3", None, False),
        # Asked for, by the option or the variable: everything, as TensorFlow
        # writes it; the option reaches the tasks as the variable.
        ({}, True, None, "1", True),
        ({"KERAS_DIST_TF_LOGS": "1"}, False, None, "1", True),
        # The user's own level is theirs: kept, nothing dropped.
        ({"TF_CPP_MIN_LOG_LEVEL": "1"}, False, "1", None, True),
    ],
)
def test_tensorflow_logs_are_quiet_unless_asked_for(
    tmp_path, environ, tf_logs, level, switch, shown
):
    script = write_script(tmp_path, "noisy.py", NOISY_TASK)
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("TF_CPP_MIN_LOG_LEVEL", "KERAS_DIST_TF_LOGS")
    }
    out, err = io.StringIO(), io.StringIO()

    status = launcher.launch(
        [sys.executable, script],
        workers=2,
        environ={**env, **environ},
        stdout=out,
        stderr=err,
        tf_logs=tf_logs,
    )

    assert status == 0, err.getvalue()
    for index in range(2):
        lines = task_lines(out.getvalue(), f"worker:{index}")
        assert lines[0] == f"level {level} switch {switch}"
        assert "mine" in lines
        assert (len(lines) == 4) is shown, lines


# --- Cores split between the tasks -----------------------------------------

THREADS_TASK = """
    import os
    print("intra", os.environ.get("TF_NUM_INTRAOP_THREADS"))
"""
_THREAD_VARS = (
    "TF_NUM_INTRAOP_THREADS",
    "OMP_NUM_THREADS",
    "KERAS_DIST_SPLIT_THREADS",
)


def launched_intra_op_threads(tmp_path, environ=None, **kwargs):
    """The `TF_NUM_INTRAOP_THREADS` every launched task saw, by task name."""
    script = write_script(tmp_path, "threads.py", THREADS_TASK)
    env = {k: v for k, v in os.environ.items() if k not in _THREAD_VARS}
    out, err = io.StringIO(), io.StringIO()
    kwargs.setdefault("workers", 2)
    status = launcher.launch(
        [sys.executable, script],
        environ={**env, **(environ or {})},
        stdout=out,
        stderr=err,
        **kwargs,
    )
    assert status == 0, err.getvalue()
    seen = {}
    for line in out.getvalue().splitlines():
        task, _, text = line.partition("] ")
        if text.startswith("intra "):
            seen[task.lstrip("[")] = text.split()[1]
    return seen


@pytest.mark.parametrize(
    ("tasks", "cores", "threads"),
    [(2, 2, 1), (4, 2, 1), (2, 8, 4), (3, 8, 2), (16, 8, 1)],
)
def test_each_task_gets_its_share_of_the_cores(tasks, cores, threads):
    env = {"A": "1"}

    assert supervisor.split_cores(env, tasks, cores=cores) == threads
    assert env == {"A": "1", "TF_NUM_INTRAOP_THREADS": str(threads)}


def test_one_task_keeps_every_core():
    env = {}

    assert supervisor.split_cores(env, 1, cores=8) is None
    assert env == {}


@pytest.mark.parametrize("name", ["TF_NUM_INTRAOP_THREADS", "OMP_NUM_THREADS"])
def test_threads_the_user_chose_are_kept(name):
    env = {name: "3"}

    assert supervisor.split_cores(env, 2, cores=8) is None
    assert env == {name: "3"}


def test_cores_are_read_from_the_affinity_mask():
    assert supervisor.available_cores() == len(os.sched_getaffinity(0))


def test_launched_tasks_get_the_split_by_default(tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor, "available_cores", lambda: 8)

    # 2 workers and a chief: 3 processes share 8 cores.
    seen = launched_intra_op_threads(tmp_path, chief=True)

    assert seen == {"chief:0": "2", "worker:0": "2", "worker:1": "2"}


def test_one_launched_task_is_left_to_tensorflow(tmp_path):
    assert launched_intra_op_threads(tmp_path, workers=1) == {"worker:0": "None"}


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"TF_NUM_INTRAOP_THREADS": "3"}, "3"),
        ({"OMP_NUM_THREADS": "1"}, "None"),
    ],
)
def test_launched_tasks_keep_the_threads_the_user_set(tmp_path, environ, expected):
    seen = launched_intra_op_threads(tmp_path, environ=environ)

    assert seen == {"worker:0": expected, "worker:1": expected}


@pytest.mark.parametrize(
    "environ, kwargs",
    [
        ({"KERAS_DIST_SPLIT_THREADS": "0"}, {}),
        ({"KERAS_DIST_SPLIT_THREADS": "off"}, {}),
        ({}, {"split_threads": False}),
        # The argument wins over the variable.
        ({"KERAS_DIST_SPLIT_THREADS": "1"}, {"split_threads": False}),
    ],
)
def test_the_split_can_be_turned_off(tmp_path, environ, kwargs):
    seen = launched_intra_op_threads(tmp_path, environ=environ, **kwargs)

    assert seen == {"worker:0": "None", "worker:1": "None"}


def test_the_split_switch_must_be_a_bool():
    with pytest.raises(TypeError, match="`split_threads` must be a bool"):
        launcher.launch(["true"], workers=2, split_threads="no")
