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
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path, PurePosixPath
from typing import Any

from mariner.server.common.archive_fields import inside
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.setting_values import bad_value as _bad
from mariner.server.contracts.setting_values import device_ids as _device_ids
from mariner.server.contracts.setting_values import device_type as _device_type
from mariner.server.contracts.setting_values import non_negative_or_positive as _number
from mariner.server.contracts.setting_values import positive_int as _positive_int

log = logging.getLogger("mariner.management")

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
_ALIASES: dict[str, str] = {"max_queue": "jobQueueSize"}
# TorchServe's built-in defaults (ModelManager, ConfigManager, RegisterModelRequest).
DEFAULT_BATCH_DELAY_MS = 100.0
DEFAULT_RESPONSE_TIMEOUT_S = 120.0
DEFAULT_STARTUP_TIMEOUT_S = 120.0  # a worker's start: process, imports, handler initialize
DEFAULT_JOB_QUEUE_SIZE = 100
_POSITIVE_INTS = frozenset({"batch_size", "max_queue"})
_WORKER_COUNTS = frozenset({"min_workers", "max_workers"})  # 0: registered without a worker
# The archive's length-aware batching keys (see `token_settings`).
TOKEN_KEYS = ("maxBatchTokens", "tokenCounter")
_TOKEN_COUNTER_KEYS = frozenset({"tokenizer", "maxLength"})
DEFAULT_TOKEN_MAX_LENGTH = 512  # BERT-style encoders' position limit, when tokenCounter omits it


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
        for name, alias in _ALIASES.items():
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


def _entry_for(versions: Any, version: str, archive_file: str) -> Mapping[str, Any]:
    """Pick the `models={...}` entry for one archive: the one naming it by marName, else the one
    keyed by its version, else the entry marked defaultVersion (TorchServe's own fallback)."""
    if not isinstance(versions, Mapping):
        return {}
    entries = [(str(k), v) for k, v in versions.items() if isinstance(v, Mapping)]
    for _, entry in entries:
        if entry.get("marName") == archive_file:
            return entry
    for key, entry in entries:
        if key == version and entry.get("marName") in (None, archive_file):
            return entry
    for _, entry in entries:
        if entry.get("defaultVersion"):
            return entry
    return {}


def default_workers(gpus: int, cores: int) -> int:
    """TorchServe's workers per model when nothing sets them (ConfigManager.getDefaultWorkers):
    one per GPU when there are GPUs, else one per CPU core."""
    return max(1, gpus if gpus > 0 else cores)


