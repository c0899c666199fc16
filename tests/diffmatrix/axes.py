"""The axes of the differential matrix and how each value is built.

A case is one value per axis: a model feature, an optimizer, an input, a
keras_dist piece and a strategy. Every builder is deterministic (seeded),
so the reference and the candidate of a case start from the same weights
and see the same examples in the same order.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

ROWS = 64  # examples of the divisible inputs: 4 batches of 16
ROWS_REMAINDER = 70  # 4 batches of 16 and one of 6
BATCH = 16
EPOCHS = 2
DATA_STEPS = 4  # steps_per_epoch of the repeated tf.data input
SEED = 3

FEATURES = (
    "dense",
    "conv",
    "embedding",
    "shared",
    "batchnorm",
    "dropout",
    "frozen_same_optimizer",
    "frozen_new_optimizer",
    "unused_weight",
    "two_outputs",
    "mixed_float16",
)
OPTIMIZERS = (
    "sgd_momentum",
    "adam",
    "adamw_exclude",
    "rmsprop",
    "adagrad",
    "lion",
    "adam_schedule",
)
INPUTS = ("arrays", "arrays_remainder", "tf_data", "py_dataset")
PIECES = (
    "model",
    "model_fp16",
    "model_bf16",
    "accumulate_1",
    "accumulate_2",
    "sharded_1",
    "sharded_2",
    "sharded_variables",
    "backup_same",
    "backup_sharded_variables",
    "backup_elastic",
    "backup_elastic_accumulate",
    "local_sgd_1",
    "diloco_1",
)
STRATEGIES = ("none", "mirrored")
AXES = {
    "feature": FEATURES,
    "optimizer": OPTIMIZERS,
    "input": INPUTS,
    "piece": PIECES,
    "strategy": STRATEGIES,
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One point of the matrix."""

    feature: str
    optimizer: str
    input: str
    piece: str
    strategy: str

    @property
    def id(self) -> str:
        return "-".join(dataclasses.astuple(self))

    @classmethod
    def from_id(cls, case_id: str) -> Case:
        return cls(*case_id.split("-"))


# --- Models --------------------------------------------------------------------


