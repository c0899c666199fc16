"""Accuracy of Deep Gradient Compression vs TopK under momentum, on digits.

Trains the digits CNN of `tests/test_compression_training.py` (two 3x3
convolutions, max pooling, a 64-unit dense layer; 23,946 parameters) on
scikit-learn's digits (1,797 8x8 images; 1,437 for training, 360 for test,
the same permutation as the tests) with `keras_dist.DistributedModel` under a
`MirroredStrategy` over two logical CPU devices, global batch 32, four ways:

- `none`: no compression, `SGD(0.02, momentum=0.9)`;
- `topk`: `TopK(0.001)` (error feedback) with the same momentum SGD;
- `dgc-0.01` and `dgc-0.001`: `DGC(ratio, momentum=0.9)` with plain
  `SGD(0.02)` (the momentum lives in the hook), sparsity warm-up over
  `--warmup-epochs` epochs;
- `dgc-0.001-nowarmup`: the same at 0.001 from the first step.

For each run and epoch it records the test accuracy; the table shows epochs
4 and 10 (the mean over `--seeds`, and each seed), and the compression
ratio: after the warm-up (what each step sends then) and over the whole run
(total raw bytes / total bytes sent, counting the warm-up's denser steps).

With `--resnet-epochs N` (default 1) it also trains a small CIFAR-shaped
ResNet (32x32x3 inputs made by upsampling the digits 4x and repeating the
channel; 3 stages of 2 residual blocks, 16/32/64 filters, 176,378
parameters) for N epochs, uncompressed momentum SGD vs `DGC(0.001)`: a
smoke of scale, not an accuracy claim.

Usage:

    python benchmarks/bench_dgc_accuracy.py [--epochs 10] [--seeds 0 1 2]
        [--warmup-epochs 1] [--out docs/benchmarks/dgc.json]

Prints markdown tables; writes the per-epoch records, the environment and the
command to the JSON file, and a plot next to it (same name, `.png`) when
matplotlib is importable (`--replot JSON` redraws it).
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import _harness as harness

NUM_LOGICAL_CPUS = 2
GLOBAL_BATCH = 32
LEARNING_RATE = 0.02
MOMENTUM = 0.9
RUNS = ("none", "topk", "dgc-0.01", "dgc-0.001", "dgc-0.001-nowarmup")
LABELS = {
    "none": "no compression, SGD momentum 0.9",
    "topk": "TopK(0.001), SGD momentum 0.9",
    "dgc-0.01": "DGC(0.01), plain SGD",
    "dgc-0.001": "DGC(0.001), plain SGD",
    "dgc-0.001-nowarmup": "DGC(0.001), no warm-up, plain SGD",
}
REPORTED_EPOCHS = (4, 10)
# 45 updates an epoch: 3 calls of the compiled step per epoch.
STEPS_PER_EXECUTION = 15


def parse_args(argv=None):
    parser = harness.parser(
        "Test accuracy on digits, 2 replicas, momentum SGD: uncompressed vs "
        "TopK(0.001) vs DGC(0.01) vs DGC(0.001).",
        "dgc.json",
        epochs=(10, "Epochs per run."),
        seeds=([0, 1, 2], "Seeds to run."),
    )
    parser.add_argument(
        "--runs", nargs="+", default=list(RUNS), choices=RUNS, help="Runs to make."
    )
    parser.add_argument(
        "--warmup-epochs",
        type=float,
        default=1.0,
        help="DGC's sparsity warm-up, in epochs (converted to optimizer updates).",
    )
    parser.add_argument(
        "--resnet-epochs",
        type=int,
        default=1,
        help="Epochs of the CIFAR-shaped ResNet smoke (0 skips it).",
    )
    return parser.parse_args(argv)


def digits():
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.images / 16.0).astype("float32")[..., None]
    y = data.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1437], y[:1437]), (x[1437:], y[1437:])


def digits_cnn(keras, keras_dist, seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.Conv2D(32, 3, activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Dense(64, activation="relu")(keras.layers.Flatten()(h))
    return keras_dist.DistributedModel(inputs, keras.layers.Dense(10)(h))


def small_resnet(keras, keras_dist, seed):
    """A CIFAR-style ResNet: 3 stages of 2 basic blocks, 16/32/64 filters."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    inputs = keras.Input((32, 32, 3))
    x = layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    for stage, filters in enumerate([16, 32, 64]):
        for block in range(2):
            stride = 2 if stage > 0 and block == 0 else 1
            y = layers.Conv2D(
                filters, 3, strides=stride, padding="same", use_bias=False
            )(x)
            y = layers.ReLU()(layers.BatchNormalization()(y))
            y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
            y = layers.BatchNormalization()(y)
            if stride != 1 or x.shape[-1] != filters:
                x = layers.Conv2D(filters, 1, strides=stride, use_bias=False)(x)
                x = layers.BatchNormalization()(x)
            x = layers.ReLU()(layers.Add()([x, y]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras_dist.DistributedModel(inputs, layers.Dense(10)(x))


def upsampled(x):
    """8x8x1 digits as 32x32x3 images (nearest-neighbour, channel repeated)."""
    import numpy as np

    return np.repeat(np.repeat(np.repeat(x, 4, axis=1), 4, axis=2), 3, axis=3)


def make_hook(keras_dist, run, warmup_steps):
    compression = keras_dist.compression
    if run == "none":
        return compression.NoCompression()
    if run == "topk":
        return compression.TopK(ratio=0.001)
    ratio = float(run.split("-")[1])
    if run.endswith("nowarmup"):
        warmup_steps = 0
    return compression.DGC(ratio=ratio, momentum=MOMENTUM, warmup_steps=warmup_steps)


def run_bytes(hook, steps):
    """(raw, sent) bytes per replica over `steps` updates, and after warm-up."""
    specs = hook.variable_specs
    raw = sum(spec.nbytes for spec in specs)
    if not hasattr(hook, "density_at"):
        sent = hook.stats().sent_bytes
        return raw * steps, sent * steps, raw / sent
    total = 0
    for step in range(steps):
        density = hook.density_at(step)
        total += sum(
            hook.k_for(spec, density) * (spec.dtype.size + 4)
            if spec.dtype.is_floating
            else spec.nbytes
            for spec in specs
        )
    return raw * steps, total, raw / hook.sent_bytes(range(len(specs)))


def train(stack, run, seed, data, epochs, warmup_epochs, model_fn):
    tf, keras, keras_dist = stack
    import numpy as np

    (x_train, y_train), (x_test, y_test) = data
    steps_per_epoch = math.ceil(len(x_train) / GLOBAL_BATCH)
    warmup_steps = round(warmup_epochs * steps_per_epoch)
    strategy = tf.distribute.MirroredStrategy(
        [f"/cpu:{i}" for i in range(NUM_LOGICAL_CPUS)],
        cross_device_ops=tf.distribute.ReductionToOneDevice(),
    )
    dataset = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(len(x_train), seed=seed, reshuffle_each_iteration=True)
        .batch(GLOBAL_BATCH)
    )
    hook = make_hook(keras_dist, run, warmup_steps)
    momentum = 0.0 if run.startswith("dgc") else MOMENTUM
    with strategy.scope():
        model = model_fn(keras, keras_dist, seed)
        model.register_all_reduce_hook(hook)
        model.compile(
            optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=momentum),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=STEPS_PER_EXECUTION,
        )
    accuracies = []
    seconds = []
    for _ in range(epochs):
        started = time.perf_counter()
        model.fit(dataset, epochs=1, verbose=0)
        seconds.append(time.perf_counter() - started)
        logits = model(x_test, training=False)
        accuracies.append(float(np.mean(np.argmax(logits, axis=-1) == y_test)))
    steps = epochs * steps_per_epoch
    raw, sent, final_ratio = run_bytes(hook, steps)
    return {
        "run": run,
        "seed": seed,
        "test_accuracy": accuracies,
        "epoch_seconds": seconds,
        "optimizer_updates": int(model.optimizer.iterations.numpy()),
        "warmup_steps": getattr(hook, "warmup_steps", 0),
        "ratio_after_warmup": final_ratio,
        "ratio_over_run": raw / sent,
        "hook": repr(hook),
        "parameters": int(model.count_params()),
    }


