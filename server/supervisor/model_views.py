"""What the supervisor's model table says: lookups, listings, readiness and the table frontends
follow. Read-only views over the versions `ModelRegistry` (which changes them) holds; apart
from it so the lifecycle module holds only the lifecycle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mariner.server.common.model_settings import snapshot_state
from mariner.server.common.models import SERVED_STATES, resolve_version, version_ready
from mariner.server.contracts.errors import ServingError
from mariner.server.contracts.types import ModelInfo
from mariner.server.contracts.worker_api import ModelEntry
from mariner.server.supervisor.failed_models import FailedModels
from mariner.server.supervisor.versions import Version, failed_entry, model_info, table_entry


class ModelViews:
    """The model versions served (`_versions`, by name then version), each model's default
    version, the models refused at start-up, and every question asked of them."""

    def __init__(self, frontends_ok: Callable[[], bool]) -> None:
        self.draining = False
        self._versions: dict[str, dict[str, Version]] = {}
        self._defaults: dict[str, str] = {}
        self._failed = FailedModels()  # asked for at start-up, refused (see supervisor.failed_models)
        self._registering: set[tuple[str, str]] = set()  # not part of readiness until registered
        self._frontends_ok = frontends_ok

    def _every(self) -> list[Version]:
        return [v for vs in self._versions.values() for v in vs.values()]

    def worker_pids(self) -> list[int]:
        return [
            i.process.pid
            for vs in self._versions.values()
            for v in vs.values()
            for i in v.instances.values()
            if i.process is not None and i.process.pid is not None and i.process.returncode is None
        ]

    # -- what frontends learn ---------------------------------------------------------------------
    def table(self) -> tuple[ModelEntry, ...]:
        """Every version as frontends must know it (see `versions.table_entry`); a FAILED one
        as a version without workers, so each frontend's readiness says it is missing."""
        served = tuple(
            table_entry(v, self._defaults.get(v.name) == v.version)
            for name in sorted(self._versions)
            for v in self._versions[name].values()
        )
        return served + tuple(
            failed_entry(f, f.name not in self._versions)
            for f in self._failed.every()
            if f.version not in self._versions.get(f.name, {})
        )

    # -- lookups (the management apps' slice of the DataPlane) ----------------------------------
    def resolve(self, model: str, version: str | None = None) -> Version:
        return resolve_version(self._versions, self._defaults, model, version)

    def _info(self, v: Version) -> ModelInfo:
        return model_info(v, self._defaults.get(v.name) == v.version)

    def models(self) -> list[ModelInfo]:
        served = [self._info(v) for name in sorted(self._versions) for v in self._versions[name].values()]
        failed = [f.info(f.name not in self._versions) for f in self._failed.every()]
        return sorted(served + failed, key=lambda i: i.name)

    def describe(self, model: str, version: str | None = None) -> list[ModelInfo]:
        """A model's versions (all of them for None or "all"), FAILED ones included."""
        failed = [f.info(model not in self._versions) for f in self._failed.of_model(model, version)]
        if version is None or version == "all":
            if model not in self._versions:
                if failed:
                    return failed
                self.resolve(model)
            return [self._info(v) for v in self._versions[model].values()] + failed
        if failed and version not in self._versions.get(model, {}):
            return failed
        return [self._info(self.resolve(model, version))]

    def snapshot_models(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Every version served, as a config snapshot records it (TorchServe's getModelState:
        default version, archive, worker counts, batching and timeouts); a version still being
        registered, or refused, is not served yet and is left out."""
        models: dict[str, dict[str, dict[str, Any]]] = {}
        for name in sorted(self._versions):
            for v in self._versions[name].values():
                if (v.name, v.version) in self._registering:
                    continue
                models.setdefault(name, {})[v.version] = {
                    "defaultVersion": self._defaults.get(name) == v.version,
                    "marName": v.spec.archive,
                    **snapshot_state(v.settings),
                    "runtimeType": "python",
                }
        return models

    def known_label(self, model: str, version: str | None) -> tuple[str, str]:
        try:
            v = self.resolve(model, version)
        except ServingError:
            return "unknown", "unknown"
        return v.name, v.version

    def is_live(self) -> bool:
        return True

    def models_ready(self) -> bool:
        """Every model asked for is served with a live worker, or was asked for with none (a
        version still being registered does not count yet: a register in progress does not take
        the server out of rotation). No model at all is ready, as TorchServe's /ping judges it:
        nothing asked for is missing."""
        every = [v for v in self._every() if (v.name, v.version) not in self._registering]
        return not self._failed and all(v.state in SERVED_STATES for v in every)

    def startup_settled(self) -> bool:
        """Every worker's first start has ended (ready or failed): nothing is still loading for
        the first time."""
        return all(i.first is None or i.first.done() for v in self._every() for i in v.instances.values())

    def is_ready(self) -> bool:
        """Every model has a live worker, every frontend is up, and the server is not draining."""
        return not self.draining and self._frontends_ok() and self.models_ready()

    def model_ready(self, model: str, version: str | None = None) -> bool:
        return version_ready(self, model, version)
