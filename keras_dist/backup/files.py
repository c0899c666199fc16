"""The backup's file layer: local paths through `os`, URLs through `tf.io.gfile`.

A local path (no scheme, or `file://`) keeps what the store relies on there:
files and folders fsync'd, `os.replace` (an atomic rename), `O_EXCL` (an
exclusive create). A URL (`gs://`, `hdfs://`, `s3://` with tensorflow-io,
`ram://`) goes through TensorFlow's file layer, which promises none of them:
an object store has no rename and no exclusive create, and an object
appears whole only once its upload completes. `store` therefore publishes a
backup differently on each (see there); this module only moves bytes.

Errors are `OSError`s on both (TensorFlow's `NotFoundError` becomes
`FileNotFoundError`, its other errors `OSError`), so callers catch one kind.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import shutil

import tensorflow as tf

_FILE_SCHEME = "file://"
_BLOCK = 1 << 20


def is_local(path: str) -> bool:
    """Whether `path` is on a local (POSIX) file system, not a URL."""
    return "://" not in path or path.startswith(_FILE_SCHEME)


def _local(path: str) -> str:
    return path[len(_FILE_SCHEME) :] if path.startswith(_FILE_SCHEME) else path


def join(base: str, *names: str) -> str:
    """`base/name/...`, with `os.path.join` for local paths."""
    if is_local(base):
        return os.path.join(base, *names)
    return "/".join([base.rstrip("/"), *names])


@contextlib.contextmanager
def _as_os_errors(path: str):
    """TensorFlow's file errors as `OSError`s naming `path`."""
    try:
        yield
    except tf.errors.NotFoundError as error:
        raise FileNotFoundError(errno.ENOENT, error.message, path) from error
    except tf.errors.OpError as error:
        raise OSError(errno.EIO, error.message, path) from error


