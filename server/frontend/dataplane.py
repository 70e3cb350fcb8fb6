"""The protocol-neutral core: which models exist, whether they are ready, and inference.

Transports translate wire messages to `InferRequest` and call `DataPlane.infer`; this module
resolves the model version, admits the request (readiness, draining) and hands it to that
version's batcher. Nothing here knows about gRPC or HTTP. One version's endpoint (its
settings, runners and batcher) is `frontend.endpoint`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable
from contextvars import ContextVar
from typing import Any, TypeVar

from mariner.server.common.batch_policy import CALLER
from mariner.server.common.models import SERVED_STATES, resolve_version, version_ready
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferRequest, InferResult, ModelInfo, ModelState
from mariner.server.frontend.endpoint import ModelEndpoint, ServingMetrics

__all__ = ["DataPlane", "ModelEndpoint"]

log = logging.getLogger("mariner.dataplane")


T = TypeVar("T")

# Set in a call's task by the transport when the call starts (its head is in, its body may not
# be): a call admitted before the drain began is one the server accepted, and it is answered
# even if its body arrives after (see DataPlane.admit). Unset (False) means not admitted.
_ADMITTED: ContextVar[bool] = ContextVar("mariner_admitted_before_drain", default=False)


def _registering(ep: ModelEndpoint) -> bool:
    """A version added by a register call that has not been ready yet: the call in progress
    answers for it, so it is not part of the server's readiness (in a frontend too, which learns
    it from the supervisor's table while its first workers start)."""
    return not ep.loaded_at_startup and ep.state is ModelState.LOADING


