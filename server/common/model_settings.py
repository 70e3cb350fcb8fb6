"""One resolution of a model version's serving settings, from every place a user can set them.

Layers, lowest to highest (a higher layer wins for each setting it gives), in TorchServe 0.12's
order (ModelServer.initModelStore, ModelManager.createModel, ApiUtils.handleRegister):

1. built-in defaults, TorchServe's: batchSize 1, maxBatchDelay 100 ms, responseTimeout 120 s,
   startupTimeout 120 s,
   job queue 100 items, and per model as many workers as GPUs, else CPU cores, for a model
   loaded at start-up, and none for a model registered later (TorchServe's register: 0 workers
   unless initial_workers, the archive, models= or default_workers_per_model say otherwise),
2. server-wide defaults: config.properties `default_workers_per_model`,
   `default_response_timeout`, `default_startup_timeout`, `job_queue_size` (or their `TS_*`
   variables),
3. config.properties `models={"name": {"version": {...}}}`, this model version's entry,
4. the archive's model-config YAML (what the model author shipped): it beats `models=`, as in
   TorchServe,
5. Mariner's own server flags / MARINER_* environment / our YAML config file (`--batch-size`,
   `--max-batch-delay-ms`, `--min-workers`, `--response-timeout-s`, `--max-queue`): an
   operator's explicit override of every model (TorchServe has no such flags; our benchmark
   scales workers with them, so they stay above the archive),
6. the management register call's parameters (REST POST /models, gRPC RegisterModel), for
   that registration only.

Where TorchServe differs (its archive's responseTimeout and workers beat a register call; it
reads `maxBatchDelay: 0` as unset...), Mariner's choice and why: docs/torchserve-config.md.

Every layer is parsed and checked by `SettingsOverrides.parse`, so a bad value fails the same way
wherever it came from: a ServingError(INVALID_ARGUMENT) naming the field, the value, what is
allowed, and where the value came from. Start-up and both register paths go through
`resolve_model_settings` over `ServerLayers.for_model`; nothing else turns a config value into a
number.

The layers' parts live beside this module, each with what reads it: `settings_layers`
(the server-wide layers and where each comes from), `archive_settings` (the archive's
model-config, its token settings too) and `register_settings` (a register call's parameters).
This module is what they share: the fields, their checks, the resolved settings and the merge.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mariner.server.contracts.setting_values import device_type as _device_type
from mariner.server.contracts.setting_values import non_negative_or_positive as _number
from mariner.server.contracts.setting_values import positive_int as _positive_int

# Our field name -> TorchServe's model-config key (the name users see in messages and YAML).
TS_KEYS: dict[str, str] = {
    "batch_size": "batchSize",
    "max_batch_delay_ms": "maxBatchDelay",
    "response_timeout_s": "responseTimeout",
    "startup_timeout_s": "startupTimeout",
    "min_workers": "minWorkers",
    "max_workers": "maxWorkers",
    "max_queue": "maxQueue",
    "device_type": "deviceType",
}
# TorchServe's model-config name for the queue (ModelConfig.jobQueueSize), read beside ours.
TS_KEY_ALIASES: dict[str, str] = {"max_queue": "jobQueueSize"}
# TorchServe's built-in defaults (ModelManager, ConfigManager, RegisterModelRequest).
DEFAULT_BATCH_DELAY_MS = 100.0
DEFAULT_RESPONSE_TIMEOUT_S = 120.0
DEFAULT_STARTUP_TIMEOUT_S = 120.0  # a worker's start: process, imports, handler initialize
DEFAULT_JOB_QUEUE_SIZE = 100
_POSITIVE_INTS = frozenset({"batch_size", "max_queue"})
_WORKER_COUNTS = frozenset({"min_workers", "max_workers"})  # 0: registered without a worker


def _checked(name: str, value: Any, source: str, key: str | None = None) -> Any:
    """`value` checked and converted for our field `name`; errors call it `key` (default: its
    model-config name)."""
    key = key or TS_KEYS[name]
    if name in _POSITIVE_INTS:
        return _positive_int(key, value, source)
    if name in _WORKER_COUNTS:
        return _positive_int(key, value, source, zero_ok=True)
    if name in ("max_batch_delay_ms", "startup_timeout_s"):  # startupTimeout 0: no time to start
        return _number(key, value, source, zero_ok=True)
    if name == "response_timeout_s":
        return _number(key, value, source, zero_ok=False)
    return _device_type(key, value, source)


@dataclass(frozen=True)
class SettingsOverrides:
    """The settings one layer gives; None means "this layer does not say".

    Constructing one checks every given value (so typed values from code are held to the same
    rules as text from a file); `parse` reads TorchServe's model-config keys from any mapping.
    """

    batch_size: int | None = None
    max_batch_delay_ms: float | None = None
    response_timeout_s: float | None = None
    min_workers: int | None = None
    max_workers: int | None = None
    max_queue: int | None = None
    device_type: str | None = None
    startup_timeout_s: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                object.__setattr__(self, f.name, _checked(f.name, value, ""))

    @classmethod
    def parse(cls, values: Mapping[str, Any], source: str) -> SettingsOverrides:
        """Read TorchServe's keys (batchSize, maxBatchDelay, ...) from `values`; other keys are
        ignored (a model-config holds handler settings too). `source` is named in errors."""
        given = {name: values[key] for name, key in TS_KEYS.items() if values.get(key) is not None}
        for name, alias in TS_KEY_ALIASES.items():
            if name not in given and values.get(alias) is not None:
                given[name] = values[alias]
        return cls(**{name: _checked(name, value, source) for name, value in given.items()})

    def given(self) -> dict[str, Any]:
        """The settings this layer gives, by our field names (for keyword arguments)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class ModelSettings:
    """A model version's resolved serving settings: what the endpoint, batcher and describe use.

    `device_type` is None when no layer asked for a device (the runner then uses a GPU when
    there is one). The worker counts' default here is one; `ServerLayers` puts TorchServe's
    (GPUs, else cores) under every model loaded at start-up.
    """

    batch_size: int = 1
    max_batch_delay_ms: float = DEFAULT_BATCH_DELAY_MS
    response_timeout_s: float = DEFAULT_RESPONSE_TIMEOUT_S
    min_workers: int = 1
    max_workers: int = 1
    max_queue: int = DEFAULT_JOB_QUEUE_SIZE
    device_type: str | None = None
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S


