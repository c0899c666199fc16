"""The backup store (`keras_dist.backup.store`), in one process, no training.

Atomic writes and the `CURRENT` pointer, falling back to the previous backup
when the newest is corrupt, truncated, missing or edited (the manifest's own
checksum), the refusal when none is usable, pruning and `remove_all`; on a
local disk and on TensorFlow's in-memory file system (`ram://`, which like an
object store is written through `tf.io.gfile` without renames): a torn write
there (the pointer written, the state missing or truncated) falls back. A
failed write leaves nothing behind; a full disk (a real tmpfs) says where and
how much room a backup needs. `BackupAndRestore` resuming a run (and being
killed inside a save) is in `test_fault_tolerance.py`; the lock in
`test_backup_lock.py`.
"""

import contextlib
import errno
import hashlib
import json
import os
import shutil
import subprocess
import uuid

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist.backup import files, store
from keras_dist.backup.store import BackupError


class Killed(Exception):
    """The process dies here (raised from a patched function)."""


@pytest.fixture(params=["disk", "ram"])
def folder(request, tmp_path):
    """A backup folder (not created yet) on a local disk or on `ram://`."""
    if request.param == "disk":
        yield str(tmp_path / "b")
        return
    root = f"ram://kd-store-{uuid.uuid4().hex}"
    yield f"{root}/b"
    files.rmtree(root)


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


def path(folder, *names):
    return files.join(str(folder), *names)


def put(target, data):
    files.write_bytes(target, data.encode() if isinstance(data, str) else data)


def get(target):
    return files.read_bytes(target)


def current(folder):
    return get(path(folder, store.CURRENT)).decode().strip()


def listing(folder):
    return sorted(files.listdir(str(folder)))


def edit_manifest(backup, **changes):
    target = path(backup, store.MANIFEST_FILE)
    put(target, json.dumps({**json.loads(get(target)), **changes}))


# --- Writing ------------------------------------------------------------------


