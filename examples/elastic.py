"""Elastic training: lose a worker, go on with the others from the backup.

Shows: `keras-dist launch --workers MIN:MAX --discover CMD` restarting a
job on the workers still available after one is lost, and
`keras_dist.callbacks.BackupAndRestore` resuming the larger job's backup on
the smaller job: the same samples, the same global batch per update
(`accumulation_steps` grows to hold it), the same learning rate.

    echo 3 > /tmp/slots
    keras-dist launch --workers 2:3 --discover "cat /tmp/slots" \\
        --max-restarts 2 -- python examples/elastic.py --lose-a-worker /tmp/slots

`--lose-a-worker FILE` plays the lost machine: on the first attempt the
last worker writes 2 into FILE (what `--discover` reads: one slot fewer)
and kills itself with SIGKILL in epoch 2. On a real cluster, the discovery
command asks the scheduler what is left (`scontrol show hostnames`, a
Kubernetes label query, a cloud API), and `backup_dir` is on shared storage.
"""

import argparse
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PER_REPLICA_BATCH = 16
UPDATE_BATCH = 96


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--backup-dir", default="/tmp/keras_dist_elastic")
    parser.add_argument("--lose-a-worker", metavar="SLOTS_FILE")
    args = parser.parse_args(argv)
    if not os.environ.get("TF_CONFIG"):
        print(
            "No TF_CONFIG: start this script through the launcher, e.g.\n"
            "  keras-dist launch --workers 2:3 -- python examples/elastic.py",
            file=sys.stderr,
        )
        return 2

    import keras
    from sklearn.datasets import load_digits

    import keras_dist

    strategy = keras_dist.auto_strategy()
    replicas = strategy.num_replicas_in_sync
    attempt = os.environ.get("KERAS_DIST_RESTART", "0")
    print(f"training on {replicas} replicas (attempt {attempt})")
    digits = load_digits()
    # 1536 examples: whole batches on 1, 2, 3 or 6 workers.
    x = (digits.data[:1536] / 16.0).astype("float32")
    y = digits.target[:1536].astype("int32")

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras_dist.DistributedModel.from_model(
            keras.Sequential(
                [
                    keras.Input((64,)),
                    keras.layers.Dense(128, activation="relu"),
                    keras.layers.Dense(10),
                ]
            )
        )
        # Written for the size this job starts with; a resumed job on another
        # size gets the value that holds UPDATE_BATCH (one log line).
        steps = max(1, UPDATE_BATCH // (PER_REPLICA_BATCH * replicas))
        model.compile(
            optimizer=keras_dist.GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.05, momentum=0.9), accumulation_steps=steps
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    callbacks = [keras_dist.callbacks.BackupAndRestore(args.backup_dir, save_freq=6)]
    if args.lose_a_worker and attempt == "0":
        task = os.environ.get("KERAS_DIST_TASK", "")
        if task == f"worker:{int(os.environ.get('KERAS_DIST_WORKERS', '1')) - 1}":
            callbacks.append(lose_this_worker(args.lose_a_worker, after=40))
    history = model.fit(
        x,
        y,
        batch_size=PER_REPLICA_BATCH * replicas,
        epochs=args.epochs,
        shuffle=False,
        callbacks=callbacks,
        verbose=0,
    )
    print(
        f"done on {replicas} replicas: accumulation_steps="
        f"{model.optimizer.accumulation_steps}, updates="
        f"{int(model.optimizer.iterations.numpy())}, final loss "
        f"{history.history['loss'][-1]:.4f}, accuracy "
        f"{history.history['accuracy'][-1]:.3f}"
    )
    return 0


def lose_this_worker(slots_file, after):
    """A callback that plays a lost machine: one slot fewer, then SIGKILL."""
    import keras

    class LoseThisWorker(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches = 0

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1
            if self.batches != after:
                return
            with open(slots_file) as handle:
                slots = int(handle.read())
            with open(slots_file, "w") as handle:
                handle.write(f"{slots - 1}\n")
            print(f"losing this worker's machine after {after} batches", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    return LoseThisWorker()


if __name__ == "__main__":
    sys.exit(main())
