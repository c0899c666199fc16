"""A long training script for the soak tests (tests/test_soak.py).

Run as every task of `keras-dist launch --workers 2 [--ps 1 --chief] --
python tests/soak_worker.py OUT PHASE:STEPS [PHASE:STEPS ...]`. Each task
samples its threads, open file descriptors and resident memory every
second (`keras_dist.testing.ResourceSampler`) into
OUT/<task>.jsonl, labelled with the phase and the step. The training tasks
train the phases one after the other in the same process, each a fresh
`DistributedModel` (a notebook trains several models in one process), for
STEPS tiny steps of one `fit` epoch:

- `plain`: no hook; `fp16`: `FP16()`; `powersgd`: `PowerSGD(rank=1)`;
- `backup`: `BackupAndRestore(async_write=True, save_freq=25)` writing to
  OUT/backup;
- `ps`: under parameter servers (the chief coordinates; the workers and the
  ps task only serve, and are sampled all the same).

The chief (or worker:0) writes OUT/done when every phase ended: the backend
that carried the sums (`gloo`, `tensorflow` or `parameter servers`).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf

import keras_dist
from keras_dist.compression import FP16, PowerSGD
from keras_dist.core import gloo

FEATURES = 4
BATCH = 8


class Steps(keras.callbacks.Callback):
    """Puts the phase's step into the sampler's labels."""

    def __init__(self, sampler, phase):
        super().__init__()
        self.sampler, self.phase = sampler, phase

    def on_train_batch_end(self, batch, logs=None):
        self.sampler.labels = {"phase": self.phase, "step": batch + 1}


def train(strategy, phase, steps, out, sampler):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * BATCH, FEATURES)).astype("float32")
    y = x.sum(axis=1, keepdims=True).astype("float32")
    hooks = {"fp16": FP16, "powersgd": lambda: PowerSGD(rank=1, start_step=0)}
    with strategy.scope():
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        hook = hooks[phase]() if phase in hooks else None
        model = keras_dist.DistributedModel(
            inputs, keras.layers.Dense(1)(hidden), all_reduce_hook=hook
        )
        model.compile(keras.optimizers.SGD(0.01), "mse")
    callbacks = [Steps(sampler, phase)]
    if phase == "backup":
        callbacks.append(
            keras_dist.callbacks.BackupAndRestore(
                os.path.join(out, "backup"), save_freq=25, async_write=True
            )
        )
    sampler.labels = {"phase": phase, "step": 0}
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=callbacks)
    # The phase's last sample: the steps it ran.
    sampler.labels = {"phase": phase, "step": int(model.optimizer.iterations.numpy())}
    sampler.sample()


def main():
    out = sys.argv[1]
    phases = [(p.split(":")[0], int(p.split(":")[1])) for p in sys.argv[2:]]
    task = os.environ.get("KERAS_DIST_TASK", "worker:0")
    sampler = keras_dist.testing.ResourceSampler(
        os.path.join(out, task.replace(":", "-") + ".jsonl"), interval=1.0
    )
    sampler.labels = {"phase": "start", "step": 0}
    sampler.start()
    # On a parameter-server cluster's worker and ps tasks this serves until
    # the launcher stops the task; the sampler goes on meanwhile.
    strategy = keras_dist.auto_strategy()
    for phase, steps in phases:
        train(strategy, phase, steps, out, sampler)
    sampler.stop()
    if task in ("chief:0", "worker:0"):
        # What carried the sums, for the test to check.
        backend = "parameter servers"
        if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            backend = gloo.choose(strategy).backend
        with open(os.path.join(out, "done"), "w") as handle:
            handle.write(f"{backend}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