def test_write_makes_a_complete_backup_and_points_current_at_it(folder):
    values = [
        np.arange(6, dtype="float32").reshape(2, 3),
        np.array(7, "int64"),
        np.array([True, False]),
        np.ones((2, 2), "float16"),
    ]
    name = store.write(folder, values, manifest(4, epoch=3))  # creates the folder
    assert name == "backup-00000001"
    assert listing(folder) == [store.CURRENT, name]
    assert current(folder) == name
    assert listing(path(folder, name)) == [store.MANIFEST_FILE, store.STATE_FILE]
    written = json.loads(get(path(folder, name, store.MANIFEST_FILE)))
    state = get(path(folder, name, store.STATE_FILE))
    expected = {**manifest(4, epoch=3), "sha256": hashlib.sha256(state).hexdigest()}
    assert written == {**expected, "manifest_sha256": store.manifest_checksum(expected)}
    found, read_manifest, read_values = store.read_latest(folder)
    assert found == path(folder, name)
    assert read_manifest == written
    for got, want in zip(read_values, values, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_each_write_takes_the_next_number(folder):
    names = [write(folder, np.full(2, i)) for i in range(3)]
    assert names == ["backup-00000001", "backup-00000002", "backup-00000003"]
    assert current(folder) == "backup-00000003"
    _, _, (value,) = store.read_latest(folder)
    np.testing.assert_array_equal(value, [2, 2])


def test_a_write_killed_before_the_rename_leaves_the_previous_backup(
    tmp_path, monkeypatch
):
    write(tmp_path, np.ones(2))

    def killed(source, target):
        raise Killed

    monkeypatch.setattr(store.files, "replace", killed)
    monkeypatch.setattr(store.files, "rmtree", lambda target: None)  # a real kill
    with pytest.raises(Killed):
        write(tmp_path, np.full(2, 5.0))
    monkeypatch.undo()
    # The half-written backup stays a `.partial-*` folder, never a backup.
    partials = [n for n in listing(tmp_path) if n.startswith(".partial-")]
    assert len(partials) == 1
    assert store.backup_names(str(tmp_path)) == ["backup-00000001"]
    found, _, (value,) = store.read_latest(str(tmp_path))
    assert found.endswith("backup-00000001")
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

    monkeypatch.setattr(store.files.os, "replace", killed_at_the_second)
    monkeypatch.setattr(store.files, "rmtree", lambda target: None)
    monkeypatch.setattr(store.files, "remove", lambda target: None)
    with pytest.raises(Killed):
        write(tmp_path, np.full(2, 5.0))
    monkeypatch.undo()
    assert calls[-1] == str(tmp_path / store.CURRENT)
    assert store.backup_names(str(tmp_path)) == ["backup-00000002", "backup-00000001"]
    assert current(tmp_path) == "backup-00000001"
    found, _, (value,) = store.read_latest(str(tmp_path))
    assert found.endswith("backup-00000001")
    np.testing.assert_array_equal(value, np.ones(2))
    # The pointer being written is left over; the next write cleans it up.
    assert any(n.startswith(f".{store.CURRENT}.") for n in listing(tmp_path))
    assert write(tmp_path) == "backup-00000003"
    assert listing(tmp_path) == [store.CURRENT, "backup-00000002", "backup-00000003"]


def test_on_an_object_store_the_backup_is_written_in_place_and_the_pointer_last(
    monkeypatch,
):
    # No `.partial-*` folder and no rename: the state, then the manifest,
    # under the backup's own prefix, then CURRENT.
    folder = f"ram://kd-store-{uuid.uuid4().hex}"
    written = []
    writer = store.files.writer

    def recording_writer(target):
        written.append(target)
        return writer(target)

    monkeypatch.setattr(store.files, "writer", recording_writer)
    monkeypatch.setattr(
        store.files, "replace", lambda *args: pytest.fail("renamed on ram://")
    )
    try:
        write(folder)
        assert [t[len(folder) + 1 :] for t in written] == [
            f"backup-00000001/{store.STATE_FILE}",
            f"backup-00000001/{store.MANIFEST_FILE}",
            store.CURRENT,
        ]
    finally:
        files.rmtree(folder)


@pytest.mark.parametrize("torn", ["state missing", "state truncated"])
def test_a_torn_write_on_an_object_store_falls_back(caplog, torn):
    # The pointer was written, but the state under it is not all there (an
    # upload that never finished, a store that lost it).
    folder = f"ram://kd-store-{uuid.uuid4().hex}"
    try:
        write(folder, np.full(3, 1.0), step=1)
        write(folder, np.full(3, 2.0), step=2)
        state = path(folder, "backup-00000002", store.STATE_FILE)
        if torn == "state missing":
            files.remove(state)
        else:
            put(state, get(state)[:100])
        assert current(folder) == "backup-00000002"
        with caplog.at_level("WARNING", logger="keras_dist.backup.store"):
            found, read_manifest, (value,) = store.read_latest(folder)
        assert found == path(folder, "backup-00000001")
        assert read_manifest["step"] == 1
        np.testing.assert_array_equal(value, np.full(3, 1.0))
        assert "Falling back to the previous complete backup" in caplog.text
    finally:
        files.rmtree(folder)


def test_an_abandoned_write_on_an_object_store_is_skipped_then_pruned():
    # Killed after the state, before the manifest and the pointer.
    folder = f"ram://kd-store-{uuid.uuid4().hex}"
    try:
        write(folder, np.full(3, 1.0))
        files.makedirs(path(folder, "backup-00000002"))
        put(path(folder, "backup-00000002", store.STATE_FILE), b"half a state")
        found, _, _ = store.read_latest(folder)
        assert found == path(folder, "backup-00000001")
        # Its number is never reused; the next complete write prunes it.
        assert write(folder) == "backup-00000003"
        assert listing(folder) == [store.CURRENT, "backup-00000001", "backup-00000003"]
    finally:
        files.rmtree(folder)


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_a_failed_write_leaves_nothing_behind(folder, monkeypatch, code):
    write(folder, np.ones(2))

    def failing_savez(handle, **arrays):
        handle.write(b"the first bytes")
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(store.np, "savez", failing_savez)
    with pytest.raises(OSError) as raised:
        write(folder, np.ones(1000))
    monkeypatch.undo()
    assert raised.value.errno == code
    if code == errno.ENOSPC:
        assert f"backup_dir={folder!r}" in str(raised.value)
        assert "room for about 3 of them (0.0 MB" in str(raised.value)
    assert listing(folder) == [store.CURRENT, "backup-00000001"]
    assert store.read_latest(folder)[0] == path(folder, "backup-00000001")


@contextlib.contextmanager
def tmpfs(mount_point, size):
    """A real tmpfs of `size` at `mount_point` (root only), unmounted after."""
    os.makedirs(mount_point, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield str(mount_point)
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_a_full_disk_names_the_folder_and_the_room_a_backup_needs(tmp_path):
    # A real file system of 1 MiB: one backup of 0.6 MB fits, the second
    # (written beside the first) does not.
    with tmpfs(tmp_path / "disk", "1m") as disk:
        folder = os.path.join(disk, "backup")
        value = np.zeros(150_000, "float32")
        write(folder, value)
        with pytest.raises(OSError) as raised:
            write(folder, value)
        message = str(raised.value)
        assert raised.value.errno == errno.ENOSPC
        assert f"No space left to write a backup in backup_dir={folder!r}" in message
        assert "about 0.6 MB" in message and "room for about 3 of them" in message
        assert "are free now" in message
        # The partial write is gone, so a restart finds the disk as it was.
        assert listing(folder) == [store.CURRENT, "backup-00000001"]
        assert store.read_latest(folder)[0].endswith("backup-00000001")
        assert shutil.disk_usage(disk).free > 400_000


# --- Reading back: the previous backup when the newest is unusable ------------


def two_backups(folder):
    write(folder, np.full(3, 1.0), step=1)
    write(folder, np.full(3, 2.0), step=2)
    return path(folder, "backup-00000002")


def assert_fell_back(folder, caplog, problem):
    with caplog.at_level("WARNING", logger="keras_dist.backup.store"):
        found, read_manifest, (value,) = store.read_latest(folder)
    assert found == path(folder, "backup-00000001")
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
    assert store.read_latest(f"ram://kd-store-{uuid.uuid4().hex}") is None


def test_a_corrupt_newest_backup_falls_back_to_the_previous(folder, caplog):
    state = path(two_backups(folder), store.STATE_FILE)
    data = get(state)
    put(state, data[:-10] + bytes(b ^ 0xFF for b in data[-10:]))
    assert_fell_back(
        folder, caplog, "backup-00000002/state.npz is corrupt (its sha256 differs)"
    )


def test_a_truncated_newest_backup_falls_back_to_the_previous(folder, caplog):
    state = path(two_backups(folder), store.STATE_FILE)
    put(state, get(state)[:100])
    assert_fell_back(folder, caplog, "backup-00000002/state.npz is corrupt")


@pytest.mark.parametrize("missing", [store.STATE_FILE, store.MANIFEST_FILE])
def test_a_newest_backup_missing_a_file_falls_back(folder, caplog, missing):
    files.remove(path(two_backups(folder), missing))
    assert_fell_back(folder, caplog, "backup-00000002 is incomplete or unreadable")


def test_a_newest_backup_that_is_gone_falls_back(folder, caplog):
    # CURRENT names a folder that is gone: the previous one is used.
    files.rmtree(two_backups(folder))
    assert current(folder) == "backup-00000002"
    assert_fell_back(folder, caplog, "backup-00000002 is incomplete or unreadable")


def test_a_newest_backup_of_another_format_falls_back(folder, caplog):
    edit_manifest(two_backups(folder), version=99)
    assert_fell_back(folder, caplog, "format version 2 (found 'keras_dist.backup'")


@pytest.mark.parametrize(
    "changes",
    [{"epoch": 1}, {"step": 3}, {"sha256": "0" * 64}],
    ids=["epoch", "step", "state-checksum"],
)
def test_an_edited_manifest_falls_back(folder, caplog, changes):
    # Issue 31 W2: "epoch": 0 edited to 1 resumed at the wrong place.
    newest = two_backups(folder)
    edit_manifest(newest, epoch=0)  # as written: epoch 0...
    edit_manifest(newest, **changes)  # ...then edited by hand
    assert_fell_back(
        folder, caplog, "backup-00000002/manifest.json is corrupt or was edited"
    )


def test_a_manifest_listing_more_values_than_the_state_holds_falls_back(folder, caplog):
    two_backups(folder)
    # Written whole (the checksums match), but it lists two variables.
    store.write(folder, [np.zeros(3)], manifest(2))
    with caplog.at_level("WARNING", logger="keras_dist.backup.store"):
        found, _, _ = store.read_latest(folder)
    assert found == path(folder, "backup-00000002")
    assert "backup-00000003/state.npz is unreadable" in caplog.text


def test_without_current_the_newest_complete_backup_is_read(folder):
    two_backups(folder)
    files.remove(path(folder, store.CURRENT))
    found, read_manifest, _ = store.read_latest(folder)
    assert found == path(folder, "backup-00000002")
    assert read_manifest["step"] == 2


def test_current_comes_first_even_when_a_newer_backup_exists(folder):
    two_backups(folder)
    put(path(folder, store.CURRENT), "backup-00000001\n")
    found, _, _ = store.read_latest(folder)
    assert found == path(folder, "backup-00000001")


def test_a_garbled_current_falls_back_to_the_newest(folder, caplog):
    two_backups(folder)
    put(path(folder, store.CURRENT), b"backup-000\xff")
    with caplog.at_level("WARNING", logger="keras_dist.backup.store"):
        found, _, _ = store.read_latest(folder)
    assert found == path(folder, "backup-00000002")
    assert "names no backup" in caplog.text


def test_no_usable_backup_is_refused_not_a_fresh_start(folder):
    two_backups(folder)
    for name in store.backup_names(folder):
        put(path(folder, name, store.MANIFEST_FILE), "{not json")
    with pytest.raises(BackupError, match=r"none is usable.*will not start over"):
        store.read_latest(folder)
    # Both problems are named; BackupError is a ValueError.
    with pytest.raises(ValueError) as raised:
        store.read_latest(folder)
    assert "backup-00000001 is incomplete" in str(raised.value)
    assert "backup-00000002 is incomplete" in str(raised.value)


def test_current_naming_nothing_usable_is_refused(folder):
    files.makedirs(folder)
    put(path(folder, store.CURRENT), "backup-00000009\n")
    with pytest.raises(BackupError, match="none is usable"):
        store.read_latest(folder)


# --- Pruning and removing -----------------------------------------------------


def test_backup_names_are_the_backup_folders_newest_first(tmp_path):
    for name in ["backup-00000002", "backup-00000010", "backup-1", ".partial-x"]:
        (tmp_path / name).mkdir()
    (tmp_path / "backup-000000011").mkdir()  # nine digits: not ours
    (tmp_path / "notes.txt").write_text("")
    assert store.backup_names(str(tmp_path)) == ["backup-00000010", "backup-00000002"]
    assert store.backup_names(str(tmp_path / "missing")) == []


def test_backup_keeps_two_and_removes_partials(tmp_path):
    folder = str(tmp_path)
    os.makedirs(tmp_path / ".partial-old")
    for _ in range(4):
        write(folder)
    assert sorted(os.listdir(folder)) == [
        store.CURRENT,
        "backup-00000003",
        "backup-00000004",
    ]
    found, _, _ = store.read_latest(folder)
    assert found.endswith("backup-00000004")
    shutil.rmtree(tmp_path / "backup-00000004")
    # CURRENT names a folder that is gone: the previous one is used.
    assert store.read_latest(folder)[0].endswith("backup-00000003")


def test_prune_keeps_the_named_backup_and_the_newest_complete_other(folder):
    for _ in range(3):
        write(folder)
    # Backups that never got their manifest (killed while being written).
    files.makedirs(path(folder, "backup-00000004"))
    files.makedirs(path(folder, ".partial-abc"))
    put(path(folder, f".{store.CURRENT}.abc"), "backup-00000003\n")
    put(path(folder, "notes.txt"), "mine")
    store.prune(folder, keep="backup-00000002")
    assert listing(folder) == [
        store.CURRENT,
        "backup-00000002",
        "backup-00000003",
        "notes.txt",
    ]


def test_remove_all_removes_every_backup_and_the_empty_folder(folder):
    for _ in range(2):
        write(folder)
    files.makedirs(path(folder, ".partial-abc"))
    put(path(folder, f".{store.CURRENT}.abc"), "")
    store.remove_all(folder)
    assert not files.exists(folder)
    store.remove_all(folder)  # nothing there: nothing to do


def test_remove_all_leaves_what_is_not_a_backup(folder):
    write(folder)
    put(path(folder, "notes.txt"), "mine")
    files.makedirs(path(folder, "backup-1"))
    store.remove_all(folder)
    assert listing(folder) == ["backup-1", "notes.txt"]


def test_an_unreachable_object_store_names_backup_dir_and_credentials():
    # Without credentials (or a network) a gs:// folder fails at once; the
    # error names the argument, the URL and what to check, not only
    # libcurl's line.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse")
    x = np.zeros((16, 4), "float32")
    url = "gs://keras-dist-no-such-bucket-for-tests/run1"
    with pytest.raises(BackupError) as raised:
        model.fit(
            x,
            x[:, :1],
            batch_size=8,
            verbose=0,
            callbacks=[keras_dist.callbacks.BackupAndRestore(url)],
        )
    message = str(raised.value)
    assert message.startswith(f"`backup_dir` could not be reached: backup_dir='{url}'")
    assert "GOOGLE_APPLICATION_CREDENTIALS" in message
