"""TorchServe's gRPC management API (`org.pytorch.serve.grpc.management.ManagementAPIsService`).

Read-only calls (ListModels, DescribeModel) answer with the JSON documents stock TorchServe
returns, key for key, so scripts that parse them keep working; DescribeModel with `customized`
asks the handler's `describe_handle` (customizedMetadata). Changing calls are delegated to the
DataPlane: as in TorchServe, RegisterModel and UnregisterModel are refused (PERMISSION_DENIED)
unless management was enabled, and archives only ever come from the model store (a URL is
never fetched: NOT_FOUND, as TorchServe answers a URL `allowed_urls` does not match);
ScaleWorker and SetDefault work whenever this API is reachable. Register fields are read as
TorchServe's GRPCUtils reads them (a number <= 0 is "not given"; no initial_workers: no worker,
or default_workers_per_model). Answers of changing calls are TorchServe's status sentences.

One deliberate difference: RegisterModel and ScaleWorker always wait for the workers. proto3
cannot tell an unset `synchronous` from false, and stock TorchServe's gRPC then answers before
the workers started, hiding a model that fails to load; REST honours `synchronous` as TorchServe.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias, TypeVar

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE_NAME
from grpc_health.v1.health import aio as health_aio

from mariner.server.common import triton_ext_grpc as oip_ext
from mariner.server.common.grpc_decoding import SafeDecoding
from mariner.server.common.grpc_server import enable_reflection, server_options
from mariner.server.common.grpc_status import abort
from mariner.server.common.grpc_stubs import management_pb2, management_pb2_grpc
from mariner.server.common.register_settings import register_call_overrides
from mariner.server.contracts.errors import Code, ServingError, as_serving_error
from mariner.server.contracts.names import check_model_name, check_params
from mariner.server.contracts.types import InferResult, ModelInfo, WireProtocol
from mariner.server.supervisor.management import grpc as grpc_management
from mariner.server.supervisor.management.describe import (
    MAX_PAGE,
    describe_customized,
    describe_models,
    list_models,
    registered_message,
)

log = logging.getLogger("mariner.grpc.management")

SERVICE_NAME: str = management_pb2.DESCRIPTOR.services_by_name["ManagementAPIsService"].full_name

T = TypeVar("T")


class ManagementPlane(Protocol):
    """What the management apps need: the supervisor's ModelRegistry (and test fakes) provide it."""

    management_enabled: bool

    def models(self) -> list[ModelInfo]: ...

    def describe(self, model: str, version: str | None = None) -> list[ModelInfo]: ...

    async def register(self, archive_name: str, **overrides: Any) -> list[ModelInfo]: ...

    async def unregister(self, model: str, version: str | None = None) -> None: ...

    async def set_default(self, model: str, version: str) -> None: ...

    async def scale(self, model: str, version: str | None, min_workers: int, max_workers: int) -> None: ...

    async def customized_metadata(
        self, model: str, version: str | None, headers: Mapping[str, str], protocol: WireProtocol
    ) -> InferResult: ...


def list_models_json(models: Sequence[ModelInfo], limit: int, next_page_token: int) -> str:
    """TorchServe's ListModels document (the same builder as REST's GET /models), as JSON.

    One deliberate difference from stock TorchServe: proto3 cannot tell an unset `limit` from 0,
    and stock TorchServe then returns an empty page; here 0 means the default page size (100),
    like a REST call without `limit`.
    """
    return json.dumps(list_models(models, limit or MAX_PAGE, next_page_token), indent=2)


def describe_json(plane: ManagementPlane, model: str, version: str | None) -> str:
    """TorchServe's DescribeModel document (the same builder as REST's GET /models/{name}), as
    JSON: the default version, one version, or "all"."""
    return json.dumps(describe_models(plane, model, version), indent=2)


