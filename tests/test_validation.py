"""The argument checks every public constructor uses."""

import math

import numpy as np
import pytest

from keras_dist._validation import check_bool, check_choice, check_int, check_real


def test_check_int_accepts_python_and_numpy_ints():
    assert check_int("steps", 4, minimum=1) == 4
    value = check_int("steps", np.int64(4), minimum=1)
    assert value == 4 and type(value) is int
    assert check_int("steps", None, allow_none=True) is None


@pytest.mark.parametrize("value", [True, 2.0, "2", None, np.float32(2)])
def test_check_int_refuses_non_ints_naming_the_argument(value):
    with pytest.raises(TypeError, match=r"`steps` must be an int >= 1\. Received: "):
        check_int("steps", value, minimum=1)


def test_check_int_range_and_hint():
    with pytest.raises(ValueError, match=r"must be an int >= 1 and <= 8\. .* Use 2\."):
        check_int("steps", 9, minimum=1, maximum=8, hint="Use 2.")
    with pytest.raises(ValueError, match=r"steps=0"):
        check_int("steps", 0, minimum=1)


def test_check_real():
    value = check_real("ratio", np.float32(0.5), 0.0, 1.0, low_open=True)
    assert value == 0.5 and type(value) is float
    assert check_real("ratio", 1, 0.0, 1.0) == 1.0
    for bad in (0.0, 1.5, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"`ratio` must be a finite number > 0"):
            check_real("ratio", bad, 0.0, 1.0, low_open=True)
    with pytest.raises(TypeError, match=r"ratio=True \(type bool\)"):
        check_real("ratio", True)
    with pytest.raises(ValueError, match=r"must be a finite number\. Received"):
        check_real("rate", math.inf)


def test_check_bool():
    assert check_bool("flag", np.bool_(True)) is True
    assert check_bool("flag", False) is False
    for bad in (0, 1, "yes", None):
        with pytest.raises(TypeError, match=r"`flag` must be a bool\. Received"):
            check_bool("flag", bad)


def test_check_choice():
    assert check_choice("mode", "sum", ("sum", "first")) == "sum"
    with pytest.raises(ValueError, match=r"must be one of \['sum', 'first'\]"):
        check_choice("mode", "mean", ("sum", "first"))
    # 1 == True in Python; a choice of True does not accept 1.
    with pytest.raises(ValueError):
        check_choice("flag", 1, (True, None))
