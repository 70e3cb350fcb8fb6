"""Assemble and run the server: HTTP (uvicorn) and gRPC (grpc.aio) on one event loop.

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
import socket
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from mariner.server.config import ServerConfig, model_specs, pinned_digests, server_layers
from mariner.server.control.management_http import management_app
from mariner.server.control.metrics import Metrics, MetricsConfig
from mariner.server.control.metrics_http import metrics_app
from mariner.server.core.dataplane import DataPlane, PlaneSettings
from mariner.server.core.errors import Code, ServingError
from mariner.server.protocols.grpc_listener import build_grpc_servers
from mariner.server.protocols.http_listener import inference_app
from mariner.server.security import (
    OPEN_HTTP_HEALTH_PATHS,
    GrpcTokenAuth,
    HttpTokenAuth,
    Tokens,
    exposure_problems,
    grpc_credentials,
    load_tokens,
)

log = logging.getLogger("mariner")


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the app owns SIGTERM for an ordered drain."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Drop idle TLS connections at once, then uvicorn's own graceful shutdown.

        uvicorn closes an idle keep-alive connection politely; over TLS that sends close_notify
        and waits for the peer's, which a client that has simply stopped using the connection
        never sends. asyncio then waits its 30 s TLS shutdown timeout and uvicorn its whole grace
        period, although no request is in flight. An idle connection has nothing left to send,
        so aborting it loses nothing; connections with a response in progress are left alone.
        """
        if self.config.is_ssl:
            for connection in list(self.server_state.connections):
                cycle = getattr(connection, "cycle", None)
                if cycle is None or cycle.response_complete:
                    connection.transport.abort()
        await super().shutdown(sockets)


def _uvicorn_config(app: object, host: str, port: int, cfg: ServerConfig) -> uvicorn.Config:
    tls: dict[str, object] = {}
    if cfg.tls_cert_file is not None:
        tls = {"ssl_certfile": str(cfg.tls_cert_file), "ssl_keyfile": str(cfg.tls_key_file)}
        if cfg.tls_client_ca_file is not None:
            tls.update(ssl_ca_certs=str(cfg.tls_client_ca_file), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="none",
        lifespan="off",
        access_log=cfg.access_log,
        log_level="warning",
        timeout_graceful_shutdown=int(cfg.grace_seconds) + 1,
        **tls,
    )


def default_torch_threads() -> int:
    """Intra-op threads for CPU inference: all cores but one, which the event loop needs.

    torch's default (every core) makes OpenMP threads spin on the event loop's core: on 2 cores
    p99 at 4 concurrent clients went from ~13 ms to ~300 ms (docs/benchmark.md).
    """
    return max(1, (os.cpu_count() or 1) - 1)


def check_exposure(cfg: ServerConfig) -> tuple[Tokens, Tokens]:
    """Load the tokens; refuse to listen beyond loopback without them unless --insecure."""
    if (cfg.tls_cert_file is None) != (cfg.tls_key_file is None):
        raise ServingError(Code.INVALID_ARGUMENT, "TLS needs both --tls-cert-file and --tls-key-file")
    inference = load_tokens(cfg.inference_token, cfg.inference_token_file)
    management = load_tokens(cfg.management_token, cfg.management_token_file)
    problems = exposure_problems(
        {
            "HTTP inference": (cfg.inference_address, inference),
            "gRPC inference": (cfg.grpc_inference_address, inference),
            "HTTP management": (cfg.management_address, management),
            "gRPC management": (cfg.grpc_management_address, management),
        }
    )
    if problems and not cfg.insecure:
        raise ServingError(
            Code.PERMISSION_DENIED,
            "refusing to listen beyond loopback without authentication ("
            + "; ".join(problems)
            + "): anyone who can reach these ports could run the models and manage them. Set "
            "MARINER_INFERENCE_TOKEN_FILE / MARINER_MANAGEMENT_TOKEN_FILE (or the *_TOKEN variables), "
            "or pass --insecure if something in front of Mariner authenticates callers",
        )
    if problems:
        log.warning("listening beyond loopback WITHOUT authentication (--insecure): %s", "; ".join(problems))
    return inference, management


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


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
        self._http: list[_EmbeddedUvicorn] = []
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
            host, port = _split(address)
            self._http.append(_EmbeddedUvicorn(_uvicorn_config(app, host, port, cfg)))
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
        self.dataplane.open_models(model_specs(self.cfg, pinned))
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
