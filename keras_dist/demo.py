"""`keras-dist demo`: train a small CNN on several logical CPU replicas.

Runs offline on scikit-learn's bundled digits data (1,797 8x8 images) and
compares configurations side by side: 1 replica, N replicas, N replicas with
gradient accumulation, with the optimizer state sharded (`ShardedOptimizer`)
and with gradient compression. Prints one table (test accuracy, samples/s,
bytes each replica sends per step, compression ratio, optimizer state per
replica) and writes it as JSON and as a PNG plot (with the loss curves).
Its last act runs two worker processes under `keras-dist launch`, kills one
mid-epoch, and shows the job resuming from its backup to the weights of an
uninterrupted run (`keras_dist._demo_fault`).

Logical CPU replicas share the machine's cores, so samples/s cannot grow with
replicas here; the table shows accuracy and bytes, and a note under it says so.
The note also checks what the replicas must not change: at every epoch, the
N-replica run's training loss and accuracy match the 1-replica run's, up to
float rounding.

TensorFlow's native log lines are hidden unless `--tf-logs` is given (or
`KERAS_DIST_TF_LOGS=1` or `TF_CPP_MIN_LOG_LEVEL` is set; see
`keras_dist.launcher.tf_logs`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import textwrap
import time

from keras_dist.launcher import tf_logs

DEFAULT_OUT = "keras_dist_demo"
# Largest difference in an epoch's training loss or accuracy, relative to the
# value, that the note puts down to float rounding: the replicas sum in
# another order, and training amplifies that epoch after epoch (measured, 8
# epochs: loss 1.5e-6 on 2 replicas, 2.4e-3 on 4; accuracy equal). A
# gradient lost or counted twice shows far beyond it.
ROUNDING_TOLERANCE = 1e-2
# The `steps` of the configuration that shards Adam's state over the replicas.
SHARDED = "sharded"
# Where real multi-worker step times over a shaped network are recorded.
BENCHMARKS_PAGE = "docs/benchmarks/compression.md"


@dataclasses.dataclass
class Result:
    """One configuration's outcome."""

    name: str
    replicas: int
    accumulation_steps: int
    hook: str
    test_accuracy: float
    samples_per_second: float
    bytes_per_step: int
    compression_ratio: float
    seconds: float
    # Bytes of optimizer state one replica holds (its slots; a
    # ShardedOptimizer's slice of them, a GradientAccumulationOptimizer's
    # accumulators too).
    state_bytes: int = 0
    # Training loss and accuracy at the end of each epoch, first epoch first.
    epoch_loss: list[float] = dataclasses.field(default_factory=list)
    epoch_accuracy: list[float] = dataclasses.field(default_factory=list)


def default_replicas() -> int:
    """Logical CPU replicas to use: 2 to 4, following the core count."""
    return max(2, min(4, os.cpu_count() or 2))


def fit_verbosity(verbose, stream) -> int:
    """The Keras `fit` verbosity to use: `verbose` if given, else by `stream`.

    Keras progress bars (`verbose=1`) redraw one line with `\\r` and colour it
    with `\\x1b[...m` escape codes, which turn CI logs and `| tee` files into
    noise; off a terminal the default is one line per epoch (`verbose=2`).

    Args:
        verbose: int or `None`. The `--verbose` given on the command line;
            `None` when it was not given.
        stream: file object. Where the output goes (`sys.stdout`).

    Returns:
        `verbose` when not `None`; else 1 when `stream` is a terminal, 2
        otherwise.
    """
    if verbose is not None:
        return verbose
    isatty = getattr(stream, "isatty", None)
    return 1 if isatty is not None and isatty() else 2


