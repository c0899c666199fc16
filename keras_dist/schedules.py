"""`ScaledLearningRate`: a learning-rate schedule that `AutoScaleBatch` rescales."""

from __future__ import annotations

import numbers

import keras
import tensorflow as tf

from keras_dist._compat import keras_src as _compat
from keras_dist.core.optimizer_view import nested_optimizers


@keras.saving.register_keras_serializable(package="keras_dist")
class ScaledLearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule times a multiplier that `AutoScaleBatch` sets.

    A Keras `LearningRateSchedule` cannot be assigned a new value while
    training runs, so `AutoScaleBatch` cannot rescale it directly. Wrap the
    schedule in `ScaledLearningRate`: the learning rate at update `t` is then
    `schedule(t) * multiplier`, and the callback sets `multiplier` to the
    batch-size scale factor (with warmup). The schedule keeps its own
    meaning: it is the learning rate of the base batch size, and it advances
    once per optimizer update.

    Args:
        schedule: `keras.optimizers.schedules.LearningRateSchedule`. The
            schedule for the base batch size.

    Example:

    ```python
    schedule = keras_dist.callbacks.ScaledLearningRate(
        keras.optimizers.schedules.CosineDecay(0.1, decay_steps=10_000)
    )
    optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
    callback = keras_dist.callbacks.AutoScaleBatch(
        per_replica_batch_size=32, base_batch_size=256, warmup_epochs=5
    )
    ```
    """

    def __init__(self, schedule):
        if not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            raise TypeError(
                "`schedule` must be a `keras.optimizers.schedules."
                f"LearningRateSchedule`. Received: schedule={schedule!r}. For a "
                "constant learning rate pass a float to the optimizer instead; "
                "AutoScaleBatch rescales it directly."
            )
        self.schedule = schedule
        self.multiplier = tf.Variable(
            1.0,
            trainable=False,
            name="learning_rate_multiplier",
            dtype=tf.float32,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )

    def __call__(self, step):
        value = self.schedule(step)
        return value * tf.cast(self.multiplier, value.dtype)

    def get_config(self):
        return {"schedule": keras.saving.serialize_keras_object(self.schedule)}

    @classmethod
    def from_config(cls, config):
        return cls(keras.saving.deserialize_keras_object(config["schedule"]))


def find_scaled_schedule(optimizer):
    """The `ScaledLearningRate` of `optimizer` or one it wraps, or `None`."""
    # Keras has no public accessor for an optimizer's schedule object (its
    # `learning_rate` returns the schedule's current value), so look for a
    # `ScaledLearningRate` among the attributes of the optimizers, by type.
    for nested in nested_optimizers(optimizer):
        schedule = _compat.find_attribute_of_type(nested, ScaledLearningRate)
        if schedule is not None:
            return schedule
    return None


def has_float_learning_rate(optimizer) -> bool:
    """Whether `optimizer` (through its wrappers) has a float learning rate,
    not a `LearningRateSchedule`: one that can be assigned a new value."""
    innermost = list(nested_optimizers(optimizer))[-1]
    return isinstance(innermost.get_config().get("learning_rate"), numbers.Real)
