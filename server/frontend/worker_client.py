"""A frontend's connection to one model worker, usable by the batcher as a `BatchRunner`.

Several batches may be in flight on one connection (the worker merges what waits); each is
matched to its `Result` by id. When the connection drops (the worker died: segfault, abort,
killed for memory or by us) every batch in flight fails with `InstanceFailed`, which the batcher
answers with INTERNAL and a message that says the worker died, and replaces the runner.

A handler's intermediate answers arrive as `Partial` frames before their batch's `Result`: each
goes to the sink its request's adapter opened (`frontend.streams`), at once, whatever the other
requests of the batch do; a request without one gets its parts in front of its final body.
The reader never waits for a sink, so a slow client stalls nobody else on this worker.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from mariner.server.common.batch_policy import InstanceFailed, RunnerRetired
from mariner.server.common.child_process import kill_worker
from mariner.server.contracts import worker_wire as protocol
from mariner.server.contracts.errors import STATUS, Code, ServingError, TorchServeAnswer
from mariner.server.contracts.peer import PeerRefused, check_peer
from mariner.server.contracts.types import InferRequest, InferResult
from mariner.server.contracts.worker_api import WorkerEndpoint
from mariner.server.frontend.streams import (
    BATCH_PROGRESS,
    MAX_HELD_BYTES,
    STREAMS,
    takes_sinks,
    too_much_held,
)

log = logging.getLogger("mariner.worker_connection")

# How long start() waits for the socket file of a worker that said it is ready (it binds before
# saying so, so this only covers a slow file system or a supervisor that forwarded it early).
CONNECT_WAIT_S = 10.0


def worker_died(pid: int) -> ServingError:
    return ServingError(
        Code.INTERNAL,
        f"the model's worker process (pid {pid}) died while running this batch; it is being restarted",
    )


class _Collected:
    """The parts of a request without a sink, joined in front of its final body: what an HTTP
    client reading the whole streamed answer gets (the first part's status and headers)."""

    __slots__ = ("chunks", "first", "held")

    def __init__(self, first: InferResult) -> None:
        self.first = first
        self.chunks: list[bytes] = [first.body]
        self.held = len(first.body)

    def add(self, part: InferResult) -> None:
        if self.ended:
            return
        self.held += len(part.body)
        if self.held > MAX_HELD_BYTES:
            log.warning("intermediate answers dropped: %s", too_much_held(self.held))
            self.first = InferResult(
                body=b"", status=STATUS[Code.INTERNAL].http, phrase=too_much_held(self.held)
            )
            self.chunks = []
            return
        self.chunks.append(part.body)

    @property
    def ended(self) -> bool:
        """An error part (or too much held) is the answer: nothing after it counts."""
        return not 100 <= self.first.status < 400

    def answer(self, final: InferResult) -> InferResult:
        if final.tensors is not None:  # a tensor answer has no body to put parts in front of
            return final
        if self.ended:
            return self.first
        body = b"".join([*self.chunks, final.body])
        return replace(self.first, body=body, model_version=final.model_version)


class WorkerConnection:
    """One worker process (one generation of one instance) as a `BatchRunner`: `run()` sends a
    batch on the worker's socket and awaits it.

    `on_oom(n)` is called with the out-of-memory splits the worker reports, so the frontend
    counts them (`mariner_oom_batch_splits_total`). It counts the batches running (several at
    once for asyncCommunication) so that a retired connection (its worker gone from the
    supervisor's table) closes only once they have their answers.
    """

    def __init__(
        self,
        endpoint: WorkerEndpoint,
        *,
        batch_size: int,
        on_oom: Callable[[int], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.id = endpoint.id
        self.instance = endpoint.instance
        self.generation = endpoint.generation
        self.pid = endpoint.pid
        self.batch_size = batch_size
        self.status = "LOADING"
        self.batches = 0
        self.busy = 0  # batches running on it now
        self.retired = False  # gone from the table: it takes no new batch and closes once idle
        self.load_seconds = endpoint.load_seconds
        self._on_oom = on_oom
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[protocol.Result]] = {}
        self._requests: dict[int, Sequence[InferRequest]] = {}  # the batches in flight
        self._progress: dict[int, Callable[[], None]] = {}  # each batch's BATCH_PROGRESS
        self._collected: dict[tuple[int, int], _Collected] = {}  # (batch, index) -> parts
        self._segments: dict[int, list[protocol.ShmRef]] = {}
        self._sent = protocol.SentSegments()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._read_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect, retrying briefly while the socket file appears, and check that the process
        listening is the worker the supervisor started (our uid, its pid) before any frame."""
        deadline = time.monotonic() + CONNECT_WAIT_S
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(self.endpoint.socket_path)
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if time.monotonic() >= deadline:
                    self.status = "FAILED"
                    raise ServingError(
                        Code.UNAVAILABLE, f"cannot reach the worker of {self.id} (pid {self.pid}): {exc}"
                    ) from exc
                await asyncio.sleep(0.02)
        try:
            check_peer(
                self._writer.get_extra_info("socket"),
                what=f"worker socket {self.endpoint.socket_path}",
                expected_pid=self.pid,
            )
        except PeerRefused as exc:
            self.status = "FAILED"
            self._writer.close()
            log.error("%s", exc)
            raise ServingError(Code.UNAVAILABLE, f"cannot reach the worker of {self.id}: {exc}") from None
        self._read_task = asyncio.get_running_loop().create_task(self._read_loop(), name=f"worker-{self.id}")
        self.status = "READY"

    async def run(self, requests: Sequence[InferRequest]) -> list[InferResult]:
        """Run one batch on the worker; raises ServingError for a whole-batch failure,
        InstanceFailed when the worker is gone and RunnerRetired when it was retired while the
        batcher held it (the batch then goes to another worker)."""
        if self.retired:
            raise RunnerRetired(f"worker {self.id} was retired before it took the batch")
        self.busy += 1
        try:
            return await self._run(requests)
        finally:
            self.busy -= 1
            if self.retired and not self.busy:
                self.close()

    def retire(self) -> None:
        """Its worker left the supervisor's table: close now, or once its running batches end."""
        self.retired = True
        if not self.busy:
            self.close()

    async def _run(self, requests: Sequence[InferRequest]) -> list[InferResult]:
        if self.status != "READY" or self._writer is None:
            raise InstanceFailed(
                f"worker {self.id} (pid {self.pid}) is {self.status}", error=worker_died(self.pid)
            )
        batch_id = next(self._ids)
        fut: asyncio.Future[protocol.Result] = asyncio.get_running_loop().create_future()
        self._pending[batch_id] = fut
        self._requests[batch_id] = requests
        progress = BATCH_PROGRESS.get()
        if progress is not None:
            self._progress[batch_id] = progress
        try:
            refs = await protocol.write_message(
                self._writer, protocol.Batch(batch_id, tuple(requests)), sent=self._sent
            )
            self._segments[batch_id] = refs
            result = await fut
        except (ConnectionError, OSError) as exc:
            self._lost(f"writing failed: {exc!r}")
            raise InstanceFailed(f"worker {self.id} connection lost", error=worker_died(self.pid)) from None
        finally:
            self._pending.pop(batch_id, None)
            self._requests.pop(batch_id, None)
            self._progress.pop(batch_id, None)
            self._sent.discard(self._segments.pop(batch_id, ()))
            collected = self._take_collected(batch_id) if self._collected else None
        if result.oom_splits and self._on_oom is not None:
            self._on_oom(result.oom_splits)
        if result.error is not None:
            if result.error.code == protocol.INSTANCE_FAILED:
                self.status = "FAILED"
                raise InstanceFailed(f"worker {self.id}: {result.error.message}")
            ts = result.error.torchserve
            raise ServingError(
                Code(result.error.code),
                result.error.message,
                torchserve=None if ts is None else TorchServeAnswer(*ts),
            )
        self.batches += 1  # batches answered (describe's count; the hung-batch count of TorchServe's line)
        if collected:
            results = list(result.results)
            for index, parts in collected.items():
                if index < len(results):
                    results[index] = parts.answer(results[index])
            return results
        return list(result.results)

    def _take_collected(self, batch_id: int) -> dict[int, _Collected]:
        mine = [key for key in self._collected if key[0] == batch_id]
        return {key[1]: self._collected.pop(key) for key in mine}

    def _on_partial(self, msg: protocol.Partial) -> None:
        """An intermediate answer: to its request's sink, else collected (module docstring)."""
        requests = self._requests.get(msg.id)
        if requests is None or not 0 <= msg.index < len(requests):
            return  # its batch was answered or abandoned meanwhile
        progress = self._progress.get(msg.id)
        if progress is not None:
            progress()  # the batch's responseTimeout starts again
        req = requests[msg.index]
        sink = STREAMS.get(req.request_id) if takes_sinks(req.protocol) else None
        if sink is not None:
            sink.partial(msg.result)
            return
        key = (msg.id, msg.index)
        parts = self._collected.get(key)
        if parts is None:
            self._collected[key] = _Collected(msg.result)
        else:
            parts.add(msg.result)

    async def _read_loop(self) -> None:
        assert self._reader is not None
        why = "the worker closed the connection"
        try:
            while True:
                msg = await protocol.read_message(self._reader)
                if isinstance(msg, protocol.Partial):
                    self._on_partial(msg)
                    continue
                if not isinstance(msg, protocol.Result):
                    raise protocol.FrameError(f"unexpected message {type(msg).__name__}")
                fut = self._pending.get(msg.id)
                self._requests.pop(msg.id, None)  # answered: a part that follows is dropped
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except asyncio.CancelledError:
            why = "closed"
            raise
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception as exc:  # a bad frame or an undecodable result: this worker is unusable
            why = f"bad message: {exc!r}"
            log.exception("worker %s sent a bad message", self.id)
        finally:
            self._lost(why)

    def _lost(self, why: str) -> None:
        if self.status == "READY":
            log.error("worker %s (pid %d): %s", self.id, self.pid, why)
            self.status = "FAILED"
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(
                    InstanceFailed(f"worker {self.id} (pid {self.pid}): {why}", error=worker_died(self.pid))
                )
        self._pending.clear()
        self._collected.clear()
        self._sent.release()  # batches the worker will never read
        if self._writer is not None:
            self._writer.close()

    def abandon(self) -> None:
        """The hung-batch path: SIGKILL the worker now (no thread, no CPU left behind) and close."""
        self.retired = True
        kill_worker(self.pid)
        self.close(status="FAILED")

    def close(self, status: str = "STOPPED") -> None:
        self.status = status
        if self._read_task is not None:
            self._read_task.cancel()
        self._lost("closed")
