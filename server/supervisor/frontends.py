"""The frontend processes of `mariner serve` and the model table broadcast to them.

Frontends are fresh interpreters (`python -m mariner.server.frontend.main`), never forks, started
with the supervisor's environment less every secret (the tokens travel in the config over the
control channel) and SIGKILLed by the kernel the moment the supervisor dies, so an orphan never
holds the inference ports (`parent_death`; started from the loop's thread, which lives as long
as the supervisor). A frontend
that dies is restarted with backoff; one that dies before it ever listened fails the start-up.
`publish` sends a new model table to every live frontend and waits (bounded) until each one
applied it, so the supervisor stops a removed worker only after no frontend sends it batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from mariner.server.common import control_channel as channel
from mariner.server.common import parent_death
from mariner.server.common.child_env import child_env
from mariner.server.common.child_process import ChildProcess
from mariner.server.common.config import ServerConfig
from mariner.server.compat.torchserve.tokens import Key
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.worker_api import ModelEntry
from mariner.server.contracts.workflow_dag import WorkflowDag
from mariner.server.supervisor.children import Backoff, mark_dead

log = logging.getLogger("mariner.supervisor")

TABLE_ACK_TIMEOUT_S = 10.0


@dataclass
class _Frontend:
    index: int
    process: ChildProcess | None = None
    writer: asyncio.StreamWriter | None = None
    listening: bool = False
    applied: int = 0
    drained: channel.Drained | None = None


class FrontendPool:
    """The frontend processes: spawn, deliver tables, restart with backoff, stop in order.

    Each frontend inherits one end of a socketpair: its control channel. It gets the config and
    the ports, then every model table (`publish`), and answers Listening, TableApplied (the
    table version it follows) and, when it has drained, its accounting.
    """

    def __init__(
        self,
        cfg: ServerConfig,
        count: int,
        http_port: int,
        grpc_port: int,
        records: Callable[[], int] | None = None,
    ) -> None:
        self.cfg = cfg
        # A new record pipe per frontend start (TorchServe's logs: ts_logs.frontend_pipe); its
        # write end is the frontend's `--log-fd`.
        self._records = records
        self.count = count
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.stopping = False
        self._frontends = [_Frontend(i) for i in range(count)]
        self._tasks: list[asyncio.Task[None]] = []
        # Version 0 is a placeholder a frontend may start on before start-up publishes the
        # models: it keeps the frontend not ready (DataPlane.awaiting_table).
        self._table: channel.ModelTable = channel.ModelTable(0, ())
        # TorchServe's current inference key (None: its token authorization is off), sent with
        # every table; set before start() so that no frontend ever listens without it.
        self.inference_key: Key | None = None
        self._progress = asyncio.Condition()
        self.start_error: str | None = None
        self.drained: list[channel.Drained] = []
        self._readers: set[asyncio.Task[None]] = set()

    def all_up(self) -> bool:
        return all(
            f.listening and f.process is not None and f.process.returncode is None for f in self._frontends
        )

    def pids(self) -> list[int]:
        return [
            f.process.pid for f in self._frontends if f.process is not None and f.process.returncode is None
        ]

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    async def start(self) -> None:
        """Start every frontend; returns once all listen, raises if one cannot start."""
        self._tasks = [
            asyncio.create_task(self._keep_running(f), name=f"frontend-{f.index}") for f in self._frontends
        ]
        async with self._progress:
            await self._progress.wait_for(lambda: self.all_up() or self.start_error is not None)
        if self.start_error is not None:
            raise ServingError(Code.UNAVAILABLE, self.start_error)

    async def _spawn(self, f: _Frontend) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        log_fd = self._records() if self._records is not None else None
        argv = [sys.executable, "-m", "mariner.server.frontend.main", "--control-fd", str(child.fileno())]
        if log_fd is not None:
            argv += ["--log-fd", str(log_fd)]
        try:
            proc = ChildProcess.start(
                argv, pass_fds=(child.fileno(), *(() if log_fd is None else (log_fd,))),
                env=parent_death.env_for_this_parent(child_env()),
            )  # fmt: skip
        finally:
            child.close()
            if log_fd is not None:
                os.close(log_fd)  # the frontend holds the only write end: EOF when it exits
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        f.process, f.writer, f.listening = proc, writer, False
        await channel.send(writer, channel.FrontendInit(self.cfg, f.index, self.http_port, self.grpc_port))
        await channel.send(writer, self._table)
        # Kept referenced: the loop holds tasks only weakly.
        reading = asyncio.create_task(self._read(f, proc, reader), name=f"frontend-{f.index}-channel")
        self._readers.add(reading)
        reading.add_done_callback(self._readers.discard)

    async def _read(self, f: _Frontend, proc: ChildProcess, reader: asyncio.StreamReader) -> None:
        while (msg := await channel.receive(reader)) is not None:
            if f.process is not proc:
                return
            if isinstance(msg, channel.Listening):
                f.listening = True
            elif isinstance(msg, channel.TableApplied):
                f.applied = max(f.applied, msg.version)
            elif isinstance(msg, channel.Drained):
                f.drained = msg
                self.drained.append(msg)
            await self._notify()

    async def _keep_running(self, f: _Frontend) -> None:
        backoff = Backoff()
        first = True
        while not self.stopping:
            started = time.monotonic()
            try:
                await self._spawn(f)
            except OSError as exc:
                self.start_error = f"cannot start frontend {f.index}: {exc}"
                await self._notify()
                return
            assert f.process is not None
            log.info("frontend %d started (pid %d)", f.index, f.process.pid)
            rc = await f.process.wait()
            mark_dead(f.process.pid)
            await self._notify()
            if self.stopping:
                return
            if first and not f.listening:
                self.start_error = f"frontend {f.index} exited with {rc} before listening (see its log above)"
                await self._notify()
                return
            first = False
            delay = backoff.after_run(time.monotonic() - started)
            log.error(
                "frontend %d (pid %d) exited with %s; restarting in %.1f s", f.index, f.process.pid, rc, delay
            )
            f.listening = False
            await backoff.wait()

    async def publish(
        self, entries: tuple[ModelEntry, ...], workflows: tuple[WorkflowDag, ...] | None = None
    ) -> None:
        """Send the table (with `workflows`, the last ones sent when None) to every frontend;
        wait (bounded) until the live ones applied it."""
        kept = self._table.workflows if workflows is None else workflows
        self._table = channel.ModelTable(self._table.version + 1, entries, self.inference_key, kept)
        version = self._table.version
        for f in self._frontends:
            if f.writer is not None and f.process is not None and f.process.returncode is None:
                with contextlib.suppress(OSError, ConnectionError):
                    await channel.send(f.writer, self._table)

        def applied() -> bool:
            return all(
                f.applied >= version
                for f in self._frontends
                if f.listening and f.process is not None and f.process.returncode is None
            )

        async with self._progress:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait_for(applied), TABLE_ACK_TIMEOUT_S)

    async def set_inference_key(self, key: Key) -> None:
        """Send the new key to every frontend with the current table; returns once the live
        ones applied it (bounded, as every table)."""
        self.inference_key = key
        await self.publish(self._table.entries)

    async def stop(self, wait_s: float) -> None:
        """SIGTERM every frontend (each drains), wait for them, SIGKILL any left after `wait_s`."""
        self.stopping = True
        procs = [f.process for f in self._frontends if f.process is not None and f.process.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        done, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=wait_s)
        for p in procs:
            if p.returncode is None:
                log.error("frontend pid %d did not stop within %.0f s; killing it", p.pid, wait_s)
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
            mark_dead(p.pid)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for f in self._frontends:
            if f.writer is not None:
                f.writer.close()
