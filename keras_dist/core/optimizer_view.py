"""What the core knows of an optimizer, which each front end defines."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


def nested_optimizers(optimizer):
    """Yields `optimizer` and every optimizer it wraps (`inner_optimizer`).

    Loss scaling, accumulation and other wrappers of both Keras front ends
    keep what they wrap in `inner_optimizer`.
    """
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        yield optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)


@dataclasses.dataclass(frozen=True)
class OptimizerView:
    """What a hook may know of the optimizer that applies its sums.

    The aggregation path gives it to a hook that defines `bind_optimizer`
    (`DGC`, which applies momentum itself) before `reduce`. Each front end
    builds it from its own optimizer classes, so the core imports neither.

    Attributes:
        optimizers: Tuple. The optimizer and every one it wraps, outermost
            first.
        loss_scale: Callable returning the float32 factor the loss was
            multiplied by (a loss-scaling optimizer's current scale), or
            `None` without loss scaling.
        sgd: String. This front end's plain SGD class, for error messages
            (`"keras.optimizers.SGD"`, `"tf_keras.optimizers.SGD"`).
        sgd_types: Tuple of classes. This front end's SGD classes: a hook
            whose sums must be applied by plain SGD (`DGC`) checks the
            innermost optimizer against them. Empty: not checked.
    """

    optimizers: tuple
    loss_scale: Callable | None = None
    sgd: str = "keras.optimizers.SGD"
    sgd_types: tuple = ()

    @property
    def applying(self):
        """The optimizer that applies the update: the innermost one."""
        return self.optimizers[-1]


def view_of(
    optimizer, loss_scaler_type, read_scale, sgd, sgd_types=()
) -> OptimizerView:
    """The `OptimizerView` of `optimizer`, for a front end's classes.

    Args:
        optimizer: The optimizer (possibly wrapped).
        loss_scaler_type: The front end's loss-scaling optimizer class.
        read_scale: Callable `read_scale(loss_scaler)` returning its current
            scale as a float32 tensor.
        sgd: String. The front end's plain SGD class, for messages.
        sgd_types: Tuple of classes. The front end's SGD classes. Defaults
            to `()`.
    """
    optimizers = tuple(nested_optimizers(optimizer))
    scaler = next((o for o in optimizers if isinstance(o, loss_scaler_type)), None)
    loss_scale = None if scaler is None else (lambda: read_scale(scaler))
    return OptimizerView(
        optimizers=optimizers,
        loss_scale=loss_scale,
        sgd=sgd,
        sgd_types=tuple(sgd_types),
    )
