"""`mariner serve`: the supervisor. It runs no model code and answers no inference call.

It reads the config, opens and checks every archive (a bad one is logged and reported, the
others serve), reserves the inference ports, starts `minWorkers` model worker processes per
model version and `--frontends` frontend processes (fresh interpreters, never fork), tells
every frontend where the workers are (a `ModelTable` over its control channel, at start and
after every change), restarts any child that dies with exponential backoff, and serves the
control plane: management (REST 8081, gRPC 7071), health of the whole server on the management
port, and `/metrics` (8082) merged over every process by prometheus_client's multiprocess mode.

Shutdown (SIGTERM/SIGINT): not ready; SIGTERM to every frontend, each of which refuses new
calls and answers every accepted one; then the workers stop; then the supervisor exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.common import health
from mariner.server.common.child_env import forget_secrets
from mariner.server.common.config import ServerConfig, frontend_count
from mariner.server.common.configured_models import model_specs, pinned_digests
from mariner.server.common.connection_budget import raise_descriptor_limit
from mariner.server.common.grpc_server import bind_port
from mariner.server.common.http_common import json_response
from mariner.server.common.listeners import (
    EmbeddedUvicorn,
    check_exposure,
    grpc_tls,
    listen_on,
    listener_auth,
    split_address,
    uvicorn_config,
)
from mariner.server.common.metrics import Metrics, MetricsConfig
from mariner.server.common.models import SERVED_STATES
from mariner.server.common.security import OPEN_HTTP_HEALTH_PATHS, Tokens
from mariner.server.compat.torchserve.logs.access import HttpAccessLog, grpc_access_log
from mariner.server.compat.torchserve.tokens import (
    KEY_FILE_NAME,
    Key,
    KeyKind,
    TokenApi,
    TorchServeKeys,
    start_keys,
)
from mariner.server.contracts.types import ModelState
from mariner.server.supervisor.frontends import FrontendPool
from mariner.server.supervisor.management.grpc import SERVICE_NAME as MANAGEMENT_SERVICE
from mariner.server.supervisor.management.grpc import build_management_server
from mariner.server.supervisor.management.http import management_app
from mariner.server.supervisor.management.workflow_http import workflow_routes
from mariner.server.supervisor.metrics_http import metrics_app
from mariner.server.supervisor.ports import reserve_port
from mariner.server.supervisor.private_dir import ensure_private_dir
from mariner.server.supervisor.registry import ModelRegistry
from mariner.server.supervisor.snapshots import ConfigSnapshots
from mariner.server.supervisor.ts_logs import TsLogs
from mariner.server.supervisor.worker_process import socket_dir_for
from mariner.server.supervisor.workflows import WorkflowRegistry

log = logging.getLogger("mariner.supervisor")


class Supervisor:
    """The control-plane process: the order things start and stop in, and the control plane's
    listeners (management, health, metrics) over the model registry."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.frontend_count = frontend_count(cfg)
        # The tokens are in `cfg` now: no child may find them in its environment.
        forget_secrets((cfg.inference_token, cfg.management_token))
        # The management listeners hold connections too: the soft descriptor limit (often 1,024)
        # would run out long before their connection cap.
        raise_descriptor_limit()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if cfg.work_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="mariner-")
            self.work_dir = Path(self._tmp.name)
        else:
            self.work_dir = cfg.work_dir
        # Worker sockets and the handler code workers import live here: ours alone, or refused.
        ensure_private_dir(self.work_dir)
        # Unix socket paths are limited to 107 bytes: the workers' sockets go where they stay short.
        self._socket_dir, self._socket_dir_is_temp = socket_dir_for(self.work_dir)
        self.metrics = Metrics(MetricsConfig(slo_seconds=cfg.slo_ms / 1e3))
        # TorchServe's log files and console: written from here, workers' output read here.
        self.ts_logs = TsLogs(cfg)
        self.registry = ModelRegistry(
            cfg,
            self.work_dir,
            self._socket_dir,
            self.metrics,
            self._publish,
            frontends_ok=self._frontends_ok,
            worker_output=self.ts_logs,
        )
        # TorchServe's workflows (.war): graphs over models the registry serves.
        self.workflows = WorkflowRegistry(
            self.registry,
            store=cfg.workflow_store or cfg.model_store,
            model_store=cfg.model_store,
            work_dir=self.work_dir,
            on_change=self._publish,
            service_envelope=cfg.service_envelope,
        )
        # TorchServe's config snapshots: at start, after each management change, at a clean stop
        # (without workflows and their nodes, as TorchServe's).
        self.snapshots = ConfigSnapshots(
            cfg, lambda: self.workflows.without_nodes(self.registry.snapshot_models())
        )
        self.registry.on_management_change = self.snapshots.changed
        self._started = False
        self.frontends: FrontendPool | None = None
        self._reserved: list[socket.socket] = []
        self._http: list[EmbeddedUvicorn] = []
        self._http_tasks: list[asyncio.Task[None]] = []
        self._grpc: Any = None
        self._health: health_aio.HealthServicer = health.GrpcHealth()
        self._health_task: asyncio.Task[None] | None = None
        self._known_models: set[str] = set()
        self.ports: dict[str, int] = {}
        self.draining = False
        self.keys: TorchServeKeys | None = None  # TorchServe's token authorization, when on

    def _frontends_ok(self) -> bool:
        return self.frontends is not None and self.frontends.all_up()

    async def _publish(self) -> None:
        if self.frontends is not None:
            await self.frontends.publish(self.registry.table(), self.workflows.table())
        await self.refresh_health()

    async def refresh_health(self) -> None:
        if self.draining:
            return
        reg = self.registry
        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        await self._health.set("", serving if reg.is_ready() else not_serving)
        await self._health.set(MANAGEMENT_SERVICE, serving)  # answers whether or not models are ready
        names = {i.name for i in reg.models()}
        for name in sorted(names):
            await self._health.set(
                name, serving if reg.model_ready(name) and self._frontends_ok() else not_serving
            )
        for gone in sorted(self._known_models - names):
            await self._health.set(gone, not_serving)
        self._known_models |= names

    async def _poll_health(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                await self.refresh_health()
            except Exception:
                log.exception("health refresh failed")

    def _management_routes(self) -> list[Route]:
        reg = self.registry

        async def ping(request: Request) -> Response:
            """The whole server's health: every frontend up and every model with a live worker."""
            if reg.is_ready():
                return json_response({"status": "Healthy"})
            return json_response({"status": "Unhealthy"}, 500)

        return [Route("/ping", ping, methods=["GET"]), *health.http_routes(reg)]

    async def start(self) -> None:
        cfg = self.cfg
        self.ts_logs.start()
        inference_tokens, management_tokens = check_exposure(cfg)
        # TorchServe's key_file.json is written before any listener takes a call, as TorchServe does.
        if not cfg.disable_token_auth:
            self.keys = start_keys(Path.cwd() / KEY_FILE_NAME, cfg.token_expiration_min)
        management_key = self.keys.management if self.keys is not None else None
        management_auth = listener_auth(management_tokens, management_key)
        # Reserve the shared inference ports first: a port in use fails here, before any child.
        http_sock = reserve_port(cfg.inference_address)
        grpc_sock = reserve_port(cfg.grpc_inference_address)
        self._reserved = [http_sock, grpc_sock]
        http_port, grpc_port = http_sock.getsockname()[1], grpc_sock.getsockname()[1]

        # Control plane: management (REST, gRPC) and metrics, all in this process.
        self._grpc = build_management_server(
            self.registry,
            max_message_bytes=cfg.max_request_bytes,
            health=self._health,
            on_change=self.refresh_health,
            interceptors=[*management_auth.grpc(open_health=cfg.open_health), grpc_access_log("management")],
        )
        grpc_mgmt_port = bind_port(
            self._grpc, cfg.grpc_management_address, "management", grpc_tls(cfg, "grpc_management")
        )
        await self.refresh_health()
        await self._grpc.start()
        # Closed metrics take the management credentials (Mariner's inference tokens without them).
        metrics_auth = listener_auth(
            Tokens() if cfg.open_metrics else (management_tokens or inference_tokens),
            None if cfg.open_metrics else management_key,
        )
        health_paths = OPEN_HTTP_HEALTH_PATHS if cfg.open_health else frozenset()
        mgmt = management_app(self.registry)
        for route in [*self._management_routes(), *workflow_routes(self.workflows)]:
            mgmt.router.routes.append(route)
        mgmt_app = management_auth.http(mgmt, open_paths=health_paths)
        if self.keys is not None:  # TorchServe's token API, authorised by its API key alone
            mgmt_app = TokenApi(mgmt_app, self.keys, self._publish_inference_key)
        for app, address, listener in (
            (HttpAccessLog(mgmt_app, "management"), cfg.management_address, "management"),
            (
                HttpAccessLog(metrics_auth.http(metrics_app(self.registry)), "metrics"),
                cfg.metrics_address,
                "metrics",
            ),
        ):
            # Bound here, so a port in use is an OSError naming it (uvicorn would sys.exit).
            sock = listen_on(address)
            self._reserved.append(sock)
            host, _ = split_address(address)
            srv = EmbeddedUvicorn(uvicorn_config(app, host, sock.getsockname()[1], cfg, listener=listener))
            self._http.append(srv)
            self._http_tasks.append(asyncio.create_task(srv.serve(sockets=[sock])))
        while not all(s.started for s in self._http):
            for t, address in zip(
                self._http_tasks, (cfg.management_address, cfg.metrics_address), strict=True
            ):
                if t.done():
                    # uvicorn reports a failed bind by logging it and exiting (SystemExit).
                    with contextlib.suppress(Exception, SystemExit):
                        t.result()
                    raise OSError(f"cannot listen on {address!r}: address in use or not available")
            await asyncio.sleep(0.005)
        mgmt_port, metrics_port = (s.servers[0].sockets[0].getsockname()[1] for s in self._http)
        self.ports = {
            "inference": http_port,
            "management": mgmt_port,
            "metrics": metrics_port,
            "grpc_inference": grpc_port,
            "grpc_management": grpc_mgmt_port,
        }
        log.info(
            "supervisor pid %d: listening %s; %d frontends", os.getpid(), self.ports, self.frontend_count
        )

        # Archives are checked here, once; workers and frontends then start in parallel.
        pinned = pinned_digests(cfg.model_store) if cfg.pin_index else None
        versions = await self.registry.open_models(model_specs(cfg, pinned))
        self.frontends = FrontendPool(
            cfg, self.frontend_count, http_port, grpc_port, records=self.ts_logs.frontend_pipe
        )
        if self.keys is not None:
            self.frontends.inference_key = self.keys.current(KeyKind.INFERENCE)
        await self.registry.start_workers(versions)
        await self.frontends.start()
        await self._publish()
        self._health_task = asyncio.create_task(self._poll_health(), name="supervisor-health")
        await self.snapshots.save("startup")
        self._started = True

    async def _publish_inference_key(self, key: Key) -> None:
        """A new TorchServe inference key to every frontend (they check inference calls)."""
        if self.frontends is not None:
            await self.frontends.set_inference_key(key)

    async def wait_ready(self) -> None:
        """Log once start-up has settled: every frontend listens and every worker's first start
        has ended, in a worker ready or a failure (a FAILED model keeps retrying with backoff;
        operators and readiness probes see it in describe and /readyz, this line says it once)."""
        t0 = time.perf_counter()
        reg = self.registry
        while not (reg.startup_settled() and self._frontends_ok()) and not self.draining:
            await asyncio.sleep(0.05)
        if self.draining:
            return
        infos = reg.models()
        ready = [f"{i.name}:{i.version}" for i in infos if i.state is ModelState.READY]
        # A version asked for with no worker (a snapshot's minWorkers 0) is served as asked, not missing.
        failed = [f"{i.name}:{i.version}" for i in infos if i.state not in SERVED_STATES]
        log.info(
            "models ready: %s%s (all ready: %s, %.2f s after the listeners)", ", ".join(ready) or "none",
            f"; not ready: {', '.join(failed)}" if failed else "", reg.is_ready(), time.perf_counter() - t0,
        )  # fmt: skip
        # TorchServe's line for launchers and its tests; printed once the listeners are up and the
        # models asked for at start-up had their first start (a model still loading answers 503
        # here, where TorchServe would queue the request until a worker is up).
        self.ts_logs.server_started()

    async def shutdown(self) -> None:
        """Not ready; frontends drain and exit; workers stop; listeners close."""
        if self.draining:
            return
        self.draining = True
        self.registry.draining = True
        log.info("shutting down: frontends drain for up to %.1f s", self.cfg.grace_seconds)
        if self._health_task is not None:
            self._health_task.cancel()
        with contextlib.suppress(Exception):
            await self._health.enter_graceful_shutdown()
        if self.frontends is not None:
            await self.frontends.stop(self.cfg.grace_seconds + self.cfg.refuse_seconds + 10.0)
            d = self.frontends.drained
            log.info(
                "all %d frontends drained: total accepted=%d answered=%d ok=%d", len(d),
                sum(x.accepted for x in d), sum(x.answered for x in d), sum(x.ok for x in d),
            )  # fmt: skip
        await self.snapshots.close()
        if self._started:  # a start that failed has no state worth restoring
            await self.snapshots.save("shutdown")
        await self.registry.close(grace=5.0)
        for srv in self._http:
            srv.should_exit = True
        if self._grpc is not None:
            await self._grpc.stop(2.0)
        await asyncio.gather(*self._http_tasks, return_exceptions=True)
        for s in self._reserved:
            s.close()
        if self._socket_dir_is_temp:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        if self._tmp is not None:
            self._tmp.cleanup()
        if self.keys is not None:  # TorchServe's launcher removes it on --stop; nothing else would
            self.keys.remove_file()
        log.info("stopped")
        await self.ts_logs.close()  # last: everything above is in the files


async def run(cfg: ServerConfig) -> int:
    """`mariner serve`: start, serve until SIGTERM/SIGINT, shut down in order. 0 on a clean stop."""
    sup = Supervisor(cfg)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(sup.start())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([starting, stopper], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await starting
        await sup.shutdown()
        return 0
    if starting.exception() is not None:
        await sup.shutdown()
        failure = starting.exception()
        assert failure is not None
        raise failure
    ready = asyncio.create_task(sup.wait_ready())
    await stopper
    ready.cancel()
    await sup.shutdown()
    return 0
