"""A training script for the elastic tests (tests/test_elastic_workers.py).

Run as every task of `keras-dist launch --workers N|MIN:MAX [--discover
CMD] [--max-restarts R] -- python tests/elastic_worker.py OUT BACKUP
--accumulation K [--hook fp16|topk] [--die ATTEMPT:BATCH:SLOTS:SLOTS_FILE]`.

It trains tests/elastic_model.py's model for 3 epochs on arrays, 8
examples per replica per step (`batch_size = 8 x replicas`), with
`GradientAccumulationOptimizer(accumulation_steps=K)` and
`BackupAndRestore(save_freq=3)`. The chief writes the final weights,
`iterations`, `accumulation_steps`, the loss history and how often each
example was trained on to OUT.

`--die ATTEMPT:BATCH:SLOTS:FILE`: on that attempt (`KERAS_DIST_RESTART`),
the last worker writes SLOTS into FILE (what `--discover "cat FILE"` reads:
its machine is gone) and SIGKILLs itself after its BATCH-th batch.
"""

import argparse
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
from elastic_model import PER_REPLICA, data, make_model, seen, write_result

import keras_dist
from keras_dist.compression import FP16, TopK
from keras_dist.core.topology import count_workers


class Die(keras.callbacks.Callback):
    """Takes this worker's machine away after its N-th batch."""

    def __init__(self, at, slots, slots_file):
        super().__init__()
        self.at, self.slots, self.slots_file, self.seen = at, slots, slots_file, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen != self.at:
            return
        with open(self.slots_file, "w") as handle:
            handle.write(f"{self.slots}\n")
        print(f"losing my machine after batch {self.seen}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("backup")
    parser.add_argument("--accumulation", type=int, required=True)
    parser.add_argument("--hook", choices=["fp16", "topk"])
    parser.add_argument("--die")
    args = parser.parse_args()
    strategy = keras_dist.auto_strategy()
    workers = count_workers(strategy)
    task = os.environ.get("KERAS_DIST_TASK", "worker:0")
    hook = {"fp16": FP16, "topk": lambda: TopK(0.25), None: lambda: None}[args.hook]
    model = make_model(strategy, args.accumulation, hook=hook())
    callbacks = [keras_dist.callbacks.BackupAndRestore(args.backup, save_freq=3)]
    if args.die:
        attempt, at, slots, slots_file = args.die.split(":")
        if attempt == os.environ.get("KERAS_DIST_RESTART", "0") and task == (
            f"worker:{workers - 1}"
        ):
            callbacks.append(Die(int(at), slots, slots_file))
    x, y = data()
    history = model.fit(
        x,
        y,
        batch_size=PER_REPLICA * strategy.num_replicas_in_sync,
        epochs=3,
        shuffle=False,
        callbacks=callbacks,
        verbose=0,
    )
    counts = seen(model, strategy)  # a collective: every worker
    if strategy.extended.should_checkpoint:
        write_result(args.out, model, counts, workers, history)
    print("done", flush=True)


if __name__ == "__main__":
    main()
