"""What keras_dist's optimizer wrappers forward to the optimizer they wrap.

`GradientAccumulationOptimizer` and `ShardedOptimizer` hold an
`inner_optimizer` that does the update, as Keras's `LossScaleOptimizer`
does. What belongs to the update belongs to the inner optimizer: its
variables are listed with the wrapper's, and its learning rate, `iterations`,
clipping, weight-decay exclusions and loss scale factor read and write
through the wrapper. The base arguments are refused on the wrapper by name.
"""

from __future__ import annotations

import keras

from keras_dist._compat import keras_src as _compat
from keras_dist.core.optimizer_view import nested_optimizers

REFUSED_BASE_KWARGS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}
"""Base optimizer arguments a wrapper refuses unless at their default."""


def check_base_kwargs(wrapper_name: str, kwargs: dict) -> None:
    """Raises unless `kwargs` are refused base arguments at their defaults."""
    for name, default in REFUSED_BASE_KWARGS.items():
        if name not in kwargs:
            continue
        value = kwargs.pop(name)
        if value != default:
            raise ValueError(
                f"{wrapper_name} does not support `{name}`. Received: "
                f"{name}={value!r}. Set `{name}` on the `inner_optimizer` "
                "instead."
            )
    if kwargs:
        raise ValueError(
            f"{wrapper_name} does not support arguments: "
            f"{', '.join(f'`{k}`' for k in kwargs)}. Received: {kwargs!r}."
        )


def _forwarded(name: str, to_innermost: bool):
    """A property reading and writing `name` on the wrapped optimizer.

    The base constructor assigns `None` before `inner_optimizer` exists;
    any other value then is refused (the wrapper's own constructor already
    refused it by name).
    """

    def target(self):
        inner = getattr(self, "inner_optimizer", None)
        if inner is None or not to_innermost:
            return inner
        return list(nested_optimizers(inner))[-1]

    def getter(self):
        optimizer = target(self)
        return None if optimizer is None else getattr(optimizer, name)

    def setter(self, value):
        optimizer = target(self)
        if optimizer is not None:
            setattr(optimizer, name, value)
        elif value is not None:
            raise ValueError(
                f"{type(self).__name__} does not support `{name}`. Set it on "
                "the `inner_optimizer` instead."
            )

    return property(
        getter, setter, doc=f"The wrapped optimizer's `{name}` (forwarded)."
    )


class InnerOptimizerWrapper(keras.optimizers.Optimizer):
    """Base of keras_dist's optimizer wrappers: forwards to `inner_optimizer`.

    The subclass's constructor sets `self.inner_optimizer` after calling
    `super().__init__(learning_rate=0.0, name=name)`.
    """

    # A wrapper that sets the factor (a `LossScaleOptimizer` clears it, a
    # `MultiOptimizer` overrides it) must reach the optimizer that unscales,
    # or the gradient is unscaled twice.
    loss_scale_factor = _forwarded("loss_scale_factor", to_innermost=False)
    # Keras's `test_clip_args`: the clipping the inner optimizer does.
    clipnorm = _forwarded("clipnorm", to_innermost=True)
    global_clipnorm = _forwarded("global_clipnorm", to_innermost=True)
    clipvalue = _forwarded("clipvalue", to_innermost=True)

    @property
    def variables(self):
        return _compat.optimizer_own_variables(self) + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        """Number of updates applied (the inner optimizer's iterations)."""
        return self.inner_optimizer.iterations

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Excludes variables from the inner optimizer's weight decay.

        Forwarded to the optimizer that decays (inside loss scaling); see
        `keras.optimizers.Optimizer.exclude_from_weight_decay`.

        Args:
            var_list: List of variables to exclude, or `None`.
            var_names: List of strings: a variable whose name contains any
                of them is excluded. Or `None`.
        """
        innermost = list(nested_optimizers(self.inner_optimizer))[-1]
        innermost.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)
