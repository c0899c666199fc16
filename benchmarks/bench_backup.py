"""The cost of `keras_dist.callbacks.BackupAndRestore`: time per save, share of steps.

Trains two models as `keras_dist.DistributedModel` with
`GradientAccumulationOptimizer(Adam, accumulation_steps=2)` and the `FP16()`
all-reduce hook on a `MirroredStrategy` over two logical CPU devices, with
no callback and with `BackupAndRestore(save_freq=...)` for each `save_freq`
asked for (1, 10 and 100 batches and `"epoch"` by default):

- `digits`: scikit-learn's 1,797 digits and the demo's small CNN (Conv2D 32
  -> Conv2D 64 -> pool -> Dense 128 -> Dense 10, 151,306 parameters);
- `mlp25m`: Dense 1024 -> 4096 -> 4096 -> 1024 (25.2M parameters) on
  generated data, mean squared error.

Each run is one `fit` (same model, so nothing is traced again) over a fixed
number of epochs with a fresh temporary `backup_dir` and
`delete_checkpoint=True`. Configurations alternate in rounds, in reverse
order every other round, so drifts of a shared machine hit all alike. Two
measures:

- step time: the wall time of `fit` divided by its batches; the median over
  rounds, its ratio to the median without the callback, and the median of
  each run's ratio to the run without the callback in the same round;
- time per save: `keras_dist.backup.transfer.snapshot_values` (the
  snapshot of every variable's value on the step, per-replica ones from
  each replica; "gather"), and `keras_dist.backup.transfer.materialize` plus
  `keras_dist.backup.store.write` (the NumPy copies, state.npz and
  manifest.json, fsync'd, then `CURRENT` switched; "write") are wrapped with
  `time.perf_counter()` in this process, and so is the callback's whole
  save on the step; the backup's size is that of its `state.npz`.

Each save configuration runs on every storage of `--storages`: `disk` (a
temporary folder under `--tmp-dir`: `os` calls, fsync, `os.replace`) and
`ram` (TensorFlow's in-memory `ram://` file system, written through
`tf.io.gfile` like an object store: the backup under its own prefix, then
the pointer; no fsync, no rename), side by side, and in every write mode
of `--write-modes`: `sync` (the write on the step) and `async`
(`async_write=True`: the write on the callback's writer thread; the
"whole save" is then the time the step was blocked: waiting for the
previous write, and the gather).

Usage:

    python benchmarks/bench_backup.py [--models digits mlp25m]
        [--save-freqs 1 10 100 epoch] [--storages disk ram]
        [--write-modes sync async]
        [--out docs/benchmarks/backup.json]

Prints a markdown table; writes the raw timings, the environment and the
command to the JSON file, and a plot next to it (same name, `.png`) when
matplotlib is importable (`--replot JSON` redraws it).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid

import _harness as harness

NUM_LOGICAL_CPUS = 2
BATCH_SIZE = 64
ACCUMULATION_STEPS = 2
MODELS = ("digits", "mlp25m")
NO_CALLBACK = "none"
STORAGES = ("disk", "ram")
WRITE_MODES = ("sync", "async")
MLP_WIDTHS = (1024, 4096, 4096, 1024)
WARMUP_BATCHES = 3


def save_freq_arg(text):
    if text == "epoch":
        return text
    try:
        return harness.positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"a save frequency is 'epoch' or an int >= 1. Received: {text!r}."
        ) from None


def parse_args(argv=None):
    parser = harness.parser(
        "Time per save and step-time share of keras_dist's BackupAndRestore "
        "for several save_freq values, on 2 logical CPU replicas.",
        "backup.json",
    )
    parser.add_argument(
        "--models", nargs="+", choices=MODELS, default=list(MODELS), help="Models."
    )
    parser.add_argument(
        "--save-freqs",
        nargs="+",
        type=save_freq_arg,
        default=[1, 10, 100, "epoch"],
        help="save_freq values to measure (ints and/or 'epoch').",
    )
    count = harness.positive_int
    parser.add_argument(
        "--digits-epochs",
        type=count,
        default=8,
        help="Epochs per digits run (28 batches of 64 each).",
    )
    parser.add_argument(
        "--mlp-batches-per-epoch",
        type=count,
        default=6,
        help="Batches of 64 generated examples per epoch of the 25M MLP.",
    )
    parser.add_argument(
        "--mlp-epochs", type=count, default=2, help="Epochs per 25M-MLP run."
    )
    parser.add_argument(
        "--digits-rounds", type=count, default=4, help="Rounds of digits runs."
    )
    parser.add_argument(
        "--mlp-rounds", type=count, default=3, help="Rounds of 25M-MLP runs."
    )
    parser.add_argument(
        "--storages",
        nargs="+",
        choices=STORAGES,
        default=list(STORAGES),
        help="Where the backups go: a local folder (disk) and/or ram://.",
    )
    parser.add_argument(
        "--write-modes",
        nargs="+",
        choices=WRITE_MODES,
        default=["sync"],
        help="Write each backup on the step (sync) and/or in the background "
        "(async: BackupAndRestore(async_write=True)).",
    )
    parser.add_argument(
        "--tmp-dir",
        default=None,
        help="Where the temporary backup folders go (default: the system's).",
    )
    return parser.parse_args(argv)


def label(save_freq, storage="disk", mode="sync"):
    if save_freq is None:
        return NO_CALLBACK
    text = f"save_freq={save_freq}" + (" on ram://" if storage == "ram" else "")
    return text + (", async" if mode == "async" else "")


@contextlib.contextmanager
def backup_folder(storage, tmp_dir):
    """A fresh `backup_dir` on `storage`, removed afterwards."""
    if storage == "disk":
        with tempfile.TemporaryDirectory(dir=tmp_dir) as folder:
            yield os.path.join(folder, "backup")
        return
    import tensorflow as tf

    root = f"ram://kd-bench-backup-{uuid.uuid4().hex}"
    try:
        yield f"{root}/backup"
    finally:
        if tf.io.gfile.exists(root):
            tf.io.gfile.rmtree(root)


class SaveTimer:
    """Times the backup path by wrapping the module functions the callback calls."""

    def __init__(self, transfer_module, store_module):
        self.records = []
        self._unwritten = collections.deque()
        self.cleanup_seconds = 0.0
        self._module = store_module
        self._snapshot_values = transfer_module.snapshot_values
        self._materialize = transfer_module.materialize
        self._write = store_module.write
        self._remove_all = store_module.remove_all
        transfer_module.snapshot_values = self._timed_snapshot_values
        transfer_module.materialize = self._timed_materialize
        store_module.write = self._timed_write
        store_module.remove_all = self._timed_remove_all

    def _timed_snapshot_values(self, *args, **kwargs):
        start = time.perf_counter()
        snapshot = self._snapshot_values(*args, **kwargs)
        self.records.append({"gather_s": time.perf_counter() - start})
        # Writes run in the order of the saves, one at a time, and a
        # background write can end after the next save's gather.
        self._unwritten.append(self.records[-1])
        return snapshot

    def _timed_materialize(self, *args, **kwargs):
        start = time.perf_counter()
        values = self._materialize(*args, **kwargs)
        self._unwritten[0]["write_s"] = time.perf_counter() - start
        return values

    def _timed_write(self, backup_dir, *args, **kwargs):
        start = time.perf_counter()
        name = self._write(backup_dir, *args, **kwargs)
        record = self._unwritten.popleft()
        record["write_s"] += time.perf_counter() - start
        import tensorflow as tf

        state = self._module.files.join(backup_dir, name, self._module.STATE_FILE)
        record["state_bytes"] = tf.io.gfile.stat(state).length
        return name

    def _timed_remove_all(self, *args, **kwargs):
        # `delete_checkpoint=True` at the end of `fit`.
        start = time.perf_counter()
        self._remove_all(*args, **kwargs)
        self.cleanup_seconds += time.perf_counter() - start

    def take(self):
        """Returns the saves and the cleanup time since the last call."""
        records, self.records = self.records, []
        cleanup, self.cleanup_seconds = self.cleanup_seconds, 0.0
        return records, cleanup


def timed_callback_class(keras_dist):
    """`BackupAndRestore` whose whole save (inventory, gather, write) is timed."""

    class TimedBackupAndRestore(keras_dist.callbacks.BackupAndRestore):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.save_seconds = []

        def _save(self, *args, **kwargs):
            start = time.perf_counter()
            super()._save(*args, **kwargs)
            self.save_seconds.append(time.perf_counter() - start)

    return TimedBackupAndRestore


def digits_data(np):
    """scikit-learn's 1,797 digits, scaled to [0, 1], as 8x8x1 images."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    return x, digits.target.astype("int32")


