"""What `test_step_logs.py` runs in each worker process, and shares with it.

Like `workers.py`, it imports neither pytest nor conftest: the worker
processes import it by name (`keras_dist.testing.run_workers`).
"""

import inspect
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import tensorflow as tf
from helpers import OPTIMIZERS, make_data, mlp, sharded_dataset

import keras_dist
from keras_dist import compression

# 96 examples in batches of 16: 6 steps per epoch, so `steps_per_execution=4`
# runs one full chunk and one partial chunk of 2 per epoch.
EXAMPLES = 96
BATCH = 16
EPOCHS = 2
CHUNK = 4

# The ops that exchange data between replicas or workers.
COLLECTIVE_OPS = frozenset(
    {
        "CollectiveReduce",
        "CollectiveReduceV2",
        "CollectiveReduceV3",
        "CollectiveGather",
        "CollectiveGatherV2",
        "CollectiveAllToAllV2",
        "CollectiveAllToAllV3",
        "CollectiveBcastSend",
        "CollectiveBcastRecv",
        "CollectiveBcastSendV2",
        "CollectiveBcastRecvV2",
        "NcclAllReduce",
    }
)


class BatchLogs(keras.callbacks.Callback):
    """Records the logs of every `on_*_batch_end` call, with its epoch."""

    def __init__(self):
        super().__init__()
        self.epoch = 0
        self.train = []
        self.test = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.train.append((self.epoch, batch, _floats(logs)))

    def on_test_batch_end(self, batch, logs=None):
        self.test.append((self.epoch, batch, _floats(logs)))


def _floats(logs):
    return {key: float(np.asarray(value)) for key, value in (logs or {}).items()}


def fit_logs(
    steps_per_execution, strategy=None, hook=None, run_eagerly=False, jit_compile=False
):
    """Trains the test MLP; returns every log Keras handed out, the weights
    and the collective counts.

    Args:
        steps_per_execution: Int. Compiled into the model.
        strategy: `tf.distribute.Strategy` or `None` (the current one).
        hook: An `AllReduceHook` or `None`.
        run_eagerly: Bool. Compiled into the model.
        jit_compile: Bool. Compiled into the model.
    """
    strategy = strategy or tf.distribute.get_strategy()
    x, y = make_data(n=EXAMPLES)
    # Sharded by data, so every worker's part of a global batch is its slice.
    dataset = sharded_dataset(x, y, BATCH)
    with strategy.scope():
        model = mlp(keras_dist.DistributedModel)
        if hook is not None:
            model.register_all_reduce_hook(hook)
        model.compile(
            optimizer=OPTIMIZERS["adam"](),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=steps_per_execution,
            run_eagerly=run_eagerly,
            jit_compile=jit_compile,
        )
    batch_logs = BatchLogs()
    history = model.fit(
        dataset,
        epochs=EPOCHS,
        validation_data=dataset,
        callbacks=[batch_logs],
        shuffle=False,
        verbose=0,
    )
    evaluation = model.evaluate(dataset, return_dict=True, verbose=0)
    return {
        "history": history.history,
        "train_batches": batch_logs.train,
        "test_batches": batch_logs.test,
        "evaluate": _floats(evaluation),
        "weights": model.get_weights(),
        "collectives": collectives_per_call(
            model, iter(strategy.experimental_distribute_dataset(dataset))
        ),
        "metric_read_collectives": metric_read_collectives(model),
    }


def collectives_per_call(model, iterator):
    """Collective ops one call of `model.train_function` runs on a full chunk.

    Counted in the train function's graph traced for `iterator`, nested
    functions included (see `count_collectives`).

    Returns:
        `{"per_call": ..., "per_loop_step": ...}`: all of one call, and what
        each step inside the `steps_per_execution` loop adds (0 at
        `steps_per_execution=1`). `None` when nothing is traced
        (`run_eagerly`).
    """
    # `train_function` is a Python closure over the traced function.
    step_on_iterator = inspect.getclosurevars(model.train_function).nonlocals.get(
        "step_on_iterator"
    )
    if not isinstance(step_on_iterator, tf.types.experimental.PolymorphicFunction):
        return None
    graph_def = step_on_iterator.get_concrete_function(iterator).graph.as_graph_def()
    loop_trips = model.steps_per_execution - 1
    per_call = count_collectives(graph_def, loop_trips=loop_trips)
    without_loop = count_collectives(graph_def, loop_trips=0)
    return {
        "per_call": per_call,
        "per_loop_step": (per_call - without_loop) // max(loop_trips, 1),
    }


def metric_read_collectives(model):
    """Collective ops of one cross-replica read of the model's metric state."""
    with model.distribute_strategy.scope():
        read = tf.function(model.get_metrics_result).get_concrete_function()
    return count_collectives(read.graph.as_graph_def(), loop_trips=0)


def count_collectives(graph_def, loop_trips):
    """Collective ops one run of `graph_def` executes.

    Nested functions count once per call site, a `while` body `loop_trips`
    times (the train function runs a chunk's first step before its loop),
    a `cond` its larger branch.
    """
    library = {f.signature.name: f for f in graph_def.library.function}

    def count(nodes):
        total = 0
        for node in nodes:
            attr = node.attr
            if node.op in COLLECTIVE_OPS:
                total += 1
            elif node.op in ("While", "StatelessWhile"):
                total += loop_trips * count(library[attr["body"].func.name].node_def)
            elif node.op in ("If", "StatelessIf"):
                total += max(
                    count(library[attr[branch].func.name].node_def)
                    for branch in ("then_branch", "else_branch")
                )
            elif "f" in attr and attr["f"].func.name in library:
                total += count(library[attr["f"].func.name].node_def)
        return total

    return count(graph_def.node)


def multi_worker_fit_logs(hook_names=(None,)):
    """`fit_logs` at `steps_per_execution` 1 and `CHUNK`, under MWMS, for
    each hook named (`None`: the default); `{hook name: {steps: logs}}`."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    results = {}
    for hook_name in hook_names:
        results[hook_name] = {}
        for steps in (1, CHUNK):
            hook = None if hook_name is None else getattr(compression, hook_name)()
            results[hook_name][steps] = fit_logs(steps, strategy=strategy, hook=hook)
    return results
