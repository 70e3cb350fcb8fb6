"""The model versions the supervisor serves, and the management API over them.

`ModelRegistry` answers the management apps (REST 8081, gRPC 7071): it decides which worker
slots each version has (register, scale, unregister) and which version is a model's default.
It is the one owner of the model lifecycle; a frontend only follows its model table. How an
archive becomes a version, and the start-up's and shutdown's workers, are its base's
(`model_loading.ModelLoading`); what the table says, `model_views.ModelViews`'. Keeping the
slots' processes running is `WorkerPool`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

from mariner.server.common.archive import ModelArchive, with_handler
from mariner.server.common.model_settings import SettingsOverrides
from mariner.server.common.models import ModelSpec, require_management
from mariner.server.contracts.errors import Code, ServingError, TorchServeAnswer
from mariner.server.contracts.types import InferResult, ModelInfo, WireProtocol
from mariner.server.contracts.worker_describe import ask_describe, describe_request
from mariner.server.supervisor.model_loading import ModelLoading
from mariner.server.supervisor.versions import Instance, Version
from mariner.server.supervisor.worker_slots import check_scale

log = logging.getLogger("mariner.supervisor")


class ModelRegistry(ModelLoading):
    """Every model version, its worker processes, and the management API over them.

    It provides the methods the management apps call (models, describe, register, unregister,
    scale, set_default, readiness). `on_change` is called whenever what frontends
    must know changed (a worker ready or gone, a model added or removed, a new default); it
    returns once every frontend applied the change (bounded). `frontends_ok` says whether
    every frontend is up (part of the whole server's readiness).
    """

    # -- management -------------------------------------------------------------------------------
    def _require_management(self, what: str) -> None:
        require_management(self.management_enabled, what)

    async def _await_first(self, v: Version, instances: Sequence[Instance]) -> None:
        """Wait for each instance's first start; raise the first failure as TorchServe answers a
        register or scale whose workers did not start (500 "Failed to start workers"), with the
        worker's own reason. A slot stopped while it started (CANCELLED) and a machine out of
        memory or processes (RESOURCE_EXHAUSTED) keep their own answers."""
        results = await asyncio.gather(*(i.first for i in instances if i.first), return_exceptions=True)
        for r in results:
            if not isinstance(r, BaseException):
                continue
            if isinstance(r, ServingError) and r.code in (Code.CANCELLED, Code.RESOURCE_EXHAUSTED):
                raise r
            why = r.message if isinstance(r, ServingError) else f"{type(r).__name__}: {r}"
            failed = f"Failed to start workers for model {v.name} version: {v.version}"
            raise ServingError(
                Code.INTERNAL,
                f"{failed}: {why}",
                torchserve=TorchServeAnswer(500, "InternalServerException", f"{failed}: {why}"),
            )

    async def register(
        self, archive_name: str, *, synchronous: bool = True, handler: str | None = None, **overrides: Any
    ) -> list[ModelInfo]:
        """Open, check and start one archive; all or nothing: when any step fails, nothing of it
        is left (no version, no worker, no unpacked directory) and readiness is as before. A
        worker count over the budget is refused before any worker starts.

        With `synchronous=False` (TorchServe's `synchronous=false`) the archive is still opened
        and checked before this returns (a bad or duplicate archive is refused to the caller),
        but the workers' start is awaited in the background; a failure there removes the
        version and is logged, as TorchServe unregisters a model whose workers failed.

        The version's lifecycle lock is held until its workers' first starts ended (a scale of
        it waits); an unregister meanwhile stops them and this answers that it was unregistered.

        `handler` replaces the manifest's handler (TorchServe's `handler=`), checked by the same
        rule; one that does not load registers (with no worker) and fails its workers' starts,
        as in TorchServe. Without a worker count from anywhere the version has none."""
        self._require_management("model registration")
        name = overrides.pop("name", None)
        spec = ModelSpec(
            archive=archive_name, name=name, overrides=SettingsOverrides(**overrides), loaded_at_startup=False
        )
        archive = await self._unpack(spec)
        if handler:
            try:
                archive = with_handler(archive, handler)
            except BaseException:
                shutil.rmtree(archive.model_dir, ignore_errors=True)
                raise
        return await self.register_opened(archive, spec, synchronous=synchronous)

    async def register_opened(
        self, archive: ModelArchive, spec: ModelSpec, *, synchronous: bool = True
    ) -> list[ModelInfo]:
        """The rest of `register` for an archive already opened and checked, whose directory it
        then owns (removed on a refusal): a workflow's function node, made from a .war."""
        if not self.management_enabled:
            shutil.rmtree(archive.model_dir, ignore_errors=True)
            self._require_management("model registration")
        await self._requirements(archive)
        v = self._install(archive, spec)
        # A new version's lock is free: taken without a wait, so nothing runs in between.
        await v.lifecycle.acquire()
        self._registering.add((v.name, v.version))
        try:
            added = self._workers.add(v, v.settings.min_workers)
        except BaseException:
            self._registering.discard((v.name, v.version))
            v.lifecycle.release()
            await self._remove(v)
            raise
        if not synchronous and added:
            task = asyncio.create_task(self._start_in_background(v, added))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return [self._info(v)]
        await self._start_registered(v, added)
        return [self._info(v)]

    async def _start_registered(self, v: Version, added: Sequence[Instance], *, keep: bool = False) -> None:
        """Wait for a just-installed version's first starts; on failure remove all of it (unless
        `keep`: its workers go on retrying) and raise. Releases the version's lifecycle lock
        `register` took."""
        try:
            try:
                await self._changed()
                await self._await_first(v, added)
                # The ready workers reach every frontend before the caller hears "registered": a
                # predict sent right after the answer must not meet a table still saying LOADING.
                await self._changed()
            except BaseException:
                if not keep or v.removed:
                    await self._remove(v)
                raise
        finally:
            self._registering.discard((v.name, v.version))
            v.lifecycle.release()
        # A fixed archive registered under a name that failed at start-up supersedes that failure.
        if self._failed.clear(v.name):
            await self._changed()
        await self.on_management_change()

    async def _start_in_background(self, v: Version, added: Sequence[Instance]) -> None:
        """An asynchronous register's second half: nobody waits for it, so a failure is logged
        and the version stays registered, its workers retrying with backoff (TorchServe keeps a
        model registered with `synchronous=false` whatever its workers do)."""
        try:
            await self._start_registered(v, added, keep=True)
        except Exception:  # each failed start was logged with its reason where it happened
            log.error("model %s version %s: its first worker start after registering failed; its workers "
                      "keep retrying", v.name, v.version)  # fmt: skip

    async def _remove(self, v: Version, why: str | None = None) -> None:
        """Stop serving `v`: out of the table first (frontends stop sending it batches and
        answer what they accepted), then its workers drain and stop, then its files go. Once
        only: a second call (a register failing because of an unregister) returns at once."""
        if v.removed:
            return
        v.removed = True
        versions = self._versions.get(v.name, {})
        if versions.get(v.version) is v:
            versions.pop(v.version)
            if not versions:
                self._versions.pop(v.name, None)
                self._defaults.pop(v.name, None)
            elif self._defaults.get(v.name) == v.version:
                self._defaults[v.name] = next(iter(versions))
        await self._changed()  # frontends stop sending it batches before its workers stop
        await self._workers.stop(
            list(v.instances.values()),
            v.settings.response_timeout_s,
            drain=True,
            why=why or f"model {v.name} version {v.version} was unregistered",
        )
        self.budget.forget((v.name, v.version))
        shutil.rmtree(v.archive.model_dir, ignore_errors=True)

    async def unregister(self, model: str, version: str | None = None) -> None:
        """Stop serving a version at once: it does not wait for a register or scale of it in
        progress (their workers still starting are stopped and they answer so)."""
        self._require_management("model unregistration")
        served = self._versions.get(model, {})
        if self._failed.of_model(model, version) and (not served or (version and version not in served)):
            self._failed.clear(model, version)  # a FAILED version is simply forgotten
            await self._changed()
            return
        await self._remove(self.resolve(model, version))
        await self.on_management_change()

    async def customized_metadata(
        self, model: str, version: str | None, headers: Mapping[str, str], protocol: WireProtocol
    ) -> InferResult:
        """The handler's own description of the model (TorchServe's `describe_handle`), asked of
        one ready worker process on its socket, bounded by the version's response timeout."""
        v = self.resolve(model, version)
        ready = [i.endpoint for i in v.instances.values() if i.status == "READY" and i.endpoint is not None]
        if not ready:
            raise ServingError(Code.UNAVAILABLE, f'Model "{v.name}" has no worker to serve inference request')
        request = describe_request(v.name, v.version, headers, protocol)
        return await ask_describe(
            ready[0].socket_path, request, v.settings.response_timeout_s, expected_pid=ready[0].pid
        )

    async def set_default(self, model: str, version: str) -> None:
        """Allowed without model management, as in TorchServe: it loads no code."""
        self.resolve(model, version)
        self._defaults[model] = version
        await self._changed()
        await self.on_management_change()

    async def scale(self, model: str, version: str | None, min_workers: int, max_workers: int) -> None:
        """Start or stop worker processes until the version has `min_workers` of them.

        Allowed without model management, as in TorchServe: it loads no new code, only more or
        fewer processes of an archive already served; the worker budget bounds how many (checked
        before any wait, so an asynchronous scale's refusal is still its caller's answer, and
        again once it is this version's turn); 0 stops every worker and keeps the version
        registered (TorchServe's scale to 0). One change of a version at a time: a scale waits
        for the register or scale before it. Scaling down drains each worker it stops: out of
        the table first, then its frontends' batches there are answered, then it stops."""
        if min_workers < 0:
            # TorchServe fails this with an internal error (500) after dropping the workers; here
            # nothing changes and the answer says why.
            raise ServingError(
                Code.INTERNAL, f"min_worker must be 0 or more, got {min_workers}; the workers are unchanged"
            )
        v = self.resolve(model, version)
        check_scale(self.budget, self._every(), v, min_workers)
        async with v.lifecycle:
            if v.removed:
                raise ServingError(
                    Code.NOT_FOUND,
                    f"model {v.name} version {v.version} was unregistered while this scale waited",
                )
            live = v.live_instances()
            if min_workers > len(live):
                check_scale(self.budget, self._every(), v, min_workers)  # what changed while it waited
            before = v.settings
            v.settings = dataclasses.replace(v.settings, min_workers=min_workers, max_workers=max_workers)
            if min_workers > len(live):
                added = self._workers.add(v, min_workers - len(live))
                await self._changed()
                try:
                    await self._await_first(v, added)
                    await self._changed()  # the new workers are in every frontend's table first
                except BaseException:
                    if not v.removed:
                        v.settings = before
                    await self._workers.stop(
                        added, 1.0, why=f"model {v.name} version {v.version}'s scale to {min_workers} failed"
                    )
                    for inst in added:
                        v.instances.pop(inst.index, None)
                    await self._changed()
                    raise
            elif min_workers < len(live):
                # Workers not serving (loading, failed) go first, then the newest.
                gone = sorted(live, key=lambda i: (i.status == "READY", -i.index))[: len(live) - min_workers]
                for inst in gone:
                    inst.retire()
                await self._changed()  # frontends stop sending them batches first
                await self._workers.stop(
                    gone,
                    v.settings.response_timeout_s,
                    drain=True,
                    why=f"model {v.name} version {v.version} was scaled down to {min_workers}",
                )
                for inst in gone:
                    v.instances.pop(inst.index, None)
                await self._changed()
        log.info("model %s version %s scaled to %d workers", v.name, v.version, min_workers)
        await self.on_management_change()