def register_overrides(request: management_pb2.RegisterModelRequest) -> dict[str, Any]:
    """RegisterModelRequest fields as DataPlane overrides (checked by the same function as REST's
    parameters); refuses the ones Mariner cannot honour.

    proto3 sends 0 / "" for unset fields, so only non-zero values override the archive's config.
    Every string field is checked first (no control characters: they reach paths and log lines).
    """
    if request.model_name:  # first: its message says the rule
        check_model_name(request.model_name)
    check_params(_strings(request))
    if request.runtime and request.runtime not in ("python", "python3"):
        raise ServingError(
            Code.INVALID_ARGUMENT, f"runtime {request.runtime!r} is not supported; allowed: python, python3"
        )
    # s3_sse_kms only matters for an archive fetched from S3, which a store entry never is.
    # proto3 sends 0 for an unset field; TorchServe's GRPCUtils.getRegisterParam reads any value
    # <= 0 as "not given" (a delay of 0 is then the archive's, not "never wait").
    overrides = register_call_overrides(
        batch_size=request.batch_size if request.batch_size > 0 else None,
        max_batch_delay=request.max_batch_delay if request.max_batch_delay > 0 else None,
        response_timeout=request.response_timeout if request.response_timeout > 0 else None,
        initial_workers=request.initial_workers if request.initial_workers > 0 else None,
        startup_timeout=request.startup_timeout if request.startup_timeout > 0 else None,
    ).given()
    if request.model_name:
        overrides["name"] = request.model_name
    if request.handler:  # replaces the manifest's handler, as in TorchServe
        overrides["handler"] = request.handler
    return overrides


def _strings(request: Any) -> dict[str, object]:
    """A request message's string fields by name (the model name and version of every call,
    a register's url, handler, runtime, ...)."""
    return {f.name: getattr(request, f.name) for f in request.DESCRIPTOR.fields if f.type == f.TYPE_STRING}


Ctx: TypeAlias = grpc.aio.ServicerContext
_Body = Callable[["ManagementServicer", Any, Ctx], Awaitable[str]]
_Rpc = Callable[["ManagementServicer", Any, Ctx], Awaitable[management_pb2.ManagementResponse]]


def _answers(what: str) -> Callable[[_Body], _Rpc]:
    """A ManagementAPIsService method from `body`, which returns the answer's `msg`: run by
    `ManagementServicer._call`, so a failure while `what` aborts the call with its status."""

    def wrap(body: _Body) -> _Rpc:
        @functools.wraps(body)
        async def rpc(
            self: ManagementServicer, request: Any, context: Ctx
        ) -> management_pb2.ManagementResponse:
            msg = await self._call(context, what, lambda: body(self, request, context))
            return management_pb2.ManagementResponse(msg=msg)

        return rpc

    return wrap


