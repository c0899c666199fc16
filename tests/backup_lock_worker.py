"""One training job for `tests/test_backup_lock.py`: a real, separate process.

    python tests/backup_lock_worker.py BACKUP_DIR [--batch-seconds S]
        [--hold-until FILE]

Trains a small Keras model (one device) for 2 epochs of 12 batches with
`BackupAndRestore(BACKUP_DIR, save_freq=1)`, sleeping S seconds after each
batch, and after the second until FILE exists, so that another job can start
meanwhile. Prints `saved N` after each
batch, `resumed` when it resumed from a backup, and exits 0 when training
ended, 3 when the backup folder was refused (`BackupInUseError`).
"""

import argparse
import logging
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

from keras_dist.backup.lock import BackupInUseError
from keras_dist.callbacks import BackupAndRestore


class Slow(keras.callbacks.Callback):
    def __init__(self, seconds, hold_until=None):
        super().__init__()
        self.seconds, self.hold_until, self.batches = seconds, hold_until, 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        print(f"saved {self.batches}", flush=True)
        time.sleep(self.seconds)
        deadline = time.monotonic() + 300
        # From the second batch: a batch's backup is written when the next
        # batch begins (after every callback has seen the batch).
        while (
            self.hold_until
            and self.batches >= 2
            and not os.path.exists(self.hold_until)
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.hold_until} did not appear in 300 s")
            time.sleep(0.1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("backup_dir")
    parser.add_argument("--batch-seconds", type=float, default=0.0)
    parser.add_argument("--hold-until", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    backup = BackupAndRestore(args.backup_dir, save_freq=1)
    try:
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[backup, Slow(args.batch_seconds, args.hold_until)],
        )
    except BackupInUseError as error:
        print(f"refused: {error}", flush=True)
        return 3
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
