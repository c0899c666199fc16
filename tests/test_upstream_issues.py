"""The upstream Keras and TensorFlow issues of docs/upstream_issues.md.

Each test first reproduces the issue with stock Keras 3 (its error, or its
result that differs from one device), then shows keras_dist doing the same
job and matching a single-device reference to 1e-5. When a stock half starts
failing, upstream has changed: revisit the page and the test.
"""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    OPTIMIZERS,
    compile_model,
    make_data,
    max_abs_diff,
    mlp,
    sharded_dataset,
)

import keras_dist
from keras_dist.compression import AllReduceHook, all_reduce_sum
from keras_dist.testing import run_workers

EPOCHS = 2
BATCH = 16
UPDATES = EPOCHS * 64 // BATCH  # make_data() has 64 examples


def single_device_weights(optimizer, batch_size=BATCH):
    """The weights after `EPOCHS` of `fit` on one device, in data order."""
    x, y = make_data()
    model = compile_model(mlp(), optimizer)
    model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


def fit_weights(model, batch_size=BATCH):
    x, y = make_data()
    model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


# --- keras-team/keras#20582: gradient accumulation under MirroredStrategy ---


def test_keras_accumulation_fails_under_mirrored_and_keras_dist_equals_big_batch(
    mirrored,
):
    x, y = make_data()
    with mirrored(2).scope():
        stock = compile_model(
            mlp(), keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)
        )
    # Keras's all-reduce sits inside the replica-context `cond` that decides
    # whether this step applies the accumulated gradient.
    with pytest.raises(RuntimeError, match="merge_call` called while defining a new"):
        stock.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    # 2 micro-batches of 8 per replica on 2 replicas make one update of 32.
    reference = single_device_weights(keras.optimizers.Adam(0.01), batch_size=32)
    with mirrored(2).scope():
        optimizer = keras_dist.GradientAccumulationOptimizer(
            keras.optimizers.Adam(0.01), accumulation_steps=2
        )
        model = compile_model(mlp(keras_dist.DistributedModel), optimizer)
    assert max_abs_diff(reference, fit_weights(model)) < 1e-5
    assert int(model.optimizer.iterations.numpy()) == UPDATES // 2


# --- keras-team/keras#20585 and tensorflow/tensorflow#72388: multi-worker ---


def stock_then_distributed_on_two_workers():
    """Runs in each of 2 worker processes: stock Keras, then DistributedModel.

    Returns the error stock `fit` and `train_on_batch` raised (`None` where
    stock Keras trained) and what DistributedModel reached: its weights,
    its `fit` history and the logs of one more `train_on_batch`.
    """
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = make_data()
    # DATA sharding: each worker gets its half of every global batch of 16,
    # so a step sees the examples one device sees with batch 16.
    dataset = sharded_dataset(x, y, BATCH)
    stock_calls = {
        "fit": lambda model: model.fit(dataset, epochs=1, verbose=0),
        # Builds from a NumPy batch, so it gets past the error of `fit` to
        # the reduction of the step's logs (tensorflow/tensorflow#72388).
        "train_on_batch": lambda model: model.train_on_batch(x[:BATCH], y[:BATCH]),
    }
    stock_errors = {}
    for name, call in stock_calls.items():
        with strategy.scope():
            stock = compile_model(mlp(), OPTIMIZERS["momentum"]())
        try:
            call(stock)
            stock_errors[name] = None
        except ValueError as error:
            stock_errors[name] = str(error)
    with strategy.scope():
        model = compile_model(
            mlp(keras_dist.DistributedModel), OPTIMIZERS["momentum"]()
        )
    history = model.fit(dataset, epochs=EPOCHS, verbose=0)
    # Every worker passes the same batch: the global batch is it twice,
    # whose mean loss and gradient are those of the batch on one device.
    logs = model.train_on_batch(x[:BATCH], y[:BATCH], return_dict=True)
    return {
        "stock_errors": stock_errors,
        "weights": model.get_weights(),
        "history": history.history,
        "logs": logs,
    }


