"""The demo's fault act: a worker is SIGKILLed mid-epoch, the job goes on.

`keras-dist demo` ends with it: `keras-dist launch --workers 2
--max-restarts 1` runs this module's `worker` as two processes, which
train a small MLP on the digits with `BackupAndRestore`; on the first
attempt worker:1 kills itself (SIGKILL) in the middle of epoch 2. The
launcher reports the loss and starts the job again; both workers resume
from the last backup, and the chief writes its final weights. The act then
trains the same model, uninterrupted, on one device in this process, and
prints how far apart the two runs' weights are (float rounding: the
replicas' sums run in another order).

`python -m keras_dist._demo_fault worker OUT` is what each task runs.
"""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import sys
import tempfile
import time

EPOCHS = 3
GLOBAL_BATCH = 64
SAVE_FREQ = 5
# The first attempt's worker:1 dies after this batch of epoch 2.
KILL_AFTER_BATCH = 8
# What the act shows of the launch: the launcher's own lines and the
# workers' lines about the backup (the rest is in the logs).
_SHOWN = ("keras-dist:", "BackupAndRestore: resumed")


@dataclasses.dataclass
class ActResult:
    """What the act shows: the launch's lines, the weights' difference."""

    status: int
    lines: list
    max_difference: float | None
    seconds: float


def _data():
    from sklearn.datasets import load_digits

    digits = load_digits()
    # 1,792 examples: whole batches of 64 (32 per worker).
    x = (digits.data[:1792] / 16.0).astype("float32")
    y = digits.target[:1792].astype("int32")
    return x, y


def _model(keras, keras_dist):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(10)(hidden))
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def worker(out: str) -> int:
    """One task of the act's job (under `keras-dist launch`)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import keras_dist

    strategy = keras_dist.auto_strategy()
    task = os.environ.get("KERAS_DIST_TASK", "")
    first_attempt = os.environ.get("KERAS_DIST_RESTART", "0") == "0"

    class KillMe(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 1 and batch + 1 == KILL_AFTER_BATCH:
                print("killing myself (SIGKILL) in epoch 2", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    with strategy.scope():
        model = _model(keras, keras_dist)
    callbacks = [
        keras_dist.callbacks.BackupAndRestore(
            os.path.join(out, "backup"), save_freq=SAVE_FREQ
        )
    ]
    if first_attempt and task == "worker:1":
        callbacks.append(KillMe())
    x, y = _data()
    model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=2,
        callbacks=callbacks,
    )
    if task == "worker:0":
        np.savez(os.path.join(out, "weights.npz"), *model.get_weights())
    return 0


def run_act() -> ActResult:
    """Runs the act; returns what it shows."""
    import numpy as np

    from keras_dist.launcher import launch
    from keras_dist.launcher.process import env_with_package

    start = time.perf_counter()
    out = tempfile.mkdtemp(prefix="keras_dist_demo_fault_")
    stdout, stderr = io.StringIO(), io.StringIO()
    env = env_with_package(os.environ)
    env.pop("TF_CONFIG", None)
    status = launch(
        [sys.executable, "-m", "keras_dist._demo_fault", "worker", out],
        workers=2,
        max_restarts=1,
        environ=env,
        stdout=stdout,
        stderr=stderr,
        log_dir=os.path.join(out, "logs"),
    )
    text = stdout.getvalue() + stderr.getvalue()
    lines = [line for line in _in_order(stdout, stderr) if _shown(line)]
    difference = None
    weights_file = os.path.join(out, "weights.npz")
    if status == 0 and os.path.exists(weights_file):
        with np.load(weights_file) as archive:
            resumed = [archive[name] for name in archive.files]
        reference = _uninterrupted()
        difference = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(resumed, reference, strict=True)
        )
    elif status != 0:
        lines.append(text[-2000:])
    return ActResult(status, lines, difference, time.perf_counter() - start)


def _in_order(stdout, stderr):
    # The launcher's lines and the tasks' lines went to two streams; each
    # is in order, which is all the act shows.
    return stderr.getvalue().splitlines() + stdout.getvalue().splitlines()


def _shown(line: str) -> bool:
    return any(marker in line for marker in _SHOWN)


def _uninterrupted():
    """The same training on one device, without a fault."""
    import keras
    import tensorflow as tf

    import keras_dist

    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        model = _model(keras, keras_dist)
    x, y = _data()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        sys.exit(worker(sys.argv[2]))
    print("usage: python -m keras_dist._demo_fault worker OUT", file=sys.stderr)
    sys.exit(2)
