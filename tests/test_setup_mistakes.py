"""A newcomer's mistakes get a word, not a silent wrong setup (issue 27).

A model built outside the strategy scope trains on one device; one fitted
inside another strategy's scope than its own is named; a parameter-server
option given to another strategy is not dropped silently.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import run_python

import keras_dist


def test_a_model_outside_the_auto_strategy_scope_is_warned_about():
    result = run_python(
        """
        import warnings
        import keras, numpy as np
        import keras_dist

        strategy = keras_dist.auto_strategy(cpu_replicas=2)
        x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")

        def model():
            inputs = keras.Input((4,))
            return keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs))

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outside = model()  # forgot `with strategy.scope():`
            outside.compile("sgd", "mse")
            outside.fit(x, y, verbose=0)
        messages = [str(w.message) for w in caught if "auto_strategy" in str(w.message)]
        assert len(messages) == 1, messages  # once per model
        print(messages[0])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with strategy.scope():
                inside = model()
                inside.compile("sgd", "mse")
            inside.fit(x, y, verbose=0)
        assert not [w for w in caught if "auto_strategy" in str(w.message)]
        """
    )
    assert "trains on 1 replica(s) instead of 2" in result.stdout
    assert "with strategy.scope():" in result.stdout


def test_a_model_fitted_in_another_strategys_scope_is_named(mirrored):
    inputs = keras.Input((4,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    with (
        mirrored(2).scope(),
        pytest.raises(
            ValueError,
            match=r"created under no strategy scope \(one device\) but is used "
            r"inside the scope of MirroredStrategy \(2 replicas\)",
        ),
    ):
        model.fit(x, y, verbose=0)


def test_a_variable_partitioner_outside_parameter_servers_is_a_warning(
    monkeypatch, caplog
):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner()
    with caplog.at_level(logging.WARNING, logger="keras_dist.strategy"):
        keras_dist.auto_strategy(variable_partitioner=partitioner)
    assert "does not use variable_partitioner" in caplog.text
    assert "it is ignored" in caplog.text
