"""The checks every serving setting's value goes through (core.model_settings): each turns a
value from YAML, JSON, a properties file, a flag or a register call into a number, or refuses
it with a ServingError(INVALID_ARGUMENT) naming the key, the value, what is allowed and where
it came from."""

from __future__ import annotations

import math
from typing import Any

from mariner.server.core.errors import Code, ServingError

DEVICE_TYPES = ("cpu", "gpu")


def bad_value(key: str, allowed: str, value: Any, source: str) -> ServingError:
    """The error for `value` of `key`: what is allowed, and the layer it came from."""
    where = f" (from {source})" if source else ""
    return ServingError(Code.INVALID_ARGUMENT, f"{key} must be {allowed}, got {value!r}{where}")


def positive_int(key: str, value: Any, source: str, *, zero_ok: bool = False) -> int:
    """An integer >= 1, or >= 0 with `zero_ok` (a worker count: a model may have no worker), a
    whole float or a numeric string too, as YAML and properties give it."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            number = None
    if number is None or number < (0 if zero_ok else 1):
        raise bad_value(key, "an integer >= 0" if zero_ok else "a positive integer", value, source)
    return number


def non_negative_or_positive(key: str, value: Any, source: str, *, zero_ok: bool) -> float:
    """A finite number, >= 0 with `zero_ok` (a delay) else > 0 (a timeout)."""
    number: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
        raise bad_value(key, "a number >= 0" if zero_ok else "a number > 0", value, source)
    return number


def device_type(key: str, value: Any, source: str) -> str:
    """One of DEVICE_TYPES, case-insensitive."""
    text = str(value).strip().lower() if isinstance(value, str) else None
    if text not in DEVICE_TYPES:
        raise bad_value(key, "one of " + ", ".join(repr(d) for d in DEVICE_TYPES), value, source)
    return text
