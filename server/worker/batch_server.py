"""The model worker's server: `Worker` serves one loaded `ModelHost` on the worker's Unix socket
to every frontend that connects, and ends itself when its parent is gone.

One thread: the handler is loaded and called on the main thread, which also runs the worker's
event loop, so its CUDA stream and thread-local torch state (OpenMP's thread count is set per
thread) stay put. The loop reads frames only between batches: a handler thread beside the loop
cost 78-94 µs of CPU per request at batch 32 over the handler's own work (the two threads
handing the GIL back and forth while frames arrived), against 2-27 µs on one thread, which
serves 10-86% more requests per second (`python -m mariner.loadtest.experiments.worker_overhead`). The
handler is called with no running loop, as TorchServe calls it from a plain thread: one that
runs `asyncio.run` itself still works.

Batches from every connection wait in one queue; when the handler is free the worker takes what
waits, merges batches up to `batch_size` items into one handler call and splits the results back
per batch. SIGTERM: finish the batch in hand, exit 0.

A coroutine handler (`async def handle`) is awaited on the loop instead, as TorchServe's
asyncCommunication worker runs it: each merged batch becomes a task, up to
`MAX_CONCURRENT_CALLS` at once, so one call's awaits let others run.

Intermediate answers (`send_intermediate_predict_response`) go to the frontend that sent the
request as `protocol.Partial` frames while the handler runs, ahead of the batch's `Result`; with
the loop busy in a plain handler they are written before the handler's call returns, or, sent
from another of its threads while the frontend is behind, as it returns (`handler_call.py`).

Apart from `main.py`, which makes the process (command line, ready line, logging, `sys.path`,
loading the handler, exit) and hands the loaded host to this loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from mariner.server.contracts.worker_api import EXIT_INSTANCE_ENDED, WorkerSpec
from mariner.server.worker.frontend_link import FrontendLink
from mariner.server.worker.handler_call import HandlerCall

log = logging.getLogger("mariner.worker")

_PARENT_POLL_S = 1.0
# Calls of a coroutine handler running at once in one worker (each a merged batch); what
# arrives beyond waits in the worker's queue.
MAX_CONCURRENT_CALLS = 256


@dataclass
class _Job:
    conn: FrontendLink
    batch: Any  # protocol.Batch
    items: int = field(default=0)
    solo: bool = False  # a describe call: its own handler call, never merged with a batch


class Worker:
    """Serves one loaded `ModelHost` on a Unix socket to every frontend that connects."""

    def __init__(self, spec: WorkerSpec, host: Any) -> None:
        self.spec = spec
        self.host = host
        self._jobs: deque[_Job] = deque()
        self._wake = asyncio.Event()
        self._stopping = False
        self._conns: set[FrontendLink] = set()
        self._oom_splits = 0
        self.exit_code = 0
        self._calls: set[asyncio.Task[None]] = set()  # a coroutine handler's calls in flight
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.get_ident()
        from mariner.server.common.archive_settings import token_settings

        # Batches merged from several frontends keep the model's token budget too (each frontend
        # formed its own within it; two of them together may not fit).
        tokens = token_settings(spec.model_config, spec.archive_file)
        self._max_batch_tokens = tokens.max_batch_tokens if tokens is not None else None
        from mariner.server.common.metrics import WorkerGpuGauge

        self._gpu_gauge = WorkerGpuGauge(host.placement.gpu_id)

    def count_oom(self) -> None:  # called from inside run_batch; read after the call returns
        self._oom_splits += 1

    async def serve(self, ready_out: IO[str], load_seconds: float) -> int:
        loop = self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        path = self.spec.socket_path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a stale socket of an earlier worker
        server = await loop.create_unix_server(self._new_link, path=path)
        os.chmod(path, 0o600)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        parent = os.getppid()
        watchdog = loop.create_task(self._watch_parent(parent))
        ready_out.write(
            json.dumps(
                # The device it really runs on (a GPU placement may have fallen back to the CPU).
                {
                    "ready": True,
                    "pid": os.getpid(),
                    "device": self.host.placement.device,
                    "load_seconds": load_seconds,
                }  # fmt: skip
            )
            + "\n"
        )
        ready_out.flush()
        ready_out.close()
        try:
            await self._dispatch()
        finally:
            watchdog.cancel()
            server.close()
            await self._finish_conns()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return self.exit_code

    async def _finish_conns(self) -> None:
        """Send what is buffered, then end each connection from this side and wait (briefly) for
        the frontend to read to the end and close: only then are unread segments its loss."""
        conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.end()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(c.closed.wait() for c in conns)), 5.0)
        for conn in conns:
            conn.close()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def _watch_parent(self, parent: int) -> None:
        # A worker whose parent died (killed, crashed) would serve nobody and hold its device:
        # it ends itself. start_new_session keeps it out of the parent's process group, so no
        # signal to that group reaches it. The kernel's PDEATHSIG (parent_death) ends it first;
        # this is the backstop: the parent's pidfd turns readable when it exits (a poll of the
        # parent pid where there is no pidfd).
        loop = asyncio.get_running_loop()
        try:
            fd: int | None = os.pidfd_open(parent)
        except (OSError, AttributeError):
            fd = None
        if fd is not None:
            gone: asyncio.Future[None] = loop.create_future()

            def exited() -> None:
                if not gone.done():
                    gone.set_result(None)

            loop.add_reader(fd, exited)
            try:
                if os.getppid() == parent:  # not already gone (its pid reused) when opened
                    await gone
            finally:
                loop.remove_reader(fd)
                os.close(fd)
        while os.getppid() == parent:
            await asyncio.sleep(_PARENT_POLL_S)
        log.error("worker %s: parent %d is gone; exiting", self.spec.id, parent)
        os._exit(1)

    def _new_link(self) -> FrontendLink:
        link = FrontendLink(f"worker {self.spec.id}", self._on_message, self._conns.discard)
        self._conns.add(link)
        return link

    def _on_message(self, conn: FrontendLink, msg: Any) -> None:
        from mariner.server.contracts import worker_wire as protocol

        if isinstance(msg, protocol.Describe):
            self._jobs.append(_Job(conn, protocol.Batch(msg.id, (msg.request,)), 1, solo=True))
        elif isinstance(msg, protocol.Batch):
            self._jobs.append(_Job(conn, msg, sum(r.items for r in msg.requests)))
        else:
            log.error("worker %s: dropping a connection that sent %s", self.spec.id, type(msg).__name__)
            conn.close()
            return
        self._wake.set()

    def _take(self) -> list[_Job]:
        """What waits, merged up to batch_size items and the token budget (always at least one
        batch)."""
        from mariner.server.common.token_groups import padded_tokens

        jobs: list[_Job] = []
        items = 0
        costs: list[Any] = []  # the merged requests' TokenCosts, when the model has a budget
        while self._jobs:
            job = self._jobs[0]
            if not job.conn.open:
                self._jobs.popleft()
                continue
            more = [r.tokens for r in job.batch.requests] if self._max_batch_tokens is not None else []
            if None in more:  # not counted (a frontend without the counter): no budget to keep
                more = []
            over = bool(more) and padded_tokens(costs + more) > (self._max_batch_tokens or 0)
            if jobs and (job.solo or items + job.items > self.spec.batch_size or over):
                break
            jobs.append(self._jobs.popleft())
            items += job.items
            costs += more
            if job.solo:
                break
        return jobs

    async def _dispatch(self) -> None:
        concurrent = bool(self.host.is_async)
        while not self._stopping and not self.exit_code:
            jobs = self._take() if len(self._calls) < MAX_CONCURRENT_CALLS else []
            if not jobs:
                self._wake.clear()
                await self._wake.wait()
                continue
            requests = [r for job in jobs for r in job.batch.requests]
            call = HandlerCall(
                jobs,
                what=f"worker {self.spec.id}",
                loop=self._loop,
                loop_thread=self._thread,
                loop_blocked=not concurrent,  # a plain handler runs with the loop hidden
            )
            if concurrent:
                task = asyncio.get_running_loop().create_task(self._run_async(call, requests))
                self._calls.add(task)
                task.add_done_callback(self._call_ended)
                await _one_turn()
                continue
            outcome: Any
            try:
                outcome = call_off_loop(self.host.run_batch, requests, call.deliver)
            except BaseException as exc:  # noqa: BLE001 - every failure is answered per batch
                outcome = exc
            call.finish()  # parts its other threads left go before the Result
            self._answer(jobs, outcome)
            self._gpu_gauge.sample()
            if self.exit_code:
                return
            await _one_turn()
        if self._calls:  # stopping: the calls in flight are answered first
            await asyncio.gather(*self._calls, return_exceptions=True)

    async def _run_async(self, call: HandlerCall, requests: list[Any]) -> None:
        """One call of a coroutine handler, awaited on the loop beside the others."""
        outcome: Any
        try:
            outcome = await self.host.run_batch_async(requests, call.deliver)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - every failure is answered per batch
            outcome = exc
        call.finish()
        self._answer(call.jobs, outcome)
        self._gpu_gauge.sample()

    def _call_ended(self, task: asyncio.Task[None]) -> None:
        self._calls.discard(task)
        self._wake.set()

    def _answer(self, jobs: Sequence[_Job], outcome: Any) -> None:
        from mariner.server.common.batch_policy import InstanceFailed
        from mariner.server.contracts import worker_wire as protocol
        from mariner.server.contracts.errors import ServingError

        # Counted since the last answer (calls of a coroutine handler overlap: each split is
        # reported once, with whichever answer goes next).
        splits, self._oom_splits = self._oom_splits, 0
        error: protocol.BatchError | None = None
        if isinstance(outcome, ServingError):
            ts = outcome.torchserve
            error = protocol.BatchError(
                outcome.code.value, outcome.message, None if ts is None else (ts.status, ts.type, ts.message)
            )
        elif isinstance(outcome, InstanceFailed):
            error = protocol.BatchError(protocol.INSTANCE_FAILED, str(outcome))
            self.exit_code = EXIT_INSTANCE_ENDED
        elif isinstance(outcome, BaseException):
            log.error("worker %s: batch failed: %r", self.spec.id, outcome)
            error = protocol.BatchError(
                "internal", "internal error while running the batch; see the server log"
            )
        start = 0
        for n, job in enumerate(jobs):
            if error is None:
                count = len(job.batch.requests)
                msg = protocol.Result(job.batch.id, tuple(outcome[start : start + count]))
                start += count
            else:
                msg = protocol.Result(job.batch.id, error=error)
            if n == 0 and splits:
                msg = protocol.Result(msg.id, msg.results, msg.error, oom_splits=splits)
            if not job.conn.open:
                continue
            try:
                frame, refs = protocol.encode(msg)
            except Exception:
                log.exception("worker %s: cannot encode the results of a batch", self.spec.id)
                frame, refs = protocol.encode(
                    protocol.Result(
                        msg.id,
                        error=protocol.BatchError("internal", "internal error while returning results"),
                    )
                )
            job.conn.send(frame, refs)


def call_off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Call `fn` on the loop's thread as if no loop ran here. TorchServe calls a handler from a
    plain thread, and handlers rely on that: one that calls `asyncio.run` or a fresh loop's
    `run_until_complete` would otherwise fail with "cannot be called from a running event loop"."""
    running = asyncio.events._get_running_loop()
    asyncio.events._set_running_loop(None)
    try:
        return fn(*args)
    finally:
        asyncio.events._set_running_loop(running)


async def _one_turn() -> None:
    """Let the loop poll its sockets once, so frames that arrived during the batch are jobs before
    the next take. uvloop runs I/O callbacks between two turns of ready callbacks (one sleep is
    enough); asyncio's own loop runs them after the ready callbacks of the same turn (two)."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)