@dataclass(frozen=True)
class ServerLayers:
    """The server-wide layers: the built-in start-up worker count, the `default_*` keys,
    config.properties `models={...}`, and Mariner's flags/env (see the module docstring).

    Every `models` entry is checked when this is built, so a typo in config.properties stops
    the server at start-up with the field named, even for a model loaded only later.
    """

    per_model: Mapping[str, Any] = field(default_factory=dict)
    flags: SettingsOverrides = SettingsOverrides()
    defaults: SettingsOverrides = SettingsOverrides()
    startup_workers: int = 1

    def __post_init__(self) -> None:
        for name, versions in self.per_model.items():
            if not isinstance(versions, Mapping):
                raise ServingError(
                    Code.INVALID_ARGUMENT,
                    f"config.properties models[{name!r}] must map versions to settings, got {versions!r}",
                )
            for version, entry in versions.items():
                if isinstance(entry, Mapping):
                    SettingsOverrides.parse(entry, self._source(name, str(version)))

    @staticmethod
    def _source(name: str, version: str) -> str:
        return f"config.properties models[{name!r}][{version!r}]"

    def models_entry(self, name: str, version: str, archive_file: str) -> SettingsOverrides:
        """This model version's config.properties `models={...}` layer."""
        entry = _entry_for(self.per_model.get(name), version, archive_file)
        return SettingsOverrides.parse(entry, self._source(name, version))

    def for_model(
        self,
        name: str,
        version: str,
        archive_file: str,
        archive: SettingsOverrides = SettingsOverrides(),
        *,
        startup: bool = True,
    ) -> tuple[SettingsOverrides, ...]:
        """Every server-side layer of this model version with its `archive` layer, lowest first:
        built-in workers, `default_*`, `models={...}`, the archive, flags. The register call's
        layer goes on top. `startup`: the model is loaded at start-up (TorchServe's default
        worker count) rather than registered later (no worker, as TorchServe registers it)."""
        return tuple(
            layer for _, layer in self.named_for_model(name, version, archive_file, archive, startup=startup)
        )

    def named_for_model(
        self,
        name: str,
        version: str,
        archive_file: str,
        archive: SettingsOverrides = SettingsOverrides(),
        *,
        startup: bool = True,
        no_default_workers: bool = False,
    ) -> tuple[tuple[LayerSource | None, SettingsOverrides], ...]:
        """`for_model`'s layers, each with where it comes from (None: the built-in defaults), so
        a limit on a setting can name the place its value was set (`worker_count_origin`).
        `no_default_workers`: a register call said `initial_workers=0` (or less), which TorchServe
        reads as "no worker" over `default_workers_per_model` but under the archive's count."""
        workers = self.startup_workers if startup else 0
        defaults = self.defaults
        if no_default_workers:
            defaults = replace(defaults, min_workers=None, max_workers=None)
        return (
            (None, SettingsOverrides(min_workers=workers, max_workers=workers)),
            (LayerSource("default_workers_per_model", "the server's config"), defaults),
            (
                LayerSource("minWorkers", self._source(name, version)),
                self.models_entry(name, version, archive_file),
            ),
            (LayerSource("minWorkers", f"the model-config of {archive_file}"), archive),
            (LayerSource("min_workers", FLAGS_SOURCE), self.flags),
        )


@dataclass(frozen=True)
class LayerSource:
    """Where a settings layer comes from, as a limit's refusal names it: `worker_key` is the
    name its worker count is given under there, `source` the place."""

    worker_key: str
    source: str


# The register call's layer (REST POST /models, gRPC RegisterModel): its count is initial_workers.
REGISTER_CALL = LayerSource("initial_workers", "the register call")
FLAGS_SOURCE = "the server's flags, MARINER_* environment or config file"


def worker_count_origin(
    named: Sequence[tuple[LayerSource | None, SettingsOverrides]],
) -> LayerSource | None:
    """Which layer decided the worker count (minWorkers): the highest one that gives it, lowest
    first as `named_for_model` lists them; None when only the built-in default does (one per
    GPU or core at start-up, none for a register call without initial_workers)."""
    origin: LayerSource | None = None
    for source, layer in named:
        if layer.min_workers is not None:
            origin = source
    return origin


def _misspelt(key: str) -> str | None:
    """The key of ours `key` almost is (batch_size, BatchSize -> batchSize), else None."""
    folded = key.replace("_", "").replace("-", "").lower()
    known = (*TS_KEYS.values(), *_ALIASES.values(), *TOKEN_KEYS)
    return next((ts for ts in known if ts.lower() == folded and ts != key), None)


def archive_overrides(model_config: Mapping[str, Any], archive_file: str) -> SettingsOverrides:
    """The archive's model-config YAML as a layer. Keys other than TorchServe's are the
    handler's, except a near miss of one of ours (`batch_size`): that is a typo that would
    silently leave the default in place, so it is refused naming the key meant."""
    source = f"the model-config of {archive_file}"
    for key in model_config:
        meant = _misspelt(str(key))
        if meant is not None:
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f"model-config key {key!r} is not one the server reads; did you mean {meant!r}? "
                f"(from {source})",
            )
    layer = SettingsOverrides.parse(model_config, source)
    _device_ids("deviceIds", model_config.get("deviceIds"), source)  # read by the worker pool
    if layer.min_workers == 0:
        # TorchServe reads an archive's minWorkers only when it is above 0 (ModelServer and
        # ApiUtils.handleRegister): 0 leaves the count to the server, as there.
        log.warning("%s: minWorkers 0 is ignored, as TorchServe ignores it; the server's worker count "
                    "applies", source)  # fmt: skip
        layer = replace(layer, min_workers=None, max_workers=None)
    return layer


