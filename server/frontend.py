"""A frontend process of `mariner serve`: the inference listeners, adapters, admission and batchers.

The supervisor starts it (`python -m mariner.server.frontend --control-fd N`) with one end of a
socketpair as its control channel. The frontend opens no archive and runs no model code: it
builds its DataPlane from the model table the supervisor sends (which worker serves which model
version, on which Unix socket) and sends batches to those workers. Every frontend listens on the
same inference ports (SO_REUSEPORT); the kernel spreads connections over them.

Table updates: a worker that became ready is connected and added to its model's batcher; one
that is gone (restarting, scaled down, unregistered) is retired from it (a batch it runs now
finishes). A worker that dies mid-batch fails that batch only; a batch past responseTimeout
gets its worker SIGKILLed; either way the supervisor restarts it and a later table brings the
new one. SIGTERM, or the supervisor going away, drains this frontend as the single-process
server drains: not ready, new calls refused with UNAVAILABLE, every accepted call answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mariner.server.app import _EmbeddedUvicorn, _split, _uvicorn_config
from mariner.server.control import channel
from mariner.server.control.metrics import Metrics, MetricsConfig
from mariner.server.core.batcher import Batcher, BatchPolicy, BatchRunner
from mariner.server.core.dataplane import DataPlane, ModelEndpoint, PlaneSettings, _ObserverAdapter
from mariner.server.core.errors import ServingError
from mariner.server.core.tensors import ModelSignature
from mariner.server.core.types import InferRequest, InferResult, ModelInfo, ModelState, WorkerInfo
from mariner.server.logs import setup_logging
from mariner.server.protocols.grpc_listener import build_grpc_servers
from mariner.server.protocols.http_listener import inference_app
from mariner.server.security import (
    OPEN_HTTP_HEALTH_PATHS,
    GrpcTokenAuth,
    HttpTokenAuth,
    grpc_credentials,
    load_tokens,
)
from mariner.server.workers.api import ModelEntry, WorkerEndpoint

log = logging.getLogger("mariner.frontend")


class _Worker:
    """One connection to one worker process (one generation of one instance), as a BatchRunner.

    Tracks whether a batch is running so that a retired connection closes only once that batch
    has its answer.
    """

    def __init__(self, endpoint: WorkerEndpoint, conn: Any) -> None:
        self.endpoint = endpoint
        self.conn = conn
        self.id = endpoint.id
        self.instance = endpoint.instance
        self.generation = endpoint.generation
        self.busy = False
        self.retired = False
        self.batches = 0

    @property
    def status(self) -> str:
        return "STOPPED" if self.retired else "READY"

    async def run(self, requests: Sequence[InferRequest]) -> list[InferResult]:
        self.busy = True
        try:
            results = await self.conn.run(requests)
            self.batches += 1
            return results
        finally:
            self.busy = False
            if self.retired:
                self.conn.close()

    def retire(self) -> None:
        self.retired = True
        if not self.busy:
            self.conn.close()

    def abandon(self) -> None:
        self.retired = True
        self.conn.abandon()


class RemoteEndpoint(ModelEndpoint):
    """A model version whose instances are worker processes the supervisor runs.

    Built from a `ModelEntry` instead of an opened archive (ModelEndpoint.__init__ opens one):
    the supervisor already checked the archive and resolved the settings once. Inference,
    deadlines and admission are ModelEndpoint's own.
    """

    def __init__(self, entry: ModelEntry, metrics: Metrics) -> None:  # noqa: D107 - see class
        s = entry.settings
        self.entry = entry
        self.name, self.version = entry.name, entry.version
        self.settings = s
        self.batch_size = s.batch_size
        self.max_batch_delay_ms = s.max_batch_delay_ms
        self.response_timeout_s = s.response_timeout_s
        self.min_workers, self.max_workers, self.max_queue = s.min_workers, s.max_workers, s.max_queue
        self.loaded_at_startup = entry.loaded_at_startup
        self.state = ModelState.LOADING
        self.load_seconds = None
        self.signature = ModelSignature.from_config(entry.model_config.get("signature"))
        self._metrics = metrics
        self._oom = metrics.oom_splits.labels(self.name, self.version)
        self.runners: list[Any] = []
        self._ready_since: dict[str, float] = {}
        self.batcher = None
        self.policy = BatchPolicy(
            self.batch_size,
            self.max_batch_delay_ms / 1e3,
            self.max_queue,
            batch_timeout_s=self.response_timeout_s,
        )
        self._workers: dict[int, _Worker] = {}  # instance -> its live connection, in the batcher
        self._ever_ready = False
        self._t0 = time.perf_counter()

    def _set_state(self) -> None:
        if self.state is ModelState.STOPPING:
            return
        ready = bool(self._workers)
        if ready:
            self.state = ModelState.READY
            self._ever_ready = True
        else:
            self.state = ModelState.RESTARTING if self._ever_ready else ModelState.LOADING
        self._metrics.model_ready.labels(self.name, self.version).set(1 if ready else 0)

    async def update(self, entry: ModelEntry) -> None:
        """Follow the supervisor's table: connect new workers, retire the ones that are gone."""
        from mariner.server.workers.connection import WorkerConnection

        self.entry = entry
        ready = {w.instance: w for w in entry.workers if w.status == "READY"}
        for instance, current in list(self._workers.items()):
            want = ready.get(instance)
            if want is None or want.id != current.id or want.pid != current.endpoint.pid:
                self._retire(current)
        for instance, endpoint in ready.items():
            if instance in self._workers:
                continue
            conn = WorkerConnection(endpoint, batch_size=self.batch_size, on_oom=self._oom.inc)
            try:
                await conn.start()
            except Exception as exc:  # the worker died since the table was sent: a later table says so
                log.warning("cannot connect to worker %s (pid %d): %s", endpoint.id, endpoint.pid, exc)
                continue
            w = _Worker(endpoint, conn)
            self._workers[instance] = w
            self.runners.append(w)
            self._ready_since[w.id] = endpoint.start_time or time.time()
            if self.batcher is None:
                self.batcher = Batcher(
                    [w],
                    self.policy,
                    observer=_ObserverAdapter(self._metrics, self.name, self.version),
                    replace_runner=self.replace_runner,
                )
                self.batcher.start()
                self.load_seconds = time.perf_counter() - self._t0
            else:
                self.batcher.add_runner(w)
        self._set_state()

    def _retire(self, w: _Worker) -> None:
        if self._workers.get(w.instance) is w:
            del self._workers[w.instance]
        if w in self.runners:
            self.runners.remove(w)
            if self.batcher is not None and not w.retired:
                self.batcher.retire_runner(w)
        w.retire()

    async def replace_runner(self, old: BatchRunner, reason: str) -> None:
        """A worker failed or hung on a batch: let it go (SIGKILL when hung). The supervisor
        restarts it and its next table brings the new worker, so nothing is returned here."""
        assert isinstance(old, _Worker)
        if self._workers.get(old.instance) is old:
            del self._workers[old.instance]
        if old in self.runners:
            self.runners.remove(old)
        if reason == "hung":
            old.abandon()  # no thread and no CPU are left behind: the process goes
        else:
            old.retire()
        self._metrics.instance_restarts.labels(self.name, self.version, reason).inc()
        self._set_state()
        return

    async def close(self, timeout: float | None) -> None:
        self.state = ModelState.STOPPING
        self._metrics.model_ready.labels(self.name, self.version).set(0)
        if self.batcher is not None:
            await self.batcher.close(timeout)
        for w in list(self._workers.values()):
            w.retire()
        self._workers.clear()

    def info(self, is_default: bool) -> ModelInfo:
        e = self.entry
        return ModelInfo(
            name=self.name,
            version=self.version,
            archive=e.archive_file,
            sha256=e.sha256,
            handler=str(e.manifest.get("model", {}).get("handler", "")),
            is_default=is_default,
            state=self.state,
            batch_size=self.batch_size,
            max_batch_delay_ms=self.max_batch_delay_ms,
            response_timeout_s=self.response_timeout_s,
            queue_size=self.max_queue,
            min_workers=self.min_workers,
            max_workers=self.max_workers,
            workers=tuple(
                WorkerInfo(
                    w.id,
                    w.endpoint.device,
                    w.status,
                    w.batches,
                    pid=w.endpoint.pid,
                    started_at=self._ready_since.get(w.id),
                )  # fmt: skip
                for w in self._workers.values()
            ),
            load_seconds=self.load_seconds,
            signature=self.signature,
            loaded_at_startup=self.loaded_at_startup,
            pending_requests=self.batcher.queued_items if self.batcher is not None else 0,
            device_type=self.settings.device_type,
        )


