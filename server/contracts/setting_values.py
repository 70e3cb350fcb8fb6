"""The checks every serving setting's value goes through (common.model_settings): each turns a
value from YAML, JSON, a properties file, a flag or a register call into a number, or refuses
it with a ServingError(INVALID_ARGUMENT) naming the key, the value, what is allowed and where
it came from."""

from __future__ import annotations

import math
from typing import Any

from mariner.server.contracts.errors import Code, ServingError

DEVICE_TYPES = ("cpu", "gpu")
# The largest count, and the longest delay (ms) or timeout (s), a setting may hold: Java's
# Integer.MAX_VALUE, the most TorchServe itself can hold, so nothing it accepts is refused, and
# no value from a file reaches a timer, a wire field or a snapshot as an unbounded number.
MOST = 2**31 - 1
# deviceIds: at most this many ids, each below it (no machine has more GPUs).
MAX_DEVICE_IDS = 1024


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
    if number > MOST:
        raise bad_value(key, f"at most {MOST}", value, source)
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
    if number > MOST:
        raise bad_value(key, f"at most {MOST}", value, source)
    return number


def device_type(key: str, value: Any, source: str) -> str:
    """One of DEVICE_TYPES, case-insensitive."""
    text = str(value).strip().lower() if isinstance(value, str) else None
    if text not in DEVICE_TYPES:
        raise bad_value(key, "one of " + ", ".join(repr(d) for d in DEVICE_TYPES), value, source)
    return text


def device_ids(key: str, value: Any, source: str) -> tuple[int, ...] | None:
    """GPU ids (TorchServe's deviceIds): a list of integers from 0, or the same comma-separated;
    None for none given. Checked whether or not the machine has a GPU, so an archive that is
    wrong here is refused where it is registered, not where it later meets a GPU."""
    if value is None or value == [] or value == "":
        return None
    allowed = f"a list of at most {MAX_DEVICE_IDS} GPU ids (integers from 0 to {MAX_DEVICE_IDS - 1})"
    if isinstance(value, list | tuple):
        items: list[Any] = list(value)
    elif isinstance(value, str | int) and not isinstance(value, bool):
        items = str(value).split(",")
    else:
        raise bad_value(key, allowed, value, source)
    if len(items) > MAX_DEVICE_IDS:
        raise bad_value(key, allowed, f"{len(items)} ids", source)
    ids: list[int] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int | str):
            raise bad_value(key, allowed, value, source)
        text = str(item).strip()
        if not text.isdigit() or len(text) > 4 or int(text) >= MAX_DEVICE_IDS:
            raise bad_value(key, allowed, value, source)
        ids.append(int(text))
    return tuple(ids)
