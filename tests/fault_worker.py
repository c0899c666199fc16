"""A training script for the fault-tolerance tests (tests/test_fault_tolerance.py).

Run as every task of `keras-dist launch --workers 2 [--max-restarts N] --
python tests/fault_worker.py OUT BACKUP [options]`. It trains a small
regression model with `DistributedModel`, a compression hook (`--config`:
`fp16`, `powersgd`, `autoscale`: FP16 with an adaptive `AutoScaleBatch`, or
`diloco`: FP16 with `DiLoCoOptimizer(Adam, sync_every=5)` syncing in FP16),
`GradientAccumulationOptimizer(accumulation_steps=2)` and
`BackupAndRestore(save_freq=4)`; the chief writes its final weights and
history to OUT/CONFIG. Several `--config`s train one after the other in the
same processes (the uninterrupted references).

`--hurt ATTEMPT:WHAT:N` (repeatable) hurts a task on that attempt
(`KERAS_DIST_RESTART`) after its N-th batch: `kill` SIGKILLs worker 1,
`term` sends SIGTERM to worker 1, `stop` sends it SIGSTOP (frozen, its
heartbeats too), `stop0` sends SIGSTOP to worker 0 (which hosts the
coordination service), `hang` makes worker 1 sleep (alive, but gone from the
collectives), `save` SIGKILLs the chief inside its N-th backup
(after the state file is written, before the switch to it; with
`--async-write` on the callback's writer thread).
"""

import argparse
import json
import os
import signal
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import keras_dist
from keras_dist.backup import store as _backup
from keras_dist.compression import FP16, PowerSGD

FEATURES = 16
EXAMPLES = 192
GLOBAL_BATCH = 16


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, 1)).astype("float32")
    y = (x @ w + 8.0 * rng.normal(size=(EXAMPLES, 1))).astype("float32")
    return x, y


class Hurt(keras.callbacks.Callback):
    """Hurts this worker after its N-th batch of this attempt."""

    def __init__(self, at, what):
        super().__init__()
        self.at, self.what, self.seen = at, what, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen != self.at:
            return
        print(f"hurting myself: {self.what}", flush=True)
        if self.what == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.what == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.what == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(600)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("backup")
    parser.add_argument("--config", action="append", default=[])
    parser.add_argument("--hurt", action="append", default=[])
    parser.add_argument("--stock", action="store_true")
    parser.add_argument("--async-write", action="store_true")
    args = parser.parse_args()
    attempt = os.environ.get("KERAS_DIST_RESTART", "0")
    hurts = [h.split(":") for h in args.hurt if h.split(":")[0] == attempt]
    strategy = keras_dist.auto_strategy()
    if args.stock:
        return stock_callbacks(strategy, args.out, args.backup)
    for config in args.config or ["fp16"]:
        train(strategy, config, args.out, args.backup, hurts, args.async_write)
    print("done", flush=True)
    return 0


def train(strategy, config, out, backup, hurts, async_write=False):
    task = os.environ.get("KERAS_DIST_TASK", "")
    autoscale = config == "autoscale"
    epochs = 4 if autoscale else 3
    keras.utils.set_random_seed(1)
    with strategy.scope():
        hook = PowerSGD(rank=1, start_step=0) if config == "powersgd" else FP16()
        model = keras_dist.DistributedModel.from_model(
            keras.Sequential(
                [
                    keras.Input((FEATURES,)),
                    keras.layers.Dense(8, activation="relu"),
                    keras.layers.Dense(1),
                ]
            ),
            all_reduce_hook=hook,
        )
        inner = keras.optimizers.Adam(0.01)
        if config == "diloco":
            # 6 updates an epoch: a window of 5, then the epoch's end.
            inner = keras_dist.DiLoCoOptimizer(inner, 5, sync_hook=FP16())
        model.compile(
            optimizer=keras_dist.GradientAccumulationOptimizer(
                inner, accumulation_steps=2
            ),
            loss="mse",
            metrics=["mae"],
        )
    callbacks = [
        keras_dist.callbacks.BackupAndRestore(
            os.path.join(backup, config), 4, async_write=async_write
        )
    ]
    if autoscale:
        callbacks.append(
            keras_dist.callbacks.AutoScaleBatch(
                GLOBAL_BATCH // strategy.num_replicas_in_sync,
                adaptive=True,
                max_batch_size=4 * GLOBAL_BATCH,
                adapt_every=2,
                ema_decay=0.5,
                lr_scaling="sqrt",
            )
        )
    for _, what, n in hurts:
        if what in ("kill", "term", "stop", "hang") and task == "worker:1":
            callbacks.append(Hurt(int(n), what))
        if what == "stop0" and task == "worker:0":
            callbacks.append(Hurt(int(n), "stop"))
        if what == "save" and task == "worker:0":
            die_inside_backup(int(n))
    x, y = data()
    fit_kwargs = {} if autoscale else {"batch_size": GLOBAL_BATCH}
    history = model.fit(
        x,
        y,
        epochs=epochs,
        shuffle=False,
        callbacks=callbacks,
        verbose=0,
        **fit_kwargs,
    )
    if strategy.extended.should_checkpoint:
        out = os.path.join(out, config)
        os.makedirs(out, exist_ok=True)
        np.savez(
            os.path.join(out, "weights.npz"),
            *[np.asarray(w) for w in model.get_weights()],
        )
        summary = {
            "history": history.history,
            "iterations": int(model.optimizer.iterations.numpy()),
            "accumulation_steps": model.optimizer.accumulation_steps,
        }
        with open(os.path.join(out, "summary.json"), "w") as handle:
            json.dump(summary, handle)


def die_inside_backup(at):
    """SIGKILLs this process inside its `at`-th backup, before the switch."""
    write, saves = _backup.write, []
    replace = os.replace

    def write_then_die(*args, **kwargs):
        saves.append(1)
        if len(saves) == at:
            os.replace = replace_then_die
        return write(*args, **kwargs)

    def replace_then_die(source, target):
        if os.path.basename(source).startswith(".partial-"):
            thread = threading.current_thread().name
            print(f"killed inside the save on {thread}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return replace(source, target)

    _backup.write = write_then_die


def stock_callbacks(strategy, out, backup):
    """Keras's own BackupAndRestore and ModelCheckpoint, on every worker."""
    with strategy.scope():
        model = keras_dist.DistributedModel.from_model(
            keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
        )
        model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    checkpoint = os.path.join(out, "model.weights.h5")
    model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH,
        epochs=2,
        verbose=0,
        callbacks=[
            keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False),
            keras.callbacks.ModelCheckpoint(checkpoint, save_weights_only=True),
        ],
    )
    print("stock done", sorted(os.listdir(backup)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
