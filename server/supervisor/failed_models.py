"""Model versions that were asked for at start-up but could not be served, and why.

An archive refused at start-up (a manifest that is not JSON, a model-config with
`batchSize: lots`, a handler path that leaves the archive) must not take the other models down,
and must not vanish either: it is listed and described with state FAILED and the reason, its
`/v2/models/{name}/ready` is false, and the whole server is not ready while it is there (a pod
that lacks a model it was asked to serve should not get traffic). Unregistering it, or
registering a fixed archive under its name, clears it. The supervisor's ModelRegistry keeps
them as `FailedModels` and tells frontends about them as versions without workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mariner.server.common.model_settings import ModelSettings
from mariner.server.contracts.types import ModelInfo, ModelState

UNKNOWN_VERSION = "unknown"  # an archive refused before its manifest could be read


@dataclass(frozen=True)
class FailedModel:
    """One version that is not served: what it would have been called, its file, and why."""

    name: str
    version: str
    archive_file: str
    reason: str

    @classmethod
    def of(
        cls, archive: str, reason: str, name: str | None = None, version: str | None = None
    ) -> FailedModel:
        """Named as its manifest says when that much was read, else by the spec or the file."""
        return cls(name or Path(archive).stem, version or UNKNOWN_VERSION, Path(archive).name, reason)

    def info(self, is_default: bool) -> ModelInfo:
        s = ModelSettings()
        return ModelInfo(
            name=self.name,
            version=self.version,
            archive=self.archive_file,
            sha256="",
            handler="",
            is_default=is_default,
            state=ModelState.FAILED,
            batch_size=s.batch_size,
            max_batch_delay_ms=s.max_batch_delay_ms,
            response_timeout_s=s.response_timeout_s,
            queue_size=0,
            min_workers=s.min_workers,
            max_workers=s.max_workers,
            workers=(),
            load_seconds=None,
            error=self.reason,
        )


class FailedModels:
    """The FAILED versions of a server, by (name, version)."""

    def __init__(self) -> None:
        self._failed: dict[tuple[str, str], FailedModel] = {}

    def __bool__(self) -> bool:
        return bool(self._failed)

    def add(self, failed: FailedModel) -> None:
        self._failed[(failed.name, failed.version)] = failed

    def every(self) -> list[FailedModel]:
        return [self._failed[k] for k in sorted(self._failed)]

    def of_model(self, model: str, version: str | None = None) -> list[FailedModel]:
        """The failed versions of `model` (only `version` when given and not "all")."""
        return [
            f for f in self.every() if f.name == model and (version in (None, "all") or f.version == version)
        ]

    def clear(self, model: str, version: str | None = None) -> bool:
        """Forget `model`'s failed versions (only `version` when given); whether any was there."""
        gone = self.of_model(model, version)
        for f in gone:
            del self._failed[(f.name, f.version)]
        return bool(gone)
