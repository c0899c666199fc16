"""The README's fifteen-line script as a job for any engine, unchanged.

The same file runs on one device, under the keras_dist launcher, as the tasks
of a SLURM job step and as the replicas of a Kubernetes TFJob:
`keras_dist.auto_strategy()` reads what the engine set (`TF_CONFIG` or the
`SLURM_*` variables) and builds the strategy. `examples/ray_train.py` runs
`train` as Ray Train's per-worker loop.

    python examples/train.py                                    # one device
    keras-dist launch --workers 2 -- python examples/train.py   # 2 processes
    srun --ntasks=2 python examples/train.py                    # SLURM
    python examples/train.py --out weights/  # + weights-<task>.npz per task
    python examples/train.py --backup-dir /shared/backups   # resumable

With `--out`, every task writes its final weights and its history to
`<out>/weights-<task>.npz` and `<out>/history-<task>.json` (`<task>` is
`worker-1` for worker 1, `single` without a cluster), so the runs can be
compared: every task of a cluster ends with the weights of the one-device run.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def train(epochs=10, callbacks=(), seed=0, hook="fp16"):
    """The README's fifteen lines, seeded; returns (model, strategy, history).

    The seed makes every run start from the same weights and see the batches
    in the same order, so a cluster run can be compared with one device.
    `hook="none"` swaps the README's `FP16` for `NoCompression`: FP16 rounds
    each worker's gradient, so only an uncompressed cluster run can equal
    one device to float32 precision (with FP16: to about 1e-4).
    """
    import keras
    from sklearn.datasets import load_digits

    import keras_dist

    hooks = {
        "fp16": keras_dist.compression.FP16,
        "none": keras_dist.compression.NoCompression,
    }
    keras.utils.set_random_seed(seed)
    # fmt: off
    x, y = load_digits(return_X_y=True)
    strategy = keras_dist.auto_strategy()  # from TF_CONFIG, SLURM or the devices
    with strategy.scope():
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(128, activation="relu")(inputs)
        model = keras_dist.DistributedModel(  # was: keras.Model
            inputs, keras.layers.Dense(10)(hidden),
            all_reduce_hook=hooks[hook]())  # FP16: half the bytes on the wire
        optimizer = keras_dist.GradientAccumulationOptimizer(  # update every 4 batches
            keras.optimizers.Adam(1e-3, global_clipnorm=1.0), accumulation_steps=4)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer, loss, metrics=["accuracy"])
    history = model.fit(x / 16, y, batch_size=32, epochs=epochs,
                        callbacks=list(callbacks), verbose=2)
    # fmt: on
    return model, strategy, history


def task_name(strategy):
    """`"worker-1"` for task 1 of a cluster, `"single"` without one."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return "single"
    return f"{resolver.task_type}-{resolver.task_id}"


def save(out, model, strategy, history):
    """Writes this task's weights and history under `out`; returns the name."""
    import numpy as np

    name = task_name(strategy)
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, f"weights-{name}.npz"), *model.get_weights())
    logs = {key: [float(v) for v in values] for key, values in history.history.items()}
    with open(os.path.join(out, f"history-{name}.json"), "w") as handle:
        json.dump(logs, handle)
    return name


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hook", choices=("fp16", "none"), default="fp16")
    parser.add_argument(
        "--out", help="folder for weights-<task>.npz and history-<task>.json"
    )
    parser.add_argument(
        "--backup-dir",
        help="BackupAndRestore's folder (shared by every task): a restarted "
        "job resumes where the last backup was written",
    )
    args = parser.parse_args(argv)
    callbacks = []
    if args.backup_dir:
        import keras_dist

        callbacks.append(keras_dist.callbacks.BackupAndRestore(args.backup_dir))
    model, strategy, history = train(
        args.epochs, callbacks=callbacks, seed=args.seed, hook=args.hook
    )
    if args.out:
        name = save(args.out, model, strategy, history)
        print(f"{name}: weights written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