def check_out(out: str) -> str | None:
    """Creates the output folder `out` and checks it is writable.

    Runs before any training, so a bad `--out` fails in a second instead of
    after every configuration has trained.

    Args:
        out: str. The `--out` folder.

    Returns:
        `None` when `out` exists (now) and a file can be written in it, else
        the error message for the command line.
    """
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        return (
            f"--out must be a folder the demo can create and write "
            f"results.json, results.md and results.png in. Received: "
            f"--out {out!r} ({reason}). Pass a writable folder, e.g. "
            f"--out {DEFAULT_OUT} (the default) or --out /tmp/{DEFAULT_OUT}."
        )
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="keras-dist demo",
        description=(
            "Train a small CNN on scikit-learn's digits with keras_dist on "
            "logical CPU replicas and compare configurations."
        ),
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="logical CPU replicas (default: 2-4 following the core count)",
    )
    parser.add_argument("--epochs", type=int, default=8, help="epochs per run")
    parser.add_argument(
        "--batch-size", type=int, default=64, help="global batch size (default 64)"
    )
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--verbose",
        type=int,
        default=None,
        choices=(0, 1, 2),
        help=(
            "Keras fit verbosity (1: progress bars, 2: one line per epoch; "
            "default 1 on a terminal, 2 otherwise)"
        ),
    )
    parser.add_argument(
        "--no-fault-act",
        action="store_true",
        help=(
            "skip the last act (two worker processes, one SIGKILLed mid-epoch, "
            "the job resumed from its backup; about 40 s)"
        ),
    )
    parser.add_argument(
        "--tf-logs",
        action="store_true",
        help=(
            "show TensorFlow's native log lines (oneDNN, CUDA, ...), hidden "
            "by default; the same as KERAS_DIST_TF_LOGS=1"
        ),
    )
    args = parser.parse_args(argv)
    if args.replicas is not None and args.replicas < 1:
        parser.error(f"--replicas must be >= 1. Received: {args.replicas}.")
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be >= 1.")
    replicas = args.replicas or default_replicas()
    if args.batch_size % (2 * replicas):
        parser.error(
            f"--batch-size must be divisible by 2 x replicas ({2 * replicas}) so "
            f"the accumulation run can halve it. Received: {args.batch_size}."
        )
    out_error = check_out(args.out)
    if out_error:
        parser.error(out_error)
    verbose = fit_verbosity(args.verbose, sys.stdout)
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        print(
            "keras-dist demo needs scikit-learn for its bundled digits data: "
            'pip install ".[demo]" in the keras_dist clone',
            file=sys.stderr,
        )
        return 1

    # Before TensorFlow loads: it reads the level once.
    quiet = tf_logs.prepare_environment(os.environ, args.tf_logs)
    with tf_logs.quiet_import(quiet):
        import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    # Raises when TensorFlow is already initialised (demo called from Python):
    # then the devices that exist are checked below.
    with contextlib.suppress(RuntimeError):
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * replicas
        )
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:replicas]
    if len(devices) < replicas:
        print(
            f"Only {len(devices)} CPU devices exist; run the demo in a fresh process.",
            file=sys.stderr,
        )
        return 1

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    order = tf.random.experimental.stateless_shuffle(
        tf.range(len(x)), seed=[0, 1]
    ).numpy()
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    data = (x[:split], y[:split], x[split:], y[split:])

    configurations = _configurations(replicas)
    print(
        f"keras_dist demo: digits {split} train / {len(x) - split} test, "
        f"global batch {args.batch_size}, {args.epochs} epochs, "
        f"{replicas} logical CPU replicas\n"
    )
    results = []
    for name, num_replicas, steps, hook_factory in configurations:
        print(f"--- {name}")
        results.append(
            _run(
                name,
                devices[:num_replicas],
                steps,
                hook_factory,
                data,
                args.batch_size,
                args.epochs,
                verbose,
            )
        )
    table = format_table(results)
    note = format_note(results, replicas, _core_count())
    print("\n" + table + "\n\n" + note)
    with open(os.path.join(args.out, "results.json"), "w") as handle:
        json.dump(
            {
                "command": " ".join(["keras-dist demo", *(argv or sys.argv[2:])]),
                "replicas": replicas,
                "epochs": args.epochs,
                "batch_size": args.batch_size,
                "results": [dataclasses.asdict(r) for r in results],
            },
            handle,
            indent=2,
        )
    with open(os.path.join(args.out, "results.md"), "w") as handle:
        handle.write(table + "\n\n" + note + "\n")
    plot = _plot(results, os.path.join(args.out, "results.png"))
    written = "results.json, results.md" + (", results.png" if plot else "")
    print(f"\nWrote {written} to {args.out}/")
    if args.no_fault_act:
        return 0
    return _fault_act()


