"""Worker functions for test_local_sgd_workers.py (`keras_dist.testing.run_workers`).

Each runs in a real MultiWorkerMirroredStrategy worker process and returns
plain Python/NumPy values for the parent to compare.
"""

import inspect

import keras
import numpy as np
import tensorflow as tf
from helpers import sharded_dataset
from step_logs_workers import COLLECTIVE_OPS

import keras_dist

EXAMPLES, BATCH, EPOCHS = 90, 20, 2


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, 5)).astype("float32")
    y = rng.integers(0, 3, size=(EXAMPLES,)).astype("int32")
    return x, y


def network():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return keras_dist.DistributedModel(inputs, keras.layers.Dense(3)(hidden))


def momentum():
    return keras.optimizers.SGD(0.1, momentum=0.9)


VARIANTS = {
    "sync": momentum,
    "local_sgd_1": lambda: keras_dist.LocalSGDOptimizer(momentum(), 1),
    "diloco_1": lambda: keras_dist.DiLoCoOptimizer(
        momentum(), 1, outer_optimizer=keras.optimizers.SGD(1.0)
    ),
    "local_sgd_3": lambda: keras_dist.LocalSGDOptimizer(momentum(), 3),
    "diloco_3": lambda: keras_dist.DiLoCoOptimizer(momentum(), 3),
}


def train_variants():
    """Each variant's weights after `EPOCHS` epochs, and the collectives
    of its traced step (`step_collectives`)."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = data()
    # Sharded by data: each worker's part of a global batch is its slice.
    dataset = sharded_dataset(x, y, BATCH)
    results = {}
    for name, optimizer in VARIANTS.items():
        with strategy.scope():
            model = network()
            model.compile(
                optimizer=optimizer(),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        model.fit(dataset, epochs=EPOCHS, shuffle=False, verbose=0)
        spread = max(
            float(np.max(np.abs(values[0] - values[-1])))
            for values in (
                [t.numpy() for t in strategy.experimental_local_results(v.value)]
                for v in model.weights
            )
        )
        results[name] = {
            "weights": model.get_weights(),
            "collectives": step_collectives(
                model, iter(strategy.experimental_distribute_dataset(dataset))
            ),
            "local_spread": spread,
        }
    return results


def step_collectives(model, iterator):
    """The collectives of one call of `model.train_function` (one step).

    Counted in the traced graph, nested functions included. A `cond`
    counts its branch with the fewest collectives for `"fewest"` and the
    one with the most for `"most"` (a step of local SGD either stays local
    or syncs). `"bytes"` is each count's payload: the elements of every
    collective's input, at its dtype's size.
    """
    step_on_iterator = inspect.getclosurevars(model.train_function).nonlocals[
        "step_on_iterator"
    ]
    graph = step_on_iterator.get_concrete_function(iterator).graph
    graph_def = graph.as_graph_def(add_shapes=True)
    library = {f.signature.name: f for f in graph_def.library.function}

    def count(nodes, pick):
        total = np.zeros(2, dtype=np.int64)  # collectives, bytes
        for node in nodes:
            attr = node.attr
            if node.op in COLLECTIVE_OPS:
                total += (1, _payload(node))
            elif node.op in ("If", "StatelessIf"):
                branches = [
                    count(library[attr[b].func.name].node_def, pick)
                    for b in ("then_branch", "else_branch")
                ]
                total += pick(branches, key=lambda c: (c[0], c[1]))
            elif node.op in ("While", "StatelessWhile"):
                raise AssertionError("counted at steps_per_execution=1 only")
            elif "f" in attr and attr["f"].func.name in library:
                total += count(library[attr["f"].func.name].node_def, pick)
        return total

    fewest, most = count(graph_def.node, min), count(graph_def.node, max)
    return {
        "fewest": int(fewest[0]),
        "most": int(most[0]),
        "fewest_bytes": int(fewest[1]),
        "most_bytes": int(most[1]),
    }


def _payload(node):
    """Bytes of a collective's first input, from the node's output shape
    (an all-reduce's output is its input's shape)."""
    shapes = node.attr["_output_shapes"].list.shape
    if not shapes or any(d.size < 0 for d in shapes[0].dim) or shapes[0].unknown_rank:
        return 0
    elements = int(np.prod([d.size for d in shapes[0].dim]))
    dtype = tf.as_dtype(node.attr["T"].type) if "T" in node.attr else tf.float32
    return elements * dtype.size
