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
    """

    optimizers: tuple
    loss_scale: Callable | None = None
    sgd: str = "keras.optimizers.SGD"
