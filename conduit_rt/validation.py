"""Checks of caller-given values: an option or argument is an integer or a finite number in its range,
or a typed error naming it. Options arrive from Python callers and from JSON-decoded requests, so an
integral float (``2.0``) counts as an integer, while ``2.7``, a bool or a string does not."""
from __future__ import annotations

import math
import numbers

from .errors import ConduitError, RequestError

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


def integer(value, name: str, low: int | None = None, high: int | None = None,
            error: type[ConduitError] = RequestError) -> int:
    """``value`` as an int within [low, high] (either bound may be None), or ``error`` naming ``name``."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = int(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer():
        number = int(value)
    else:
        raise error(f"{name} must be an integer{_range(low, high)}, got {value!r}")
    if (low is not None and number < low) or (high is not None and number > high):
        raise error(f"{name} must be an integer{_range(low, high)}, got {number}")
    return number


def real(value, name: str, low: float | None = None, high: float | None = None, low_open: bool = False,
         error: type[ConduitError] = RequestError) -> float:
    """``value`` as a finite float within [low, high] ((low, high] when ``low_open``), or ``error``."""
    where = _range(low, high, low_open)
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(float(value)):
        raise error(f"{name} must be a finite number{where}, got {value!r}")
    number = float(value)
    below = low is not None and (number <= low if low_open else number < low)
    if below or (high is not None and number > high):
        raise error(f"{name} must be a number{where}, got {number}")
    return number


def flag(value, name: str, error: type[ConduitError] = RequestError) -> bool:
    """``value`` if it is a bool, else ``error`` (a truthy string or number is a mistake, not a yes)."""
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False, got {value!r}")
    return value


def set_fields(instance, values: dict) -> None:
    """Stores checked ``values`` (field name -> value) on a frozen dataclass ``instance``."""
    for name, value in values.items():
        object.__setattr__(instance, name, value)


def _range(low, high, low_open: bool = False) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}]"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    if high is not None:
        return f" <= {high}"
    return ""