def listdir(path: str) -> list[str]:
    """The names in folder `path`; `[]` when it does not exist."""
    try:
        if is_local(path):
            return os.listdir(_local(path))
        with _as_os_errors(path):
            # Object stores list "sub-folders" with a trailing slash.
            return [name.rstrip("/") for name in tf.io.gfile.listdir(path)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def exists(path: str) -> bool:
    """Whether a file or folder is at `path`."""
    if is_local(path):
        return os.path.exists(_local(path))
    with _as_os_errors(path):
        return tf.io.gfile.exists(path)


def makedirs(path: str) -> None:
    """Creates folder `path` and its parents, if missing."""
    if is_local(path):
        os.makedirs(_local(path), exist_ok=True)
        return
    with _as_os_errors(path):
        tf.io.gfile.makedirs(path)


def rmtree(path: str) -> None:
    """Removes folder `path` and everything in it; nothing if it is gone."""
    if is_local(path):
        shutil.rmtree(_local(path), ignore_errors=True)
        return
    with contextlib.suppress(FileNotFoundError), _as_os_errors(path):
        tf.io.gfile.rmtree(path)


def remove(path: str) -> None:
    """Removes file `path`; nothing if it is gone."""
    with contextlib.suppress(FileNotFoundError):
        if is_local(path):
            os.remove(_local(path))
            return
        with _as_os_errors(path):
            tf.io.gfile.remove(path)


def remove_empty_folder(path: str) -> None:
    """Removes folder `path` if it is empty (on an object store: a no-op
    once its last object is gone, and harmless otherwise)."""
    if is_local(path):
        with contextlib.suppress(OSError):
            os.rmdir(_local(path))
        return
    if not listdir(path):
        rmtree(path)


def read_bytes(path: str) -> bytes:
    """The whole content of file `path`."""
    if is_local(path):
        with open(_local(path), "rb") as handle:
            return handle.read()
    with _as_os_errors(path), tf.io.gfile.GFile(path, "rb") as handle:
        return handle.read()


def write_bytes(path: str, data: bytes) -> None:
    """Writes `data` to `path` (replacing it); fsync'd on a local disk."""
    with writer(path) as handle:
        handle.write(data)


class HashingWriter:
    """A write-only stream that hashes and counts what goes through it.

    It cannot seek or tell its position to a caller that asks the stream
    (it counts instead), so `zipfile` (under `np.savez`) writes straight
    through, never back: the sha256 of what was written is the file's.
    """

    def __init__(self, handle):
        self._handle = handle
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self._handle.write(data)
        self._digest.update(data)
        size = memoryview(data).nbytes
        self.size += size
        return size

    def tell(self) -> int:
        return self.size

    def seek(self, *args):
        raise io.UnsupportedOperation("seek")

    def seekable(self) -> bool:
        return False

    def read(self, *args):  # `np.savez` takes an object with `read` as a file.
        raise io.UnsupportedOperation("read")

    def flush(self) -> None:
        self._handle.flush()

    @property
    def sha256(self) -> str:
        """The hex sha256 of everything written so far."""
        return self._digest.hexdigest()


@contextlib.contextmanager
def writer(path: str):
    """Opens `path` for writing; yields a `HashingWriter`.

    Local: flushed and fsync'd before the file is closed. URL: the object
    is complete when the block ends (an upload finishes at close). An
    existing one is removed first: object stores replace it anyway, but
    TensorFlow's `ram://` appends to it (TF 2.21). Readers never depend on
    the moment in between (`store` reads only checksummed backups, and
    finds the newest without `CURRENT` too).
    """
    if is_local(path):
        with open(_local(path), "wb") as handle:
            stream = HashingWriter(handle)
            yield stream
            handle.flush()
            os.fsync(handle.fileno())
        return
    remove(path)
    with _as_os_errors(path), tf.io.gfile.GFile(path, "wb") as handle:
        yield HashingWriter(handle)


def sha256_of(path: str) -> str:
    """The hex sha256 of file `path`, read in blocks."""
    digest = hashlib.sha256()
    if is_local(path):
        with open(_local(path), "rb") as handle:
            for block in iter(lambda: handle.read(_BLOCK), b""):
                digest.update(block)
        return digest.hexdigest()
    digest.update(read_bytes(path))
    return digest.hexdigest()


# --- Local only: what object stores do not offer ----------------------------------


def fsync_dir(path: str) -> None:
    """Makes a local folder's entries (renames, new files) durable."""
    try:
        descriptor = os.open(_local(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def replace(source: str, target: str) -> None:
    """Atomically renames `source` to `target` (local paths)."""
    os.replace(_local(source), _local(target))


def create_exclusive(path: str, data: bytes) -> bool:
    """Creates file `path` with `data` unless it exists; returns whether it did.

    Local: `O_EXCL`, so of two processes racing exactly one wins. URL: a
    check, then a write: two writers starting in the same instant may both
    pass (object stores offer no exclusive create through this layer), so
    the caller checks again later (`lock.check_owned` before every save).
    """
    if is_local(path):
        try:
            descriptor = os.open(_local(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        return True
    if exists(path):
        return False
    write_bytes(path, data)
    return True


def free_bytes(path: str) -> int | None:
    """Free bytes on the local disk holding `path`; `None` for a URL."""
    if not is_local(path):
        return None
    path = os.path.abspath(_local(path))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


# What to check when an object store refuses or cannot be reached, by scheme.
_CREDENTIALS = {
    "gs": (
        "Google Cloud credentials: GOOGLE_APPLICATION_CREDENTIALS naming a "
        "service-account key file, or `gcloud auth application-default login` "
        "(on a GCE/GKE machine, the instance's service account and scopes); "
        "that the bucket exists; and that this machine reaches "
        "storage.googleapis.com"
    ),
    "s3": (
        "AWS credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
        "~/.aws/credentials), AWS_REGION, tensorflow-io installed (it serves "
        "s3://), and that the bucket exists"
    ),
    "hdfs": (
        "HADOOP_HDFS_HOME, CLASSPATH (`hadoop classpath --glob`) and that the "
        "namenode in the URL answers"
    ),
}


def unreachable(path: str, argument: str, error: BaseException) -> str:
    """A message for a URL `path` that could not be read or written: the
    argument, the URL, the error's first line and what to check."""
    scheme = path.split("://", 1)[0]
    check = _CREDENTIALS.get(
        scheme, "that the URL is right and TensorFlow has a file system for it"
    )
    detail = str(getattr(error, "message", None) or error).strip().splitlines()
    first = detail[0] if detail else type(error).__name__
    return (
        f"`{argument}` could not be reached: {argument}={path!r}. The object "
        f"store said: {first[:300]}. Check the {check}."
    )
