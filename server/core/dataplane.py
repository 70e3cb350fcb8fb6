"""The protocol-neutral core: which models exist, whether they are ready, and inference.

Transports translate wire messages to `InferRequest` and call `DataPlane.infer`; this module
resolves the model version, admits the request (readiness, draining) and hands it to that
version's batcher. Nothing here knows about gRPC or HTTP. One version's endpoint (its
settings, runners and batcher) is `core.endpoint`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from mariner.server.control.metrics import Metrics
from mariner.server.core.archive import UNLISTED, ModelArchive, open_archive, resolve_in_store
from mariner.server.core.endpoint import ArchiveEndpoint, ModelEndpoint, ModelSpec, PlaneSettings
from mariner.server.core.errors import Code, ServingError
from mariner.server.core.failed_models import FailedEndpoint, FailedModel
from mariner.server.core.model_settings import SettingsOverrides
from mariner.server.core.types import InferRequest, InferResult, ModelInfo, ModelState, WireProtocol

__all__ = ["DataPlane", "ModelEndpoint", "ModelSpec", "PlaneSettings"]

log = logging.getLogger("mariner.dataplane")


T = TypeVar("T")


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
            Code.NOT_FOUND, f"model {_shown(model)} is not served here; served: {listed or 'none'}"
        )
    v = version or defaults[model]
    found = versions.get(v)
    if found is None:
        raise ServingError(
            Code.NOT_FOUND,
            f"model {model!r} has no version {_shown(v)}; versions served: {', '.join(sorted(versions))}",
        )
    return found


def _load_failure(ep: ModelEndpoint, exc: BaseException) -> ServingError:
    """A model's load failure as the caller sees it: a worker process reports its handler's
    error as a ServingError already; a thread runner's raw exception is worded the same way."""
    if isinstance(exc, ServingError):
        return exc
    log.error("model %s version %s: its handler failed to initialise", ep.name, ep.version, exc_info=exc)
    return ServingError(
        Code.INVALID_ARGUMENT,
        f"model {ep.name} version {ep.version} failed to load: {type(exc).__name__}: {exc}",
    )


def _registering(ep: ModelEndpoint) -> bool:
    """A version added by a register call that has not been ready yet: the call in progress
    answers for it, so it is not part of the server's readiness (in a frontend too, which learns
    it from the supervisor's table while its first workers start)."""
    return not ep.loaded_at_startup and ep.state is ModelState.LOADING


def require_management(enabled: bool, what: str) -> None:
    """PERMISSION_DENIED for a model change while model management is off (the secure default)."""
    if not enabled:
        raise ServingError(
            Code.PERMISSION_DENIED,
            f"{what} is disabled: start the server with --enable-model-management to allow it "
            "(archives are then taken only from the model store)",
        )