def _fault_act() -> int:
    """The last act: a worker lost mid-epoch, the job resumed exactly."""
    from keras_dist import _demo_fault

    print(
        "\n--- A worker lost mid-epoch: keras-dist launch --workers 2 "
        "--max-restarts 1, with BackupAndRestore; worker:1 is SIGKILLed in "
        "epoch 2"
    )
    act = _demo_fault.run_act()
    for line in act.lines:
        print(line)
    if act.status != 0 or act.max_difference is None:
        print(f"The job did not recover (exit status {act.status}).")
        return 1
    print(
        "Final weights equal the uninterrupted run (one device, no fault): "
        f"max |diff| = {act.max_difference:.1e} ({act.seconds:.0f} s)."
    )
    return 0


def _configurations(replicas):
    from keras_dist import compression

    configs = [
        ("1 replica", 1, 1, None),
        (f"{replicas} replicas", replicas, 1, None),
        (f"{replicas} replicas, accumulation x2", replicas, 2, None),
        (f"{replicas} replicas, ShardedOptimizer", replicas, SHARDED, None),
    ]
    optional = [
        ("FP16", "FP16", {}),
        ("PowerSGD", "PowerSGD", {"rank": 2, "start_step": 10}),
    ]
    for label, class_name, kwargs in optional:
        cls = getattr(compression, class_name, None)
        if cls is not None:
            configs.append(
                (
                    f"{replicas} replicas, {label}" + (" rank 2" if kwargs else ""),
                    replicas,
                    1,
                    lambda cls=cls, kwargs=kwargs: cls(**kwargs),
                )
            )
    return configs


def build_cnn(cls):
    """The demo's small CNN for 8x8x1 digits, in `cls`'s functional form."""
    import keras

    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(128, activation="relu")(h)
    outputs = keras.layers.Dense(10)(h)
    return cls(inputs, outputs)


def _run(name, devices, steps, hook_factory, data, batch_size, epochs, verbose):
    import keras
    import tensorflow as tf

    import keras_dist

    x_train, y_train, x_test, y_test = data
    if len(devices) == 1:
        strategy = tf.distribute.OneDeviceStrategy(devices[0])
    else:
        strategy = tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
    keras.utils.set_random_seed(0)
    hook = hook_factory() if hook_factory else None
    with strategy.scope():
        model = build_cnn(keras_dist.DistributedModel)
        if hook is not None:
            model.register_all_reduce_hook(hook)
        optimizer = keras.optimizers.Adam(1e-3)
        if steps == SHARDED:
            optimizer = keras_dist.ShardedOptimizer(optimizer)
            steps = 1
        elif steps > 1:
            optimizer = keras_dist.GradientAccumulationOptimizer(
                optimizer, accumulation_steps=steps
            )
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    micro_batch = batch_size // steps
    dataset = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(len(x_train), seed=0)
        .batch(micro_batch, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )
    # The dataset shuffles itself (seeded); `shuffle=False` says so to Keras,
    # which otherwise warns that it ignores `shuffle=True`.
    # The first epoch traces the train function; time the others.
    history = model.fit(dataset, epochs=1, shuffle=False, verbose=verbose).history
    epoch_loss, epoch_accuracy = list(history["loss"]), list(history["accuracy"])
    start = time.perf_counter()
    if epochs > 1:
        history = model.fit(
            dataset, initial_epoch=1, epochs=epochs, shuffle=False, verbose=verbose
        ).history
        epoch_loss += history["loss"]
        epoch_accuracy += history["accuracy"]
    seconds = time.perf_counter() - start
    seen = (epochs - 1) * (len(x_train) // micro_batch) * micro_batch
    _, accuracy = model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)
    stats = model.all_reduce_hook.stats()
    per_update = stats.sent_bytes if len(devices) > 1 else 0
    state = sum(
        strategy.experimental_local_results(getattr(v, "value", v))[0].numpy().nbytes
        for v in model.optimizer.variables
        if len(v.shape)
    )
    return Result(
        name=name,
        replicas=len(devices),
        accumulation_steps=steps,
        hook=type(model.all_reduce_hook).__name__,
        test_accuracy=float(accuracy),
        samples_per_second=seen / seconds if seconds > 0 else float("nan"),
        bytes_per_step=int(per_update / steps),
        compression_ratio=float(stats.ratio) if len(devices) > 1 else 1.0,
        seconds=seconds,
        state_bytes=int(state),
        epoch_loss=[float(value) for value in epoch_loss],
        epoch_accuracy=[float(value) for value in epoch_accuracy],
    )


