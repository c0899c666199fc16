"""Private tf_keras (Keras 2) API that `keras_dist.tf_keras` touches.

Imported only by the tf_keras front end (which imports tf_keras anyway);
no Keras 3. `tests/test_tf_keras.py` pins each touch.
"""

from __future__ import annotations

from tf_keras.src.optimizers import utils as _optimizer_utils
from tf_keras.src.saving import object_registration as _registration


def created_iterations(optimizer):
    """The optimizer's `iterations` variable if it exists, else `None`.

    A legacy (OptimizerV2) optimizer creates it on first access of
    `iterations`, which counts as creating its weights: `set_weights` then
    expects it and assigning `iterations` fails. Reading `_iterations`
    leaves the optimizer as the user made it.
    """
    return getattr(optimizer, "_iterations", None)


def custom_gradient_aggregator(optimizer):
    """A legacy optimizer's own `gradient_aggregator`, or `None`.

    `None` when it is tf_keras's default (its cross-replica sum, which
    keras_dist's hook replaces) or the optimizer has none (the current
    optimizers).
    """
    aggregator = getattr(optimizer, "gradient_aggregator", None)
    if aggregator is None or aggregator is _optimizer_utils.all_reduce_sum_gradients:
        return None
    return aggregator


def save_under_the_name_of(cls, base) -> None:
    """Makes tf_keras save instances of `cls` under `base`'s registered name.

    tf_keras writes an object's class by `get_registered_name(type(obj))`,
    which falls back to the bare class name for a class it does not know.
    Its newer optimizers are known as `Custom>Adafactor`, `Custom>Lion`, ...
    and load only by that name. `DistributedOptimizer`'s class is made at
    run time from the wrapped one; only the class-to-name map learns it
    (the name still loads the plain class).
    """
    name = _registration.get_registered_name(base)
    if name != base.__name__:
        _registration._GLOBAL_CUSTOM_NAMES[cls] = name