class DataPlane:
    """All model versions this frontend serves, and the one entry point for inference.

    The versions are the supervisor's (its model table, applied by the frontend with
    `install_endpoint` / `remove_endpoint`): this plane opens no archive, starts no worker and
    manages nothing; it resolves, admits and hands requests to each version's batcher.
    """

    # Model changes are the supervisor's (management port); an inference listener asking for one
    # (Triton's repository extension on the inference port) is refused as management-disabled.
    management_enabled = False

    def __init__(self, metrics: ServingMetrics) -> None:
        # The frontend's common.metrics.Metrics: the adapters read more of it (call counters)
        # and type it themselves; core only feeds what ServingMetrics names.
        self.metrics: Any = metrics
        self._endpoints: dict[str, dict[str, ModelEndpoint]] = {}
        self._defaults: dict[str, str] = {}
        self.draining = False
        # Not ready until the supervisor's first real model table is applied: an empty plane is
        # ready only when the server serves no model, which only that table can say (a frontend
        # sets it when it starts, apply clears it).
        self.awaiting_table = False
        # Accounting for the shutdown proof: every accepted request must be answered.
        self.accepted = 0
        self.answered = 0
        self.answered_ok = 0
        self._inflight = 0
        self._pending = 0  # calls admitted by a transport that tracks them, not yet finished
        self._idle: asyncio.Event | None = None

    # -- the table --------------------------------------------------------------------------
    def install_endpoint(self, ep: ModelEndpoint) -> None:
        """Serve an endpoint built from the supervisor's model table."""
        versions = self._endpoints.setdefault(ep.name, {})
        versions[ep.version] = ep
        self._defaults.setdefault(ep.name, ep.version)
        self.metrics.model_ready.labels(ep.name, ep.version).set(0)

    def endpoint(self, model: str, version: str) -> ModelEndpoint | None:
        """The installed endpoint of exactly this version, if any (no default resolution)."""
        return self._endpoints.get(model, {}).get(version)

    def installed(self) -> list[tuple[str, str]]:
        """Every installed (model, version)."""
        return [(name, v) for name, vs in self._endpoints.items() for v in vs]

    def set_default(self, model: str, version: str) -> None:
        """The supervisor's default version of `model` (from its table)."""
        self.resolve(model, version)
        self._defaults[model] = version

    def remove_endpoint(self, model: str, version: str) -> ModelEndpoint:
        """Stop serving one version (the caller closes it); the default moves to another version."""
        ep = self._endpoints[model].pop(version)
        if not self._endpoints[model]:
            del self._endpoints[model]
            self._defaults.pop(model, None)
        elif self._defaults.get(model) == version:
            self._defaults[model] = next(iter(self._endpoints[model]))
        return ep

    # -- lookups --------------------------------------------------------------------------
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
        return ep.info(ep.version == self._defaults.get(ep.name))

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
        """Every model asked for is served and READY, or asked for with no worker (a version
        still being registered does not count yet: a register in progress does not take the
        server out of rotation). No model at all is ready, as TorchServe's /ping judges it."""
        if self.awaiting_table or self.draining:
            return False
        eps = [ep for v in self._endpoints.values() for ep in v.values() if not _registering(ep)]
        return all(ep.state in SERVED_STATES for ep in eps)

    def model_ready(self, model: str, version: str | None = None) -> bool:
        return version_ready(self, model, version)

    # -- inference ------------------------------------------------------------------------
    async def infer(self, req: InferRequest) -> InferResult:
        return await self.enqueue(req, CALLER.get(), admitted=_ADMITTED.get())

    def enqueue(self, req: InferRequest, caller: Hashable, *, admitted: bool) -> asyncio.Future[InferResult]:
        """Resolve `req`'s version and queue it; the future of its result (refusals raise at
        once). `caller` is its fair-order key (`batch_policy.CALLER`); `admitted`, whether its
        call was admitted before a drain began (`admit`). Synchronous so a transport's callbacks
        can hand a request over without a task (`frontend.protocols.prediction_path`)."""
        if self.draining and not admitted:
            raise ServingError(Code.UNAVAILABLE, "server is shutting down; retry on another replica")
        ep = self.resolve(req.model, req.version)
        self.accepted += 1  # a refusal by the version (overloaded, restarting) is an answer too
        try:
            fut = ep.enqueue(req, caller)
        except BaseException:
            self.answered += 1
            raise
        self._inflight += 1
        fut.add_done_callback(self._answered)
        return fut

    def _answered(self, fut: asyncio.Future[InferResult]) -> None:
        self.answered += 1
        self._inflight -= 1
        self._maybe_idle()
        if not fut.cancelled() and fut.exception() is None and fut.result().status == 200:
            self.answered_ok += 1

    # -- admission (transports) -----------------------------------------------------------
    def admit(self) -> bool:
        """Called in a call's own task when the call starts, before its body is read: False
        while draining (the transport refuses the call, unread), else the call is accepted and
        its inference is served even if the drain begins while its body is still arriving (a
        large tensor takes a while). A call never admitted is refused once draining."""
        if self.draining:
            return False
        _ADMITTED.set(True)
        return True

    def begin_call(self) -> None:
        """An admitted call that `wait_idle` waits for until `end_call` (HTTP, whose request
        ends in the transport's own code; grpc's server.stop waits for its calls itself)."""
        self._pending += 1

    def end_call(self) -> None:
        self._pending -= 1
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if self._inflight == 0 and self._pending == 0 and self._idle is not None:
            self._idle.set()

    # -- shutdown -------------------------------------------------------------------------
    def start_draining(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) until no accepted inference and no tracked call is left."""
        if self._inflight == 0 and self._pending == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            log.error(
                "grace period over with %d requests in flight and %d calls still being received",
                self._inflight,
                self._pending,
            )
            return False
        finally:
            self._idle = None
        return True

    async def close(self, grace: float) -> None:
        """Finish accepted requests within `grace` seconds, then stop every batcher."""
        self.draining = True
        deadline = time.monotonic() + grace
        # Every accepted request (queued, running, or between admission and the batcher) is
        # answered before the batchers close.
        await self.wait_idle(grace)
        eps = [ep for v in self._endpoints.values() for ep in v.values()]
        left = max(0.0, deadline - time.monotonic())
        await asyncio.gather(*(ep.close(left) for ep in eps))