def reuseport_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) that the other frontends share (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class Frontend:
    """One frontend: its DataPlane, the inference listeners and the control channel."""

    def __init__(self, init: channel.FrontendInit, control: socket.socket) -> None:
        cfg = self.cfg = init.cfg
        self.index = init.index
        self._control = control
        self.metrics = Metrics(MetricsConfig(slo_seconds=cfg.slo_ms / 1e3))
        self.dataplane = DataPlane(
            PlaneSettings(
                model_store=cfg.model_store,
                work_dir=Path(tempfile.gettempdir()),
                default_max_queue=cfg.max_queue,
            ),
            self.metrics,
        )
        tokens = load_tokens(cfg.inference_token, cfg.inference_token_file)
        grpc_host, _ = _split(cfg.grpc_inference_address)
        self.grpc = build_grpc_servers(
            self.dataplane,
            inference_address=f"{grpc_host}:{init.grpc_port}",
            management_address=None,
            max_message_bytes=cfg.max_request_bytes,
            inference_interceptors=[GrpcTokenAuth(tokens, open_health=cfg.open_health)] if tokens else [],
            credentials=grpc_credentials(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)
            if cfg.tls_cert_file and cfg.tls_key_file
            else None,
            reuse_port=True,
        )
        host, _ = _split(cfg.inference_address)
        self._http_socket = reuseport_listener(host, init.http_port)
        app = HttpTokenAuth(
            inference_app(self.dataplane, max_body_bytes=cfg.max_request_bytes),
            tokens,
            open_paths=OPEN_HTTP_HEALTH_PATHS if cfg.open_health else frozenset(),
        )
        self.http = _EmbeddedUvicorn(_uvicorn_config(app, host, init.http_port, cfg))
        self._applied = 0
        self._closing: set[asyncio.Task[None]] = set()

    async def apply(self, table: channel.ModelTable) -> None:
        dp = self.dataplane
        wanted = {(e.name, e.version) for e in table.entries}
        for e in table.entries:
            ep = dp._endpoints.get(e.name, {}).get(e.version)
            if ep is None:
                ep = RemoteEndpoint(e, self.metrics)
                dp.install_endpoint(ep)
            assert isinstance(ep, RemoteEndpoint)
            await ep.update(e)
            if e.is_default:
                dp._defaults[e.name] = e.version
        gone = [(name, v) for name, vs in dp._endpoints.items() for v in vs if (name, v) not in wanted]
        for name, version in gone:
            ep = dp.remove_endpoint(name, version)
            closing = asyncio.create_task(ep.close(ep.response_timeout_s))  # its accepted calls finish
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        await self.grpc.refresh_health()

    async def _follow(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stop: asyncio.Event
    ) -> None:
        while (msg := await channel.receive(reader)) is not None:
            if isinstance(msg, channel.ModelTable) and msg.version >= self._applied:
                try:
                    await self.apply(msg)
                except Exception:
                    log.exception("frontend %d: applying model table %d failed", self.index, msg.version)
                self._applied = msg.version
                await channel.send(writer, channel.TableApplied(msg.version))
        if not stop.is_set():
            log.error("frontend %d: the supervisor went away; draining", self.index)
            stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        reader, writer = await asyncio.open_unix_connection(sock=self._control)
        await self.grpc.start()
        http_task = asyncio.create_task(self.http.serve(sockets=[self._http_socket]))
        while not self.http.started:
            if http_task.done():
                http_task.result()
                raise OSError("the HTTP inference listener stopped during start-up")
            await asyncio.sleep(0.005)
        await channel.send(writer, channel.Listening(os.getpid()))
        log.info("frontend %d (pid %d) listening", self.index, os.getpid())
        follower = asyncio.create_task(self._follow(reader, writer, stop))
        await stop.wait()
        # The same ordered drain as the single-process server (app.MarinerServer.shutdown).
        dp, cfg = self.dataplane, self.cfg
        dp.start_draining()
        await self.grpc.set_not_serving()
        await dp.close(cfg.grace_seconds)
        log.info("drained: accepted=%d answered=%d ok=%d", dp.accepted, dp.answered, dp.answered_ok)
        with contextlib.suppress(OSError, ConnectionError):
            await channel.send(writer, channel.Drained(dp.accepted, dp.answered, dp.answered_ok))
        await asyncio.sleep(min(cfg.refuse_seconds, cfg.grace_seconds))
        self.http.should_exit = True
        await self.grpc.stop(grace=2.0)
        await asyncio.gather(http_task, return_exceptions=True)
        follower.cancel()
        writer.close()
        return 0


async def _run(init: channel.FrontendInit, control: socket.socket) -> int:
    # Built inside the running loop: grpc.aio servers belong to the loop they are created in.
    return await Frontend(init, control).run()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mariner.server.frontend")
    parser.add_argument("--control-fd", type=int, required=True)
    args = parser.parse_args(argv)
    control = socket.socket(fileno=args.control_fd)
    init = channel.receive_blocking(control)
    if not isinstance(init, channel.FrontendInit):
        print("frontend: no start message from the supervisor", file=sys.stderr)
        return 2
    setup_logging(init.cfg.log_level)
    control.setblocking(False)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        runner = asyncio.run
    try:
        return runner(_run(init, control))
    except (ServingError, OSError, RuntimeError) as exc:
        logging.getLogger("mariner").error(
            "frontend %d cannot start: %s", init.index, getattr(exc, "message", exc)
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
