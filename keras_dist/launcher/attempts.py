"""What the tasks of one attempt tell the launcher, through a folder.

`keras-dist launch` gives every attempt a folder (`KERAS_DIST_RUN_DIR` in
each task's environment) that holds the tasks' log files and two notes the
tasks write there for the launcher:

- `<task>.started`: the task trained its first step (`DistributedModel.fit`
  writes it). A task that fails before, twice with the same error, fails
  the same way every time: the launcher stops instead of restarting.
- `backup.json`: where the chief's `BackupAndRestore` wrote its last backup
  (folder, epoch, batches into it), so that the launcher's report says what
  a restart resumes from.

Both are best-effort: a task that cannot write them trains on.

Like the rest of the launcher, this module imports neither TensorFlow nor
Keras.
"""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger(__name__)

RUN_DIR_ENV_VAR = "KERAS_DIST_RUN_DIR"
TASK_ENV_VAR = "KERAS_DIST_TASK"
_BACKUP_NOTE = "backup.json"


def run_dir(environ=None) -> str | None:
    """This task's attempt folder (`None` when not under the launcher)."""
    value = (os.environ if environ is None else environ).get(RUN_DIR_ENV_VAR, "")
    return value.strip() or None


def _task_file(name: str, suffix: str) -> str:
    return name.replace(":", "-") + suffix


def mark_started() -> None:
    """Notes that this task trained a step (once; a no-op off the launcher)."""
    folder, task = run_dir(), os.environ.get(TASK_ENV_VAR, "").strip()
    if folder is None or not task:
        return
    path = os.path.join(folder, _task_file(task, ".started"))
    if os.path.exists(path):
        return
    try:
        with open(path, "w") as handle:
            handle.write("started\n")
    except OSError as error:
        logger.debug("keras_dist: could not write %s: %s", path, error)


def note_backup(path: str, epoch: int, batches: int) -> None:
    """Notes the backup just written (a no-op off the launcher)."""
    folder = run_dir()
    if folder is None:
        return
    note = os.path.join(folder, _BACKUP_NOTE)
    try:
        with open(note + ".tmp", "w") as handle:
            json.dump({"path": path, "epoch": epoch, "batches": batches}, handle)
        os.replace(note + ".tmp", note)
    except OSError as error:
        logger.debug("keras_dist: could not write %s: %s", note, error)


def started_tasks(folder: str) -> set:
    """The tasks of an attempt that trained a step."""
    try:
        names = os.listdir(folder)
    except OSError:
        return set()
    return {
        name[: -len(".started")].replace("-", ":", 1)
        for name in names
        if name.endswith(".started")
    }


def last_backup(folder: str) -> dict | None:
    """The chief's last backup of an attempt (`path`, `epoch`, `batches`)."""
    try:
        with open(os.path.join(folder, _BACKUP_NOTE)) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def describe_backup(note: dict | None) -> str:
    """What a restart resumes from, in words."""
    if note is None:
        return "from the start (no backup written)"
    where = f"epoch {note['epoch'] + 1}"
    if note.get("batches"):
        where += f", {note['batches']} batches into it"
    return f"from the backup of {where} ({note['path']})"