@pytest.mark.multiworker
def test_keras_fails_on_two_workers_and_distributed_model_equals_one_device():
    results = run_workers(
        stock_then_distributed_on_two_workers, num_workers=2, timeout=300
    )
    x, y = make_data()
    reference = compile_model(mlp(), OPTIMIZERS["momentum"]())
    history = reference.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0
    )
    logs = reference.train_on_batch(x[:BATCH], y[:BATCH], return_dict=True)
    for worker in results:
        errors = worker["stock_errors"]
        # `fit` first reduces a whole batch with `strategy.reduce`, which
        # MultiWorkerMirroredStrategy cannot do with a PerReplica value.
        assert errors["fit"] is not None, "stock `fit` trained: revisit"
        assert "Attempt to convert a value (PerReplica" in errors["fit"]
        # The step's logs are scalars; Keras reduces them along axis 0.
        message = errors["train_on_batch"]
        assert message is not None, "stock `train_on_batch` trained: revisit"
        assert "Invalid reduction dimension 0 for input with 0 dimensions" in message
        assert max_abs_diff(reference.get_weights(), worker["weights"]) < 1e-5
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(
                worker["history"][key], history.history[key], rtol=1e-5
            )
            np.testing.assert_allclose(worker["logs"][key], logs[key], rtol=1e-5)


# --- Clipping before the all-reduce (no upstream issue number) ---


def test_keras_clips_each_replica_and_keras_dist_clips_the_summed_gradient(mirrored):
    def clipped():
        return keras.optimizers.SGD(0.5, global_clipnorm=0.05)

    reference = single_device_weights(clipped())

    # Control: without clipping, stock Keras on 2 replicas equals one device,
    # so the difference below comes from where it clips.
    with mirrored(2).scope():
        unclipped = compile_model(mlp(), keras.optimizers.SGD(0.5))
    unclipped_reference = single_device_weights(keras.optimizers.SGD(0.5))
    assert max_abs_diff(unclipped_reference, fit_weights(unclipped)) < 1e-5

    with mirrored(2).scope():
        stock = compile_model(mlp(), clipped())
    assert max_abs_diff(reference, fit_weights(stock)) > 1e-3

    with mirrored(2).scope():
        model = compile_model(mlp(keras_dist.DistributedModel), clipped())
    assert max_abs_diff(reference, fit_weights(model)) < 1e-5


# --- keras-team/keras#19308: no public gradient all-reduce hook ---


class HalvedSum(AllReduceHook):
    """Sums over replicas, then halves; records what it was given."""

    def __init__(self):
        super().__init__()
        self.seen_shapes = None

    def build(self, variables):
        super().build(variables)
        self.add_state("calls", (), "int64", aggregation="first", per_variable=False)

    def reduce(self, gradients, variables):
        gradients, _ = self.prepare(gradients, variables)
        self.seen_shapes = [tuple(g.shape) for g in gradients]  # at trace time
        with tf.control_dependencies([self.state("calls").assign_add(1)]):
            return [g * 0.5 for g in all_reduce_sum(gradients)]


def test_keras_has_no_all_reduce_hook_and_a_keras_dist_hook_sets_the_gradient(
    mirrored,
):
    # Keras 2's `apply_gradients(..., skip_gradients_aggregation=True)`, the
    # way to do the all-reduce yourself, is gone: it takes only the gradients.
    variable = keras.Variable(1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'skip_gradie"):
        keras.optimizers.SGD(0.1).apply_gradients(
            [(tf.constant(1.0), variable)], skip_gradients_aggregation=True
        )
    parameters = inspect.signature(keras.optimizers.SGD(0.1).apply_gradients)
    assert list(parameters.parameters) == ["grads_and_vars"]

    # Halving the sum with SGD(0.1) is one device with SGD(0.05): the hook's
    # result, not Keras's own sum, is what the optimizer applies.
    reference = single_device_weights(keras.optimizers.SGD(0.05))
    hook = HalvedSum()
    with mirrored(2).scope():
        model = compile_model(
            mlp(keras_dist.DistributedModel), keras.optimizers.SGD(0.1)
        )
    model.register_all_reduce_hook(hook)
    weights = fit_weights(model)
    assert max_abs_diff(reference, weights) < 1e-5
    assert (
        max_abs_diff(single_device_weights(keras.optimizers.SGD(0.1)), weights) > 1e-3
    )
    assert hook.seen_shapes == [tuple(v.shape) for v in model.trainable_variables]
    assert int(hook.state("calls").numpy()) == UPDATES
    assert int(model.optimizer.iterations.numpy()) == UPDATES
