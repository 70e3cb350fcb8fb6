"""A frontend process of `mariner serve`: the inference listeners, adapters, admission and batchers.

The supervisor starts it (`python -m mariner.server.frontend.main --control-fd N`) with one end of a
socketpair as its control channel. The frontend opens no archive and runs no model code: it
builds its DataPlane from the model table the supervisor sends (which worker serves which model
version, on which Unix socket) and sends batches to those workers. Every frontend listens on the
same inference ports (SO_REUSEPORT); the kernel spreads connections over them.

Table updates: a worker that became ready is connected and added to its model's batcher; one
that is gone (restarting, scaled down, unregistered) is retired from it (a batch it runs now
finishes). A worker that dies mid-batch fails that batch only; a batch past responseTimeout
gets its worker SIGKILLed; either way the supervisor restarts it and a later table brings the
new one. SIGTERM, or the supervisor going away, drains this frontend: not ready, new calls
refused with UNAVAILABLE, every accepted call answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence

from mariner.server.common import control_channel as channel
from mariner.server.common import event_loop, parent_death
from mariner.server.common.connection_budget import frontend_budget
from mariner.server.common.grpc_server import GrpcLimits
from mariner.server.common.heap import freeze_heap
from mariner.server.common.held_bytes import MIB, HeldBytes, HeldLimits
from mariner.server.common.listeners import (
    EmbeddedUvicorn,
    grpc_tls,
    listener_auth,
    reuseport_listener,
    split_address,
)
from mariner.server.common.logs import setup_logging
from mariner.server.common.metrics import Metrics, MetricsConfig
from mariner.server.common.security import load_tokens
from mariner.server.compat.torchserve.logs import emit as ts_emit
from mariner.server.compat.torchserve.logs.access import grpc_access_log
from mariner.server.compat.torchserve.logs.records import RecordPipe
from mariner.server.compat.torchserve.tokens import KeyCheck
from mariner.server.contracts.errors import ServingError
from mariner.server.contracts.peer import PeerRefused
from mariner.server.contracts.workflow_dag import WorkflowTable
from mariner.server.frontend.dataplane import DataPlane
from mariner.server.frontend.endpoint import ModelEndpoint
from mariner.server.frontend.protocols.grpc_drain_gate import GrpcDrainGate
from mariner.server.frontend.protocols.grpc_listener import build_grpc_servers
from mariner.server.frontend.protocols.http_inference import inference_listener

log = logging.getLogger("mariner.frontend")

# The least time grpc's server.stop gets to end the calls it still has once the grace period is
# spent (their clients are then told CANCELLED).
MIN_GRPC_STOP_S = 2.0


class Frontend:
    """One frontend: its DataPlane, the inference listeners and the control channel."""

    def __init__(self, init: channel.FrontendInit, control: socket.socket) -> None:
        cfg = self.cfg = init.cfg
        self.index = init.index
        self._control = control
        self._orphaned = False  # the supervisor went away: close the listeners first
        self.metrics = Metrics(MetricsConfig(slo_seconds=cfg.slo_ms / 1e3))
        self.dataplane = DataPlane(self.metrics)
        self.dataplane.awaiting_table = True  # the supervisor's first table (version 0) is empty
        self.workflows = WorkflowTable()  # TorchServe workflows, from the supervisor's table
        tokens = load_tokens(cfg.inference_token, cfg.inference_token_file)
        # TorchServe's inference key, when its token authorization is on: it arrives with each
        # model table (the first one before this frontend listens); until then nothing passes.
        self.torchserve_key = None if cfg.disable_token_auth else KeyCheck()
        auth = listener_auth(tokens, self.torchserve_key)
        # One descriptor budget for both protocols, so a flood on one cannot starve the other.
        budget = frontend_budget(cfg.http_max_connections, cfg.grpc_max_connections)
        # One budget of request bytes held, over both protocols and every connection and stream.
        self.held = HeldBytes(
            HeldLimits(limit=cfg.frontend_max_held_mb * MIB, stream_limit=cfg.stream_max_held_mb * MIB)
        )
        grpc_host, _ = split_address(cfg.grpc_inference_address)
        self.grpc = build_grpc_servers(
            self.dataplane,
            inference_address=f"{grpc_host}:{init.grpc_port}",
            max_message_bytes=cfg.max_request_bytes,
            inference_interceptors=[
                *auth.grpc(open_health=cfg.open_health),
                grpc_access_log(f"frontend-{self.index}"),
                GrpcDrainGate(self.dataplane),
            ],
            limits=GrpcLimits(budget.grpc, cfg.grpc_max_concurrent_streams, cfg.grpc_idle_timeout_s),
            credentials=grpc_tls(cfg, "grpc_inference"),
            reuse_port=True,
            held=self.held,
        )
        host, _ = split_address(cfg.inference_address)
        self._http_host, self._http_port = host, init.http_port
        http_cfg = dataclasses.replace(cfg, http_max_connections=budget.http)
        self.http = EmbeddedUvicorn(
            inference_listener(
                self.dataplane,
                http_cfg,
                auth,
                port=init.http_port,
                thread=f"frontend-{self.index}",
                held=self.held,
                workflows=self.workflows,
            )
        )
        self._applied = 0
        self._ready = False
        self._closing: set[asyncio.Task[None]] = set()

    async def apply(self, table: channel.ModelTable) -> None:
        dp = self.dataplane
        if self.torchserve_key is not None and table.inference_key is not None:
            self.torchserve_key.set(table.inference_key)
        wanted = {(e.name, e.version) for e in table.entries}
        for e in table.entries:
            ep = dp.endpoint(e.name, e.version)
            if ep is None:
                ep = ModelEndpoint(e, self.metrics)
                dp.install_endpoint(ep)
            assert isinstance(ep, ModelEndpoint)
            await ep.update(e)
            if e.is_default:
                dp.set_default(e.name, e.version)
        self.workflows.replace(table.workflows)
        if table.version >= 1:  # what the supervisor serves, not its placeholder before start-up
            dp.awaiting_table = False
        gone = [key for key in dp.installed() if key not in wanted]
        for name, version in gone:
            ep = dp.remove_endpoint(name, version)
            closing = asyncio.create_task(ep.close(ep.response_timeout_s))  # its accepted calls finish
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        await self.grpc.refresh_health()
        ready = dp.is_ready()
        if ready != self._ready:  # readiness flips are worth a line: probes act on them
            self._ready = ready
            log.info("frontend %d %s", self.index, "ready" if ready else "not ready")

    async def _apply_and_ack(self, msg: channel.ModelTable, writer: asyncio.StreamWriter) -> None:
        if msg.version < self._applied:
            return
        try:
            await self.apply(msg)
        except Exception:
            log.exception("frontend %d: applying model table %d failed", self.index, msg.version)
        self._applied = msg.version
        await channel.send(writer, channel.TableApplied(msg.version))

    async def _follow(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stop: asyncio.Event
    ) -> None:
        while (msg := await channel.receive(reader)) is not None:
            if isinstance(msg, channel.ModelTable):
                await self._apply_and_ack(msg, writer)
        if not stop.is_set():
            log.error("frontend %d: the supervisor went away; closing the listeners", self.index)
            self._orphaned = True
            stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        reader, writer = await asyncio.open_unix_connection(sock=self._control)
        # The supervisor sends the model table right after the start message. Apply it (connect
        # to every worker it lists as ready) before joining the shared ports: the kernel hands a
        # listening frontend connections at once, and a restarted frontend that listened first
        # would answer them 503 LOADING while the other frontends could have served them.
        first = await channel.receive(reader)
        if isinstance(first, channel.ModelTable):
            await self._apply_and_ack(first, writer)
        # The long-lived heap (grpc, starlette, the adapters) is built: without freezing it, every
        # full collection walks it while requests wait (`heap`).
        freeze_heap()
        await self.grpc.start()
        http_socket = reuseport_listener(self._http_host, self._http_port)
        http_task = asyncio.create_task(self.http.serve(sockets=[http_socket]))
        while not self.http.started:
            if http_task.done():
                http_task.result()
                raise OSError("the HTTP inference listener stopped during start-up")
            await asyncio.sleep(0.005)
        await channel.send(writer, channel.Listening(os.getpid()))
        log.info("frontend %d (pid %d) listening", self.index, os.getpid())
        follower = asyncio.create_task(self._follow(reader, writer, stop))
        await stop.wait()
        await self._drain(http_task, writer)
        follower.cancel()
        writer.close()
        return 0

    async def _drain(self, http_task: asyncio.Task[None], writer: asyncio.StreamWriter) -> None:
        """The ordered drain: not ready, refuse new calls, answer every accepted one, close.

        A call is accepted when its head is in (HTTP) or its metadata (gRPC), before the drain:
        one still receiving a large body is answered too. New calls are refused, unread, with
        503 + `Connection: close` or UNAVAILABLE for `refuse_seconds`, so load balancers see
        the frontend leave; then the listeners close, each waiting for the calls it accepted
        (uvicorn for its requests, grpc's server.stop for its calls), and only then do the
        batchers stop and the accounting go to the supervisor: it covers every accepted call.
        """
        dp, cfg = self.dataplane, self.cfg
        deadline = time.monotonic() + cfg.grace_seconds

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        dp.start_draining()
        await self.grpc.set_not_serving()
        if not self._orphaned:  # an orphan's ports must go at once: a new server may take them
            await dp.wait_idle(cfg.grace_seconds)
            await asyncio.sleep(min(cfg.refuse_seconds, left()))
        self.http.should_exit = True
        await asyncio.gather(
            self.grpc.stop(grace=max(left(), MIN_GRPC_STOP_S)), http_task, return_exceptions=True
        )
        await dp.close(left())
        log.info("drained: accepted=%d answered=%d ok=%d", dp.accepted, dp.answered, dp.answered_ok)
        with contextlib.suppress(OSError, ConnectionError):
            await channel.send(writer, channel.Drained(dp.accepted, dp.answered, dp.answered_ok))


async def _run(init: channel.FrontendInit, control: socket.socket, records: RecordPipe | None = None) -> int:
    if records is not None:
        records.attach(asyncio.get_running_loop())  # written once per loop turn from now on
    # Built inside the running loop: grpc.aio servers belong to the loop they are created in.
    return await Frontend(init, control).run()


def main(argv: Sequence[str] | None = None) -> int:
    parent_death.arm_from_env()
    parser = argparse.ArgumentParser(prog="mariner.server.frontend.main")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--log-fd", type=int, help="the record pipe to the supervisor (TorchServe's logs)")
    args = parser.parse_args(argv)
    control = socket.socket(fileno=args.control_fd)
    try:
        init = channel.receive_blocking(control)
    except PeerRefused as exc:
        print(f"frontend: {exc}", file=sys.stderr)
        return 2
    if not isinstance(init, channel.FrontendInit):
        print("frontend: no start message from the supervisor", file=sys.stderr)
        return 2
    setup_logging(init.cfg.log_level)
    records = RecordPipe(args.log_fd) if args.log_fd is not None else None
    if records is not None:  # TorchServe's log lines and this process's log records, to the supervisor
        ts_emit.set_target(records.put_fields)
        logging.getLogger().addHandler(ts_emit.ServerRecords(f"frontend-{init.index}"))
    control.setblocking(False)
    try:
        return event_loop.run(_run(init, control, records))
    except (ServingError, OSError, RuntimeError) as exc:
        logging.getLogger("mariner").error(
            "frontend %d cannot start: %s", init.index, getattr(exc, "message", exc)
        )
        return 2
    finally:
        if records is not None:
            records.close()


if __name__ == "__main__":
    sys.exit(main())
