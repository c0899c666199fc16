"""keras_dist.noise_scale: the estimator formulas, the moving averages and
the target-batch arithmetic, in plain Python (no TensorFlow in this module;
`test_module_imports_no_framework` checks the module itself in a fresh
interpreter). The end-to-end checks on real gradients are in
tests/test_callbacks.py."""

import dataclasses
import math

import numpy as np
import pytest
from helpers import run_python

from keras_dist.noise_scale import (
    NoiseScaleController,
    NoiseScaleEstimate,
    NoiseScaleMeasurement,
    estimate_noise,
)


def controller(**kwargs):
    kwargs = {
        "num_replicas": 2,
        "per_replica_batch_size": 16,
        "max_batch_size": 1024,
        **kwargs,
    }
    return NoiseScaleController(**kwargs)


def window(gradient_sq_norm, trace_covariance, batch, count=10, replicas=2):
    """Sums over `count` updates of the two squared norms whose expectations
    match `|G|^2` and `tr(Sigma)` at per-replica batch `batch`."""
    local = gradient_sq_norm + trace_covariance / batch
    reduced = gradient_sq_norm + trace_covariance / (batch * replicas)
    return local * count, reduced * count, count


# --- estimate_noise (moved here from tests/test_callbacks.py) ---


def test_estimate_noise_formulas():
    # E|G_b|^2 = |G|^2 + tr(Sigma) / b with |G|^2 = 3, tr(Sigma) = 40, b = 4,
    # R = 2: local 13, reduced 8.
    gradient_sq_norm, trace = estimate_noise(
        13.0, 8.0, num_replicas=2, per_replica_batch=4
    )
    assert gradient_sq_norm == pytest.approx(3.0)
    assert trace == pytest.approx(40.0)
    with pytest.raises(ValueError, match="num_replicas=1"):
        estimate_noise(1.0, 1.0, num_replicas=1, per_replica_batch=4)


def test_estimate_noise_with_more_replicas():
    # R = 4, b = 8: local = 3 + 40 / 8 = 8, reduced = 3 + 40 / 32 = 4.25.
    gradient_sq_norm, trace = estimate_noise(
        8.0, 4.25, num_replicas=4, per_replica_batch=8
    )
    assert gradient_sq_norm == pytest.approx(3.0)
    assert trace == pytest.approx(40.0)


# --- NoiseScaleController.update ---


def test_update_estimates_from_window_means():
    noise = controller(per_replica_batch_size=2)
    # 2 examples x 2 accumulation steps = b 4: the sums of 5 updates of
    # local 13 and reduced 8 give |G|^2 = 3 and tr(Sigma) = 40.
    estimate = noise.update(65.0, 40.0, 5, accumulation_steps=2)
    assert isinstance(estimate, NoiseScaleEstimate)
    assert estimate.gradient_sq_norm == pytest.approx(3.0)
    assert estimate.trace_covariance == pytest.approx(40.0)
    assert estimate.noise_scale == pytest.approx(40.0 / 3.0)
    assert noise.windows == 1


def test_empty_window_changes_nothing():
    noise = controller()
    assert noise.update(0.0, 0.0, 0) is None
    assert noise.windows == 0
    assert math.isnan(noise.noise_scale)


def test_moving_averages_and_their_ratio():
    noise = controller(ema_decay=0.5)
    first = noise.update(*window(2.0, 20.0, batch=16))
    assert noise.ema_gradient_sq_norm == pytest.approx(1.0)
    assert noise.ema_trace_covariance == pytest.approx(10.0)
    # Averages starting at 0 have the ratio of the bias-corrected ones.
    assert first.noise_scale == pytest.approx(10.0)
    second = noise.update(*window(4.0, 20.0, batch=16))
    assert noise.ema_gradient_sq_norm == pytest.approx(0.5 * 1.0 + 0.5 * 4.0)
    assert noise.ema_trace_covariance == pytest.approx(0.5 * 10.0 + 0.5 * 20.0)
    assert second.noise_scale == pytest.approx(15.0 / 2.5)
    assert second.gradient_sq_norm == pytest.approx(4.0)  # this window alone
    assert noise.noise_scale == second.noise_scale


def test_noise_scale_is_nan_before_and_inf_without_a_positive_gradient():
    noise = controller()
    assert math.isnan(noise.noise_scale)
    # A window where the reduced norm is the smaller one: |G|^2 estimate < 0.
    estimate = noise.update(10.0, 1.0, 1)
    assert estimate.gradient_sq_norm < 0
    assert estimate.noise_scale == math.inf