@dataclass(frozen=True)
class TokenSettings:
    """An archive's length-aware batching settings (model-config `maxBatchTokens` and
    `tokenCounter`), for models that pad each batch to its longest member.

    `max_batch_tokens` is the budget of padded tokens per batch (rows x longest row, as TEI's
    max_batch_tokens); None counts tokens without a budget (batches are still grouped by
    length). `tokenizer` is the tokenizer.json path as the archive names it; `tokenizer_file`
    the file it resolves to inside the unpacked archive (None when read without the archive's
    directory, as a worker does, which needs only the budget).

    These keys are read from the archive only: the tokenizer is a file of the archive, and the
    budget is tied to the model (its memory per padded token), so a worker merging batches from
    several frontends reads the same budget from the same model-config.
    """

    max_batch_tokens: int | None
    tokenizer: str
    max_length: int
    tokenizer_file: Path | None = None


def token_settings(
    model_config: Mapping[str, Any], archive_file: str, model_dir: Path | None = None
) -> TokenSettings | None:
    """The archive's token settings, checked; None when it sets neither key (batching as before).

    With `model_dir` (the unpacked archive), the tokenizer path must resolve to a file inside it
    (symlinks followed), as every file an archive names must. Errors are ServingError
    (INVALID_ARGUMENT) naming the key, the value, what is allowed and the archive.
    """
    source = f"the model-config of {archive_file}"
    budget_value = model_config.get("maxBatchTokens")
    counter = model_config.get("tokenCounter")
    if budget_value is None and counter is None:
        return None
    budget = None if budget_value is None else _positive_int("maxBatchTokens", budget_value, source)
    if counter is None:
        raise ServingError(
            Code.INVALID_ARGUMENT,
            "maxBatchTokens needs tokenCounter ({tokenizer: <tokenizer.json in the archive>, "
            f"maxLength: <int>}}) to count each request's tokens (from {source})",
        )
    allowed = "a mapping {tokenizer: <path of a tokenizer.json inside the archive>, maxLength: <int>}"
    if not isinstance(counter, Mapping) or not set(counter) <= _TOKEN_COUNTER_KEYS:
        raise _bad("tokenCounter", allowed, counter, source)
    tokenizer = counter.get("tokenizer")
    if not isinstance(tokenizer, str) or not tokenizer.strip():
        raise _bad(
            "tokenCounter.tokenizer", "the path of a tokenizer.json inside the archive", tokenizer, source
        )
    outside = (
        PurePosixPath(tokenizer).is_absolute()
        or tokenizer.startswith(("/", "\\"))
        or ".." in PurePosixPath(tokenizer.replace("\\", "/")).parts
    )
    resolved = None
    if not outside and model_dir is not None:
        resolved = inside(model_dir, tokenizer)
        outside = resolved is None
    if outside:
        raise _bad(
            "tokenCounter.tokenizer",
            "a relative path inside the archive (no '..', no absolute path, no symlink out)",
            tokenizer,
            source,
        )
    if resolved is not None and not resolved.is_file():
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"tokenCounter.tokenizer {tokenizer!r} is not a file of the archive (from {source})",
        )
    max_length = DEFAULT_TOKEN_MAX_LENGTH
    if counter.get("maxLength") is not None:
        max_length = _positive_int("tokenCounter.maxLength", counter["maxLength"], source)
    return TokenSettings(budget, tokenizer, max_length, resolved)