class ManagementServicer(management_pb2_grpc.ManagementAPIsServiceServicer):
    """ManagementAPIsService over the DataPlane.

    `on_change` runs after a successful register/unregister/set-default so the health service
    can follow at once instead of at its next poll.
    """

    def __init__(
        self, dataplane: ManagementPlane, on_change: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self._plane = dataplane
        self._on_change = on_change

    @_answers("listing models")
    async def ListModels(self, request: management_pb2.ListModelsRequest, context: Ctx) -> str:
        return list_models_json(self._plane.models(), request.limit, request.next_page_token)

    @_answers("describing the model")
    async def DescribeModel(self, request: management_pb2.DescribeModelRequest, context: Ctx) -> str:
        check_params(_strings(request))
        version = request.model_version or None
        if request.customized:  # TorchServe answers OK whatever status the handler set
            headers = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
            doc, _ = await describe_customized(
                self._plane, request.model_name, version, headers, WireProtocol.TS_GRPC
            )
            return json.dumps(doc, indent=2)
        return describe_json(self._plane, request.model_name, version)

    @_answers("registering the model")
    async def RegisterModel(self, request: management_pb2.RegisterModelRequest, context: Ctx) -> str:
        # The DataPlane decides first whether management is allowed at all, so a refused
        # caller learns nothing about which arguments would have been accepted.
        overrides = register_overrides(request) if self._plane.management_enabled else {}
        if self._plane.management_enabled and not request.url:
            raise ServingError(
                Code.INVALID_ARGUMENT, "url is required: the file name of an archive in the model store"
            )
        infos = await self._plane.register(request.url, **overrides)
        await self._changed()
        return "; ".join(registered_message(i) for i in infos) or f'Archive "{request.url}" registered'

    @_answers("unregistering the model")
    async def UnregisterModel(self, request: management_pb2.UnregisterModelRequest, context: Ctx) -> str:
        if self._plane.management_enabled:
            check_params(_strings(request))
            if not request.model_name:
                raise ServingError(Code.INVALID_ARGUMENT, "model_name is required")
        await self._plane.unregister(request.model_name, request.model_version or None)
        await self._changed()
        return f'Model "{request.model_name}" unregistered'

    @_answers("scaling workers")
    async def ScaleWorker(self, request: management_pb2.ScaleWorkerRequest, context: Ctx) -> str:
        # TorchServe's defaults: min_worker 0 means 1, max_worker 0 means min_worker.
        min_workers = request.min_worker if request.min_worker > 0 else 1
        max_workers = request.max_worker if request.max_worker > 0 else min_workers
        version = request.model_version or None
        check_params(_strings(request))
        if max_workers < min_workers:
            raise ServingError(
                Code.INVALID_ARGUMENT, f"max_worker ({max_workers}) must be >= min_worker ({min_workers})"
            )
        await self._plane.scale(request.model_name, version, min_workers, max_workers)
        await self._changed()
        suffix = f", version: {version}" if version else ""
        return f"Workers scaled to {min_workers} for model: {request.model_name}{suffix}"

    @_answers("setting the default version")
    async def SetDefault(self, request: management_pb2.SetDefaultRequest, context: Ctx) -> str:
        check_params(_strings(request))
        if not (request.model_name and request.model_version):
            raise ServingError(Code.INVALID_ARGUMENT, "model_name and model_version are both required")
        await self._plane.set_default(request.model_name, request.model_version)
        await self._changed()
        return (
            f'Default version successfully updated for model "{request.model_name}" '
            f'to "{request.model_version}"'
        )

    async def _changed(self) -> None:
        if self._on_change is None:
            return
        try:
            await self._on_change()
        except Exception:  # the change itself succeeded; health catches up at its next refresh
            log.exception("health refresh after a management change failed")

    async def _call(self, context: grpc.aio.ServicerContext, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run `fn`; a ServingError aborts with its mapped status, anything else with INTERNAL."""
        try:
            return await fn()
        except asyncio.CancelledError:
            raise
        except ServingError as exc:
            error = exc
        except Exception as exc:
            log.exception("management call failed while %s", what)
            error = as_serving_error(exc, what)
        return await abort(context, error)


def add_to_server(
    dataplane: ManagementPlane,
    server: grpc.aio.Server,
    on_change: Callable[[], Awaitable[None]] | None = None,
) -> ManagementServicer:
    """Register the management service on `server`; returns the servicer."""
    servicer = ManagementServicer(dataplane, on_change)
    management_pb2_grpc.add_ManagementAPIsServiceServicer_to_server(servicer, server)
    return servicer


def build_management_server(
    plane: grpc_management.ManagementPlane,
    *,
    max_message_bytes: int,
    health: health_aio.HealthServicer,
    on_change: Callable[[], Awaitable[None]] | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> grpc.aio.Server:
    """The gRPC management server (7071) of the supervisor, not yet bound: management, health
    and reflection."""
    management = grpc.aio.server(
        options=server_options(max_message_bytes), interceptors=[SafeDecoding(), *interceptors]
    )
    grpc_management.add_to_server(plane, management, on_change)
    # Triton's repository load/unload/index: management calls, so served here (management token).
    oip_ext.add_repository_to_server(plane, management)
    health_pb2_grpc.add_HealthServicer_to_server(health, management)
    enable_reflection((grpc_management.SERVICE_NAME, oip_ext.SERVICE_NAME, HEALTH_SERVICE_NAME), management)
    return management