class DataPlane:
    """All model versions this server serves, and the one entry point for inference."""

    def __init__(self, settings: PlaneSettings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.management_enabled = settings.management_enabled
        self._endpoints: dict[str, dict[str, ModelEndpoint]] = {}
        self._defaults: dict[str, str] = {}
        self._load_errors: dict[ModelEndpoint, str] = {}  # why a start-up model failed to load
        self.draining = False
        # Accounting for the shutdown proof: every accepted request must be answered.
        self.accepted = 0
        self.answered = 0
        self.answered_ok = 0
        self._inflight = 0
        self._idle: asyncio.Event | None = None
        self._background: set[asyncio.Task[None]] = set()  # asynchronous registers still loading

    # -- loading --------------------------------------------------------------------------
    async def open_models(self, specs: Sequence[ModelSpec]) -> None:
        """Check and unpack every archive; the models are then known (health NOT_SERVING) but LOADING.

        An archive that fails its checks (missing, unsafe, malformed) is logged in one line and
        served as a FAILED version with the reason (`failed_models.FailedEndpoint`), so one bad
        file in the store does not take the others down and does not go unnoticed.
        """
        for spec in specs:
            archive: ModelArchive | None = None
            try:
                archive = await self._unpack(spec)
                self._install(archive, spec)
            except ServingError as exc:
                self._refused(spec, exc, archive)

    def _refused(self, spec: ModelSpec, exc: ServingError, archive: ModelArchive | None) -> None:
        named = exc.message.startswith(f"archive {spec.archive}")
        log.error("refusing %s", exc.message if named else f"archive {spec.archive}: {exc.message}")
        if spec.sha256 != UNLISTED:  # off the --pin-index allowlist: left out by design
            name, version = (archive.name, archive.version) if archive else (spec.name, None)
            failed = FailedModel.of(spec.archive, exc.message, name, version)
            if failed.version not in self._endpoints.get(failed.name, {}):
                self._put(FailedEndpoint(failed, self.metrics))

    async def load_models(self, specs: Sequence[ModelSpec] = ()) -> None:
        """Open `specs` (if any), then initialise every LOADING model concurrently."""
        await self.open_models(specs)
        endpoints = [
            ep
            for v in self._endpoints.values()
            for ep in v.values()
            if isinstance(ep, ArchiveEndpoint) and ep.state is ModelState.LOADING
        ]
        results = await asyncio.gather(*(ep.load() for ep in endpoints), return_exceptions=True)
        for ep, res in zip(endpoints, results, strict=True):
            if isinstance(res, BaseException):
                self._load_errors[ep] = _load_failure(ep, res).message
                log.error("%s", self._load_errors[ep])

    async def _unpack(self, spec: ModelSpec) -> ModelArchive:
        """Hash, check and unpack the archive off the event loop (a large one takes seconds)."""
        path = resolve_in_store(self.settings.model_store, spec.archive)
        return await asyncio.to_thread(
            open_archive,
            path,
            self.settings.work_dir,
            limits=self.settings.limits,
            expected_sha256=spec.sha256,
            name_override=spec.name,
        )

    def _install(self, archive: ModelArchive, spec: ModelSpec) -> ArchiveEndpoint:
        """Resolve the archive's settings and serve it (LOADING); on a refusal its unpacked
        directory is removed and nothing is left behind."""
        try:
            held = self._endpoints.get(archive.name, {}).get(archive.version)
            if held is not None and not isinstance(held, FailedEndpoint):  # a FAILED one is replaced
                raise ServingError(  # TorchServe's 409 ConflictStatusException, same sentence
                    Code.ALREADY_EXISTS,
                    f"Model version {archive.version} is already registered for model {archive.name}",
                )
            ep = ArchiveEndpoint.from_archive(archive, spec, self.settings, self.metrics)
        except BaseException:
            shutil.rmtree(archive.model_dir, ignore_errors=True)
            raise
        self._put(ep)
        return ep

    def _put(self, ep: ModelEndpoint) -> None:
        """Add `ep` to the table; a served version takes the default from a FAILED one."""
        self._endpoints.setdefault(ep.name, {})[ep.version] = ep
        default = self._endpoints[ep.name].get(self._defaults.get(ep.name, ""))
        if default is None or (isinstance(default, FailedEndpoint) and not isinstance(ep, FailedEndpoint)):
            self._defaults[ep.name] = ep.version
        self.metrics.model_ready.labels(ep.name, ep.version).set(0)

    def install_endpoint(self, ep: ModelEndpoint) -> None:
        """Serve an endpoint built elsewhere (a frontend's, from the supervisor's model table)."""
        versions = self._endpoints.setdefault(ep.name, {})
        versions[ep.version] = ep
        self._defaults.setdefault(ep.name, ep.version)
        self.metrics.model_ready.labels(ep.name, ep.version).set(0)

    def remove_endpoint(self, model: str, version: str) -> ModelEndpoint:
        """Stop serving one version (the caller closes it); the default moves to another version."""
        ep = self._endpoints[model].pop(version)
        if not self._endpoints[model]:
            del self._endpoints[model]
            self._defaults.pop(model, None)
        elif self._defaults.get(model) == version:
            left = self._endpoints[model]
            served = [v for v, e in left.items() if not isinstance(e, FailedEndpoint)]
            self._defaults[model] = served[0] if served else next(iter(left))
        return ep

    # -- lookups --------------------------------------------------------------------------
    @property
    def startup_timeout_s(self) -> float:
        """How long a worker may take to start and load its handler (describe's startupTimeout)."""
        return self.settings.worker_start_timeout_s

    def resolve(self, model: str, version: str | None = None) -> ModelEndpoint:
        return resolve_version(self._endpoints, self._defaults, model, version)

    def known_label(self, model: str, version: str | None) -> tuple[str, str]:
        """Metric label values: a loaded model's name/version, or 'unknown' (bounded cardinality)."""
        try:
            ep = self.resolve(model, version)
        except ServingError:
            return "unknown", "unknown"
        return ep.name, ep.version

    def _info(self, ep: ModelEndpoint) -> ModelInfo:
        info = ep.info(ep.version == self._defaults.get(ep.name))
        error = self._load_errors.get(ep)
        return dataclasses.replace(info, error=error) if error and info.state is ModelState.FAILED else info

    def models(self) -> list[ModelInfo]:
        return [self._info(ep) for name in sorted(self._endpoints) for ep in self._endpoints[name].values()]

    def describe(self, model: str, version: str | None = None) -> list[ModelInfo]:
        """A model's versions (all of them for None or "all"), FAILED ones included."""
        if version is None or version == "all":
            if model not in self._endpoints:
                self.resolve(model)
            return [self._info(ep) for ep in self._endpoints[model].values()]
        return [self._info(self.resolve(model, version))]

    def is_live(self) -> bool:
        return True

    def is_ready(self) -> bool:
        """Every model asked for is served and READY (a version still being registered does not
        count yet: a register in progress does not take the server out of rotation)."""
        eps = [ep for v in self._endpoints.values() for ep in v.values() if not _registering(ep)]
        return not self.draining and bool(eps) and all(ep.state is ModelState.READY for ep in eps)

    def model_ready(self, model: str, version: str | None = None) -> bool:
        try:
            return not self.draining and self.resolve(model, version).state is ModelState.READY
        except ServingError:
            return False

    # -- inference ------------------------------------------------------------------------
    async def infer(self, req: InferRequest) -> InferResult:
        if self.draining:
            raise ServingError(Code.UNAVAILABLE, "server is shutting down; retry on another replica")
        ep = self.resolve(req.model, req.version)
        self.accepted += 1
        self._inflight += 1
        try:
            result = await ep.infer(req)
        finally:
            self.answered += 1
            self._inflight -= 1
            if self._inflight == 0 and self._idle is not None:
                self._idle.set()
        if result.status == 200:
            self.answered_ok += 1
        return result

    # -- management -----------------------------------------------------------------------
    def _require_management(self, what: str) -> None:
        require_management(self.management_enabled, what)

    async def register(
        self, archive_name: str, *, synchronous: bool = True, **overrides: Any
    ) -> list[ModelInfo]:
        """Open, check and load one archive; all or nothing: when any step fails, nothing of it
        is left (no version, no worker, no unpacked directory) and readiness is as before.

        With `synchronous=False` (TorchServe's `synchronous=false`) the archive is opened and
        checked before this returns, and the load finishes in the background (a failure there
        is logged and leaves nothing, as above)."""
        self._require_management("model registration")
        name = overrides.pop("name", None)
        # Keyword overrides are checked here like every other layer (SettingsOverrides does it).
        spec = ModelSpec(
            archive=archive_name, name=name, overrides=SettingsOverrides(**overrides), loaded_at_startup=False
        )
        archive = await self._unpack(spec)
        held = self._endpoints.get(archive.name, {}).get(archive.version)
        ep = self._install(archive, spec)  # replaces a FAILED version of that name and version
        if not synchronous:
            task = asyncio.create_task(self._load_in_background(ep, held))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return [self._info(ep)]
        await self._load_registered(ep, held)
        return [self._info(ep)]

    async def _load_in_background(self, ep: ArchiveEndpoint, held: ModelEndpoint | None) -> None:
        """An asynchronous register's second half: nobody waits for it, so a failure is logged."""
        try:
            await self._load_registered(ep, held)
        except Exception as exc:
            why = exc.message if isinstance(exc, ServingError) else repr(exc)
            log.error("model %s version %s failed to load after registering: %s", ep.name, ep.version, why)

    async def _load_registered(self, ep: ArchiveEndpoint, held: ModelEndpoint | None) -> None:
        """Load a just-installed version; on failure put back what it replaced and raise."""
        try:
            await ep.load()
        except BaseException as exc:
            self.remove_endpoint(ep.name, ep.version)
            if held is not None:
                self._put(held)  # the FAILED version it was to replace, as before
            await ep.close(timeout=0)  # stops whatever workers did start, removes the unpacked dir
            if isinstance(exc, Exception):
                raise _load_failure(ep, exc) from exc
            raise
        # A fixed archive registered under a name that failed at start-up supersedes that failure.
        for version, other in list(self._endpoints[ep.name].items()):
            if isinstance(other, FailedEndpoint):
                self.remove_endpoint(ep.name, version)

    async def customized_metadata(
        self, model: str, version: str | None, headers: Mapping[str, str], protocol: WireProtocol
    ) -> InferResult:
        """The handler's own description of the model (TorchServe's `describe_handle`), asked of
        one ready instance as a handler call of its own, bounded by the response timeout."""
        from mariner.server.workers.protocol import ask_describe, describe_request

        ep = self.resolve(model, version)
        ready = [r for r in getattr(ep, "runners", ()) if r.status == "READY"]
        if not ready:
            raise ServingError(
                Code.UNAVAILABLE, f'Model "{ep.name}" has no worker to serve inference request'
            )
        request = describe_request(ep.name, ep.version, headers, protocol)
        timeout = ep.response_timeout_s
        spec = getattr(ready[0], "spec", None)
        if spec is not None:  # a worker process: ask it on its socket
            return await ask_describe(spec.socket_path, request, timeout)
        try:  # a thread runner: its one handler thread runs it between batches
            async with asyncio.timeout(timeout):
                (result,) = await ready[0].run([request])
        except TimeoutError:
            raise ServingError(
                Code.DEADLINE_EXCEEDED, f"the handler did not describe the model within {timeout:g} s"
            ) from None
        return result

    async def unregister(self, model: str, version: str | None = None) -> None:
        """Stop serving one version (the default one when `version` is None), found by model name
        whatever its archive file is called; a FAILED version is simply forgotten."""
        self._require_management("model unregistration")
        ep = self.resolve(model, version)
        self.remove_endpoint(model, ep.version)
        self._load_errors.pop(ep, None)
        await ep.close(timeout=ep.response_timeout_s)

    async def set_default(self, model: str, version: str) -> None:
        """Allowed without model management, as in TorchServe: it loads no code."""
        self.resolve(model, version)
        self._defaults[model] = version

    async def scale(self, model: str, version: str | None, min_workers: int, max_workers: int) -> None:
        """Not gated by model management (TorchServe allows it: no new code is loaded), but a
        single-process server cannot scale yet; the supervisor (`mariner serve`) can."""
        self.resolve(model, version)
        raise ServingError(
            Code.UNIMPLEMENTED,
            "scaling a loaded model is not supported yet; restart with --min-workers instead",
        )

    # -- shutdown -------------------------------------------------------------------------
    def start_draining(self) -> None:
        self.draining = True

    async def close(self, grace: float) -> None:
        """Finish accepted requests within `grace` seconds, then stop every runner."""
        self.draining = True
        for task in list(self._background):
            task.cancel()
        deadline = time.monotonic() + grace
        if self._inflight:
            # Wait for every accepted request (queued, running, or between admission and the
            # batcher) to be answered before the batchers close.
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except TimeoutError:
                log.error("grace period over with %d requests still in flight", self._inflight)
        eps = [ep for v in self._endpoints.values() for ep in v.values()]
        left = max(0.0, deadline - time.monotonic())
        await asyncio.gather(*(ep.close(left) for ep in eps))
