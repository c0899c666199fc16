"""Backup files: written atomically, read back safely, pruned.

Layout of `backup_dir` (a local folder, or a URL such as `gs://b/run1`):

    CURRENT                 the name of the newest complete backup
    LOCK                    who writes here (`lock`: one job per folder)
    backup-00000007/        state.npz + manifest.json
    backup-00000006/        the previous one, kept until the next is complete
    .partial-*/             a backup being written (local disks only)

`manifest.json` holds the sha256 of `state.npz` and its own (over its other
fields): a backup is trusted only when both match.

How a new backup becomes current without a window where none is usable:

- **Local disk**: written into a `.partial-*` folder, fsync'd, renamed to
  `backup-N` (`os.replace`, atomic), and only then named in `CURRENT`
  (written beside it and renamed over it).
- **URL** (object stores have no rename): written under its own prefix
  `backup-N/` (a number never used before in the folder), state first,
  manifest second, and `CURRENT` overwritten last, a one-line object that
  appears whole or not at all. A process killed in between leaves a
  `backup-N/` without a manifest, or one whose checksums do not match what
  is there: readers skip it.

Readers start from the backup `CURRENT` names and fall back to the newest
other one that checks out, with a warning. A failed write removes what it
had written; a full disk is reported with the room a backup needs.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import re
import uuid

import numpy as np

from keras_dist.backup import files
from keras_dist.backup import lock as lock_lib

logger = logging.getLogger(__name__)

FORMAT = "keras_dist.backup"
# 2: the manifest carries its own checksum, the batch size and the
# accumulation cycle.
FORMAT_VERSION = 2
CURRENT = "CURRENT"
STATE_FILE = "state.npz"
MANIFEST_FILE = "manifest.json"
MANIFEST_CHECKSUM = "manifest_sha256"
_BACKUP_NAME = re.compile(r"^backup-(\d{8})$")
# Complete backups kept: the newest and the one before it (the fallback
# when the newest turns out unreadable). A save needs room for one more.
KEEP = 2
_NO_ROOM = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


class BackupError(ValueError):
    """A backup exists but cannot be used for this run."""


def backup_names(backup_dir: str) -> list[str]:
    """Backup folders (complete or not), newest first."""
    names = files.listdir(backup_dir)
    return sorted((n for n in names if _BACKUP_NAME.match(n)), reverse=True)


def manifest_checksum(manifest: dict) -> str:
    """The sha256 of `manifest`'s fields other than its own checksum."""
    fields = {k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# --- Writing ---------------------------------------------------------------------


def write(backup_dir: str, values: list[np.ndarray], manifest: dict, owner=None) -> str:
    """Writes a complete backup and switches `CURRENT` to it; returns its name.

    Args:
        backup_dir: String. The folder (a local path or a URL).
        values: List of arrays. The state.
        manifest: Dict. What the backup says about itself (JSON).
        owner: `lock.Owner` or `None`. When given, the write first checks
            that `backup_dir` is still this owner's.

    Raises:
        lock.BackupInUseError: `owner` no longer holds `backup_dir`.
        OSError: the write failed (nothing of it is left behind); for a
            full disk the message names `backup_dir` and the room needed.
    """
    files.makedirs(backup_dir)
    if owner is not None:
        lock_lib.check_owned(backup_dir, owner)
    existing = backup_names(backup_dir)
    number = int(_BACKUP_NAME.match(existing[0]).group(1)) + 1 if existing else 1
    name = f"backup-{number:08d}"
    final = files.join(backup_dir, name)
    local = files.is_local(backup_dir)
    folder = files.join(backup_dir, f".partial-{uuid.uuid4().hex}") if local else final
    pointer = files.join(backup_dir, f".{CURRENT}.{uuid.uuid4().hex}")
    published = False
    try:
        files.makedirs(folder)
        _write_backup(folder, values, manifest)
        if local:
            files.fsync_dir(folder)
            files.replace(folder, final)
            files.fsync_dir(backup_dir)
            files.write_bytes(pointer, (name + "\n").encode())
            files.replace(pointer, files.join(backup_dir, CURRENT))
            files.fsync_dir(backup_dir)
        else:
            files.write_bytes(files.join(backup_dir, CURRENT), (name + "\n").encode())
        published = True
    except BaseException as error:
        if not published:
            # Nothing of a backup that never became current may stay: on a
            # full disk it would keep the disk full for every restart.
            for path in (folder, final):
                files.rmtree(path)
            files.remove(pointer)
        if isinstance(error, OSError) and error.errno in _NO_ROOM:
            raise _no_room(backup_dir, values, error) from error
        raise
    prune(backup_dir, keep=name)
    return name


def _write_backup(folder: str, values, manifest: dict) -> None:
    """Writes `state.npz`, then the manifest with both checksums."""
    # Straight to the file, hashed on the way: a second copy of a large
    # model's state in memory would be the peak of the whole save.
    with files.writer(files.join(folder, STATE_FILE)) as handle:
        np.savez(handle, **{f"v{index}": value for index, value in enumerate(values)})
        digest = handle.sha256
    manifest = dict(manifest, sha256=digest)
    manifest[MANIFEST_CHECKSUM] = manifest_checksum(manifest)
    files.write_bytes(
        files.join(folder, MANIFEST_FILE), json.dumps(manifest, indent=1).encode()
    )


def _megabytes(count: int) -> str:
    return f"{count / 1e6:,.1f} MB"


def _no_room(backup_dir: str, values, error: OSError) -> OSError:
    size = sum(int(np.asarray(value).nbytes) for value in values)
    free = files.free_bytes(backup_dir)
    free_text = "" if free is None else f" ({_megabytes(free)} are free now)"
    return OSError(
        error.errno,
        f"No space left to write a backup in backup_dir={backup_dir!r}. A "
        f"backup of this training state takes about {_megabytes(size)}, and "
        f"the folder needs room for about {KEEP + 1} of them "
        f"({_megabytes((KEEP + 1) * size)}: the newest, the previous one kept "
        f"to fall back on, and the one being written){free_text}. The partial "
        "backup was removed. Free space there, or point `backup_dir` at a "
        "larger disk",
    )


def prune(backup_dir: str, keep: str) -> None:
    """Removes abandoned writes and all complete backups but the newest `KEEP`.

    Only the writer that holds `backup_dir` (`lock`) calls it, so every
    `.partial-*` folder is a write its previous holder abandoned.
    """
    complete = [
        n
        for n in backup_names(backup_dir)
        if n != keep and files.exists(files.join(backup_dir, n, MANIFEST_FILE))
    ]
    kept = {keep, *complete[: KEEP - 1]}
    for name in files.listdir(backup_dir):
        path = files.join(backup_dir, name)
        if name.startswith(".partial-") or (
            _BACKUP_NAME.match(name) and name not in kept
        ):
            files.rmtree(path)
        elif name.startswith(f".{CURRENT}."):
            files.remove(path)


# --- Reading ---------------------------------------------------------------------


def _read_one(path: str) -> tuple[dict, list[np.ndarray]]:
    """Reads and verifies one backup folder; raises `BackupError` if unusable."""
    state_path = files.join(path, STATE_FILE)
    try:
        manifest = json.loads(files.read_bytes(files.join(path, MANIFEST_FILE)))
        if not isinstance(manifest, dict):
            raise ValueError("the manifest is not a JSON object")
    except (OSError, ValueError) as error:
        raise BackupError(f"{path} is incomplete or unreadable: {error}") from error
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise BackupError(
            f"{path} is not a keras_dist backup of format version "
            f"{FORMAT_VERSION} (found {manifest.get('format')!r} version "
            f"{manifest.get('version')!r})."
        )
    if manifest.get(MANIFEST_CHECKSUM) != manifest_checksum(manifest):
        raise BackupError(
            f"{path}/{MANIFEST_FILE} is corrupt or was edited (its checksum "
            "differs): a manifest that says where to resume is trusted only "
            "as written."
        )
    try:
        if files.is_local(path):
            digest = files.sha256_of(state_path)
            source = state_path
        else:
            # One read of the remote object: hashed, then parsed from memory.
            data = files.read_bytes(state_path)
            digest = hashlib.sha256(data).hexdigest()
            source = io.BytesIO(data)
    except OSError as error:
        raise BackupError(f"{path} is incomplete or unreadable: {error}") from error
    if digest != manifest.get("sha256"):
        raise BackupError(f"{path}/{STATE_FILE} is corrupt (its sha256 differs).")
    try:
        with np.load(source) as archive:
            values = [archive[f"v{i}"] for i in range(len(manifest["variables"]))]
    except (OSError, ValueError, KeyError) as error:
        raise BackupError(f"{path}/{STATE_FILE} is unreadable: {error}") from error
    return manifest, values


def read_latest(backup_dir: str):
    """Returns `(path, manifest, values)` of the newest usable backup, or `None`.

    `None` means there is nothing to resume from (no backup was ever
    completed). The backup `CURRENT` names comes first; when it is unusable
    the newest other one that checks out is used, with a warning. When
    backups exist but none is usable, raises `BackupError`: the run must not
    start over silently.
    """
    candidates = []
    current = files.join(backup_dir, CURRENT)
    try:
        named = files.read_bytes(current).decode(errors="replace").strip()
    except FileNotFoundError:
        named = None
    except OSError as error:
        logger.warning("Cannot read %s: %s", current, error)
        named = None
    if named:
        candidates.append(named)
    candidates += [n for n in backup_names(backup_dir) if n not in candidates]
    if not candidates:
        return None
    problems = []
    for name in candidates:
        if not _BACKUP_NAME.match(name):
            problems.append(f"{current} names no backup: {name!r}")
            continue
        path = files.join(backup_dir, name)
        try:
            manifest, values = _read_one(path)
        except BackupError as error:
            problems.append(str(error))
            continue
        if problems:
            logger.warning(
                "Falling back to the previous complete backup %s: %s",
                path,
                "; ".join(problems),
            )
        return path, manifest, values
    raise BackupError(
        f"{backup_dir} holds backups, but none is usable: {'; '.join(problems)}. "
        "Training will not start over silently: move the directory away (or "
        "delete it) to start from scratch."
    )


def remove_all(backup_dir: str, owner=None) -> None:
    """Removes every backup, `CURRENT` and `owner`'s `LOCK`; the folder too
    when it is empty.

    With `owner`, nothing is removed unless `backup_dir` is still its own
    (another job's backups are never deleted).
    """
    if owner is not None and not lock_lib.owns(backup_dir, owner):
        logger.warning(
            "BackupAndRestore: not deleting the backups in %s: it is no longer "
            "this job's (%s names another owner).",
            backup_dir,
            lock_lib.LOCK_FILE,
        )
        return
    names = files.listdir(backup_dir)
    if not names and not files.exists(backup_dir):
        return
    for name in names:
        path = files.join(backup_dir, name)
        if name == CURRENT or name.startswith(f".{CURRENT}."):
            files.remove(path)
        elif _BACKUP_NAME.match(name) or name.startswith(".partial-"):
            files.rmtree(path)
    if owner is not None:
        lock_lib.release(backup_dir, owner)
    files.remove_empty_folder(backup_dir)
