"""Writing a backup off the training step: one write at a time, on a thread.

`BackupAndRestore(..., async_write=True)` takes a snapshot of the state on
the step (`backup.transfer.snapshot_values`: variable reads, which the
steps after it do not change, and the all-gather of per-replica state under
several workers) and hands the rest (the NumPy copies, serialising,
hashing, fsync, the switch to the new backup) to this writer, as Orbax's
`AsyncCheckpointer` and PyTorch's `torch.distributed.checkpoint.async_save`
do. The store's atomicity is unchanged (a backup becomes current only when
complete), so a process killed while a write runs leaves the previous
backup current.

At most one write runs: the next save waits for it before gathering, so a
process holds at most one extra copy of the state, and saves more frequent
than writes slow training down to the writes' pace instead of piling up. A
failed write raises in `fit` at the next batch (or save, or the end of
`fit`). The thread is not a daemon: a `fit` that fails after a save still
finishes that write before the process exits.
"""

from __future__ import annotations

import threading


class BackgroundWriter:
    """Runs one callable at a time on a thread; its error comes back later."""

    def __init__(self):
        self._thread = None
        self._error = None

    def submit(self, write, *args, **kwargs) -> None:
        """Starts `write(*args, **kwargs)` on a thread, after the previous one.

        Raises:
            BaseException: the previous write's error (it is not retried).
        """
        self.wait()

        def run():
            try:
                write(*args, **kwargs)
            except BaseException as error:
                self._error = error

        self._thread = threading.Thread(
            target=run, name="keras_dist-backup-writer", daemon=False
        )
        self._thread.start()

    def wait(self) -> None:
        """Waits for the running write; raises its error, if it failed."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raises the error of a write that failed (once), without waiting."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
