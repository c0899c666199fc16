"""tf_keras's own optimizer tests pass with `keras_dist.tf_keras.DistributedOptimizer`.

Runs tf_keras's optimizer tests (vendored from keras-team/tf-keras v2.21.0 in
`tests/keras_conformance/tf_keras_v2_21_0/`, as the wheel does not ship
them) with every tf_keras optimizer class `Cls` rebound to
`DistributedOptimizer(Cls(...))` (suite `tf_keras-optimizers`). Each test
that passes stock is one item; see `test_keras_conformance.py`.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "keras_conformance"))

import checks


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("test_id", checks.cases("tf_keras-optimizers"))
def test_tf_keras_optimizer_tests_pass_with_distributed_optimizer(test_id):
    checks.check("tf_keras-optimizers", test_id)
