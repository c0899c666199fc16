"""Keras's own optimizer tests pass with `GradientAccumulationOptimizer`.

Runs `keras/src/optimizers/*_test.py` (and `schedules/*_test.py`) from the
installed Keras wheel with every optimizer class `Cls` rebound to
`GradientAccumulationOptimizer(Cls(...), accumulation_steps=1)`, and
`loss_scale_optimizer_test.py` a second time with the wrapper outside
`LossScaleOptimizer` (`tests/keras_conformance/`, suite `optimizers`). Each
test that passes stock is one item; see `test_keras_conformance.py`.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "keras_conformance"))

import checks


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("test_id", checks.cases("optimizers"))
def test_keras_optimizer_tests_pass_with_gradient_accumulation(test_id):
    checks.check("optimizers", test_id)
