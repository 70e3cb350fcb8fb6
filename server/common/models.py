"""What a model version is, as the supervisor and every frontend describe it.

The spec a version was loaded from, its source, the one resolution of its settings and
signature, its ModelInfo, its lookup by name and version, and the answers a call to a version
that cannot serve hears. Shared because the supervisor's registry and a frontend's endpoint must
say the same thing of the same version."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from mariner.server.common.archive import ModelArchive
from mariner.server.common.archive_settings import archive_overrides
from mariner.server.common.batch_policy import max_batch_bytes
from mariner.server.common.model_settings import ModelSettings, SettingsOverrides, resolve_model_settings
from mariner.server.common.settings_layers import (
    REGISTER_CALL,
    LayerSource,
    ServerLayers,
    worker_count_origin,
)
from mariner.server.common.token_cost import load_token_counter
from mariner.server.contracts.errors import Code, ServingError, TorchServeAnswer
from mariner.server.contracts.tensors import ModelSignature
from mariner.server.contracts.types import ModelInfo, ModelState, WorkerInfo

T = TypeVar("T")


def failed_message(name: str, version: str) -> str:
    """What a call to a FAILED version hears (the reason is for operators, in describe)."""
    return (
        f"model {name} version {version} failed to load and is not served; "
        "the management API's describe says why"
    )


def no_worker_message(name: str, version: str | None) -> str:
    """TorchServe's answer (503) to a call to a model registered with no worker, word for word
    (ApiUtils.getStreamingInferenceErrorResponseMessage, its stray quote after a version too)."""
    which = f'Model "{name}' + (f'" Version {version}' if version else "")
    return (
        f'{which}" has no worker to serve inference request. Please use scale workers API to add workers. '
        "If this is a sequence inference, please check if it is closed, or expired; or exceeds "
        "maxSequenceJobQueueSize"
    )


@dataclass(frozen=True)
class ModelSpec:
    """One model to load: an archive file in the store, the name to serve it under, and the
    register call's settings (the top layer; empty for models loaded at start-up)."""

    archive: str
    name: str | None = None
    overrides: SettingsOverrides = SettingsOverrides()
    sha256: str | None = None
    loaded_at_startup: bool = True


@dataclass(frozen=True)
class ModelSource:
    """Where a served version came from, as management shows it."""

    archive_file: str
    sha256: str
    handler: str
    loaded_at_startup: bool = True


def resolve_model(
    archive: ModelArchive, spec: ModelSpec, *, default_max_queue: int | None, layers: ServerLayers
) -> tuple[ModelSettings, ModelSignature | None]:
    """The one resolution of a version's settings and signature.

    Settings: defaults < default_* < config.properties models= < archive model-config <
    flags/env < register call (common.model_settings). A bad value anywhere refuses this archive
    with the field named.
    """
    settings = resolve_model_settings(
        *(layer for _, layer in _named_layers(archive, spec, default_max_queue, layers))
    )
    load_token_counter(archive.model_config, archive.path.name, archive.model_dir)  # refuses a bad one
    max_batch_bytes(archive.model_config, archive.path.name)  # refuses a bad one
    try:
        signature = ModelSignature.from_config(archive.model_config.get("signature"))
    except (ValueError, KeyError, TypeError) as exc:
        msg = f"archive {archive.path.name}: bad signature: {exc}"
        raise ServingError(Code.INVALID_ARGUMENT, msg) from exc
    return settings, signature


def _named_layers(
    archive: ModelArchive, spec: ModelSpec, default_max_queue: int | None, layers: ServerLayers
) -> tuple[tuple[LayerSource | None, SettingsOverrides], ...]:
    """Every layer of a version's settings, lowest first, with where each comes from. A register
    call's `initial_workers=0` is no worker under the archive's and models=' counts (TorchServe's
    ApiUtils.handleRegister): it replaces default_workers_per_model rather than topping them."""
    call = spec.overrides
    no_default_workers = not spec.loaded_at_startup and call.min_workers == 0
    if no_default_workers:
        call = replace(call, min_workers=None, max_workers=None)
    return (
        (None, SettingsOverrides(max_queue=default_max_queue)),
        *layers.named_for_model(
            archive.name,
            archive.version,
            archive.path.name,
            archive_overrides(archive.model_config, archive.path.name),
            startup=spec.loaded_at_startup,
            no_default_workers=no_default_workers,
        ),
        (REGISTER_CALL if not spec.loaded_at_startup else None, call),
    )


