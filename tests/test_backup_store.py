"""The backup store (`keras_dist.backup.store`), in one process, no training.

Atomic writes and the `CURRENT` pointer, falling back to the previous backup
when the newest is corrupt, truncated or missing, the refusal when none is
usable, pruning and `remove_all`. `BackupAndRestore` resuming a run (and being
killed inside a save) is in `test_fault_tolerance.py`.
"""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from keras_dist.backup import store
from keras_dist.backup.store import BackupError


class Killed(Exception):
    """The process dies here (raised from a patched `os.replace`)."""


def manifest(count=1, **extra):
    return {
        "format": store.FORMAT,
        "version": store.FORMAT_VERSION,
        "variables": [{}] * count,
        **extra,
    }


def write(folder, *values, **extra):
    """Writes a backup of `values` (default: one array) into `folder`."""
    values = list(values) or [np.zeros(2)]
    return store.write(str(folder), values, manifest(len(values), **extra))


def current(folder):
    return (folder / store.CURRENT).read_text().strip()


def listing(folder):
    return sorted(os.listdir(folder))


# --- Writing ------------------------------------------------------------------


def test_write_makes_a_complete_backup_and_points_current_at_it(tmp_path):
    values = [
        np.arange(6, dtype="float32").reshape(2, 3),
        np.array(7, "int64"),
        np.array([True, False]),
        np.ones((2, 2), "float16"),
    ]
    folder = tmp_path / "b"  # created by the first write
    name = store.write(str(folder), values, manifest(4, epoch=3))
    assert name == "backup-00000001"
    assert listing(folder) == [store.CURRENT, name]
    assert current(folder) == name
    assert listing(folder / name) == [store.MANIFEST_FILE, store.STATE_FILE]
    written = json.loads((folder / name / store.MANIFEST_FILE).read_text())
    state = (folder / name / store.STATE_FILE).read_bytes()
    assert written == {
        **manifest(4, epoch=3),
        "sha256": hashlib.sha256(state).hexdigest(),
    }
    path, read_manifest, read_values = store.read_latest(str(folder))
    assert path == str(folder / name)
    assert read_manifest == written
    for got, want in zip(read_values, values, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_each_write_takes_the_next_number(tmp_path):
    names = [write(tmp_path, np.full(2, i)) for i in range(3)]
    assert names == ["backup-00000001", "backup-00000002", "backup-00000003"]
    assert current(tmp_path) == "backup-00000003"
    _, _, (value,) = store.read_latest(str(tmp_path))
    np.testing.assert_array_equal(value, [2, 2])


def test_a_write_killed_before_the_rename_leaves_the_previous_backup(
    tmp_path, monkeypatch
):
    write(tmp_path, np.ones(2))

    def killed(source, target):
        raise Killed

    monkeypatch.setattr(store.os, "replace", killed)
    with pytest.raises(Killed):
        write(tmp_path, np.full(2, 5.0))
    monkeypatch.undo()
    # The half-written backup stays a `.partial-*` folder, never a backup.
    partials = [n for n in listing(tmp_path) if n.startswith(".partial-")]
    assert len(partials) == 1
    assert store.backup_names(str(tmp_path)) == ["backup-00000001"]
    path, _, (value,) = store.read_latest(str(tmp_path))
    assert path.endswith("backup-00000001")
    np.testing.assert_array_equal(value, np.ones(2))
    # The next complete write removes the abandoned one.
    assert write(tmp_path) == "backup-00000002"
    assert not [n for n in listing(tmp_path) if n.startswith(".")]


def test_a_write_killed_before_current_moves_resumes_from_what_current_names(
    tmp_path, monkeypatch
):
    # The new backup is complete but CURRENT was not switched to it: CURRENT
    # decides (the backup it names was the last one finished everywhere).
    write(tmp_path, np.ones(2))
    replace = os.replace
    calls = []

    def killed_at_the_second(source, target):
        calls.append(target)
        if len(calls) == 2:
            raise Killed
        replace(source, target)

    monkeypatch.setattr(store.os, "replace", killed_at_the_second)
    with pytest.raises(Killed):
        write(tmp_path, np.full(2, 5.0))
    monkeypatch.undo()
    assert calls[-1] == str(tmp_path / store.CURRENT)
    assert store.backup_names(str(tmp_path)) == ["backup-00000002", "backup-00000001"]
    assert current(tmp_path) == "backup-00000001"
    path, _, (value,) = store.read_latest(str(tmp_path))
    assert path.endswith("backup-00000001")
    np.testing.assert_array_equal(value, np.ones(2))
    # The pointer being written is left over; the next write cleans it up.
    assert any(n.startswith(f".{store.CURRENT}.") for n in listing(tmp_path))
    assert write(tmp_path) == "backup-00000003"
    assert listing(tmp_path) == [store.CURRENT, "backup-00000002", "backup-00000003"]


# --- Reading back: the previous backup when the newest is unusable ------------


def two_backups(tmp_path):
    write(tmp_path, np.full(3, 1.0), step=1)
    write(tmp_path, np.full(3, 2.0), step=2)
    return tmp_path / "backup-00000002"


def assert_fell_back(tmp_path, caplog, problem):
    with caplog.at_level("WARNING", logger="keras_dist.backup.store"):
        path, read_manifest, (value,) = store.read_latest(str(tmp_path))
    assert path == str(tmp_path / "backup-00000001")
    assert read_manifest["step"] == 1
    np.testing.assert_array_equal(value, np.full(3, 1.0))
    assert "Falling back to the previous complete backup" in caplog.text
    assert problem in caplog.text


def test_nothing_to_resume_from_is_none(tmp_path):
    assert store.read_latest(str(tmp_path / "missing")) is None
    assert store.read_latest(str(tmp_path)) is None
    # Killed during the very first save: nothing was ever completed.
    (tmp_path / ".partial-1234").mkdir()
    (tmp_path / ".partial-1234" / store.STATE_FILE).write_bytes(b"half")
    assert store.read_latest(str(tmp_path)) is None


def test_a_corrupt_newest_backup_falls_back_to_the_previous(tmp_path, caplog):
    state = two_backups(tmp_path) / store.STATE_FILE
    data = state.read_bytes()
    state.write_bytes(data[:-10] + bytes(b ^ 0xFF for b in data[-10:]))
    assert_fell_back(
        tmp_path, caplog, "backup-00000002/state.npz is corrupt (its sha256 differs)"
    )


def test_a_truncated_newest_backup_falls_back_to_the_previous(tmp_path, caplog):
    state = two_backups(tmp_path) / store.STATE_FILE
    state.write_bytes(state.read_bytes()[:100])
    assert_fell_back(tmp_path, caplog, "backup-00000002/state.npz is corrupt")


@pytest.mark.parametrize("missing", [store.STATE_FILE, store.MANIFEST_FILE])
def test_a_newest_backup_missing_a_file_falls_back(tmp_path, caplog, missing):
    (two_backups(tmp_path) / missing).unlink()
    assert_fell_back(tmp_path, caplog, "backup-00000002 is incomplete or unreadable")


def test_a_newest_backup_that_is_gone_falls_back(tmp_path, caplog):
    # CURRENT names a folder that is gone: the previous one is used.
    shutil.rmtree(two_backups(tmp_path))
    assert current(tmp_path) == "backup-00000002"
    assert_fell_back(tmp_path, caplog, "backup-00000002 is incomplete or unreadable")


def test_a_newest_backup_of_another_format_falls_back(tmp_path, caplog):
    newest = two_backups(tmp_path) / store.MANIFEST_FILE
    newest.write_text(json.dumps({**json.loads(newest.read_text()), "version": 99}))
    assert_fell_back(tmp_path, caplog, "format version 1 (found 'keras_dist.backup'")


def test_a_manifest_listing_more_values_than_the_state_holds_falls_back(
    tmp_path, caplog
):
    two_backups(tmp_path)
    # Written whole (the checksum matches), but it lists two variables.
    store.write(str(tmp_path), [np.zeros(3)], manifest(2))
    with caplog.at_level("WARNING", logger="keras_dist.backup.store"):
        path, _, _ = store.read_latest(str(tmp_path))
    assert path == str(tmp_path / "backup-00000002")
    assert "backup-00000003/state.npz is unreadable" in caplog.text


def test_without_current_the_newest_complete_backup_is_read(tmp_path):
    two_backups(tmp_path)
    (tmp_path / store.CURRENT).unlink()
    path, read_manifest, _ = store.read_latest(str(tmp_path))
    assert path == str(tmp_path / "backup-00000002")
    assert read_manifest["step"] == 2


def test_current_comes_first_even_when_a_newer_backup_exists(tmp_path):
    two_backups(tmp_path)
    (tmp_path / store.CURRENT).write_text("backup-00000001\n")
    path, _, _ = store.read_latest(str(tmp_path))
    assert path == str(tmp_path / "backup-00000001")


def test_no_usable_backup_is_refused_not_a_fresh_start(tmp_path):
    two_backups(tmp_path)
    for name in store.backup_names(str(tmp_path)):
        (tmp_path / name / store.MANIFEST_FILE).write_text("{not json")
    with pytest.raises(BackupError, match=r"none is usable.*will not start over"):
        store.read_latest(str(tmp_path))
    # Both problems are named; BackupError is a ValueError.
    with pytest.raises(ValueError) as raised:
        store.read_latest(str(tmp_path))
    assert "backup-00000001 is incomplete" in str(raised.value)
    assert "backup-00000002 is incomplete" in str(raised.value)


def test_current_naming_nothing_usable_is_refused(tmp_path):
    (tmp_path / store.CURRENT).write_text("backup-00000009\n")
    with pytest.raises(BackupError, match="none is usable"):
        store.read_latest(str(tmp_path))


# --- Pruning and removing -----------------------------------------------------


def test_backup_names_are_the_complete_looking_folders_newest_first(tmp_path):
    for name in ["backup-00000002", "backup-00000010", "backup-1", ".partial-x"]:
        (tmp_path / name).mkdir()
    (tmp_path / "backup-000000011").mkdir()  # nine digits: not ours
    (tmp_path / "notes.txt").write_text("")
    assert store.backup_names(str(tmp_path)) == ["backup-00000010", "backup-00000002"]
    assert store.backup_names(str(tmp_path / "missing")) == []


def test_backup_keeps_two_and_removes_partials(tmp_path):
    # Moved from test_fault_tolerance.py.
    folder = str(tmp_path)
    os.makedirs(tmp_path / ".partial-old")
    manifest = {"format": store.FORMAT, "version": store.FORMAT_VERSION}
    for _ in range(4):
        store.write(folder, [np.zeros(2)], {**manifest, "variables": [{}]})
    assert sorted(os.listdir(folder)) == [
        store.CURRENT,
        "backup-00000003",
        "backup-00000004",
    ]
    path, _, _ = store.read_latest(folder)
    assert path.endswith("backup-00000004")
    shutil.rmtree(tmp_path / "backup-00000004")
    # CURRENT names a folder that is gone: the previous one is used.
    assert store.read_latest(folder)[0].endswith("backup-00000003")


def test_prune_keeps_the_named_backup_and_the_newest_other(tmp_path):
    for _ in range(3):
        write(tmp_path)
    (tmp_path / "backup-00000001").mkdir()
    (tmp_path / "backup-00000004").mkdir()
    (tmp_path / ".partial-abc").mkdir()
    (tmp_path / f".{store.CURRENT}.abc").write_text("backup-00000003\n")
    (tmp_path / "notes.txt").write_text("mine")
    store.prune(str(tmp_path), keep="backup-00000002")
    assert listing(tmp_path) == [
        store.CURRENT,
        "backup-00000002",
        "backup-00000004",
        "notes.txt",
    ]


def test_remove_all_removes_every_backup_and_the_empty_folder(tmp_path):
    folder = tmp_path / "b"
    for _ in range(2):
        write(folder)
    (folder / ".partial-abc").mkdir()
    (folder / f".{store.CURRENT}.abc").write_text("")
    store.remove_all(str(folder))
    assert not folder.exists()
    store.remove_all(str(folder))  # nothing there: nothing to do


def test_remove_all_leaves_what_is_not_a_backup(tmp_path):
    write(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "backup-1").mkdir()
    store.remove_all(str(tmp_path))
    assert listing(tmp_path) == ["backup-1", "notes.txt"]
