"""Run a real MarinerServer in a background thread with its own event loop, all ports 0.

Integration tests talk to it over real sockets (gRPC and HTTP) exactly like clients do.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from mariner.server.app import BoundPorts, MarinerServer
from mariner.server.config import ServerConfig


class InProcessMariner:
    def __init__(self, model_store: Path, models: str, **overrides: Any) -> None:
        self.cfg = replace(
            ServerConfig(),
            model_store=model_store,
            models=models,
            inference_address="127.0.0.1:0",
            management_address="127.0.0.1:0",
            metrics_address="127.0.0.1:0",
            grpc_inference_address="127.0.0.1:0",
            grpc_management_address="127.0.0.1:0",
            **overrides,
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mariner-test-loop", daemon=True)
        self.server: MarinerServer | None = None
        self.ports: BoundPorts | None = None

    def call(self, coro: Any, timeout: float = 300.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, *, load: bool = True) -> InProcessMariner:
        self.thread.start()

        async def make() -> MarinerServer:
            return MarinerServer(self.cfg)

        self.server = self.call(make())
        self.ports = self.call(self.server.start())
        if load:
            self.call(self.server.load())
        return self

    def load(self) -> None:
        assert self.server is not None
        self.call(self.server.load())

    def stop(self) -> None:
        if self.server is not None:
            self.call(self.server.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def http(self) -> str:
        assert self.ports is not None
        return f"http://127.0.0.1:{self.ports.inference}"

    @property
    def management(self) -> str:
        assert self.ports is not None
        return f"http://127.0.0.1:{self.ports.management}"

    @property
    def metrics(self) -> str:
        assert self.ports is not None
        return f"http://127.0.0.1:{self.ports.metrics}"

    @property
    def grpc_target(self) -> str:
        assert self.ports is not None
        return f"127.0.0.1:{self.ports.grpc_inference}"

    @property
    def grpc_management_target(self) -> str:
        assert self.ports is not None
        return f"127.0.0.1:{self.ports.grpc_management}"
