"""One writer per `backup_dir` (`keras_dist.backup.lock`; issue 31 B2).

Two separate jobs sharing a `backup_dir` used to corrupt each other (one
pruned the other's backup while it was being written; the first to finish
deleted the folder). With real processes: a second job is stopped at the
start with a message naming the first, which trains to the end untouched;
a job killed with SIGKILL leaves a stale `LOCK` that the next one takes
over. In one process: the rules for a `LOCK` of another host, of the same
job, of this process, a garbled one, and a job that lost the folder
deleting nothing.
"""

import dataclasses
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import REPO_ROOT

from keras_dist.backup import files, lock, store

WORKER = os.path.join(REPO_ROOT, "tests", "backup_lock_worker.py")
TIMEOUT = 300


def start(backup_dir, batch_seconds=0.0, hold_until=None):
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"}
    for name in ("TF_CONFIG", lock.JOB_ID_ENV_VAR, "SLURM_JOB_ID"):
        env.pop(name, None)
    return subprocess.Popen(
        [
            sys.executable,
            WORKER,
            str(backup_dir),
            "--batch-seconds",
            str(batch_seconds),
            *(["--hold-until", str(hold_until)] if hold_until else []),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )


def wait_for_a_backup(process, backup_dir):
    deadline = time.monotonic() + TIMEOUT
    while not os.path.exists(os.path.join(backup_dir, store.CURRENT)):
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no backup written"
        time.sleep(0.2)


def finish(process):
    output, _ = process.communicate(timeout=TIMEOUT)
    return process.returncode, output


@pytest.mark.slow
def test_a_second_job_on_the_same_backup_dir_is_stopped_and_the_first_finishes(
    tmp_path,
):
    backup_dir = tmp_path / "shared"
    # The first job waits after its first batch until the second is done (a
    # fixed pace let it finish first when the second started slowly in CI).
    second_done = tmp_path / "second_done"
    first = start(backup_dir, hold_until=second_done)
    try:
        wait_for_a_backup(first, backup_dir)
        owner = lock.read_owner(str(backup_dir))
        assert owner.pid == first.pid
        status, output = finish(start(backup_dir))
        second_done.touch()
        assert status == 3, output[-3000:]
        assert "`backup_dir` is in use by another job" in output
        assert f"belongs to process {first.pid} on " in output
        assert "which is running" in output
        status, output = finish(first)
    finally:
        if first.poll() is None:
            first.kill()
    # The first job never met the second: every save went through, and it
    # deleted its backups (and LOCK) at the end as usual.
    assert status == 0, output[-3000:]
    assert "done" in output and "Traceback" not in output
    assert not backup_dir.exists()


@pytest.mark.slow
def test_a_killed_jobs_lock_is_taken_over_by_the_next(tmp_path):
    backup_dir = tmp_path / "shared"
    killed = start(backup_dir, batch_seconds=0.3)
    try:
        wait_for_a_backup(killed, backup_dir)
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=TIMEOUT)
    assert lock.read_owner(str(backup_dir)).pid == killed.pid
    status, output = finish(start(backup_dir))
    assert status == 0, output[-3000:]
    assert f"was held by process {killed.pid} on " in output
    assert "which is no longer running; taking it over" in output
    assert "resumed from" in output
    assert not backup_dir.exists()


# --- The rules, in one process ------------------------------------------------------


def foreign(backup_dir, **changes):
    """Writes a LOCK of another process (this one's, changed)."""
    owner = dataclasses.replace(lock.this_process(), **changes)
    files.makedirs(str(backup_dir))
    files.write_bytes(files.join(str(backup_dir), lock.LOCK_FILE), owner.to_bytes())
    return owner


def test_a_lock_of_another_host_is_refused_with_the_way_out(tmp_path):
    foreign(tmp_path, host="elsewhere", pid=4321, job=None)
    with pytest.raises(lock.BackupInUseError) as raised:
        lock.acquire(str(tmp_path))
    message = str(raised.value)
    assert "belongs to process 4321 on elsewhere" in message
    assert "runs on another host" in message
    assert f"delete {tmp_path / lock.LOCK_FILE}" in message
    assert lock.JOB_ID_ENV_VAR in message


def test_a_live_process_on_this_host_is_refused(tmp_path):
    parent = os.getppid()  # running, and not this process
    from keras_dist.backup.lock import _start_time

    foreign(tmp_path, pid=parent, started=_start_time(parent), job=None)
    with pytest.raises(lock.BackupInUseError, match="which is running"):
        lock.acquire(str(tmp_path))


def test_an_earlier_attempt_of_the_same_job_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv(lock.JOB_ID_ENV_VAR, "run-7")
    old = foreign(tmp_path, host="elsewhere", pid=4321, job=lock.job_id())
    owner = lock.acquire(str(tmp_path))
    assert owner.token != old.token
    assert lock.read_owner(str(tmp_path)) == owner


def test_a_reused_pid_or_this_process_is_stale(tmp_path, caplog):
    me = lock.this_process()
    # The same pid, started at another time: a process before this one.
    foreign(tmp_path, started="1", job=None)
    with caplog.at_level("WARNING"):
        lock.acquire(str(tmp_path))
    assert "no longer running; taking it over" in caplog.text
    # This very process (a `fit` that stopped with an exception).
    foreign(tmp_path, started=me.started, job=None)
    assert lock.acquire(str(tmp_path)).pid == me.pid


def test_a_garbled_lock_is_replaced(tmp_path):
    (tmp_path / lock.LOCK_FILE).write_text('{"host": "half')
    owner = lock.acquire(str(tmp_path))
    assert lock.read_owner(str(tmp_path)) == owner


def test_job_id_sources():
    assert lock.job_id({}) is None
    assert lock.job_id({lock.JOB_ID_ENV_VAR: "a"}) == f"{lock.JOB_ID_ENV_VAR}=a"
    assert lock.job_id({"SLURM_JOB_ID": "12"}) == "SLURM_JOB_ID=12"
    config = '{"cluster": {"worker": ["w0:2222", "w1:2222"]}, "task": {"index": 1}}'
    same = '{"cluster": {"worker": ["w0:2222", "w1:2222"]}, "task": {"index": 0}}'
    assert lock.job_id({"TF_CONFIG": config}) == lock.job_id({"TF_CONFIG": same})
    assert lock.job_id({"TF_CONFIG": config}).startswith("TF_CONFIG cluster ")


@pytest.mark.parametrize("storage", ["disk", "ram"])
def test_a_job_that_lost_the_folder_writes_and_deletes_nothing(tmp_path, storage):
    backup_dir = str(tmp_path) if storage == "disk" else f"ram://kd-lock-{os.getpid()}"
    try:
        mine = lock.acquire(backup_dir)
        store.write(backup_dir, [np.zeros(2)], {"variables": [{}]}, owner=mine)
        # Another job takes it over (its LOCK replaces this one's).
        other = foreign(backup_dir, host="elsewhere", job=None)
        with pytest.raises(lock.BackupInUseError, match="no longer this job's"):
            store.write(backup_dir, [np.zeros(2)], {"variables": [{}]}, owner=mine)
        store.remove_all(backup_dir, owner=mine)
        lock.release(backup_dir, mine)
        assert sorted(files.listdir(backup_dir)) == [
            store.CURRENT,
            lock.LOCK_FILE,
            "backup-00000001",
        ]
        assert lock.read_owner(backup_dir) == other
    finally:
        if storage == "ram":
            files.rmtree(backup_dir)
