"""Writes `docs/matrix.md` from a run of the differential matrix.

    KERAS_DIST_MATRIX_RESULTS=/tmp/matrix.jsonl \\
        .venv/bin/python -m pytest tests/test_matrix.py -n0
    .venv/bin/python tests/diffmatrix/report.py /tmp/matrix.jsonl

The page lists the axes, what is not combined and why, and every case of
the run with what it must show and what it measured. `test_matrix.py`
checks that the page lists the cases the suite runs, with their
expectations, so it cannot fall behind the code.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffmatrix import cases
from diffmatrix.axes import AXES, Case

PAGE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "docs",
    "matrix.md",
)
TABLE_START = "<!-- matrix:start -->"
TABLE_END = "<!-- matrix:end -->"


def expected_text(case: Case) -> str:
    """The expectation of `case`, as the page's column says it."""
    expected = cases.expectation(case)
    if isinstance(expected, cases.Refused):
        return "refused"
    if isinstance(expected, cases.Warned):
        return "warned (differs by design)"
    return f"equal, {expected.tolerance:g}"


def row_cells(case: Case, outcome: dict | None) -> list[str]:
    if outcome is None:
        measured, updates = "not run", ""
    elif not outcome["trained"]:
        measured, updates = outcome["error"].splitlines()[0][:80], ""
    else:
        measured = f"{outcome['max_diff']:.1e}"
        got, want = outcome["iterations"]
        updates = f"{got}" if got == want else f"{got} (stock {want})"
    return [
        case.feature,
        case.optimizer,
        case.input,
        case.piece,
        case.strategy,
        expected_text(case),
        measured,
        updates,
    ]


def table(outcomes: dict) -> str:
    header = [
        "model feature",
        "optimizer",
        "input",
        "piece",
        "strategy",
        "must show",
        "max weight difference",
        "updates",
    ]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * 5 + ["---", "---:", "---:"]) + "|",
    ]
    for case in [*cases.selected(), *cases.multi_worker_sample()]:
        lines.append("| " + " | ".join(row_cells(case, outcomes.get(case.id))) + " |")
    return "\n".join(lines)


def page(outcomes: dict, when: str) -> str:
    axes = "\n".join(
        f"- **{name}**: {', '.join(values)}" for name, values in AXES.items()
    )
    not_combined = "\n".join(
        f"- {what}: {why}." for what, why in cases.NOT_COMBINED.items()
    )
    return f"""# The differential matrix

Every keras_dist piece is trained next to stock Keras on the models,
optimizers and inputs users have, and the weights are compared. A case
passes when they agree to the piece's tolerance (and the number of
updates is the same), or when the piece refuses the combination with an
error that names it, or when a documented difference applies and its
warning is given. Never a silent difference. The test suite runs every
case below (`tests/test_matrix.py`); this page is written from one run of
it.

**The reference** is stock Keras: the same model as a plain `keras.Model`
on one device, with the same global batch; for an accumulating piece, one
batch `k` times larger; for a resumed piece, the uninterrupted run.
Dropout and BatchNormalization draw their masks and statistics per replica
(stock Keras does too), so on 2 replicas their reference is stock Keras on
2 replicas.

**The axes** (the cases are an all-pairs covering: every pair of values
of two axes is in some case; `KERAS_DIST_MATRIX=full` runs the whole
product):

{axes}

Pieces: `model` is `DistributedModel` with the default hook, `model_fp16` /
`model_bf16` with the `FP16` / `BF16` hooks, `accumulate_k` a
`GradientAccumulationOptimizer` with `accumulation_steps=k`, `sharded_k` a
`ShardedOptimizer` with `accumulation_steps=k`, `sharded_variables` a
`ShardedOptimizer` with `shard_by="variables"` (whole variables per
replica), `backup_same` a run stopped
after 7 batches and resumed by `BackupAndRestore(save_freq=5)` on the same
strategy, `backup_sharded_variables` the same with a `ShardedOptimizer`
sharded by whole variables (each replica's owned state in the backup),
`backup_elastic` resumed on one device from 2 replicas or the
other way round, `backup_elastic_accumulate` the same with accumulation 2,
`local_sgd_1` a `LocalSGDOptimizer` with `sync_every=1`, `diloco_1` a
`DiLoCoOptimizer` with `sync_every=1` and the outer `SGD(1.0)` (with SGD,
both are synchronous training). Strategies: none (one device),
`MirroredStrategy` on 2 logical CPUs, and a sample of 8 cases under
`MultiWorkerMirroredStrategy` with 2 worker processes (`multi_worker`),
run twice by the suite: with the default collectives (gloo where PyTorch
is installed) and with TensorFlow's (`KERAS_DIST_COLLECTIVES=tensorflow`,
what a plain install gets), each held to the same bound.
Inputs: 64 examples in batches of 16 (`arrays`), 70 (`arrays_remainder`:
the last batch of each epoch has 6), a seeded, reshuffling `tf.data`
pipeline repeated with `steps_per_epoch`, and a `keras.utils.PyDataset`.

**Not combined**:

{not_combined}

**The documented differences** (each warns; see the guarantees page):
an `Embedding`'s rows summed over an accumulation window (Adam-like
optimizers square each occurrence of a row in stock Keras),
BatchNormalization's statistics per micro-batch under accumulation, and
batch statistics and random masks drawn per replica after an elastic
resize.

## The cases

Measured on {when} with TensorFlow 2.21 and Keras 3.15.1, on CPUs:

```bash
KERAS_DIST_MATRIX_RESULTS=/tmp/matrix.jsonl \\
    .venv/bin/python -m pytest tests/test_matrix.py -n0
.venv/bin/python tests/diffmatrix/report.py /tmp/matrix.jsonl
```

{TABLE_START}
{table(outcomes)}
{TABLE_END}
"""


def read(path: str) -> dict:
    outcomes = {}
    with open(path) as handle:
        for line in handle:
            if line.strip():
                outcome = json.loads(line)
                outcomes[outcome["case"]] = outcome
    return outcomes


def published_rows(path: str = PAGE) -> list[list[str]]:
    """The cells of the page's case table (for the test that keeps it true)."""
    with open(path) as handle:
        text = handle.read()
    body = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip().splitlines()
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in body[2:]]


def main(argv) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    when = datetime.date.today().isoformat()
    with open(PAGE, "w") as handle:
        handle.write(page(read(argv[0]), when))
    print(f"Wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