def resolve_worker_origin(
    archive: ModelArchive, spec: ModelSpec, *, default_max_queue: int | None, layers: ServerLayers
) -> LayerSource | None:
    """Where a version's worker count (minWorkers) was set, for the worker budget's refusal
    (see `settings_layers.worker_count_origin`); None for the built-in default count."""
    return worker_count_origin(_named_layers(archive, spec, default_max_queue, layers))


def resident_bytes(pid: int | None = None) -> int | None:
    """A process's resident set size (Linux /proc; this process by default); None where it
    cannot be read (e.g. the process is gone)."""
    try:
        with open(f"/proc/{pid or 'self'}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def version_info(
    name: str,
    version: str,
    source: ModelSource,
    settings: ModelSettings,
    *,
    is_default: bool,
    state: ModelState,
    workers: tuple[WorkerInfo, ...],
    load_seconds: float | None,
    signature: ModelSignature | None,
    pending_requests: int = 0,
    error: str | None = None,
) -> ModelInfo:
    """One version's ModelInfo from its source and settings: the one builder, for a frontend's
    endpoint and for the supervisor's registry alike."""
    return ModelInfo(
        name=name,
        version=version,
        archive=source.archive_file,
        sha256=source.sha256,
        handler=source.handler,
        is_default=is_default,
        state=state,
        batch_size=settings.batch_size,
        max_batch_delay_ms=settings.max_batch_delay_ms,
        response_timeout_s=settings.response_timeout_s,
        startup_timeout_s=settings.startup_timeout_s,
        queue_size=settings.max_queue,
        min_workers=settings.min_workers,
        max_workers=settings.max_workers,
        workers=workers,
        load_seconds=load_seconds,
        signature=signature,
        loaded_at_startup=source.loaded_at_startup,
        pending_requests=pending_requests,
        device_type=settings.device_type,
        error=error,
    )


_LIMIT = 200  # characters of a client-supplied name quoted back in TorchServe's messages


def _shown(name: str, limit: int = 80) -> str:
    """A client-supplied name for an error message: quoted, escaped and bounded in length."""
    return repr(name[:limit] + ("..." if len(name) > limit else ""))


def resolve_version(
    table: Mapping[str, Mapping[str, T]], defaults: Mapping[str, str], model: str, version: str | None
) -> T:
    """The served `version` of `model` (its default version when None), or NOT_FOUND naming what
    is served. One lookup for every model table: the data plane's and the supervisor's."""
    versions = table.get(model)
    if not versions:
        served = sorted(table)
        listed = ", ".join(served[:10]) + (f" and {len(served) - 10} more" if len(served) > 10 else "")
        raise ServingError(
            Code.NOT_FOUND,
            f"model {_shown(model)} is not served here; served: {listed or 'none'}",
            torchserve=TorchServeAnswer(404, "ModelNotFoundException", f"Model not found: {model[:_LIMIT]}"),
        )
    v = version or defaults[model]
    found = versions.get(v)
    if found is None:
        raise ServingError(
            Code.NOT_FOUND,
            f"model {model!r} has no version {_shown(v)}; versions served: {', '.join(sorted(versions))}",
            torchserve=TorchServeAnswer(
                404,
                "ModelVersionNotFoundException",
                f"Model version: {v[:_LIMIT]} does not exist for model: {model}",
            ),
        )
    return found


class _Resolving(Protocol):
    draining: bool

    def resolve(self, model: str, version: str | None = None) -> Any: ...


# The states in which a version counts for the server's readiness: serving, or registered with
# no worker on purpose (TorchServe's /ping: a model's healthy workers cover its minWorkers, 0).
SERVED_STATES = frozenset({ModelState.READY, ModelState.NO_WORKERS})


def version_ready(plane: _Resolving, model: str, version: str | None) -> bool:
    """Whether `model` (its `version`, or the default one) is served READY and the plane is not
    draining: an unknown model is simply not ready. One answer for a frontend and the registry."""
    try:
        return not plane.draining and plane.resolve(model, version).state is ModelState.READY
    except ServingError:
        return False


def require_management(enabled: bool, what: str) -> None:
    """PERMISSION_DENIED for a model change while model management is off (the secure default)."""
    if not enabled:
        raise ServingError(
            Code.PERMISSION_DENIED,
            f"{what} is disabled: start the server with --enable-model-management to allow it "
            "(archives are then taken only from the model store)",
        )
