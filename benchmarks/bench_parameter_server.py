"""Asynchronous parameter servers against synchronous MWMS, with a straggler.

Runs `examples/parameter_server.py` (exercise 3) through `keras-dist launch`,
each run a fresh job:

- `PS`: a chief (the coordinator), 2 workers and 1 ps task,
  `ParameterServerStrategy`, asynchronous updates;
- `MWMS`: 2 workers, `MultiWorkerMirroredStrategy`, synchronous updates;

each without a straggler and with worker 1's input slowed so that its steps
take `--straggler-factor` (3) times as long. Same model (Dense 128 -> 64 ->
10 on the 64 pixels of scikit-learn's digits), Adam, 32 examples per worker
batch and the same number of training examples for every run: `--epochs`
times the 1,437 training images (PS then takes twice the steps of MWMS, one
worker's batch each). Samples, not steps, are held equal: samples/s is the
work both strategies do, and accuracy after the same data is what a user
compares. The configurations alternate in rounds, in reverse order every
other round.

Per run, from the example's JSON: test accuracy (360 held-out images),
samples/s and wall time of the timed `fit` (after a warm-up that traces the
functions; not the job's startup), steps and applied updates, final loss,
the measured warm-up step and the straggler's sleep.

Usage:

    python benchmarks/bench_parameter_server.py [--epochs 8] [--rounds 2]
        [--straggler-factor 3] [--out docs/benchmarks/parameter_server.json]

Prints a markdown table; writes the runs, the summary, the environment and
the command to the JSON file, and a plot next to it (same name, `.png`)
when matplotlib is importable (`--replot JSON` redraws it).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

import _harness as harness

EXAMPLE = os.path.join(harness.REPO_ROOT, "examples", "parameter_server.py")
LAUNCHES = {
    "PS": ["--workers", "2", "--ps", "1", "--chief"],
    "MWMS": ["--workers", "2"],
}
TIMEOUT_S = 300


def parse_args(argv=None):
    parser = harness.parser(
        "Parameter servers (async) vs MultiWorkerMirroredStrategy (sync), "
        "with and without a straggler, through keras-dist launch.",
        "parameter_server.json",
        epochs=(8, "Training-set passes' worth per run."),
        rounds=(2, "Rounds of the 4 configurations."),
    )
    parser.add_argument(
        "--straggler-factor",
        type=float,
        default=3.0,
        help="How many times as long worker 1's steps take in the straggler runs.",
    )
    args = parser.parse_args(argv)
    if args.straggler_factor <= 1:
        parser.error("--straggler-factor must be > 1.")
    return args


def label(strategy, factor):
    return strategy if factor == 1 else f"{strategy}, straggler x{factor:g}"


def run_once(strategy, factor, epochs, folder):
    """One job through the launcher; returns the example's JSON."""
    out = os.path.join(folder, f"{strategy}-{factor:g}.json")
    job = [
        *(sys.executable, "-m", "keras_dist", "launch", *LAUNCHES[strategy], "--"),
        *(sys.executable, EXAMPLE, "--epochs", str(epochs)),
        *("--straggler-factor", str(factor), "--out", out),
    ]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": harness.REPO_ROOT}
    env.pop("TF_CONFIG", None)
    completed = subprocess.run(
        job, capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )
    if completed.returncode != 0 or not os.path.exists(out):
        sys.exit(
            f"{label(strategy, factor)} failed ({completed.returncode}):\n"
            + (completed.stdout + completed.stderr)[-4000:]
        )
    with open(out) as file:
        return json.load(file)


def summarize(runs, factor):
    by_label = {}
    for run in runs:
        by_label.setdefault(run["configuration"], []).append(run)
    rows = {}
    for configuration, group in by_label.items():
        rows[configuration] = {
            "configuration": configuration,
            "runs": len(group),
            "steps": group[0]["steps"],
            "samples": group[0]["samples"],
            "test_accuracy": statistics.mean(r["test_accuracy"] for r in group),
            "test_accuracy_runs": [r["test_accuracy"] for r in group],
            "samples_per_s": statistics.median(r["samples_per_s"] for r in group),
            "samples_per_s_runs": [r["samples_per_s"] for r in group],
            "wall_s": statistics.median(r["wall_s"] for r in group),
            "final_loss": statistics.mean(r["final_loss"] for r in group),
            "warmup_step_ms": statistics.median(r["warmup_step_ms"] for r in group),
            "straggler_sleep_ms": statistics.median(
                r["straggler_sleep_ms"] for r in group
            ),
        }
    ratios = {}
    for strategy in LAUNCHES:
        plain, slow = rows[label(strategy, 1)], rows[label(strategy, factor)]
        ratios[f"{strategy} straggler / no straggler, samples/s"] = (
            slow["samples_per_s"] / plain["samples_per_s"]
        )
        ratios[f"{strategy} straggler - no straggler, test accuracy"] = (
            slow["test_accuracy"] - plain["test_accuracy"]
        )
    for name, f in (("no straggler", 1), (f"straggler x{factor:g}", factor)):
        ps, mwms = rows[label("PS", f)], rows[label("MWMS", f)]
        ratios[f"PS / MWMS, {name}, samples/s"] = (
            ps["samples_per_s"] / mwms["samples_per_s"]
        )
        ratios[f"PS - MWMS, {name}, test accuracy"] = (
            ps["test_accuracy"] - mwms["test_accuracy"]
        )
    return list(rows.values()), ratios