def format_table(results) -> str:
    """Returns the results as a markdown table."""
    lines = [
        "| configuration | test accuracy | samples/s | bytes sent per step "
        "(per replica) | compression | optimizer state per replica |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.test_accuracy:.3f} | {r.samples_per_second:,.0f} | "
            f"{r.bytes_per_step:,} | {r.compression_ratio:.1f}x | "
            f"{r.state_bytes / 1024:,.0f} KiB |"
        )
    return "\n".join(lines)


def _core_count() -> int:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class EpochDifference:
    """How far a run's per-epoch training metrics are from the 1-replica run's.

    Each difference is the largest over the epochs of
    `|a - b| / max(|a|, |b|)`; its epoch is 1-based (the first largest).
    """

    loss: float
    loss_epoch: int
    accuracy: float
    accuracy_epoch: int


def epoch_difference(reference: Result, other: Result) -> EpochDifference | None:
    """Compares two runs' training loss and accuracy, epoch by epoch.

    Args:
        reference: `Result`. The 1-replica run.
        other: `Result`. A run to compare with it.

    Returns:
        An `EpochDifference`, or `None` when a run has no epochs recorded or
        the runs have different numbers of epochs.
    """
    found = []
    for a_values, b_values in (
        (reference.epoch_loss, other.epoch_loss),
        (reference.epoch_accuracy, other.epoch_accuracy),
    ):
        if not a_values or len(a_values) != len(b_values):
            return None
        worst = (0.0, 1)
        for epoch, (a, b) in enumerate(zip(a_values, b_values), start=1):
            difference = abs(a - b) / max(abs(a), abs(b), 1e-12)
            if difference > worst[0]:
                worst = (difference, epoch)
        found.append(worst)
    (loss, loss_epoch), (accuracy, accuracy_epoch) = found
    return EpochDifference(loss, loss_epoch, accuracy, accuracy_epoch)


def _agreement(difference: EpochDifference) -> str:
    """`"its training accuracy is the same, and its loss agrees to ..."`."""
    if difference.accuracy == 0:
        accuracy = "is the same"
    else:
        accuracy = (
            f"agrees to {difference.accuracy:.1e} (relative; largest at "
            f"epoch {difference.accuracy_epoch})"
        )
    if difference.loss == 0:
        loss = "is the same too"
    else:
        loss = (
            f"agrees to {difference.loss:.1e} (relative; largest at epoch "
            f"{difference.loss_epoch})"
        )
    return f"its training accuracy {accuracy}, and its loss {loss}"