def summarize(results, epochs):
    rows = []
    for run in RUNS:
        mine = [r for r in results if r["run"] == run]
        if not mine:
            continue
        row = {"run": run, "label": LABELS[run], "seeds": [r["seed"] for r in mine]}
        for epoch in REPORTED_EPOCHS:
            if epoch <= epochs:
                values = [r["test_accuracy"][epoch - 1] for r in mine]
                row[f"epoch_{epoch}"] = statistics.mean(values)
                row[f"epoch_{epoch}_seeds"] = values
        row["ratio_after_warmup"] = mine[0]["ratio_after_warmup"]
        row["ratio_over_run"] = mine[0]["ratio_over_run"]
        rows.append(row)
    return rows


def markdown_table(rows, epochs):
    reported = [e for e in REPORTED_EPOCHS if e <= epochs]
    header = ["run"]
    header += [f"test acc. epoch {e} (mean; per seed)" for e in reported]
    header += ["ratio after warm-up", "ratio over the run"]
    cells = []
    for row in rows:
        line = [row["label"]]
        for epoch in reported:
            seeds = ", ".join(f"{v:.3f}" for v in row[f"epoch_{epoch}_seeds"])
            line.append(f"**{row[f'epoch_{epoch}']:.3f}** ({seeds})")
        line += [f"{row['ratio_after_warmup']:.0f}x", f"{row['ratio_over_run']:.1f}x"]
        cells.append(line)
    return harness.table(header, cells, align="l" * (1 + len(reported)) + "rr")