class UnusedWeight(keras.layers.Layer):
    """A dense layer with one more weight that its output never uses."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.kernel = self.add_weight(
            shape=(input_shape[-1], self.units), initializer="glorot_uniform"
        )
        self.unused = self.add_weight(shape=(self.units,), initializer="ones")

    def call(self, inputs):
        return inputs @ self.kernel


def build_model(feature: str, base=keras.Model):
    """The model of `feature`, of class `base` (`keras.Model` or
    `keras_dist.DistributedModel`), seeded."""
    keras.utils.set_random_seed(SEED)
    if feature == "conv":
        inputs = keras.Input((6, 6, 1))
        hidden = keras.layers.Conv2D(2, 3, activation="relu")(inputs)
        hidden = keras.layers.Flatten()(hidden)
        return base(inputs, keras.layers.Dense(3)(hidden))
    if feature == "embedding":
        inputs = keras.Input((6,), dtype="int32")
        hidden = keras.layers.Embedding(10, 4)(inputs)
        hidden = keras.layers.Flatten()(hidden)
        return base(inputs, keras.layers.Dense(3)(hidden))
    inputs = keras.Input((6,))
    if feature == "shared":
        shared = keras.layers.Dense(6, activation="tanh", name="shared")
        hidden = shared(shared(inputs))
        return base(inputs, keras.layers.Dense(3)(hidden))
    if feature == "batchnorm":
        hidden = keras.layers.Dense(8)(inputs)
        hidden = keras.layers.BatchNormalization()(hidden)
        hidden = keras.layers.Activation("relu")(hidden)
        return base(inputs, keras.layers.Dense(3)(hidden))
    if feature == "dropout":
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        hidden = keras.layers.Dropout(0.5, seed=SEED)(hidden)
        return base(inputs, keras.layers.Dense(3)(hidden))
    if feature == "unused_weight":
        hidden = UnusedWeight(8, name="with_unused")(inputs)
        return base(inputs, keras.layers.Dense(3)(keras.activations.relu(hidden)))
    hidden = keras.layers.Dense(8, activation="relu", name="first")(inputs)
    if feature == "two_outputs":
        first = keras.layers.Dense(3, name="a")(hidden)
        second = keras.layers.Dense(2, name="b")(hidden)
        return base(inputs, [first, second])
    # dense, frozen_*, mixed_float16 (the policy is set around the build).
    return base(inputs, keras.layers.Dense(3)(hidden))


def loss_of(feature: str):
    if feature == "two_outputs":
        return ["mse", "mae"]
    return "mse"


def loss_weights_of(feature: str):
    return [1.0, 0.5] if feature == "two_outputs" else None


def freeze(model) -> None:
    """The layer a `frozen_*` case freezes after its first fit."""
    model.get_layer("first").trainable = False


# --- Optimizers ------------------------------------------------------------------


def build_optimizer(name: str):
    if name == "sgd_momentum":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    if name == "adam":
        return keras.optimizers.Adam(0.01)
    if name == "adamw_exclude":
        optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.1)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return optimizer
    if name == "rmsprop":
        return keras.optimizers.RMSprop(0.01)
    if name == "adagrad":
        return keras.optimizers.Adagrad(0.1)
    if name == "lion":
        return keras.optimizers.Lion(0.003)
    if name == "adam_schedule":
        schedule = keras.optimizers.schedules.ExponentialDecay(
            0.02, decay_steps=2, decay_rate=0.7
        )
        return keras.optimizers.Adam(schedule)
    raise ValueError(name)


# --- Inputs ----------------------------------------------------------------------


def arrays(feature: str, rows: int):
    """`(x, y)` for `feature`'s model, `rows` examples, seeded."""
    rng = np.random.default_rng(SEED)
    if feature == "conv":
        x = rng.normal(size=(rows, 6, 6, 1)).astype("float32")
    elif feature == "embedding":
        # Ten ids in batches of 16 x 6 lookups: every batch repeats ids.
        x = rng.integers(0, 10, size=(rows, 6)).astype("int32")
    else:
        x = rng.normal(size=(rows, 6)).astype("float32")
    flat = x.reshape(rows, -1).astype("float32")
    y = np.tanh(flat[:, :3] + 0.5 * flat[:, 3:6]).astype("float32")
    if feature == "two_outputs":
        return x, (y, (flat[:, :2] - flat[:, 4:6]).astype("float32"))
    return x, y


class ArraySequence(keras.utils.PyDataset):
    """Batches of arrays in order, as a `keras.utils.PyDataset`."""

    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        window = slice(index * self.batch_size, (index + 1) * self.batch_size)
        y = (
            tuple(part[window] for part in self.y)
            if isinstance(self.y, tuple)
            else self.y[window]
        )
        return self.x[window], y


@dataclasses.dataclass
class FitData:
    """What `fit` is given: `x`, `y`, `batch_size`, `steps_per_epoch`."""

    kwargs: dict
    examples_per_epoch: int


def fit_data(input_kind: str, feature: str, batch: int) -> FitData:
    """The input of `input_kind` at global batch `batch` (a reference of an
    accumulating case gets the micro-batch times the steps)."""
    if input_kind == "arrays_remainder":
        x, y = arrays(feature, ROWS_REMAINDER)
        return FitData(
            {"x": x, "y": y, "batch_size": batch, "shuffle": False}, ROWS_REMAINDER
        )
    x, y = arrays(feature, ROWS)
    if input_kind == "arrays":
        return FitData({"x": x, "y": y, "batch_size": batch, "shuffle": False}, ROWS)
    if input_kind == "py_dataset":
        return FitData({"x": ArraySequence(x, y, batch), "shuffle": False}, ROWS)
    if input_kind == "tf_data":
        # The shuffle's seeds are (global, op): the same global seed for the
        # reference and the candidate, whatever ran before.
        tf.random.set_seed(SEED)
        dataset = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(ROWS, seed=SEED)
            .batch(batch)
            .repeat()
        )
        steps = DATA_STEPS * BATCH // batch
        return FitData({"x": dataset, "steps_per_epoch": steps}, DATA_STEPS * BATCH)
    raise ValueError(input_kind)
