"""A training script for tests/test_sharding_fault_tolerance.py.

Run as every task of `keras-dist launch --workers 2 [--max-restarts N] --
python tests/sharding_fault_worker.py OUT BACKUP [options]`. It trains a
small regression model with `DistributedModel`, sharded Adam with
accumulation and `BackupAndRestore(save_freq=4)`; `--config` picks the
accumulation:

- `stage2`: `ShardedOptimizer(Adam, accumulation_steps=2)` (micro-step
  gradients reduce-scattered into slice accumulators);
- `stage1`: `GradientAccumulationOptimizer(ShardedOptimizer(Adam), 2)`
  (full-size local accumulators, sharded update);
- `owned`: `GradientAccumulationOptimizer(ShardedOptimizer(Adam,
  shard_by="variables"), 2)` (each worker keeps its own variables' Adam
  state, outside the strategy's variables).

The chief writes its final weights and a summary to OUT/CONFIG. Several
`--config`s train one after the other in the same processes (the
uninterrupted references). `--hurt ATTEMPT:kill:N` SIGKILLs worker 1 after
its N-th batch of that attempt (`KERAS_DIST_RESTART`).
"""

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import keras_dist

FEATURES = 16
EXAMPLES = 192
GLOBAL_BATCH = 16
EPOCHS = 3
ACCUMULATION = 2
SAVE_FREQ = 4
CONFIGS = ("stage2", "stage1", "owned")


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, 1)).astype("float32")
    y = (x @ w + 8.0 * rng.normal(size=(EXAMPLES, 1))).astype("float32")
    return x, y


def build(config, sharded=True):
    """The compiled model; `sharded=False`: the one-device reference."""
    keras.utils.set_random_seed(1)
    model = keras_dist.DistributedModel.from_model(
        keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
    )
    adam = keras.optimizers.Adam(0.01)
    if not sharded:
        optimizer = keras_dist.GradientAccumulationOptimizer(adam, ACCUMULATION)
    elif config == "stage2":
        optimizer = keras_dist.ShardedOptimizer(adam, accumulation_steps=ACCUMULATION)
    else:
        shard_by = "variables" if config == "owned" else "elements"
        optimizer = keras_dist.GradientAccumulationOptimizer(
            keras_dist.ShardedOptimizer(adam, shard_by=shard_by), ACCUMULATION
        )
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model


class Kill(keras.callbacks.Callback):
    """SIGKILLs this worker after its N-th batch of this attempt."""

    def __init__(self, at):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            print("hurting myself: kill", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("backup")
    parser.add_argument("--config", action="append", choices=CONFIGS, default=[])
    parser.add_argument("--hurt", action="append", default=[])
    args = parser.parse_args()
    attempt = os.environ.get("KERAS_DIST_RESTART", "0")
    kills = [
        int(n)
        for at, what, n in (h.split(":") for h in args.hurt)
        if at == attempt and what == "kill"
    ]
    strategy = keras_dist.auto_strategy()
    for config in args.config or ["stage2"]:
        train(strategy, config, args.out, args.backup, kills)
    print("done", flush=True)
    return 0


def train(strategy, config, out, backup, kills):
    with strategy.scope():
        model = build(config)
    callbacks = [
        keras_dist.callbacks.BackupAndRestore(os.path.join(backup, config), SAVE_FREQ)
    ]
    if os.environ.get("KERAS_DIST_TASK") == "worker:1":
        callbacks += [Kill(n) for n in kills]
    x, y = data()
    history = model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH,
        epochs=EPOCHS,
        shuffle=False,
        callbacks=callbacks,
        verbose=0,
    )
    if not strategy.extended.should_checkpoint:
        return
    sharded = next(
        o
        for o in (model.optimizer, getattr(model.optimizer, "inner_optimizer", None))
        if isinstance(o, keras_dist.ShardedOptimizer)
    )
    out = os.path.join(out, config)
    os.makedirs(out, exist_ok=True)
    np.savez(
        os.path.join(out, "weights.npz"),
        *[np.asarray(w) for w in model.get_weights()],
    )
    summary = {
        "history": history.history,
        "iterations": int(model.optimizer.iterations.numpy()),
        "replicas": strategy.num_replicas_in_sync,
    }
    if sharded.shard_by == "variables":
        # The owners of the variables, and the shapes of this worker's state.
        summary["owners"] = list(sharded._owned.layout.owners)
        summary["owned_here"] = sorted(sharded._owned.optimizers)
    else:
        slot = sharded.inner_optimizer.variables[-1]
        summary["slot_shape"] = [
            list(c.shape) for c in strategy.experimental_local_results(slot.value)
        ]
    with open(os.path.join(out, "summary.json"), "w") as handle:
        json.dump(summary, handle)


if __name__ == "__main__":
    sys.exit(main())
