"""Backup files: written atomically, read back safely, pruned.

Layout of `backup_dir`:

    CURRENT                 the name of the newest complete backup
    backup-00000007/        state.npz + manifest.json (with state.npz's sha256)
    backup-00000006/        the previous one, kept until the next is complete
    .partial-*/             a backup being written (removed when abandoned)

A backup is written into a `.partial-*` folder, synced, renamed to
`backup-N`, and only then named in `CURRENT` (an atomic `os.replace`), so a
process killed at any point leaves the previous backup usable.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import uuid

import numpy as np

logger = logging.getLogger(__name__)

FORMAT = "keras_dist.backup"
FORMAT_VERSION = 1
CURRENT = "CURRENT"
STATE_FILE = "state.npz"
MANIFEST_FILE = "manifest.json"
_BACKUP_NAME = re.compile(r"^backup-(\d{8})$")
# Complete backups kept: the newest and the one before it (the fallback
# when the newest turns out unreadable).
KEEP = 2


class BackupError(ValueError):
    """A backup exists but cannot be used for this run."""


# --- Files ---------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def backup_names(backup_dir: str) -> list[str]:
    """Complete-looking backup folders, newest first."""
    try:
        names = os.listdir(backup_dir)
    except FileNotFoundError:
        return []
    return sorted((n for n in names if _BACKUP_NAME.match(n)), reverse=True)


def write(backup_dir: str, values: list[np.ndarray], manifest: dict) -> str:
    """Writes a complete backup and switches `CURRENT` to it; returns its name."""
    os.makedirs(backup_dir, exist_ok=True)
    existing = backup_names(backup_dir)
    number = int(_BACKUP_NAME.match(existing[0]).group(1)) + 1 if existing else 1
    name = f"backup-{number:08d}"
    partial = os.path.join(backup_dir, f".partial-{uuid.uuid4().hex}")
    os.makedirs(partial)
    state_path = os.path.join(partial, STATE_FILE)
    # Straight to the file: a second copy of a large model's state in memory
    # would be the peak of the whole save.
    with open(state_path, "wb") as handle:
        np.savez(handle, **{f"v{index}": value for index, value in enumerate(values)})
        handle.flush()
        os.fsync(handle.fileno())
    manifest = dict(manifest, sha256=_sha256_of(state_path))
    _write_file(
        os.path.join(partial, MANIFEST_FILE),
        json.dumps(manifest, indent=1).encode(),
    )
    _fsync_dir(partial)
    os.replace(partial, os.path.join(backup_dir, name))
    _fsync_dir(backup_dir)
    pointer = os.path.join(backup_dir, f".{CURRENT}.{uuid.uuid4().hex}")
    _write_file(pointer, (name + "\n").encode())
    os.replace(pointer, os.path.join(backup_dir, CURRENT))
    _fsync_dir(backup_dir)
    prune(backup_dir, keep=name)
    return name


def prune(backup_dir: str, keep: str) -> None:
    """Removes abandoned partial backups and all but the newest `KEEP`."""
    names = backup_names(backup_dir)
    kept = [keep, *[n for n in names if n != keep][: KEEP - 1]]
    for name in os.listdir(backup_dir):
        path = os.path.join(backup_dir, name)
        if name.startswith(".partial-") or (
            _BACKUP_NAME.match(name) and name not in kept
        ):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(f".{CURRENT}."):
            with contextlib.suppress(OSError):
                os.remove(path)


def _read_one(path: str) -> tuple[dict, list[np.ndarray]]:
    """Reads and verifies one backup folder; raises `BackupError` if unusable."""
    state_path = os.path.join(path, STATE_FILE)
    try:
        with open(os.path.join(path, MANIFEST_FILE), "rb") as handle:
            manifest = json.loads(handle.read())
        digest = _sha256_of(state_path)
    except (OSError, ValueError) as error:
        raise BackupError(f"{path} is incomplete or unreadable: {error}") from error
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise BackupError(
            f"{path} is not a keras_dist backup of format version "
            f"{FORMAT_VERSION} (found {manifest.get('format')!r} version "
            f"{manifest.get('version')!r})."
        )
    if digest != manifest.get("sha256"):
        raise BackupError(f"{path}/{STATE_FILE} is corrupt (its sha256 differs).")
    try:
        with np.load(state_path) as archive:
            values = [archive[f"v{i}"] for i in range(len(manifest["variables"]))]
    except (OSError, ValueError, KeyError) as error:
        raise BackupError(f"{path}/{STATE_FILE} is unreadable: {error}") from error
    return manifest, values


def read_latest(backup_dir: str):
    """Returns `(path, manifest, values)` of the newest usable backup, or `None`.

    `None` means there is nothing to resume from (no backup was ever
    completed). The backup `CURRENT` names comes first; when it is unusable
    the previous complete one is used, with a warning. When backups exist
    but none is usable, raises `BackupError`: the run must not start over
    silently.
    """
    candidates = []
    try:
        with open(os.path.join(backup_dir, CURRENT)) as handle:
            candidates.append(handle.read().strip())
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.warning("Cannot read %s: %s", os.path.join(backup_dir, CURRENT), error)
    candidates += [n for n in backup_names(backup_dir) if n not in candidates]
    if not candidates:
        return None
    problems = []
    for name in candidates:
        path = os.path.join(backup_dir, name)
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


def remove_all(backup_dir: str) -> None:
    """Removes every backup and `CURRENT`; the folder too when it is empty."""
    if not os.path.isdir(backup_dir):
        return
    for name in os.listdir(backup_dir):
        path = os.path.join(backup_dir, name)
        if name == CURRENT or name.startswith(f".{CURRENT}."):
            os.remove(path)
        elif _BACKUP_NAME.match(name) or name.startswith(".partial-"):
            shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(backup_dir)
