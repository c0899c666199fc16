"""Train distributed, deploy plain: weights and exports load into stock Keras.

A `DistributedModel` trained with a stateful hook (TopK's error feedback)
saves that state beside its layers; a plain `keras.Model` of the same
architecture loads the same files and ignores it, and `to_keras_model()`
exports a stock model that loads where keras_dist is not installed.
"""

import logging

import keras
import numpy as np
import pytest
from helpers import make_data, run_python

import keras_dist
from keras_dist.compression import TopK


def architecture(cls, **kwargs):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((8,), name="features")
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, name="logits")(hidden)
    return cls(inputs, outputs, **kwargs)


def trained(strategy, hook):
    x, y = make_data()
    with strategy.scope():
        model = architecture(keras_dist.DistributedModel, all_reduce_hook=hook)
        model.compile(
            keras.optimizers.SGD(0.1),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    return model, x


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_weights_with_hook_state_load_into_plain_keras(tmp_path, suffix, mirrored):
    model, x = trained(mirrored(2), TopK(0.1))
    assert model.all_reduce_hook.state_variables  # there is state to skip
    path = str(tmp_path / f"trained{suffix}")
    if suffix == ".keras":
        model.save(path)
    else:
        model.save_weights(path)
    plain = architecture(keras.Model)
    plain.load_weights(path)
    for got, want in zip(plain.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(
        plain.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )


def test_hook_state_round_trips_between_distributed_models(tmp_path, mirrored):
    model, _ = trained(mirrored(2), TopK(0.1))
    path = str(tmp_path / "trained.weights.h5")
    model.save_weights(path)
    saved = [v.numpy() for v in model.all_reduce_hook.state_variables]
    assert any(np.any(s != 0) for s in saved)
    with mirrored(2).scope():
        fresh = architecture(keras_dist.DistributedModel, all_reduce_hook=TopK(0.1))
    fresh.load_weights(path)
    restored = [v.numpy() for v in fresh.all_reduce_hook.state_variables]
    for got, want in zip(restored, saved, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_hook_state_is_skipped_with_a_warning_by_a_stateless_hook(
    tmp_path, caplog, mirrored
):
    model, _ = trained(mirrored(2), TopK(0.1))
    path = str(tmp_path / "trained.weights.h5")
    model.save_weights(path)
    plain_hook = architecture(keras_dist.DistributedModel)
    with caplog.at_level(logging.WARNING, logger="keras_dist.models"):
        plain_hook.load_weights(path)
    assert "hook state" in caplog.text and "skipped" in caplog.text
    np.testing.assert_array_equal(plain_hook.get_weights()[0], model.get_weights()[0])


def test_to_keras_model_exports_a_stock_model(tmp_path, mirrored):
    model, x = trained(mirrored(2), TopK(0.1))
    exported = model.to_keras_model()
    assert not isinstance(exported, keras_dist.DistributedModel)
    assert type(exported).__module__.startswith("keras.")
    path = tmp_path / "exported.keras"
    exported.save(path)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "expected.npy", model.predict(x, verbose=0))
    # A fresh interpreter with no keras_dist import loads and predicts alike.
    code = (
        "import sys, numpy as np, keras\n"
        f"model = keras.saving.load_model({str(path)!r})\n"
        f"x = np.load({str(tmp_path / 'x.npy')!r})\n"
        f"expected = np.load({str(tmp_path / 'expected.npy')!r})\n"
        "np.testing.assert_allclose(model.predict(x, verbose=0), expected,"
        " atol=1e-6)\n"
        "assert 'keras_dist' not in sys.modules\n"
        "print('ok')\n"
    )
    assert run_python(code).stdout.strip().endswith("ok")


def test_to_keras_model_of_a_wrapped_model_is_the_model():
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    assert keras_dist.DistributedModel.from_model(inner).to_keras_model() is inner


def test_to_keras_model_of_a_subclass_says_how_to_deploy():
    class Net(keras_dist.DistributedModel):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    with pytest.raises(TypeError, match=r"Define the same class on `keras\.Model`"):
        Net().to_keras_model()
