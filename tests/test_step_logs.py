"""DistributedModel's logs: reduced once per `steps_per_execution` chunk.

Only the last step of a chunk hands its logs to Keras, so only it reads the
metric state across replicas (under MultiWorkerMirroredStrategy one
collective for the metric state and the other log values together). The
logs Keras sees must not change: the reference is the same training at
`steps_per_execution=1`, where every step is a chunk and every step's logs
are reduced.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import make_data, max_abs_diff, mlp
from step_logs_workers import BATCH, CHUNK, EXAMPLES, fit_logs, multi_worker_fit_logs

import keras_dist
from keras_dist import compression
from keras_dist.testing import run_workers

STEPS_PER_EPOCH = EXAMPLES // BATCH


def _chunk_end(batch):
    # Keras reports a partial last chunk at its nominal end (`begin + spe - 1`).
    return min(batch, STEPS_PER_EPOCH - 1)


def assert_same_logs(reference, chunked):
    """`chunked` (steps_per_execution > 1) logged what `reference` (1) did."""
    assert sorted(chunked["history"]) == sorted(reference["history"])
    for key, values in reference["history"].items():
        np.testing.assert_allclose(chunked["history"][key], values, rtol=1e-6)
    for kind in ("train_batches", "test_batches"):
        by_step = {(epoch, batch): logs for epoch, batch, logs in reference[kind]}
        assert chunked[kind], kind
        for epoch, batch, logs in chunked[kind]:
            expected = by_step[(epoch, _chunk_end(batch))]
            assert sorted(logs) == sorted(expected), (kind, epoch, batch)
            for key, value in expected.items():
                np.testing.assert_allclose(logs[key], value, rtol=1e-6)
    assert reference["evaluate"].keys() == chunked["evaluate"].keys()
    for key, value in reference["evaluate"].items():
        np.testing.assert_allclose(chunked["evaluate"][key], value, rtol=1e-6)
    assert max_abs_diff(reference["weights"], chunked["weights"]) < 1e-6


@pytest.mark.parametrize("hook", [None, "FP16"])
def test_chunk_logs_equal_stepwise_logs_on_two_replicas(hook, mirrored):
    strategy = mirrored(2)

    def run(steps):
        return fit_logs(
            steps,
            strategy=strategy,
            hook=None if hook is None else getattr(compression, hook)(),
        )

    reference, chunked = run(1), run(CHUNK)
    # One batch-end call per chunk: a full chunk of 4, then the last 2.
    assert [batch for epoch, batch, _ in chunked["train_batches"] if epoch == 0] == [
        3,
        7,
    ]
    assert_same_logs(reference, chunked)
    if hook is not None:
        assert chunked["history"]["compression_ratio"] == [2.0, 2.0]


def test_chunk_logs_run_eagerly(mirrored):
    strategy = mirrored(2)
    reference = fit_logs(1, strategy=strategy)
    assert_same_logs(reference, fit_logs(CHUNK, strategy=strategy, run_eagerly=True))


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_chunk_logs_one_device(jit_compile):
    reference = fit_logs(1, jit_compile=jit_compile)
    assert_same_logs(reference, fit_logs(CHUNK, jit_compile=jit_compile))


def test_python_iterator_logs(mirrored):
    """The path for Python iterators of batches (`train_on_batch` hands one)."""
    strategy = mirrored(2)
    x, y = make_data(n=3 * BATCH)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    )
    logs = {}
    for steps in (1, CHUNK):
        with strategy.scope():
            model = mlp(keras_dist.DistributedModel)
            model.compile(
                optimizer="sgd",
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
                steps_per_execution=steps,
            )
        first = model.train_on_batch(x[:BATCH], y[:BATCH], return_dict=True)
        # The other two batches in one call: one chunk, reduced once.
        batches = list(dataset)[1:]
        if steps == 1:
            for batch in batches:
                last = model.train_function(iter([batch]))
        else:
            last = model.train_function(iter(batches))
        logs[steps] = [first, {key: float(value) for key, value in last.items()}]
    for one, chunked in zip(logs[1], logs[CHUNK]):
        assert one.keys() == chunked.keys()
        for key, value in one.items():
            np.testing.assert_allclose(chunked[key], value, rtol=1e-6)


HOOKS = (None, "FP16")


@pytest.fixture(scope="module")
def multi_worker_logs():
    """Both hooks' fits in one 2-worker launch: `[worker][hook][steps]`.
    Counts of TensorFlow's collective ops: keep the sums on them (`auto`
    would send the gradients through gloo where PyTorch is installed)."""
    return run_workers(
        multi_worker_fit_logs,
        num_workers=2,
        args=(HOOKS,),
        env={"KERAS_DIST_COLLECTIVES": "tensorflow"},
        timeout=600,
    )


@pytest.mark.multiworker
@pytest.mark.parametrize("hook", HOOKS)
def test_multi_worker_chunk_logs_and_collectives(hook, multi_worker_logs):
    results = [worker[hook] for worker in multi_worker_logs]
    for worker in results:
        reference, chunked = worker[1], worker[CHUNK]
        assert_same_logs(reference, chunked)
        # A step costs its own collectives (the iterator's "any data left"
        # vote; the gradients' all-reduce, two with FP16; the batch-size
        # sum) and, when its logs are reduced, one all-reduce for all of
        # them: the metric state and the other values' means packed
        # together (trainer/logs.py). Before, a cross-replica read cost one
        # per metric variable (Keras's own read, which `fit` still does once
        # per epoch, counts them) and one per other value: 7 and 9 per call
        # at steps_per_execution=1, now 4 and 5.
        metric_reads = chunked["metric_read_collectives"]
        assert metric_reads == 4  # loss and accuracy: total and count each
        step = 1 + (1 if hook is None else 2) + 1
        assert reference["collectives"]["per_call"] == step + 1
        assert chunked["collectives"]["per_loop_step"] == step
    # Both workers hand out the same logs.
    assert_same_logs(results[0][1], results[1][1])


class _MeanOfReplicas(keras.metrics.Metric):
    """A metric whose state is averaged over replicas ("mean" aggregation)."""

    def __init__(self, name="mean_of_replicas", first=False):
        super().__init__(name=name)
        self.level = self.add_variable((), "zeros", name="level", aggregation="mean")
        if first:
            self.first = self.add_variable(
                (), "zeros", name="first", aggregation="only_first_replica"
            )

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.level.assign(keras.ops.mean(y_pred))

    def result(self):
        return self.level * 2.0


def _trained(strategy, make_metrics):
    x, y = make_data(n=2 * BATCH)
    with strategy.scope():
        # Metrics made in the scope: their variables are per replica.
        model = mlp(keras_dist.DistributedModel)
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=make_metrics(),
        )
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model


def test_one_collective_gives_what_a_cross_replica_read_gives(mirrored):
    # The packed path's arithmetic, on 2 logical replicas (under several
    # workers `fit` takes it; the multi-worker tests compare those logs
    # with one device's).
    from keras_dist.trainer import logs as logs_lib

    strategy = mirrored(2)
    model = _trained(
        strategy,
        lambda: [
            "accuracy",
            keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent"),
            _MeanOfReplicas(),
        ],
    )
    outputs = strategy.run(
        lambda: {
            "extra": tf.constant(3.0)
            + tf.cast(
                tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32
            )
        }
    )
    with strategy.scope():
        metrics, means = logs_lib.one_collective(model, outputs)
        expected = model.get_metrics_result()
    names = ["accuracy", "loss", "mean_of_replicas", "xent"]
    assert sorted(metrics) == sorted(expected) == names
    for key, value in expected.items():
        np.testing.assert_allclose(float(metrics[key]), float(value), rtol=1e-6)
    (extra,) = means.values()
    assert float(extra) == 3.5  # (3 + 4) / 2


def test_state_a_sum_cannot_reproduce_keeps_keras_reads(mirrored):
    from keras_dist.trainer import logs as logs_lib

    strategy = mirrored(2)
    model = _trained(strategy, lambda: ["accuracy", _MeanOfReplicas(first=True)])
    with strategy.scope():
        # "only_first_replica" is not a sum over replicas: Keras reads it.
        assert logs_lib.one_collective(model, {}) is None

    class OwnResults(keras_dist.DistributedModel):
        def get_metrics_result(self):
            return {"mine": 1.0}

    with strategy.scope():
        own = OwnResults.from_config(model.get_config())
        own.compile(optimizer="sgd", loss="mse", metrics=["accuracy"])
        assert logs_lib.one_collective(own, {}) is None
