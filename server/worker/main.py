"""A model worker process: `python -m mariner.server.worker.main [SPEC.json]` (spec on stdin
when no path is given).

It puts only its archive's directory on `sys.path`, loads the handler (a `ModelHost`), listens
on the spec's Unix socket, and writes one JSON line to its ready pipe (`--ready-fd N`; without
it, its stdout, which then points at stderr): `{"ready": true, "pid", "device",
"load_seconds"}`, or `{"ready": false, "error"}` followed by exit code 3 when loading failed.
Its stdout and stderr are the handler's, line-buffered, and its own log goes to stdout in
TorchServe's backend format (the bare message): the supervisor reads
both as TorchServe's frontend reads a backend's (`compat.torchserve.logs.worker_output`).

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
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NoReturn

from mariner.server.contracts.worker_api import (
    EXIT_INSTANCE_ENDED,
    EXIT_LOAD_FAILED,
    WorkerSpec,
    spec_from_json,
)
from mariner.server.worker.frontend_link import FrontendLink
from mariner.server.worker.handler_call import HandlerCall

log = logging.getLogger("mariner.worker")

_PARENT_POLL_S = 1.0
# Calls of a coroutine handler running at once in one worker (each a merged batch); what
# arrives beyond waits in the worker's queue.
MAX_CONCURRENT_CALLS = 256


def isolate_sys_path(model_dir: str) -> None:
    """Make `model_dir` the only place model code imports from: drop the current directory and the
    script's directory (which `-m` and `-c` put first) and put the archive's directory first, then
    the requirements pip installed for it (install_py_dep_per_model), before site-packages."""
    from mariner.server.common.archive import requirements_dir

    cwd = os.getcwd()
    deps = str(requirements_dir(Path(model_dir)))
    kept = [p for p in sys.path if p not in ("", ".", cwd, model_dir, deps)]
    sys.path[:] = [model_dir, *([deps] if os.path.isdir(deps) else []), *kept]


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
        from mariner.server.common.model_settings import token_settings

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


def _ready_stream(ready_fd: int) -> IO[str]:
    """The ready line's stream: its own pipe (no child of the handler inherits it), or, given
    fd 1, the real stdout kept for that line alone while fd 1 then points at stderr, so whatever
    the handler prints lands in the log, not in the parent's ready-line reader. Either way the
    handler's stdout and stderr are line-buffered: a `print()` reaches the log when made."""
    if ready_fd == 1:
        ready = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    else:
        os.set_inheritable(ready_fd, False)
        ready = os.fdopen(ready_fd, "w")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    return ready


def _load(spec: WorkerSpec) -> tuple[Any, float]:
    from mariner.server.common.archive import ModelArchive
    from mariner.server.worker.runner import ModelHost, Placement
    from mariner.server.worker.torchvision_ops import ensure_torchvision_importable

    ensure_torchvision_importable()  # before the handler imports torchvision (ts's vision handlers do)
    archive = ModelArchive(
        name=spec.model,
        version=spec.version,
        path=Path(spec.archive_file),
        sha256=spec.sha256,
        model_dir=Path(spec.model_dir),
        manifest=spec.manifest,
        model_config=spec.model_config,
    )
    host = ModelHost(
        archive,
        id=spec.id,
        placement=Placement(
            gpu_id=spec.gpu_id, torch_threads=spec.torch_threads, require_gpu=spec.require_gpu
        ),
        batch_size=spec.batch_size,
    )
    return host, host.load()


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from mariner.server.common import parent_death

    parent_death.arm_from_env()
    parser = argparse.ArgumentParser(prog="mariner.server.worker.main")
    parser.add_argument("spec", nargs="?", help="the WorkerSpec as JSON (default: stdin)")
    parser.add_argument("--ready-fd", type=int, default=1, help="where the ready line goes (default: stdout)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    spec = spec_from_json(Path(args.spec).read_text() if args.spec else sys.stdin.read())
    return run_worker(spec, args.ready_fd)


def _event_loop_runner() -> Any:
    """uvloop's `run` where it is installed (it ships with uvicorn[standard]): its socket reads
    and writes and its cross-thread wake-up cost less CPU per batch than asyncio's selector loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it
        return asyncio.run
    return uvloop.run


def run_worker(spec: WorkerSpec, ready_fd: int = 1) -> NoReturn:
    """Load and serve `spec`, then exit; the ready line goes to `ready_fd`. The entry both for a
    fresh interpreter (`main`) and for a child forked by the zygote (`zygote.py`), which has set
    up its fds first."""
    ready_out = _ready_stream(ready_fd)
    # TorchServe's backend logs the bare message to stdout; its frontend adds the time, the
    # worker's name and the level when it logs the line (here the supervisor does).
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s", force=True)
    isolate_sys_path(spec.model_dir)
    # SIGINT is not how a worker is stopped (the supervisor or its runner sends SIGTERM) and a
    # worker has its own session, so no terminal sends it one. Set it explicitly rather than
    # inherit it: a fresh interpreter started from a background job inherits SIG_IGN, one from
    # a terminal gets KeyboardInterrupt, and a zygote's fork would get whatever the zygote had.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        host, load_seconds = _load(spec)
    except BaseException as exc:  # noqa: BLE001 - any failure to load is reported, then exit 3
        from mariner.server.contracts.errors import ServingError

        ours = exc if isinstance(exc, ServingError) else None  # one check: narrowed for mypy
        reason = ours.message if ours is not None else f"{type(exc).__name__}: {exc}"
        if ours is not None:
            log.error("worker %s: loading failed: %s", spec.id, reason)
        else:  # the traceback says what was raised; the supervisor's line points here
            log.error("worker %s: loading the handler failed", spec.id, exc_info=True)
        ready = {"ready": False, "error": reason[:2000], "traceback": ours is None}
        ready_out.write(json.dumps(ready) + "\n")
        ready_out.flush()
        _end(EXIT_LOAD_FAILED)
    worker = Worker(spec, host)
    from mariner.server.compat.torchserve.metrics import record_worker_load

    record_worker_load(spec.ts_name, load_seconds)  # TorchServe's WorkerLoadTime (prometheus mode)
    host.on_oom = worker.count_oom
    # torch and the model leave a large heap of long-lived objects; every batch allocates many
    # short-lived ones, so without freezing the former, each full collection walks them all
    # (tens of ms that every batch in flight waits for).
    gc.collect()
    gc.freeze()
    code = _event_loop_runner()(worker.serve(ready_out, load_seconds))
    if not code:
        # A clean stop lets the handler and its model go first: what they hold is released with
        # them (an AOTInductor package's extracted files are removed only then).
        gc.unfreeze()
        host.unload()
        gc.collect()
    _end(code)


def _end(code: int) -> NoReturn:
    """Exit now, whether the worker served or failed to load: the ready line or the batch in hand
    is written and flushed, so nothing is left to do. Do not wait on threads the handler or torch
    started, nor run the interpreter's finalisation with them alive (the handler's own atexit
    work, a hung thread's join)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