def markdown_table(rows, ratios):
    header = ["run", "steps", "samples", "test accuracy (mean)"]
    header += ["samples/s (median)", "training wall s", "final loss"]
    header += ["warm-up step ms", "straggler sleep ms"]
    runs = [
        [
            row["configuration"],
            row["steps"],
            f"{row['samples']:,}",
            f"{row['test_accuracy']:.3f}",
            f"{row['samples_per_s']:,.0f}",
            f"{row['wall_s']:.1f}",
            f"{row['final_loss']:.4f}",
            f"{row['warmup_step_ms']:.0f}",
            f"{row['straggler_sleep_ms']:.0f}",
        ]
        for row in rows
    ]
    values = [
        [name, f"{value:+.3f}" if "accuracy" in name else f"{value:.2f}"]
        for name, value in ratios.items()
    ]
    return "\n\n".join(
        [harness.table(header, runs), harness.table(["ratio", "value"], values)]
    )


def plot(plt, report, path):
    rows, runs = report["summary"], report["runs"]
    factor = report["setup"]["straggler_factor"]
    figure, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    names = [row["configuration"] for row in rows]
    colors = ["tab:blue" if name.startswith("PS") else "tab:orange" for name in names]
    hatches = ["" if "straggler" not in name else "//" for name in names]
    positions = range(len(rows))
    ticks = [name.replace(", ", "\n") for name in names]
    for axis, key, title in (
        (axes[0], "samples_per_s", "samples/s (median; dots: runs)"),
        (axes[1], "test_accuracy", "test accuracy (mean; dots: runs)"),
    ):
        axis.bar(
            positions,
            [row[key] for row in rows],
            color=colors,
            hatch=hatches,
            edgecolor="black",
        )
        for position, row in zip(positions, rows):
            values = row[f"{key}_runs"]
            axis.plot([position] * len(values), values, "k.", markersize=5)
        axis.set_xticks(list(positions), ticks, fontsize=8)
        axis.set_title(title, fontsize=10)
        axis.grid(axis="y", alpha=0.3)
    lowest = min(min(row["test_accuracy_runs"]) for row in rows)
    axes[1].set_ylim(min(0.9, lowest - 0.02), 1.0)
    for run in runs:
        async_run = run["configuration"].startswith("PS")
        axes[2].plot(
            range(1, len(run["loss_per_epoch"]) + 1),
            run["loss_per_epoch"],
            color="tab:blue" if async_run else "tab:orange",
            ls="--" if "straggler" in run["configuration"] else "-",
            alpha=0.7,
            label=run["configuration"] if run["round"] == 0 else None,
        )
    axes[2].set_yscale("log")
    axes[2].set_xlabel("epoch (training-set passes' worth)")
    axes[2].set_title("training loss per epoch, every run", fontsize=10)
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=8)
    figure.suptitle(
        "Parameter servers (async, blue) vs MWMS (sync, orange), 2 workers, "
        f"straggler x{factor:g} hatched/dashed; 2 shared CPU cores",
        fontsize=10,
    )
    return harness.save_figure(figure, path)


def run(args, report):
    configurations = [
        (strategy, factor)
        for factor in (1.0, args.straggler_factor)
        for strategy in LAUNCHES
    ]
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(args.rounds):
            for strategy, factor in harness.alternate(configurations, round_index):
                result = run_once(strategy, factor, args.epochs, folder)
                result.update(configuration=label(strategy, factor), round=round_index)
                runs.append(result)
                print(
                    f"  round {round_index + 1}/{args.rounds} "
                    f"{result['configuration']}: {result['samples_per_s']:,.0f} "
                    f"samples/s, accuracy {result['test_accuracy']:.3f}, "
                    f"{result['wall_s']:.1f} s",
                    file=sys.stderr,
                )
    order = [label(s, f) for s, f in configurations]
    rows, ratios = summarize(runs, args.straggler_factor)
    rows.sort(key=lambda row: order.index(row["configuration"]))
    print(markdown_table(rows, ratios))
    fields = {
        "setup": {
            "example": "examples/parameter_server.py",
            "launches": {
                name: "keras-dist launch " + " ".join(flags)
                for name, flags in LAUNCHES.items()
            },
            "model": "Dense(128, relu) -> Dense(64, relu) -> Dense(10), Adam(3e-3)",
            "data": "sklearn digits, 1,437 train / 360 test images",
            "per_worker_batch": 32,
            "epochs": args.epochs,
            "rounds": args.rounds,
            "straggler_factor": args.straggler_factor,
            "held_equal": "training examples per run (PS: twice the steps)",
        },
        "runs": runs,
        "summary": rows,
        "ratios": ratios,
    }
    report.write(fields, nice=os.nice(0))


if __name__ == "__main__":
    sys.exit(harness.main(parse_args, run, plot))
