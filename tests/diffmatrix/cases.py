"""Which cases run, and what each must show.

All-pairs covering: every pair of values of two axes that some allowed case
holds is in at least one selected case (greedy, deterministic: each pick is
the allowed case that covers the most pairs not yet covered, ties to the
first in product order). `KERAS_DIST_MATRIX=full` runs the whole product
instead.

An expectation is one of:

- `Equal(tolerance)`: the weights agree with the reference to `tolerance`
  (absolute) and the update counts are equal;
- `Refused(pattern)`: the piece raises an error matching `pattern` before
  it trains;
- `Warned(pattern, tolerance)`: a documented difference: a warning matching
  `pattern` is given, and the weights agree to `tolerance` (`None`: they
  differ by design, only the warning is checked).
"""

from __future__ import annotations

import dataclasses
import itertools
import os

from diffmatrix.axes import AXES, Case

EXACT = 1e-5


@dataclasses.dataclass(frozen=True)
class Equal:
    tolerance: float = EXACT
    kind: str = "equal"


@dataclasses.dataclass(frozen=True)
class Refused:
    pattern: str
    kind: str = "refused"


@dataclasses.dataclass(frozen=True)
class Warned:
    pattern: str
    tolerance: float | None
    kind: str = "warned"


# Combinations that do not make a case, and why (the guarantees page lists
# them).
NOT_COMBINED = {
    "a frozen layer with a backup piece": "the resume is of one `fit`; "
    "freezing between fits is covered by the other pieces",
    "Dropout with accumulation": "the masks are drawn per micro-batch, so "
    "no batch k times larger draws the same ones (equal in distribution "
    "only)",
    "local SGD or DiLoCo on 2 replicas with an optimizer other than SGD": "each "
    "replica's optimizer steps on its own gradient and the weights are "
    "averaged after, which is synchronous training for SGD (with momentum) "
    "only, by design; with one device it is for every optimizer",
}


def allowed(case: Case) -> bool:
    """Whether `case` is a case (see `NOT_COMBINED`)."""
    if case.piece.startswith("backup") and case.feature.startswith("frozen"):
        return False
    if (
        case.piece in PERIODIC
        and case.strategy != "none"
        and case.optimizer != "sgd_momentum"
    ):
        return False
    return not (case.feature == "dropout" and case.piece in ACCUMULATING)


ACCUMULATING = ("accumulate_2", "sharded_2", "backup_elastic_accumulate")
PERIODIC = ("local_sgd_1", "diloco_1")
LOSS_SCALING = r"does not support loss scaling \(the mixed_float16 policy"
ELASTIC = ("backup_elastic", "backup_elastic_accumulate")
# Documented differences: the warning each gives.
SUMMED_ROWS = r"are sparse \(rows of an Embedding.*accumulation_steps=2"
MICRO_BATCH_STATISTICS = r"BatchNormalization layers .* compute their batch statistics"
PER_REPLICA_AFTER_RESIZE = r"elastic resume from \d+ to \d+ replicas with"
AVERAGED_STATISTICS = r"averages the moving statistics of .* at every sync"


def expectation(case: Case):
    """What `case` must show."""
    if case.piece in PERIODIC and case.feature == "mixed_float16":
        return Refused(LOSS_SCALING)
    if case.piece in ELASTIC and case.feature in ("batchnorm", "dropout"):
        return Warned(PER_REPLICA_AFTER_RESIZE, None)
    on_replicas = case.strategy != "none"
    if case.piece in PERIODIC and case.feature == "batchnorm" and on_replicas:
        # Averaged at every sync; stock Keras keeps each replica's copy.
        return Warned(AVERAGED_STATISTICS, None)
    if case.piece in ACCUMULATING and case.feature == "batchnorm":
        return Warned(MICRO_BATCH_STATISTICS, None)
    if (
        case.piece in ACCUMULATING
        and case.feature == "embedding"
        and case.optimizer not in ("sgd_momentum", "lion")
    ):
        return Warned(SUMMED_ROWS, None)
    tolerance = EXACT
    if case.feature == "mixed_float16":
        tolerance = 1e-3
    if case.piece == "model_fp16":
        tolerance = max(tolerance, 1e-3)
    if case.piece == "model_bf16":
        tolerance = max(tolerance, 2e-2)
    return Equal(tolerance)


def product() -> list[Case]:
    return [
        case
        for case in (Case(*values) for values in itertools.product(*AXES.values()))
        if allowed(case)
    ]


def _pairs(case: Case):
    values = dataclasses.astuple(case)
    return {
        (i, values[i], j, values[j])
        for i, j in itertools.combinations(range(len(values)), 2)
    }


def all_pairs(cases: list[Case]) -> list[Case]:
    """A greedy all-pairs covering of `cases` (deterministic)."""
    pairs_of = [_pairs(case) for case in cases]
    uncovered = set().union(*pairs_of)
    chosen = []
    while uncovered:
        best = max(range(len(cases)), key=lambda i: len(pairs_of[i] & uncovered))
        chosen.append(cases[best])
        uncovered -= pairs_of[best]
    return chosen


def selected() -> list[Case]:
    """The cases this run takes: all pairs, or the whole product."""
    everything = product()
    if os.environ.get("KERAS_DIST_MATRIX", "").strip() == "full":
        return everything
    return all_pairs(everything)


# Under MultiWorkerMirroredStrategy (2 worker processes), one case per
# piece: the features, optimizers and inputs rotate. Dropout and
# BatchNormalization are left out (their reference is stock Keras on as many
# replicas, which a worker process cannot build), and so are the elastic
# pieces (test_elastic_workers.py resizes real worker jobs).
MULTI_WORKER_PIECES = (
    "model",
    "model_fp16",
    "model_bf16",
    "accumulate_1",
    "accumulate_2",
    "sharded_1",
    "sharded_2",
    "backup_same",
)
MULTI_WORKER_FEATURES = (
    "embedding",
    "conv",
    "two_outputs",
    "unused_weight",
    "shared",
    "frozen_same_optimizer",
    "mixed_float16",
    "dense",
)


def multi_worker_sample() -> list[Case]:
    """The cases run under MultiWorkerMirroredStrategy."""
    inputs = ("arrays", "arrays_remainder", "tf_data", "py_dataset")
    optimizers = ("adam", "sgd_momentum", "adamw_exclude", "rmsprop", "lion")
    return [
        Case(
            MULTI_WORKER_FEATURES[i],
            optimizers[i % len(optimizers)],
            inputs[i % len(inputs)],
            piece,
            "multi_worker",
        )
        for i, piece in enumerate(MULTI_WORKER_PIECES)
    ]