@pytest.mark.parametrize(("decay", "windows"), [(0.9, 10), (0.5, 2), (0.0, 1)])
def test_warm_after_one_over_one_minus_decay_windows(decay, windows):
    noise = controller(ema_decay=decay)
    for _ in range(windows - 1):
        noise.update(*window(1.0, 1000.0, batch=16))
        assert not noise.warm
        assert noise.target_accumulation_steps(1) == 1
    noise.update(*window(1.0, 1000.0, batch=16))
    assert noise.warm
    assert noise.target_accumulation_steps(1) == 2


# --- NoiseScaleController.target_accumulation_steps ---


def warm_controller(noise_scale, **kwargs):
    noise = controller(ema_decay=0.0, **kwargs)
    noise.update(*window(1.0, noise_scale, batch=16))
    assert noise.noise_scale == pytest.approx(noise_scale)
    return noise


def test_target_grows_by_at_most_max_growth_toward_the_noise_scale():
    # B_simple = 161 with 16 x 2 = 32 per micro-step: floor(161 / 32) = 5,
    # reached 1 -> 2 -> 4 -> 5 with max_growth 2, then held.
    noise = warm_controller(161.0)
    steps, path = 1, []
    for _ in range(5):
        steps = noise.target_accumulation_steps(steps)
        path.append(steps)
    assert path == [2, 4, 5, 5, 5]
    assert warm_controller(161.0, max_growth=1.5).target_accumulation_steps(2) == 3


def test_target_stops_at_max_batch_size():
    # floor(100 / 32) = 3 steps at most.
    noise = warm_controller(10_000.0, max_batch_size=100)
    assert noise.target_accumulation_steps(2) == 3
    assert noise.target_accumulation_steps(3) == 3


def test_target_never_shrinks_and_holds_without_an_estimate():
    assert warm_controller(40.0).target_accumulation_steps(4) == 4
    noise = controller(ema_decay=0.0)
    noise.update(10.0, 1.0, 1)  # smoothed |G|^2 < 0: noise scale inf
    assert noise.warm
    assert noise.target_accumulation_steps(3) == 3


def test_controllers_fed_the_same_values_decide_alike():
    first, second = controller(), controller()
    steps = {id(first): 1, id(second): 1}
    rng = np.random.default_rng(0)
    for _ in range(30):
        values = window(1.0, float(rng.uniform(100, 400)), batch=16)
        for noise in (first, second):
            noise.update(*values, accumulation_steps=steps[id(noise)])
            steps[id(noise)] = noise.target_accumulation_steps(steps[id(noise)])
    assert first == second
    assert steps[id(first)] == steps[id(second)] > 1


# --- Arguments and records ---


def test_numpy_scalars_become_python_numbers():
    noise = NoiseScaleController(
        num_replicas=np.int64(4),
        per_replica_batch_size=np.int32(8),
        max_batch_size=np.int64(512),
        ema_decay=np.float32(0.5),
        max_growth=np.float64(1.5),
    )
    assert type(noise.num_replicas) is int
    assert type(noise.ema_decay) is float
    assert noise.ema_decay == 0.5


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_replicas": 1}, ValueError, "num_replicas=1"),
        ({"per_replica_batch_size": 0}, ValueError, "per_replica_batch_size=0"),
        ({"per_replica_batch_size": 2.5}, TypeError, "per_replica_batch_size=2.5"),
        ({"max_batch_size": True}, TypeError, "max_batch_size=True"),
        ({"ema_decay": 1.0}, ValueError, "ema_decay=1.0"),
        ({"ema_decay": "0.9"}, TypeError, "ema_decay='0.9'"),
        ({"max_growth": 1}, ValueError, "max_growth=1"),
        ({"max_growth": math.inf}, ValueError, "max_growth=inf"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        controller(**kwargs)


def test_state_is_not_a_constructor_argument():
    with pytest.raises(TypeError):
        controller(windows=3)
    assert "windows=0" in repr(controller())


def test_measurement_is_a_frozen_record():
    measurement = NoiseScaleMeasurement(
        update=20,
        samples=640,
        gradient_sq_norm=4.0,
        trace_covariance=640.0,
        noise_scale=160.0,
        batch_size=64,
    )
    assert dataclasses.asdict(measurement)["noise_scale"] == 160.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        measurement.batch_size = 128


def test_module_imports_no_framework():
    # A fresh interpreter: this test session has TensorFlow loaded already.
    # `sys.argv = ['-m']` is the command line's import of the package, which
    # skips the package's own TensorFlow imports (as in test_compat.py); what
    # is left is the import of keras_dist.noise_scale itself.
    code = (
        "import sys\n"
        "sys.argv = ['-m']\n"
        "import keras_dist.noise_scale as n\n"
        "c = n.NoiseScaleController(2, 16, 1024)\n"
        "c.update(26.0, 16.0, 2)\n"
        "loaded = {'tensorflow', 'keras'} & set(sys.modules)\n"
        "print(sorted(loaded) or 'none')\n"
    )
    assert run_python(code).stdout == "none\n"