def resnet_table(results):
    header = ["run", "epochs", "test acc.", "ratio after warm-up"]
    header += ["ratio over the run", "s/epoch"]
    cells = [
        [
            LABELS[r["run"]],
            len(r["test_accuracy"]),
            f"{r['test_accuracy'][-1]:.3f}",
            f"{r['ratio_after_warmup']:.0f}x",
            f"{r['ratio_over_run']:.1f}x",
            f"{statistics.mean(r['epoch_seconds']):.1f}",
        ]
        for r in results
    ]
    return harness.table(header, cells)


def plot(plt, report, path):
    results = report["results"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {
        "none": "black",
        "topk": "tab:red",
        "dgc-0.01": "tab:green",
        "dgc-0.001": "tab:blue",
        "dgc-0.001-nowarmup": "tab:purple",
    }
    for run in RUNS:
        mine = [r["test_accuracy"] for r in results if r["run"] == run]
        if not mine:
            continue
        epochs = range(1, len(mine[0]) + 1)
        mean = [statistics.mean(values) for values in zip(*mine)]
        ax.plot(epochs, mean, color=colors[run], marker="o", label=LABELS[run])
        for values in mine:
            ax.plot(epochs, values, color=colors[run], alpha=0.25, linewidth=0.8)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (360 digits)")
    ax.set_ylim(0.5, 1.0)
    ax.grid(alpha=0.3)
    ax.set_title(
        "Digits CNN, 2 replicas, batch 32, lr 0.02 (mean of seeds; thin: each)"
    )
    ax.legend(loc="lower right")
    return harness.save_figure(fig, path)


def run(args, report):
    stack = harness.import_stack(logical_cpus=NUM_LOGICAL_CPUS)
    data = digits()
    results = []
    for seed in args.seeds:
        for name in args.runs:
            result = train(
                stack, name, seed, data, args.epochs, args.warmup_epochs, digits_cnn
            )
            results.append(result)
            print(
                f"seed {seed} {name:10s} "
                + " ".join(f"{a:.3f}" for a in result["test_accuracy"])
                + f"  ratio {result['ratio_after_warmup']:.0f}x"
                f" ({result['ratio_over_run']:.1f}x over the run)",
                flush=True,
            )
    rows = summarize(results, args.epochs)
    print()
    print(markdown_table(rows, args.epochs))

    resnet = []
    if args.resnet_epochs:
        (x_train, y_train), (x_test, y_test) = data
        big = ((upsampled(x_train), y_train), (upsampled(x_test), y_test))
        for name in ("none", "dgc-0.001"):
            result = train(
                stack,
                name,
                args.seeds[0],
                big,
                args.resnet_epochs,
                args.warmup_epochs,
                small_resnet,
            )
            resnet.append(result)
        print()
        print(resnet_table(resnet))

    fields = {
        "setup": {
            "global_batch": GLOBAL_BATCH,
            "learning_rate": LEARNING_RATE,
            "momentum": MOMENTUM,
            "epochs": args.epochs,
            "seeds": args.seeds,
            "warmup_epochs": args.warmup_epochs,
        },
        "summary": rows,
        "results": results,
        "resnet_smoke": resnet,
    }
    report.write(fields, logical_cpu_devices=NUM_LOGICAL_CPUS)


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot))
