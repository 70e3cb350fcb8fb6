"""A management register call's settings layer (REST POST /models, gRPC RegisterModel), its
parameters read as TorchServe reads them.

Kept apart from `model_settings` because TorchServe reads these parameters its own way (Java's
Integer.parseInt, sentinels for "not given") and never refuses a registration for their values:
a value it would accept but that cannot work here is left to the lower layers with a warning,
where every other layer's bad value is an error.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from mariner.server.common.model_settings import SettingsOverrides

log = logging.getLogger("mariner.management")

# A register parameter as TorchServe reads it (NettyUtils.getIntParameter: Java's
# Integer.parseInt, so no spaces, no decimals); a JSON body may carry a real number.
_JAVA_INT = re.compile(r"^[+-]?[0-9]{1,10}$")
# What each register parameter means when it is left to the lower layers, for the warning.
_UNSET_MEANS = {
    "batch_size": "the model's batchSize (archive, models=, else 1)",
    "max_batch_delay": "the model's maxBatchDelay (archive, models=, else 100 ms)",
    "response_timeout": "the model's responseTimeout (archive, models=, default_response_timeout, "
    "else 120 s)",
    "startup_timeout": "the model's startupTimeout (archive, models=, default_startup_timeout, else 120 s)",
    "initial_workers": "the model's minWorkers (archive, models=, default_workers_per_model, else no worker)",
}


def _java_int(value: Any) -> int | None:
    """`value` as TorchServe's getIntParameter reads it; None when it is no integer."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _JAVA_INT.match(value):
        number = int(value)
        return number if -(2**31) <= number < 2**31 else None
    return None


def _register_value(param: str, value: Any, *, lowest: int, sentinel: int | None) -> int | None:
    """One register parameter, as TorchServe reads it: absent or empty is "not given"; TorchServe's
    own "not given" value (`sentinel`: -1 for the timeouts, 0 for the worker count) silently too.
    A value TorchServe accepts but that cannot work here (not an integer, or below `lowest`) is
    answered as TorchServe answers it (the registration goes on) with ONE warning naming the
    parameter, the value and what is used instead."""
    if value is None or value == "":
        return None
    number = _java_int(value)
    if number is not None and number == sentinel:
        return None
    if number is not None and number < 0 and param == "initial_workers":
        log.warning(
            "register parameter %s=%r is below 0 (TorchServe accepts it): no worker instead (unless "
            "the archive or models= give minWorkers)", param, str(value)[:80],
        )  # fmt: skip
        return 0
    if number is None or number < lowest:
        why = "is not an integer" if number is None else f"is below {lowest}"
        log.warning(
            "register parameter %s=%r %s (TorchServe accepts it): using %s instead",
            param, str(value)[:80], why, _UNSET_MEANS[param],
        )  # fmt: skip
        return None
    return number


def register_call_overrides(
    *,
    batch_size: Any = None,
    max_batch_delay: Any = None,
    response_timeout: Any = None,
    initial_workers: Any = None,
    startup_timeout: Any = None,
) -> SettingsOverrides:
    """The register call's layer, from REST query/body parameters or gRPC RegisterModelRequest,
    read as TorchServe reads them (RegisterModelRequest, ModelManager.createModel).

    A register call TorchServe accepts is never refused for its values: a value that is not an
    integer, or one TorchServe would use but that cannot work (a batch size or timeout below 1,
    a negative delay), leaves the setting to the lower layers with one warning (see
    `_register_value`). `initial_workers` absent (or not a number) is "not given": TorchServe then
    starts `default_workers_per_model` workers, else none; 0 or less is no worker, though the
    archive's or models= count still wins (`ServerLayers.named_for_model`'s
    `no_default_workers`); it sets minWorkers and maxWorkers both.
    `startup_timeout` 0 is kept: TorchServe's workers then have no time to start. A gRPC caller
    passes None for a max_batch_delay of 0, since proto3 cannot say whether it was set.
    """
    values: dict[str, Any] = {}
    for name, param, value, lowest, sentinel in (
        ("batch_size", "batch_size", batch_size, 1, -1),
        ("max_batch_delay_ms", "max_batch_delay", max_batch_delay, 0, -100),
        ("response_timeout_s", "response_timeout", response_timeout, 1, -1),
        ("startup_timeout_s", "startup_timeout", startup_timeout, 0, -1),
        ("min_workers", "initial_workers", initial_workers, 0, None),
    ):
        number = _register_value(param, value, lowest=lowest, sentinel=sentinel)
        if number is not None:
            values[name] = number
    if "min_workers" in values:
        values["max_workers"] = values["min_workers"]
    return SettingsOverrides(**values)
