"""The server-wide layers every model version's settings resolve over, and where each comes from.

`ServerLayers` holds what the server's configuration gives (the built-in start-up worker count,
the `default_*` keys, config.properties `models={...}`, Mariner's flags) and lists a version's
layers in order around its archive's; `LayerSource` names the place a layer comes from, so a
limit can say where the refused worker count was set. Kept apart from `model_settings` (what
one layer is and how layers merge) because this is the order of the layers, not their values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mariner.server.common.model_settings import SettingsOverrides
from mariner.server.contracts.errors import Code, ServingError

# A layer that gives no setting: a version's archive layer when none is passed.
_NO_LAYER = SettingsOverrides()


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

    def for_model(self, *args: Any, **kwargs: Any) -> tuple[SettingsOverrides, ...]:
        """Every server-side layer of this model version with its `archive` layer, lowest first:
        built-in workers, `default_*`, `models={...}`, the archive, flags; `named_for_model`'s
        layers (the same arguments) without where each comes from. The register call's layer
        goes on top."""
        return tuple(layer for _, layer in self.named_for_model(*args, **kwargs))

    def named_for_model(
        self,
        name: str,
        version: str,
        archive_file: str,
        archive: SettingsOverrides = _NO_LAYER,
        *,
        startup: bool = True,
        no_default_workers: bool = False,
    ) -> tuple[tuple[LayerSource | None, SettingsOverrides], ...]:
        """`for_model`'s layers, each with where it comes from (None: the built-in defaults), so
        a limit on a setting can name the place its value was set (`worker_count_origin`).
        `startup`: the model is loaded at start-up (TorchServe's default worker count) rather
        than registered later (no worker, as TorchServe registers it).
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