def digits_model(keras):
    """The demo's CNN; returns `(inputs, outputs, loss)`."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(128, activation="relu")(h)
    outputs = keras.layers.Dense(10)(h)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return inputs, outputs, loss


def mlp_data(np, batches_per_epoch):
    """Generated inputs and regression targets for the 25M MLP."""
    rng = np.random.default_rng(0)
    count = batches_per_epoch * BATCH_SIZE
    x = rng.normal(size=(count, MLP_WIDTHS[0])).astype("float32")
    y = rng.normal(size=(count, MLP_WIDTHS[-1])).astype("float32")
    return x, y


def mlp_model(keras):
    """Dense 1024 -> 4096 -> 4096 -> 1024; returns `(inputs, outputs, loss)`."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((MLP_WIDTHS[0],))
    h = inputs
    for width in MLP_WIDTHS[1:-1]:
        h = keras.layers.Dense(width, activation="relu")(h)
    outputs = keras.layers.Dense(MLP_WIDTHS[-1])(h)
    return inputs, outputs, "mse"


def run_model(tf, keras, keras_dist, np, name, args, strategy, timer):
    if name == "digits":
        (x, y), build, epochs, rounds = (
            digits_data(np),
            digits_model,
            args.digits_epochs,
            args.digits_rounds,
        )
    else:
        (x, y), build, epochs, rounds = (
            mlp_data(np, args.mlp_batches_per_epoch),
            mlp_model,
            args.mlp_epochs,
            args.mlp_rounds,
        )
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(BATCH_SIZE, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )
    batches_per_epoch = len(x) // BATCH_SIZE
    with strategy.scope():
        inputs, outputs, loss = build(keras)
        model = keras_dist.DistributedModel(
            inputs, outputs, all_reduce_hook=keras_dist.compression.FP16()
        )
        model.compile(
            optimizer=keras_dist.GradientAccumulationOptimizer(
                keras.optimizers.Adam(1e-3), accumulation_steps=ACCUMULATION_STEPS
            ),
            loss=loss,
        )
    callback_class = timed_callback_class(keras_dist)

    def fit(save_freq, folder, steps=None, mode="sync"):
        callbacks = []
        if save_freq is not None:
            callbacks.append(
                callback_class(
                    folder,
                    save_freq=save_freq,
                    delete_checkpoint=True,
                    async_write=mode == "async",
                )
            )
        start = time.perf_counter()
        model.fit(
            dataset.take(steps) if steps else dataset,
            epochs=1 if steps else epochs,
            verbose=0,
            callbacks=callbacks,
        )
        return time.perf_counter() - start, callbacks

    # Warm-up: the first fit traces the train function; a fit with saves
    # after it makes the first timed save no different from the others.
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as folder:
        fit(None, folder, WARMUP_BATCHES)
        fit(1, os.path.join(folder, "backup"), WARMUP_BATCHES)
    timer.take()

    configurations = [(None, "disk", "sync")] + [
        (save_freq, storage, mode)
        for save_freq in args.save_freqs
        for storage in args.storages
        for mode in args.write_modes
    ]
    runs = []
    for round_index in range(rounds):
        for save_freq, storage, mode in harness.alternate(configurations, round_index):
            with backup_folder(storage, args.tmp_dir) as folder:
                seconds, callbacks = fit(save_freq, folder, mode=mode)
            saves, cleanup = timer.take()
            whole = callbacks[0].save_seconds if callbacks else []
            for record, total in zip(saves, whole):
                record["save_s"] = total
            runs.append(
                {
                    "round": round_index,
                    "configuration": label(save_freq, storage, mode),
                    "save_freq": save_freq,
                    "storage": storage if save_freq is not None else None,
                    "write_mode": mode if save_freq is not None else None,
                    "batches": epochs * batches_per_epoch,
                    "fit_s": seconds,
                    "cleanup_s": cleanup,
                    "saves": saves,
                }
            )
            print(
                f"  [{name}] round {round_index + 1}/{rounds} "
                f"{label(save_freq, storage, mode)}: "
                f"{seconds * 1e3 / (epochs * batches_per_epoch):.1f} ms/batch, "
                f"{len(saves)} saves",
                file=sys.stderr,
            )
    return {
        "parameters": model.count_params(),
        "examples": len(x),
        "batches_per_epoch": batches_per_epoch,
        "epochs": epochs,
        "rounds": rounds,
        "runs": runs,
    }


