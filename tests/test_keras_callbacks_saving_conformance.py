"""Keras's own callbacks and saving tests pass with `DistributedModel`.

Runs `keras/src/callbacks/*_test.py` and `keras/src/saving/*_test.py` from
the installed Keras wheel with `Model` and `Sequential` rebound to
keras_dist's (`tests/keras_conformance/`, suites `callbacks` and `saving`).
Each test that passes stock is one item; see `test_keras_conformance.py`.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "keras_conformance"))

import checks


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("test_id", checks.cases("callbacks"))
def test_keras_callbacks_tests_pass_with_distributed_model(test_id):
    checks.check("callbacks", test_id)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("test_id", checks.cases("saving"))
def test_keras_saving_tests_pass_with_distributed_model(test_id):
    checks.check("saving", test_id)
