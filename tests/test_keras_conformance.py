"""Keras's own trainer and model tests pass with `DistributedModel`.

Runs `keras/src/trainers/trainer_test.py` and `keras/src/models/model_test.py`
from the installed Keras wheel with the model names rebound to keras_dist's
(`tests/keras_conformance/`, suite `trainer-model`): every test that passes
on stock Keras (the recorded list in `tests/keras_conformance/stock_passing/`)
is one item here and must pass with `DistributedModel`, unless
`exceptions.py` or `known_defects.py` lists it (then it must fail: strict
xfail). `make test` checks every second of them (a fixed stride:
`checks.SAMPLED`), `make test-all` all. The other suites are in
`test_*_conformance.py`.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "keras_conformance"))

import checks


@pytest.mark.slow
@pytest.mark.parametrize("test_id", checks.cases("trainer-model"))
def test_keras_trainer_and_model_tests_pass_with_distributed_model(test_id, request):
    # `make test` checks every second test (the substituted run runs those
    # alone); `make test-all` all of them.
    everything = request.config.getoption("extended")
    checks.check("trainer-model", test_id, everything)