def summarize(results):
    rows = []
    for name, result in results.items():
        by_configuration = {}
        for run in result["runs"]:
            by_configuration.setdefault(run["configuration"], []).append(run)
        baseline = statistics.median(
            run["fit_s"] / run["batches"] for run in by_configuration[NO_CALLBACK]
        )
        # The run without the callback in the same round: the machine's load
        # changes between rounds more than within one.
        baseline_of_round = {
            run["round"]: run["fit_s"] / run["batches"]
            for run in by_configuration[NO_CALLBACK]
        }
        for configuration, runs in by_configuration.items():
            step = statistics.median(run["fit_s"] / run["batches"] for run in runs)
            saves = [save for run in runs for save in run["saves"]]
            saves_per_run = sorted({len(run["saves"]) for run in runs})

            def median_ms(key, saves=saves):
                return statistics.median(s[key] for s in saves) * 1e3 if saves else None

            in_saves = statistics.median(
                sum(s["save_s"] for s in run["saves"]) / run["fit_s"] for run in runs
            )
            rows.append(
                {
                    "model": name,
                    "parameters": result["parameters"],
                    "configuration": configuration,
                    "runs": len(runs),
                    "batches_per_run": runs[0]["batches"],
                    "saves_per_run": saves_per_run,
                    "step_ms": step * 1e3,
                    "ratio": step / baseline,
                    "paired_ratio": statistics.median(
                        run["fit_s"] / run["batches"] / baseline_of_round[run["round"]]
                        for run in runs
                    ),
                    "gather_ms": median_ms("gather_s"),
                    "write_ms": median_ms("write_s"),
                    "save_ms": median_ms("save_s"),
                    "backup_mb": saves[0]["state_bytes"] / 1e6 if saves else None,
                    "share_in_saves": in_saves,
                    "cleanup_ms": statistics.median(run["cleanup_s"] for run in runs)
                    * 1e3,
                }
            )
    return rows


