"""Argument checks with the house error message, in one place.

Every public constructor and function validates its arguments with these
helpers, so the same mistake gets the same message everywhere:

    `name` must be <what>. Received: name=<value> (type <type>). <hint>

A wrong type raises `TypeError`, a value out of range `ValueError`. NumPy
scalars (`np.int64(4)`, `np.float32(0.01)`) are accepted where Python
numbers are, and converted to them; `bool` is never accepted as a number
(`True` is an `int` in Python, never what the caller meant).
"""

from __future__ import annotations

import math
import numbers
import sys

__all__ = ["check_bool", "check_choice", "check_int", "check_real"]


def _received(name, value) -> str:
    return f"Received: {name}={value!r} (type {type(value).__name__})."


def _bounds(minimum, maximum, low_open=False, high_open=False) -> str:
    parts = []
    if minimum is not None:
        parts.append(f"{'>' if low_open else '>='} {minimum}")
    if maximum is not None:
        parts.append(f"{'<' if high_open else '<='} {maximum}")
    return " and ".join(parts)


def _fail(error, name, value, what, hint):
    message = f"`{name}` must be {what}. {_received(name, value)}"
    raise error(f"{message} {hint}" if hint else message)


def check_int(
    name: str,
    value,
    minimum: int | None = None,
    maximum: int | None = None,
    *,
    allow_none: bool = False,
    hint: str = "",
):
    """Returns `value` as a Python int after checking it.

    Args:
        name: String. The argument's name, as the caller wrote it.
        value: What was received.
        minimum: Int or `None`. Smallest allowed value. Defaults to `None`.
        maximum: Int or `None`. Largest allowed value. Defaults to `None`.
        allow_none: Bool. Accept `None` (returned as is). Defaults to
            `False`.
        hint: String. How to fix it, appended to the message.

    Returns:
        `int(value)`, or `None` when allowed and given.

    Raises:
        TypeError: `value` is not an integer (a bool is not one).
        ValueError: `value` is out of range.
    """
    if value is None and allow_none:
        return None
    bounds = _bounds(minimum, maximum)
    what = "an int" + (f" {bounds}" if bounds else "") + (" or None" * allow_none)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(TypeError, name, value, what, hint)
    value = int(value)
    if (minimum is not None and value < minimum) or (
        maximum is not None and value > maximum
    ):
        _fail(ValueError, name, value, what, hint)
    return value


def check_real(
    name: str,
    value,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
    hint: str = "",
):
    """Returns `value` as a finite Python float after checking it.

    Args:
        name: String. The argument's name.
        value: What was received.
        minimum: Float or `None`. Lower bound. Defaults to `None`.
        maximum: Float or `None`. Upper bound. Defaults to `None`.
        low_open: Bool. Exclude `minimum` itself. Defaults to `False`.
        high_open: Bool. Exclude `maximum` itself. Defaults to `False`.
        allow_none: Bool. Accept `None` (returned as is). Defaults to
            `False`.
        hint: String. How to fix it, appended to the message.

    Returns:
        `float(value)`, or `None` when allowed and given.

    Raises:
        TypeError: `value` is not a real number (a bool is not one).
        ValueError: `value` is NaN, infinite or out of range.
    """
    if value is None and allow_none:
        return None
    bounds = _bounds(minimum, maximum, low_open, high_open)
    what = "a finite number" + (f" {bounds}" if bounds else "")
    what += " or None" * allow_none
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(TypeError, name, value, what, hint)
    number = float(value)
    out_of_range = not math.isfinite(number)
    if minimum is not None:
        out_of_range |= number <= minimum if low_open else number < minimum
    if maximum is not None:
        out_of_range |= number >= maximum if high_open else number > maximum
    if out_of_range:
        _fail(ValueError, name, value, what, hint)
    return number


def check_bool(name: str, value, *, hint: str = "") -> bool:
    """Returns `value` as a Python bool; accepts `bool` and `numpy.bool_`.

    Raises:
        TypeError: anything else (`0`, `"yes"`, `None`).
    """
    # NumPy is looked up, not imported: the launcher imports this module and
    # must stay light, and a `numpy.bool_` cannot exist without NumPy loaded.
    numpy = sys.modules.get("numpy")
    if isinstance(value, bool) or (
        numpy is not None and isinstance(value, numpy.bool_)
    ):
        return bool(value)
    _fail(TypeError, name, value, "a bool", hint)


def check_choice(name: str, value, choices, *, hint: str = ""):
    """Returns `value` if it is one of `choices` (compared with `==`).

    Raises:
        ValueError: `value` is not among `choices`.
    """
    if any(value == choice and type(value) is type(choice) for choice in choices):
        return value
    _fail(ValueError, name, value, f"one of {list(choices)!r}", hint)
