"""Ray Train: the README's fifteen-line script as `TensorflowTrainer`'s loop.

Ray Train's `TensorflowTrainer` starts one Ray actor per worker and sets
`TF_CONFIG` in each; `keras_dist.auto_strategy()` (inside `train`, from
`examples/train.py`, unchanged) then builds a `MultiWorkerMirroredStrategy`
and `DistributedModel.fit` trains across the workers. Every epoch's logs
(`loss`, `accuracy`, `compression_ratio`) go to `ray.train.report`, so they
show up in Ray's `Result`.

    pip install ".[ray]"                                # in the keras_dist clone
    python examples/ray_train.py                        # a local Ray, 2 workers
    python examples/ray_train.py --max-failures 1 --backup-dir gs://bucket/run1
    python examples/ray_train.py --max-failures 1 --backup-dir /shared/backups
    RAY_ADDRESS=auto python examples/ray_train.py --workers 4   # a running cluster
    RAY_ADDRESS=auto python examples/ray_train.py --workers 2:4 \
        --max-failures 3 --backup-dir gs://bucket/run1          # elastic

With `--max-failures N` Ray restarts the whole worker group when a worker
dies, up to N times. With `--backup-dir` (an object store URL such as
`gs://bucket/run1`, the first choice, or a folder every Ray node can read)
`keras_dist.callbacks.BackupAndRestore` makes the new group resume from the
last backup (every epoch); without it the new group trains from the first
epoch again, and the epochs done before the failure are lost time.

Elastic: `--workers MIN:MAX` gives Ray Train
`ScalingConfig(num_workers=(MIN, MAX))` (Train v2's elastic scaling). Ray
starts as many workers as the cluster's nodes hold, up to MAX (one CPU
each). A lost node is a worker-group failure (counted by `--max-failures`):
Ray restarts the group with as many workers as the nodes left hold, or
waits while that is below MIN. While the group is healthy, Ray looks for
more resources every `ScalingConfig.elastic_resize_monitor_interval_s`
(its default, 60 s, is kept here) and restarts the group larger when it
finds them. With `--backup-dir`, a new group of another size resumes the
backup through `BackupAndRestore`'s elastic resume: state resharded, data
position kept, one log line (`BackupAndRestore: elastic resume: 3
worker(s) / 3 replica(s) -> 2 / 2; global batch per step 32 -> 32, per
update 128 -> 128 (accumulation_steps=4).`). `examples/train.py` passes
`batch_size=32` to `fit`, the *global* batch under a distribution strategy
(tf.distribute splits it over the replicas), so a step is 32 samples on any
number of workers: the update batch (32 x `accumulation_steps=4` = 128) is
held as it is, and neither `accumulation_steps` nor the learning rate
changes; only each worker's share of a step does. A group of one worker
(`DefaultStrategy`) resumes a backup of several too, and the other way
round. A local Ray (no `RAY_ADDRESS`) is one node with MAX
CPUs, so the group is always MAX there; it shrinks on a cluster that loses
a node (tests/test_ray.py removes one of three).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

EXAMPLES = os.path.dirname(os.path.abspath(__file__))


def train_loop_per_worker(config):
    """Runs on every Ray worker: `examples/train.py`'s `train`, reported."""
    import tempfile

    import keras
    import ray.train
    import train as script  # examples/train.py, on PYTHONPATH (runtime_env)

    class Report(keras.callbacks.Callback):
        """Hands every epoch's logs to `ray.train.report`."""

        def on_epoch_end(self, epoch, logs=None):
            metrics = {"epoch": epoch + 1}
            metrics.update({key: float(value) for key, value in logs.items()})
            # Every worker saves: reading the weights under
            # MultiWorkerMirroredStrategy may take part in a collective. Ray
            # hands the driver only metrics that come with a checkpoint, so
            # rank 0 reports its weights as one; every worker reports (the
            # call is a barrier).
            with tempfile.TemporaryDirectory() as folder:
                self.model.save_weights(os.path.join(folder, "model.weights.h5"))
                checkpoint = None
                if ray.train.get_context().get_world_rank() == 0:
                    checkpoint = ray.train.Checkpoint.from_directory(folder)
                ray.train.report(metrics, checkpoint)

    callbacks = [Report()]
    if config["backup_dir"]:
        # Ray restarts the whole group; every worker reads the backup.
        import keras_dist

        callbacks.insert(0, keras_dist.callbacks.BackupAndRestore(config["backup_dir"]))
    model, strategy, history = script.train(
        config["epochs"], callbacks=callbacks, hook=config["hook"]
    )
    if config["out"]:
        script.save(config["out"], model, strategy, history)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers",
        type=_workers,
        default=2,
        metavar="N|MIN:MAX",
        help="N workers, or MIN:MAX for Ray's elastic scaling (default: 2)",
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--hook", choices=("fp16", "none"), default="fp16")
    parser.add_argument("--max-failures", type=int, default=0)
    parser.add_argument(
        "--out", help="folder for every worker's weights-<task>.npz and history"
    )
    parser.add_argument(
        "--storage", help="Ray Train's storage_path (default: ~/ray_results)"
    )
    parser.add_argument(
        "--backup-dir",
        help="BackupAndRestore's folder or object store URL (gs://...), "
        "readable by every Ray node: a restarted group resumes where the last "
        "backup was written",
    )
    args = parser.parse_args(argv)
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    # The workers import `train` from this folder.
    runtime_env = {"env_vars": {"PYTHONPATH": _pythonpath()}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=runtime_env)
    else:
        # A local Ray with no dashboard: one CPU per worker (MAX of them when
        # elastic), nothing more.
        ray.init(
            num_cpus=_max_workers(args.workers),
            include_dashboard=False,
            runtime_env=runtime_env,
        )
    trainer = TensorflowTrainer(
        train_loop_per_worker,
        train_loop_config={
            "epochs": args.epochs,
            "hook": args.hook,
            "out": os.path.abspath(args.out) if args.out else None,
            "backup_dir": _absolute(args.backup_dir),
        },
        # An int: a fixed group; a (MIN, MAX) tuple: Ray Train v2's elastic
        # group, sized to the resources the cluster has at every (re)start.
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(
            storage_path=_absolute(args.storage),
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    )
    result = trainer.fit()
    reports = [_plain(row) for row in result.metrics_dataframe.to_dict("records")]
    for row in reports:
        print(f"ray.train.report: {json.dumps(row, sort_keys=True)}")
    print(f"last checkpoint: {result.checkpoint.path}")
    if args.out:
        with open(os.path.join(args.out, "reports.json"), "w") as handle:
            json.dump(reports, handle)
    return 0


def _workers(text):
    """`--workers`: an int `N`, or `(MIN, MAX)` from `MIN:MAX`."""
    parts = text.split(":")
    if len(parts) in (1, 2) and all(part.isdigit() for part in parts):
        numbers = tuple(int(part) for part in parts)
        if min(numbers) >= 1 and numbers == tuple(sorted(numbers)):
            return numbers[0] if len(numbers) == 1 else numbers
    raise argparse.ArgumentTypeError(
        "`--workers` must be a number of workers N >= 1, or MIN:MAX with "
        f"1 <= MIN <= MAX for an elastic group. Received: --workers={text!r}. "
        "For example `--workers 2` or `--workers 2:4`."
    )


def _max_workers(workers):
    """The most workers `--workers` may start."""
    return workers[1] if isinstance(workers, tuple) else workers


def _absolute(path):
    """A local path made absolute (the workers start elsewhere); a URL as is.

    `gs://bucket/run1` (or `s3://`, `hdfs://`): an object store every Ray
    node reaches, the first choice on a cluster (docs/guides/clusters.md).
    """
    if not path or "://" in path:
        return path or None
    return os.path.abspath(path)


def _pythonpath():
    return os.pathsep.join(
        [EXAMPLES, *filter(None, [os.environ.get("PYTHONPATH", "")])]
    )


def _plain(metrics):
    """`metrics` with JSON types (numpy numbers become floats)."""
    return {
        key: value if isinstance(value, str) else float(value)
        for key, value in metrics.items()
    }


if __name__ == "__main__":
    sys.exit(main())