# The settings a config snapshot records per version (TorchServe's Model.getModelState), read
# back as that version's top layer when the snapshot is restored.
SNAPSHOT_KEYS = (
    "minWorkers",
    "maxWorkers",
    "batchSize",
    "maxBatchDelay",
    "responseTimeout",
    "startupTimeout",
)


def snapshot_state(settings: ModelSettings) -> dict[str, int]:
    """`settings` under TorchServe's snapshot keys, in its whole units (ms, s)."""
    return {
        "minWorkers": settings.min_workers,
        "maxWorkers": settings.max_workers,
        "batchSize": settings.batch_size,
        "maxBatchDelay": round(settings.max_batch_delay_ms),
        "responseTimeout": round(settings.response_timeout_s),
        "startupTimeout": round(settings.startup_timeout_s),
    }


def resolve_model_settings(*layers: SettingsOverrides) -> ModelSettings:
    """Merge `layers` (lowest first) over the defaults; the highest layer giving a setting wins.

    maxWorkers is never below minWorkers: raising minWorkers at a higher layer (a flag, a
    register call's initial_workers) raises maxWorkers with it rather than failing.
    """
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update(layer.given())
    min_workers = merged.get("min_workers", ModelSettings.min_workers)
    merged["max_workers"] = max(min_workers, merged.get("max_workers", min_workers))
    return ModelSettings(**merged)
