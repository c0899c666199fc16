"""The differential matrix: every piece against stock Keras, on the models,
optimizers and inputs users have (tests/diffmatrix/).

Each case trains keras_dist's piece and stock Keras's reference for it, and
passes when the piece matches (to its tolerance), refuses the combination
with a clear error, or gives the documented warning of a documented
difference. Never a silent difference. The cases are an all-pairs covering
of the axes (`KERAS_DIST_MATRIX=full`: the whole product); a sample runs
under `MultiWorkerMirroredStrategy` in two real worker processes.
`KERAS_DIST_MATRIX_RESULTS=path` appends each outcome to `path` (JSON
lines), from which `python tests/diffmatrix/report.py` writes the table of
`docs/matrix.md`.
"""

import dataclasses
import json
import os
import re

import pytest
from diffmatrix import cases, report, runner
from diffmatrix.axes import Case

import keras_dist

SELECTED = cases.selected()


def record(outcome) -> None:
    path = os.environ.get("KERAS_DIST_MATRIX_RESULTS")
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps(dataclasses.asdict(outcome)) + "\n")


def check(case: Case, outcome) -> None:
    expected = cases.expectation(case)
    shown = f"{case.id}: {outcome}"
    if isinstance(expected, cases.Refused):
        assert not outcome.trained, shown
        assert re.search(expected.pattern, outcome.error), shown
        return
    assert outcome.trained, shown
    if isinstance(expected, cases.Warned):
        assert any(re.search(expected.pattern, w) for w in outcome.warnings), shown
        if expected.tolerance is None:
            return
    assert outcome.iterations[0] == outcome.iterations[1], shown
    assert outcome.max_diff <= expected.tolerance, shown


@pytest.mark.parametrize("case", SELECTED, ids=[c.id for c in SELECTED])
def test_case(case):
    outcome = runner.run(case)
    record(outcome)
    check(case, outcome)


@pytest.mark.multiworker
@pytest.mark.slow
# Both collective backends of CPU workers: `auto` is gloo where PyTorch is
# installed (here), TensorFlow's collectives what a plain install gets.
@pytest.mark.parametrize(
    "backend", ["auto", pytest.param("tensorflow", marks=pytest.mark.extended)]
)
def test_multi_worker_sample(tmp_path, backend):
    sample = cases.multi_worker_sample()
    results = keras_dist.testing.run_workers(
        runner.run_in_worker,
        num_workers=2,
        args=([c.id for c in sample], str(tmp_path)),
        env={"KERAS_DIST_COLLECTIVES": backend},
        timeout=1200,
    )
    for worker, outcomes in enumerate(results):
        for case, outcome in zip(sample, outcomes, strict=True):
            outcome = runner.Outcome(**outcome)
            if worker == 0 and backend == "auto":
                record(outcome)
            check(case, outcome)


def test_the_covering_holds_every_pair():
    every = cases.product()
    chosen = cases.all_pairs(every)
    wanted = set().union(*(cases._pairs(c) for c in every))
    assert set().union(*(cases._pairs(c) for c in chosen)) == wanted
    assert len(chosen) < len(every) / 20


def test_the_published_matrix_lists_these_cases():
    # docs/matrix.md is written from a run (tests/diffmatrix/report.py);
    # its cases and what each must show are the suite's.
    rows = report.published_rows()
    expected = [*cases.selected(), *cases.multi_worker_sample()]
    assert [row[:5] for row in rows] == [list(c.id.split("-")) for c in expected]
    assert [row[5] for row in rows] == [report.expected_text(c) for c in expected]
    assert all(row[6] != "not run" for row in rows)