def format_equality(results) -> str | None:
    """Says whether the replicated runs trained as the 1-replica run did.

    Compares, epoch by epoch, the training loss and accuracy of the
    N-replica runs without compression (plain, then with accumulation) with
    the 1-replica run's, and says how close they are, or that they are
    further apart than float rounding explains (`ROUNDING_TOLERANCE`).

    Args:
        results: list of `Result`. The demo's rows, "1 replica" first.

    Returns:
        A paragraph, or `None` when there is nothing to compare (no such
        N-replica run, or no epochs recorded).
    """
    reference = results[0]
    compared = []
    for r in results:
        if r.replicas > 1 and r.hook == "NoCompression":
            difference = epoch_difference(reference, r)
            if difference is not None:
                compared.append((r, difference))
    if not compared:
        return None
    off = [(r, d) for r, d in compared if max(d.loss, d.accuracy) > ROUNDING_TOLERANCE]
    if off:
        run, difference = off[0]
        return (
            f'Not the same training: at every epoch the "{run.name}" run '
            f'should match the "{reference.name}" run up to float rounding; '
            f"{_agreement(difference)}, beyond the {ROUNDING_TOLERANCE:g} "
            "that rounding explains. keras_dist's tests hold these runs "
            "equal; please report this run's results.json."
        )
    (run, difference), *others = compared
    text = (
        f"Same training on one device and on replicas: at every one of the "
        f'{len(reference.epoch_loss)} epochs, the "{run.name}" run matches the '
        f'"{reference.name}" run: {_agreement(difference)}. The replicas split '
        "each batch and DistributedModel sums their gradients, so each update "
        "is the one device's up to float rounding (the sums run in another "
        "order), which training amplifies over the epochs."
    )
    for r, d in others:
        text += f' So does "{r.name}": {_agreement(d)}.'
    return text


def format_note(results, replicas: int, cores: int) -> str:
    """Returns what the run shows and what the table's columns mean.

    Args:
        results: list of `Result`. The demo's rows, "1 replica" first.
        replicas: int. The logical CPU replicas of the multi-replica rows.
        cores: int. The CPU cores they share.
    """
    single = results[0].test_accuracy
    multi = [r.test_accuracy for r in results if r.replicas > 1]
    if multi and min(multi) == max(multi):
        spread = f"{min(multi):.3f}"
    elif multi:
        spread = f"{min(multi):.3f}-{max(multi):.3f}"
    else:
        spread = "-"
    cpu = f"{cores} CPU core" + ("s" if cores != 1 else "")
    device = f"{replicas} logical CPU replica" + ("s" if replicas != 1 else "")
    equality = format_equality(results)
    paragraphs = [p for p in [equality] if p] + [
        f"samples/s: the {device} split each global batch but run on this "
        f"machine's {cpu} and add an all-reduce per step, so throughput cannot "
        "grow with replicas here: differences in this column are that overhead "
        "and whatever else the machine is running. It is not keras_dist's speed "
        "on real hardware.",
        f"What this run shows: test accuracy on replicas vs one device (1 replica "
        f"{single:.3f}; {replicas} replicas {spread}), the bytes each replica "
        "puts on the wire per step (here a copy in memory), and how much each "
        "hook compresses them.",
        "On real devices or workers each replica has its own compute and those "
        "bytes cross a real link every step, which is where compression saves "
        "time. Measured multi-worker step times over a bandwidth-shaped network: "
        f"{BENCHMARKS_PAGE} in the keras_dist repository.",
    ]
    return "\n\n".join(textwrap.fill(p, width=78) for p in paragraphs)


def _plot(results, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [r.name for r in results]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    # The training loss epoch by epoch: one device, replicas and accumulation
    # follow the same curve (the point of the library); the compressing
    # hooks' curves may part from it a little.
    loss_axis = axes[0]
    for r in results:
        epochs = range(1, len(r.epoch_loss) + 1)
        style = "-" if r.hook == "NoCompression" else ":"
        loss_axis.plot(
            epochs, r.epoch_loss, style, marker="o", markersize=3, label=r.name
        )
    loss_axis.set(title="training loss per epoch", xlabel="epoch", yscale="log")
    loss_axis.legend(fontsize=7)
    panels = [
        ("test accuracy", ".3f", [r.test_accuracy for r in results]),
        (
            "KiB sent per step per replica",
            ",.1f",
            [r.bytes_per_step / 1024 for r in results],
        ),
        (
            "optimizer state per replica, KiB",
            ",.0f",
            [r.state_bytes / 1024 for r in results],
        ),
    ]
    for axis, (title, spec, values) in zip(axes[1:], panels):
        axis.barh(names, values, color="#4878a8")
        axis.set_title(title)
        axis.invert_yaxis()
        for index, value in enumerate(values):
            axis.text(value, index, f" {value:{spec}}", va="center", fontsize=8)
    for axis in axes[2:]:
        axis.set_yticklabels([])
    fig.suptitle("keras-dist demo: small CNN on digits")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())
