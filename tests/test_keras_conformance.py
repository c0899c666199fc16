"""Keras's own trainer and model tests pass with `DistributedModel`.

Runs `keras/src/trainers/trainer_test.py` and `keras/src/models/model_test.py`
from the installed Keras wheel with the model names rebound to keras_dist's
(`tests/keras_conformance/`), and fails on any test that passes on stock
Keras but not with `DistributedModel`. The stock pass list is recorded once
per Keras version (`tests/keras_conformance/stock_passing/`); where the
installed version has none, stock Keras runs here first.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "keras_conformance"))

import run as conformance

# Tests that cannot apply to a subclass by design, each with its reason.
# Keep it short: anything else that fails is a defect to fix.
EXCEPTIONS: dict[str, str] = {}


@pytest.mark.slow
def test_keras_trainer_and_model_tests_pass_with_distributed_model():
    path = conformance.stock_list_path()
    if path.exists():
        stock = conformance.read_stock_list(path)
    else:
        outcomes = conformance.run("stock")
        stock = {test for test, outcome in outcomes.items() if outcome == "passed"}
    assert len(stock) > 200, f"too few stock tests passed: {len(stock)}"
    outcomes = conformance.run("distributed")
    regressions = sorted(
        test
        for test in stock
        if outcomes.get(test) != "passed" and test not in EXCEPTIONS
    )
    assert not regressions, (
        f"{len(regressions)} Keras tests pass on stock Keras but not with "
        "DistributedModel:\n" + "\n".join(regressions)
    )
    stale = sorted(test for test in EXCEPTIONS if outcomes.get(test) == "passed")
    assert not stale, f"listed as exceptions but passing now: {stale}"
