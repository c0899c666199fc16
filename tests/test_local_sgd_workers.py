"""Local SGD and DiLoCo in real MultiWorkerMirroredStrategy worker processes.

Two workers train each variant (`local_sgd_workers.py`): one update per
window equals synchronous training; three equal stock Keras models trained
apart and synced by hand (`test_local_sgd.simulate`); and the traced step's
collectives show what a window saves: a local step sends none for the
gradients, a sync sends the weights' changes (and one scalar, the examples).
"""

import keras
import pytest
from helpers import max_abs_diff
from local_sgd_workers import BATCH, EPOCHS, data
from test_local_sgd import simulate

from keras_dist.testing import run_workers


@pytest.fixture(scope="module")
def results():
    import local_sgd_workers

    # TensorFlow's collectives: the counts below are of its collective ops
    # (where PyTorch is installed, `auto` would sum the gradients in gloo).
    first, second = run_workers(
        local_sgd_workers.train_variants,
        num_workers=2,
        env={"KERAS_DIST_COLLECTIVES": "tensorflow"},
        timeout=400,
    )
    for name in first:
        assert max_abs_diff(first[name]["weights"], second[name]["weights"]) == 0.0
    return first


@pytest.mark.multiworker
def test_one_update_per_window_is_synchronous_training(results):
    for name in ("local_sgd_1", "diloco_1"):
        diff = max_abs_diff(results[name]["weights"], results["sync"]["weights"])
        assert diff < 1e-6, name


@pytest.mark.multiworker
def test_windows_equal_replicas_trained_apart_then_synced(results):
    x, y = data()
    assert BATCH == 20  # as `simulate` batches

    def nesterov():
        return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)

    expected = {
        "local_sgd_3": simulate(x, y, 3, epochs=EPOCHS),
        "diloco_3": simulate(x, y, 3, epochs=EPOCHS, outer=nesterov),
    }
    for name, model in expected.items():
        assert results[name]["local_spread"] == 0.0  # fit ends with a sync
        assert max_abs_diff(results[name]["weights"], model.get_weights()) < 1e-5


@pytest.mark.multiworker
def test_a_step_sends_the_gradients_bytes_once_per_window(results):
    parameters = sum(w.size for w in results["sync"]["weights"])
    sync = results["sync"]["collectives"]
    assert sync["fewest"] == sync["most"]  # no branch: every step all-reduces
    for name in ("local_sgd_1", "local_sgd_3", "diloco_3"):
        step = results[name]["collectives"]
        # What every step sends either way (the iterator's vote, the batch
        # size, the logs): the synchronous step without its gradients.
        assert step["fewest"] == sync["fewest"] - 1, name
        assert sync["fewest_bytes"] - step["fewest_bytes"] == 4 * parameters
        # A sync: the weights' changes and the examples each replica saw.
        assert step["most"] - step["fewest"] == 2, name
        assert step["most_bytes"] - step["fewest_bytes"] == 4 * parameters + 4
    # So over H updates the gradient path costs 2 collectives and
    # 4 * parameters + 4 bytes, where synchronous training costs H and
    # H * 4 * parameters: 1/H, plus 4 bytes a window.
