"""The single-process server: HTTP (uvicorn) and gRPC (grpc.aio) on one event loop, one DataPlane.

`mariner serve --worker-mode thread` runs it with thread runners (handler code in this
process, as the previous release did: the baseline the process model is measured against);
the in-process tests run it with worker processes. `mariner serve` otherwise runs the
supervisor (`mariner.server.supervisor`).

Start-up order: listeners first (so `/healthz` answers and `/readyz` says 503 while models
load), then every model loads concurrently, then health flips to SERVING. Shutdown on
SIGTERM/SIGINT: readiness goes NOT_SERVING first, new inference calls are refused with
UNAVAILABLE, accepted requests finish within the grace period, then listeners stop; exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mariner.server.config import ServerConfig, model_specs, pinned_digests, server_layers
from mariner.server.control.management_http import management_app
from mariner.server.control.metrics import Metrics, MetricsConfig
from mariner.server.control.metrics_http import metrics_app
from mariner.server.core.dataplane import DataPlane, PlaneSettings
from mariner.server.listeners import EmbeddedUvicorn, check_exposure, split_address, uvicorn_config
from mariner.server.protocols.grpc_listener import build_grpc_servers
from mariner.server.protocols.http_listener import inference_app
from mariner.server.security import (
    OPEN_HTTP_HEALTH_PATHS,
    GrpcTokenAuth,
    HttpTokenAuth,
    Tokens,
    grpc_credentials,
)

log = logging.getLogger("mariner")


def default_torch_threads() -> int:
    """Intra-op threads for CPU inference: all cores but one, which the event loop needs.

    torch's default (every core) makes OpenMP threads spin on the event loop's core: on 2 cores
    p99 at 4 concurrent clients went from ~13 ms to ~300 ms (docs/benchmark.md).
    """
    return max(1, (os.cpu_count() or 1) - 1)


@dataclass(frozen=True)
class BoundPorts:
    inference: int
    management: int
    metrics: int
    grpc_inference: int
    grpc_management: int


class MarinerServer:
    """One server process: a DataPlane plus its five listeners."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self._tmp = None if cfg.work_dir else tempfile.TemporaryDirectory(prefix="mariner-")
        work_dir = cfg.work_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.metrics = Metrics(MetricsConfig(slo_seconds=cfg.slo_ms / 1e3))
        self.dataplane = DataPlane(
            PlaneSettings(
                model_store=cfg.model_store,
                work_dir=work_dir,
                default_max_queue=cfg.max_queue,
                torch_threads=cfg.torch_threads or default_torch_threads(),
                management_enabled=cfg.enable_model_management,
                model_layers=server_layers(cfg),
                worker_mode=cfg.worker_mode,
                require_gpu=cfg.require_gpu,
            ),
            self.metrics,
        )
        inference_tokens, management_tokens = check_exposure(cfg)
        health_paths = OPEN_HTTP_HEALTH_PATHS if cfg.open_health else frozenset()
        self.grpc = build_grpc_servers(
            self.dataplane,
            inference_address=cfg.grpc_inference_address,
            management_address=cfg.grpc_management_address,
            max_message_bytes=cfg.max_request_bytes,
            # An interceptor costs every call a little even when it lets everything through.
            inference_interceptors=[GrpcTokenAuth(inference_tokens, open_health=cfg.open_health)]
            if inference_tokens
            else [],
            management_interceptors=[GrpcTokenAuth(management_tokens, open_health=cfg.open_health)]
            if management_tokens
            else [],
            credentials=grpc_credentials(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)
            if cfg.tls_cert_file and cfg.tls_key_file  # check_exposure insists on both or neither
            else None,
        )
        metrics_tokens = Tokens() if cfg.open_metrics else (management_tokens or inference_tokens)
        self._http: list[EmbeddedUvicorn] = []
        for app, address in (
            (
                HttpTokenAuth(
                    inference_app(self.dataplane, max_body_bytes=cfg.max_request_bytes),
                    inference_tokens,
                    open_paths=health_paths,
                ),
                cfg.inference_address,
            ),
            (HttpTokenAuth(management_app(self.dataplane), management_tokens), cfg.management_address),
            (HttpTokenAuth(metrics_app(self.dataplane), metrics_tokens), cfg.metrics_address),
        ):
            host, port = split_address(address)
            self._http.append(EmbeddedUvicorn(uvicorn_config(app, host, port, cfg)))
        self._http_tasks: list[asyncio.Task[None]] = []
        self.stopped = asyncio.Event()
        self.ports: BoundPorts | None = None

    async def start(self) -> BoundPorts:
        await self.grpc.start()
        for srv in self._http:
            self._http_tasks.append(asyncio.create_task(srv.serve()))
        while not all(s.started for s in self._http):
            for t in self._http_tasks:
                if t.done():
                    t.result()  # re-raise a bind failure
                    raise RuntimeError("an HTTP listener stopped during start-up")
            await asyncio.sleep(0.005)
        http_ports = [s.servers[0].sockets[0].getsockname()[1] for s in self._http]
        self.ports = BoundPorts(*http_ports, self.grpc.inference_port, self.grpc.management_port)
        log.info("listening %s", self.ports)
        # Archives are checked and unpacked now, so health already names every model
        # (NOT_SERVING) while the slow part, initialising handlers, happens in load().
        pinned = pinned_digests(self.cfg.model_store) if self.cfg.pin_index else None
        await self.dataplane.open_models(model_specs(self.cfg, pinned))
        await self.grpc.refresh_health()
        return self.ports

    async def load(self) -> None:
        await self.dataplane.load_models()
        # torch and the models leave ~200k long-lived objects; without freezing them every full
        # collection walks them all (70-100 ms pauses that every in-flight request waits for).
        gc.collect()
        gc.freeze()
        await self.grpc.refresh_health()
        ready = [f"{m.name}:{m.version}" for m in self.dataplane.models() if m.state.value == "READY"]
        log.info("models ready: %s (all ready: %s)", ", ".join(ready) or "none", self.dataplane.is_ready())

    async def shutdown(self, *, refuse: bool = True) -> None:
        """Ordered drain: not-ready, refuse new calls, finish accepted ones, stop listeners."""
        if self.dataplane.draining:
            return
        log.info("shutting down: draining for up to %.1f s", self.cfg.grace_seconds)
        self.dataplane.start_draining()
        await self.grpc.set_not_serving()
        await self.dataplane.close(self.cfg.grace_seconds)
        dp = self.dataplane
        log.info("drained: accepted=%d answered=%d ok=%d", dp.accepted, dp.answered, dp.answered_ok)
        # Keep listening a moment, answering UNAVAILABLE: a call that reaches grpc core while the
        # server is stopping would otherwise be CANCELLED, which clients do not retry elsewhere.
        if refuse:
            await asyncio.sleep(min(self.cfg.refuse_seconds, self.cfg.grace_seconds))
        for srv in self._http:
            srv.should_exit = True
        await self.grpc.stop(grace=2.0)
        await asyncio.gather(*self._http_tasks, return_exceptions=True)
        if self._tmp is not None:
            self._tmp.cleanup()
        self.stopped.set()
        log.info("stopped")


async def run(cfg: ServerConfig) -> int:
    server = MarinerServer(cfg)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
    except BaseException:
        await server.shutdown(refuse=False)  # release whatever listeners did start
        raise
    loader = asyncio.create_task(server.load())
    await stop.wait()
    if not loader.done():
        loader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await loader
    await server.shutdown()
    return 0