def markdown_table(rows):
    def number(value, digits=1):
        return "" if value is None else f"{value:,.{digits}f}"

    header = ["model", "configuration", "batches per run", "saves per run"]
    header += ["ms/batch (median)", "ratio to none", "paired ratio", "gather ms"]
    header += ["write ms", "ms the step waits per save", "backup MB"]
    header += ["share of fit time in saves"]
    cells = [
        [
            row["model"],
            row["configuration"],
            row["batches_per_run"],
            ", ".join(map(str, row["saves_per_run"])),
            number(row["step_ms"]),
            f"{row['ratio']:.2f}",
            f"{row['paired_ratio']:.2f}",
            *(number(row[key]) for key in ("gather_ms", "write_ms", "save_ms")),
            number(row["backup_mb"]),
            f"{row['share_in_saves']:.1%}",
        ]
        for row in rows
    ]
    return harness.table(header, cells, align="ll" + "r" * 10)


def plot(plt, report, path):
    rows = report["summary"]
    models = list(dict.fromkeys(row["model"] for row in rows))
    figure, axes = plt.subplots(
        1, len(models), figsize=(5.2 * len(models), 4.2), squeeze=False
    )
    for axis, name in zip(axes[0], models):
        model_rows = [row for row in rows if row["model"] == name]
        labels = [
            row["configuration"].replace("save_freq=", "save_freq=\n")
            + "\n"
            + "/".join(map(str, row["saves_per_run"]))
            + " saves"
            for row in model_rows
        ]
        steps = [row["step_ms"] for row in model_rows]
        in_saves = [row["step_ms"] * row["share_in_saves"] for row in model_rows]
        rest = [s - k for s, k in zip(steps, in_saves)]
        positions = range(len(model_rows))
        axis.bar(positions, rest, color="tab:blue", label="training")
        axis.bar(
            positions,
            in_saves,
            bottom=rest,
            color="tab:orange",
            hatch="//",
            label="inside saves (timed)",
        )
        for position, row in zip(positions, model_rows):
            axis.text(
                position,
                row["step_ms"],
                f"{row['ratio']:.2f}x",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        axis.axhline(model_rows[0]["step_ms"], color="black", linewidth=0.8, ls="--")
        axis.set_xticks(list(positions), labels, fontsize=8)
        axis.set_ylabel("ms per batch (median over rounds)")
        params = model_rows[0]["parameters"]
        axis.set_title(f"{name} ({params / 1e6:.2f}M parameters)")
        axis.grid(axis="y", alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(
        "BackupAndRestore: time per batch, ratio to no callback on top "
        "(2 logical CPU replicas)",
        fontsize=10,
    )
    return harness.save_figure(figure, path)


def run(args, report):
    tf, keras, keras_dist = harness.import_stack(NUM_LOGICAL_CPUS)
    import numpy as np

    timer = SaveTimer(*harness.private_backup_modules())
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices)
    results = {}
    for name in args.models:
        results[name] = run_model(
            tf, keras, keras_dist, np, name, args, strategy, timer
        )
    rows = summarize(results)
    print(markdown_table(rows))
    fields = {
        "setup": {
            "strategy": f"MirroredStrategy over {NUM_LOGICAL_CPUS} logical CPUs",
            "global_batch_size": BATCH_SIZE,
            "optimizer": (
                f"GradientAccumulationOptimizer(Adam(1e-3), "
                f"accumulation_steps={ACCUMULATION_STEPS})"
            ),
            "all_reduce_hook": "FP16()",
            "callback": "BackupAndRestore(tmp_dir, save_freq, delete_checkpoint=True)",
            "save_freqs": args.save_freqs,
            "storages": args.storages,
            "digits_model": "Conv2D(32)-Conv2D(64)-MaxPool-Dense(128)-Dense(10)",
            "mlp25m_model": "Dense " + " -> ".join(map(str, MLP_WIDTHS)) + ", MSE",
            "tmp_dir": args.tmp_dir or tempfile.gettempdir(),
        },
        "results": results,
        "summary": rows,
    }
    report.write(fields, logical_cpu_devices=NUM_LOGICAL_CPUS, nice=os.nice(0))


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot))
